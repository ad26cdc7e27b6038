"""DeepSeek-V4's lightning-indexer scores at decode (docs/dsv4-math.md §2.3): a Triton kernel and its PyTorch twin.

A query at position p scores every index key K_w (index_head_dim wide) of its CSA layer:
    I[p, w] = sum_h w[h] * ReLU(q[h] . K_w) * index_head_dim^-0.5,   -inf for w >= (p + 1) // ratio (not yet visible)
with the per-head weights w (weights_proj's output, already times n_heads^-0.5). The model keeps the top index_topk
(dsv3lite/v4/attention.py's Indexer). At long contexts this scan of all keys is the largest read of a decode step
(docs/dsv4-math.md §8), so the kernel reads each key tile once per query and reduces over the heads in registers:
program (b, query, key block) multiplies its query's [H, d] by TILES tiles of BLOCK_N keys on tensor cores.
"""
from __future__ import annotations

import torch

from . import dispatch
from .dispatch import jit as _jit, tl, triton
from .mla_decode import MAX_QUERIES


def launch_config(dtype: torch.dtype) -> dict:
    """Keys a tile, tiles a program (the query's [H, d] read once for them), warps: 16-bit keys on tensor cores;
    fp32 multiplies exactly ("ieee", no tensor cores) in tiles of 16 on 8 warps (64 keys on 4 warps spilled ~10 KB,
    32 spilled on sm_80)."""
    if dtype == torch.float32:
        return dict(BLOCK_N=16, TILES=16, num_warps=8)
    return dict(BLOCK_N=64, TILES=4, num_warps=4)


def index_scores_ref(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
                     ratio: int) -> torch.Tensor:
    """The indexer's scores (module docstring), the eager math: q [B, S, H, d] and keys [B, N, d] in fp32 (any float
    dtype is read as fp32), weights [B, S, H] fp32, positions [S] -> [B, S, N] fp32, -inf where not yet visible."""
    scores = torch.matmul(q.float(), keys.float().transpose(1, 2)[:, None]).relu_() * q.shape[-1] ** -0.5
    index = (scores * weights[..., None]).sum(dim=2)                                          # [B, S, N]
    future = torch.arange(keys.shape[1], device=q.device)[None, :] >= ((positions + 1) // ratio)[:, None]
    return index.masked_fill(future, float("-inf"))


@_jit
def _v4_index_kernel(
    q_ptr, w_ptr, k_ptr, out_ptr, start_ptr,
    scale, start, num_heads, dim, n_keys,
    stride_qb, stride_qs, stride_qh,   # q [B, S, H, d]
    stride_wb, stride_ws,              # weights [B, S, H]
    stride_kb, stride_kt,              # keys [B, N, d]
    stride_ob, stride_os,              # out [B, S, N]
    RATIO: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    TILES: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    START_ON_DEVICE: tl.constexpr,     # the first position read from start_ptr (a captured step), not `start`
):
    b = tl.program_id(0).to(tl.int64)
    if START_ON_DEVICE:
        start = tl.load(start_ptr).to(tl.int32)
    query = tl.program_id(1)
    heads = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_ok = heads < num_heads
    d_ok = offs_d < dim
    q = tl.load(q_ptr + b * stride_qb + query * stride_qs + heads[:, None] * stride_qh + offs_d[None, :],
                mask=h_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    w = tl.load(w_ptr + b * stride_wb + query * stride_ws + heads, mask=h_ok, other=0.0)
    visible = (start + query + 1) // RATIO
    for t in tl.range(0, TILES):
        offs_n = (tl.program_id(2) * TILES + t) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < n_keys
        k = tl.load(k_ptr + b * stride_kb + offs_n[:, None].to(tl.int64) * stride_kt + offs_d[None, :],
                    mask=(n_ok & (offs_n < visible))[:, None] & d_ok[None, :], other=0.0)   # none past the visible
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)                  # [BLOCK_H, BLOCK_N]
        index = tl.sum((tl.maximum(s, 0.0) * scale) * w[:, None], 0)
        index = tl.where(offs_n < visible, index, float("-inf"))
        tl.store(out_ptr + b * stride_ob + query * stride_os + offs_n, index, mask=n_ok)


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, start, ratio: int) -> torch.Tensor:
    """`index_scores_ref` with the Triton kernel, for 1..4 queries at positions start..: q [B, S, H, d] (the model's
    dtype: its products are exact in fp32), weights [B, S, H] fp32, keys [B, N, d] in q's dtype (rows
    contiguous) -> [B, S, N] fp32. start: an int, or an integer tensor of one element on q's device (a captured
    step; keys may then be the cache's whole capacity: none past the visible ones is read)."""
    assert triton is not None, "index_scores needs Triton; use index_scores_ref"
    on_device = isinstance(start, torch.Tensor)
    assert not on_device or (start.numel() == 1 and start.device == q.device and not start.is_floating_point()), \
        "a device start is one integer on q's device"
    batch, sq, heads, dim = q.shape
    assert 1 <= sq <= MAX_QUERIES, f"Sq must be in 1..{MAX_QUERIES}, got {sq}"
    assert keys.dim() == 3 and keys.shape[0] == batch and keys.shape[2] == dim and keys.dtype == q.dtype, (
        f"keys must be {q.dtype} [{batch}, N, {dim}], got {keys.dtype} {tuple(keys.shape)}")
    assert weights.shape == (batch, sq, heads) and weights.dtype == torch.float32, (
        f"weights must be float32 [{batch}, {sq}, {heads}], got {weights.dtype} {tuple(weights.shape)}")
    assert q.stride(3) == 1 and keys.stride(2) == 1 and weights.stride(2) == 1, "rows must be contiguous"
    n = keys.shape[1]
    out = torch.empty(batch, sq, n, dtype=torch.float32, device=q.device)
    if n == 0:
        return out
    upcast = dispatch.interpreted()
    precision = "ieee" if (upcast or q.dtype == torch.float32) else "tf32"
    cfg = launch_config(q.dtype)
    if batch * sq * triton.cdiv(n, cfg["BLOCK_N"] * cfg["TILES"]) < 2 * dispatch.sm_count(q.device):
        cfg["TILES"] = 1                         # short contexts: a tile a program, so that every SM has work
    _v4_index_kernel[(batch, sq, triton.cdiv(n, cfg["BLOCK_N"] * cfg["TILES"]))](
        q, weights, keys, out, start if on_device else out,
        dim ** -0.5, 0 if on_device else start, heads, dim, n,
        q.stride(0), q.stride(1), q.stride(2),
        weights.stride(0), weights.stride(1),
        keys.stride(0), keys.stride(1),
        out.stride(0), out.stride(1),
        RATIO=ratio, BLOCK_H=max(16, triton.next_power_of_2(heads)), BLOCK_D=max(16, triton.next_power_of_2(dim)),
        UPCAST=upcast, DOT_PRECISION=precision, START_ON_DEVICE=on_device, num_stages=2, **cfg,
    )
    return out
