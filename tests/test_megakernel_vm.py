"""The decode-step task graph, executed task by task on the CPU, equals the reference model's
decode step: same logits, same K/V written, greedy token = argmax."""

import copy
import dataclasses
import os

import numpy as np
import pytest
import torch

from mk.config import ModelConfig
from mk.megakernel import graph as mkgraph
from mk.megakernel.buffers import StepBuffers
from mk.megakernel.graph import Op
from mk.megakernel.vm import RoutingMismatch, run_step
from mk.model import PageAllocator, synthetic_weights
from mk.model.reference import Model

CFG = ModelConfig.tiny()
SEED = int(os.environ.get("MK_TEST_SEED", str(int.from_bytes(os.urandom(4), "little") % 2**31)))
MAX_PAGES = 8


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(SEED)
    w = synthetic_weights(CFG, seed=SEED, dtype=torch.float32, std=0.1)
    for name in w:  # sharper attention and routing so a wrong index shows
        if "q_proj" in name or "k_proj" in name or name.endswith("mlp.gate.weight"):
            w[name] *= 3
    return Model(CFG, w)


def prefilled(model, lengths):
    """Sequences of the given prompt lengths prefilled into one paged cache."""
    alloc = PageAllocator(CFG.num_hidden_layers * MAX_PAGES * len(lengths), seed=SEED)
    kv = model.new_kv(alloc.num_free)
    tables, last = [], []
    for n in lengths:
        t = alloc.new_table(CFG, MAX_PAGES)
        alloc.ensure(t, n)
        prompt = torch.randint(0, CFG.vocab_size, (n,))
        model.forward(prompt, 0, kv, t)
        alloc.release_out_of_window(t, CFG, n)
        alloc.ensure(t, n + 1, from_pos=n)
        tables.append(t)
        last.append(int(torch.randint(0, CFG.vocab_size, ())))
    return kv, tables, last


def step_buffers(g, tokens, positions, tables) -> StepBuffers:
    """CPU buffers for graph `g` with the step's inputs filled in."""
    buf = StepBuffers.allocate(CFG, len(positions), g.slots, g.max_splits, MAX_PAGES, 16, torch.float32, "cpu")
    buf.tokens[:] = torch.tensor(tokens, dtype=torch.int32)
    buf.positions[:] = torch.tensor(positions, dtype=torch.int32)
    buf.block_tables[:] = torch.stack(tables, dim=1)
    return buf


@pytest.mark.parametrize(
    "lengths",
    [
        [1],
        [63],
        [64, 96, 97],
        [5, 130, 300, 64, 200, 17, 95, 250],
        # 16 rows: one launch of the wide megakernel image
        [5, 130, 300, 64, 200, 17, 95, 250, 1, 33, 65, 128, 129, 191, 96, 299],
    ],
)
@pytest.mark.parametrize("num_sms,row_groups,chunk", [(7, 3, 64), (132, 1, 0), (132, 8, 512)])
def test_vm_step_equals_reference_decode(model, lengths, num_sms, row_groups, chunk):
    kv, tables, tokens = prefilled(model, lengths)
    positions = list(lengths)
    kv_ref = copy.deepcopy(kv)
    expected = model.decode(torch.tensor(tokens), torch.tensor(positions), kv_ref, tables)

    g = mkgraph.build(CFG, positions, num_sms=num_sms, attn_chunk=chunk, row_groups=row_groups, check=True)
    buf = step_buffers(g, tokens, positions, tables)
    run_step(model, kv, g, buf)

    assert not buf.logits.isnan().any()
    rel = (buf.logits - expected).norm() / expected.norm()
    assert rel < 1e-5, f"seed {SEED}: relative logit error {rel:.2e}"
    top2 = expected.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 1e-4  # fp32 summation order may flip a closer race
    assert torch.equal(buf.sampled.long()[clear], expected.argmax(dim=-1)[clear]), f"seed {SEED}"
    # K/V entries are O(1); a wrong page or row is off by that much, while fp32 summation order moves
    # an entry by ~1e-5 (a CI run once saw 1.3e-5), so the absolute tolerance is 1e-4.
    torch.testing.assert_close(kv.k, kv_ref.k, rtol=1e-3, atol=1e-4, equal_nan=True)
    torch.testing.assert_close(kv.v, kv_ref.v, rtol=1e-3, atol=1e-4, equal_nan=True)


def test_vm_step_in_bf16_equals_the_reference_decode_in_bf16():
    """The interpreter in the GPU's dtype: bf16 weights, activations and expert outputs (the
    buffers' dtypes as the kernel has them), against the reference's bf16 decode. Every row takes
    every expert (top-k = experts), so no near-tie in the router can pick another expert set and
    the two differ only by bf16 rounding in another order: a relative logit error of 4.2e-3 to
    6.5e-3 over 60 seeds, K/V entries (O(1)) within 0.017; the bounds are about 3x those."""
    cfg = dataclasses.replace(CFG, num_experts_per_tok=CFG.num_experts)
    model = Model(cfg, synthetic_weights(cfg, seed=SEED, dtype=torch.bfloat16, std=0.1))
    lengths = [5, 130, 300, 64, 200, 17, 95, 250]
    kv, tables, tokens = prefilled(model, lengths)  # (the page tables do not depend on top-k)
    kv_ref = copy.deepcopy(kv)
    expected = model.decode(torch.tensor(tokens), torch.tensor(lengths), kv_ref, tables)

    g = mkgraph.build(cfg, lengths, num_sms=7, attn_chunk=64, row_groups=3, check=True)
    buf = StepBuffers.allocate(cfg, len(lengths), g.slots, g.max_splits, MAX_PAGES, 16, torch.bfloat16, "cpu")
    buf.tokens[:] = torch.tensor(tokens, dtype=torch.int32)
    buf.positions[:] = torch.tensor(lengths, dtype=torch.int32)
    buf.block_tables[:] = torch.stack(tables, dim=1)
    run_step(model, kv, g, buf)

    assert buf.expert_out.dtype == buf.h.dtype == torch.bfloat16
    assert buf.logits.isfinite().all()
    rel = (buf.logits - expected).norm() / expected.norm()
    assert rel < 2e-2, f"seed {SEED}: relative logit error {rel:.2e}"
    torch.testing.assert_close(kv.k.float(), kv_ref.k.float(), rtol=0, atol=0.05, equal_nan=True)
    torch.testing.assert_close(kv.v.float(), kv_ref.v.float(), rtol=0, atol=0.05, equal_nan=True)


def test_graph_builder_refuses_an_empty_batch():
    with pytest.raises(ValueError, match="at least one row"):
        mkgraph.build(CFG, [])


def test_forced_routing_follows_ties_and_refuses_real_differences(model):
    kv, tables, tokens = prefilled(model, [70, 150])
    g = mkgraph.build(CFG, [70, 150], num_sms=5, check=True)

    def fresh():
        return step_buffers(g, tokens, [70, 150], tables)

    own = fresh()
    run_step(model, copy.deepcopy(kv), g, own)
    again = fresh()
    assert run_step(model, copy.deepcopy(kv), g, again, forced_routing=own.routing_log.clone()) == 0
    assert torch.equal(again.logits, own.logits)
    # The lowest-scoring experts are no tie of the best ones: refused.
    worst = own.router.argsort(dim=1)[:, : CFG.num_experts_per_tok]
    bad = own.routing_log.clone()
    bad[-1] = worst.to(torch.int32)
    with pytest.raises(RoutingMismatch):
        run_step(model, copy.deepcopy(kv), g, fresh(), forced_routing=bad)


def test_balanced_dealing_runs_the_same_step(model):
    """The cost-model dealing moves tasks between SMs, never changes them: the checker passes, the
    step equals the reference decode, and the task multiset is round-robin's."""
    lengths = [5, 130, 300, 64]
    kv, tables, tokens = prefilled(model, lengths)
    kv_ref = copy.deepcopy(kv)
    expected = model.decode(torch.tensor(tokens), torch.tensor(lengths), kv_ref, tables)
    rr = mkgraph.build(CFG, lengths, num_sms=7)
    g = mkgraph.build(CFG, lengths, num_sms=7, check=True, dealing="balanced")
    assert not np.array_equal(g.tasks, rr.tasks) and np.array_equal(g.order, rr.order)

    def real_tasks(graph):  # the padded lists' tasks without their NOP padding
        words = graph.tasks.reshape(-1, 16)
        return sorted(map(bytes, words[words[:, 0] != 0]))

    assert real_tasks(g) == real_tasks(rr)
    assert 0 < g.modelled_ns <= rr.modelled_ns * 1.001
    buf = step_buffers(g, tokens, lengths, tables)
    run_step(model, kv, g, buf)
    assert (buf.logits - expected).norm() / expected.norm() < 1e-5
    with pytest.raises(ValueError, match="dealing must be"):
        mkgraph.build(CFG, lengths, dealing="random")


@pytest.mark.parametrize("lengths", [[63], [5, 130, 300, 64]])
def test_expert_queues_and_one_task_per_tile_give_the_same_step(model, lengths):
    """Claiming expert tiles from queues (the default from two rows on) or dealing one task per
    tile changes where tiles run, never what they compute: both pass the checker and give the
    same logits, bit for bit."""
    kv, tables, tokens = prefilled(model, lengths)
    logits = []
    for queue in (True, False):
        g = mkgraph.build(CFG, lengths, num_sms=7, check=True, expert_queue=queue)
        claims = int((g.order[:, 0] == Op.EXPERT_CLAIM).sum())
        moe_layers = sum(CFG.is_moe(i) for i in range(CFG.num_hidden_layers))
        assert claims == (2 * 7 * moe_layers if queue else 0)
        buf = step_buffers(g, tokens, lengths, tables)
        run_step(model, copy.deepcopy(kv), g, buf)
        logits.append(buf.logits.clone())
    assert torch.equal(logits[0], logits[1])
