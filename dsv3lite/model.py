"""The DeepSeek-V3-family network: RMSNorm, YaRN RoPE, MLA (naive + absorbed), V3.2's lightning indexer (sparse
attention), routers, MoE, MTP.

Numerics follow transformers' DeepseekV3/V2 (docs/dsv3-math.md, "Reference B"): RMSNorm statistics and
the router in fp32, routed outputs summed in ascending expert id. Routed experts sit behind one seam,
`MoE.experts`: a module called as `experts(x [N, D], ids [N, K], weights [N, K]) -> [N, D]`, so the
offloading runtime can swap in its own provider without touching the network.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelArgs
from .kernels import cpu_decode, cpu_experts
from .kernels.mla_decode import mla_attend

# q_a_layernorm / kv_a_layernorm use 1e-6 whatever the config says (as the hub code and transformers do)
_LATENT_NORM_EPS = 1e-6


def as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in `dtype`, skipping the no-op (but dispatched) conversion when it already is."""
    return x if x.dtype == dtype else x.to(dtype)


def inference_views(owner: nn.Module, tensors: tuple[torch.Tensor, ...], build):
    """build() -> views of `tensors` (transposes, per-expert slices), kept on `owner` between inference-mode calls
    so a decode step does not re-derive them (one set of views per owner); rebuilt when a tensor changes storage
    (a load, .to()), never kept (nor built from a cache) outside inference mode, where autograd must see the
    parameters themselves."""
    if not torch.is_inference_mode_enabled():
        return build()
    key = [t.data_ptr() for t in tensors]
    cached = owner.__dict__.get("_inference_views")
    if cached is None or cached[0] != key:
        cached = owner.__dict__["_inference_views"] = (key, build())
    return cached[1]


class Linear(nn.Linear):
    """A bias-free nn.Linear whose inference forward is the product linear() reduces to, x @ W^T (matmul, or mm for
    2-D x: the same kernel on the same operands, so the same bits), with W^T kept between calls: a decode step is
    hundreds of tiny products, and linear's dispatch layers cost more than the product itself."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if not torch.is_inference_mode_enabled():
            return F.linear(x, w)
        wt = inference_views(self, (w,), w.t)
        return torch.mm(x, wt) if x.dim() == 2 else torch.matmul(x, wt)     # matmul folds the rows into one mm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # statistics in fp32, normalised value rounded to the input dtype, then the weight multiply. Spelled out: the
        # bits of F.rms_norm (checked in test_model_parity) in a third of its operators (on CPU it is a composite that
        # also converts eps to a tensor and back)
        h = as_dtype(x, torch.float32)
        return self.weight * as_dtype(h * h.pow(2).mean(-1, keepdim=True).add_(self.eps).rsqrt_(), x.dtype)


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

INDEX_SCORE_ELEMENTS = 1 << 24   # indexer scores [queries, index heads, keys] (fp32) computed at once in a prefill


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

    def forward(self, x: torch.Tensor, start: int, cos: torch.Tensor, sin: torch.Tensor,
                cache: torch.Tensor | None = None, absorb: bool = False) -> torch.Tensor:
        """x [B, S, D] at positions start..start+S-1; cache [B, Tmax, cache_dim] is written in place."""
        bsz, seqlen, _ = x.shape
        q_nope, q_pe, latent, q_latent = self.project(x, cos, sin)
        attend = self._attend_absorbed if absorb else self._attend_naive
        if self.indexer is not None:
            return self.wo(self._indexed(x, start, cos, sin, cache, attend, q_nope, q_pe, latent, q_latent).flatten(2))
        if cache is not None:
            cache[:, start:start + seqlen] = latent
            kv = cache[:, :start + seqlen]
        else:
            kv = latent
        if absorb:        # the kernel splits the context as for the whole cache: the bits of a graph's step
            out = self._attend_absorbed(q_nope, q_pe, kv, capacity=None if cache is None else cache.shape[1])
        else:
            out = attend(q_nope, q_pe, kv)                # [B, S, H, dv]
        return self.wo(out.flatten(2))

    def decode_at(self, x: torch.Tensor, positions: torch.Tensor, seqlens: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        """forward(x, start, cos, sin, cache, absorb=True) with the positions as device tensors, for a CUDA graph
        (dsv3lite/graphs.py): positions int64 [S] (start..start+S-1), seqlens int32 [1] (start + S); cache
        [1, Tmax, latent_dim] is written at the positions and read whole, up to seqlens. Dense MLA only."""
        q_nope, q_pe, latent, _ = self.project(x, cos, sin)
        cache[0].index_copy_(0, positions, latent[0].to(cache.dtype))
        return self.wo(self._attend_absorbed(q_nope, q_pe, cache, seqlens=seqlens).flatten(2))

    def _indexed(self, x, start, cos, sin, cache, attend, q_nope, q_pe, latent, q_latent):
        """V3.2: cache the indexer's keys next to the latents; beyond index_topk tokens of context, attend only
        to the tokens the indexer selects for each query."""
        seqlen, width = x.shape[1], self.args.latent_dim
        index_keys = self.indexer.keys(x, cos, sin)
        if cache is not None:
            cache[:, start:start + seqlen, :width] = latent
            cache[:, start:start + seqlen, width:] = index_keys
            kv, index_keys = cache[:, :start + seqlen, :width], cache[:, :start + seqlen, width:]
        else:
            kv = latent
        selected = None
        if kv.shape[1] > self.args.index_topk:
            selected = self.indexer.select(x, q_latent, index_keys, cos, sin)     # [B, S, index_topk]
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

class MLP(nn.Module):
    """SwiGLU: down(silu(gate x) * up x). Dense layers and shared experts."""

    def __init__(self, dim: int, inter: int):
        super().__init__()
        self.w1 = Linear(dim, inter)   # gate_proj
        self.w3 = Linear(dim, inter)   # up_proj
        self.w2 = Linear(inter, dim)   # down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Gate(nn.Module):
    """Router in fp32: sigmoid + bias-corrected grouped top-k (noaux_tc) or softmax greedy / group-limited."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.weight = nn.Parameter(torch.empty(args.n_routed_experts, args.hidden_size, dtype=torch.float32))
        if args.has_gate_bias:
            self.register_buffer("bias", torch.zeros(args.n_routed_experts, dtype=torch.float32))
        else:
            self.bias = None

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """Unbiased routing scores [N, E] in fp32."""
        w = as_dtype(self.weight, torch.float32)
        logits = torch.mm(as_dtype(x, torch.float32), inference_views(self, (w,), w.t))     # F.linear's product
        return logits.sigmoid() if self.args.scoring_func == "sigmoid" else logits.softmax(dim=-1)

    def select(self, scores: torch.Tensor) -> torch.Tensor:
        """Expert ids [N, K] chosen from unbiased scores [N, E] (bias and group limit applied here)."""
        return self.pick(scores if self.bias is None else scores + self.bias)

    def pick(self, choice: torch.Tensor) -> torch.Tensor:
        """Expert ids [N, K] from bias-corrected scores [N, E]: the group limit, then the top k."""
        a = self.args
        if a.n_group > 1 and a.topk_method != "greedy":
            grouped = choice.view(-1, a.n_group, a.n_routed_experts // a.n_group)
            if a.topk_method == "noaux_tc":
                group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            else:
                group_scores = grouped.amax(dim=-1)
            keep = group_scores.topk(a.topk_group, dim=-1, sorted=False).indices
            dropped = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, keep, False)
            choice = grouped.masked_fill(dropped[..., None], float("-inf")).view_as(choice)
        return choice.topk(a.num_experts_per_tok, dim=-1, sorted=False).indices

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, D] -> (weights [N, K] fp32, ids [N, K], scores [N, E]); weights use the unbiased scores."""
        scores = self.scores(x)
        ids = self.select(scores)
        weights = scores.gather(1, ids)
        if self.args.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.args.routed_scaling_factor, ids, scores


FEW_TOKENS = 4      # up to this many tokens (MTP verification), RoutedExperts runs each token as a decode step


class RoutedExperts(nn.Module):
    """All routed experts of one layer, resident and dense: w1/w3 [E, I, D], w2 [E, D, I]."""

    def __init__(self, n_experts: int, dim: int, inter: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, inter, dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, inter, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, inter))

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        w1, w3, w2 = self._transposed()
        return _swiglu(x, w1[e], w3[e], w2[e])

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1:
            return self._one_token(x, ids, weights)
        if x.shape[0] <= FEW_TOKENS:
            return self._few_tokens(x, ids, weights)
        return combine_experts(self.expert, x, ids, weights)

    def _few_tokens(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """A few tokens (MTP verification): each token as in `_one_token`, so a verified position gets the bits
        a plain decode step would give it."""
        return torch.cat([self._one_token(x[i:i + 1], ids[i:i + 1], weights[i:i + 1]) for i in range(x.shape[0])])

    def _one_token(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Decode of one token: the chosen experts in ascending id, each weighted output rounded to x.dtype and
        added, as combine_experts does (same operators per expert, so the same bits) without its grouping."""
        ids_sorted, order = ids[0].sort()
        w1, w3, w2 = self._transposed()
        out = None
        for e, w in zip(ids_sorted.tolist(), weights[0].index_select(0, order)[:, None].unbind(0)):
            t = as_dtype(_swiglu(x, w1[e], w3[e], w2[e]) * w, x.dtype)
            out = t if out is None else out + t
        return out

    def cpu_blobs(self):
        """(expert addresses [E], descriptor, tensors read) for the CPU decode step (kernels/cpu_decode.py): the
        three stacked fp32 tensors read as one blob per expert; None for other dtypes or devices."""
        found = cpu_experts.dense_experts(self.w1, self.w3, self.w2)
        return None if found is None else (*found, [self.w1, self.w3, self.w2])

    def _transposed(self):
        """w1, w3, w2 transposed, the operands of x @ W^T: stacked [E, D, I], [E, D, I], [E, I, D], or in inference
        mode per-expert lists kept between decode steps."""
        def stacked():
            return tuple(w.transpose(1, 2) for w in (self.w1, self.w3, self.w2))
        if not torch.is_inference_mode_enabled():
            return stacked()
        return inference_views(self, (self.w1, self.w3, self.w2), lambda: tuple(t.unbind(0) for t in stacked()))


def _swiglu(x: torch.Tensor, w1t: torch.Tensor, w3t: torch.Tensor, w2t: torch.Tensor) -> torch.Tensor:
    """One expert on x [N, D] from transposed weights: the products F.linear would run (mm on W^T), same bits."""
    return torch.mm(F.silu(torch.mm(x, w1t)) * torch.mm(x, w3t), w2t)


def combine_experts(expert_fn, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                    host_ids: list[list[int]] | None = None) -> torch.Tensor:
    """sum_k weights[n, k] * expert_{ids[n, k]}(x[n]), accumulated in ascending expert id.

    Each expert's weighted output is rounded to x.dtype before it is added (as transformers does), so every
    provider that goes through here gives the same bits for the same expert outputs. `host_ids` (the same ids
    already on the host) saves the device->host read of the routing.
    """
    out = torch.zeros_like(x)
    k = ids.shape[1]
    if host_ids is None:
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)              # (token, slot) pairs grouped by expert, ascending
        counts = torch.bincount(flat, minlength=1).tolist()
    else:
        pairs = sorted(range(len(host_ids) * k), key=lambda i: (host_ids[i // k][i % k], i))
        order = torch.tensor(pairs, dtype=torch.long).to(x.device, non_blocking=True)
        counts = [0] * (max(e for row in host_ids for e in row) + 1)
        for row in host_ids:
            for e in row:
                counts[e] += 1
    token = order // k
    w = weights.flatten()[order]
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        tok = token[start:start + n]
        y = expert_fn(e, x.index_select(0, tok))              # index_select: its backward is a fast index_add
        out.index_add_(0, tok, (y * w[start:start + n, None]).to(x.dtype))
        start += n
    return out


class MoE(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.gate = Gate(args)
        self.experts = RoutedExperts(args.n_routed_experts, args.hidden_size, args.moe_intermediate_size)
        self.shared_experts = MLP(args.hidden_size, args.n_shared_experts * args.moe_intermediate_size)
        self.observers = Observers()          # the model's own, shared by all its layers (Transformer sets it)
        self.prepared = None                  # (x, gate(x)) computed ahead for this very x (offload/predictor.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        pre, self.prepared = self.prepared, None
        weights, ids, scores = pre[1] if pre is not None and pre[0] is x else self.gate(flat)
        for fn in self.observers.routing:
            fn(self.layer_id, ids, scores)
        # the shared expert first: on a GPU it is queued before the routed experts wait for copies or CPU results
        # (and on an offloaded layer it runs while they do); addition commutes exactly, so the bits do not change
        shared = self.shared_experts(x)
        routed = self.experts(flat, ids, weights).view(shape)
        return routed + shared


# --- observers ---------------------------------------------------------------------------------------

class Observers:
    """The callbacks watching one model's forward passes, per event; lists stay empty (and cost one loop
    over nothing) when nobody watches."""

    def __init__(self):
        self.attention: list = []
        self.routing: list = []

    def add(self, on_attention=None, on_routing=None) -> "ObserverHandle":
        assert on_attention is not None or on_routing is not None, "an observer needs at least one callback"
        if on_attention is not None:
            self.attention.append(on_attention)
        if on_routing is not None:
            self.routing.append(on_routing)
        return ObserverHandle(self, on_attention, on_routing)


class ObserverHandle:
    def __init__(self, observers: Observers, on_attention, on_routing):
        self._observers, self._on_attention, self._on_routing = observers, on_attention, on_routing

    def remove(self) -> None:
        """Detach the callbacks (idempotent)."""
        for fns, fn in ((self._observers.attention, self._on_attention), (self._observers.routing, self._on_routing)):
            if fn is not None and fn in fns:
                fns.remove(fn)
        self._on_attention = self._on_routing = None


# --- blocks ------------------------------------------------------------------------------------------

class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.attn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.attn = MLA(args)
        self.ffn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.is_moe = args.is_moe_layer(layer_id)
        self.ffn = MoE(args, layer_id) if self.is_moe else MLP(args.hidden_size, args.intermediate_size)
        self.prepared = None        # (h, ffn_norm(h)) computed ahead for this very h (offload/predictor.py)

    def attention(self, h, start, cos, sin, cache=None, absorb=False):
        if absorb and h.device.type == "cpu":               # a CPU decode step: one kernel call (kernels/cpu_decode.py)
            out = cpu_decode.attention(self, h, start, cos, sin, cache)
            if out is not None:
                return out
        return h + self.attn(self.attn_norm(h), start, cos, sin, cache, absorb)

    def feed_forward(self, h):
        pre = self.prepared
        if pre is not None:
            self.prepared = None
        if pre is None and h.device.type == "cpu" and (not self.is_moe or self.ffn.prepared is None):
            out = cpu_decode.feed_forward(self, h)
            if out is not None:
                return out
        return h + self.ffn(pre[1] if pre is not None and pre[0] is h else self.ffn_norm(h))

    def forward(self, h, start, cos, sin, cache=None, absorb=False):
        return self.feed_forward(self.attention(h, start, cos, sin, cache, absorb))


class MTPLayer(nn.Module):
    """Multi-token prediction module: [enorm(emb(t_{i+1})) | hnorm(h_i)] -> eh_proj -> block -> head_norm."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        d = args.hidden_size
        self.enorm = RMSNorm(d, args.rms_norm_eps)
        self.hnorm = RMSNorm(d, args.rms_norm_eps)
        self.eh_proj = Linear(2 * d, d)
        self.block = Block(args, args.mtp_layer_id)
        self.head_norm = RMSNorm(d, args.rms_norm_eps)

    def forward(self, emb: torch.Tensor, hidden: torch.Tensor, start, cos, sin, cache=None, absorb=False,
                watchers=()):
        """emb: embeddings of the next tokens [B, S, D]; hidden: the main model's final-normed hidden [B, S, D].
        watchers: on_attention callbacks, called after the block's attention as for a main layer."""
        h = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(hidden)], dim=-1))
        h = self.block.attention(h, start, cos, sin, cache, absorb)
        for fn in watchers:
            fn(self.block, h)
        return self.head_norm(self.block.feed_forward(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs, with_mtp: bool = False):
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(Block(args, i) for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.head = Linear(args.hidden_size, args.vocab_size)
        self.mtp = MTPLayer(args) if with_mtp else None
        self.rotary = Rotary(args)
        self.observers = Observers()
        for moe in self.moe_modules():
            moe.observers = self.observers

    def add_observer(self, on_attention=None, on_routing=None) -> "ObserverHandle":
        """Watch forward passes: on_attention(block, h [B, S, D]) after each layer's attention (before its
        feed-forward; the MTP block included, after the main layers), on_routing(layer_id, ids [N, K],
        scores [N, E]) after each MoE router, MTP layer included. Observers run in the order they were added; `handle.remove()` detaches them."""
        return self.observers.add(on_attention, on_routing)

    def blocks(self) -> list[Block]:
        """Every decoder block, main layers then the MTP block (cache index = position in this list)."""
        return list(self.layers) + ([self.mtp.block] if self.mtp is not None else [])

    def moe_modules(self) -> list[MoE]:
        return [b.ffn for b in self.blocks() if b.is_moe]

    def hidden(self, tokens: torch.Tensor, start: int = 0, cache: torch.Tensor | None = None,
               absorb: bool = False) -> torch.Tensor:
        """tokens [B, S] -> final-normed hidden [B, S, D]. cache: [n_layers(+1), B, Tmax, latent] or None."""
        h = self.embed(tokens)
        cos, sin = (as_dtype(t, h.dtype)[:, None] for t in self.rotary(start, tokens.shape[1], h.device))
        watchers = self.observers.attention
        if absorb and cache is not None and not watchers and h.device.type == "cpu":
            out = cpu_decode.layers(self, h, start, cos, sin, cache)    # a CPU decode step: one kernel call
            if out is not None:
                return self.norm(out)
        for i, layer in enumerate(self.layers):
            h = layer.attention(h, start, cos, sin, None if cache is None else cache[i], absorb)
            for fn in watchers:
                fn(layer, h)
            h = layer.feed_forward(h)
        return self.norm(h)

    def forward(self, tokens: torch.Tensor, start: int = 0, cache: torch.Tensor | None = None,
                absorb: bool = False) -> torch.Tensor:
        """tokens [B, S] -> logits [B, S, vocab] in the compute dtype."""
        return self.head(self.hidden(tokens, start, cache, absorb))

    def mtp_hidden(self, hidden: torch.Tensor, next_tokens: torch.Tensor, start: int = 0,
                   cache: torch.Tensor | None = None, absorb: bool = False) -> torch.Tensor:
        """MTP pass over pairs (hidden_i, t_{i+1}) at positions start..; cache: the MTP layer's own [B, Tmax, latent]."""
        cos, sin = (as_dtype(t, hidden.dtype)[:, None] for t in self.rotary(start, next_tokens.shape[1], hidden.device))
        return self.mtp(self.embed(next_tokens), hidden, start, cos, sin, cache, absorb, self.observers.attention)


def init_weights(model: Transformer, std: float = 0.02) -> Transformer:
    """Random init for training from scratch: normal(0, std) matrices, unit norms, zero router bias."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("norm.bias"):
                p.zero_()
            else:
                p.normal_(0.0, std)
        for mod in model.modules():
            if isinstance(mod, Gate) and mod.bias is not None:
                mod.bias.zero_()
    return model
