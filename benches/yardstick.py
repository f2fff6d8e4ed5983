"""The PyTorch yardstick: one decode step of the model in plain PyTorch, captured in a CUDA graph.

Static shapes throughout so the step can be captured: paged K/V gathered through the block table
into SDPA (GQA), sigmoid top-k routing with `torch._grouped_mm` over the experts (tokens sorted by
expert on the device), tied LM head and greedy argmax. Weights are the stacked tensors the bench
generates; the megakernel reads the same memory through per-expert views.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mk.config import PAGE_SIZE, ModelConfig


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(torch.bfloat16)


def gathered_bytes(cfg: ModelConfig, batch: int, ctx: int) -> int:
    """The K and V a full-attention layer of the step gathers through the block tables (bf16): the
    least the step needs beside the cache and the weights, before SDPA's own work space. A point
    where this is not free cannot run."""
    return 2 * batch * ctx * cfg.kv_width * 2


class TorchDecode:
    def __init__(self, cfg: ModelConfig, w: dict, stacked: dict, k_pool, v_pool, tables, positions) -> None:
        self.cfg, self.w, self.stacked = cfg, w, stacked
        self.k_pool, self.v_pool = k_pool, v_pool
        self.tables = tables  # int32 [layers, B, pages]
        self.positions = positions.long()  # [B]
        dev = positions.device
        hd = cfg.head_dim
        inv = cfg.rope_theta ** (-torch.arange(0, hd, 2, dtype=torch.float64, device=dev) / hd)
        ang = self.positions[:, None].double() * inv[None]
        self.cos, self.sin = ang.cos().float(), ang.sin().float()
        ctx = int(positions.max()) + 1
        self.keys = torch.arange(ctx, device=dev)
        self.grouped = hasattr(torch, "_grouped_mm")

    def step_checked(self, tokens):
        """First (eager) step: falls back to gathered experts if grouped matmuls are refused (not
        when the card is out of memory: the gathered experts take more)."""
        try:
            return self.step(tokens)
        except torch.cuda.OutOfMemoryError:
            raise
        except RuntimeError:
            self.grouped = False
            return self.step(tokens)

    def rope(self, x: torch.Tensor) -> torch.Tensor:  # [B, heads, hd]
        xe, xo = x[..., 0::2].float(), x[..., 1::2].float()
        c, s = self.cos[:, None], self.sin[:, None]
        return torch.stack([xe * c - xo * s, xo * c + xe * s], -1).flatten(-2).to(torch.bfloat16)

    def attention(self, layer: int, q, k, v):
        cfg, B = self.cfg, q.shape[0]
        table = self.tables[layer].long()  # [B, pages]
        pos = self.positions
        blk = table.gather(1, (pos // PAGE_SIZE)[:, None]).squeeze(1)
        self.k_pool[blk, pos % PAGE_SIZE] = k
        self.v_pool[blk, pos % PAGE_SIZE] = v
        window = cfg.window(layer)
        keys = self.keys
        if window is not None:
            keys = keys[-min(window, len(keys)) :]
        # Gather every row's keys through its table (rows shorter than ctx mask the rest).
        kpos = keys[None, :].expand(B, -1)
        kblk = table.gather(1, (kpos // PAGE_SIZE).clamp(min=0))
        kk = self.k_pool[kblk.clamp(min=0), kpos % PAGE_SIZE]  # [B, n, hkv, hd]
        vv = self.v_pool[kblk.clamp(min=0), kpos % PAGE_SIZE]
        visible = kpos <= pos[:, None]
        if window is not None:
            visible &= kpos > pos[:, None] - window
        mask = visible[:, None, None, :]
        o = F.scaled_dot_product_attention(
            q[:, :, None], kk.transpose(1, 2), vv.transpose(1, 2), attn_mask=mask, enable_gqa=True
        )
        return o.reshape(B, -1)

    def moe(self, layer: int, h):
        cfg, st = self.cfg, self.stacked
        logits = (h @ self.w[f"model.layers.{layer}.mlp.gate.weight"].T).float()
        scores, idx = torch.topk(logits, cfg.num_experts_per_tok, dim=-1)
        scores = torch.sigmoid(scores)
        flat = idx.flatten()
        order = torch.argsort(flat, stable=True)
        rows = h[order // cfg.num_experts_per_tok]
        if self.grouped:
            counts = F.one_hot(flat, cfg.num_experts).sum(0)
            offs = torch.cumsum(counts, 0).to(torch.int32)
            g = torch._grouped_mm(rows, st["gate"][layer].transpose(-2, -1), offs=offs)
            u = torch._grouped_mm(rows, st["up"][layer].transpose(-2, -1), offs=offs)
            a = (F.silu(g.float()) * u.float()).to(torch.bfloat16)
            y = torch._grouped_mm(a, st["down"][layer].transpose(-2, -1), offs=offs).float()
        else:  # gather each (token, choice)'s expert weights: more traffic, always available
            e = flat[order]
            g = torch.bmm(st["gate"][layer][e], rows[:, :, None]).squeeze(-1)
            u = torch.bmm(st["up"][layer][e], rows[:, :, None]).squeeze(-1)
            a = (F.silu(g.float()) * u.float()).to(torch.bfloat16)
            y = torch.bmm(st["down"][layer][e], a[:, :, None]).squeeze(-1).float()
        out = torch.zeros(flat.numel(), cfg.hidden_size, device=h.device)
        out[order] = y
        return (out.view(h.shape[0], -1, cfg.hidden_size) * scores[..., None]).sum(1)

    def step(self, tokens):
        cfg, w = self.cfg, self.w
        B = tokens.shape[0]
        x = w["model.embed_tokens.weight"][tokens].float()
        hq, hkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        for layer in range(cfg.num_hidden_layers):
            p = f"model.layers.{layer}."
            h = _norm(x, w[p + "input_layernorm.weight"], cfg.rms_norm_eps)
            q = (h @ w[p + "self_attn.q_proj.weight"].T).view(B, hq, hd)
            k = (h @ w[p + "self_attn.k_proj.weight"].T).view(B, hkv, hd)
            v = (h @ w[p + "self_attn.v_proj.weight"].T).view(B, hkv, hd)
            if cfg.needs_rope(layer):
                q, k = self.rope(q), self.rope(k)
            attn = self.attention(layer, q, k, v) @ w[p + "self_attn.o_proj.weight"].T
            if cfg.is_moe(layer):
                ffn = self.moe(layer, h)
            else:
                g = h @ w[p + "mlp.gate_proj.weight"].T
                u = h @ w[p + "mlp.up_proj.weight"].T
                ffn = ((F.silu(g.float()) * u.float()).to(torch.bfloat16) @ w[p + "mlp.down_proj.weight"].T).float()
            x = x + attn.float() + ffn
        h = _norm(x, w["model.norm.weight"], cfg.rms_norm_eps)
        return (h @ w["model.embed_tokens.weight"].T).float().argmax(-1)
