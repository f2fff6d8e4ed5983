"""Launch decode steps of a bf16 model on its GPU through the megakernel (mk._native.decode_step).

The weights stay where the loader put them (HF tensor names, one tensor each): the kernel gets
tables of their device addresses, so nothing is repacked or copied.
"""

from __future__ import annotations

import struct
import weakref
from dataclasses import dataclass

import torch

from mk import _native
from mk.config import PAGE_SIZE
from mk.megakernel import graph as mkgraph
from mk.megakernel.buffers import StepBuffers
from mk.megakernel.trace import LEDGER_STAGES, TRACE_WORDS
from mk.model.paged import PagedKV
from mk.model.reference import Model

# The HF tensor (under model.layers.{i}.) of each MkLayerWeight entry; the table's order is
# _native.LAYER_WEIGHTS. A layer has either the router (MoE) or the dense FFN's three.
_LAYER_WEIGHT_TENSORS = {
    "NORM": "input_layernorm",
    "Q": "self_attn.q_proj",
    "K": "self_attn.k_proj",
    "V": "self_attn.v_proj",
    "O": "self_attn.o_proj",
    "ROUTER": "mlp.gate",
    "GATE": "mlp.gate_proj",
    "UP": "mlp.up_proj",
    "DOWN": "mlp.down_proj",
}
_EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")  # expert_weights' last axis
_FORMATS = {"u64": "<Q", "i32": "<i", "f32": "<f"}
# MkRowSample (cuda/abi.h): 1 / T, the seed's low and high words, the step index, masked.
ROW_SAMPLE_FORMAT = "<f4I"
ROW_SAMPLE_WORDS = struct.calcsize(ROW_SAMPLE_FORMAT) // 4
if struct.calcsize(ROW_SAMPLE_FORMAT) != _native.ROW_SAMPLE_BYTES:
    raise ImportError("mk._native was built from another cuda/abi.h (MkRowSample differs)")


def pack_step_args(values: dict[str, int | float]) -> bytes:
    """MkStepArgs as bytes, field by field from the layout Rust mirrors (checked against nvcc).
    Every field but `reserved*` must be given; unknown names are an error."""
    layout, size = _native.step_args_layout()
    names = {name for name, _, _ in layout}
    unknown = set(values) - names
    missing = {n for n in names if n not in values and not n.startswith("reserved")}
    if unknown or missing:
        raise ValueError(f"MkStepArgs: unknown fields {sorted(unknown)}, missing fields {sorted(missing)}")
    out = bytearray(size)
    for name, offset, kind in layout:
        struct.pack_into(_FORMATS[kind], out, offset, values.get(name, 0))
    return bytes(out)


@dataclass(frozen=True)
class ModelTables:
    """The model's device-side lookup tables: weight addresses (nothing is repacked), the weights'
    bulk-copy descriptors (the same matrices, for the kernel's weight producer) and per-layer
    flags."""

    layer_weights: torch.Tensor  # uint64 [layers][MK_LW_COUNT]
    expert_weights: torch.Tensor  # uint64 [layers][experts][3]: gate, up, down
    layer_window: torch.Tensor  # int32 [layers], 0 = full attention
    layer_rope: torch.Tensor  # int32 [layers]
    layer_maps: torch.Tensor  # uint8 [layers][MK_LW_COUNT][TENSOR_MAP_BYTES]
    expert_maps: torch.Tensor  # uint8 [layers][experts][3][TENSOR_MAP_BYTES]
    embed_map: torch.Tensor  # uint8 [TENSOR_MAP_BYTES]

    @classmethod
    def build(cls, model: Model) -> ModelTables:
        cfg, w = model.config, model.weights
        for t in w.values():
            if not t.is_contiguous():
                raise ValueError("the megakernel needs contiguous weights")
        n_lw = _native.LAYER_WEIGHT_COUNT
        layers = torch.zeros(cfg.num_hidden_layers, n_lw, dtype=torch.int64)
        experts = torch.zeros(cfg.num_hidden_layers, cfg.num_experts, 3, dtype=torch.int64)
        # (address, rows, cols) of every matrix, in the tables' order, for the tensor maps.
        layer_specs = [[(0, 0, 0)] * n_lw for _ in range(cfg.num_hidden_layers)]
        expert_specs = [[[(0, 0, 0)] * 3 for _ in range(cfg.num_experts)] for _ in range(cfg.num_hidden_layers)]

        def spec(t: torch.Tensor) -> tuple[int, int, int]:
            return (t.data_ptr(), t.shape[0], t.shape[1]) if t.dim() == 2 else (0, 0, 0)

        for layer in range(cfg.num_hidden_layers):
            p = f"model.layers.{layer}."
            for i, which in enumerate(_native.LAYER_WEIGHTS):
                t = w.get(f"{p}{_LAYER_WEIGHT_TENSORS[which]}.weight")
                if t is not None:
                    layers[layer, i] = t.data_ptr()
                    layer_specs[layer][i] = spec(t)
            if cfg.is_moe(layer):
                for e in range(cfg.num_experts):
                    for j, proj in enumerate(_EXPERT_PROJECTIONS):
                        t = w[f"{p}mlp.experts.{e}.{proj}.weight"]
                        experts[layer, e, j] = t.data_ptr()
                        expert_specs[layer][e][j] = spec(t)
        n = cfg.num_hidden_layers
        window = torch.tensor([cfg.window(i) or 0 for i in range(n)], dtype=torch.int32)
        rope = torch.tensor([int(cfg.needs_rope(i)) for i in range(n)], dtype=torch.int32)
        mb = _native.TENSOR_MAP_BYTES

        def maps(specs: list, shape: tuple[int, ...]) -> torch.Tensor:
            # Encoding needs the CUDA driver; a model elsewhere (CPU tests of the templates) gets
            # zeros, and the megakernel refuses to run it anyway.
            if model.device.type != "cuda" or not specs:
                return torch.zeros(*shape, mb, dtype=torch.uint8)
            return torch.frombuffer(bytearray(_native.weight_maps(specs)), dtype=torch.uint8).reshape(*shape, mb)

        flat_experts = [s for per_layer in expert_specs for per_expert in per_layer for s in per_expert]
        layer_maps = maps([s for per_layer in layer_specs for s in per_layer], (n, n_lw))
        expert_maps = maps(flat_experts, (n, cfg.num_experts, 3))
        embed_map = maps([spec(w["model.embed_tokens.weight"])], ())
        tensors = (layers, experts, window, rope, layer_maps, expert_maps, embed_map)
        return cls(*(t.to(model.device) for t in tensors))


# Per cache: the pools' addresses its maps describe, and the maps.
_KV_MAPS: weakref.WeakKeyDictionary[PagedKV, tuple[tuple[int, int], torch.Tensor]] = weakref.WeakKeyDictionary()


def kv_maps(kv: PagedKV) -> torch.Tensor:
    """The bulk-copy descriptors of `kv`'s K and V pools (MkStepArgs.kv_maps: uint8 [2][TENSOR_MAP_BYTES]
    on the pools' device), encoded once per cache and pools; zeros for a cache off the GPU."""
    pools = (kv.k.data_ptr(), kv.v.data_ptr())
    cached = _KV_MAPS.get(kv)
    if cached is not None and cached[0] == pools:
        return cached[1]
    blocks, page, heads, dim = kv.k.shape
    if kv.device.type != "cuda":
        maps = torch.zeros(2, _native.TENSOR_MAP_BYTES, dtype=torch.uint8)
    else:
        if kv.dtype != torch.bfloat16 or kv.v.dtype != kv.k.dtype or kv.v.shape != kv.k.shape:
            raise ValueError("the megakernel reads bf16 K and V pools of one shape")
        raw = _native.kv_maps(*pools, blocks * page, heads * dim)
        maps = torch.frombuffer(bytearray(raw), dtype=torch.uint8).reshape(2, -1).to(kv.device)
    _KV_MAPS[kv] = (pools, maps)
    return maps


def fixed_step_args(model: Model, kv: PagedKV, tables: ModelTables, buf: StepBuffers) -> dict[str, int | float]:
    """The MkStepArgs fields that stay the same from step to step: the model's dimensions and the
    addresses of its weights, tables, KV pools and `buf` (empty tensors: 0; tracing off). The
    caller adds the step's own: tasks, counters, per_sm, num_counters, parity, batch, max_pages,
    max_splits, slots, sample_parts."""
    cfg = model.config
    values: dict[str, int | float] = {name: t.data_ptr() if t.numel() else 0 for name, t in buf.tensors().items()}
    values.update(
        layer_weights=tables.layer_weights.data_ptr(),
        expert_weights=tables.expert_weights.data_ptr(),
        layer_window=tables.layer_window.data_ptr(),
        layer_rope=tables.layer_rope.data_ptr(),
        layer_maps=tables.layer_maps.data_ptr(),
        expert_maps=tables.expert_maps.data_ptr(),
        embed_map=tables.embed_map.data_ptr(),
        embed=model.weights["model.embed_tokens.weight"].data_ptr(),
        final_norm=model.weights["model.norm.weight"].data_ptr(),
        k_pool=kv.k.data_ptr(),
        v_pool=kv.v.data_ptr(),
        kv_maps=kv_maps(kv).data_ptr(),
        layers=cfg.num_hidden_layers,
        hidden=cfg.hidden_size,
        heads=cfg.num_attention_heads,
        kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        experts=cfg.num_experts,
        top_k=cfg.num_experts_per_tok,
        expert_ffn=cfg.intermediate_size,
        dense_ffn=cfg.prefix_dense_intermediate_size,
        vocab=cfg.vocab_size,
        eps=cfg.rms_norm_eps,
        logit_scale=cfg.logit_scale,
        rope_theta=cfg.rope_theta,
        flags=0,
        trace=0,
        row_samples=0,
        row_masks=0,
        mask_ready=0,
        mask_epoch=0,
    )
    return values


class MegakernelStep:
    """Runs decode steps of `model` (bf16, on a CUDA device) over the paged cache `kv`."""

    def __init__(
        self,
        model: Model,
        kv: PagedKV,
        max_pages: int,
        attn_chunk: int = 0,
        row_groups: int = _native.ROW_GROUPS,
        sample_parts: int = _native.SAMPLE_PARTS,
        dealing: str = "round_robin",
        qkv_groups: int | None = None,
        gate_up_groups: int | None = None,
        attention_first: bool | None = None,
        expert_queue: bool | None = None,
        local_routing: bool | None = None,
    ) -> None:
        if model.device.type != "cuda" or model.dtype != torch.bfloat16:
            raise ValueError("the megakernel runs bf16 models on a CUDA device")
        self.model, self.kv, self.cfg = model, kv, model.config
        self.max_pages, self.attn_chunk, self.row_groups, self.sample_parts = (
            max_pages,
            attn_chunk,
            row_groups,
            sample_parts,
        )
        self.device = model.device
        self.dealing = dealing  # how graph() deals tasks onto the SMs
        self.qkv_groups, self.gate_up_groups = qkv_groups, gate_up_groups  # GEMV task sizes (None: default)
        self.attention_first = attention_first  # the global order (rust/graph BuildOptions; None: default)
        self.expert_queue = expert_queue  # expert tiles claimed at run time (BuildOptions; None: default)
        self.local_routing = local_routing  # every block routes for itself (BuildOptions; None: default)
        self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.tables = ModelTables.build(model)
        cfg = self.cfg
        self.num_counters = (cfg.num_hidden_layers + 1) * _native.COUNTERS_PER_LAYER
        self.counters = torch.zeros(2, self.num_counters, dtype=torch.int32, device=self.device)
        self.parity = 0

    def graph(self, positions: list[int], check: bool = False) -> mkgraph.StepGraph:
        return mkgraph.build(
            self.cfg,
            positions,
            num_sms=self.num_sms,
            attn_chunk=self.attn_chunk,
            row_groups=self.row_groups,
            sample_parts=self.sample_parts,
            check=check,
            dealing=self.dealing,
            qkv_groups=self.qkv_groups,
            gate_up_groups=self.gate_up_groups,
            attention_first=self.attention_first,
            expert_queue=self.expert_queue,
            local_routing=self.local_routing,
        )

    def buffers(self, g: mkgraph.StepGraph, log_residuals: bool = True, max_splits: int = 0) -> StepBuffers:
        """Buffers for `g`'s batch, with room for max(`max_splits`, g.max_splits) attention splits
        (so that graphs with more splits, e.g. other attn_chunk sizes, can run on them too)."""
        return StepBuffers.allocate(
            self.cfg,
            g.batch,
            g.slots,
            max(max_splits, g.max_splits),
            self.max_pages,
            self.sample_parts,
            torch.bfloat16,
            self.device,
            log_residuals,
        )

    def run(
        self,
        g: mkgraph.StepGraph,
        buf: StepBuffers,
        tasks: torch.Tensor | None = None,
        trace: torch.Tensor | None = None,
        kernel: int = 0,
        row_samples: torch.Tensor | None = None,
        row_masks: torch.Tensor | None = None,
    ) -> None:
        """Enqueue one step on the current stream. `buf.tokens/positions/block_tables` must be
        filled; `tasks` (g.tasks on the device) may be passed to skip the upload. `trace` (from
        `trace_buffer`) receives when each task waited and ran. `kernel` picks one of the loaded
        megakernel variants (`_native.megakernel_count`; 0, the default, unless a benchmark
        compares several). `row_samples` (`row_samples_tensor`): how each row's token is drawn;
        None: greedy. `row_masks`: int32 [batch, ceil(vocab / 32)], the tokens each masked row may
        take (bit t % 32 of word t / 32), read for the rows `row_samples` marks masked."""
        if tasks is None:
            tasks = torch.from_numpy(g.tasks.copy()).to(self.device)
        if g.num_counters != self.num_counters or buf.block_tables.shape[2] != self.max_pages:
            raise ValueError("graph or buffers do not match this MegakernelStep")
        # The kernel indexes the buffers by these: a graph with more splits or slots than they
        # were allocated for would write past them.
        if buf.x.shape[0] != g.batch or buf.attn_o.shape[1] < g.max_splits or buf.expert_act.shape[0] < g.slots:
            raise ValueError(
                f"buffers for batch {buf.x.shape[0]}, {buf.attn_o.shape[1]} splits and {buf.expert_act.shape[0]} "
                f"slots cannot run a graph of batch {g.batch}, {g.max_splits} splits and {g.slots} slots"
            )
        if int(buf.positions.max()) >= self.max_pages * PAGE_SIZE:
            raise ValueError("a position lies past the block tables")
        values = fixed_step_args(self.model, self.kv, self.tables, buf)
        if trace is not None:
            want = (*g.tasks.shape[:2], TRACE_WORDS)
            if trace.dtype != torch.int64 or tuple(trace.shape) != want or trace.device != self.device:
                raise ValueError(f"trace must be int64 {want} on {self.device} (see trace_buffer)")
            _ledger_offset(trace)  # a ledger build writes past the entries
            values["trace"] = trace.data_ptr()
        if row_samples is not None:
            if (
                row_samples.dtype != torch.int32
                or tuple(row_samples.shape) != (g.batch, ROW_SAMPLE_WORDS)
                or row_samples.device != self.device
            ):
                want = f"int32 ({g.batch}, {ROW_SAMPLE_WORDS}) on {self.device}"
                raise ValueError(f"row_samples must be {want} (see row_samples_tensor)")
            values["row_samples"] = row_samples.data_ptr()
            if row_masks is None and bool(row_samples[:, ROW_SAMPLE_WORDS - 1].any()):
                raise ValueError("row_samples marks a row masked but no row_masks are given")
        if row_masks is not None:
            want = (g.batch, (self.cfg.vocab_size + 31) // 32)
            if row_masks.dtype != torch.int32 or tuple(row_masks.shape) != want or row_masks.device != self.device:
                raise ValueError(f"row_masks must be int32 {want} on {self.device}")
            values["row_masks"] = row_masks.data_ptr()
        values.update(
            tasks=tasks.data_ptr(),
            counters=self.counters.data_ptr(),
            per_sm=g.tasks.shape[1],
            num_counters=self.num_counters,
            parity=self.parity,
            batch=g.batch,
            max_pages=self.max_pages,
            max_splits=buf.attn_o.shape[1],  # the partials' stride
            slots=g.slots,
            sample_parts=self.sample_parts,
        )
        stream = torch.cuda.current_stream(self.device).cuda_stream
        _native.decode_step(self.device.index or 0, stream, pack_step_args(values), g.tasks.shape[0], kernel)
        self.parity ^= 1


def row_samples_tensor(
    rules: list[tuple[float, int, int]], device: torch.device, masked: list[bool] | None = None
) -> torch.Tensor:
    """MkRowSample [rows] for `MegakernelStep.run(row_samples=...)`, as int32 words, from one
    (1 / T, seed, index) per row: 1 / T (as float32) 0 draws greedily, > 0 with Gumbel noise;
    `masked` rows draw among their `row_masks` tokens only."""
    flags = masked or [False] * len(rules)

    def words(t: float, seed: int, index: int, m: bool) -> tuple[int, ...]:
        raw = struct.pack(ROW_SAMPLE_FORMAT, t, seed & 0xFFFFFFFF, seed >> 32, index, int(m))
        return struct.unpack(f"<{ROW_SAMPLE_WORDS}i", raw)

    rows = [words(*rule, m) for rule, m in zip(rules, flags, strict=True)]
    return torch.tensor(rows, dtype=torch.int32, device=device)


def trace_buffer(g: mkgraph.StepGraph, device: torch.device) -> torch.Tensor:
    """A zeroed MkTraceEntry [num_sms][per_sm] array for `MegakernelStep.run(trace=...)`, as int64
    words (mk.megakernel.trace reads them): [..., 0] the %globaltimer ns when the block reached the
    task, [..., 1] its wait and run cycles; for tasks whose weights were streamed (GEMV and
    expert-claim tasks, attention splits), [..., 2] when the producer issued the first copy and
    [..., 3] its ring and top-k wait cycles (a -DMK_TRACE_MARKS=1 kernel: also the marks of tasks
    that stream nothing, see cuda/abi.h). Entries of NOPs stay 0. Past the entries, in the same
    storage, room for the rows a -DMK_STREAM_LEDGER=1 kernel writes of every ring stage
    (`ledger_of`; ~34 MB at 132 SMs): whichever kernel is loaded, a trace never overflows."""
    sms, per_sm = g.tasks.shape[:2]
    flat = torch.zeros(sms * (per_sm + LEDGER_STAGES), TRACE_WORDS, dtype=torch.int64, device=device)
    return flat[: sms * per_sm].view(sms, per_sm, TRACE_WORDS)


def _ledger_offset(trace: torch.Tensor) -> int:
    """Where a ledger build's rows start in `trace`'s storage (int64 words), after checking that
    they fit there (`trace_buffer` makes the room)."""
    sms, per_sm, words = trace.shape
    offset = trace.storage_offset() + sms * per_sm * words
    if trace.untyped_storage().nbytes() < (offset + sms * LEDGER_STAGES * words) * 8:
        raise ValueError("a trace needs room for a ledger build's rows past its entries: make it with trace_buffer")
    return offset


def ledger_of(trace: torch.Tensor) -> torch.Tensor:
    """The int64 [num_sms, MK_LEDGER_STAGES, 4] ledger a -DMK_STREAM_LEDGER=1 kernel wrote past the
    entries of `trace` (a `trace_buffer`): each ring stage's issue time, when the compute warps
    found it full, its bytes and kind, its task (cuda/abi.h); zeros from any other kernel."""
    sms, _, words = trace.shape
    out = torch.empty(0, dtype=torch.int64, device=trace.device)
    return out.set_(trace.untyped_storage(), _ledger_offset(trace), (sms, LEDGER_STAGES, words))
