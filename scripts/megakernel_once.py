"""Decode steps of the GPU-test geometry through the megakernel, for compute-sanitizer runs:
compute-sanitizer --tool memcheck python3 scripts/megakernel_once.py
(batch 4, one step for each way of running expert tiles (claim queues, one task per tile) and of
learning the routing (the top-k task's, each block's own); and, where the build has the wide image
(not the swizzled variant), one step of 12 rows: two n-tiles, O's reduction in two activation passes).
--narrow leaves the 12-row step out: under racecheck (far slower) it outlasts the kernel's 2 s wait
limit. --dump PATH saves each step's x, residual log, logits and K/V pages (torch.save), to compare
two builds (e.g. a build variant against the default) on the same inputs."""

import itertools
import sys

import torch

from mk import _native
from mk.config import PAGE_SIZE, ModelConfig
from mk.megakernel.launch import MegakernelStep
from mk.megakernel.random_cache import random_step_inputs
from mk.model import synthetic_weights
from mk.model.reference import Model

cfg = ModelConfig.gpu_test()
model = Model(cfg, synthetic_weights(cfg, seed=1, device="cuda", dtype=torch.bfloat16, std=0.02))
args = sys.argv[1:]
dump_path = args[args.index("--dump") + 1] if "--dump" in args else None
dumps = []
steps = [([100, 4100, 64, 5000], queue, local) for queue, local in itertools.product((True, False), (False, True))]
if _native.STEP_MAX_ROWS >= 16 and "--narrow" not in args:
    steps.append(([100 + 397 * i for i in range(12)], True, False))
for positions, queue, local in steps:
    max_pages = max(positions) // PAGE_SIZE + 1
    kv, tables, _ = random_step_inputs(model, positions, max_pages, torch.Generator(device="cuda").manual_seed(1))
    step = MegakernelStep(model, kv, max_pages, expert_queue=queue, local_routing=local)
    g = step.graph(positions, check=True)
    buf = step.buffers(g)
    buf.tokens.copy_(torch.arange(1, len(positions) + 1, dtype=torch.int32))
    buf.positions.copy_(torch.tensor(positions, dtype=torch.int32))
    buf.block_tables.copy_(torch.stack(tables, dim=1))
    step.run(g, buf)
    torch.cuda.synchronize()
    assert not buf.logits.isnan().any() and (buf.sampled >= 0).all()
    print(
        f"one step ok ({len(positions)} rows, expert_queue={queue}, local_routing={local}), sampled",
        buf.sampled.tolist(),
    )
    if dump_path:
        names = ("x", "residual_log", "logits", "sampled")
        dumps.append({n: getattr(buf, n).cpu() for n in names} | {"k": kv.k.cpu(), "v": kv.v.cpu()})
if dump_path:
    torch.save(dumps, dump_path)
