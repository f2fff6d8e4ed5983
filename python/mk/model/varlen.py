"""Causal, windowed GQA attention of packed variable-length pieces over the paged KV cache.

A chunk of a prefill holds pieces: piece i is positions [first_i, first_i + n_i) of one sequence,
at rows [q_off_i, q_off_i + n_i) of the packed queries. `pack_keys` lays out, per attention kind
(full, or sliding with window W), the keys each piece can see, by position, so only pages inside
the window are ever touched:

    piece i's keys = positions [k_first_i, first_i + n_i), k_first_i = 0 (full) or
    max(0, first_i - W + 1) (sliding), at columns [k_off_i, k_off_i + k_len_i);

and for every query row the interval [lo, hi] of key columns it sees (causal, windowed, own
piece only). The attention paths (`attend_*`) take Q [N, heads, d] and the gathered packed K, V
[K, kv_heads, d] and return [N, heads * d]:
- flex: `flex_attention` with a block mask built from the intervals (compiled on CUDA);
- fa3: FlashAttention-3 varlen (`flash_attn_interface`), causal bottom-right, window (W - 1, 0);
- sdpa: per piece and query tile, `scaled_dot_product_attention` with an explicit boolean mask.
`attend_causal` is the plain case (n rows over their own n keys, no window: a fresh prompt's
full-attention layers), one fused `scaled_dot_product_attention` call.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mk.config import PAGE_SIZE
from mk.model.paged import UNMAPPED, KVMappingError

# Query and key block of the flex block mask (the kernel's sparse block).
FLEX_BLOCK = 128
# Elements of one [heads, query tile, keys] score tile on the SDPA path.
SDPA_TILE_ELEMENTS = {"cpu": 1 << 22, "cuda": 1 << 28}


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`. From the CPU to CUDA through pinned memory, non-blocking: the copy is queued
    behind the stream's work, where a copy from pageable memory would first wait for that work to
    finish (PyTorch synchronises the stream after it), leaving the GPU idle while the host prepares
    what follows. (PyTorch keeps the pinned block until the copy has run.)"""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


@dataclass(slots=True)
class Piece:
    """One sequence's tokens in a chunk: positions [first, first + n), query rows [q_off, q_off + n)."""

    first: int
    n: int
    q_off: int
    table: torch.Tensor  # int32 [layers, pages] on the CPU (mapping checks)
    table_dev: torch.Tensor  # the same on the compute device (gathers)


@dataclass(slots=True)
class PackedKeys:
    """The packed keys of one chunk for one attention kind (window None: full attention)."""

    window: int | None
    row_of: dict[int, int]  # model layer -> row of `slots`
    slots: torch.Tensor  # long [layers of this kind, K]: pool row (block * 64 + offset) of each key
    write_cols: torch.Tensor  # long [N]: the key column holding each query row's own position
    k_first: list[int]
    k_off: list[int]
    k_len: list[int]
    n_keys: int
    lo: torch.Tensor  # int32 [N]: first key column each query row sees
    hi: torch.Tensor  # int32 [N]: last key column each query row sees
    backend_data: object = None  # the attention path's per-chunk data (block mask, cu_seqlens)


def pack_keys(pieces: list[Piece], layers: list[int], window: int | None, device: torch.device) -> PackedKeys:
    """Key layout and pool rows of one chunk for `layers` (all of one kind); raises
    KVMappingError if a page to be written or read is unmapped on any of them."""
    rows = torch.tensor(layers, dtype=torch.long)
    rows_dev = to_device(rows, device)
    slots, write_cols, lo_parts, hi_parts = [], [], [], []
    k_first, k_off, k_len = [], [], []
    off = 0
    for p in pieces:
        end = p.first + p.n
        first = 0 if window is None else max(0, p.first - window + 1)
        check_mapped(p.table, rows, p.first, end, "written")
        check_mapped(p.table, rows, first, end, "read")
        kpos = torch.arange(first, end, device=device)
        blocks = p.table_dev.index_select(0, rows_dev)[:, kpos // PAGE_SIZE]
        slots.append(blocks.long() * PAGE_SIZE + kpos % PAGE_SIZE)
        write_cols.append(torch.arange(off + p.first - first, off + end - first, device=device))
        qpos = torch.arange(p.first, end, device=device, dtype=torch.int32)
        lo = qpos - window + 1 if window is not None else torch.zeros_like(qpos)
        lo_parts.append(off + lo.clamp(min=first) - first)
        hi_parts.append(off + qpos - first)
        k_first.append(first)
        k_off.append(off)
        k_len.append(end - first)
        off += end - first
    return PackedKeys(
        window=window,
        row_of={layer: i for i, layer in enumerate(layers)},
        slots=torch.cat(slots, dim=1),
        write_cols=torch.cat(write_cols),
        k_first=k_first,
        k_off=k_off,
        k_len=k_len,
        n_keys=off,
        lo=torch.cat(lo_parts).to(torch.int32),
        hi=torch.cat(hi_parts).to(torch.int32),
    )


def check_mapped(table: torch.Tensor, rows: torch.Tensor, lo: int, hi: int, what: str) -> None:
    """Every page holding positions [lo, hi) of the given layers is mapped."""
    p0, p1 = lo // PAGE_SIZE, (hi - 1) // PAGE_SIZE
    if p1 >= table.shape[1]:
        raise KVMappingError(f"position {hi - 1} needs page {p1} but the table has {table.shape[1]}")
    sub = table.index_select(0, rows)[:, p0 : p1 + 1]
    if (sub == UNMAPPED).any():
        i, j = (sub == UNMAPPED).nonzero()[0].tolist()
        raise KVMappingError(
            f"layer {int(rows[i])}: page {p0 + j} is unmapped but positions {lo}..{hi - 1} are {what} (prefill)"
        )


# ---- flex ----------------------------------------------------------------------------------------------
def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def interval_block_mask(
    lo: torch.Tensor, hi: torch.Tensor, k_pad: int, q_pad: int | None = None, block: int = FLEX_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block classification of a mask where query row r sees key columns [lo[r], hi[r]].

    Rows from len(lo) up to `q_pad` (default: the next multiple of `block`) are padding, whose
    output is thrown away (don't care). Returns bool (partial, full) of shape [q_pad // block,
    k_pad // block]: `full` blocks need no mask inside, `partial` blocks hold at least one visible
    entry and need the mask_mod; other blocks are skipped."""
    n = lo.shape[0]
    q_pad = round_up(n, block) if q_pad is None else q_pad
    q_blocks, pad = q_pad // block, q_pad - n
    real = torch.ones(n, dtype=torch.bool, device=lo.device)
    if pad:
        lo = torch.cat([lo, lo.new_full((pad,), 1)])
        hi = torch.cat([hi, hi.new_zeros(pad)])
        real = torch.cat([real, real.new_zeros(pad)])
    lo_b, hi_b, real_b = lo.view(q_blocks, block, 1), hi.view(q_blocks, block, 1), real.view(q_blocks, block, 1)
    c0 = torch.arange(0, k_pad, block, device=lo.device, dtype=lo.dtype)
    c1 = c0 + block - 1
    any_ = (real_b & (lo_b <= hi_b) & (lo_b <= c1) & (hi_b >= c0)).any(1)
    full = (~real_b | ((lo_b <= c0) & (hi_b >= c1))).all(1) & any_
    return any_ & ~full, full


def _ordered(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(count, indices) of the True columns of each row, True columns first in ascending order."""
    num = mask.sum(-1, dtype=torch.int32)
    idx = torch.argsort(mask.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return num[None, None], idx[None, None]


def flex_block_mask(keys: PackedKeys, q_pad: int, k_pad: int):
    """The flex BlockMask of one chunk: query rows see [lo, hi]; padding rows see nothing."""
    from torch.nn.attention.flex_attention import BlockMask

    n = keys.lo.shape[0]
    lo = torch.cat([keys.lo, keys.lo.new_full((q_pad - n,), 1)])
    hi = torch.cat([keys.hi, keys.hi.new_zeros(q_pad - n)])

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx >= lo[q_idx]) & (kv_idx <= hi[q_idx])

    partial, full = interval_block_mask(keys.lo, keys.hi, k_pad, q_pad)
    kv_num, kv_idx = _ordered(partial)
    full_num, full_idx = _ordered(full)
    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=FLEX_BLOCK, mask_mod=mask_mod, seq_lengths=(q_pad, k_pad)
    )


def static_block_mask(lo: torch.Tensor, hi: torch.Tensor, k_pad: int):
    """A flex BlockMask whose query row r sees key columns [lo[r], hi[r]] of `lo` and `hi` (int32
    [q_pad], every row real) as they hold at each call: `refresh_block_mask` rewrites its block
    tensors in place after they change, so a CUDA graph that captured it stays valid."""
    from torch.nn.attention.flex_attention import BlockMask

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx >= lo[q_idx]) & (kv_idx <= hi[q_idx])

    partial, full = interval_block_mask(lo, hi, k_pad, lo.shape[0])
    kv_num, kv_idx = _ordered(partial)
    full_num, full_idx = _ordered(full)
    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=FLEX_BLOCK, mask_mod=mask_mod, seq_lengths=(lo.shape[0], k_pad)
    )


def refresh_block_mask(mask, lo: torch.Tensor, hi: torch.Tensor, k_pad: int) -> None:
    """`static_block_mask`'s block tensors for the intervals `lo` and `hi` now hold (the forward
    pass reads only the key-side ones)."""
    partial, full = interval_block_mask(lo, hi, k_pad, lo.shape[0])
    for (num, idx), (num_dst, idx_dst) in (
        (_ordered(partial), (mask.kv_num_blocks, mask.kv_indices)),
        (_ordered(full), (mask.full_kv_num_blocks, mask.full_kv_indices)),
    ):
        num_dst.copy_(num)
        idx_dst.copy_(idx)


def attend_intervals_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor):
    """Attention where query row r sees key columns [lo[r], hi[r]]: one SDPA call with an explicit
    mask (small shapes only: the CPU tests of the static passes). q [N, heads, d], k/v [K, kv_heads,
    d] -> [N, heads * d]."""
    n, hq, hd = q.shape
    group = hq // k.shape[1]
    cols = torch.arange(k.shape[0], device=q.device)
    mask = (cols[None, :] >= lo[:, None]) & (cols[None, :] <= hi[:, None])
    kk = k.repeat_interleave(group, dim=1).transpose(0, 1)
    vv = v.repeat_interleave(group, dim=1).transpose(0, 1)
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], kk[None], vv[None], attn_mask=mask[None, None])
    return o[0].transpose(0, 1).reshape(n, hq * hd)


@contextlib.contextmanager
def compile_settings():
    """What mk's torch.compile calls trace and compile under (scoped to the call):
    - no duck sizing: sizes equal at the first call (query and key lengths, a length and a head
      count) must not become one symbol, or the first call where they differ recompiles;
    - no on-disk FX graph / AOTAutograd cache: in torch 2.11 a dynamic-shape flex_attention graph
      recompiled in one process was served to another from the cache with the wrong kernel (heap
      corruption on the CPU, seen here). Each process compiles afresh (seconds to tens of seconds).
    """
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config
    from torch.fx.experimental import _config as fx_config

    with (
        fx_config.patch(use_duck_shape=False),
        inductor_config.patch(fx_graph_cache=False),
        functorch_config.patch(enable_autograd_cache=False),
    ):
        yield


_FLEX = None


def _compiled_flex():
    """flex_attention compiled once per process (dynamic shapes: one kernel for all lengths)."""
    global _FLEX
    if _FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX = torch.compile(flex_attention, dynamic=True)
    return _FLEX


def flex_len(n: int) -> int:
    """Padded flex length: whole blocks, and at least two, so that no block-mask dimension is 1
    (the compiler specialises size-1 dimensions: one more compile)."""
    return max(2 * FLEX_BLOCK, round_up(n, FLEX_BLOCK))


def _head_major(x: torch.Tensor, length: int) -> torch.Tensor:
    """[n, heads, d] -> contiguous [1, heads, length, d], zero beyond n. Zero, not garbage: a masked
    entry multiplies V by a zero probability, and 0 · NaN would survive."""
    out = x.new_zeros(1, x.shape[1], length, x.shape[2])
    out[0, :, : x.shape[0]] = x.transpose(0, 1)
    return out


def attend_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: PackedKeys, compiled: bool) -> torch.Tensor:
    n, hq, hd = q.shape
    q_pad, k_pad = flex_len(n), flex_len(keys.n_keys)
    if keys.backend_data is None:
        keys.backend_data = flex_block_mask(keys, q_pad, k_pad)
    q4, k4, v4 = _head_major(q, q_pad), _head_major(k, k_pad), _head_major(v, k_pad)
    if compiled:
        with compile_settings():
            out = _compiled_flex()(q4, k4, v4, block_mask=keys.backend_data, enable_gqa=True)
    else:
        from torch.nn.attention.flex_attention import flex_attention

        out = flex_attention(q4, k4, v4, block_mask=keys.backend_data, enable_gqa=True)
    return out[0, :, :n].transpose(0, 1).reshape(n, hq * hd)


# Fused kernels `attend_causal` may take, in order of preference (the math one: the CPU's fallback).
CAUSAL_BACKENDS = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "MATH")


def attend_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal GQA attention of rows 0..n-1 over their own keys: q [n, heads, d], k/v [n, kv_heads, d]
    -> [n, heads * d]. No block mask to read: on CUDA one fused kernel (cuDNN's where it takes the
    shapes)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    n, hq, hd = q.shape
    backends = [getattr(SDPBackend, name) for name in CAUSAL_BACKENDS]
    with sdpa_kernel(backends, set_priority=True):
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True, enable_gqa=True
        )
    return o[0].transpose(0, 1).reshape(n, hq * hd)


# ---- FlashAttention-3 ----------------------------------------------------------------------------------
def fa3_available() -> bool:
    try:
        import flash_attn_interface  # noqa: F401
    except ImportError:
        return False
    return True


def attend_fa3(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: PackedKeys, pieces: list[Piece]
) -> torch.Tensor:
    from flash_attn_interface import flash_attn_varlen_func

    n, hq, hd = q.shape
    if keys.backend_data is None:
        q_lens = [p.n for p in pieces]
        cu_q = to_device(torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32), q.device)
        cu_k = to_device(torch.tensor([*keys.k_off, keys.n_keys], dtype=torch.int32), q.device)
        keys.backend_data = (cu_q, cu_k, max(q_lens), max(keys.k_len))
    cu_q, cu_k, max_q, max_k = keys.backend_data
    window = (keys.window - 1, 0) if keys.window is not None else (-1, -1)
    # Causal aligns bottom-right: each piece's last query sees its last key.
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, window_size=window)
    if isinstance(out, tuple):  # some releases also return the log-sum-exp
        out = out[0]
    return out.reshape(n, hq * hd)


# ---- SDPA ----------------------------------------------------------------------------------------------
def attend_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: PackedKeys, pieces: list[Piece]
) -> torch.Tensor:
    n, hq, hd = q.shape
    group = hq // k.shape[1]
    out = q.new_empty(n, hq, hd)
    budget = SDPA_TILE_ELEMENTS.get(q.device.type, 1 << 24)
    for i, p in enumerate(pieces):
        first, k_off = keys.k_first[i], keys.k_off[i]
        tile = max(1, min(p.n, budget // max(1, keys.k_len[i] * hq)))
        for t0 in range(0, p.n, tile):
            t1 = min(p.n, t0 + tile)
            lo_pos = first if keys.window is None else max(first, p.first + t0 - keys.window + 1)
            c0, c1 = k_off + lo_pos - first, k_off + p.first + t1 - first
            qpos = torch.arange(p.first + t0, p.first + t1, device=q.device)[:, None]
            kpos = torch.arange(lo_pos, p.first + t1, device=q.device)[None, :]
            mask = kpos <= qpos
            if keys.window is not None:
                mask &= kpos > qpos - keys.window
            kk = k[c0:c1].repeat_interleave(group, dim=1).transpose(0, 1)
            vv = v[c0:c1].repeat_interleave(group, dim=1).transpose(0, 1)
            qq = q[p.q_off + t0 : p.q_off + t1].transpose(0, 1)
            o = F.scaled_dot_product_attention(qq[None], kk[None], vv[None], attn_mask=mask[None, None])
            out[p.q_off + t0 : p.q_off + t1] = o[0].transpose(0, 1)
    return out.reshape(n, hq * hd)
