"""Unlikelihood fine-tuning against greedy loops: the loop rules, the unlikelihood loss and the phase
that runs after the main schedule (`unlikelihood_phase`)."""

from __future__ import annotations

import random
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from mk.model.train import forward
from mk.text import tokenizer_files

from .evaluation import greedy
from .training import autocast, batch_at, main_loss, optimizer_step

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
    """No non-blank line of `text` occurs more than `repeats` times (the built-in model's loop-free bar)."""
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
    after every update past UL_MAX_VAL_COST the phase undoes that update and ends (a guard checked
    only at the end would drop the whole phase, the useful updates with the costly one). Returns the new
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
