"""Evaluation of trained weights: greedy generation, the completion, chat and tool-call rates on held-out
functions, and the checks of the written checkpoint against the reference model."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import torch

from mk.model import load
from mk.model.train import forward
from mk.text import tokenizer_files

from .corpus import Function
from .documents import TOOL_NAMES, TOOLS, tool_prompt
from .training import autocast

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
