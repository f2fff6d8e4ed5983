"""The memory plan on the card the tests run on, at the real geometry: an engine with its defaults
starts within its share of the card, serves a full KV pool of long prompts and 16 streams with no
out-of-memory error, and a context no card holds is refused naming the longest that fits."""

from __future__ import annotations

import re
import threading

import pytest
import torch

from mk.config import ModelConfig
from mk.engine import memory
from mk.engine.engine import Engine
from mk.engine.options import GPU_MEMORY_UTILIZATION
from mk.engine.sampling import SamplingParams
from mk.model import synthetic_weights
from mk.model.reference import Model

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a GPU", allow_module_level=True)


@pytest.fixture(scope="module")
def model():
    # (tests/conftest.py hands the card back after the module, once pytest has let go of the model)
    cfg = ModelConfig.real()
    return Model(cfg, synthetic_weights(cfg, seed=5, device="cuda", dtype=torch.bfloat16, std=0.01))


def used() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


def serve(engine: Engine, prompts: list[list[int]], max_tokens: int) -> list[tuple[int, str | None, str | None]]:
    """(tokens, finish reason, error) of each prompt, all submitted together."""
    done = threading.Semaphore(0)
    results: list[list] = [[0, None, None] for _ in prompts]

    def sink(i):
        def on_event(event):
            results[i][0] += event.token_id is not None
            if event.finish_reason is not None:
                results[i][1:] = [event.finish_reason, event.error]
                done.release()

        return on_event

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    with engine.together():
        for i, p in enumerate(prompts):
            engine.submit_callback(p, params, sink(i))
    for _ in prompts:
        assert done.acquire(timeout=600), "a request never finished"
    return [tuple(r) for r in results]


def test_the_default_engine_serves_a_full_pool_within_its_share(model):
    torch.cuda.empty_cache()
    total = torch.cuda.mem_get_info()[1]
    gen = torch.Generator().manual_seed(11)
    vocab = model.config.vocab_size
    with Engine(model, max_context=40000) as engine:
        plan = engine.memory_plan
        assert plan is not None and plan.utilization == GPU_MEMORY_UTILIZATION
        started = used()
        print(plan.describe(engine.max_context), f"; in use after the start {started / 2**30:.2f} GiB")
        assert started <= plan.utilization * total, "the start took more than its share of the card"
        assert engine.max_context == 40000
        # 16 streams of 8K-token prompts and a 32K one beside them: more than the pool holds at
        # once on an 80 GB card (the scheduler queues or preempts), never an out-of-memory error.
        prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in [8192] * 16 + [32768]]
        torch.cuda.reset_peak_memory_stats()
        results = serve(engine, prompts, max_tokens=24)
        assert all(r == (24, "length", None) for r in results), results
        peak = torch.cuda.max_memory_reserved()
        stats = engine.native_stats()
        print(f"served: preemptions {stats['preemptions']}, torch's peak {peak / 2**30:.2f} GiB, "
              f"in use {used() / 2**30:.2f} GiB")  # fmt: skip
        assert used() <= plan.utilization * total


def test_a_context_no_card_holds_is_refused_naming_the_longest_that_fits(model):
    torch.cuda.empty_cache()
    before = used()
    with pytest.raises(memory.MemoryPlanError) as e:
        Engine(model, max_context=1 << 23)
    print(e.value)
    longest = int(re.search(r"holds at most (\d+) tokens", str(e.value)).group(1))
    assert 40000 <= longest < 1 << 23, str(e.value)
    torch.cuda.empty_cache()
    assert used() - before < memory.GiB, "the refused engine kept its scratch pool or graphs"
