"""A CPU (or GPU) interpreter of decode-step task graphs, written with PyTorch.

It executes the same task lists the megakernel runs, one task at a time in the graph's global
order, on the same buffers (`StepBuffers`), with the reference model's numerics. Tests compare
its logits with `Model.decode`; GPU tests compare the kernel's buffers with it, buffer by buffer.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from mk.config import PAGE_SIZE
from mk.megakernel.buffers import StepBuffers
from mk.megakernel.graph import ARG, Matrix, Op, StepGraph
from mk.model.moe import select_experts
from mk.model.paged import PagedKV
from mk.model.reference import Model, rms_norm
from mk.model.rope import cos_sin


def split_keys(a: list[int], pos: int) -> tuple[int, int]:
    """Keys [lo, hi) of an attention split (words: row, KV head, split, window or 0, splits, chunk)
    for its row writing at `pos`, as the kernel and `graph::split_keys` compute them."""
    split, window, chunk = a[2], a[3], a[5]
    end = pos + 1
    start = max(0, end - window) if window > 0 else 0
    lo = start + split * chunk
    return lo, min(lo + chunk, end)


class RoutingMismatch(AssertionError):
    """A forced routing choice is not a near-tie of the interpreter's own choice."""


def run_step(
    model: Model,
    kv: PagedKV,
    graph: StepGraph,
    buf: StepBuffers,
    forced_routing: torch.Tensor | None = None,
    tie_tol: float = 0.0,
    teacher_residuals: torch.Tensor | None = None,
) -> int:
    """Execute every task of `graph` in its global order; returns how many expert choices
    followed `forced_routing`.

    `forced_routing` ([layers, B, top_k] expert ids, e.g. the kernel's `routing_log`) makes each
    top-k task take those experts wherever they are within `tie_tol` of the interpreter's own
    choice (bf16 rounding can flip near-tied experts, and one flip changes everything after
    it); a choice farther off raises RoutingMismatch.

    `teacher_residuals` ([layers, B, hidden], e.g. the kernel's `residual_log`): after each
    layer, the interpreter records its own residual in `buf.residual_log` and then continues
    from the teacher's, so every layer is compared on the same input and errors do not compound.
    """
    vm = _Interpreter(model, kv, graph, buf, forced_routing, tie_tol)
    vm.teacher = teacher_residuals
    for task in graph.order:
        vm.execute(task)
    return vm.forced


class _Interpreter:
    def __init__(self, model: Model, kv: PagedKV, graph: StepGraph, buf: StepBuffers, forced, tie_tol) -> None:
        self.m, self.cfg, self.w, self.kv, self.g, self.b = model, model.config, model.weights, kv, graph, buf
        self.forced_routing, self.tie_tol, self.forced = forced, tie_tol, 0
        self.teacher: torch.Tensor | None = None
        self.act = model.dtype
        self.cos, self.sin = cos_sin(self.cfg, buf.positions.long(), model.dtype)
        self.claimed: set[tuple[int, int]] = set()  # (layer, matrix) queues already emptied

    def execute(self, t) -> None:
        op, layer, a = Op(int(t[0])), int(t[1]), [int(v) for v in t[ARG:]]
        {
            Op.NOP: lambda *_: None,
            Op.EMBED: self.embed,
            Op.GEMV: self.gemv,
            Op.ATTN_SPLIT: self.attn_split,
            Op.ATTN_COMBINE: self.attn_combine,
            Op.TOPK: self.topk,
            Op.RESIDUAL_NORM: self.residual_norm,
            Op.SAMPLE_PART: self.sample_part,
            Op.SAMPLE_FINAL: self.sample_final,
            Op.EXPERT_CLAIM: self.expert_claim,
        }[op](layer, a)

    # ---- helpers ----------------------------------------------------------------------------
    def lw(self, layer: int, name: str) -> torch.Tensor:
        return self.w[f"model.layers.{layer}.{name}.weight"]

    def gamma(self, layer: int) -> torch.Tensor:
        """Norm weight applied to produce layer `layer`'s input (the final norm past the end)."""
        if layer == self.cfg.num_hidden_layers:
            return self.w["model.norm.weight"]
        return self.lw(layer, "input_layernorm")

    def matmul(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x · wᵀ in the weights' dtype (bf16 rounds here, as the reference does), widened."""
        return (x.to(w.dtype) @ w.T).float() if w.dtype != torch.float64 else x.to(w.dtype) @ w.T

    def expert_rows(self, slot: int) -> torch.Tensor:
        return (self.b.topk_slot == slot).any(dim=1).nonzero().flatten()

    # ---- ops ----------------------------------------------------------------------------------
    def embed(self, layer: int, a: list[int]) -> None:
        row = a[0]
        self.b.x[row] = self.w["model.embed_tokens.weight"][int(self.b.tokens[row])].float()
        self.b.h[row] = rms_norm(self.b.x[row], self.gamma(0), self.cfg.rms_norm_eps).to(self.act)

    def gemv(self, layer: int, a: list[int]) -> None:
        matrix, r0, groups, slot = Matrix(a[0]), a[1], a[2], a[3]
        r1 = r0 + 16 * groups
        b, cfg = self.b, self.cfg
        if matrix == Matrix.QKV:
            qw, kvw = cfg.q_width, cfg.kv_width
            end = qw if r0 < qw else (qw + kvw if r0 < qw + kvw else qw + 2 * kvw)  # tasks stay in Q, K or V
            for lo in range(r0, min(r1, end), 16):
                self.qkv_tile(layer, lo, lo + 16)
        elif matrix == Matrix.O_PROJ:
            b.y_attn[:, r0:r1] = self.matmul(b.attn_out, self.lw(layer, "self_attn.o_proj")[r0:r1])
        elif matrix == Matrix.ROUTER:
            b.router[:, r0:r1] = self.matmul(b.h, self.lw(layer, "mlp.gate")[r0:r1])
        elif matrix == Matrix.DENSE_GATE_UP:
            gate, up = self.lw(layer, "mlp.gate_proj")[r0:r1], self.lw(layer, "mlp.up_proj")[r0:r1]
            b.dense_act[:, r0:r1] = self.swiglu_half(b.h, gate, up)
        elif matrix == Matrix.DENSE_DOWN:
            b.ffn_out[:, r0:r1] = self.matmul(b.dense_act, self.lw(layer, "mlp.down_proj")[r0:r1])
        elif matrix == Matrix.EXPERT_GATE_UP:
            if slot < int(b.slot_count[0]):
                p, rows = self.expert_prefix(layer, slot), self.expert_rows(slot)
                gate, up = self.w[p + "gate_proj.weight"][r0:r1], self.w[p + "up_proj.weight"][r0:r1]
                b.expert_act[slot, rows, r0:r1] = self.swiglu_half(b.h[rows], gate, up)
        elif matrix == Matrix.EXPERT_DOWN:
            if slot < int(b.slot_count[0]):
                p, rows = self.expert_prefix(layer, slot), self.expert_rows(slot)
                down = self.w[p + "down_proj.weight"][r0:r1]
                b.expert_out[slot, rows, r0:r1] = self.matmul(b.expert_act[slot, rows], down).to(b.expert_out.dtype)
        elif matrix == Matrix.LM_HEAD:
            out = self.matmul(b.h, self.w["model.embed_tokens.weight"][r0:r1])
            b.logits[:, r0:r1] = out * cfg.logit_scale

    def expert_claim(self, layer: int, a: list[int]) -> None:
        """The first claimer of a queue takes every tile (in the kernel, whoever is free does);
        the others find it empty."""
        matrix, groups, tiles = a[0], a[1], a[2]
        if (layer, matrix) in self.claimed:
            return
        self.claimed.add((layer, matrix))
        for tile in range(int(self.b.slot_count[0]) * tiles):
            slot, r0 = tile // tiles, (tile % tiles) * 16 * groups
            self.gemv(layer, [matrix, r0, groups, slot])

    def expert_prefix(self, layer: int, slot: int) -> str:
        return f"model.layers.{layer}.mlp.experts.{int(self.b.slot_expert[slot])}."

    def swiglu_half(self, h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return (F.silu(self.matmul(h, gate)) * self.matmul(h, up)).to(self.act)

    def qkv_tile(self, layer: int, r0: int, r1: int) -> None:
        cfg, b = self.cfg, self.b
        qw, kvw, hd = cfg.q_width, cfg.kv_width, cfg.head_dim
        if r0 < qw:
            w, lo, target = self.lw(layer, "self_attn.q_proj"), r0, "q"
        elif r0 < qw + kvw:
            w, lo, target = self.lw(layer, "self_attn.k_proj"), r0 - qw, "k"
        else:
            w, lo, target = self.lw(layer, "self_attn.v_proj"), r0 - qw - kvw, "v"
        y = self.matmul(b.h, w[lo : lo + 16])  # [B, 16], dtype-rounded
        if target != "v" and cfg.needs_rope(layer):
            pairs = slice((lo % hd) // 2, (lo % hd) // 2 + 8)
            c, s = self.cos[:, pairs], self.sin[:, pairs]
            ye, yo = y[:, 0::2].to(c.dtype), y[:, 1::2].to(c.dtype)
            y = torch.stack([ye * c - yo * s, yo * c + ye * s], dim=-1).flatten(1)
        if target == "q":
            b.q[:, lo : lo + 16] = y.float()
            return
        pool = self.kv.k if target == "k" else self.kv.v
        head, d0 = lo // hd, lo % hd
        for row in range(b.positions.numel()):
            pos = int(b.positions[row])
            block = int(b.block_tables[layer, row, pos // PAGE_SIZE])
            pool[block, pos % PAGE_SIZE, head, d0 : d0 + 16] = y[row].to(pool.dtype)

    def keys(self, layer: int, row: int, kvh: int, lo: int, hi: int):
        pos = torch.arange(lo, hi)
        blocks = self.b.block_tables[layer, row, pos // PAGE_SIZE].long().cpu()
        if (blocks < 0).any():
            raise RuntimeError(f"layer {layer} row {row}: attention reads an unmapped page")
        k = self.kv.k[blocks, pos % PAGE_SIZE, kvh].float()
        v = self.kv.v[blocks, pos % PAGE_SIZE, kvh].float()
        return k, v

    def attn_split(self, layer: int, a: list[int]) -> None:
        row, kvh, split = a[:3]
        lo, hi = split_keys(a, int(self.b.positions[row]))
        cfg, b = self.cfg, self.b
        group, hd = cfg.num_attention_heads // cfg.num_key_value_heads, cfg.head_dim
        q = b.q[row, kvh * group * hd : (kvh + 1) * group * hd].view(group, hd)
        k, v = self.keys(layer, row, kvh, lo, hi)
        scores = (q @ k.T) / math.sqrt(hd)
        m = scores.max(dim=-1).values
        p = torch.exp(scores - m[:, None])
        slot = row * cfg.num_key_value_heads + kvh
        b.attn_o[slot, split] = p @ v
        b.attn_ml[slot, split, :, 0] = m
        b.attn_ml[slot, split, :, 1] = p.sum(dim=-1)

    def attn_combine(self, layer: int, a: list[int]) -> None:
        row, kvh, splits = a[:3]
        cfg, b = self.cfg, self.b
        group, hd = cfg.num_attention_heads // cfg.num_key_value_heads, cfg.head_dim
        slot = row * cfg.num_key_value_heads + kvh
        m, s = b.attn_ml[slot, :splits, :, 0], b.attn_ml[slot, :splits, :, 1]
        scale = torch.exp(m - m.max(dim=0).values)  # [splits, group]
        o = (b.attn_o[slot, :splits] * scale[..., None]).sum(0) / (s * scale).sum(0)[:, None]
        b.attn_out[row, kvh * group * hd : (kvh + 1) * group * hd] = o.flatten().to(self.act)

    def topk(self, layer: int, a: list[int]) -> None:
        b = self.b
        idx, scores = select_experts(b.router, self.cfg.num_experts_per_tok)
        if self.forced_routing is not None:
            idx = self.follow(layer, idx)
            scores = torch.sigmoid(torch.gather(b.router, 1, idx))
        b.routing_log[layer] = idx.to(torch.int32)
        active = torch.unique(idx)  # ascending expert ids
        b.slot_count[0] = len(active)
        b.slot_expert[: len(active)] = active.to(torch.int32)
        b.topk_slot[:] = torch.searchsorted(active, idx.contiguous()).to(torch.int32)
        b.topk_score[:] = scores

    def follow(self, layer: int, own: torch.Tensor) -> torch.Tensor:
        forced = self.forced_routing[layer].to(own.device).long()
        logits = self.b.router
        kth = torch.gather(logits, 1, own).min(dim=1, keepdim=True).values
        got = torch.gather(logits, 1, forced)
        if (got < kth - self.tie_tol).any() or (forced.sort(1).values.diff(dim=1) == 0).any():
            raise RoutingMismatch(f"layer {layer}: forced experts {forced.tolist()} vs own {own.tolist()}")
        self.forced += int((forced.sort(1).values != own.sort(1).values).any(dim=1).sum())
        return forced

    def residual_norm(self, layer: int, a: list[int]) -> None:
        row, b = a[0], self.b
        if self.cfg.is_moe(layer):
            # Slots are in ascending expert order: the reference's summation order.
            order = torch.argsort(b.topk_slot[row])
            ffn = torch.zeros_like(b.x[row])
            for k in order.tolist():
                ffn = ffn + b.expert_out[int(b.topk_slot[row, k]), row] * b.topk_score[row, k]
        else:
            ffn = b.ffn_out[row]
        b.x[row] = b.x[row] + b.y_attn[row] + ffn
        if b.residual_log.numel():
            b.residual_log[layer, row] = b.x[row]
        if self.teacher is not None:
            b.x[row] = self.teacher[layer, row].to(b.x.device)
        b.h[row] = rms_norm(b.x[row], self.gamma(layer + 1), self.cfg.rms_norm_eps).to(self.act)

    def sample_part(self, layer: int, a: list[int]) -> None:
        row, part, lo, hi = a[:4]
        best = int(torch.argmax(self.b.logits[row, lo:hi]))  # first maximum: the lowest id
        self.b.sample_score[row, part] = self.b.logits[row, lo + best]
        self.b.sample_id[row, part] = lo + best

    def sample_final(self, layer: int, a: list[int]) -> None:
        row, parts = a[:2]
        scores, ids = self.b.sample_score[row, :parts], self.b.sample_id[row, :parts]
        best = scores.max()
        self.b.sampled[row] = ids[scores == best].min()
