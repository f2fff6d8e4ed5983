"""mk.tokenizer (encode, token bytes, HF-style chat template) and mk.textstream (incremental
detokenizer, stop strings)."""

import json

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from mk import tokenizer_files
from mk.config import ModelConfig
from mk.model import synthetic_weights, write_checkpoint
from mk.textstream import Detokenizer, StopMatcher
from mk.tokenizer import TemplateError, Tokenizer

TOK = Tokenizer.builtin(512)
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "Weather in "}, "Paris <b>?"]},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "0", "type": "function", "function": {"name": "get", "arguments": '{"q": "<x>"}'}}],
    },
    {"role": "tool", "tool_call_id": "0", "content": "sunny & 20°C"},
]
TOOLS = [{"type": "function", "function": {"name": "get", "description": "a <tool>", "parameters": {"type": "object"}}}]

texts = st.text(st.characters(exclude_categories=("Cs",)), max_size=60)


def test_template_renders_like_the_hf_environment():
    ours = TOK.apply_chat_template(CHAT, TOOLS, add_generation_prompt=True)
    reference = tokenizer_files.render_chat(CHAT, TOOLS, add_generation_prompt=True)
    assert ours == reference
    assert '"<x>"' in ours and "a <tool>" in ours  # tojson must not HTML-escape
    assert ours.startswith("<BOS_TOKEN>") and ours.endswith("<|START_THINKING|>")
    off = TOK.apply_chat_template(CHAT[:2], enable_thinking=False)
    assert off.endswith("<|START_THINKING|><|END_THINKING|>")


def test_template_errors_are_template_errors():
    with pytest.raises(TemplateError, match="unsupported message role"):
        TOK.apply_chat_template([{"role": "robot", "content": "x"}])
    broken = Tokenizer(TOK.hf, {**TOK.config, "chat_template": "{% if %}"})
    with pytest.raises(TemplateError, match="does not compile"):
        broken.apply_chat_template(CHAT)
    none = Tokenizer(TOK.hf, {**TOK.config, "chat_template": None})
    with pytest.raises(TemplateError, match="no chat template"):
        none.apply_chat_template(CHAT)


def test_named_templates_pick_tool_use_when_tools_are_given():
    named = [{"name": "default", "template": "plain"}, {"name": "tool_use", "template": "tools={{ tools | length }}"}]
    tok = Tokenizer(TOK.hf, {**TOK.config, "chat_template": named})
    assert tok.apply_chat_template(CHAT) == "plain"
    assert tok.apply_chat_template(CHAT, TOOLS) == "tools=1"


def test_from_dir_reads_a_written_checkpoint(tmp_path):
    cfg = ModelConfig.tiny()
    write_checkpoint(tmp_path, cfg, synthetic_weights(cfg, std=0.1))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.eos_token_id == cfg.eos_token_id == 2
    assert tok.encode("def f():") == TOK.encode("def f():")
    assert tok.encode("x")[0] == tokenizer_files.BOS_ID
    assert tok.apply_chat_template(CHAT, TOOLS) == TOK.apply_chat_template(CHAT, TOOLS)
    assert set(range(len(tokenizer_files.SPECIAL_TOKENS))) <= tok.special_ids


@settings(max_examples=200, deadline=None)
@given(texts)
def test_token_bytes_concatenate_to_the_utf8_text(text):
    ids = TOK.encode(text, add_special_tokens=False)
    assert b"".join(TOK.token_bytes(i) for i in ids) == text.encode()


def test_token_bytes_of_special_tokens_are_their_text():
    assert TOK.token_bytes(tokenizer_files.SPECIAL_IDS["<|START_ACTION|>"]) == b"<|START_ACTION|>"


@settings(max_examples=200, deadline=None)
@given(texts, st.booleans())
@example("\ufffd", False)  # the character a split one would show as, in the text itself
def test_detokenizer_pieces_add_up_and_never_break_a_character(text, skip):
    ids = TOK.encode("<|START_RESPONSE|>" + text, add_special_tokens=False)
    d = Detokenizer(TOK, skip_special_tokens=skip)
    pieces = [d.push(i) for i in ids]
    pieces.append(d.flush())
    assert "".join(pieces) == TOK.decode(ids, skip_special_tokens=skip)
    # No piece shows a split character as U+FFFD (the text may hold that character itself).
    assert sum(p.count("\ufffd") for p in pieces) == text.count("\ufffd")


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 511), max_size=40))
def test_detokenizer_on_arbitrary_ids_matches_a_full_decode(ids):
    d = Detokenizer(TOK)
    assert "".join([d.push(i) for i in ids] + [d.flush()]) == TOK.decode(ids)


def test_detokenizer_holds_a_split_emoji_until_it_completes():
    ids = TOK.encode("a😀", add_special_tokens=False)
    assert len(ids) > 2  # the emoji's four bytes come as several tokens
    d = Detokenizer(TOK)
    assert [d.push(i) for i in ids] == ["a"] + [""] * (len(ids) - 2) + ["😀"]


@settings(max_examples=300, deadline=None)
@given(texts, st.lists(st.text("ab\n", min_size=1, max_size=4), min_size=1, max_size=3), st.data())
def test_stop_strings_cut_at_the_first_match_and_never_leak(text, stops, data):
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    m = StopMatcher(stops)
    # Like vLLM: the stream stops at the first chunk that completes a stop string, cut where it starts.
    expected, hit, end = text, False, 0
    for chunk in chunks:
        end += len(chunk)
        starts = [i for s in stops if (i := text[:end].find(s)) >= 0]
        if starts:
            expected, hit = text[: min(starts)], True
            break
    out = ""
    for chunk in chunks:
        out += m.push(chunk)
        assert expected.startswith(out)  # nothing past the cut ever comes out
    out += m.flush()
    assert out == expected
    assert (m.matched is not None) == hit


def test_stop_matcher_holds_a_partial_match_then_releases_it():
    m = StopMatcher(["</end>"])
    assert m.push("code </e") == "code "
    assert m.push("xtra") == "</extra"
    assert m.push(" </end> more") == " "
    assert m.matched == "</end>" and m.push("again") == "" and m.flush() == ""


def test_chat_template_is_json_safe_for_tool_arguments():
    text = TOK.apply_chat_template(CHAT, TOOLS)
    start = text.index("<|START_ACTION|>") + len("<|START_ACTION|>")
    action = json.loads(text[start : text.index("<|END_ACTION|>")])
    assert action == [{"tool_call_id": "0", "tool_name": "get", "parameters": {"q": "<x>"}}]
