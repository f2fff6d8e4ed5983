"""Speculative decoding's verification rows on the megakernel: one launch verifies each sequence's
draft d[0..k] as k + 1 rows at consecutive positions p..p+k that share the sequence's block table
(row 0 feeds the sequence's last token, row i feeds d[i - 1]), so row i must see the K/V that rows
0..i-1 of its sequence wrote in the same launch.

The inputs are fresh random ones (test_megakernel_gpu.py's: N(0, 0.5) KV pages, synthetic weights,
poisoned step buffers), and the positions the launch writes hold NaN in K and V before it, so a row
that read a key of its sequence before this launch wrote it shows as NaN. Each launch is checked
as test_megakernel_gpu.py checks a decode step, with its tolerances and for its reasons: layer by
layer against the interpreter on the kernel's own input (teacher forcing, the kernel's near-tied
expert choices followed), and, free-running (at the small test geometry), every row's logits
against `Model.verify` on the same KV (the reference's top-k following the kernel's choice where
the two are within TIE_TOL, as the interpreter does); the K/V the launch wrote at p..p+k against
both."""

from __future__ import annotations

import gc
import random
from unittest import mock

import pytest
import test_megakernel_gpu as decode_tests
import torch
from test_megakernel_gpu import SEED, TIE_TOL, WIDE, assert_close, check_step

from mk import _native
from mk.config import PAGE_SIZE, ModelConfig
from mk.megakernel.launch import MegakernelStep, row_samples_tensor
from mk.megakernel.vm import run_step
from mk.model import PageAllocator, moe
from mk.model.paged import pages_needed
from mk.model.reference import Model

# The weights test_megakernel_gpu.py's steps run on (its module fixtures, one copy per module).
real_weights = decode_tests.real_weights
gpu_test_weights = decode_tests.gpu_test_weights

# check_step's bounds: a step's logits against the reference's (relative), and K/V written (absolute).
LOGITS_TOL = 3e-2
KV_TOL = 0.1


def verification_inputs(model: Model, starts: list[int], drafts: list[int], max_pages: int, gen: torch.Generator):
    """(cache, one block table per sequence mapped through its last row, every row's token) for
    sequences whose rows sit at starts[s] .. starts[s] + drafts[s]: random_step_inputs' cache, but
    a table per sequence, not per row, keeping what a row at its first position can see."""
    cfg = model.config
    pages = sum(pages_needed(p + k + 1) for p, k in zip(starts, drafts, strict=True))
    alloc = PageAllocator(cfg.num_hidden_layers * pages, seed=SEED)
    kv = model.new_kv(alloc.num_free)
    kv.k.normal_(0, 0.5, generator=gen)
    kv.v.normal_(0, 0.5, generator=gen)
    tables = []
    for p, k in zip(starts, drafts, strict=True):
        t = alloc.new_table(cfg, max_pages)
        alloc.ensure(t, p + k + 1)
        alloc.release_out_of_window(t, cfg, p)
        tables.append(t)
    tokens = torch.randint(0, cfg.vocab_size, (sum(drafts) + len(drafts),), generator=gen, device=gen.device)
    return kv, tables, tokens


def written_slots(tables: list[torch.Tensor], starts: list[int], drafts: list[int], device):
    """(blocks [layers, rows], offsets [rows]): where every row writes its K/V, in row order."""
    blocks, offsets = [], []
    for t, p, k in zip(tables, starts, drafts, strict=True):
        pos = torch.arange(p, p + k + 1)
        blocks.append(t[:, pos // PAGE_SIZE])
        offsets.append(pos % PAGE_SIZE)
    return torch.cat(blocks, dim=1).long().to(device), torch.cat(offsets).to(device)


def copy_kv(model: Model, kv):
    out = model.new_kv(kv.num_blocks)
    out.k.copy_(kv.k)
    out.v.copy_(kv.v)
    return out


def verification_step(model: Model, starts: list[int], drafts: list[int], attn_chunk: int = 0, check_graph=False):
    """One launch of every sequence's rows on fresh random inputs, ready to run: (step, graph, its
    buffers filled, the cache, a copy of it, tables, tokens, positions, each row's sequence). The
    positions the launch writes hold NaN in both caches."""
    gen = torch.Generator(device="cuda").manual_seed(SEED)
    positions = [p + i for p, k in zip(starts, drafts, strict=True) for i in range(k + 1)]
    seq_of_row = [s for s, k in enumerate(drafts) for _ in range(k + 1)]
    max_pages = max(positions) // PAGE_SIZE + 1
    kv, tables, tokens = verification_inputs(model, starts, drafts, max_pages, gen)
    blocks, offsets = written_slots(tables, starts, drafts, kv.device)
    kv.k[blocks, offsets] = float("nan")
    kv.v[blocks, offsets] = float("nan")
    # (an earlier test's pools go back to the driver before a second real-geometry pool)
    gc.collect()
    torch.cuda.empty_cache()
    before = copy_kv(model, kv)
    step = MegakernelStep(model, kv, max_pages, attn_chunk=attn_chunk)
    g = step.graph(positions, check=check_graph)
    buf = step.buffers(g)
    buf.tokens.copy_(tokens.to(torch.int32))
    buf.positions.copy_(torch.tensor(positions, dtype=torch.int32))
    buf.block_tables.copy_(torch.stack([tables[s] for s in seq_of_row], dim=1))
    return step, g, buf, kv, before, tables, tokens, positions, seq_of_row


def verify_following(model: Model, kernel_routing: torch.Tensor, rows, kv) -> tuple[torch.Tensor, int]:
    """`Model.verify(rows, kv)` whose top-k takes the kernel's experts (`routing_log`) wherever they
    are within TIE_TOL of its own k-th choice, as the interpreter's `follow` does (and fails where
    they are not); returns its logits and how many (layer, row) choices followed the kernel."""
    cfg = model.config
    layers = iter([layer for layer in range(cfg.num_hidden_layers) if cfg.is_moe(layer)])
    select = moe.select_experts
    followed = 0

    def follow(logits: torch.Tensor, k: int):
        nonlocal followed
        layer = next(layers)
        own, _ = select(logits, k)
        forced = kernel_routing[layer].to(logits.device).long()
        kth = torch.gather(logits, 1, own).min(dim=1, keepdim=True).values
        got = torch.gather(logits, 1, forced)
        below = float((kth - got).max())
        assert below <= TIE_TOL, f"seed {SEED}: layer {layer}: the kernel chose an expert {below:.3g} below the k-th"
        assert not (forced.sort(1).values.diff(dim=1) == 0).any(), f"seed {SEED}: layer {layer}: an expert twice"
        followed += int((forced.sort(1).values != own.sort(1).values).any(dim=1).sum())
        return forced, torch.sigmoid(got)

    with mock.patch.object(moe, "select_experts", follow):
        logits = model.verify(rows, kv)
    assert next(layers, None) is None, "Model.verify routed fewer layers than the model has MoE layers"
    return logits, followed


def check_verification(
    model: Model, starts: list[int], drafts: list[int], attn_chunk: int, check_graph: bool, free_running: bool = True
):
    """The launch's rows layer by layer against the interpreter on the kernel's own input, and (where
    `free_running`) end to end against `Model.verify`: at the real geometry 49 layers of bf16 drift
    move the router's scores past TIE_TOL, so there only the first check applies, as in
    test_megakernel_gpu.py's real-geometry steps."""
    step, g, buf, kv, before, tables, tokens, positions, seq_of_row = verification_step(
        model, starts, drafts, attn_chunk, check_graph
    )
    step.run(g, buf)
    torch.cuda.synchronize()
    first_row = {s: seq_of_row.index(s) for s in range(len(starts))}
    nan_rows = [r for r in range(len(positions)) if bool(buf.logits[r].isnan().any())]
    where = [f"row {r - first_row[seq_of_row[r]]} of sequence {seq_of_row[r]}" for r in nan_rows]
    assert not nan_rows, (
        f"seed {SEED}: NaN logits in {', '.join(where)}: a key of its sequence read before this launch "
        "wrote it (those positions held NaN before the launch), or a buffer left unwritten"
    )

    # Layer by layer on the kernel's own input (test_megakernel_gpu.run_and_compare's interpreter).
    kv_vm = copy_kv(model, before)
    vm = step.buffers(g)
    for name in ("tokens", "positions", "block_tables"):
        getattr(vm, name).copy_(getattr(buf, name))
    flips = run_step(
        model, kv_vm, g, vm, forced_routing=buf.routing_log, tie_tol=TIE_TOL, teacher_residuals=buf.residual_log
    )
    check_step(model, buf, vm, kv, kv_vm, tables, tokens, flips, None, g, positions)
    blocks, offsets = written_slots(tables, starts, drafts, kv.device)
    for name in ("k", "v"):
        got = getattr(kv, name)[blocks, offsets]
        assert not got.isnan().any(), f"seed {SEED}: the launch left a position of its rows unwritten in {name}"
        diff = (got.float() - getattr(kv_vm, name)[blocks, offsets].float()).abs().max().item()
        assert diff < KV_TOL, f"seed {SEED}: {name} written differs from the interpreter's by {diff:.3g}"
    del kv_vm, vm
    if not free_running:
        return

    # Free-running: every row's logits and the K/V written against Model.verify on the same cache.
    kv_ref = copy_kv(model, before)
    del before
    rows, r0 = [], 0
    for s, (p, k) in enumerate(zip(starts, drafts, strict=True)):
        rows.append((tokens[r0 : r0 + k + 1].tolist(), p, tables[s]))
        r0 += k + 1
    expected, followed = verify_following(model, buf.routing_log, rows, kv_ref)
    for r, pos in enumerate(positions):
        s = seq_of_row[r]
        name = f"logits of row {r - first_row[s]} of sequence {s} (position {pos}) vs Model.verify"
        assert_close(name, buf.logits[r], expected[r].to(buf.logits.device), LOGITS_TOL)
    for name in ("k", "v"):
        got, want = getattr(kv, name)[blocks, offsets], getattr(kv_ref, name)[blocks, offsets]
        diff = (got.float() - want.float()).abs().max().item()
        assert diff < KV_TOL, f"seed {SEED}: {name} written differs from Model.verify's by {diff:.3g}"
    print(
        f"seed {SEED}: drafts {drafts} at {starts}: {flips} near-tied choices followed the kernel in the "
        f"interpreter, {followed} in Model.verify"
    )


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("starts", "drafts", "attn_chunk"),
    [
        pytest.param([4094, 700], [3, 0], 0, id="b2-drafts-3-0"),
        pytest.param([0], [4], 0, id="b1-from-position-0"),
        pytest.param([3067], [7], 64, id="b1-draft-7-one-page-splits"),
        pytest.param([5000, 64, 300], [2, 2, 1], 0, id="b3-ragged"),
        pytest.param([61, 2000, 4094, 300], [3, 3, 3, 3], 0, marks=WIDE, id="b4-drafts-3-wide"),
    ],
)
def test_verification_rows_match_the_reference_at_gpu_test_geometry(gpu_test_weights, starts, drafts, attn_chunk):
    """Drafts across a page boundary (64, 3072, 4096) and the sliding window's edge (4096), from
    position 0, with one-page attention splits (the producer copies a split's page as soon as its
    walk reaches it), ragged, and 16 rows (the wide image)."""
    model = Model(ModelConfig.gpu_test(), gpu_test_weights)
    check_verification(model, starts, drafts, attn_chunk, check_graph=True)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("starts", "drafts", "attn_chunk"),
    [
        pytest.param([4094, 700], [3, 0], 0, id="b2-drafts-3-0"),
        pytest.param([3067], [7], 0, id="b1-draft-7"),
        pytest.param([3067], [7], 64, id="b1-draft-7-one-page-splits"),
        pytest.param([61, 2000, 4094, 300], [3, 3, 3, 3], 0, marks=WIDE, id="b4-drafts-3-wide"),
    ],
)
def test_verification_rows_match_the_reference_at_real_geometry(real_weights, starts, drafts, attn_chunk):
    model = Model(ModelConfig.real(), real_weights)
    check_verification(model, starts, drafts, attn_chunk, check_graph=False, free_running=False)


@pytest.mark.gpu
def test_verification_rows_draw_at_their_generation_index(gpu_test_weights):
    """Row i of a sequence that has generated n tokens draws at generation index n + i (MkRowSample's
    index), as the plain step that would feed it would: each sampled row's token is the host
    sampler's draw from the row's own logits at that index, a greedy sequence's rows take their
    argmax. High temperatures make the noise decide, so a kernel that drew every row of a sequence
    at one index would differ."""
    model = Model(ModelConfig.gpu_test(), gpu_test_weights)
    starts, drafts = [300, 4094, 1000], [3, 2, 2]
    temperatures = [1.0, 50.0, 0.0]
    rng = random.Random(SEED)
    per_seq = [(0.0 if t == 0 else 1.0 / t, rng.getrandbits(64), rng.getrandbits(16)) for t in temperatures]
    step, g, buf, _, _, _, _, positions, seq_of_row = verification_step(model, starts, drafts)
    first_row = {s: seq_of_row.index(s) for s in range(len(starts))}
    rules = []
    for r, s in enumerate(seq_of_row):
        inv_t, seed, generated = per_seq[s]
        rules.append((inv_t, seed, generated + r - first_row[s]))
    step.run(g, buf, row_samples=row_samples_tensor(rules, buf.tokens.device))
    torch.cuda.synchronize()
    logits, sampled = buf.logits.cpu(), buf.sampled.cpu().tolist()
    assert not logits.isnan().any(), f"seed {SEED}: NaN logits"
    noisy = 0
    for r, (inv_t, seed, index) in enumerate(rules):
        i, s = r - first_row[seq_of_row[r]], seq_of_row[r]
        if inv_t == 0:
            assert sampled[r] == int(logits[r].argmax()), f"seed {SEED}: greedy row {i} of sequence {s}"
            continue
        want = _native.gumbel_draw(logits[r].numpy().tobytes(), inv_t, seed, index)
        assert sampled[r] == want, f"seed {SEED}: row {i} of sequence {s} drew {sampled[r]}, the host {want}"
        if i > 0:
            noisy += want != _native.gumbel_draw(logits[r].numpy().tobytes(), inv_t, seed, index - i)
    assert noisy >= 2, f"seed {SEED}: the index changed only {noisy} of the hot draft rows' tokens"
