"""The PyTorch reference model of North Mini Code: the numerics oracle of mk.

Per layer l with residual x:  h = RMSNorm(x)·w_l;  x = x + Attn_l(h) + FFN_l(h)  (parallel block).
Then logits = (RMSNorm(x)·w_final) @ embed_tokens^T · logit_scale (tied head).

Precision: the residual, norms, RoPE, softmax and the MoE combine run in fp32 (fp64 for a float64
model); matmuls run in the weights' dtype. In bf16 mode Q/K and cos/sin enter RoPE bf16-rounded.
K/V live in a paged cache (mk.model.paged); the model reads only the pages inside each query's
causal/sliding window, so released out-of-window pages are never touched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mk.config import PAGE_SIZE, ModelConfig
from mk.model.moe import acc_dtype, moe_ffn, swiglu
from mk.model.names import expected_shapes
from mk.model.paged import UNMAPPED, KVMappingError, PageAllocator, PagedKV, pages_needed
from mk.model.rope import apply_rope, cos_sin

# Queries per attention tile of a long chunk: bounds the [heads, tile, keys] score tensor.
Q_TILE = 1024


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x · rsqrt(mean(x²) + eps) · w in x's dtype (the caller passes fp32 or fp64)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.to(x.dtype)


@dataclass
class _Seq:
    """One sequence's rows inside a batch: rows[a:b] sit at positions first .. first+b-a-1."""

    rows: slice
    first: int
    table: torch.Tensor  # int32 [num_layers, max_pages] on the CPU


class Model:
    """North Mini Code over a dict of HF-named weights (kept as given, never copied)."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
        expected = expected_shapes(config)
        missing = [n for n in expected if n not in weights]
        if missing:
            raise ValueError(f"missing weight {missing[0]!r} ({len(missing)} missing in all)")
        unknown = [n for n in weights if n not in expected]
        if unknown:
            raise ValueError(f"unexpected weight {unknown[0]!r} ({len(unknown)} unexpected in all)")
        ref = weights["model.embed_tokens.weight"]
        for name, shape in expected.items():
            t = weights[name]
            if tuple(t.shape) != shape:
                raise ValueError(f"weight {name!r} has shape {tuple(t.shape)}, expected {shape}")
            if t.dtype != ref.dtype or t.device != ref.device:
                raise ValueError(
                    f"weight {name!r} is {t.dtype} on {t.device}; the embedding is {ref.dtype} on {ref.device}"
                )
        if not ref.dtype.is_floating_point:
            raise ValueError(f"weights must be floating point, got {ref.dtype}")
        self.config = config
        self.weights = weights
        self.dtype = ref.dtype
        self.device = ref.device
        self.acc = acc_dtype(self.dtype)

    # ---- public API ---------------------------------------------------------------------------
    def new_kv(self, num_blocks: int) -> PagedKV:
        """An empty KV pool in the model's dtype and device."""
        return PagedKV(self.config, num_blocks, dtype=self.dtype, device=self.device)

    @torch.no_grad()
    def forward(
        self,
        tokens: torch.Tensor,
        start: int,
        kv: PagedKV,
        block_table: torch.Tensor,
        return_hidden: bool = False,
        last_only: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """Prefill one chunk of one sequence at positions start .. start+T-1.

        Writes the chunk's K/V into the (already mapped) pages of `block_table` and attends over
        the cache. Returns logits [T, vocab] (float32; float64 for a float64 model), only the last
        row when `last_only`; with `return_hidden` also the residual after each layer [T, hidden].
        """
        tokens = self._check_tokens(tokens)
        if start < 0:
            raise ValueError(f"start must be >= 0, got {start}")
        seqs = [_Seq(slice(0, len(tokens)), int(start), self._check_table(block_table))]
        positions = torch.arange(start, start + len(tokens), dtype=torch.long)
        return self._run(tokens, positions, seqs, kv, return_hidden, last_only)

    @torch.no_grad()
    def decode(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        kv: PagedKV,
        block_tables: list[torch.Tensor],
    ) -> torch.Tensor:
        """One token for each of B distinct sequences at ragged positions; logits [B, vocab].

        Row i writes its K/V at positions[i] of block_tables[i] (mapped beforehand) and attends
        over that sequence's cache.
        """
        tokens = self._check_tokens(tokens)
        positions = torch.as_tensor(positions, dtype=torch.long).cpu().reshape(-1)
        if not (len(tokens) == len(positions) == len(block_tables)):
            raise ValueError(
                f"decode got {len(tokens)} tokens, {len(positions)} positions and {len(block_tables)} block tables"
            )
        if (positions < 0).any():
            raise ValueError("decode positions must be >= 0")
        if len({id(t) for t in block_tables}) != len(block_tables):
            raise ValueError("decode takes one token per sequence: a block table appears twice")
        seqs = [
            _Seq(slice(i, i + 1), int(p), self._check_table(t))
            for i, (p, t) in enumerate(zip(positions.tolist(), block_tables, strict=True))
        ]
        return self._run(tokens, positions, seqs, kv, False, False)

    @torch.no_grad()
    def verify(self, rows: list[tuple[list[int], int, torch.Tensor]], kv: PagedKV) -> torch.Tensor:
        """Speculative decoding's verification step: per sequence (tokens, start, block table),
        its next token and its draft at positions start, start+1, ... (mapped beforehand); logits
        [all rows, vocab], a sequence's row j being the logits after its token j. A row sees the
        rows of its own sequence before it, written in this call, as steps of one token would."""
        if len({id(t) for _, _, t in rows}) != len(rows):
            raise ValueError("verify takes each sequence once: a block table appears twice")
        if any(not tokens for tokens, _, _ in rows) or any(start < 0 for _, start, _ in rows):
            raise ValueError("verify needs at least one token per sequence, at a position >= 0")
        seqs, firsts, n = [], [], 0
        for tokens, start, table in rows:
            seqs.append(_Seq(slice(n, n + len(tokens)), int(start), self._check_table(table)))
            firsts.append(torch.arange(start, start + len(tokens), dtype=torch.long))
            n += len(tokens)
        tokens = self._check_tokens([t for toks, _, _ in rows for t in toks])
        return self._run(tokens, torch.cat(firsts), seqs, kv, False, False)

    def logits(self, token_ids: torch.Tensor | list[int]) -> torch.Tensor:
        """One-shot prefill into a private cache sized for the prompt; logits [len, vocab]."""
        tokens = self._check_tokens(token_ids)
        pages = pages_needed(len(tokens))
        alloc = PageAllocator(pages * self.config.num_hidden_layers)
        table = alloc.new_table(self.config, pages)
        alloc.ensure(table, len(tokens))
        return self.forward(tokens, 0, self.new_kv(pages * self.config.num_hidden_layers), table)

    # ---- the computation ----------------------------------------------------------------------
    def _run(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        seqs: list[_Seq],
        kv: PagedKV,
        return_hidden: bool,
        last_only: bool,
    ):
        cfg, w = self.config, self.weights
        if kv.device != self.device:
            raise ValueError(f"KV cache is on {kv.device}, the model on {self.device}")
        write_blocks = self._write_blocks(seqs)  # [layers, N], checked mapped
        offsets = (positions % PAGE_SIZE).to(self.device)
        n = len(tokens)
        hq, hkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        rope = cos_sin(cfg, positions.to(self.device), self.dtype)

        x = w["model.embed_tokens.weight"][tokens].to(self.acc)
        hidden: list[torch.Tensor] = []
        for layer in range(cfg.num_hidden_layers):
            p = f"model.layers.{layer}."
            h = rms_norm(x, w[p + "input_layernorm.weight"], cfg.rms_norm_eps).to(self.dtype)

            # Attention: project, rotate, store K/V, then attend per sequence over the cache.
            q = (h @ w[p + "self_attn.q_proj.weight"].T).view(n, hq, hd)
            k = (h @ w[p + "self_attn.k_proj.weight"].T).view(n, hkv, hd)
            v = (h @ w[p + "self_attn.v_proj.weight"].T).view(n, hkv, hd)
            if cfg.needs_rope(layer):
                q, k = apply_rope(q, *rope), apply_rope(k, *rope)
            kv.k[write_blocks[layer], offsets] = k.to(kv.dtype)
            kv.v[write_blocks[layer], offsets] = v.to(kv.dtype)
            q = q.to(self.acc)
            attn = torch.cat([self._attend(layer, q[s.rows], s, kv) for s in seqs])
            attn = (attn.to(self.dtype) @ w[p + "self_attn.o_proj.weight"].T).to(self.acc)

            if cfg.is_moe(layer):
                experts = [
                    (
                        w[f"{p}mlp.experts.{e}.gate_proj.weight"],
                        w[f"{p}mlp.experts.{e}.up_proj.weight"],
                        w[f"{p}mlp.experts.{e}.down_proj.weight"],
                    )
                    for e in range(cfg.num_experts)
                ]
                ffn = moe_ffn(h, w[p + "mlp.gate.weight"], experts, cfg.num_experts_per_tok)
            else:
                mlp = p + "mlp."
                ffn = swiglu(h, w[mlp + "gate_proj.weight"], w[mlp + "up_proj.weight"], w[mlp + "down_proj.weight"])
            x = x + attn + ffn.to(self.acc)
            if return_hidden:
                hidden.append(x)

        if last_only:
            x = x[-1:]
        h = rms_norm(x, w["model.norm.weight"], cfg.rms_norm_eps).to(self.dtype)
        out_dtype = torch.float64 if self.dtype == torch.float64 else torch.float32
        logits = (h @ w["model.embed_tokens.weight"].T).to(out_dtype) * cfg.logit_scale
        return (logits, hidden) if return_hidden else logits

    def _attend(self, layer: int, q: torch.Tensor, seq: _Seq, kv: PagedKV) -> torch.Tensor:
        """Causal (and, on sliding layers, windowed) GQA attention of one sequence's rows.

        q [T, heads, head_dim] in the acc dtype at positions seq.first ..; returns [T, heads·head_dim].
        Only keys in [first_query − window + 1, last_query] are gathered from the cache.
        """
        cfg = self.config
        window = cfg.window(layer)
        t, hq, hd = q.shape
        hkv = cfg.num_key_value_heads
        group = hq // hkv
        out = []
        for a in range(0, t, Q_TILE):
            qt = q[a : a + Q_TILE]
            q_first = seq.first + a
            q_last = q_first + len(qt) - 1
            lo = 0 if window is None else max(0, q_first - window + 1)
            k, v = self._gather(layer, seq.table, lo, q_last, kv)
            qpos = torch.arange(q_first, q_last + 1, device=self.device)[:, None]
            kpos = torch.arange(lo, q_last + 1, device=self.device)[None, :]
            visible = kpos <= qpos
            if window is not None:
                visible &= kpos > qpos - window
            scores = torch.einsum("tkgd,skd->kgts", qt.view(len(qt), hkv, group, hd), k) / math.sqrt(hd)
            probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
            out.append(torch.einsum("kgts,skd->tkgd", probs, v).reshape(len(qt), hq * hd))
        return torch.cat(out)

    def _gather(self, layer: int, table: torch.Tensor, lo: int, hi: int, kv: PagedKV):
        """K/V of positions [lo, hi] of one layer from the pages, in the acc dtype."""
        p0, p1 = lo // PAGE_SIZE, hi // PAGE_SIZE
        blocks = table[layer, p0 : p1 + 1]
        if (blocks == UNMAPPED).any():
            page = p0 + int((blocks == UNMAPPED).nonzero()[0])
            raise KVMappingError(f"layer {layer} reads positions {lo}..{hi} but page {page} is unmapped")
        idx = blocks.to(device=self.device, dtype=torch.long)
        sl = slice(lo - p0 * PAGE_SIZE, hi - p0 * PAGE_SIZE + 1)
        hkv, hd = self.config.num_key_value_heads, self.config.head_dim
        k = kv.k[idx].reshape(-1, hkv, hd)[sl].to(self.acc)
        v = kv.v[idx].reshape(-1, hkv, hd)[sl].to(self.acc)
        return k, v

    # ---- checks -------------------------------------------------------------------------------
    def _write_blocks(self, seqs: list[_Seq]) -> torch.Tensor:
        """Physical block of every row's position in every layer: long [layers, N] on the device."""
        cols = []
        for s in seqs:
            n = s.rows.stop - s.rows.start
            pages = torch.arange(s.first, s.first + n) // PAGE_SIZE
            if int(pages[-1]) >= s.table.shape[1]:
                raise KVMappingError(
                    f"position {s.first + n - 1} needs page {int(pages[-1])} but the table has {s.table.shape[1]}"
                )
            blocks = s.table[:, pages]
            if (blocks == UNMAPPED).any():
                layer, col = (blocks == UNMAPPED).nonzero()[0].tolist()
                raise KVMappingError(f"layer {layer}: position {s.first + col} is written to an unmapped page")
            cols.append(blocks)
        return torch.cat(cols, dim=1).to(device=self.device, dtype=torch.long)

    def _check_tokens(self, tokens: torch.Tensor | list[int]) -> torch.Tensor:
        tokens = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        if len(tokens) == 0:
            raise ValueError("no tokens")
        if int(tokens.min()) < 0 or int(tokens.max()) >= self.config.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.config.vocab_size})")
        return tokens.to(self.device)

    def _check_table(self, table: torch.Tensor) -> torch.Tensor:
        if table.dim() != 2 or table.shape[0] != self.config.num_hidden_layers:
            raise ValueError(
                f"block table must be [num_layers={self.config.num_hidden_layers}, max_pages], got {tuple(table.shape)}"
            )
        return table.to(device="cpu", dtype=torch.int32)
