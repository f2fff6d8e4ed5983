"""mk.text.tokenizer (encode, token bytes, HF-style chat template) and mk.text.textstream (incremental
detokenizer, stop strings)."""

import json
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import mk
from mk.config import ModelConfig
from mk.model import synthetic_weights, write_checkpoint
from mk.text import tokenizer_files
from mk.text.textstream import Detokenizer, StopMatcher
from mk.text.tokenizer import TemplateError, Tokenizer, TooManyTokens

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
    d = Detokenizer(TOK, keep_special=() if skip else None)
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


@settings(max_examples=100, deadline=None)
@given(texts)
def test_detokenizer_keeps_only_the_special_tokens_it_is_told_to(text):
    """A chat's text: its answer markers, and no other special token (vLLM's skip_special_tokens)."""
    ids = TOK.encode("<|START_RESPONSE|>" + text + "<|CHATBOT_TOKEN|><|END_RESPONSE|>", add_special_tokens=False)
    d = Detokenizer(TOK, keep_special=("<|START_RESPONSE|>", "<|END_RESPONSE|>"))
    plain = TOK.decode(TOK.encode(text, add_special_tokens=False), skip_special_tokens=True)
    assert "".join([d.push(i) for i in ids] + [d.flush()]) == "<|START_RESPONSE|>" + plain + "<|END_RESPONSE|>"


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


# ---- the segment cache (a re-rendered conversation's earlier messages are not tokenized again) ----
EMBEDDED = Tokenizer.from_dir(Path(mk.__file__).parent / "embedded")
long_texts = st.text(st.characters(exclude_categories=("Cs",)), min_size=0, max_size=200)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(long_texts, st.sampled_from(sorted(EMBEDDED._segments.added))), max_size=10))
def test_the_segment_cache_encodes_as_tokenizers_does(parts):
    """Text of special tokens and arbitrary text between them (whitespace and characters of every
    kind next to the tokens), encoded twice (the second time from the cache): the ids `tokenizers`
    gives, for the built-in model's tokenizer and the test tokenizer."""
    text = "".join(parts)
    for tok in (EMBEDDED, TOK):
        assert tok._segments is not None, "both tokenizers are ones the cache is exact for"
        want = tok.hf.encode(text, add_special_tokens=False).ids
        assert tok.encode(text, add_special_tokens=False) == want
        assert tok.encode(text, add_special_tokens=False) == want


def test_a_next_turn_tokenizes_only_its_new_messages(monkeypatch):
    """The same conversation rendered again with one more message: the earlier messages' text
    comes from the cache, only the new one (and pieces too short to cache) is encoded."""
    tok = Tokenizer.builtin(512)
    history = [{"role": "user", "content": "print the first " + "ten thousand primes, " * 20}]
    history.append({"role": "assistant", "content": "Here is a sieve " + "that works, " * 30})
    first = tok.apply_chat_template(history)
    tok.encode(first, add_special_tokens=False)
    encoded: list[str] = []
    hf = tok._segments.hf
    spy = {"encode_batch_fast": lambda _, texts, **kw: encoded.extend(texts) or hf.encode_batch_fast(texts, **kw)}
    monkeypatch.setattr(tok._segments, "hf", type("Spy", (), spy)())
    new = {"role": "user", "content": "now make it faster " * 10}
    second = tok.apply_chat_template([*history, new])
    assert tok.encode(second, add_special_tokens=False) == hf.encode(second, add_special_tokens=False).ids
    assert any(new["content"] in t for t in encoded)
    assert all(len(t) < tok._segments.MIN_CHARS for t in encoded if new["content"] not in t), encoded


def with_steps(**steps) -> Tokenizer:
    """The test tokenizer with other normalizer / pre-tokenizer steps (tokenizer.json's spec)."""
    from tokenizers import Tokenizer as HFTokenizer

    spec = {**json.loads(TOK.hf.to_str()), **steps}
    return Tokenizer(HFTokenizer.from_str(json.dumps(spec)), {})


@settings(max_examples=100, deadline=None)
@given(st.lists(st.one_of(long_texts, st.sampled_from(sorted(TOK._segments.added))), max_size=8))
def test_piecewise_normalizers_and_pre_tokenizers_keep_the_cache_exact(parts):
    """NFC and a digit split before the byte-level step (the kind of steps a real checkpoint's
    tokenizer has) act on each piece alone: the cache stays on and exact."""
    tok = PIECEWISE
    assert tok._segments is not None
    text = "".join(parts)
    want = tok.hf.encode(text, add_special_tokens=False).ids
    assert tok.encode(text, add_special_tokens=False) == want == tok.encode(text, add_special_tokens=False)


PIECEWISE = with_steps(
    normalizer={"type": "NFC"},
    pre_tokenizer={
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            json.loads(TOK.hf.to_str())["pre_tokenizer"],
        ],
    },
)


def test_no_segment_cache_for_steps_that_see_the_whole_input():
    byte_level = json.loads(TOK.hf.to_str())["pre_tokenizer"]
    prefixed = with_steps(pre_tokenizer={**byte_level, "add_prefix_space": True})
    metaspace = with_steps(pre_tokenizer={"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first"})
    assert prefixed._segments is None and metaspace._segments is None


def test_no_segment_cache_where_tokenizers_would_not_split_alike(monkeypatch):
    """An added token that strips its neighbours' whitespace joins pieces the cache would keep apart:
    that tokenizer gets no cache (and encodes as ever); a small budget keeps the cache within it."""
    spec = json.loads(TOK.hf.to_str())
    spec["added_tokens"][-1]["lstrip"] = True
    from tokenizers import Tokenizer as HFTokenizer

    stripping = Tokenizer(HFTokenizer.from_str(json.dumps(spec)), {})
    assert stripping._segments is None
    token = spec["added_tokens"][-1]["content"]
    text = "x   " + token + " y"
    assert stripping.encode(text, add_special_tokens=False) == stripping.hf.encode(text, add_special_tokens=False).ids
    # Added tokens one of which begins another: the longest at the leftmost place wins, as in `tokenizers`.
    from tokenizers import AddedToken

    overlapping = HFTokenizer.from_str(TOK.hf.to_str())
    overlapping.add_special_tokens([AddedToken("<x>", special=True), AddedToken("<x><y>", special=True)])
    tok = Tokenizer(overlapping, {})
    assert tok._segments is not None
    for text in ("a<x><y>b", "<x><x><y><y>", "<x>" * 3 + " tail"):
        assert tok.encode(text, add_special_tokens=False) == overlapping.encode(text, add_special_tokens=False).ids
    monkeypatch.setattr(type(TOK._segments), "BUDGET_CHARS", 1000)
    tok = Tokenizer.builtin(512)
    for i in range(30):
        text = f"message {i}: " + "lorem ipsum dolor " * 8
        assert tok.encode(text, add_special_tokens=False) == tok.hf.encode(text, add_special_tokens=False).ids
    assert 0 < tok._segments.chars <= 1000 and len(tok._segments.pieces) <= 1000 // 64


# ---- bounds on a text's token count (a prompt refused before or while it is tokenized) ----------
dashes = st.integers(1, 300).map(lambda n: "-" * n)  # runs of the longest tokens of the built-in model


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(long_texts, dashes, st.sampled_from(sorted(EMBEDDED._segments.added))), max_size=8))
def test_a_texts_size_never_promises_more_tokens_than_it_has(parts):
    text = "".join(parts)
    for tok in (EMBEDDED, TOK):
        for special in (True, False):
            assert tok.fewest_tokens(text) <= len(tok.encode(text, add_special_tokens=special))


def test_the_longest_token_bounds_only_tokenizers_it_is_sound_for():
    longest_piece = max(len(p) for p in EMBEDDED.hf.get_vocab(with_added_tokens=False))
    assert EMBEDDED.max_token_bytes == longest_piece  # longer than every special token
    assert TOK.max_token_bytes == max(len(t) for t in tokenizer_files.SPECIAL_TOKENS)
    assert PIECEWISE.max_token_bytes is None  # NFC may shrink text
    assert PIECEWISE.fewest_tokens("x" * 10_000) == 0
    truncating = with_steps(truncation={"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0})
    assert truncating.max_token_bytes is None
    spec = json.loads(TOK.hf.to_str())
    spec["added_tokens"][-1]["lstrip"] = True  # one token for the token and every space before it
    stripping = with_steps(added_tokens=spec["added_tokens"])
    assert len(stripping.encode(" " * 1000 + spec["added_tokens"][-1]["content"], add_special_tokens=False)) == 1
    assert stripping.max_token_bytes is None
    byte_level = json.loads(TOK.hf.to_str())["pre_tokenizer"]
    removing = {"type": "Split", "pattern": {"String": " "}, "behavior": "Removed", "invert": False}
    for dropping in ({"type": "WhitespaceSplit"}, removing):
        spaceless = with_steps(pre_tokenizer={"type": "Sequence", "pretokenizers": [dropping, byte_level]})
        assert spaceless.encode(" " * 1000, add_special_tokens=False) == []
        assert spaceless.max_token_bytes is None
    split = {"type": "Split", "pattern": {"String": " "}, "behavior": "Isolated", "invert": False}
    assert with_steps(pre_tokenizer={"type": "Sequence", "pretokenizers": [split, byte_level]}).max_token_bytes
    assert EMBEDDED.fewest_tokens("é" * longest_piece) == 2  # two bytes a character


@pytest.mark.parametrize("special", [True, False])  # False: through the segment cache
def test_a_limit_refuses_a_text_with_too_many_tokens_and_counts_them_all(special):
    tok = Tokenizer.builtin(512)
    text = "<|START_RESPONSE|>".join(["print the first ten thousand primes, " * 20] * 3)
    want = tok.hf.encode(text, add_special_tokens=special).ids
    assert tok.encode(text, add_special_tokens=special, limit=len(want)) == want
    for _ in range(2):  # the second time from the cache where there is one
        with pytest.raises(TooManyTokens) as e:
            tok.encode(text, add_special_tokens=special, limit=len(want) - 1)
        assert (e.value.count, e.value.limit) == (len(want), len(want) - 1)
        assert tok.encode(text, add_special_tokens=special) == want
