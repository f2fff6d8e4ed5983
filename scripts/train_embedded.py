"""Train mk's embedded model: a small North-Mini-Code-architecture coder on the Python standard library.

Self-contained (torch, tokenizers and the mk package; no network), seeded and reproducible:

1. Corpus: every .py file of the running interpreter's standard library (`sysconfig` "stdlib"), except
   test folders (test/, tests/, idle_test/), site-/dist-packages and pydoc_data (a generated text dump).
   Files are ordered by SHA-256 of their path relative to the library root. Walking that order, whole files
   are held out until they give `--heldout` functions fit for the completion test (a docstring, 2-30 body
   lines; at most 4 from one file, picked by hash): those functions are the test set, their files the
   held-out loss set. The next files in that
   order, up to 2% of the bytes, are the validation set (loss curve, best-checkpoint choice). The rest is
   training text, minus any file that contains a copy of a held-out function (the stdlib has a few copies).
2. Documents: each training file (BOS + source + EOS, its trailing newlines dropped: a file's last
   newline before EOS taught the model that a bare newline ends the text, so after a docstring and a
   newline its first token was EOS); each fit training function alone, dedented, as the completion test
   prompts it; one chat example per fit training function, rendered with mk's Cohere-format chat template:
   either its signature and docstring as the user turn and its body as the answer, or "Write a Python
   function ..." with its docstring's first line and the whole function in a ```python block as the answer
   (half of them with a short reasoning block); 2,000 tool-call conversations (tools offered in
   the system turn, a `<|START_ACTION|>` block, tool results, a final answer), repeated.
3. Tokenizer: byte-level BPE (`mk.text.tokenizer_files.train_tokenizer`, the Cohere special tokens at mk's fixed
   ids) trained on the training documents only.
4. Model: `ModelConfig.embedded()` (or `--preset tiny`; `--geometry field=value,...` changes its fields,
   e.g. `hidden_size=384,vocab_size=16384`; `--dry-run` prints the size and the megakernel's verdict),
   trained with `mk.model.train.forward` (the reference model's math, batched; a test checks it equals
   `Model.logits`), AdamW, warmup then cosine decay, bf16 autocast on CUDA, a small load-balancing loss on
   the routers. Without `--steps`, the step count is fixed
   after a short timing calibration so that training fits `--time-budget` (capped by `--max-epochs`); the
   JSON's "replay" flags (`--steps N --max-steps M --warmup W --seed S`) rerun the same schedule and batches.
5. Outputs: the checkpoint of the lowest validation loss, in bf16 (`--out-dir`, by default
   python/mk/embedded/), written with `write_checkpoint` (in shards of at most SHIPPED_SHARD_BYTES when
   larger: the device machine returns files of at most 16 MiB); `<docs-dir>/embedded-model.json` (settings,
   metrics, curves, samples) and `<docs-dir>/embedded-model-loss.png` (when matplotlib is there). Metrics,
   all on the shipped bf16 weights: held-out next-token loss (and bits per byte), the share of the held-out
   functions whose greedy completion (signature + docstring as the prompt) makes the function parse with
   `ast.parse` and have a body (not `pass` or `...` alone), the same through the chat template, and the
   share of held-out tool prompts answered with a well-formed tool call. A table is printed last.

CPU smoke run: python scripts/train_embedded.py --max-steps 5 --device cpu  (defaults shrink on the CPU).
GPU run (the device machine): bash scripts/device-train.sh.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import os
import platform
import random
import re
import sys
import sysconfig
import textwrap
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from mk.config import ModelConfig, default_layer_types
from mk.model import load, write_checkpoint
from mk.model.names import expected_shapes
from mk.model.train import forward, init_weights
from mk.text import tokenizer_files

REPO = Path(__file__).resolve().parent.parent
SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "pydoc_data", "__pycache__"})
HOLDOUT_SALT = b"mk-embedded-holdout:"
BODY_LINES = (2, 30)  # body lines (after the docstring) of a function fit for the completion test
PROMPT_LINES = 30  # at most this many signature + docstring lines
VAL_FRACTION = 0.02
PER_FILE = 4  # test functions taken from one held-out file at most (variety)

# ================================================================================================
# Corpus
# ================================================================================================


@dataclass(frozen=True)
class Function:
    """A function fit for the completion test, dedented to column 0: `prompt` (decorators, signature and
    docstring, ending with a newline) + `body` (the rest, ending with a newline) is its source."""

    path: str  # relative to the library root, '/'-separated
    name: str
    lineno: int
    prompt: str
    body: str

    @property
    def source(self) -> str:
        return self.prompt + self.body


@dataclass
class Corpus:
    root: str
    train: dict[str, str]  # path -> text
    val: dict[str, str]
    heldout: dict[str, str]
    test_functions: list[Function]  # the held-out functions of the completion test
    train_functions: list[Function]  # fit functions of the training files (chat examples)
    leak_excluded: list[str] = field(default_factory=list)  # training files dropped for a held-out copy


def holdout_key(path: str) -> str:
    return hashlib.sha256(HOLDOUT_SALT + path.encode()).hexdigest()


def list_sources(root: Path) -> list[str]:
    """Relative paths of the library's .py files outside test folders, site-packages and pydoc_data."""
    out = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if SKIP_DIRS.intersection(rel.parts[:-1]) or rel.name.startswith("test_") or not p.is_file():
            continue
        out.append(rel.as_posix())
    return sorted(out)


def read_source(path: Path) -> str | None:
    """The file's text with '\\n' line ends, or None when it is not UTF-8 or does not parse here."""
    try:
        text = path.read_bytes().decode("utf-8").replace("\r\n", "\n")
        ast.parse(text)
    except (UnicodeDecodeError, SyntaxError, ValueError, OSError):
        return None
    return text


def extract_functions(path: str, text: str) -> list[Function]:
    """The functions (and methods) of a source file fit for the completion test, in source order."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.split("\n")
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or ast.get_docstring(node) is None:
            continue
        if len(node.body) < 2 or node.body[1].lineno <= node.body[0].end_lineno:
            continue
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        head = lines[first - 1 : node.body[0].end_lineno]
        body = lines[node.body[0].end_lineno : node.end_lineno]
        if len(head) > PROMPT_LINES or not BODY_LINES[0] <= sum(1 for x in body if x.strip()) <= BODY_LINES[1]:
            continue
        source = textwrap.dedent("\n".join(head + body) + "\n")
        try:
            parsed = ast.parse(source)
        except SyntaxError:
            continue  # a docstring or string literal below the def's indentation: dedent broke it
        if len(parsed.body) != 1 or not isinstance(parsed.body[0], ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        src_lines = source.split("\n")
        prompt = "\n".join(src_lines[: len(head)]) + "\n"
        found.append(Function(path, node.name, node.lineno, prompt, source[len(prompt) :]))
    return sorted(found, key=lambda f: f.lineno)


def _normalise(text: str) -> str:
    """Whitespace-insensitive form for the leak check: each line stripped, blank lines dropped."""
    return "\n".join(s for s in (x.strip() for x in text.split("\n")) if s)


def first_files(
    texts: dict, max_files: int | None, max_bytes: int | None, drop: Callable[[str], bool] | None = None
) -> tuple[dict, list]:
    """The first files of `texts` (in its order), at most `max_files` of them and `max_bytes` in all,
    leaving out (and listing) those `drop` refuses; files past the caps are not looked at."""
    kept: dict = {}
    dropped = []
    size = 0
    for path, text in texts.items():
        if (max_files is not None and len(kept) >= max_files) or (
            max_bytes is not None and size + len(text) > max_bytes
        ):
            break
        if drop is not None and drop(text):
            dropped.append(path)
            continue
        kept[path] = text
        size += len(text)
    return kept, dropped


def build_corpus(
    root: str | Path, heldout: int = 100, max_files: int | None = None, max_bytes: int | None = None
) -> Corpus:
    """Split the library at `root` into training, validation and held-out files (see the module doc).

    Deterministic: depends only on the files' paths and contents. `max_files` keeps the first that many
    training files in hash order (quick runs); the held-out and validation sets do not change with it.
    """
    root = Path(root)
    order = sorted(list_sources(root), key=holdout_key)
    texts: dict[str, str] = {}
    held: dict[str, str] = {}
    tests: list[Function] = []
    i = 0
    while len(tests) < heldout and i < len(order):
        path = order[i]
        i += 1
        text = read_source(root / path)
        if text is None:
            continue
        fit = sorted(extract_functions(path, text), key=lambda f: holdout_key(f"{f.path}:{f.lineno}"))
        if fit:
            held[path] = text
            tests.extend(fit[: min(PER_FILE, heldout - len(tests))])
    if len(tests) < heldout:
        raise ValueError(f"{root}: only {len(tests)} functions fit for the completion test, {heldout} wanted")

    rest = [p for p in order[i:]]
    total = sum((root / p).stat().st_size for p in rest)
    val: dict[str, str] = {}
    val_bytes = 0
    j = 0
    while j < len(rest) and val_bytes < VAL_FRACTION * total:
        text = read_source(root / rest[j])
        if text is not None:
            val[rest[j]] = text
            val_bytes += len(text)
        j += 1
    candidates = rest[j:]
    if max_files is not None:
        candidates = candidates[: 2 * max_files]  # a margin for unreadable and leaking files
    for path in candidates:
        text = read_source(root / path)
        if text is not None:
            texts[path] = text

    # Leak guard: a training file holding a copy of a held-out function is dropped.
    needles = [_normalise(f.source) for f in tests]
    excluded = []
    for path in list(texts):
        hay = _normalise(texts[path])
        if any(n in hay for n in needles):
            excluded.append(path)
            del texts[path]
    texts = first_files(texts, max_files, max_bytes)[0]
    train_functions = [f for path, text in texts.items() for f in extract_functions(path, text)]
    return Corpus(str(root), texts, val, held, tests, train_functions, excluded)


def pick_test_functions(files: dict[str, str], count: int) -> list[Function]:
    """Up to `count` functions fit for the completion test from `files` (path -> text): files in hash
    order, at most PER_FILE from one, picked by hash."""
    found: list[Function] = []
    for path in sorted(files, key=holdout_key):
        fit = sorted(extract_functions(path, files[path]), key=lambda f: holdout_key(f"{f.path}:{f.lineno}"))
        found.extend(fit[: min(PER_FILE, count - len(found))])
        if len(found) >= count:
            break
    return found


def _code_corpus():
    """scripts/code_corpus.py, imported by name (once: its worker processes pickle its functions by name)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import code_corpus

    return code_corpus


def build_site_corpus(
    packages: list,
    held_out: set[str],
    heldout: int,
    max_files: int | None = None,
    workers: int = 1,
    max_bytes: int | None = None,
) -> tuple[Corpus, dict]:
    """The corpus of installed packages (scripts/code_corpus.py: deduplicated, tests and generated files
    dropped) with whole packages held out: their functions are the completion test, their files the
    held-out loss set; the first training files in hash order, up to 2% of the bytes, are the validation
    set. Returns the corpus and code_corpus's manifest."""
    built = _code_corpus().build(packages, held_out, workers)
    held = {path: text for texts in built.held_out.values() for path, text in texts.items()}
    tests = pick_test_functions(held, heldout)
    if len(tests) < heldout:
        raise ValueError(f"held-out packages give only {len(tests)} functions fit for the completion test")
    order = sorted(built.train, key=holdout_key)
    total = sum(len(built.train[p]) for p in order)
    val: dict[str, str] = {}
    j = val_bytes = 0
    while j < len(order) and val_bytes < VAL_FRACTION * total:
        val[order[j]] = built.train[order[j]]
        val_bytes += len(val[order[j]])
        j += 1
    needles = [_normalise(f.source) for f in tests]  # a held-out function copied inside a larger file
    # The leak check stops with the caps: it scans every byte it is given.
    texts, excluded = first_files(
        {p: built.train[p] for p in order[j:]}, max_files, max_bytes, lambda t: any(n in _normalise(t) for n in needles)
    )
    train_functions = [f for path, text in texts.items() for f in extract_functions(path, text)]
    corpus = Corpus(SITE, texts, val, held, tests, train_functions, excluded)
    return corpus, built.manifest


# ================================================================================================
# Documents: raw files, chat examples, tool-call conversations
# ================================================================================================

# The code of a request is fenced: a user turn that ended with a bare docstring and its newline taught
# the model that EOS (<|END_OF_TURN_TOKEN|>) follows a docstring's newline, which is how the completion
# test's prompts end (every first token was EOS).
CHAT_ASKS = (
    "```python\n{code}```",
    "Complete this Python function:\n\n```python\n{code}```",
    "Write the body of `{name}`.\n\n```python\n{code}```",
    "Implement the following function.\n\n```python\n{code}```",
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a source file of the Python standard library.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run_python",
            "description": "Run a Python snippet and return what it prints.",
            "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search_stdlib",
            "description": "List the standard-library files that mention a name.",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "list_directory",
            "description": "List the modules of a standard-library package.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        },
    },
]
TOOL_NAMES = frozenset(t["function"]["name"] for t in TOOLS)


def _pick(key: str, n: int) -> int:
    return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % n


def _summary(fn: Function) -> str:
    doc = ast.get_docstring(ast.parse(fn.source).body[0]) or ""
    return (doc.strip().split("\n")[0].strip() or f"it is the function {fn.name}").rstrip(".") + "."


# "Write a Python function ..." requests: the function's docstring summary as the task, the whole
# function as the answer.
WRITE_ASKS = (
    "Write a Python function that does this: {summary}",
    "Write a Python function `{name}`. {summary}",
    "Write a Python function. {summary}",
)


def chat_example(fn: Function) -> str:
    """One chat conversation for a training function: its prompt as the user turn and its body as the
    answer, or (one in two) a request to write it from its summary, answered with the function in a
    fenced block."""
    key = f"{fn.path}:{fn.lineno}"
    if _pick(key + "/write", 2):
        ask = WRITE_ASKS[_pick(key, len(WRITE_ASKS))].format(summary=_summary(fn), name=fn.name)
        answer = {"role": "assistant", "content": f"```python\n{fn.source}```"}
        reasoning = f"`{fn.name}`: {_summary(fn)} I write the function."
    else:
        ask = CHAT_ASKS[_pick(key, len(CHAT_ASKS))].format(code=fn.prompt, name=fn.name)
        answer = {"role": "assistant", "content": fn.body}
        reasoning = f"`{fn.name}`: {_summary(fn)} I write its body."
    if _pick(key + "/think", 2):
        answer["reasoning"] = reasoning
    return tokenizer_files.render_chat([{"role": "user", "content": ask}, answer])


def _call(i: int, name: str, **params) -> dict:
    return {"id": str(i), "type": "function", "function": {"name": name, "arguments": params}}


SITE = "site-packages"  # Corpus.root of build_site_corpus's corpora


def import_path(path: str, site: bool) -> str:
    """A corpus path as the module's import path: a site-packages corpus files every module under its
    distribution's folder (scripts/code_corpus.py), which is no part of the name. Shown with it (a
    question about `networkx.networkx.algorithms`, a read_file of networkx/networkx/...), the repeated
    folder made a model loop while copying the path into its answer (most of its malformed tool
    calls)."""
    return path.split("/", 1)[1] if site and "/" in path else path


def tool_prompt(fn: Function, site: bool) -> list[dict]:
    """The user turn of a read_file conversation (used for training and, on held-out functions, for eval)."""
    module = import_path(fn.path, site)[:-3].replace("/", ".").removesuffix(".__init__")
    return [{"role": "user", "content": f"What does `{fn.name}` in the `{module}` module do? Look it up."}]


def tool_examples(corpus: Corpus, count: int, seed: int) -> list[str]:
    """`count` tool-call conversations in the template's format, built from the training files (paths
    and modules as imported: `import_path`)."""
    rng = random.Random(seed)
    site = corpus.root == SITE

    def shown(path: str) -> str:
        return import_path(path, site)

    fns = sorted(corpus.train_functions, key=lambda f: (f.path, f.lineno))
    files = sorted(shown(p) for p in corpus.train)
    packages = sorted({p.rsplit("/", 1)[0] for p in files if "/" in p})

    if not fns:
        return []
    out = []
    for i in range(count):
        kind = i % 5
        if kind == 0:  # read a file, answer from it
            fn = rng.choice(fns)
            msgs = tool_prompt(fn, site) + [
                {
                    "role": "assistant",
                    "content": f"I will read {shown(fn.path)} and find `{fn.name}`.",
                    "tool_calls": [_call(0, "read_file", path=shown(fn.path))],
                },
                {"role": "tool", "tool_call_id": "0", "content": fn.prompt},
                {"role": "assistant", "content": f"`{fn.name}` ({shown(fn.path)}): {_summary(fn)}"},
            ]
        elif kind == 1:  # run code
            a, b = rng.randint(2, 999), rng.randint(2, 99)
            op = rng.choice(["+", "-", "*", "//", "%", "**"])
            if op == "**":
                b = rng.randint(2, 6)
            expr = f"{a} {op} {b}"
            value = eval(expr)  # noqa: S307 - integers and an operator chosen above
            msgs = [
                {"role": "user", "content": f"What is {expr} in Python?"},
                {
                    "role": "assistant",
                    "content": "I will run it.",
                    "tool_calls": [_call(0, "run_python", code=f"print({expr})")],
                },
                {"role": "tool", "tool_call_id": "0", "content": f"{value}\n"},
                {"role": "assistant", "content": f"`{expr}` is {value}."},
            ]
        elif kind == 2:  # search
            fn = rng.choice(fns)
            hits = sorted(shown(p) for p, t in corpus.train.items() if fn.name in t)[:4]
            msgs = [
                {"role": "user", "content": f"Which standard-library files mention `{fn.name}`?"},
                {
                    "role": "assistant",
                    "content": "I will search the library.",
                    "tool_calls": [_call(0, "search_stdlib", query=fn.name)],
                },
                {"role": "tool", "tool_call_id": "0", "content": json.dumps(hits)},
                {"role": "assistant", "content": f"`{fn.name}` appears in " + ", ".join(hits) + "."},
            ]
        elif kind == 3 and packages:  # list a package
            pkg = rng.choice(packages)
            mods = sorted(p.rsplit("/", 1)[1] for p in files if p.rsplit("/", 1)[0] == pkg)
            msgs = [
                {"role": "user", "content": f"Which modules does the `{pkg.replace('/', '.')}` package have?"},
                {
                    "role": "assistant",
                    "content": f"I will list {pkg}.",
                    "tool_calls": [_call(0, "list_directory", path=pkg)],
                },
                {"role": "tool", "tool_call_id": "0", "content": json.dumps(mods)},
                {"role": "assistant", "content": f"{len(mods)} modules: " + ", ".join(mods) + "."},
            ]
        else:  # two calls in one action block
            f1, f2 = rng.choice(fns), rng.choice(fns)
            msgs = [
                {"role": "user", "content": f"Compare `{f1.name}` and `{f2.name}`."},
                {
                    "role": "assistant",
                    "content": f"I will read {shown(f1.path)} and {shown(f2.path)}.",
                    "tool_calls": [
                        _call(0, "read_file", path=shown(f1.path)),
                        _call(1, "read_file", path=shown(f2.path)),
                    ],
                },
                {"role": "tool", "tool_call_id": "0", "content": f1.prompt},
                {"role": "tool", "tool_call_id": "1", "content": f2.prompt},
                {"role": "assistant", "content": f"`{f1.name}`: {_summary(f1)} `{f2.name}`: {_summary(f2)}"},
            ]
        out.append(tokenizer_files.render_chat(msgs, tools=TOOLS))
    return out


@dataclass
class Documents:
    code: list[str]  # raw source files (tokenized as BOS + text + EOS)
    functions: list[str]  # the fit training functions alone, dedented (tokenized as code)
    chat: list[str]  # rendered conversations (they carry their own BOS and end with EOS)
    tools: list[str]  # distinct tool conversations (repeated in the stream)


def build_documents(corpus: Corpus, tool_count: int, seed: int) -> Documents:
    return Documents(
        code=list(corpus.train.values()),
        functions=[f.source for f in corpus.train_functions],
        chat=[chat_example(f) for f in corpus.train_functions],
        tools=tool_examples(corpus, tool_count, seed),
    )


# ================================================================================================
# Tokens
# ================================================================================================


def build_tokenizer(docs: Documents, vocab_size: int, max_code_bytes: int | None = None):
    """BPE on the chat and tool documents and the first code files up to `max_code_bytes` (the
    merges settle long before a large corpus ends; training on all of it costs minutes)."""
    code = list(first_files(dict(enumerate(docs.code)), None, max_code_bytes)[0].values())
    return tokenizer_files.train_tokenizer([*code, *docs.chat, *docs.tools], vocab_size)


def encode_code(tok, texts: Sequence[str]) -> list[list[int]]:
    """BOS + text + EOS, without the text's trailing newlines: EOS follows code, never a bare newline
    (which the completion test's prompts may end with)."""
    bos, eos = tokenizer_files.BOS_ID, tokenizer_files.EOS_ID
    texts = [t.rstrip("\n") for t in texts]
    return [[bos, *e.ids, eos] for e in tok.encode_batch(texts, add_special_tokens=False)]


def encode_chat(tok, texts: Sequence[str]) -> list[list[int]]:
    return [e.ids for e in tok.encode_batch(list(texts), add_special_tokens=False)]


def token_stream(pieces: list[list[int]], seed: int) -> torch.Tensor:
    """The documents in a seeded random order, concatenated: int64 [n]."""
    order = list(range(len(pieces)))
    random.Random(seed).shuffle(order)
    if not order:
        return torch.zeros(0, dtype=torch.long)
    # One array per document, then one copy (a flat Python list of every token would take GBs).
    return torch.cat([torch.tensor(pieces[i], dtype=torch.long) for i in order])


# ================================================================================================
# Training
# ================================================================================================

DEFAULTS = {  # per device type; every one can be given on the command line
    "cuda": dict(batch_size=64, seq_len=1024, eval_every=200, eval_batches=16, loss_batches=None, max_new_tokens=256),
    "cpu": dict(batch_size=4, seq_len=128, eval_every=50, eval_batches=2, loss_batches=16, max_new_tokens=24),
}
CPU_EVAL_FUNCTIONS = 8


def lr_at(step: int, total: int, peak: float, warmup: int, floor: float) -> float:
    """Linear warmup to `peak`, then cosine decay to `floor`·peak at step `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def batch_at(stream: torch.Tensor, batch: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    """[batch, seq + 1] windows at seeded random offsets of the stream."""
    starts = torch.randint(0, len(stream) - seq - 1, (batch,), generator=gen)
    return stream[(starts[:, None] + torch.arange(seq + 1)).to(stream.device)]


def autocast(device: torch.device):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else _Null()


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@torch.no_grad()
def stream_loss(
    cfg, weights, stream: torch.Tensor, seq: int, batch: int, device, max_batches=None
) -> tuple[float, torch.Tensor]:
    """Mean next-token loss (nats) over non-overlapping windows of the stream (all of it by default, else
    `max_batches` batches of evenly spaced windows), and the mean expert load [MoE layers, experts]."""
    n = (len(stream) - 1) // seq
    if n == 0:
        return float("nan"), torch.zeros(0)
    starts = torch.arange(n) * seq
    if max_batches is not None:
        starts = starts[torch.linspace(0, n - 1, min(n, max_batches * batch)).long()]
    total, count, load = 0.0, 0, 0.0
    for i in range(0, len(starts), batch):
        s = starts[i : i + batch]
        win = stream[s[:, None] + torch.arange(seq + 1)].to(device)
        with autocast(device):
            out = forward(cfg, weights, win[:, :-1])
        loss = F.cross_entropy(out.logits.float().flatten(0, 1), win[:, 1:].flatten(), reduction="sum")
        total += float(loss)
        count += win[:, 1:].numel()
        load = load + out.expert_load.float().cpu() * len(s)
    return total / count, load / len(starts)


def ul_on(args) -> bool:
    return args.unlikelihood_updates is not None or args.unlikelihood_seconds > 0


def ul_reserved(args) -> float:
    """Seconds of --time-budget the unlikelihood phase takes (a replay's counted updates take none)."""
    return args.unlikelihood_seconds if args.unlikelihood_updates is None else 0.0


def main_loss(args, cfg, weights, win: torch.Tensor, device) -> tuple:
    """The training objective on windows [batch, seq + 1]: (next-token loss, it plus the routers'
    balance term, the forward's output)."""
    with autocast(device):
        out = forward(cfg, weights, win[:, :-1], dropout=args.dropout)
    lm = F.cross_entropy(out.logits.float().flatten(0, 1), win[:, 1:].flatten())
    return lm, lm + args.balance_coef * out.balance_loss, out


def optimizer_step(args, weights, opt, loss: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(list(weights.values()), args.grad_clip)
    opt.step()


def train(args, cfg: ModelConfig, train_stream, val_stream, device: torch.device, log) -> dict:
    """The training loop; returns the best weights (lowest validation loss) and the history."""
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    weights = init_weights(cfg, seed=args.seed, device=device)
    decay = [t for t in weights.values() if t.dim() > 1]
    no_decay = [t for t in weights.values() if t.dim() <= 1]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=device.type == "cuda",
    )
    tokens_per_step = args.batch_size * args.seq_len
    epoch_steps = max(1, len(train_stream) // tokens_per_step)
    cap = max(1, int(args.max_epochs * epoch_steps))
    # total: the schedule's length; stop_at: where training stops (earlier only with --steps and --max-steps).
    if args.steps is not None:
        total, how = args.steps, "--steps"
        stop_at = min(total, args.max_steps or total)
    else:
        total, how = min(cap, args.max_steps or cap), "max-epochs cap" if not args.max_steps else "--max-steps"
        stop_at = total
    # Fixed before the first step, so a calibrated run replays exactly (report["replay"]).
    warmup = args.warmup if args.steps is not None or args.warmup < total // 2 else max(1, total // 10)
    budget = args.time_budget * 60 - ul_reserved(args)
    calib = (10, 60)  # steps timed (inside the warmup) to size the run when no --steps is given
    stream_dev = train_stream.to(device)

    hist = {k: [] for k in ("step", "tokens", "train_loss", "lr", "val_step", "val_loss")}
    hist.update(val_expert_load_min=[], val_expert_load_max=[])
    best = {"loss": float("inf"), "step": -1, "weights": None}
    run_loss = torch.zeros((), device=device)
    run_n = 0
    t0 = time.perf_counter()
    t_calib = None
    stopped_early = diverged = False
    step = 0

    def evaluate(step: int) -> None:
        v, load = stream_loss(cfg, weights, val_stream, args.seq_len, args.batch_size, device, args.eval_batches)
        hist["val_step"].append(step)
        hist["val_loss"].append(v)
        hist["val_expert_load_min"].append(float(load.min()) if load.numel() else 0.0)
        hist["val_expert_load_max"].append(float(load.max()) if load.numel() else 0.0)
        if v < best["loss"]:
            best.update(loss=v, step=step, weights={n: t.detach().clone() for n, t in weights.items()})
        log(f"step {step:6d}  val loss {v:.4f}  ({time.perf_counter() - t0:.0f} s)")

    while step < stop_at:
        if args.steps is None and step == calib[0]:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t_calib = time.perf_counter()
        if args.steps is None and step == calib[1] and t_calib is not None:
            if device.type == "cuda":
                torch.cuda.synchronize()
            per_step = (time.perf_counter() - t_calib) / (calib[1] - calib[0])
            left = budget - (time.perf_counter() - t0)
            by_time = calib[1] + int(0.95 * left / (per_step * (1 + args.eval_batches / (2 * args.eval_every))))
            if by_time < total:
                total, how = max(calib[1] + 1, by_time), "time budget"
            stop_at = total
            log(f"calibration: {per_step * 1000:.1f} ms/step -> {total} steps ({how})")
        lr = lr_at(step, total, args.lr, warmup, args.min_lr_frac)
        for g in opt.param_groups:
            g["lr"] = lr
        win = batch_at(stream_dev, args.batch_size, args.seq_len, gen.manual_seed(args.seed * 1_000_003 + step))
        lm, loss, out = main_loss(args, cfg, weights, win, device)
        optimizer_step(args, weights, opt, loss)
        run_loss += lm.detach()
        run_n += 1
        step += 1
        if step % args.log_every == 0 or step == stop_at:
            hist["step"].append(step)
            hist["tokens"].append(step * tokens_per_step)
            hist["train_loss"].append(float(run_loss) / run_n)
            hist["lr"].append(lr)
            run_loss.zero_()
            run_n = 0
            if not math.isfinite(hist["train_loss"][-1]):
                log(f"training loss is {hist['train_loss'][-1]} at step {step}: stopping (best weights kept)")
                diverged = True
                break
            if step % (args.log_every * 10) == 0 or step == stop_at:
                load = out.expert_load
                log(
                    f"step {step:6d}/{total}  loss {hist['train_loss'][-1]:.4f}  lr {lr:.2e}  "
                    f"expert load min/max {float(load.min()):.3f}/{float(load.max()):.3f}  "
                    f"({time.perf_counter() - t0:.0f} s)"
                )
        if step % args.eval_every == 0 and step < stop_at:
            evaluate(step)
        if time.perf_counter() - t0 > budget * 1.05:
            log(f"time budget reached at step {step} of {total}: stopping")
            stopped_early = True
            break
    evaluate(step)
    elapsed = time.perf_counter() - t0
    if best["weights"] is None:  # no finite validation loss at all: ship the last weights, flagged
        best["weights"] = {n: t.detach().clone() for n, t in weights.items()}
        diverged = True
    return {
        "weights": best["weights"],
        "state": (weights, opt),  # the last weights and their optimizer (the unlikelihood phase goes on from them)
        "best_step": best["step"],
        "best_val_loss": best["loss"],
        "steps": step,
        "planned_steps": total,
        "steps_set_by": how,
        "warmup": warmup,
        "stopped_early": stopped_early,
        "diverged": diverged,
        "tokens_seen": step * tokens_per_step,
        "epochs": step * tokens_per_step / len(train_stream),
        "train_seconds": elapsed,
        "tokens_per_second": step * tokens_per_step / elapsed,
        "history": hist,
    }


# ================================================================================================
# Unlikelihood fine-tuning: greedy loops
# ================================================================================================

LOOP_REPEATS = 3  # a non-blank line repeated more often than this in a greedy continuation is a loop
# The phase's generation: training-function prompts of at most UL_PROMPT_TOKENS tokens, UL_NEW_TOKENS greedy
# tokens each, --unlikelihood-round of them at once (one forward serves the whole round), UL_BATCH looping
# continuations per update.
UL_PROMPT_TOKENS, UL_NEW_TOKENS, UL_BATCH = 96, 48, 32
UL_NGRAM = 4  # a token that ends a repeat of an earlier n-gram of its continuation is a candidate
UL_REPEAT_SHARE = 0.5  # a continuation half of whose tokens are such candidates loops (within a line too)
# The validation loss the phase may cost; past it the weights from before the phase are shipped. (A
# phase without this bound, with a fresh AdamW, cost several times as much in a few updates, and its
# model put its loops inside lines instead: docs/EMBEDDED.md.)
UL_MAX_VAL_COST = 0.03


def loop_free(text: str, repeats: int = LOOP_REPEATS) -> bool:
    """No non-blank line of `text` occurs more than `repeats` times (the #13 bar's rule)."""
    lines = [line.strip() for line in text.split("\n") if line.strip()]
    return all(lines.count(line) <= repeats for line in set(lines))


def repeat_marks(ids: Sequence[int], n: int = UL_NGRAM) -> list[int]:
    """Positions t of `ids` whose n-gram ending at t occurred earlier in `ids` (ending before t): the
    tokens that continue a verbatim repeat, the candidates of sequence-level unlikelihood training
    (Welleck et al., 2020)."""
    seen: set[tuple[int, ...]] = set()
    marks = []
    for t in range(n - 1, len(ids)):
        gram = tuple(ids[t - n + 1 : t + 1])
        if gram in seen:
            marks.append(t)
        seen.add(gram)
    return marks


def unlikelihood_loss(logits: torch.Tensor, seqs: torch.Tensor, marks: torch.Tensor) -> torch.Tensor:
    """Mean of -log(1 - p(token)) over the marked positions: logits [B, T, V] of seqs [B, T] (position t's
    logits predict token t + 1), marks [B, T] bool on the predicted tokens (column 0 never marked)."""
    p = F.softmax(logits[:, :-1].float(), -1).gather(-1, seqs[:, 1:, None]).squeeze(-1)
    ul = -torch.log((1 - p).clamp_min(1e-5))
    m = marks[:, 1:].to(ul.dtype)
    return (ul * m).sum() / m.sum().clamp_min(1)


def looping_examples(tok, prompts: list[list[int]], outs: list[list[int]], stop_ids: set[int]) -> list:
    """(prompt + continuation, marked positions) of each continuation that loops: a line repeated more
    than twice (stricter than the bar, so the phase also sees the loops before they reach it), or half
    its tokens closing a repeated n-gram (a loop inside one line, which the line rule misses)."""
    examples = []
    for prompt, out in zip(prompts, outs, strict=True):
        cont = out[: next((i for i, t in enumerate(out) if t in stop_ids), len(out))]
        marks = repeat_marks(cont)
        line_loop = not loop_free(tok.decode(cont, skip_special_tokens=False), repeats=2)
        if marks and (line_loop or len(marks) >= UL_REPEAT_SHARE * len(cont)):
            examples.append((prompt + cont, [len(prompt) + t for t in marks]))
    return examples


def unlikelihood_phase(
    args, cfg, weights, train_stream, prompts: list[list[int]], tok, device, log, opt=None, val_cost=None
) -> tuple:
    """`--unlikelihood-seconds` of fine-tuning after the main schedule: each update is the main loss on a
    training batch plus `--unlikelihood-weight` times the unlikelihood of the repeated tokens of the
    model's own greedy continuations of training-function prompts that loop, regenerated whenever the
    looping ones of the last round are used up, at the schedule's final learning rate. `opt`: the main
    schedule's AdamW over `weights` (the last weights), which the phase goes on with (a fresh AdamW's
    first updates are a full learning rate in every weight); without it, a copy of `weights` and a
    new AdamW. `val_cost(weights)`: what the weights cost in validation loss against the phase's start;
    after every update past UL_MAX_VAL_COST the phase undoes that update and ends (the first two runs
    spent 0.18 and 0.28 nats before a guard at the end dropped the whole phase). Returns the new
    weights and the phase's record (the looping share of each round: the loop rate on training
    prompts as it falls; `stopped`: why it ended before its updates or seconds, if it did)."""
    specials = set(tokenizer_files.SPECIAL_IDS.values())
    gen = torch.Generator().manual_seed(args.seed + 1)
    rng = random.Random(args.seed)
    stream_dev = train_stream.to(device)
    pool: list = []
    if opt is None:
        weights = {n: t.detach().clone().requires_grad_(True) for n, t in weights.items()}
        opt = torch.optim.AdamW(list(weights.values()), lr=args.lr, betas=(0.9, 0.95))
    for g in opt.param_groups:
        g["lr"] = args.lr * args.min_lr_frac
    rounds, updates, penalised, t0 = [], 0, 0, time.perf_counter()
    record = {"seconds": args.unlikelihood_seconds, "weight": args.unlikelihood_weight, "ngram": UL_NGRAM}

    def more() -> bool:  # --unlikelihood-updates (a replay) counts updates; else the time bound
        if args.unlikelihood_updates is not None:
            return updates < args.unlikelihood_updates
        return time.perf_counter() - t0 < args.unlikelihood_seconds

    while more():
        if not pool:
            batch = rng.sample(prompts, min(len(prompts), args.unlikelihood_round))
            outs = greedy(cfg, weights, batch, UL_NEW_TOKENS, lambda ids: ids[-1] in specials, device, len(batch))
            pool = looping_examples(tok, batch, outs, specials)
            rounds.append(len(pool) / max(1, len(batch)))
            if not pool:
                log("unlikelihood: a round of continuations without a loop: the phase ends")
                break
        take, pool = pool[:UL_BATCH], pool[UL_BATCH:]
        width = max(len(s) for s, _ in take)
        seqs = torch.zeros(len(take), width, dtype=torch.long)
        marks = torch.zeros(len(take), width, dtype=torch.bool)
        for r, (s, m) in enumerate(take):
            seqs[r, : len(s)] = torch.tensor(s)
            marks[r, m] = True
        seqs, marks = seqs.to(device), marks.to(device)
        lm, loss, _ = main_loss(args, cfg, weights, batch_at(stream_dev, args.batch_size, args.seq_len, gen), device)
        with autocast(device):
            ul_logits = forward(cfg, weights, seqs).logits
        ul = unlikelihood_loss(ul_logits, seqs, marks)
        undo = {n: t.detach().clone() for n, t in weights.items()} if val_cost is not None else None
        optimizer_step(args, weights, opt, loss + args.unlikelihood_weight * ul)
        if undo is not None and not (cost := val_cost(weights)) <= UL_MAX_VAL_COST:  # NaN included
            with torch.no_grad():
                for n, t in weights.items():
                    t.copy_(undo[n])
            record["stopped"] = f"update {updates + 1} cost {cost:.4f} nats of validation loss: undone"
            log(f"unlikelihood: {record['stopped']}; the phase ends")
            break
        updates += 1
        penalised += int(marks.sum())
        if updates % 20 == 0:
            log(
                f"unlikelihood update {updates}: lm {float(lm):.4f}  ul {float(ul):.4f}  looping share of the "
                f"last round {rounds[-1]:.2f}  ({time.perf_counter() - t0:.0f} s)"
            )
    record.update(updates=updates, penalised_tokens=penalised, looping_share_by_round=rounds)
    record["wall_seconds"] = time.perf_counter() - t0
    return weights, record


# ================================================================================================
# Evaluation
# ================================================================================================

# A line that starts at column 0: the (dedented) function has ended.
_ENDED = re.compile(r"\n(?=\S)")


def cut_completion(text: str, finished: bool) -> str:
    """The part of a greedy continuation of a function's prompt (which ends at its docstring's closing
    quotes, without the newline) that belongs to the function: up to and including the newline before the
    first line at column 0; without one, the whole text when generation stopped on its own, else up to the
    last newline (no half-written line)."""
    m = _ENDED.search(text)
    if m is not None:
        return text[: m.start() + 1]
    return text if finished else text[: text.rfind("\n") + 1]


def _placeholder(stmt: ast.stmt) -> bool:
    """`pass` or a bare `...`: a statement that is not a body."""
    is_ellipsis = isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and stmt.value.value is Ellipsis
    return isinstance(stmt, ast.Pass) or is_ellipsis


def parses_with_body(source: str) -> bool:
    """`source` parses and is one function with at least one statement after its docstring, not
    `pass` or `...` alone."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return False
    fn = tree.body[0] if len(tree.body) == 1 else None
    if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) or len(fn.body) < 2:
        return False
    return not all(_placeholder(stmt) for stmt in fn.body[1:])


@torch.no_grad()
def greedy(cfg, weights, prompts: list[list[int]], max_new: int, stop, device, batch: int) -> list[list[int]]:
    """Greedy continuations (full recomputation, right-padded batches) until `stop(ids)` or `max_new`."""
    outs: list[list[int]] = [[] for _ in prompts]
    for b0 in range(0, len(prompts), batch):
        active = list(range(b0, min(b0 + batch, len(prompts))))
        for _ in range(max_new):
            if not active:
                break
            seqs = [prompts[i] + outs[i] for i in active]
            width = max(map(len, seqs))
            ids = torch.zeros(len(seqs), width, dtype=torch.long)
            for r, s in enumerate(seqs):
                ids[r, : len(s)] = torch.tensor(s)
            last = torch.tensor([len(s) - 1 for s in seqs], device=device)
            with autocast(device):
                logits = forward(cfg, weights, ids.to(device)).logits
            nxt = logits[torch.arange(len(seqs), device=device), last].argmax(-1).tolist()
            keep = []
            for i, t in zip(active, nxt, strict=True):
                outs[i].append(t)
                if not stop(outs[i]):
                    keep.append(i)
            active = keep
    return outs


def evaluate_completions(cfg, weights, tok, fns: list[Function], args, device) -> dict:
    """Completion mode: BOS + signature + docstring, greedy until the function ends (a line at column 0,
    a special token or max_new_tokens); the result counts when prompt + continuation parses as one
    function with a body (`parses_with_body`).

    The prompt stops at the docstring's closing quotes: byte-level BPE merges a newline with the next
    line's indentation, so a prompt ending in a bare newline token would be one the model never saw."""
    specials = set(tokenizer_files.SPECIAL_IDS.values())

    def stop(ids):
        return ids[-1] in specials or _ENDED.search(tok.decode(ids, skip_special_tokens=False)) is not None

    heads = [f.prompt.removesuffix("\n") for f in fns]
    prompts = [tok.encode(h, add_special_tokens=True).ids for h in heads]
    outs = greedy(cfg, weights, prompts, args.max_new_tokens, stop, device, args.gen_batch)
    rows = []
    for f, head, ids in zip(fns, heads, outs, strict=True):
        finished = bool(ids) and ids[-1] in specials
        text = tok.decode([i for i in ids if i not in specials], skip_special_tokens=False)
        body = cut_completion(text, finished)
        rows.append({"path": f.path, "name": f.name, "ok": parses_with_body(head + body), "completion": body})
    return {"rate": sum(r["ok"] for r in rows) / max(1, len(rows)), "rows": rows}


def evaluate_chat(cfg, weights, tok, fns: list[Function], args, device) -> dict:
    """Chat mode: the prompt as the user turn; the answer between START_RESPONSE and END_RESPONSE."""
    end = {tokenizer_files.EOS_ID, tokenizer_files.SPECIAL_IDS["<|END_RESPONSE|>"]}
    prompts = [
        tok.encode(
            tokenizer_files.render_chat([{"role": "user", "content": f.prompt}], add_generation_prompt=True),
            add_special_tokens=False,
        ).ids
        for f in fns
    ]
    max_new = args.max_new_tokens + args.max_new_tokens // 4  # room for a reasoning line
    outs = greedy(cfg, weights, prompts, max_new, lambda ids: ids[-1] in end, device, args.gen_batch)
    rows = []
    for f, ids in zip(fns, outs, strict=True):
        text = tok.decode(ids, skip_special_tokens=False)
        answer = text.split("<|START_RESPONSE|>", 1)[1] if "<|START_RESPONSE|>" in text else None
        if answer is not None:
            answer = answer.split("<|END_RESPONSE|>", 1)[0]
        ok = answer is not None and parses_with_body(f.prompt + answer)
        rows.append({"path": f.path, "name": f.name, "ok": ok, "text": text})
    return {"rate": sum(r["ok"] for r in rows) / max(1, len(rows)), "rows": rows}


def action_ok(text: str) -> bool:
    """The text holds one well-formed action block: a JSON list of calls to offered tools."""
    if "<|START_ACTION|>" not in text or "<|END_ACTION|>" not in text:
        return False
    block = text.split("<|START_ACTION|>", 1)[1].split("<|END_ACTION|>", 1)[0]
    try:
        calls = json.loads(block)
    except json.JSONDecodeError:
        return False
    return (
        isinstance(calls, list)
        and bool(calls)
        and all(
            isinstance(c, dict) and c.get("tool_name") in TOOL_NAMES and isinstance(c.get("parameters"), dict)
            for c in calls
        )
    )


def evaluate_tools(cfg, weights, tok, fns: list[Function], site: bool, args, device) -> dict:
    """Held-out functions asked about with the tools offered: does the model call a tool, well-formed?"""
    end = {tokenizer_files.EOS_ID, tokenizer_files.SPECIAL_IDS["<|END_ACTION|>"]}
    prompts = [
        tok.encode(
            tokenizer_files.render_chat(tool_prompt(f, site), tools=TOOLS, add_generation_prompt=True),
            add_special_tokens=False,
        ).ids
        for f in fns
    ]
    max_new = min(96, args.max_new_tokens)
    outs = greedy(cfg, weights, prompts, max_new, lambda ids: ids[-1] in end, device, args.gen_batch)
    texts = [tok.decode(ids, skip_special_tokens=False) for ids in outs]
    oks = [action_ok(t) for t in texts]
    return {
        "rate": sum(oks) / max(1, len(oks)),
        "rows": [{"ok": o, "text": t} for o, t in zip(oks, texts, strict=True)],
    }


FIXED_PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""'


@torch.no_grad()
def reference_expectation(path: Path, max_new: int = 24) -> dict:
    """Greedy continuation of FIXED_PROMPT by the reference model loaded from the written checkpoint (CPU,
    float32): the expectation a test of the shipped weights compares against."""
    from mk.text.tokenizer import Tokenizer

    model = load(path, device="cpu", dtype=torch.float32, progress=False)
    tok = Tokenizer.from_dir(path)
    ids = tok.encode(FIXED_PROMPT)
    out = []
    for _ in range(max_new):
        out.append(int(model.logits(ids + out)[-1].argmax()))
        if out[-1] == tok.eos_token_id:
            break
    return {"prompt": FIXED_PROMPT, "greedy_ids": out, "greedy_text": tok.decode(out), "max_new_tokens": max_new}


@torch.no_grad()
def reference_agreement(path: Path, cfg, weights_f32: dict, stream: torch.Tensor, n: int = 200) -> float:
    """Max |logit difference| between the training forward and the reference model read back from the
    checkpoint, on the first n held-out tokens (CPU, float32, the same bf16-rounded weights)."""
    model = load(path, device="cpu", dtype=torch.float32, progress=False)
    ids = stream[:n]
    ours = forward(cfg, weights_f32, ids[None]).logits[0]
    return float((ours - model.logits(ids)).abs().max())


# ================================================================================================
# Outputs
# ================================================================================================


def plot(path: Path, result: dict, heldout_loss: float) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    h = result["history"]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot(h["step"], h["train_loss"], label="train (dropout on)", lw=1)
    ax.plot(h["val_step"], h["val_loss"], "o-", ms=3, label="validation")
    ax.axhline(heldout_loss, color="k", ls="--", lw=0.8, label=f"held-out files, best weights: {heldout_loss:.3f}")
    ax.axvline(result["best_step"], color="grey", ls=":", lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("next-token loss (nats)")
    ax.set_yscale("log")
    ax.set_title("mk embedded model on the Python standard library")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def print_table(rows: list[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in rows)
    print("\n== embedded model ==")
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


# Shards of the shipped checkpoint: the device machine returns at most 8 files of at most 16 MiB, 64 MiB
# in all (scripts/device-train.sh sends the weights and one tar of the rest).
SHIPPED_SHARD_BYTES = 15 * 2**20
SHIPPED_MAX_BYTES = 60 * 2**20


def unshippable(cfg: ModelConfig) -> str | None:
    """Why the device machine could not return `cfg`'s bf16 weights (a tensor over a shard, too many
    bytes), or None. The sharder never splits a tensor."""
    shapes = expected_shapes(cfg)
    name, shape = max(shapes.items(), key=lambda kv: math.prod(kv[1]))
    total = 2 * sum(math.prod(s) for s in shapes.values())
    largest = 2 * math.prod(shape)
    if largest > SHIPPED_SHARD_BYTES:
        return (
            f"{name} {tuple(shape)} is {largest / 2**20:.1f} MiB in bf16, over a {SHIPPED_SHARD_BYTES >> 20} MiB shard"
        )
    if total > SHIPPED_MAX_BYTES:
        return f"the weights are {total / 2**20:.1f} MiB in bf16, over the {SHIPPED_MAX_BYTES >> 20} MiB returned"
    return None


def preset_config(preset: str, geometry: str | None) -> ModelConfig:
    """The preset's config with the `--geometry` changes (`field=value,...`; a new layer count gets the
    default layer pattern)."""
    cfg = ModelConfig.embedded() if preset == "embedded" else ModelConfig.tiny()
    if not geometry:
        return cfg
    names = [f.name for f in fields(ModelConfig) if f.name != "layer_types"]
    changes: dict = {}
    for item in geometry.split(","):
        key, sep, value = (s.strip() for s in item.partition("="))
        if not sep or key not in names:
            raise SystemExit(f"--geometry: {item!r} is not field=value with a field among {', '.join(names)}")
        try:
            changes[key] = type(getattr(cfg, key))(value)
        except ValueError:
            raise SystemExit(f"--geometry: {key}={value!r} is not a {type(getattr(cfg, key)).__name__}") from None
    if "num_hidden_layers" in changes:
        changes["layer_types"] = default_layer_types(changes["num_hidden_layers"])
    try:
        return replace(cfg, **changes)
    except ValueError as e:
        raise SystemExit(f"--geometry: {e}") from None


def megakernel_verdict(cfg: ModelConfig) -> str:
    """Whether the megakernel can serve `cfg` (mk.megakernel.support), where mk's compiled module is
    importable (not on the device machine, which trains from python/)."""
    try:
        from mk.megakernel.support import geometry_unsupported
    except ImportError:
        return "not checked (mk's compiled module is not importable here)"
    why = geometry_unsupported(cfg)
    return "the megakernel can serve it" if why is None else why


def write_shipped(out_dir: Path, cfg: ModelConfig, weights: dict, tok, shard_bytes: int = SHIPPED_SHARD_BYTES) -> int:
    """Writes the shipped checkpoint, one file if it fits `shard_bytes`, else shards; returns its weight bytes."""
    total = sum(t.numel() * t.element_size() for t in weights.values())
    one_file = total <= shard_bytes
    write_checkpoint(out_dir, cfg, weights, tokenizer=tok, single_file=one_file, max_shard_bytes=shard_bytes)
    return sum(p.stat().st_size for p in out_dir.glob("*.safetensors"))


def megabytes(mb: float | None) -> int | None:
    return None if mb is None else int(mb * 1e6)


def parse_args(argv: Sequence[str] | None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--preset", choices=["embedded", "tiny"], default="embedded")
    p.add_argument(
        "--geometry",
        default=None,
        help="changes to the preset's config, field=value,... (e.g. hidden_size=384,vocab_size=16384)",
    )
    p.add_argument(
        "--dry-run", action="store_true", help="print the geometry, its size and the megakernel's verdict, then exit"
    )
    p.add_argument("--time-budget", type=float, default=12.0, help="minutes of training (default 12)")
    p.add_argument("--steps", type=int, default=None, help="schedule length in steps, no timing calibration")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")
    p.add_argument("--max-epochs", type=float, default=40.0, help="upper bound on passes over the training tokens")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-frac", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--balance-coef", type=float, default=0.01)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument(
        "--unlikelihood-seconds",
        type=float,
        default=0.0,
        help="seconds of unlikelihood fine-tuning on the model's own looping continuations after the main\n"
        "schedule, taken from --time-budget (default 0: none)",
    )
    p.add_argument(
        "--unlikelihood-updates",
        type=int,
        default=None,
        help="exactly this many unlikelihood updates, without a time bound (the replay flags record it)",
    )
    p.add_argument("--unlikelihood-weight", type=float, default=1.0, help="the unlikelihood term's weight (default 1)")
    p.add_argument(
        "--unlikelihood-round", type=int, default=256, help="prompts continued per generation round (default 256)"
    )
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=None)
    p.add_argument("--eval-batches", type=int, default=None, help="validation batches per evaluation")
    p.add_argument("--loss-batches", type=int, default=None, help="batches of the final losses (default: all)")
    p.add_argument("--vocab-size", type=int, default=None, help="tokenizer size (default: the preset's vocab)")
    p.add_argument("--stdlib", default=None, help="library root (default: this interpreter's stdlib)")
    p.add_argument(
        "--held-out-packages",
        default=None,
        help="train on every installed package and the stdlib (scripts/code_corpus.py), holding these\n"
        "comma-separated packages out for the tests (default: the stdlib alone, held-out files)",
    )
    p.add_argument("--max-files", type=int, default=None, help="training files kept (quick runs)")
    p.add_argument(
        "--max-train-bytes",
        type=float,
        default=None,
        help="MB of training files kept, the first in hash order (a large site-packages corpus is\n"
        "more than one GPU run trains on; encoding it costs time and host memory)",
    )
    p.add_argument(
        "--tokenizer-bytes",
        type=float,
        default=None,
        help="MB of code files the tokenizer is trained on (default: all; BPE on hundreds of MB takes minutes)",
    )
    p.add_argument("--heldout", type=int, default=100, help="held-out functions")
    p.add_argument("--eval-functions", type=int, default=None, help="held-out functions generated from")
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--gen-batch", type=int, default=128, help="sequences per greedy-generation batch")
    p.add_argument("--tool-examples", type=int, default=2000, help="tool-call conversations (default 2000)")
    p.add_argument("--tool-repeat", type=int, default=2)
    p.add_argument("--out-dir", default=str(REPO / "python" / "mk" / "embedded"))
    p.add_argument("--docs-dir", default=str(REPO / "docs"))
    args = p.parse_args(argv)
    if args.unlikelihood_updates is None and args.unlikelihood_seconds >= 0.5 * args.time_budget * 60:
        p.error("--unlikelihood-seconds must leave the main schedule at least half of --time-budget")
    if args.unlikelihood_round < 1:
        p.error("--unlikelihood-round must be at least 1")
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(args.device).type
    for k, v in DEFAULTS["cuda" if dev == "cuda" else "cpu"].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.eval_functions is None:
        args.eval_functions = args.heldout if dev == "cuda" else min(args.heldout, CPU_EVAL_FUNCTIONS)
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    cfg = preset_config(args.preset, args.geometry)
    vocab = args.vocab_size or cfg.vocab_size
    if vocab > cfg.vocab_size:
        raise SystemExit(f"--vocab-size {vocab} exceeds the model's vocab_size {cfg.vocab_size} (see --geometry)")
    too_big = unshippable(cfg)
    if args.dry_run:
        n_params = sum(math.prod(s) for s in expected_shapes(cfg).values())
        print(f"{args.preset} {cfg.to_dict()}")
        verdict = megakernel_verdict(cfg)
        print(f"{n_params / 1e6:.2f}M parameters, {2 * n_params / 1e6:.2f} MB in bf16; {verdict}")
        print(f"the device machine can return it: {too_big or 'yes'}")
        return {"config": cfg.to_dict(), "parameters": n_params, "megakernel": verdict, "unshippable": too_big}
    if too_big:
        raise SystemExit(f"--geometry: {too_big}")
    started = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - started:7.1f}s] {msg}", flush=True)

    random.seed(args.seed)
    torch.manual_seed(args.seed)
    manifest = None
    if args.held_out_packages:
        cc = _code_corpus()
        held = {h.strip().lower() for h in args.held_out_packages.split(",") if h.strip()}
        packages = cc.installed_packages() + [cc.stdlib_package()]
        root = Path("site-packages")
        corpus, manifest = build_site_corpus(
            packages, held, args.heldout, args.max_files, os.cpu_count() or 1, megabytes(args.max_train_bytes)
        )
    else:
        root = Path(args.stdlib or sysconfig.get_paths()["stdlib"])
        corpus = build_corpus(root, args.heldout, args.max_files, megabytes(args.max_train_bytes))
    docs = build_documents(corpus, args.tool_examples, args.seed)
    log(
        f"corpus {root}: {len(corpus.train)} training files, {len(corpus.val)} validation, {len(corpus.heldout)} "
        f"held out ({len(corpus.test_functions)} test functions), {len(corpus.leak_excluded)} dropped as copies; "
        f"{len(docs.functions)} function documents, {len(docs.chat)} chat and {len(docs.tools)} tool examples"
    )
    tok = build_tokenizer(docs, vocab, megabytes(args.tokenizer_bytes))
    for name, i in tokenizer_files.SPECIAL_IDS.items():
        assert tok.token_to_id(name) == i, name
    pieces = (
        encode_code(tok, docs.code)
        + encode_code(tok, docs.functions)
        + encode_chat(tok, docs.chat)
        + encode_chat(tok, docs.tools) * args.tool_repeat
    )
    train_stream = token_stream(pieces, args.seed)
    val_stream = torch.tensor([t for d in encode_code(tok, list(corpus.val.values())) for t in d], dtype=torch.long)
    held_texts = list(corpus.heldout.values())
    held_stream = torch.tensor([t for d in encode_code(tok, held_texts) for t in d], dtype=torch.long)
    code_tokens = sum(len(p) for p in pieces[: len(docs.code)])
    log(
        f"tokenizer: {tok.get_vocab_size()} tokens; stream {len(train_stream):,} training tokens "
        f"({code_tokens:,} of raw code, {sum(map(len, corpus.train.values())) / max(1, code_tokens):.2f} "
        f"bytes/token), {len(val_stream):,} validation, {len(held_stream):,} held out"
    )
    if len(train_stream) <= args.seq_len + 1 or len(val_stream) <= args.seq_len + 1:
        raise SystemExit("corpus too small for --seq-len")

    result = train(args, cfg, train_stream, val_stream, device, log)
    ul_record = None
    if ul_on(args):
        heads = [f.prompt.removesuffix("\n") for f in corpus.train_functions]
        ul_prompts = [e.ids for e in tok.encode_batch(heads, add_special_tokens=True)]
        ul_prompts = [ids for ids in ul_prompts if len(ids) <= UL_PROMPT_TOKENS]
        # The best weights are the last ones (as in every run so far): go on with their optimizer.
        last, opt = result["state"] if result["best_step"] == result["steps"] else (result["weights"], None)

        def val_cost(w) -> float:
            loss, _ = stream_loss(cfg, w, val_stream, args.seq_len, args.batch_size, device, args.eval_batches)
            return loss - result["best_val_loss"]

        try:
            tuned, ul_record = unlikelihood_phase(
                args, cfg, last, train_stream, ul_prompts, tok, device, log, opt, val_cost
            )
            ul_record["val_loss_after"], _ = stream_loss(
                cfg, tuned, val_stream, args.seq_len, args.batch_size, device, args.eval_batches
            )
        except Exception as e:  # the main schedule's weights are worth more than the phase
            log(f"unlikelihood phase failed ({type(e).__name__}: {e}): the weights before it ship")
            tuned, ul_record = None, {"error": f"{type(e).__name__}: {e}", "updates": 0, "val_loss_after": math.inf}
            ul_record["looping_share_by_round"] = []
            ul_record["wall_seconds"] = 0.0
        ul_record["val_loss_before"] = result["best_val_loss"]
        ul_record["kept"] = ul_record["val_loss_after"] <= ul_record["val_loss_before"] + UL_MAX_VAL_COST
        if ul_record["kept"]:
            result["weights"] = {n: t.detach().clone() for n, t in tuned.items()}
        log(
            f"unlikelihood: {ul_record['updates']} updates in {ul_record['wall_seconds']:.0f} s; looping share "
            f"{ul_record['looping_share_by_round'][:1]} -> {ul_record['looping_share_by_round'][-1:]}; validation "
            f"loss {ul_record['val_loss_before']:.4f} -> {ul_record['val_loss_after']:.4f}: "
            + (
                "kept"
                if ul_record["kept"]
                else f"dropped (costs more than {UL_MAX_VAL_COST}), the weights before it ship"
            )
        )

    # The shipped weights: bf16. Every metric below is computed on them.
    shipped = {n: t.to(torch.bfloat16) for n, t in result["weights"].items()}
    eval_w = shipped if device.type == "cuda" else {n: t.float() for n, t in shipped.items()}
    out_dir = Path(args.out_dir)
    size = write_shipped(out_dir, cfg, shipped, tok)
    log(f"checkpoint written: {out_dir} ({size / 1e6:.2f} MB)")

    lw = args.loss_batches
    heldout_loss, held_load = stream_loss(cfg, eval_w, held_stream, args.seq_len, args.batch_size, device, lw)
    val_loss, _ = stream_loss(cfg, eval_w, val_stream, args.seq_len, args.batch_size, device, lw)
    held_bytes = sum(len(t.encode()) for t in held_texts)
    bits_per_byte = heldout_loss * (len(held_stream) - 1) / (held_bytes * math.log(2))
    fns = corpus.test_functions[: args.eval_functions]
    comp = evaluate_completions(cfg, eval_w, tok, fns, args, device)
    log(f"held-out loss {heldout_loss:.4f}; completion parse rate {comp['rate']:.1%} on {len(fns)} functions")
    chat = evaluate_chat(cfg, eval_w, tok, fns, args, device)
    tools = evaluate_tools(cfg, eval_w, tok, fns[: min(len(fns), 32)], corpus.root == SITE, args, device)
    log(f"chat parse rate {chat['rate']:.1%}; tool-call rate {tools['rate']:.1%}")
    cpu_w = {n: t.float().cpu() for n, t in shipped.items()}
    agreement = reference_agreement(out_dir, cfg, cpu_w, held_stream)
    expectation = reference_expectation(out_dir)
    log(f"reference model from the checkpoint agrees with the training forward: max |dlogit| {agreement:.2e}")

    n_params = sum(math.prod(s) for s in expected_shapes(cfg).values())
    settings = {k: v for k, v in vars(args).items() if k not in ("out_dir", "docs_dir")}
    report = {
        "settings": settings,
        "config": cfg.to_dict(),
        "environment": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "stdlib": str(root),
            "corpus_sha256": hashlib.sha256(
                "".join(f"{p}\0{t}\0" for p, t in sorted(corpus.train.items())).encode()
            ).hexdigest(),
        },
        "corpus": {
            "manifest": manifest,  # packages, versions, licences, drops (None: the stdlib alone)
            "train_files": len(corpus.train),
            "val_files": sorted(corpus.val),
            "heldout_files": sorted(corpus.heldout),
            "leak_excluded": corpus.leak_excluded,
            "function_documents": len(docs.functions),
            "chat_examples": len(docs.chat),
            "tool_examples": len(docs.tools),
            "tool_repeat": args.tool_repeat,
            "train_tokens": len(train_stream),
            "val_tokens": len(val_stream),
            "heldout_tokens": len(held_stream),
            "vocab": tok.get_vocab_size(),
        },
        "model": {"parameters": n_params, "safetensors_bytes": size, "megakernel": megakernel_verdict(cfg)},
        "training": {k: v for k, v in result.items() if k not in ("weights", "state", "history")},
        "unlikelihood": ul_record,
        # The same run again (same schedule, same batches; on CUDA up to atomic-add order).
        "replay": f"--steps {result['planned_steps']} --max-steps {result['steps']} --warmup {result['warmup']} "
        f"--seed {args.seed}"
        + (
            f" --unlikelihood-updates {ul_record['updates']} --unlikelihood-weight {args.unlikelihood_weight}"
            f" --unlikelihood-round {args.unlikelihood_round}"
            if ul_record
            else ""
        ),
        "metrics": {
            "heldout_loss": heldout_loss,
            "heldout_bits_per_byte": bits_per_byte,
            "val_loss": val_loss,
            "completion_parse_rate": comp["rate"],
            "chat_parse_rate": chat["rate"],
            "tool_call_rate": tools["rate"],
            "eval_functions": len(fns),
            "reference_max_abs_logit_diff": agreement,
            # Share of the (token, slot) assignments per expert on the held-out files, one row per MoE layer
            # (uniform: 1 / num_experts).
            "heldout_expert_load": [[round(x, 4) for x in row] for row in held_load.tolist()],
        },
        "expectation": expectation,
        "history": result["history"],
        "samples": {
            "completions": comp["rows"],
            "chat": chat["rows"][:8],
            "tools": tools["rows"][:8],
        },
        "wall_seconds": time.perf_counter() - started,
    }
    docs_dir = Path(args.docs_dir)
    docs_dir.mkdir(parents=True, exist_ok=True)
    (docs_dir / "embedded-model.json").write_text(json.dumps(report, indent=1) + "\n")
    png = plot(docs_dir / "embedded-model-loss.png", result, heldout_loss)

    t = result
    print_table(
        [
            (
                "geometry",
                f"{args.preset}{f' with {args.geometry}' if args.geometry else ''}: {n_params / 1e6:.2f}M "
                f"parameters, {size / 1e6:.2f} MB bf16 safetensors",
            ),
            (
                "corpus",
                (
                    f"{len(manifest['packages'])} packages (held out: {', '.join(manifest['held_out'])})"
                    if manifest
                    else f"Python {platform.python_version()} stdlib"
                )
                + f", {len(train_stream):,} training tokens",
            ),
            ("steps", f"{t['steps']} ({t['steps_set_by']}), {t['epochs']:.1f} epochs, {t['train_seconds']:.0f} s"),
            ("throughput", f"{t['tokens_per_second']:,.0f} tokens/s on {args.device}"),
            ("best validation", f"{t['best_val_loss']:.4f} at step {t['best_step']}"),
            (
                "unlikelihood",
                (
                    f"{ul_record['updates']} updates, looping share {ul_record['looping_share_by_round'][0]:.2f} -> "
                    f"{ul_record['looping_share_by_round'][-1]:.2f}, validation {ul_record['val_loss_after']:.4f}, "
                    + ("kept" if ul_record["kept"] else "dropped")
                    + (f" ({ul_record['stopped']})" if "stopped" in ul_record else "")
                )
                if ul_record and ul_record["looping_share_by_round"]
                else "none",
            ),
            ("held-out loss", f"{heldout_loss:.4f} nats/token, {bits_per_byte:.3f} bits/byte"),
            ("completion parse", f"{comp['rate']:.1%} of {len(fns)} held-out functions"),
            ("chat parse", f"{chat['rate']:.1%}"),
            ("tool calls", f"{tools['rate']:.1%} well-formed"),
            (
                "expert load",
                f"{float(held_load.min()):.3f} .. {float(held_load.max()):.3f} (uniform {1 / cfg.num_experts:.3f})",
            ),
            ("reference check", f"max |dlogit| {agreement:.1e}"),
            ("outputs", f"{out_dir}, {docs_dir / 'embedded-model.json'}" + (" + loss PNG" if png else "")),
            ("wall time", f"{report['wall_seconds']:.0f} s"),
        ]
    )
    return report


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    main(sys.argv[1:])
