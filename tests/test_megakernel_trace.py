"""The task-trace summary (mk.megakernel.trace) on a synthetic trace with a known clock and timings."""

import numpy as np
import pytest

from mk.config import ModelConfig
from mk.megakernel import graph as mkgraph
from mk.megakernel.graph import Op
from mk.megakernel.trace import LEDGER_STAGES, TRACE_MARKED, TRACE_WORDS, stream_profile, summarize, task_family

EPOCH_NS = 1_700_000_000_000_000_000  # a real %globaltimer counts ns since an epoch: too big for float64 ns


STREAM_LEAD_NS = 1000  # the producer's first copy, before the block reaches a gemv task
RING_WAIT, TOPK_WAIT = 300, 100  # the producer's cycles per gemv task
MARK1, MARK2 = 450, 900  # a diagnostic kernel's marks in the top-k tasks and splits (cycles after their wait)


def synthetic_trace(g: mkgraph.StepGraph, hz: float, rng: np.random.Generator) -> np.ndarray:
    """Each block runs its tasks back to back from a random start; gemv waits 2000 cycles, others
    500; the producer streamed every gemv task's weights STREAM_LEAD_NS before the block reached it."""
    trace = np.zeros((*g.tasks.shape[:2], TRACE_WORDS), dtype=np.int64)
    for s in range(g.tasks.shape[0]):
        t = rng.uniform(0, 500)
        for i in range(g.tasks.shape[1]):
            if g.tasks[s, i, 0] == Op.NOP:
                break
            wait = 2000 if g.tasks[s, i, 0] == Op.GEMV else 500
            run = int(rng.integers(1000, 5000))
            trace[s, i, 0] = EPOCH_NS + int(t)
            trace[s, i, 1] = wait | (run << 32)
            if g.tasks[s, i, 0] in (Op.GEMV, Op.ATTN_SPLIT):
                trace[s, i, 2] = EPOCH_NS + int(t) - STREAM_LEAD_NS
            if g.tasks[s, i, 0] == Op.GEMV:
                trace[s, i, 3] = RING_WAIT | (TOPK_WAIT << 32)
            elif g.tasks[s, i, 0] in (Op.TOPK, Op.ATTN_SPLIT):  # a split streams, and marks in place of the producer
                # the flag is the word's top bit: as an int64, the word is negative
                trace[s, i, 3] = (MARK1 | ((MARK2 | TRACE_MARKED) << 32)) - (1 << 64)
            t += (wait + run) / hz * 1e9
    return trace


def test_summary_recovers_the_clock_counts_and_waits():
    g = mkgraph.build(ModelConfig.tiny(), [5, 130, 300], num_sms=7)
    rng = np.random.default_rng(0)
    s = summarize(g, synthetic_trace(g, 1.5e9, rng))
    assert s["sm_clock_mhz"] == pytest.approx(1500, rel=1e-3)
    assert s["tasks"] == len(g.order)
    want = {}
    for words in g.order:
        want[task_family(words)] = want.get(task_family(words), 0) + 1
    assert {f["name"]: f["count"] for f in s["families"]} == want
    gemv = [f for f in s["families"] if f["name"].startswith("gemv:")]
    assert all(f["wait_us"] == pytest.approx(2000 / 1.5e9 * 1e6, rel=1e-3) for f in gemv)
    assert 0 < s["busy_fraction"] <= 1 and 0 < s["wait_fraction"] < 1
    assert len(s["layer_us"]) == ModelConfig.tiny().num_hidden_layers + 1  # + the head's "layer"
    assert s["families"][0]["run_sm_us"] >= s["families"][-1]["run_sm_us"]


def test_summary_reports_the_weight_producer_for_streamed_tasks_only():
    g = mkgraph.build(ModelConfig.tiny(), [5, 130, 300], num_sms=7)
    s = summarize(g, synthetic_trace(g, 1.5e9, np.random.default_rng(2)))
    for f in s["families"]:
        if f["name"] == "attn_split":  # streamed, its producer words taken by its marks
            assert f["streamed"] == f["count"] and f["ring_wait_us"] == 0 and f["topk_wait_us"] == 0
            assert f["lead_us"] == pytest.approx((STREAM_LEAD_NS + 500 / 1.5e9 * 1e9) / 1e3, abs=2e-3)
            continue
        if not f["name"].startswith("gemv:"):
            assert f["streamed"] == 0 and f["ring_wait_us"] == 0 and f["lead_us"] == 0
            continue
        assert f["streamed"] == f["count"]
        assert f["ring_wait_us"] == pytest.approx(RING_WAIT / 1.5e9 * 1e6, rel=1e-3)
        assert f["topk_wait_us"] == pytest.approx(TOPK_WAIT / 1.5e9 * 1e6, rel=1e-3)
        # the copy came STREAM_LEAD_NS before the block arrived, which then waited 2000 cycles
        assert f["lead_us"] == pytest.approx((STREAM_LEAD_NS + 2000 / 1.5e9 * 1e9) / 1e3, abs=2e-3)
    gemv_tasks = sum(f["count"] for f in s["families"] if f["name"].startswith("gemv:"))
    ring_us = gemv_tasks * RING_WAIT / 1.5e9 * 1e6
    assert s["producer_ring_wait_fraction"] == pytest.approx(ring_us / (7 * s["span_us"]), rel=1e-3)
    for r in s["timeline"]:
        assert (r["stream_us"] is not None) == (r["name"].startswith("gemv:") or r["name"] == "attn_split")
        if r["stream_us"] is not None:
            assert r["stream_us"] < r["arrive_us"]


def test_summary_reports_the_marks_of_tasks_that_flag_them():
    g = mkgraph.build(ModelConfig.tiny(), [5, 130, 300], num_sms=7)
    s = summarize(g, synthetic_trace(g, 1.5e9, np.random.default_rng(3)))
    by_name = {f["name"]: f for f in s["families"]}
    for name in ("topk", "attn_split"):  # one streams nothing, the other streams
        assert by_name[name]["mark1_us"] == pytest.approx(MARK1 / 1.5e9 * 1e6, rel=1e-3)
        assert by_name[name]["mark2_us"] == pytest.approx(MARK2 / 1.5e9 * 1e6, rel=1e-3)
    for name, f in by_name.items():
        if name not in ("topk", "attn_split"):  # gemv tasks' word 3 is the producer's, not marks
            assert f["mark1_us"] == 0 and f["mark2_us"] == 0


def test_a_trace_without_timed_tasks_is_refused():
    g = mkgraph.build(ModelConfig.tiny(), [5], num_sms=4)
    with pytest.raises(ValueError, match="no block with two timed tasks"):
        summarize(g, np.zeros((*g.tasks.shape[:2], TRACE_WORDS), dtype=np.int64))


def test_the_layer_timeline_names_every_family_of_the_middle_layer_in_start_order():
    cfg = ModelConfig.tiny()
    g = mkgraph.build(cfg, [5, 130, 300], num_sms=7)
    s = summarize(g, synthetic_trace(g, 1.5e9, np.random.default_rng(1)))
    layer = s["timeline_layer"]
    assert layer == cfg.num_hidden_layers // 2
    want = {task_family(w) for w in g.order if w[1] == layer}
    rows = s["timeline"]
    assert {r["name"] for r in rows} == want
    following = {task_family(w) for w in g.order if w[1] == layer + 1}
    assert {r["name"] for r in s["next_timeline"]} == following
    starts = [r["first_start_us"] for r in rows]
    assert starts == sorted(starts)
    for r in rows:
        assert r["arrive_us"] <= r["first_start_us"] <= r["median_start_us"] <= r["median_end_us"] <= r["last_end_us"]
        # gemv tasks wait 2000 cycles at 1.5 GHz in the synthetic trace
        if r["name"].startswith("gemv:"):
            assert r["first_start_us"] - r["arrive_us"] == pytest.approx(2000 / 1.5e9 * 1e6, rel=1e-3)


def test_layer_phases_are_each_phase_s_last_end_after_the_previous_norm():
    cfg = ModelConfig.tiny()
    g = mkgraph.build(cfg, [5, 130, 300], num_sms=7)
    hz = 1.5e9
    trace = synthetic_trace(g, hz, np.random.default_rng(2))
    phases = summarize(g, trace)["layer_phases_us"]
    # From first principles: every task's end, each (family, layer)'s last one.
    last: dict[tuple[str, int], float] = {}
    for s in range(g.tasks.shape[0]):
        for i in range(g.tasks.shape[1]):
            words = g.tasks[s, i]
            if words[0] == Op.NOP:
                break
            wait, run = int(trace[s, i, 1]) & 0xFFFFFFFF, int(trace[s, i, 1]) >> 32
            end = (int(trace[s, i, 0]) - EPOCH_NS) + (wait + run) / hz * 1e9
            key = (task_family(words), int(words[1]))
            last[key] = max(last.get(key, -np.inf), end)
    moe = [layer for layer in range(1, cfg.num_hidden_layers) if cfg.is_moe(layer)]
    assert phases["layers"] == len(moe) > 0

    def want(names):
        ends = [max(last.get((n, layer), -np.inf) for n in names) - last[("residual_norm", layer - 1)] for layer in moe]
        return np.mean(ends) / 1e3

    for phase, names in {
        "qkv": ["gemv:qkv"],
        "attention": ["attn_split", "attn_combine"],
        "gate_up": ["gemv:expert_gate_up", "claim:expert_gate_up"],
        "o_proj": ["gemv:o_proj"],
        "down": ["gemv:expert_down", "claim:expert_down"],
        "norm": ["residual_norm"],
    }.items():
        assert phases[phase] == pytest.approx(want(names), abs=2e-3), phase


def test_the_stream_profile_recovers_a_steady_stream_s_rate_waits_and_lead():
    """A ledger (a -DMK_STREAM_LEDGER=1 kernel's rows) in which every block issues a 24 KB stage
    every 100 ns through the whole step and finds each 700 ns later, warps 0 and 2 waiting for the
    GEMV tasks' stages only: the profile's rates are the stream's, its lead 0.7 µs, its waits by
    family."""
    cfg = ModelConfig.tiny()
    g = mkgraph.build(cfg, [5, 130, 300], num_sms=7)
    trace = synthetic_trace(g, 1.5e9, np.random.default_rng(4))
    sms = g.tasks.shape[0]
    ledger = np.zeros((sms, LEDGER_STAGES, 4), dtype=np.int64)
    step, size, lead = 100, 24576, 700
    span = int(trace[..., 0].max() - EPOCH_NS) + 20_000
    for s in range(sms):
        streamed = [i for i in range(g.tasks.shape[1]) if g.tasks[s, i, 0] in (Op.GEMV, Op.ATTN_SPLIT)]
        for k in range(min(span // step, LEDGER_STAGES - 1)):
            task = streamed[k % len(streamed)]
            waited = g.tasks[s, task, 0] == Op.GEMV
            ledger[s, k] = (
                EPOCH_NS + k * step,
                EPOCH_NS + k * step + lead,
                size | (0 if waited else 1) << 32,
                task | (0b101 << 32 if waited else 0),
            )
    p = stream_profile(g, trace, ledger, bin_us=2.0)
    assert p["layers"] == sum(cfg.is_moe(layer) for layer in range(1, cfg.num_hidden_layers))
    rate = sms * size / step / 1e3  # TB/s
    assert p["layer_mb"] / p["layer_us"] == pytest.approx(rate, rel=0.05)
    inner = [v for v in p["issued_tb_s"][:-1]]  # the last bin is cut by the shortest window
    assert inner and all(v == pytest.approx(rate, rel=0.06) for v in inner)
    assert all(v == pytest.approx(rate, rel=0.06) for v in p["found_tb_s"][1:-1])
    for f in p["families"]:
        assert f["issue_to_found_us"] == pytest.approx(lead / 1e3)
        assert f["waited"] == (1.0 if f["name"].startswith("gemv:") else 0.0)
        assert f["warps_waited"] == (2.0 if f["name"].startswith("gemv:") else 0.0)
    assert not p["ledger_full"] and p["stages_recorded"] == sms * min(span // step, LEDGER_STAGES - 1)


def test_every_trace_buffer_has_room_for_a_ledger_and_a_bare_trace_is_refused():
    """A ledger build writes past any trace it is given: `trace_buffer` leaves the room (zeros for
    `ledger_of` to read), and a trace without it is refused before a launch could overflow it."""
    import torch

    from mk.megakernel.launch import _ledger_offset, ledger_of, trace_buffer

    g = mkgraph.build(ModelConfig.tiny(), [5, 130, 300], num_sms=7)
    trace = trace_buffer(g, torch.device("cpu"))
    assert tuple(trace.shape) == (*g.tasks.shape[:2], TRACE_WORDS) and not trace.any()
    ledger = ledger_of(trace)
    assert tuple(ledger.shape) == (7, LEDGER_STAGES, TRACE_WORDS) and not ledger.any()
    ledger[3, 5, 1] = 42  # the rows follow the entries in the same storage
    assert trace.untyped_storage().nbytes() == (trace.numel() + ledger.numel()) * 8
    assert ledger_of(trace)[3, 5, 1] == 42 and not trace.any()
    with pytest.raises(ValueError, match="room for a ledger"):
        _ledger_offset(torch.zeros(*g.tasks.shape[:2], TRACE_WORDS, dtype=torch.int64))
