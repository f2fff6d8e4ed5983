"""A small byte-level BPE tokenizer and a Cohere-format chat template, for test checkpoints and the
embedded default model (the real checkpoint ships its own `tokenizer.json` and template).

Special tokens sit at fixed ids 0..17 in the order of `SPECIAL_TOKENS`:

     0 <PAD>                      6 <|CHATBOT_TOKEN|>       12 <|START_ACTION|>
     1 <UNK>                      7 <|SYSTEM_TOKEN|>        13 <|END_ACTION|>
     2 <|END_OF_TURN_TOKEN|> EOS  8 <|START_THINKING|>      14 <|START_TOOL_RESULT|>
     3 <BOS_TOKEN>                9 <|END_THINKING|>        15 <|END_TOOL_RESULT|>
     4 <|START_OF_TURN_TOKEN|>   10 <|START_RESPONSE|>      16 <|START_TEXT|>
     5 <|USER_TOKEN|>            11 <|END_RESPONSE|>        17 <|END_TEXT|>

EOS is id 2 because the tiny, GPU-test and embedded geometries use `eos_token_id=2`. Then come the 256 byte
symbols, then BPE merges. `build_tokenizer` learns them from a few stdlib modules' source (so the merges
depend on the Python version's stdlib; training is deterministic and takes a few tens of ms): with a large
requested size it stops where that text runs out of pairs (about 3,900 tokens). `train_tokenizer` learns
them from a given corpus (scripts/train_embedded.py uses it for the embedded model). The vocabulary never
exceeds the requested size. Encoding with `add_special_tokens=True` prepends `<BOS_TOKEN>`; nothing adds EOS.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterable
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from mk.text.tokenizer import TemplateError, render_template

__all__ = ["TemplateError", "build_tokenizer", "render_chat", "tokenizer_config", "train_tokenizer"]

PAD = "<PAD>"
UNK = "<UNK>"
EOS = "<|END_OF_TURN_TOKEN|>"
BOS = "<BOS_TOKEN>"

SPECIAL_TOKENS: tuple[str, ...] = (
    PAD,
    UNK,
    EOS,
    BOS,
    "<|START_OF_TURN_TOKEN|>",
    "<|USER_TOKEN|>",
    "<|CHATBOT_TOKEN|>",
    "<|SYSTEM_TOKEN|>",
    "<|START_THINKING|>",
    "<|END_THINKING|>",
    "<|START_RESPONSE|>",
    "<|END_RESPONSE|>",
    "<|START_ACTION|>",
    "<|END_ACTION|>",
    "<|START_TOOL_RESULT|>",
    "<|END_TOOL_RESULT|>",
    "<|START_TEXT|>",
    "<|END_TEXT|>",
)
SPECIAL_IDS: dict[str, int] = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
PAD_ID, UNK_ID, EOS_ID, BOS_ID = 0, 1, 2, 3

# Smallest vocabulary that holds the special tokens and all 256 byte symbols.
MIN_VOCAB = len(SPECIAL_TOKENS) + 256

# Context length written to tokenizer_config.json.
MODEL_MAX_LENGTH = 131072


def _training_text() -> list[str]:
    import argparse
    import difflib
    import string
    import textwrap

    text = "".join(inspect.getsource(m) for m in (textwrap, difflib, string, argparse))
    return [text[i : i + 4096] for i in range(0, len(text), 4096)]


def train_tokenizer(texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> Tokenizer:
    """A byte-level BPE tokenizer with at most `vocab_size` tokens trained on `texts`: the special tokens at
    their fixed ids (SPECIAL_IDS), then the 256 byte symbols, then merges. Deterministic for the same texts.
    Encoding with `add_special_tokens=True` prepends `<BOS_TOKEN>`."""
    if vocab_size < MIN_VOCAB:
        raise ValueError(f"vocab_size {vocab_size} is too small for a byte-level tokenizer (need {MIN_VOCAB})")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, BOS_ID)]
    )
    for token, i in SPECIAL_IDS.items():
        if tok.token_to_id(token) != i:
            raise AssertionError(f"tokenizer training put {token} at {tok.token_to_id(token)}, not {i}")
    return tok


@functools.lru_cache(maxsize=8)
def _trained(vocab_size: int) -> str:
    return train_tokenizer(_training_text(), vocab_size).to_str()


def build_tokenizer(vocab_size: int) -> Tokenizer:
    """The built-in test tokenizer: `train_tokenizer` on a few stdlib modules (cached training, new object)."""
    if vocab_size < MIN_VOCAB:
        raise ValueError(f"vocab_size {vocab_size} is too small for a byte-level tokenizer (need {MIN_VOCAB})")
    return Tokenizer.from_str(_trained(vocab_size))


# ---- chat template ------------------------------------------------------------------------------
#
# Variables: messages, tools (OpenAI {"type": "function", "function": {...}} or bare {name, ...}),
# tool_choice ("none" | "required" | {"type": "function", "function": {"name": ...}}; "auto" or absent: no
# instruction), add_generation_prompt, enable_thinking (default true), bos_token.
#
# Layout (all special tokens are single ids):
#   <BOS_TOKEN>
#   [<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>{first system message}{tools preamble}<|END_OF_TURN_TOKEN|>]
#   user:       <|START_OF_TURN_TOKEN|><|USER_TOKEN|>{text}<|END_OF_TURN_TOKEN|>
#   system:     <|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>{text}<|END_OF_TURN_TOKEN|>       (later ones)
#   assistant:  <|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_THINKING|>{reasoning}<|END_THINKING|>
#               then <|START_RESPONSE|>{content}<|END_RESPONSE|>
#               or, with tool calls, <|START_ACTION|>[{"tool_call_id": id, "tool_name": name,
#               "parameters": {...}}, ...]<|END_ACTION|> (the content, if any, is the thinking "plan"
#               when there is no separate reasoning), then <|END_OF_TURN_TOKEN|>
#   tool:       consecutive tool messages share one system turn:
#               <|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|><|START_TOOL_RESULT|>[{"tool_call_id": id,
#               "results": {"0": content}}, ...]<|END_TOOL_RESULT|><|END_OF_TURN_TOKEN|>
#   prompt:     <|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_THINKING|>  (+<|END_THINKING|> if thinking off)
#
# Assistant turns always carry a thinking block (empty without reasoning) so history looks like what the
# generation prompt makes the model write. Tool-call ids are the OpenAI ids, verbatim ("0", "1", ... when a
# call has none); tool results quote the same ids. String `arguments` are inserted as given (they are
# JSON text); mappings go through `tojson`, which must not HTML-escape (HF's does not; see render_chat).

CHAT_TEMPLATE = r"""
{%- macro text(content) -%}
  {%- if content is none -%}
  {%- elif content is string -%}{{ content }}
  {%- else -%}
    {%- for part in content -%}
      {%- if part is string -%}{{ part }}{%- else -%}{{ part['text'] }}{%- endif -%}
    {%- endfor -%}
  {%- endif -%}
{%- endmacro -%}
{%- macro tool_json(tool) -%}
  {%- set f = tool['function'] if tool['function'] is defined else tool -%}
  {"name": {{ f['name'] | tojson }}, "description": {{ (f['description'] or '') | tojson -}}
  , "parameters": {{ (f['parameters'] or {}) | tojson }}}
{%- endmacro -%}
{%- set ns = namespace(system='', start=0) -%}
{%- if messages and messages[0]['role'] == 'system' -%}
  {%- set ns.system = text(messages[0]['content']) -%}
  {%- set ns.start = 1 -%}
{%- endif -%}
{{- bos_token -}}
{%- if ns.system or tools -%}
  {{- '<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>' + ns.system -}}
  {%- if tools -%}
    {%- if ns.system -%}{{- '\n\n' -}}{%- endif -%}
    {{- '# Available Tools\nYou may call the tools below. To call tools, first write a short plan, then a JSON '
        'list of calls, each {"tool_call_id": "<id>", "tool_name": "<name>", "parameters": {...}}.' -}}
    {%- if tool_choice is defined and tool_choice == 'none' -%}
      {{- ' Do not call any tool now.' -}}
    {%- elif tool_choice is defined and tool_choice == 'required' -%}
      {{- ' You must call at least one tool.' -}}
    {%- elif tool_choice is defined and tool_choice is mapping -%}
      {{- ' You must call the tool ' + tool_choice['function']['name'] + '.' -}}
    {%- endif -%}
    {{- '\n```json\n[' -}}
    {%- for tool in tools -%}
      {{- tool_json(tool) -}}{%- if not loop.last -%}{{- ', ' -}}{%- endif -%}
    {%- endfor -%}
    {{- ']\n```' -}}
  {%- endif -%}
  {{- '<|END_OF_TURN_TOKEN|>' -}}
{%- endif -%}
{%- for message in messages[ns.start:] -%}
  {%- set role = message['role'] -%}
  {%- if role == 'user' -%}
    {{- '<|START_OF_TURN_TOKEN|><|USER_TOKEN|>' + text(message['content']) + '<|END_OF_TURN_TOKEN|>' -}}
  {%- elif role == 'system' -%}
    {{- '<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>' + text(message['content']) + '<|END_OF_TURN_TOKEN|>' -}}
  {%- elif role == 'assistant' -%}
    {%- set calls = message['tool_calls'] if message['tool_calls'] is defined and message['tool_calls'] else [] -%}
    {%- if message['reasoning'] is defined and message['reasoning'] -%}
      {%- set thinking = message['reasoning'] -%}
    {%- elif message['reasoning_content'] is defined and message['reasoning_content'] -%}
      {%- set thinking = message['reasoning_content'] -%}
    {%- elif calls -%}
      {%- set thinking = text(message['content']) -%}
    {%- else -%}
      {%- set thinking = '' -%}
    {%- endif -%}
    {{- '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_THINKING|>' + thinking + '<|END_THINKING|>' -}}
    {%- if calls -%}
      {{- '<|START_ACTION|>[' -}}
      {%- for call in calls -%}
        {%- set f = call['function'] if call['function'] is defined else call -%}
        {%- set id = call['id'] if call['id'] is defined and call['id'] else loop.index0 | string -%}
        {{- '{"tool_call_id": ' + id | tojson + ', "tool_name": ' + f['name'] | tojson + ', "parameters": ' -}}
        {%- if f['arguments'] is string -%}
          {{- f['arguments'] -}}
        {%- else -%}
          {{- f['arguments'] | tojson -}}
        {%- endif -%}
        {{- '}' -}}{%- if not loop.last -%}{{- ', ' -}}{%- endif -%}
      {%- endfor -%}
      {{- ']<|END_ACTION|>' -}}
    {%- else -%}
      {{- '<|START_RESPONSE|>' + text(message['content']) + '<|END_RESPONSE|>' -}}
    {%- endif -%}
    {{- '<|END_OF_TURN_TOKEN|>' -}}
  {%- elif role == 'tool' -%}
    {%- if loop.first or loop.previtem['role'] != 'tool' -%}
      {{- '<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|><|START_TOOL_RESULT|>[' -}}
    {%- else -%}
      {{- ', ' -}}
    {%- endif -%}
    {{- '{"tool_call_id": ' + message['tool_call_id'] | tojson + ', "results": {"0": '
        + text(message['content']) | tojson + '}}' -}}
    {%- if loop.last or loop.nextitem['role'] != 'tool' -%}
      {{- ']<|END_TOOL_RESULT|><|END_OF_TURN_TOKEN|>' -}}
    {%- endif -%}
  {%- else -%}
    {{- raise_exception('unsupported message role: ' + role) -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_THINKING|>' -}}
  {%- if enable_thinking is defined and not enable_thinking -%}{{- '<|END_THINKING|>' -}}{%- endif -%}
{%- endif -%}
""".strip()


def tokenizer_config(chat_template: str = CHAT_TEMPLATE) -> dict[str, Any]:
    """The `tokenizer_config.json` of a tokenizer from `build_tokenizer` (HF PreTrainedTokenizerFast)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": UNK,
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {
            str(i): {
                "content": tok,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for tok, i in SPECIAL_IDS.items()
        },
        "chat_template": chat_template,
    }


def render_chat(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    chat_template: str = CHAT_TEMPLATE,
    bos_token: str = BOS,
    **kwargs: Any,
) -> str:
    """Render a chat template (the built-in one by default) through mk.text.tokenizer's HF-compatible
    environment; extra kwargs (tool_choice, enable_thinking) are template variables."""
    return render_template(
        chat_template,
        messages=messages,
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        bos_token=bos_token,
        **kwargs,
    )
