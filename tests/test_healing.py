"""Token healing (mk.text.healing): the backing-up rule on the built-in model's tokenizer, the grammar that
holds the first tokens to the removed text, and `mk.LLM` on the built-in model (CPU): text prompts
healed, token ids taken as given, stop strings, max_tokens and streaming on the healed text, and the
prompt forms users type after a docstring on held-out functions."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

import mk
from mk.default_model import load_default
from mk.engine.sampling import ConstraintSpec, SamplingParams
from mk.text import healing
from mk.text.healing import MAX_HEALED_TOKENS, HealedText, back_up, heal, healing_constraint, strip_healed

TOK = load_default()[1]  # the built-in model's tokenizer (byte-level BPE)
DOCSTRING = 'def add(a, b):\n    """Add two numbers."""'
GREEDY = SamplingParams(max_tokens=24, temperature=0)


def text_tokens() -> list[bytes]:
    return [TOK.token_bytes(t) for t in range(TOK.vocab_size) if t not in TOK.special_ids]


def scanned_back_up(ids: list[int]) -> tuple[list[int], str] | None:
    """The rule by a scan of the whole vocabulary: the longest tail of up to MAX_HEALED_TOKENS text
    tokens, whole UTF-8, that some longer token starts with."""
    vocab, found = text_tokens(), None
    for k in range(1, min(MAX_HEALED_TOKENS, len(ids) - 1) + 1):
        if ids[-k] in TOK.special_ids:
            break
        tail = b"".join(TOK.token_bytes(t) for t in ids[-k:])
        if any(len(v) > len(tail) and v.startswith(tail) for v in vocab):
            try:
                found = (ids[:-k], tail.decode("utf-8"))
            except UnicodeDecodeError:
                pass
    return found


@pytest.fixture(scope="module")
def llm():
    with mk.LLM(device="cpu", max_batch=8, max_context=512, prefill_chunk=128) as llm:
        yield llm


@pytest.fixture(scope="module")
def unhealed():
    with mk.LLM(device="cpu", max_batch=8, max_context=512, prefill_chunk=128, token_healing=False) as llm:
        yield llm


# ---- the rule ------------------------------------------------------------------------------------


def test_a_prompt_ending_in_a_bare_newline_is_backed_up():
    ids = TOK.encode(DOCSTRING + "\n")
    assert TOK.token_bytes(ids[-1]) == b"\n"  # the bare newline token, not the one with the indentation
    assert back_up(TOK, ids) == (ids[:-1], "\n")
    assert any(len(v) > 1 and v.startswith(b"\n") for v in text_tokens())  # such as "\n    "


def test_a_prompt_ending_where_no_longer_token_starts_is_kept():
    for prompt in (DOCSTRING, "Hello"):  # closing quotes ('."""'), and a whole word
        ids = TOK.encode(prompt)
        tail = TOK.token_bytes(ids[-1])
        assert not any(len(v) > len(tail) and v.startswith(tail) for v in text_tokens())
        assert back_up(TOK, ids) is None


def test_the_rule_agrees_with_a_scan_of_the_vocabulary():
    prompts = [
        DOCSTRING,
        DOCSTRING + "\n",
        DOCSTRING + "\n    ",
        "    retu",  # " ret" + "u": two tokens backed up, " retu" as the model saw it in " return"
        "x = 1",
        "import os\n",
        "def f(x):",
        'print("é',  # a character split over two byte tokens
        "a",
        "",
    ]
    kinds = set()
    for prompt in prompts:
        ids = TOK.encode(prompt)
        got = back_up(TOK, ids)
        assert got == scanned_back_up(ids), prompt
        kinds.add(0 if got is None else len(ids) - len(got[0]))
    assert kinds == {0, 1, 2}


def test_special_tokens_are_never_backed_up_and_one_token_is_kept():
    bos_only = TOK.encode("")
    assert back_up(TOK, bos_only) is None
    ends_special = TOK.encode("x") + [TOK.eos_token_id]
    assert back_up(TOK, ends_special) is None
    assert back_up(TOK, TOK.encode("x", add_special_tokens=False)) is None  # one token: kept


def test_requests_with_a_grammar_ignore_eos_or_a_stop_token_inside_the_tail_are_not_healed():
    ids = TOK.encode("import os\n")
    assert heal(TOK, ids, SamplingParams()) is not None
    assert heal(TOK, ids, SamplingParams(constraint=ConstraintSpec("regex", "[a-z]+"))) is None
    assert heal(TOK, ids, SamplingParams(ignore_eos=True)) is None
    assert heal(TOK, ids, SamplingParams(stop_token_ids=[ids[-1]])) is None  # it would stop on the prompt's text
    assert heal(TOK, ids, SamplingParams(stop_token_ids=[ids[-2], TOK.eos_token_id])) is not None


def test_the_healed_text_is_left_out_of_the_stream():
    strip = HealedText("\n    ")
    assert [strip.push(t) for t in ("", "\n ", "  ", " if", " x")] == ["", "", "", "if", " x"]
    assert strip_healed("\n    return", "\n") == "    return"
    assert strip_healed(" re", " retu") == ""  # cut off inside the healed text: nothing new
    assert strip_healed("```", "\n") == "```"  # not under the healing grammar: left whole


def test_the_constraint_is_the_removed_text_as_a_prefix(llm):
    spec = healing_constraint('\n "\\é')
    assert (spec.kind, spec.value, spec.origin) == ("prefix", '\n "\\é', healing.ORIGIN)
    llm.engine._native.check_constraint(spec.kind, spec.value)  # compiles against the vocabulary


# ---- generation on the built-in model --------------------------------------------------------------


def test_a_prompt_ending_in_a_bare_newline_no_longer_answers_a_code_fence(llm, unhealed):
    prompt = DOCSTRING + "\n"
    before = unhealed.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0]
    assert before.text.startswith("```")  # the token-boundary artefact, healing off
    out = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.text.startswith("    ") and not c.text.startswith("\n")  # the next line, without the prompt's newline
    assert TOK.decode(c.token_ids, skip_special_tokens=True) == "\n" + c.text
    assert out.prompt_token_ids == TOK.encode(prompt)  # the prompt's own ids
    assert out.prompt == prompt


def test_sampled_first_tokens_begin_with_the_removed_text(llm):
    """At a high temperature, many seeds: every completion's tokens begin with the removed text (or, cut
    off by max_tokens, are a start of it), over one token ("\\n") and two (" retu")."""
    for prompt, removed in ((DOCSTRING + "\n", "\n"), ("    retu", " retu")):
        assert back_up(TOK, TOK.encode(prompt))[1] == removed
        params = SamplingParams(max_tokens=3, temperature=1.5, seed=7, n=24)
        for c in llm.generate(prompt, params, use_tqdm=False)[0].outputs:
            raw = TOK.decode(c.token_ids, skip_special_tokens=True)
            assert raw.startswith(removed) or removed.startswith(raw), (prompt, raw)
            assert c.text == raw[len(removed) :]


def test_after_the_removed_text_the_request_decodes_as_one_without_a_grammar(llm):
    """Once its first token covers the removed text the engine drops the constraint: the rest is what
    the backed-up prompt and that token continue to without any grammar (greedy)."""
    prompt = "import os\nimport sys\n\ndef main():\n"
    healing_of = heal(TOK, TOK.encode(prompt), SamplingParams())
    assert healing_of is not None and healing_of.removed == "\n"
    healed = llm.generate(prompt, GREEDY_80, use_tqdm=False)[0].outputs[0].token_ids
    first, rest = healed[0], healed[1:]
    assert TOK.decode([first]).startswith("\n") and len(rest) > 10
    free = llm.generate([*healing_of.prompt, first], GREEDY_79, use_tqdm=False)[0].outputs[0].token_ids
    assert rest == free


GREEDY_80, GREEDY_79 = SamplingParams(max_tokens=80, temperature=0), SamplingParams(max_tokens=79, temperature=0)


def _fields(p: SamplingParams) -> dict:
    return {f: getattr(p, f) for f in ("max_tokens", "temperature", "seed")}


def test_token_id_prompts_are_taken_as_given(llm, unhealed):
    ids = TOK.encode(DOCSTRING + "\n")
    got = llm.generate(ids, GREEDY, use_tqdm=False)[0].outputs[0]
    want = unhealed.generate(ids, GREEDY, use_tqdm=False)[0].outputs[0]
    assert (got.text, got.token_ids) == (want.text, want.token_ids)
    assert want.text == unhealed.generate(DOCSTRING + "\n", GREEDY, use_tqdm=False)[0].outputs[0].text


def test_stop_strings_never_match_the_removed_text(llm):
    """The prompt "import os\\n" heals its newline; a stop at "\\n" cuts the completion at the end of its
    own first line, not at the healed newline it begins with."""
    whole = llm.generate("import os\n", SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)[0].outputs[0]
    assert "\n" in whole.text.strip("\n")
    cut = llm.generate("import os\n", SamplingParams(max_tokens=24, temperature=0, stop=["\n"]), use_tqdm=False)
    c = cut[0].outputs[0]
    assert c.finish_reason == "stop" and c.text and c.text == whole.text[: whole.text.index("\n")]


def test_max_tokens_counts_the_healing_token(llm):
    one = llm.generate(DOCSTRING + "\n", SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)[0].outputs[0]
    assert len(one.token_ids) == 1 and one.finish_reason == "length"
    assert one.text == TOK.decode(one.token_ids)[1:]  # the first token less the healed newline


def test_stream_gives_what_generate_gives(llm):
    prompt, params = DOCSTRING + "\n", SamplingParams(max_tokens=12, temperature=0, logprobs=1)

    async def main():
        return [o async for o in llm.stream(prompt, params)]

    last = asyncio.run(main())[-1].outputs[0]
    batch = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert (last.text, last.token_ids, last.finish_reason) == (batch.text, batch.token_ids, batch.finish_reason)
    assert len(batch.logprobs) == len(batch.token_ids)


# ---- the prompt forms users type, on functions the model never saw ------------------------------------


REPO = Path(__file__).resolve().parent.parent
FUNCTIONS = 8
MAX_NEW = 64


def test_prompts_after_a_docstring_parse_at_least_as_often_as_at_its_closing_quotes(llm, unhealed):
    """Held-out functions (scripts/eval_embedded.py's) prompted three ways: ending at the docstring's
    closing quotes, after its newline, after the next line's indentation. Healed, no completion starts
    with a code fence and the later forms parse (prompt + completion, cut where the function ends) at
    least as often as the first; unhealed, the newline form answers fences and the indented one puts
    a space too many before its first statement."""
    sys.path.insert(0, str(REPO / "scripts"))
    import eval_embedded as ev
    from embedded.evaluation import cut_completion, parses_with_body

    fns = ev.held_out_functions(["jinja2"], FUNCTIONS)
    heads, forms = [], []
    for f in fns:
        head = f.prompt.removesuffix("\n")
        first = f.body.splitlines()[0]
        indent = first[: len(first) - len(first.lstrip())]
        heads.append(head)
        forms.append({"quotes": head, "newline": head + "\n", "indent": head + "\n" + indent})
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0)

    def run(model) -> dict[str, list[tuple[bool, bool]]]:
        prompts = [(i, name, p) for i, f in enumerate(forms) for name, p in f.items()]
        outs = model.generate([p for _, _, p in prompts], greedy, use_tqdm=False)
        got: dict[str, list[tuple[bool, bool]]] = {}
        for (i, name, prompt), out in zip(prompts, outs, strict=True):
            c = out.outputs[0]
            body = cut_completion((prompt + c.text)[len(heads[i]) :], c.finish_reason == "stop")
            got.setdefault(name, []).append((parses_with_body(heads[i] + body), c.text.startswith("```")))
        return got

    healed, plain = run(llm), run(unhealed)
    parsed = {name: sum(ok for ok, _ in rows) for name, rows in healed.items()}
    assert not any(fence for rows in healed.values() for _, fence in rows)
    assert parsed["quotes"] > 0
    assert parsed["newline"] >= parsed["quotes"] and parsed["indent"] >= parsed["quotes"]
    # Healing off, the same prompts show the problem it solves.
    assert sum(fence for _, fence in plain["newline"]) > len(fns) // 2
    assert sum(ok for ok, _ in plain["indent"]) < parsed["indent"]
