"""The Python half of the `Megakernel` decode backend (rust/python/megakernel_backend.rs).

Prefill is the PrefillRunner's (PyTorch, `mk.prefill.packed`, writes the prompt's K/V into the pool), run on this
runner's own CUDA stream; decode never comes here: Rust launches the megakernel on the same
stream, so every launch follows the prefills before it. This object owns every tensor the kernel
reads (weights, KV pool, pointer tables, activation buffers) and hands their addresses to Rust once,
through `megakernel_setup`; Rust owns the per-step inputs (tasks, tokens, positions, block tables)
and the counters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mk import _native
from mk.engine.runner import PrefillRunner
from mk.megakernel.buffers import StepBuffers
from mk.megakernel.launch import ModelTables, fixed_step_args, pack_step_args
from mk.megakernel.support import STEP_MAX_ROWS, MegakernelUnavailable, megakernel_unsupported
from mk.model.reference import Model
from mk.prefill.packed import Prefill

# MkStepArgs fields Rust fills in for every launch (its buffers, or per-step values).
PER_STEP_FIELDS = tuple(_native.PER_STEP_FIELDS)


def step_template(model: Model, kv, tables: ModelTables, buf: StepBuffers) -> bytes:
    """MkStepArgs with every address Python owns and the model's dimensions; the per-step fields
    are 0 (Rust overwrites them)."""
    values = fixed_step_args(model, kv, tables, buf)
    values.update(dict.fromkeys(PER_STEP_FIELDS, 0))
    return pack_step_args(values)


@dataclass(frozen=True)
class MegakernelSetup:
    """What the Rust backend reads once, by these names (`Setup` in
    rust/python/megakernel_backend.rs): the device and the CUDA stream prefill runs on (the
    launches share it, so they follow the prefill's K/V writes), an MkStepArgs template holding
    every address Python owns, the buffers' sizes, the task graph's build options and how rows
    under a grammar are drawn."""

    device: int
    stream: int
    step_args: bytes
    rows: int
    max_splits: int
    slots: int
    max_pages: int
    num_blocks: int
    attn_chunk: int  # 0: automatic
    row_groups: int
    sample_parts: int
    dealing: str  # mk.engine.options.DEALINGS
    kernel_masks: bool
    late_masks: bool


class MegakernelRunner(PrefillRunner):
    """Prefills on its own CUDA stream and hands the kernel's buffers to Rust, which decodes."""

    def __init__(
        self,
        model: Model,
        num_blocks: int,
        max_batch: int,
        max_context: int,
        *,
        row_groups: int = _native.ROW_GROUPS,
        sample_parts: int = _native.SAMPLE_PARTS,
        packed_prefill: Prefill | None = None,
        prefill_chunk: int | None = None,
        kernel_masks: bool = False,
        late_masks: bool = False,
        rows: int | None = None,
        dealing: str = "round_robin",
    ) -> None:
        why = megakernel_unsupported(model)
        if why is not None:
            raise MegakernelUnavailable(why)
        super().__init__(model, num_blocks, max_batch, max_context, packed_prefill, prefill_chunk)
        cfg, device = model.config, model.device
        self.stream = torch.cuda.Stream(device)
        # Rows of one launch (None: the batch's, up to STEP_MAX_ROWS); larger steps run as several
        # launches, each over these buffers in turn.
        self.rows = min(max_batch, STEP_MAX_ROWS) if rows is None else rows
        if not 1 <= self.rows <= STEP_MAX_ROWS:
            raise ValueError(f"a launch takes 1 to {STEP_MAX_ROWS} rows, not {self.rows}")
        self.slots = min(cfg.num_experts, self.rows * cfg.num_experts_per_tok)
        # Automatic attention splits never exceed one per SM (graph::Builder::attention).
        self.max_splits = torch.cuda.get_device_properties(device).multi_processor_count
        self.row_groups, self.sample_parts = row_groups, sample_parts
        self.kernel_masks = kernel_masks  # grammar rows drawn by the kernel (Engine's kernel_masks)
        self.late_masks = late_masks  # their steps queued, masks delivered while they run (Engine's)
        self.dealing = dealing  # how the tasks are dealt to the SMs (Engine's)
        self.model_tables = ModelTables.build(model)
        # tokens, positions and block_tables of these buffers stay unused (Rust uploads its own).
        self.buffers = StepBuffers.allocate(
            cfg, self.rows, self.slots, self.max_splits, 1, sample_parts, torch.bfloat16, device, log_residuals=False
        )
        # The engine's stream starts on weights, pools and buffers made on the default stream.
        torch.cuda.synchronize(device)

    def prefill(self, pieces, dirty, layers=None):
        with torch.cuda.stream(self.stream):
            return super().prefill(pieces, dirty, layers)

    def warm_up(self, progress: bool = True) -> None:
        with torch.cuda.stream(self.stream):
            super().warm_up(progress)
        self.stream.synchronize()

    def megakernel_setup(self) -> MegakernelSetup:
        """Read once by the Rust backend (rust/python/megakernel_backend.rs)."""
        device = self.model.device.index
        return MegakernelSetup(
            device=device if device is not None else torch.cuda.current_device(),
            stream=self.stream.cuda_stream,
            step_args=step_template(self.model, self.kv, self.model_tables, self.buffers),
            rows=self.rows,
            max_splits=self.max_splits,
            slots=self.slots,
            max_pages=self.max_pages,
            num_blocks=self.kv.num_blocks,
            attn_chunk=0,
            row_groups=self.row_groups,
            sample_parts=self.sample_parts,
            dealing=self.dealing,
            kernel_masks=self.kernel_masks,
            late_masks=self.late_masks,
        )
