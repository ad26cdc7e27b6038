"""Attention of the V3 family: YaRN RoPE, multi-head latent attention (naive for prefill, absorbed over the latent
cache for decode) and V3.2's lightning indexer (sparse attention beyond index_topk tokens of context).

Numerics follow transformers' DeepseekV3/V2/V32 (docs/dsv3-math.md). A layer's cache is a `cache.LatentCache`;
positions are a `cache.Positions` (host or device), so one entry serves eager forwards and captured decode steps.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .cache import LatentCache, Positions
from .config import ModelArgs
from .kernels.mla_decode import mla_attend
from .layers import Linear, RMSNorm, as_dtype, inference_views
from .limits import INDEX_SCORE_ELEMENTS

# q_a_layernorm / kv_a_layernorm use 1e-6 whatever the config says (as the hub code and transformers do)
_LATENT_NORM_EPS = 1e-6

# --- rotary embedding ---------------------------------------------------------------------------------

def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    """Inverse frequencies [rope_dim / 2] in fp32; YaRN blends interpolated and original frequencies."""
    dim, base = args.qk_rope_head_dim, args.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if args.rope_type != "yarn":
        return 1.0 / pos_freqs

    def correction_dim(rotations: float) -> float:
        return dim * math.log(args.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(args.beta_fast)), 0)
    high = min(math.ceil(correction_dim(args.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp                                   # 1 = keep the original (extrapolated) frequency
    return (1.0 / (args.rope_factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


class Rotary(nn.Module):
    """RoPE tables [positions, rope_dim] in fp32, grown on demand; not part of the checkpoint. For the pair
    angles theta_i they hold cos = [cos theta | cos theta] and sin = [-sin theta | sin theta], the form
    `apply_rope` uses on de-interleaved [evens | odds] vectors."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None

    def tables(self, end: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cos is None or self.cos.shape[0] < end or self.cos.device != device:
            n = max(end, 256 if self.cos is None else 2 * self.cos.shape[0])
            inv = rope_inv_freq(self.args).to(device)
            angles = torch.arange(n, device=device, dtype=torch.float32)[:, None] * inv
            cos, sin = angles.cos() * self.args.cos_sin_scale, angles.sin() * self.args.cos_sin_scale
            self.cos, self.sin = torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)
        return self.cos, self.sin

    def forward(self, start: int, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.tables(start + length, device)
        return cos[start:start + length], sin[start:start + length]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool = True) -> torch.Tensor:
    """Rotate x [..., rope_dim] by the tables of `Rotary` (broadcast against x), in x's dtype (as transformers).

    interleave=True: the checkpoint pairs adjacent dims (2i, 2i+1); the result is laid out de-interleaved
    [rotated evens | rotated odds]. q and k get the same permutation, so their dot products are unchanged.
    interleave=False: NeoX halves. With x = [a | b], the result is [a cos - b sin | b cos + a sin], computed
    as x * cos + swap_halves(x) * sin with sin = [-sin | sin] (the same bits: negation is exact).
    """
    if interleave:
        first, second = x[..., 0::2], x[..., 1::2]
        x = torch.cat((first, second), dim=-1)
    else:
        half = x.shape[-1] // 2
        first, second = x[..., :half], x[..., half:]
    return x * cos + torch.cat((second, first), dim=-1) * sin          # swap_halves(x) without a roll


# --- attention ---------------------------------------------------------------------------------------



class Indexer(nn.Module):
    """DeepSeek-V3.2's lightning indexer (DSA), as transformers' DeepseekV32Indexer defines it: for each query a
    relu'd multi-head dot product with one cached key per token, weighted per head and summed, picks the
    index_topk earlier tokens the query attends to. (DeepSeek's reference also rotates q and k by a Hadamard
    matrix, which keeps their dot products, and scores in FP8; transformers, and so this, scores in fp32.)"""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.n_heads, self.head_dim = args.index_n_heads, args.index_head_dim
        self.wq_b = Linear(args.q_lora_rank, self.n_heads * self.head_dim)
        self.wk = Linear(args.hidden_size, self.head_dim)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = Linear(args.hidden_size, self.n_heads)    # kept in fp32 (as transformers)
        self.scale = self.head_dim ** -0.5

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE on the first qk_rope_head_dim dims, NeoX halves (unlike MLA's interleaved pairs); the rest pass."""
        r = self.args.qk_rope_head_dim
        return torch.cat([apply_rope(x[..., :r], cos, sin, interleave=False), x[..., r:]], dim=-1)

    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, S, D] -> the keys cached for these tokens [B, S, head_dim]."""
        return self._rope(self.k_norm(self.wk(x))[:, :, None], cos, sin)[:, :, 0]

    def select(self, x: torch.Tensor, q_latent: torch.Tensor, keys: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> torch.Tensor:
        """The index_topk positions (int32 [B, S, topk]) each of the S queries keeps among keys [B, T, head_dim],
        the S queries being the last S positions (later positions score -inf, so a query that sees fewer than
        index_topk tokens keeps all of them and some it cannot see, which attention masks)."""
        bsz, seqlen, _ = x.shape
        total = keys.shape[1]
        q = self._rope(self.wq_b(q_latent).view(bsz, seqlen, self.n_heads, self.head_dim), cos, sin).float()
        weights = self.weights_proj(as_dtype(x, self.weights_proj.weight.dtype)).float() * self.n_heads ** -0.5
        k = keys.float().transpose(1, 2)[:, None]                                     # [B, 1, Dh, T]
        block = max(1, INDEX_SCORE_ELEMENTS // (self.n_heads * total))
        picked = []
        for s0 in range(0, seqlen, block):
            scores = torch.matmul(q[:, s0:s0 + block], k).mul_(self.scale).relu_()   # [B, s, H, T]
            index_scores = torch.matmul(weights[:, s0:s0 + block, None], scores)[:, :, 0]   # [B, s, T]
            if seqlen > 1:
                visible = causal_mask(seqlen, total, x.device)[s0:s0 + block]
                index_scores = index_scores.masked_fill(~visible, float("-inf"))
            picked.append(index_scores.topk(self.args.index_topk, dim=-1).indices)
        return (picked[0] if len(picked) == 1 else torch.cat(picked, dim=1)).to(torch.int32)


class MLA(nn.Module):
    """Multi-head latent attention. The cache holds, per token, [normalised latent c | RoPE'd k_pe], followed on
    V3.2 by the indexer's key: there, a query whose context exceeds index_topk tokens attends only to the
    index_topk tokens its indexer picks (dense attention up to that context)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.n_heads = args.num_attention_heads
        d, h = args.hidden_size, args.num_attention_heads
        if args.q_lora_rank:
            self.wq_a = Linear(d, args.q_lora_rank)
            self.q_norm = RMSNorm(args.q_lora_rank, _LATENT_NORM_EPS)
            self.wq_b = Linear(args.q_lora_rank, h * args.qk_head_dim)
        else:
            self.wq = Linear(d, h * args.qk_head_dim)
        self.wkv_a = Linear(d, args.kv_lora_rank + args.qk_rope_head_dim)
        self.kv_norm = RMSNorm(args.kv_lora_rank, _LATENT_NORM_EPS)
        self.wkv_b = Linear(args.kv_lora_rank, h * (args.qk_nope_head_dim + args.v_head_dim))
        self.wo = Linear(h * args.v_head_dim, d)
        self.indexer = Indexer(args) if args.has_indexer else None

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, S, D] -> q_nope [B, S, H, dn], q_pe [B, S, H, dr] (RoPE'd), latent [B, S, kv_lora + dr], and the
        query latent [B, S, q_lora_rank] (None without q_lora)."""
        a = self.args
        bsz, seqlen, _ = x.shape
        if a.q_lora_rank:
            q_latent = self.q_norm(self.wq_a(x))
            q = self.wq_b(q_latent)
        else:
            q_latent, q = None, self.wq(x)
        q = q.view(bsz, seqlen, self.n_heads, a.qk_head_dim)
        q_nope, q_pe = q.split([a.qk_nope_head_dim, a.qk_rope_head_dim], dim=-1)
        q_pe = apply_rope(q_pe, cos, sin, a.rope_interleave)                  # cos/sin: [S, 1, dr]
        kv = self.wkv_a(x)
        c, k_pe = kv.split([a.kv_lora_rank, a.qk_rope_head_dim], dim=-1)
        k_pe = apply_rope(k_pe[:, :, None], cos, sin, a.rope_interleave)[:, :, 0]
        latent = torch.cat([self.kv_norm(c), k_pe], dim=-1)
        return q_nope, q_pe, latent, q_latent

    def forward(self, x: torch.Tensor, pos: Positions, cos: torch.Tensor, sin: torch.Tensor,
                cache: LatentCache | None = None, absorb: bool = False) -> torch.Tensor:
        """x [B, S, D] at positions `pos` -> [B, S, D]; `cache` (this layer's) gets the tokens' rows. absorb:
        attention over the latent cache itself (decode: the kernel path), else expanded per head (prefill)."""
        q_nope, q_pe, latent, q_latent = self.project(x, cos, sin)
        if self.indexer is not None:
            return self.wo(self._indexed(x, pos, cos, sin, cache, absorb, q_nope, q_pe, latent, q_latent).flatten(2))
        if cache is None:
            kv = latent
        else:
            cache.write(pos, latent)
            kv = cache.latents(pos)
        if absorb:        # the kernel splits the context as for the whole cache: the same bits with graphs and without
            out = self._attend_absorbed(q_nope, q_pe, kv, seqlens=pos.seqlens if pos.start is None else None,
                                        capacity=None if cache is None else cache.capacity)
        else:
            out = self._attend_naive(q_nope, q_pe, kv)                 # [B, S, H, dv]
        return self.wo(out.flatten(2))

    def _indexed(self, x, pos, cos, sin, cache, absorb, q_nope, q_pe, latent, q_latent):
        """V3.2: cache the indexer's keys next to the latents; beyond index_topk tokens of context, attend only
        to the tokens the indexer selects for each query. Host positions only (which path runs depends on the
        context length)."""
        assert pos.start is not None, "V3.2's sparse attention takes host positions"
        width = self.args.latent_dim
        index_keys = self.indexer.keys(x, cos, sin)
        if cache is not None:
            cache.write(pos, latent, index_keys)
            rows = cache.latents(pos)
            kv, index_keys = rows[..., :width], rows[..., width:]
        else:
            kv = latent
        selected = None
        if kv.shape[1] > self.args.index_topk:
            selected = self.indexer.select(x, q_latent, index_keys, cos, sin)     # [B, S, index_topk]
        attend = self._attend_absorbed if absorb else self._attend_naive
        return attend(q_nope, q_pe, kv, selected)

    def _attend_naive(self, q_nope, q_pe, kv, selected=None):
        """Expand the latent into per-head K/V and run causal SDPA (prefill, training)."""
        a = self.args
        bsz, seqlen, h, _ = q_nope.shape
        total = kv.shape[1]
        kvh = self.wkv_b(kv[..., :a.kv_lora_rank]).view(bsz, total, h, a.qk_nope_head_dim + a.v_head_dim)
        k_nope, v = kvh.split([a.qk_nope_head_dim, a.v_head_dim], dim=-1)
        k_pe = kv[..., a.kv_lora_rank:][:, :, None, :].expand(bsz, total, h, a.qk_rope_head_dim)
        q = torch.cat([q_nope, q_pe], dim=-1).transpose(1, 2)          # [B, H, S, dqk]
        k = torch.cat([k_nope, k_pe], dim=-1).transpose(1, 2)          # [B, H, T, dqk]
        v = v.transpose(1, 2)
        mask = None
        if seqlen > 1:
            # bottom-right causal: query s (absolute total-seqlen+s) sees keys t <= total-seqlen+s
            mask = causal_mask(seqlen, total, q.device)
        if selected is not None:      # sparse (V3.2): only the tokens the indexer kept for each query
            keep = torch.zeros(bsz, seqlen, total, dtype=torch.bool, device=q.device).scatter_(-1, selected.long(), True)
            mask = (keep if mask is None else keep & mask)[:, None]          # [B, 1, S, T]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=a.softmax_scale)
        return out.transpose(1, 2)

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, dn, kv_lora] and W_UV^T [H, kv_lora, dv] as views of wkv_b (kept between decode steps)."""
        a, weight = self.args, self.wkv_b.weight

        def views():
            w = weight.view(self.n_heads, a.qk_nope_head_dim + a.v_head_dim, a.kv_lora_rank)
            return w[:, :a.qk_nope_head_dim], w[:, a.qk_nope_head_dim:].transpose(1, 2)
        return inference_views(self, (weight,), views)

    def _attend_absorbed(self, q_nope, q_pe, kv, selected=None, seqlens=None, capacity=None):
        """Attention over the latent cache itself: q_nope is folded into W_UK, V is the latent (decode).
        seqlens, capacity: see mla_attend (with seqlens, kv is the whole cache)."""
        a = self.args
        bsz, seqlen, _, _ = q_nope.shape
        h = self.n_heads
        w_uk, w_uv_t = self.absorbed_weights()
        # q_abs[b, s, h] = q_nope[b, s, h] @ W_UK[h], as one batched matmul over heads
        q_abs = torch.bmm(q_nope.reshape(bsz * seqlen, h, -1).transpose(0, 1), w_uk)           # [H, BS, c]
        q_abs = q_abs.transpose(0, 1).reshape(bsz, seqlen, h, a.kv_lora_rank)
        q = torch.cat([q_abs, q_pe], dim=-1)                             # [B, S, H, kv_lora + dr]
        out_latent = mla_attend(q, kv, a.softmax_scale, a.kv_lora_rank, selected, seqlens, capacity)
        # out[b, s, h] = out_latent[b, s, h] @ W_UV[h]^T
        out = torch.bmm(out_latent.reshape(bsz * seqlen, h, -1).transpose(0, 1), w_uv_t)  # [H, BS, dv]
        return out.transpose(0, 1).reshape(bsz, seqlen, h, a.v_head_dim)


def causal_mask(seqlen: int, total: int, device) -> torch.Tensor:
    """Boolean [S, T] mask (True = visible) for S queries that are the last S of T positions."""
    q_pos = torch.arange(total - seqlen, total, device=device)[:, None]
    return torch.arange(total, device=device)[None, :] <= q_pos


# --- feed-forward ------------------------------------------------------------------------------------
