"""mk.text.tokenizer_files: the built-in tokenizer's training, its special tokens, and the chat template
written beside a checkpoint (rendered as HF's apply_chat_template would)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mk.config import ModelConfig
from mk.model import synthetic_weights, write_checkpoint
from mk.text.tokenizer_files import (
    BOS_ID,
    EOS,
    EOS_ID,
    MIN_VOCAB,
    SPECIAL_TOKENS,
    TemplateError,
    build_tokenizer,
    render_chat,
)

CFG = ModelConfig.tiny()


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(CFG.vocab_size)


def test_tokenizer_fits_and_round_trips(tok) -> None:
    assert tok.get_vocab_size() == CFG.vocab_size
    assert build_tokenizer(CFG.vocab_size).to_str() == tok.to_str()
    assert build_tokenizer(32768).get_vocab_size() <= 32768
    with pytest.raises(ValueError, match="too small"):
        build_tokenizer(MIN_VOCAB - 1)
    text = 'def f(x):\n\treturn {"k": x ** 2}  # héllo, 世界 🙂\n'
    ids = tok.encode(text, add_special_tokens=False).ids
    assert len(ids) < len(text.encode())  # merges were learned
    assert tok.decode(ids) == text
    assert tok.encode(text).ids == [BOS_ID, *ids]  # add_special_tokens adds BOS only


def test_special_tokens_single_ids(tok) -> None:
    assert tok.token_to_id(EOS) == EOS_ID == CFG.eos_token_id
    for i, token in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(token) == i
        assert tok.encode(f"a{token}b", add_special_tokens=False).ids == [
            tok.token_to_id("a"),
            i,
            tok.token_to_id("b"),
        ]
    assert tok.decode([4, 5], skip_special_tokens=False) == "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>"


def test_chat_template_user_and_generation_prompt(tok, tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "ckpt", CFG, synthetic_weights(CFG), tokenizer=tok)
    tc = json.loads((path / "tokenizer_config.json").read_text())
    assert tc["bos_token"] == "<BOS_TOKEN>" and tc["eos_token"] == EOS
    assert tc["added_tokens_decoder"][str(EOS_ID)]["content"] == EOS
    s = render_chat([{"role": "user", "content": "Hi!"}], add_generation_prompt=True, chat_template=tc["chat_template"])
    assert s == (
        "<BOS_TOKEN><|START_OF_TURN_TOKEN|><|USER_TOKEN|>Hi!<|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_THINKING|>"
    )
    ids = tok.encode(s, add_special_tokens=False).ids
    assert ids[:3] == [BOS_ID, 4, 5] and ids[-4:] == [EOS_ID, 4, 6, 8]
    off = render_chat([{"role": "user", "content": "Hi!"}], add_generation_prompt=True, enable_thinking=False)
    assert off.endswith("<|CHATBOT_TOKEN|><|START_THINKING|><|END_THINKING|>")
    assert not render_chat([{"role": "user", "content": "Hi!"}]).endswith("<|CHATBOT_TOKEN|><|START_THINKING|>")


def test_chat_template_tool_conversation() -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather for a <city>",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris and Zürich?"}]},
        {
            "role": "assistant",
            "content": "Look both up.",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
        {"role": "assistant", "content": "Paris sunny, Zürich rain.", "reasoning": "Summarise."},
        {"role": "user", "content": "Thanks"},
    ]
    s = render_chat(messages, tools=tools, add_generation_prompt=True, tool_choice="required")
    system, rest = s.split("<|END_OF_TURN_TOKEN|>", 1)
    assert system.startswith("<BOS_TOKEN><|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>Be brief.\n\n# Available Tools")
    assert "You must call at least one tool." in system
    listed = json.loads(system.split("```json\n")[1].split("\n```")[0])
    assert listed == [{"name": "get_weather", **{k: v for k, v in tools[0]["function"].items() if k != "name"}}]
    assert rest == (
        "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>Weather in Paris and Zürich?<|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_THINKING|>Look both up.<|END_THINKING|><|START_ACTION|>"
        '[{"tool_call_id": "c1", "tool_name": "get_weather", "parameters": {"city": "Paris"}}, '
        '{"tool_call_id": "c2", "tool_name": "get_weather", "parameters": {"city": "Zürich"}}]'
        "<|END_ACTION|><|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|><|START_TOOL_RESULT|>"
        '[{"tool_call_id": "c1", "results": {"0": "sunny"}}, '
        '{"tool_call_id": "c2", "results": {"0": "rain"}}]<|END_TOOL_RESULT|><|END_OF_TURN_TOKEN|>'
        "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_THINKING|>Summarise.<|END_THINKING|>"
        "<|START_RESPONSE|>Paris sunny, Zürich rain.<|END_RESPONSE|><|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>Thanks<|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_THINKING|>"
    )
    named = render_chat(
        messages[1:2], tools=tools, tool_choice={"type": "function", "function": {"name": "get_weather"}}
    )
    assert named.startswith("<BOS_TOKEN><|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|># Available Tools")
    assert "You must call the tool get_weather." in named
    with pytest.raises(TemplateError, match="unsupported message role: robot"):
        render_chat([{"role": "robot", "content": "beep"}])
