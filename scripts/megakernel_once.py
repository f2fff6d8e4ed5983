"""One decode step of the GPU-test geometry through the megakernel, for compute-sanitizer runs:
    compute-sanitizer --tool memcheck python3 scripts/megakernel_once.py"""

import torch

from mk.config import PAGE_SIZE, ModelConfig
from mk.megakernel.launch import MegakernelStep
from mk.model import PageAllocator, synthetic_weights
from mk.model.reference import Model

cfg = ModelConfig.gpu_test()
model = Model(cfg, synthetic_weights(cfg, seed=1, device="cuda", dtype=torch.bfloat16, std=0.02))
positions = [100, 4100, 64, 5000]
max_pages = max(positions) // PAGE_SIZE + 1
alloc = PageAllocator(cfg.num_hidden_layers * max_pages * len(positions))
kv = model.new_kv(alloc.num_free)
kv.k.normal_(0, 0.5)
kv.v.normal_(0, 0.5)
tables = []
for pos in positions:
    t = alloc.new_table(cfg, max_pages)
    alloc.ensure(t, pos + 1)
    alloc.release_out_of_window(t, cfg, pos)
    tables.append(t)
step = MegakernelStep(model, kv, max_pages)
g = step.graph(positions, check=True)
buf = step.buffers(g)
buf.tokens.copy_(torch.tensor([1, 2, 3, 4], dtype=torch.int32))
buf.positions.copy_(torch.tensor(positions, dtype=torch.int32))
buf.block_tables.copy_(torch.stack(tables, dim=1))
step.run(g, buf)
torch.cuda.synchronize()
assert not buf.logits.isnan().any() and (buf.sampled >= 0).all()
print("one step ok, sampled", buf.sampled.tolist())
