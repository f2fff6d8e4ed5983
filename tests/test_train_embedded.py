"""The embedded model's training recipe (scripts/train_embedded.py) on the CPU: the corpus split is
deterministic and leak-free, the chat and tool examples use mk's template, the tokenizer keeps the special
ids, the training forward is the reference model's function, a 3-step run writes a checkpoint that the
loader and `load_default` read, and the embedded preset fits the megakernel and the 40 MB bound."""

from __future__ import annotations

import argparse
import ast
import copy
import dataclasses
import json
import logging
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import tokenizers
import torch

from mk.config import ModelConfig
from mk.default_model import EMBEDDED_DIR, FALLBACK_NAME, NAME, has_embedded, load_default
from mk.model import load, synthetic_weights
from mk.model.names import expected_shapes
from mk.model.reference import Model
from mk.model.train import forward, init_weights
from mk.text import tokenizer_files
from mk.text.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parent.parent


sys.path.insert(0, str(REPO / "scripts"))  # the scripts import each other by name
import train_embedded as te  # noqa: E402  (main, preset_config: the command line)
from embedded.corpus import (  # noqa: E402
    PER_FILE,
    SITE,
    Function,
    _normalise,
    build_corpus,
    build_site_corpus,
    code_corpus,
    extract_functions,
    first_files,
    holdout_key,
    list_sources,
    read_source,
)
from embedded.documents import (  # noqa: E402
    TOOL_NAMES,
    _summary,
    build_documents,
    chat_example,
    cut_example,
    import_path,
    tool_examples,
    tool_prompt,
)
from embedded.evaluation import action_ok, cut_completion, parses_with_body  # noqa: E402
from embedded.outputs import unshippable, write_shipped  # noqa: E402
from embedded.tokens import build_tokenizer, encode_chat, encode_code, encode_cut, token_stream  # noqa: E402
from embedded.unlikelihood import (  # noqa: E402
    UL_MAX_VAL_COST,
    loop_free,
    looping_examples,
    repeat_marks,
    unlikelihood_loss,
    unlikelihood_phase,
)

pytestmark = pytest.mark.slow  # (trains small models)

# ---- a small fake standard library --------------------------------------------------------------


def _module(i: int) -> str:
    funcs = [
        f'def func_{i}_{j}(x, y={j}):\n    """Combine x and y, variant {i}.{j}."""\n'
        f"    total = x * {i + 1} + y\n    for k in range({j + 2}):\n        total += k * {i}\n    return total\n"
        for j in range(5)
    ]
    method = (
        f'class Thing{i}:\n    def size(self):\n        """How big thing {i} is."""\n'
        f"        n = {i}\n        return n * 2\n"
    )
    return f"import os\n\nLIMIT = {i}\n\n\n" + "\n\n".join(funcs) + "\n\n" + method


@pytest.fixture()
def fake_stdlib(tmp_path: Path) -> Path:
    root = tmp_path / "lib"
    for i in range(40):
        sub = root / ("pkg" if i % 3 == 0 else "") / f"mod{i}.py"
        sub.parent.mkdir(parents=True, exist_ok=True)
        sub.write_text(_module(i))
    for skipped in ("test/test_x.py", "site-packages/foo/bar.py", "pkg/tests/helper.py", "pydoc_data/topics.py"):
        (root / skipped).parent.mkdir(parents=True, exist_ok=True)
        (root / skipped).write_text(_module(99))
    (root / "broken.py").write_text("def f(:\n    pass\n")
    (root / "latin.py").write_bytes(b"x = '\xe9'\n")
    return root


def _normalised_sources(corpus) -> list[str]:
    return [_normalise(f.source) for f in corpus.test_functions]


# ---- corpus ---------------------------------------------------------------------------------------


def test_holdout_is_deterministic_disjoint_and_skips_tests(fake_stdlib):
    a = build_corpus(fake_stdlib, heldout=10)
    b = build_corpus(fake_stdlib, heldout=10)
    assert a.test_functions == b.test_functions and a.heldout == b.heldout and a.train == b.train
    assert len(a.test_functions) == 10
    assert {f.path for f in a.test_functions} == set(a.heldout)
    assert all(sum(f.path == p for f in a.test_functions) <= PER_FILE for p in a.heldout)
    assert not (set(a.train) & set(a.heldout)) and not (set(a.train) & set(a.val)) and not (set(a.val) & set(a.heldout))
    everything = set(a.train) | set(a.val) | set(a.heldout)
    assert not any(p.startswith(("test/", "site-packages/", "pydoc_data/")) or "/tests/" in p for p in everything)
    assert "broken.py" not in everything and "latin.py" not in everything
    # The held-out files are the first files (in path-hash order) that have functions fit for the test.
    order = sorted(list_sources(fake_stdlib), key=holdout_key)
    fit = [p for p in order if read_source(fake_stdlib / p) and extract_functions(p, (fake_stdlib / p).read_text())]
    assert list(a.heldout) == fit[: len(a.heldout)]
    # Fewer training files leave the held-out and validation sets alone.
    c = build_corpus(fake_stdlib, heldout=10, max_files=5)
    assert c.heldout == a.heldout and c.val == a.val and len(c.train) == 5


def test_byte_caps_keep_the_first_training_files_and_bound_the_tokenizer_text(fake_stdlib):
    full = build_corpus(fake_stdlib, heldout=10)
    sizes = [len(t) for t in full.train.values()]
    cap = sum(sizes[:3]) + sizes[3] // 2  # three whole files and half of the fourth
    capped = build_corpus(fake_stdlib, heldout=10, max_bytes=cap)
    assert list(capped.train) == list(full.train)[:3]
    assert capped.heldout == full.heldout and capped.val == full.val  # only the training side shrinks
    assert first_files(full.train, 2, None) == (dict(list(full.train.items())[:2]), [])
    assert first_files(full.train, None, None) == (full.train, [])
    first = next(iter(full.train))
    kept, dropped = first_files(full.train, 2, None, lambda t: t == full.train[first])
    assert dropped == [first] and list(kept) == list(full.train)[1:3]
    docs = build_documents(full, 3, 0)
    small = build_tokenizer(docs, 300, max_code_bytes=sizes[0])
    whole = build_tokenizer(docs, 300)
    for name, i in tokenizer_files.SPECIAL_IDS.items():
        assert small.token_to_id(name) == whole.token_to_id(name) == i
    assert build_tokenizer(docs, 300, max_code_bytes=sum(sizes)).get_vocab() == whole.get_vocab()


def test_the_token_stream_is_the_documents_in_seeded_order():
    pieces = [[1, 2], [], [3], [4, 5, 6]]
    stream = token_stream(pieces, seed=5)
    order = list(range(4))
    random.Random(5).shuffle(order)
    assert stream.tolist() == [t for i in order for t in pieces[i]] and stream.dtype == torch.long
    assert token_stream([], seed=1).tolist() == []


def test_held_out_functions_never_reach_the_training_documents(fake_stdlib):
    first = build_corpus(fake_stdlib, heldout=10)
    victim = first.test_functions[3]
    # A copy of a held-out function in a file that sorts after every other one: it must be dropped.
    name = max((f"copy{i}.py" for i in range(200)), key=holdout_key)
    (fake_stdlib / name).write_text("import sys\n\n\n" + victim.source)
    corpus = build_corpus(fake_stdlib, heldout=10)
    assert corpus.test_functions == first.test_functions
    assert corpus.leak_excluded == [name] and name not in corpus.train
    docs = build_documents(corpus, tool_count=20, seed=0)
    needles = _normalised_sources(corpus)
    for text in [*docs.code, *docs.chat, *docs.tools]:
        hay = _normalise(text)
        assert not any(n in hay for n in needles)
    assert not any(f.path in corpus.heldout for f in corpus.train_functions)


def test_real_stdlib_split_has_100_functions_and_no_leak():
    import sysconfig

    corpus = build_corpus(sysconfig.get_paths()["stdlib"], heldout=100, max_files=30)
    assert len(corpus.test_functions) == 100 and len(corpus.heldout) >= 100 // PER_FILE
    assert not (set(corpus.train) & set(corpus.heldout))
    needles = _normalised_sources(corpus)
    for text in corpus.train.values():
        hay = _normalise(text)
        assert not any(n in hay for n in needles)
    for f in corpus.test_functions:
        assert parses_with_body(f.source) and not parses_with_body(f.prompt)  # prompt: docstring only
        assert f.prompt.endswith("\n") and f.body.lstrip("\n").startswith((" ", "\t"))


# ---- documents and tokenizer ---------------------------------------------------------------------


def test_a_site_corpus_holds_whole_packages_out(tmp_path):
    """Training on installed packages (scripts/code_corpus.py): the held-out packages' files are the
    held-out set and their functions the tests; training and validation files come from the others,
    and a training file that copies a held-out function is dropped."""
    cc = code_corpus()

    def package(name: str, modules: dict[str, str]):
        root = tmp_path / name
        for rel, text in modules.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(text)
        return cc.Package(name, "1.0", "MIT", root.resolve(), tuple(sorted((root / r).resolve() for r in modules)))

    held_fn = 'def held(a):\n    """Held out."""\n    b = a + 1\n    return b * 2\n'
    train = package("train", {f"train/m{i}.py": _module(i) for i in range(30)})
    copies = package("copies", {"copies/c.py": _module(500) + "\n\n" + held_fn})
    held = package("held", {f"held/h{i}.py": _module(100 + i).replace("func_", "hfunc_") for i in range(6)})
    (tmp_path / "held" / "held" / "h0.py").write_text(_module(100).replace("func_", "hfunc_") + "\n\n" + held_fn)
    corpus, manifest = build_site_corpus([train, copies, held], {"held"}, heldout=12)
    assert set(corpus.heldout) == {f"held/held/h{i}.py" for i in range(6)}
    assert len(corpus.test_functions) == 12 and all(f.path.startswith("held/") for f in corpus.test_functions)
    assert not set(corpus.train) & set(corpus.val) and all(p.startswith(("train/", "copies/")) for p in corpus.train)
    assert len(corpus.train) + len(corpus.val) + len(corpus.leak_excluded) == 31
    assert manifest["held_out"] == ["held"] and {r["name"] for r in manifest["packages"]} == {"train", "copies", "held"}
    needles = _normalised_sources(corpus)  # no training file copies a test function
    assert not any(n in _normalise(t) for t in corpus.train.values() for n in needles)
    assert set(corpus.leak_excluded) <= {"copies/copies/c.py"}
    again, _ = build_site_corpus([train, copies, held], {"held"}, heldout=12)
    assert again.train == corpus.train and [f.name for f in again.test_functions] == [
        f.name for f in corpus.test_functions
    ]
    # Capped: the first training files in the same order, the held-out side and validation unchanged.
    cap = sum(len(t) for t in list(corpus.train.values())[:5])
    capped, _ = build_site_corpus([train, copies, held], {"held"}, heldout=12, max_bytes=cap)
    assert list(capped.train) == list(corpus.train)[:5]
    assert capped.val == corpus.val and capped.heldout == corpus.heldout
    assert not any(n in _normalise(t) for t in capped.train.values() for n in needles)


def test_chat_examples_render_with_the_template(fake_stdlib):
    corpus = build_corpus(fake_stdlib, heldout=10)
    kinds = set()
    for fn in corpus.train_functions:
        text = chat_example(fn)
        assert text.startswith(tokenizer_files.BOS + "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>")
        assert "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_THINKING|>" in text and "<|END_THINKING|>" in text
        user = text.split("<|USER_TOKEN|>")[1].split("<|END_OF_TURN_TOKEN|>")[0]
        content = text.split("<|START_RESPONSE|>")[1].split("<|END_RESPONSE|>")[0]
        if user.startswith("Write a Python function"):
            # The whole function in a fenced block, from its summary: what the chat bar asks for.
            kinds.add("write")
            assert _summary(fn) in user and content == f"```python\n{fn.source}```"
            tree = ast.parse(content.removeprefix("```python\n").removesuffix("```"))
            assert isinstance(tree.body[0], ast.FunctionDef | ast.AsyncFunctionDef)
        else:
            kinds.add("body")
            assert fn.prompt in user and content == fn.body
        # Same text as the template renders for the conversation, so serving prompts look like training.
        thinking = text.split("<|START_THINKING|>")[1].split("<|END_THINKING|>")[0]
        answer = {"role": "assistant", "content": content, **({"reasoning": thinking} if thinking else {})}
        assert text == tokenizer_files.render_chat([{"role": "user", "content": user}, answer])
        kinds.add("thinking" if thinking else "no thinking")
    assert kinds == {"write", "body", "thinking", "no thinking"}, kinds


def test_documents_hold_each_training_function_alone_and_code_ends_without_a_newline(fake_stdlib):
    corpus = build_corpus(fake_stdlib, heldout=10)
    docs = build_documents(corpus, tool_count=5, seed=0)
    assert docs.functions == [f.source for f in corpus.train_functions] and docs.functions
    tok = build_tokenizer(docs, 600)
    newline = {i for t, i in tok.get_vocab().items() if set(tok.decode([i])) <= {"\n"} and tok.decode([i])}
    for ids in encode_code(tok, docs.code + docs.functions):
        assert ids[-1] == tokenizer_files.EOS_ID and ids[-2] not in newline


def test_cut_examples_end_their_first_half_where_prompts_end_and_tokenize_each_half_alone(fake_stdlib):
    fns = [
        Function("m.py", f"f{i}", i, f'def f{i}(a):\n    """Doc {i}."""\n', f"    x = a + {i}\n    return x\n")
        for i in range(40)
    ]
    kinds = set()
    for fn in fns:
        head, tail = cut_example(fn)
        assert head + tail == fn.source and cut_example(fn) == (head, tail)
        kind = next((k for k, form in fn.prompt_forms().items() if form == head), "body")
        assert kind != "body" or len(fn.prompt) < len(head) < len(fn.source), head
        kinds.add(kind)
    assert kinds == {"quotes", "newline", "indent", "body"}
    docs = build_documents(build_corpus(fake_stdlib, heldout=10), tool_count=5, seed=0)
    assert [h + t for h, t in docs.cut] == docs.functions
    # After the docstring's newline the text's own tokens merge the newline with the indentation;
    # the cut example holds the prompt's tokens, then the body's.
    tok = tokenizers.Tokenizer.from_file(str(EMBEDDED_DIR / "tokenizer.json"))
    fn = next(f for f in fns if cut_example(f)[0] == f.prompt)
    ids = encode_cut(tok, [cut_example(fn)])[0]
    head = tok.encode(fn.prompt, add_special_tokens=False).ids
    assert ids[0] == tokenizer_files.BOS_ID and ids[-1] == tokenizer_files.EOS_ID
    assert ids[1 : 1 + len(head)] == head and tok.decode(ids[1:-1]) == fn.source.rstrip("\n")
    assert ids != encode_code(tok, [fn.source])[0]


def test_tool_examples_are_cohere_action_blocks(fake_stdlib):
    corpus = build_corpus(fake_stdlib, heldout=10)
    examples = tool_examples(corpus, 25, seed=0)
    assert len(examples) == 25 and examples == tool_examples(corpus, 25, seed=0)
    names = set()
    for text in examples:
        assert text.startswith(tokenizer_files.BOS + "<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|># Available Tools")
        assert action_ok(text)
        block = text.split("<|START_ACTION|>")[1].split("<|END_ACTION|>")[0]
        calls = json.loads(block)
        assert all(set(c) == {"tool_call_id", "tool_name", "parameters"} for c in calls)
        names |= {c["tool_name"] for c in calls}
        assert "<|START_TOOL_RESULT|>" in text and text.endswith("<|END_RESPONSE|><|END_OF_TURN_TOKEN|>")
    assert names == TOOL_NAMES
    assert any(len(json.loads(t.split("<|START_ACTION|>")[1].split("<|END_ACTION|>")[0])) == 2 for t in examples)
    assert not action_ok("<|START_ACTION|>[{'tool_name': 'x'}]<|END_ACTION|>")
    assert not action_ok('<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "rm", "parameters": {}}]<|END_ACTION|>')


def test_site_corpus_tool_examples_name_modules_as_imported(fake_stdlib):
    """A site-packages corpus files each module under its distribution's folder; its tool
    conversations show the import path, exactly as the same files without the folder would."""
    corpus = build_corpus(fake_stdlib, heldout=10)
    site = dataclasses.replace(
        corpus,
        root=SITE,
        train={f"dist/{p}": t for p, t in corpus.train.items()},
        train_functions=[dataclasses.replace(f, path=f"dist/{f.path}") for f in corpus.train_functions],
    )
    assert tool_examples(site, 25, seed=0) == tool_examples(corpus, 25, seed=0)
    fn = dataclasses.replace(corpus.train_functions[0], path="networkx/networkx/algorithms/cuts.py", name="cut_size")
    (turn,) = tool_prompt(fn, site=True)
    assert "`networkx.algorithms.cuts` module" in turn["content"]
    assert import_path("networkx/networkx/__init__.py", site=False) == "networkx/networkx/__init__.py"


def test_tokenizer_keeps_the_special_token_ids(fake_stdlib):
    corpus = build_corpus(fake_stdlib, heldout=10)
    docs = build_documents(corpus, tool_count=10, seed=0)
    tok = build_tokenizer(docs, 600)
    assert tok.get_vocab_size() <= 600
    for name, i in tokenizer_files.SPECIAL_IDS.items():
        assert tok.token_to_id(name) == i
        assert tok.encode(name, add_special_tokens=False).ids == [i]
    assert tok.encode("x = 1").ids[0] == tokenizer_files.BOS_ID
    chat = encode_chat(tok, [docs.chat[0]])[0]
    assert chat[0] == tokenizer_files.BOS_ID and chat[-1] == tokenizer_files.EOS_ID
    assert encode_code(tok, ["pass\n"])[0][0] == tokenizer_files.BOS_ID
    assert tok.decode(encode_code(tok, [docs.code[0]])[0][1:-1]) == docs.code[0].rstrip("\n")


# ---- completion rules ------------------------------------------------------------------------------


def test_completion_cut_and_parse_rules():
    head = 'def f(x):\n    """Double."""'
    assert cut_completion("\n    return 2 * x\n\ndef g():\n", finished=False) == "\n    return 2 * x\n\n"
    assert cut_completion("\n    y = x\n    return y", finished=True) == "\n    y = x\n    return y"
    assert cut_completion("\n    y = x\n    return (y", finished=False) == "\n    y = x\n"
    assert parses_with_body(head + "\n    return 2 * x\n")
    assert not parses_with_body(head + "\n")  # a docstring alone is no body
    assert not parses_with_body(head + "\n    return (x\n")
    assert not parses_with_body(head + "\n    return x\nprint(1)\n")
    # A placeholder is no body, but a placeholder beside real statements is fine.
    assert not parses_with_body(head + "\n    pass\n")
    assert not parses_with_body(head + "\n    ...\n    pass\n")
    assert parses_with_body(head + "\n    y = 2 * x\n    pass\n")


# ---- the training forward ---------------------------------------------------------------------------


def _sharp(cfg: ModelConfig, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    w = synthetic_weights(cfg, seed=seed, dtype=dtype, std=0.1)
    for name in w:  # sharper attention and routing, so a wrong mask or expert shows
        if "q_proj" in name or "k_proj" in name or name.endswith("mlp.gate.weight"):
            w[name] = w[name] * 3
    return w


def test_training_forward_equals_reference_logits_float64():
    cfg = ModelConfig.tiny()  # window 96 < 150 tokens: the band mask is exercised
    w = _sharp(cfg, torch.float64, seed=5)
    tokens = torch.randint(0, cfg.vocab_size, (2, 150), generator=torch.Generator().manual_seed(0))
    out = forward(cfg, w, tokens)
    model = Model(cfg, w)
    for row in range(2):
        torch.testing.assert_close(out.logits[row], model.logits(tokens[row]), rtol=0, atol=1e-10)
    assert out.expert_load.shape == (cfg.num_hidden_layers - 1, cfg.num_experts)
    assert torch.allclose(out.expert_load.sum(-1), torch.ones((), dtype=torch.float64))


def test_training_moe_has_the_gathering_moes_values_and_gradients():
    """train._moe runs every expert on every token, scaled by a combine weight that is 0 where the
    expert was not selected: its output and its gradients (weights, router, input) equal the
    reference's per-expert gather (mk.model.moe.moe_ffn), float64."""
    from mk.model.moe import moe_ffn
    from mk.model.train import _moe

    cfg = ModelConfig.embedded()
    w0 = _sharp(cfg, torch.float64, seed=7)
    prefix = "model.layers.1.mlp."
    h0 = torch.randn(96, cfg.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    grads = []
    for dense in (True, False):
        w = {n: t.detach().clone().requires_grad_(True) for n, t in w0.items() if n.startswith(prefix)}
        h = h0.clone().requires_grad_(True)
        if dense:
            out = _moe(h, w, prefix, cfg)[0]
        else:
            experts = [
                tuple(w[f"{prefix}experts.{e}.{m}_proj.weight"] for m in ("gate", "up", "down"))
                for e in range(cfg.num_experts)
            ]
            out = moe_ffn(h, w[prefix + "gate.weight"], experts, cfg.num_experts_per_tok)
        (out * torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view_as(out)).sum().backward()
        grads.append((out.detach(), h.grad, {n: t.grad for n, t in w.items()}))
    (a, ha, wa), (b, hb, wb) = grads
    torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    torch.testing.assert_close(ha, hb, rtol=0, atol=1e-12)
    assert wa.keys() == wb.keys() and all(wb[n] is not None for n in wb)
    for n in wa:
        torch.testing.assert_close(wa[n], wb[n], rtol=0, atol=1e-12, msg=n)


def test_training_forward_equals_reference_logits_at_the_embedded_geometry():
    cfg = ModelConfig.embedded()
    w = _sharp(cfg, torch.float64, seed=6)
    tokens = torch.randint(0, cfg.vocab_size, (1, 300), generator=torch.Generator().manual_seed(1))
    ref = Model(cfg, w).logits(tokens[0])
    torch.testing.assert_close(forward(cfg, w, tokens).logits[0], ref, rtol=0, atol=1e-9)


def test_init_weights_cover_the_checkpoint_names_and_train():
    cfg = ModelConfig.tiny()
    w = init_weights(cfg, seed=1)
    assert list(w) == list(expected_shapes(cfg)) and all(t.requires_grad for t in w.values())
    assert torch.equal(w["model.norm.weight"], torch.ones(cfg.hidden_size))
    assert all(torch.equal(a, b) for a, b in zip(w.values(), init_weights(cfg, seed=1).values(), strict=True))
    tokens = torch.randint(0, cfg.vocab_size, (2, 33))
    out = forward(cfg, w, tokens[:, :-1], dropout=0.1)
    loss = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), tokens[:, 1:].flatten()) + out.balance_loss
    loss.backward()
    assert all(t.grad is not None for t in w.values())
    assert w["model.layers.1.mlp.gate.weight"].grad.abs().sum() > 0  # the router learns


# ---- unlikelihood fine-tuning (greedy loops) ---------------------------------------------------------


def test_loop_rule_and_repeat_marks():
    assert loop_free("a\nb\na\nb\na\n\n\n\n")  # blank lines never count
    assert not loop_free("x = 1\n" * 4) and loop_free("x = 1\n" * 3)
    assert not loop_free("  y\ny  \ny\n", repeats=2)  # lines compare stripped
    # The tokens that close a repeat of an earlier 4-gram: [1 2 3 4] again at 7 and 12, [2 3 4 1] at 13.
    ids = [1, 2, 3, 4, 1, 2, 3, 4, 9, 1, 2, 3, 4, 1]
    assert repeat_marks(ids) == [7, 12, 13]
    assert repeat_marks([5] * 6, n=2) == [2, 3, 4, 5]
    assert repeat_marks([1, 2, 3]) == []


def test_looping_examples_keep_only_loops_and_mark_their_repeats():
    class Tok:  # ids are characters
        def decode(self, ids, skip_special_tokens=False):
            return "".join(chr(i) for i in ids)

    line = [ord(c) for c in "ab\n"]
    prompt = [ord("p")]
    eos = 2
    inline = [ord(c) for c in "f(x) or f(x) or f(x) or f(x)"]  # one line, looping inside it
    varied = [ord(c) for c in "f(x) or g(y)\n"]
    outs = [line * 3 + [eos] + line * 5, line * 2 + [ord("c"), ord("\n")], line * 4, inline, varied]
    ex = looping_examples(Tok(), [prompt] * len(outs), outs, {eos})
    # The first loops before its EOS (three lines), the second never repeats a line more than twice,
    # the fourth repeats itself within its line, the last has one repeated 4-gram (" or ") only.
    assert [len(s) for s, _ in ex] == [1 + 9, 1 + 12, 1 + len(inline)]
    seq, marks = ex[0]
    assert seq == prompt + line * 3 and marks == [1 + t for t in repeat_marks(line * 3)] and marks


def test_unlikelihood_loss_is_minus_log_one_minus_p_and_lowers_the_marked_tokens():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7, dtype=torch.float64)
    seqs = torch.randint(0, 7, (2, 5))
    marks = torch.zeros(2, 5, dtype=torch.bool)
    marks[0, 2] = marks[1, 4] = True
    p = torch.softmax(logits, -1)
    want = -(torch.log(1 - p[0, 1, seqs[0, 2]]) + torch.log(1 - p[1, 3, seqs[1, 4]])) / 2
    assert torch.allclose(unlikelihood_loss(logits, seqs, marks), want.float())
    # A few steps on the loss alone make the model's marked tokens less likely.
    cfg = ModelConfig.tiny()
    w = init_weights(cfg, seed=3, device=torch.device("cpu"))
    seq = torch.randint(3, cfg.vocab_size, (1, 24))
    m = torch.zeros(1, 24, dtype=torch.bool)
    m[0, 12:] = True

    def marked_p():
        with torch.no_grad():
            lp = torch.softmax(forward(cfg, w, seq).logits[:, :-1].float(), -1)
            return lp.gather(-1, seq[:, 1:, None]).squeeze(-1)[m[:, 1:]].mean()

    def fit(loss_of, steps=15):
        opt = torch.optim.Adam(list(w.values()), lr=1e-2)
        for _ in range(steps):
            opt.zero_grad()
            loss_of(forward(cfg, w, seq).logits).backward()
            opt.step()

    # Learn the sequence first (the unlikelihood of a token the model already finds unlikely is ~0).
    fit(lambda logits: torch.nn.functional.cross_entropy(logits[0, :-1], seq[0, 1:]))
    learned = marked_p()
    assert learned > 0.3
    fit(lambda logits: unlikelihood_loss(logits, seq, m))
    assert marked_p() < 0.5 * learned


class LoopingTok:  # every token decodes to the same line: every continuation loops
    def decode(self, ids, skip_special_tokens=False):
        return "x = 1\n" * len(ids)


def looping_phase_inputs(updates: int):
    """A tiny model, phase arguments for `updates` counted updates, a training stream and 40 prompts
    (ids below 18 are special: they end a continuation)."""
    cfg = ModelConfig.tiny()
    w = init_weights(cfg, seed=1, device=torch.device("cpu"))
    args = argparse.Namespace(
        seed=0, unlikelihood_seconds=0.0, unlikelihood_updates=updates, unlikelihood_weight=1.0, lr=1e-3,
        min_lr_frac=0.1, batch_size=2, seq_len=16, dropout=0.0, balance_coef=0.01, grad_clip=1.0,
        unlikelihood_round=40,
    )  # fmt: skip
    stream = torch.randint(3, cfg.vocab_size, (400,))
    prompts = [[1, 20 + i, 300, 301] for i in range(40)]
    return cfg, w, args, stream, prompts


def test_the_unlikelihood_phase_updates_on_looping_continuations_for_the_counted_updates():
    cfg, w, args, stream, prompts = looping_phase_inputs(3)
    new, record = unlikelihood_phase(args, cfg, w, stream, prompts, LoopingTok(), torch.device("cpu"), lambda msg: None)
    assert record["updates"] == 3 and record["penalised_tokens"] > 0
    # 40 prompts a round, each continuation looping: two rounds feed three updates of UL_BATCH.
    assert record["looping_share_by_round"] == [1.0, 1.0]
    changed = ("model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight")
    assert all(not torch.equal(new[n], w[n]) for n in changed)
    assert all(not t.requires_grad or t.grad is None for t in w.values())  # the phase trained a copy
    # Given the main schedule's optimizer, the phase goes on with it, on its weights, in place, at the
    # schedule's final learning rate.
    before = {n: t.detach().clone() for n, t in w.items()}
    opt = torch.optim.AdamW(list(w.values()), lr=args.lr)
    same, _ = unlikelihood_phase(
        args, cfg, w, stream, prompts, LoopingTok(), torch.device("cpu"), lambda msg: None, opt
    )
    assert same is w and all(not torch.equal(w[n], before[n]) for n in changed)
    assert opt.param_groups[0]["lr"] == pytest.approx(args.lr * args.min_lr_frac) and len(opt.state) > 0


def test_the_unlikelihood_phase_undoes_the_update_that_costs_too_much_and_ends():
    cfg, w, args, stream, prompts = looping_phase_inputs(4)

    def phase(updates, costs=None):
        seen = []

        def val_cost(weights):
            seen.append({n: t.detach().clone() for n, t in weights.items()})
            return costs[len(seen) - 1]

        a = argparse.Namespace(**{**vars(args), "unlikelihood_updates": updates})
        guard = None if costs is None else val_cost
        new, record = unlikelihood_phase(
            a, cfg, w, stream, prompts, LoopingTok(), torch.device("cpu"), print, None, guard
        )
        return new, record, seen

    one, _, _ = phase(1)
    guarded, record, seen = phase(4, [0.0, UL_MAX_VAL_COST + 0.01, 0.0, 0.0])

    # The second update cost too much: undone, and the phase ended with the first update's weights
    # (to 1e-9: the CPU's embedding backward sums across threads in no fixed order, ~1e-11 apart;
    # an update moves weights by ~1e-4).
    def same(a, b):
        return all(torch.allclose(a[n], b[n], rtol=0, atol=1e-9) for n in w)

    assert record["updates"] == 1 and "update 2" in record["stopped"] and len(seen) == 2
    assert same(guarded, one)
    assert not same(seen[1], one)  # the undone update had changed them
    for cost in (1.0, math.nan):  # the first update too (or a NaN loss): the weights it started from
        first, record, _ = phase(4, [cost])
        assert record["updates"] == 0 and all(torch.equal(first[n], w[n]) for n in w)
    _, record, seen = phase(2, [0.0, 0.0])  # within the cost: every update, no stop
    assert record["updates"] == 2 and "stopped" not in record and len(seen) == 2


def test_a_phase_that_fails_or_costs_validation_loss_ships_the_weights_before_it(fake_stdlib, tmp_path, monkeypatch):
    plain = _run(fake_stdlib, tmp_path / "a", tmp_path / "da", "--max-steps", "2")
    ul = ("--max-steps", "2", "--unlikelihood-updates", "1")

    def spoiled(args, cfg, weights, *rest):  # a phase that wrecks the model
        record = {"updates": 1, "looping_share_by_round": [1.0], "wall_seconds": 0.0}
        return {n: torch.zeros_like(t) for n, t in weights.items()}, record

    # train_embedded imports the phase by name: main looks it up there, so that is where it is patched.
    monkeypatch.setattr(te, "unlikelihood_phase", spoiled)
    report = _run(fake_stdlib, tmp_path / "b", tmp_path / "db", *ul)
    assert report["unlikelihood"]["kept"] is False
    assert report["unlikelihood"]["val_loss_after"] > report["unlikelihood"]["val_loss_before"] + UL_MAX_VAL_COST

    def broken(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(te, "unlikelihood_phase", broken)
    failed = _run(fake_stdlib, tmp_path / "c", tmp_path / "dc", *ul)
    assert failed["unlikelihood"]["kept"] is False and "boom" in failed["unlikelihood"]["error"]
    for out in ("b", "c"):
        assert (tmp_path / out / "model.safetensors").read_bytes() == (
            tmp_path / "a" / "model.safetensors"
        ).read_bytes()
    assert plain["unlikelihood"] is None


# ---- a whole run ------------------------------------------------------------------------------------


def _run(stdlib: Path, out: Path, docs: Path, *extra: str) -> dict:
    return te.main(
        [
            "--device", "cpu", "--preset", "tiny", "--stdlib", str(stdlib), "--heldout", "6",
            "--eval-functions", "2", "--max-new-tokens", "4", "--seq-len", "32", "--batch-size", "2",
            "--loss-batches", "2", "--tool-examples", "5", "--tool-repeat", "2", "--vocab-size", "400",
            "--out-dir", str(out), "--docs-dir", str(docs), *extra,
        ]
    )  # fmt: skip


def test_three_step_cpu_run_writes_a_checkpoint_the_loader_reads(fake_stdlib, tmp_path, caplog):
    out, docs = tmp_path / "embedded", tmp_path / "docs"
    report = _run(fake_stdlib, out, docs, "--max-steps", "3")
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert report["training"]["steps"] == 3 and report["replay"].startswith("--steps 3 ")
    for key in ("heldout_loss", "completion_parse_rate", "chat_parse_rate", "tool_call_rate"):
        assert math.isfinite(report["metrics"][key])
    assert json.loads((docs / "embedded-model.json").read_text())["metrics"] == report["metrics"]
    assert report["metrics"]["reference_max_abs_logit_diff"] < 1e-3

    model = load(out, progress=False)
    assert model.config == ModelConfig.tiny() and model.weights["model.norm.weight"].dtype == torch.float32
    assert has_embedded(out)
    with caplog.at_level(logging.WARNING, logger="mk"):
        default, tok = load_default(path=out)
    assert not caplog.records
    assert default.config == ModelConfig.tiny() and tok.vocab_size <= 400
    assert tok.chat_template == tokenizer_files.CHAT_TEMPLATE and tok.eos_token_id == tokenizer_files.EOS_ID
    for name in tokenizer_files.SPECIAL_TOKENS:
        assert tok.encode(name, add_special_tokens=False) == [tokenizer_files.SPECIAL_IDS[name]]
    # The recorded expectation is what the loaded model's greedy decoding gives.
    exp = report["expectation"]
    ids = tok.encode(exp["prompt"])
    got = []
    for _ in range(len(exp["greedy_ids"])):
        got.append(int(default.logits(ids + got)[-1].argmax()))
    assert got == exp["greedy_ids"]


@pytest.fixture
def one_thread():
    """torch on one CPU thread for the test: its sums then have one order whatever else runs in the
    process (a test's engine threads left behind, say)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_runs_are_reproducible(fake_stdlib, tmp_path, one_thread):
    """Same seed and flags: the same weights byte for byte (CPU); the recorded replay flags too, an
    unlikelihood phase's counted updates included."""
    first = _run(
        fake_stdlib, tmp_path / "a", tmp_path / "da", "--max-steps", "2", "--unlikelihood-updates", "2",
        "--unlikelihood-round", "16",
    )  # fmt: skip
    assert "--unlikelihood-updates " in first["replay"] and first["unlikelihood"]["updates"] <= 2
    _run(fake_stdlib, tmp_path / "b", tmp_path / "db", *first["replay"].split())
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    other = _run(fake_stdlib, tmp_path / "c", tmp_path / "dc", "--max-steps", "2", "--seed", "1")
    assert (tmp_path / "a" / "model.safetensors").read_bytes() != (tmp_path / "c" / "model.safetensors").read_bytes()
    assert other["corpus"]["heldout_files"] == first["corpus"]["heldout_files"]  # the split ignores the seed


def test_training_needs_no_compiled_extension():
    """The device machine runs the script from python/ without mk's compiled module."""
    code = (
        "import sys, runpy; sys.modules['mk._native'] = None; "
        "runpy.run_path('scripts/train_embedded.py', run_name='not_main'); import mk.text.tokenizer, mk.model.reference"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO / "python")}
    subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, check=True, timeout=120)


def test_load_default_falls_back_to_the_random_tiny_model_with_a_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="mk"):
        model, tok = load_default(path=tmp_path / "nothing-here")
    assert model.config == ModelConfig.tiny() and tok.vocab_size <= 512
    assert any("no embedded model" in r.getMessage() for r in caplog.records)
    assert NAME == ("mk-embedded" if has_embedded() else FALLBACK_NAME)


# ---- the preset -------------------------------------------------------------------------------------


def test_embedded_preset_fits_the_megakernel_and_the_size_bounds():
    cfg = ModelConfig.embedded()
    assert cfg.head_dim == 128
    assert cfg.num_attention_heads // cfg.num_key_value_heads <= 8
    assert cfg.hidden_size % 32 == 0 and cfg.hidden_size <= 8192
    assert cfg.q_width % 32 == 0 and cfg.kv_width % 32 == 0
    assert cfg.intermediate_size % 32 == 0 and cfg.prefix_dense_intermediate_size % 32 == 0
    assert cfg.num_experts <= 512 and cfg.num_experts_per_tok <= 8 and cfg.vocab_size % 16 == 0
    assert cfg.eos_token_id == tokenizer_files.EOS_ID
    n = cfg.num_hidden_layers
    kinds = {(cfg.is_moe(i), cfg.is_sliding(i), cfg.needs_rope(i)) for i in range(n)}
    assert kinds == {(False, False, True), (True, True, True), (True, False, False)}
    assert cfg.layer_types == tuple("full_attention" if i % 4 == 0 else "sliding_attention" for i in range(n))
    assert cfg.sliding_window <= 512
    nbytes = 2 * sum(math.prod(s) for s in expected_shapes(cfg).values())
    assert nbytes <= 40_000_000  # the package stays small
    assert unshippable(cfg) is None  # returns from the device machine (shards of at most 15 MiB)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg


def test_geometry_changes_the_preset_and_refuses_unknown_or_invalid_fields():
    cfg = te.preset_config("embedded", "hidden_size=384, vocab_size=16384,num_hidden_layers=9")
    base = ModelConfig.embedded()
    assert (cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers) == (384, 16384, 9)
    assert cfg.layer_types == tuple("full_attention" if i % 4 == 0 else "sliding_attention" for i in range(9))
    assert cfg.num_experts == base.num_experts and cfg.rope_theta == base.rope_theta
    assert te.preset_config("tiny", None) == ModelConfig.tiny()
    for bad, why in [
        ("hidden=384", "not field=value"),
        ("hidden_size", "not field=value"),
        ("layer_types=x", "not field=value"),
        ("hidden_size=3.5", "is not a int"),
        ("num_experts_per_tok=99", "--geometry"),
    ]:
        with pytest.raises(SystemExit, match=why):
            te.preset_config("embedded", bad)


def test_a_dry_run_reports_the_size_and_the_megakernel_verdict(capsys):
    report = te.main(["--dry-run", "--device", "cpu", "--geometry", "vocab_size=16384"])
    cfg = te.preset_config("embedded", "vocab_size=16384")
    assert report["config"] == cfg.to_dict()
    assert report["parameters"] == sum(math.prod(s) for s in expected_shapes(cfg).values())
    assert report["megakernel"] == "the megakernel can serve it"
    assert "MB in bf16" in capsys.readouterr().out
    wide = te.main(["--dry-run", "--device", "cpu", "--geometry", "head_dim=64"])
    assert "head_dim is 64" in wide["megakernel"]
    with pytest.raises(SystemExit, match="exceeds the model's vocab_size"):
        te.main(["--dry-run", "--device", "cpu", "--vocab-size", "32768"])
    assert report["unshippable"] is None


def test_a_geometry_the_device_could_not_return_is_refused_before_training():
    # The embedding of 32768 x 384 is 24 MiB in bf16: one tensor over a 15 MiB shard.
    big_table = unshippable(te.preset_config("embedded", "vocab_size=32768,hidden_size=384"))
    assert big_table is not None and "model.embed_tokens.weight" in big_table and "shard" in big_table
    geometry = "vocab_size=16384,hidden_size=384,num_hidden_layers=8,intermediate_size=128,num_experts=32"
    many = unshippable(te.preset_config("embedded", geometry))  # 90 MB, no tensor over 12 MiB
    assert many is not None and "MiB returned" in many
    assert unshippable(te.preset_config("embedded", "vocab_size=16384,hidden_size=384")) is None
    with pytest.raises(SystemExit, match="over a 15 MiB shard"):
        te.main(["--device", "cpu", "--geometry", "vocab_size=32768,hidden_size=384"])


def test_a_checkpoint_larger_than_a_shard_is_written_in_shards_the_loader_reads(tmp_path):
    cfg = ModelConfig.tiny()
    w = synthetic_weights(cfg, seed=3, dtype=torch.bfloat16)
    tok = tokenizer_files.train_tokenizer(["def f(x):\n    return x + 1\n"] * 20, 300)
    total = sum(t.numel() * t.element_size() for t in w.values())
    size = write_shipped(tmp_path / "sharded", cfg, w, tok, shard_bytes=total // 3)
    shards = sorted(p.name for p in (tmp_path / "sharded").glob("*.safetensors"))
    assert len(shards) >= 3 and all(n.startswith("model-") for n in shards)
    assert all((tmp_path / "sharded" / n).stat().st_size <= total // 3 + 100_000 for n in shards)
    assert size == sum((tmp_path / "sharded" / n).stat().st_size for n in shards)
    loaded = load(tmp_path / "sharded", progress=False, dtype=torch.bfloat16)
    assert all(torch.equal(loaded.weights[n], t) for n, t in w.items())
    assert write_shipped(tmp_path / "one", cfg, w, tok) > total  # fits: one file (plus its header)
    assert [p.name for p in (tmp_path / "one").glob("*.safetensors")] == ["model.safetensors"]


def test_the_megakernel_runs_the_embedded_preset():
    """The Rust graph builder accepts the geometry and its task list, interpreted on the CPU (the
    megakernel's VM), equals the reference decode step for rows inside and past the sliding window."""
    graph = pytest.importorskip("mk.megakernel.graph")
    from mk.megakernel.buffers import StepBuffers
    from mk.megakernel.support import geometry_unsupported
    from mk.megakernel.vm import run_step
    from mk.model import PageAllocator

    cfg, max_pages, lengths = ModelConfig.embedded(), 8, [70, 300]
    assert geometry_unsupported(cfg) is None  # the engine's backend="auto" picks the megakernel on an H200
    model = Model(cfg, synthetic_weights(cfg, seed=1, dtype=torch.float32, std=0.05))
    alloc = PageAllocator(cfg.num_hidden_layers * max_pages * len(lengths), seed=1)
    kv = model.new_kv(alloc.num_free)
    gen = torch.Generator().manual_seed(2)
    tables, tokens = [], []
    for n in lengths:
        table = alloc.new_table(cfg, max_pages)
        alloc.ensure(table, n)
        model.forward(torch.randint(0, cfg.vocab_size, (n,), generator=gen), 0, kv, table)
        alloc.release_out_of_window(table, cfg, n)
        alloc.ensure(table, n + 1, from_pos=n)
        tables.append(table)
        tokens.append(int(torch.randint(0, cfg.vocab_size, (), generator=gen)))
    kv_ref = copy.deepcopy(kv)
    expected = model.decode(torch.tensor(tokens), torch.tensor(lengths), kv_ref, tables)

    g = graph.build(cfg, lengths, num_sms=132, check=True)
    assert g.slots == min(cfg.num_experts, len(lengths) * cfg.num_experts_per_tok)
    buf = StepBuffers.allocate(cfg, len(lengths), g.slots, g.max_splits, max_pages, 16, torch.float32, "cpu")
    buf.tokens[:] = torch.tensor(tokens, dtype=torch.int32)
    buf.positions[:] = torch.tensor(lengths, dtype=torch.int32)
    buf.block_tables[:] = torch.stack(tables, dim=1)
    run_step(model, kv, g, buf)
    assert (buf.logits - expected).norm() / expected.norm() < 1e-5
    assert torch.equal(buf.sampled.long(), expected.argmax(dim=-1))


# ---- the shipped model (once python/mk/embedded/ exists) --------------------------------------------


@pytest.mark.skipif(not has_embedded(), reason="python/mk/embedded/ has not been trained yet")
def test_shipped_embedded_model_loads_and_its_greedy_continuation_is_stable():
    model, tok = load_default()
    assert model.config == ModelConfig.embedded()
    shards = list(EMBEDDED_DIR.glob("*.safetensors"))
    assert isinstance(tok, Tokenizer) and sum(p.stat().st_size for p in shards) <= 40_000_000
    assert tok.hf.get_vocab_size() == model.config.vocab_size
    exp = json.loads((REPO / "docs" / "embedded-model.json").read_text())["expectation"]
    ids = tok.encode(exp["prompt"])
    got = []
    for _ in range(len(exp["greedy_ids"])):
        got.append(int(model.logits(ids + got)[-1].argmax()))
    assert got == exp["greedy_ids"]


# Recorded from the shipped checkpoint (fp32 reference model, CPU); its closest top-2 race is 0.071 logits,
# far above fp32 noise. (The model writes a comment, not the function: a 16.6M-parameter model.)
LONGER_PROMPT = "import os\n\n\ndef list_files(path):\n"
LONGER_GREEDY = [
    20,
    614,
    592,
    1336,
    737,
    368,
    1014,
    375,
    2955,
    313,
    1420,
    321,
    313,
    737,
    31,
    216,
    20,
    973,
    737,
    368,
    3060,
]


@pytest.mark.skipif(not has_embedded(), reason="python/mk/embedded/ has not been trained yet")
def test_shipped_model_greedy_continuation_of_a_longer_prompt_is_stable():
    model, tok = load_default()
    ids, got = tok.encode(LONGER_PROMPT), []
    for _ in LONGER_GREEDY:
        got.append(int(model.logits(ids + got)[-1].argmax()))
    assert got == LONGER_GREEDY, tok.decode(got)
    assert tok.decode(got).startswith("# The Python source file is used to build the files")
