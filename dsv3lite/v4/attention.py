"""DeepSeek-V4 attention (docs/dsv4-math.md §2.3, §3): MQA over one head_dim-wide key = value row per token, a
128-token sliding window in every layer, plus compressed entries in CSA layers (an overlapping compressor and the
lightning indexer's top-k) and HCA layers (all entries), an attention sink per head, RoPE on the last
qk_rope_head_dim dims (interleaved pairs) undone on the output, and a grouped low-rank output projection.

Numerics follow transformers' DeepseekV4 (the oracle) with DeepSeek's fp32 where docs/dsv4-math.md §2.7 asks for it:
norms with fp32 statistics and weights and one rounding; the compressors' gate, softmax and weighted sum in fp32,
rounded before their norm; QK^T in the model dtype, the softmax with the sink in fp32, P rounded before PV.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import dispatch
from ..kernels.mla_decode import MAX_QUERIES
from ..kernels import v4_compressor
from ..kernels.v4_attention import gather_rows, sink_attention, v4_decode_attention
from ..kernels.v4_compressor import apply_rope, pool_windows, rms_norm  # noqa: F401  (apply_rope re-exported)
from ..kernels.v4_indexer import index_scores, index_scores_ref
from ..model import Linear, rope_inv_freq
from ..cache import Positions
from .cache import CompressorState, SlidingCache
from .config import CSA, SLIDING, V4Args

SCORE_ELEMENTS = 1 << 24      # attention / indexer scores (fp32) computed at once: queries are taken in blocks


class RMSNorm(nn.Module):
    """Weighted RMSNorm as V4 has it: statistics, weight (kept in fp32) and product in fp32, one rounding."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def unweighted_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps), the factor computed in fp32 and rounded to x.dtype (the per-head q norm, mHC)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


# --- rotary embeddings ---------------------------------------------------------------------------------

class Rotary:
    """One of V4's two rotaries (a plain object, no state): angles pos * inv_freq over qk_rope_head_dim / 2 pairs."""

    def __init__(self, args: V4Args, compress: bool):
        yarn = compress and args.compress_rope_type == "yarn"
        spec = SimpleNamespace(qk_rope_head_dim=args.qk_rope_head_dim,
                               rope_theta=args.compress_rope_theta if compress else args.rope_theta,
                               rope_type="yarn" if yarn else "default", rope_factor=args.rope_factor,
                               original_max_position_embeddings=args.original_max_position_embeddings,
                               beta_fast=args.beta_fast, beta_slow=args.beta_slow)
        with torch.device("cpu"):                   # also when the network is built on the meta device
            self.inv_freq = rope_inv_freq(spec)     # YaRN frequencies, no attention factor (§3)
        self._on: dict = {}                         # device -> inv_freq there (copied once: no copy per call,
                                                    # none inside a captured step)

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [..., r/2] for integer positions [...], rounded to `dtype` (as transformers)."""
        inv = self._on.get(positions.device)
        if inv is None:
            inv = self._on[positions.device] = self.inv_freq.to(positions.device)
        angles = positions[..., None].float() * inv
        return angles.cos().to(dtype), angles.sin().to(dtype)


# --- compressors -------------------------------------------------------------------------------------------

class Compressor(nn.Module):
    """Pools every `ratio` tokens into one entry: per channel, a softmax over the window's gates (Cz + ape) weights
    the values Cv; then norm and RoPE (compress rotary) at the window's first position. With `overlap` (CSA) each
    token projects two series, and entry w pools series A of window w-1 with series B of window w (width 2 ratio,
    stride ratio)."""

    def __init__(self, dim: int, ratio: int, overlap: bool, width: int, eps: float):
        super().__init__()
        self.ratio, self.overlap, self.width = ratio, overlap, width
        channels = width * (2 if overlap else 1)
        self.wkv = Linear(dim, channels)
        self.wgate = Linear(dim, channels)
        self.ape = nn.Parameter(torch.zeros(ratio, channels, dtype=torch.float32))
        self.norm = RMSNorm(width, eps)

    def project(self, a: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """a [B, S, D] at positions [S] -> (Cv, G = Cz + ape[p mod ratio]) [B, S, channels] in fp32."""
        return self.wkv(a).float(), self.wgate(a).float() + self.ape.float()[positions % self.ratio]

    def update(self, a: torch.Tensor, start, state: CompressorState, rotary: Rotary) -> torch.Tensor:
        """Write a [B, S, D]'s (Cv, G) into `state`, emit the entries of the windows they complete, and return every
        entry complete by the end of the chunk, [B, (start + S) // ratio, width]. start: an int, or device
        Positions (a captured step: the kernel pools the entry the step completes, if any, and every entry of the
        cache's capacity is returned; the attention reads only those its positions see)."""
        if isinstance(start, Positions):
            return self._update_on_device(a, start, state, rotary)
        cv, g = self.project(a, torch.arange(start, start + a.shape[1], device=a.device))
        end = start + a.shape[1]
        n = end // self.ratio - start // self.ratio
        if v4_compressor.use_kernel(a.device, a.shape[1], n, state.entries.dtype, a.dtype):
            state.remember(cv, g, start)             # the kernel reads the window from the rings
            window = end // self.ratio - 1
            cos, sin = rotary.at(torch.tensor([window * self.ratio], device=a.device), a.dtype)
            v4_compressor.compress_entry(state.cv.kv, state.g.kv, state.entries, window, self.ratio, self.overlap,
                                         self.norm.weight, self.norm.eps, cos[0], sin[0])
            return state.view(end // self.ratio)
        old_cv, old_g, first = state.pending(start)
        state.remember(cv, g, start)
        if n:
            entries = self.pool(torch.cat((old_cv, cv), 1), torch.cat((old_g, g), 1), first, n, rotary, a.dtype)
            state.put(entries, start // self.ratio)
        return state.view(end // self.ratio)

    def _update_on_device(self, a: torch.Tensor, pos: Positions, state: CompressorState,
                          rotary: Rotary) -> torch.Tensor:
        cv, g = self.project(a, pos.index)
        state.remember_at(cv, g, pos.index)
        cos, sin = rotary.at(v4_compressor.window_of(pos.seqlens, self.ratio) * self.ratio, a.dtype)
        v4_compressor.compress_entry(state.cv.kv, state.g.kv, state.entries, pos.seqlens, self.ratio, self.overlap,
                                     self.norm.weight, self.norm.eps, cos[0], sin[0], queries=pos.length)
        return state.entries

    def pool(self, cv: torch.Tensor, g: torch.Tensor, first: int, n: int, rotary: Rotary,
             dtype: torch.dtype) -> torch.Tensor:
        """The n entries from (Cv, G) [B, T, channels] of tokens first.. (first < 0: the slots before position 0
        are empty: value 0, gate -inf) -> [B, n, width] in `dtype`."""
        m, o = self.ratio, int(self.overlap)
        if first < 0:
            cv = F.pad(cv, (0, 0, -first, 0))
            g = F.pad(g, (0, 0, -first, 0), value=float("-inf"))
        pooled = pool_windows(cv, g, n, m, self.overlap, self.width)      # [B, n, width] fp32
        entries = self.norm(pooled.to(dtype))
        first_window = first // m + o
        positions = (torch.arange(n, device=cv.device) + first_window) * m
        return apply_rope(entries, *rotary.at(positions, dtype))


class Indexer(nn.Module):
    """The lightning indexer of a CSA layer: its own overlapping compressor makes one key per window
    (index_head_dim wide); each query scores the keys visible to it by sum_h w_h ReLU(q_h . K_w) and keeps the
    top index_topk."""

    def __init__(self, args: V4Args):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = args.index_n_heads, args.index_head_dim, args.index_topk
        self.ratio = args.compress_rate_csa
        self.wq_b = Linear(args.q_lora_rank, self.n_heads * self.head_dim)
        self.weights_proj = Linear(args.hidden_size, self.n_heads)
        self.compressor = Compressor(args.hidden_size, self.ratio, True, self.head_dim, args.rms_norm_eps)

    def select(self, a: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor,
               rotary: Rotary, start=None) -> torch.Tensor:
        """Entry ids [B, S, min(topk, N)] each query keeps among keys [B, N, head_dim]; -1 marks a pick the query
        cannot see (fewer visible entries than picks). a [B, S, D], qr: the query latent [B, S, q_lora_rank].
        start (positions[0], an int or a device tensor): with it, a decode step's scores come from the Triton kernel
        where kernels run."""
        bsz, seqlen, _ = a.shape
        q = self.wq_b(qr).view(bsz, seqlen, self.n_heads, self.head_dim)
        q = apply_rope(q, *(t[:, None] for t in rotary.at(positions, q.dtype)))
        weights = self.weights_proj(a).float() * self.n_heads ** -0.5                # [B, S, H]
        n = keys.shape[1]
        visible = (positions + 1) // self.ratio                                    # entries w < visible
        kernel = start is not None and seqlen <= MAX_QUERIES and keys.dtype == q.dtype and \
            dispatch.use_kernels(q.device)
        block = seqlen if kernel else max(1, SCORE_ELEMENTS // max(1, bsz * self.n_heads * n))
        picked = []
        for s0 in range(0, seqlen, block):
            if kernel:
                index = index_scores(q, weights, keys, start, self.ratio)                      # [B, S, N]
            else:
                index = index_scores_ref(q[:, s0:s0 + block], weights[:, s0:s0 + block], keys,
                                         positions[s0:s0 + block], self.ratio)
            top = index.topk(min(self.topk, n), dim=-1).indices
            picked.append(torch.where(top >= visible[s0:s0 + block, None], -1, top))
        return torch.cat(picked, dim=1)


# --- attention -------------------------------------------------------------------------------------------

class Attention(nn.Module):
    """One block's attention; `kind` sliding | csa | hca. Parameter names are the official checkpoint's."""

    def __init__(self, args: V4Args, layer_id: int, main_rotary: Rotary, compress_rotary: Rotary):
        super().__init__()
        self.args, self.layer_id = args, layer_id
        self.kind, self.ratio = args.attn_kind(layer_id), args.compress_ratio(layer_id)
        d, h, hd = args.hidden_size, args.num_attention_heads, args.head_dim
        self.n_heads, self.head_dim, self.window = h, hd, args.sliding_window
        self.wq_a = Linear(d, args.q_lora_rank)
        self.q_norm = RMSNorm(args.q_lora_rank, args.rms_norm_eps)
        self.wq_b = Linear(args.q_lora_rank, h * hd)
        self.wkv = Linear(d, hd)
        self.kv_norm = RMSNorm(hd, args.rms_norm_eps)
        self.wo_a = Linear(h * hd // args.o_groups, args.o_groups * args.o_lora_rank)   # per group [R, H/G * hd]
        self.wo_b = Linear(args.o_groups * args.o_lora_rank, d)
        self.attn_sink = nn.Parameter(torch.zeros(h, dtype=torch.float32))
        self.compressor = None if self.kind == SLIDING else \
            Compressor(d, self.ratio, self.kind == CSA, hd, args.rms_norm_eps)
        self.indexer = Indexer(args) if self.kind == CSA else None
        # sliding layers (and the MTP block) use the main rotary; CSA / HCA layers the compress one throughout
        self.rotary = main_rotary if self.kind == SLIDING else compress_rotary
        self.compress_rotary = compress_rotary

    def forward(self, a: torch.Tensor, start, cache: SlidingCache | None = None) -> torch.Tensor:
        """a [B, S, D] (the normed collapsed residual) at positions start..start+S-1 -> [B, S, D]. cache: this
        block's cache object (written here); None: a whole sequence from position 0 (or any start for a
        sliding block), nothing kept. start: an int, or Positions; device Positions (a captured decode step:
        `captures` holds) take the kernels with every position read on the device, the cache's length set by the
        caller (begin_write)."""
        if isinstance(start, Positions) and start.start is not None:
            start = start.start
        if isinstance(start, Positions):
            return self._forward_on_device(a, start, cache)
        seqlen = a.shape[1]
        positions = torch.arange(start, start + seqlen, device=a.device)
        cos, sin = self.rotary.at(positions, a.dtype)                          # [S, r/2]
        qr, q, kv = self._queries(a, cos, sin)
        # decode through the Triton kernel where kernels run: it reads the window straight from the ring
        kernel = cache is not None and seqlen <= MAX_QUERIES and cache.window.kv.dtype == q.dtype and \
            dispatch.use_kernels(q.device)
        keys, states = self._window_keys(kv, start, cache, gather=not kernel)
        entries = selected = None
        if self.compressor is not None:
            entries = self.compressor.update(a, start, states["compressor"], self.compress_rotary)
            if self.indexer is not None:
                index_keys = self.indexer.compressor.update(a, start, states["indexer"], self.compress_rotary)
                if entries.shape[1] > self.indexer.topk:   # else every visible entry is picked: the causal mask
                    selected = self.indexer.select(a, qr, positions, index_keys, self.compress_rotary, start)
        if kernel:
            out = v4_decode_attention(q, cache.window.kv, start, self.window, self.attn_sink, self.head_dim ** -0.5,
                                      entries, None if selected is None else selected.to(torch.int32), self.ratio)
        else:
            out = self._attend(q, start, positions, keys, entries, selected)    # [B, S, H, hd]
        return self._output(out, cos, sin)

    def _queries(self, a: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """(query latent qr [B, S, q_lora_rank], queries q [B, S, H, hd], key = value rows kv [B, S, hd]), RoPE'd."""
        bsz, seqlen, _ = a.shape
        qr = self.q_norm(self.wq_a(a))
        q = unweighted_rms(self.wq_b(qr).view(bsz, seqlen, self.n_heads, self.head_dim), self.args.rms_norm_eps)
        q = apply_rope(q, cos[:, None], sin[:, None])
        kv = apply_rope(self.kv_norm(self.wkv(a)), cos, sin)
        return qr, q, kv

    def _output(self, out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        out = apply_rope(out, cos[:, None], -sin[:, None])                   # back to offsets p - j
        return self.wo_b(self._grouped_wo_a(out))

    def captures(self, cache: SlidingCache | None, dtype: torch.dtype) -> bool:
        """Whether a decode step may run this attention with its positions on the device (a captured step): the
        Triton kernels run there, and the cache keeps the model's dtype."""
        return cache is not None and cache.window.kv.dtype == dtype and dispatch.use_kernels(cache.window.kv.device)

    def _forward_on_device(self, a: torch.Tensor, pos: Positions, cache: SlidingCache) -> torch.Tensor:
        """forward for device positions (1..4 tokens): the ring, the compressors' state and their entries written
        at pos.index; the kernels read the positions from the device and attend over the cache's whole capacity
        of entries, of which they read the visible ones; CSA selects among all its capacity's index keys (those not
        yet visible score -inf and are dropped) whenever the capacity exceeds index_topk."""
        assert cache is not None and pos.length <= MAX_QUERIES and self.captures(cache, a.dtype), \
            "device positions need a cache in the model's dtype and the kernels"
        positions = pos.index
        first = positions[:1]
        cos, sin = self.rotary.at(positions, a.dtype)
        qr, q, kv = self._queries(a, cos, sin)
        cache.window.write_at(kv, positions)
        entries = selected = None
        if self.compressor is not None:
            states = cache.compressors
            entries = self.compressor.update(a, pos, states["compressor"], self.compress_rotary)
            if self.indexer is not None:
                index_keys = self.indexer.compressor.update(a, pos, states["indexer"], self.compress_rotary)
                if entries.shape[1] > self.indexer.topk:
                    selected = self.indexer.select(a, qr, positions, index_keys, self.compress_rotary, first)
        out = v4_decode_attention(q, cache.window.kv, first, self.window, self.attn_sink, self.head_dim ** -0.5,
                                  entries, None if selected is None else selected.to(torch.int32), self.ratio)
        return self._output(out, cos, sin)

    def _window_keys(self, kv: torch.Tensor, start: int, cache: SlidingCache | None, gather: bool = True):
        """(the window's keys [B, n_prior + S, hd] for positions start - n_prior.. (None without `gather`: only
        the ring is written), compressor states)."""
        seqlen = kv.shape[1]
        if cache is None:
            if start and self.compressor is not None:
                raise ValueError("a compressed-attention forward without a cache starts at position 0")
            states = {}
            if self.compressor is not None:
                states["compressor"] = CompressorState(self.ratio, self.kind == CSA, self.compressor.wkv.out_features,
                                                       self.head_dim, kv.shape[0], seqlen, kv.device, kv.dtype)
            if self.indexer is not None:
                ic = self.indexer.compressor
                states["indexer"] = CompressorState(self.ratio, True, ic.wkv.out_features, ic.width, kv.shape[0],
                                                    seqlen, kv.device, kv.dtype)
            return kv, states
        cache.begin_write(start, seqlen)
        n_prior = min(start, self.window - 1)
        prior = cache.window.read(start - n_prior, start).to(kv.dtype) if gather else None
        cache.window.write(kv, start)
        return (torch.cat((prior, kv), dim=1) if gather else None), cache.compressors

    def _attend(self, q, start, positions, keys, entries, selected):
        """Softmax over (window keys, visible or selected entries) and the sink, per query; V = K. Queries go in
        blocks that bound the scores (and the gathered entries) held at once."""
        bsz, seqlen, h, hd = q.shape
        n_comp = 0 if entries is None else (entries.shape[1] if selected is None else selected.shape[-1])
        block = SCORE_ELEMENTS // max(1, bsz * h * (self.window + n_comp))
        if selected is not None:
            block = min(block, SCORE_ELEMENTS // max(1, bsz * n_comp * hd))
        block = max(1, min(seqlen, block))
        key_first = start + seqlen - keys.shape[1]                             # position of keys[:, 0]
        out = []
        for s0 in range(0, seqlen, block):
            s1 = min(s0 + block, seqlen)
            lo = max(start + s0 - self.window + 1, key_first) - key_first
            hi = start + s1 - key_first
            out.append(self._attend_block(q[:, s0:s1], positions[s0:s1], keys[:, lo:hi], key_first + lo, entries,
                                          None if selected is None else selected[:, s0:s1]))
        return out[0] if len(out) == 1 else torch.cat(out, dim=1)

    def _attend_block(self, q, pos, keys, key_first, entries, selected):
        kpos = torch.arange(key_first, key_first + keys.shape[1], device=q.device)
        see = (kpos[None, :] <= pos[:, None]) & (kpos[None, :] > pos[:, None] - self.window)        # [s, Tw]
        parts = [(keys, see[None])]
        if entries is not None and selected is None:
            visible = torch.arange(entries.shape[1], device=q.device)[None, :] < ((pos + 1) // self.ratio)[:, None]
            parts.append((entries, visible[None]))
        elif entries is not None:
            parts.append((gather_rows(entries, selected), selected >= 0))                     # [B, s, k, hd]
        return sink_attention(q, self.attn_sink, self.head_dim ** -0.5, parts)

    def _grouped_wo_a(self, o: torch.Tensor) -> torch.Tensor:
        """o [B, S, H, hd] -> [B, S, G * o_lora_rank]: head group g (heads gH/G..) through its own [R, H/G * hd]."""
        bsz, seqlen = o.shape[:2]
        groups = self.args.o_groups
        x = o.reshape(bsz * seqlen, groups, -1).transpose(0, 1)                                # [G, N, in]
        if not isinstance(self.wo_a, nn.Linear):    # packed (--dense): every group's rows, its own block kept
            y = self.wo_a(x).view(groups, bsz * seqlen, groups, -1)                            # [G, N, G, R]
            return torch.stack([y[g, :, g] for g in range(groups)], dim=1).reshape(bsz, seqlen, -1)
        w = self.wo_a.weight.view(groups, -1, x.shape[-1]).transpose(1, 2)                     # [G, in, R]
        return torch.bmm(x, w).transpose(0, 1).reshape(bsz, seqlen, -1)

