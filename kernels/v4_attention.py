"""DeepSeek-V4 decode attention (docs/dsv4-math.md §2.3): a split-KV Triton kernel and its PyTorch twin.

MQA: every head reads the same head_dim-wide rows, each both key and value. A query at position p attends to
  - the sliding window: the kv rows of positions p - window + 1 .. p, read from the block's ring (position t at
    row t mod R, dsv3lite/v4/cache.py's WindowRing), and
  - compressed entries: those named by its index list (CSA: the lightning indexer's top-k, -1 for none), or every
    entry w < (p + 1) // ratio (HCA, and CSA while all visible entries are picked),
with one softmax over both and a per-head sink that adds exp(sink[h]) to the denominator only:
    P[h, j] = exp(z[h, j]) / (sum_j' exp(z[h, j']) + exp(sink[h])),  z = (q[h] . k_j) * scale,  o[h] = sum_j P k_j.
Sq <= 4 queries per sequence (a decode step plus MTP drafts) sit at positions start .. start + Sq - 1.
The model undoes the RoPE on the output afterwards (dsv3lite/v4/attention.py).

`sink_attention` is the math of the eager attention (dsv3lite/v4/attention.py calls it); `v4_decode_attention_ref`,
the kernel's twin, builds the same keys from the ring and calls it.
"""
from __future__ import annotations

import torch

from . import dispatch
from .dispatch import jit as _jit, tl, triton
from .mla_decode import (MAX_QUERIES, MERGE_COLS, MERGE_ROWS, _MAX_SPLITS, _auto_num_splits, _mla_decode_merge_kernel,
                         _split_len)

_LOG2E = 1.4426950408889634


# ----------------------------------------------------------------------------------------------
# PyTorch: the eager math and the twin
# ----------------------------------------------------------------------------------------------

def sink_attention(q: torch.Tensor, sink: torch.Tensor, scale: float, parts) -> torch.Tensor:
    """Softmax attention with a sink over the keys of several parts, V = K (the eager V4 attention's math).

    q [B, S, H, D]; sink [H] (fp32 logits that join each softmax's denominator only); parts: (keys, see) pairs,
    keys [B, T, D] shared by the S queries or [B, S, T, D] one list per query, see bool broadcastable to [B, S, T]
    (True: the query attends to that key). Logits q . k in q.dtype, then fp32 times scale; the softmax in fp32;
    probabilities rounded to q.dtype before they weigh the keys. -> [B, S, H, D] in q.dtype."""
    logits = []
    for keys, see in parts:
        spec = "bshd,btd->bsht" if keys.dim() == 3 else "bshd,bstd->bsht"
        logits.append(torch.einsum(spec, q, keys).float().mul_(scale).masked_fill_(~see[:, :, None], float("-inf")))
    sinks = sink.float()[None, None, :, None].expand(q.shape[0], q.shape[1], -1, 1)
    combined = torch.cat([*logits, sinks], dim=-1)
    probs = (combined - combined.amax(dim=-1, keepdim=True)).softmax(dim=-1).to(q.dtype)
    out, first = None, 0
    for keys, _ in parts:
        n = keys.shape[-2]
        spec = "bsht,btd->bshd" if keys.dim() == 3 else "bsht,bstd->bshd"
        o = torch.einsum(spec, probs[..., first:first + n], keys)
        out, first = o if out is None else out + o, first + n
    return out


def gather_rows(entries: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    """entries [B, N, d], selected [B, s, k] (-1: none, read as row 0 and masked by the caller) -> [B, s, k, d]."""
    bsz, s, k = selected.shape
    idx = selected.clamp(min=0).reshape(bsz, s * k).long()
    return torch.gather(entries, 1, idx[..., None].expand(-1, -1, entries.shape[-1])).view(bsz, s, k, -1)


def _check_inputs(q, window, start, window_size, sink, entries, indices, ratio):
    assert q.dim() == 4, f"q must be [B, Sq, H, D], got shape {tuple(q.shape)}"
    batch, sq, heads, dim = q.shape
    assert 1 <= sq <= MAX_QUERIES, f"Sq must be in 1..{MAX_QUERIES}, got {sq}"
    assert window.dim() == 3 and window.shape[0] == batch and window.shape[2] == dim, (
        f"window must be [{batch}, R, {dim}], got shape {tuple(window.shape)}")
    assert window.shape[1] >= window_size + sq - 1, (
        f"the ring has {window.shape[1]} rows; {sq} queries over a window of {window_size} need "
        f"{window_size + sq - 1}")
    assert start >= 0 and window_size >= 1, f"start {start}, window {window_size}"
    assert sink.shape == (heads,), f"sink must be [{heads}], got shape {tuple(sink.shape)}"
    if entries is not None:
        assert entries.dim() == 3 and entries.shape[0] == batch and entries.shape[2] == dim, (
            f"entries must be [{batch}, N, {dim}], got shape {tuple(entries.shape)}")
        if indices is None:
            assert ratio >= 1, f"all entries visible by position need the compression ratio, got {ratio}"
    if indices is not None:
        assert entries is not None, "indices name entries: pass them"
        assert indices.dim() == 3 and indices.shape[:2] == (batch, sq), (
            f"indices must be [{batch}, {sq}, K], got shape {tuple(indices.shape)}")
    for name, t in (("window", window), ("sink", sink), ("entries", entries), ("indices", indices)):
        assert t is None or t.device == q.device, f"{name} is on {t.device}, q on {q.device}"


def v4_decode_attention_ref(q: torch.Tensor, window: torch.Tensor, start: int, window_size: int, sink: torch.Tensor,
                            scale: float, entries: torch.Tensor | None = None, indices: torch.Tensor | None = None,
                            ratio: int = 0) -> torch.Tensor:
    """The twin of `v4_decode_attention` (same arguments): the window's rows read from the ring, then
    `sink_attention`, as the eager attention computes it."""
    start = int(start)                                         # (a device start, read back: the twin is no capture)
    _check_inputs(q, window, start, window_size, sink, entries, indices, ratio)
    sq = q.shape[1]
    positions = torch.arange(start, start + sq, device=q.device)
    first = max(0, start - window_size + 1)
    kpos = torch.arange(first, start + sq, device=q.device)
    keys = window.index_select(1, kpos % window.shape[1]).to(q.dtype)
    see = (kpos[None, :] <= positions[:, None]) & (kpos[None, :] > positions[:, None] - window_size)
    parts = [(keys, see[None])]
    if entries is not None and indices is None:
        visible = torch.arange(entries.shape[1], device=q.device)[None, :] < ((positions + 1) // ratio)[:, None]
        parts.append((entries.to(q.dtype), visible[None]))
    elif entries is not None:
        parts.append((gather_rows(entries.to(q.dtype), indices), indices >= 0))
    return sink_attention(q, sink, scale, parts)


# ----------------------------------------------------------------------------------------------
# Triton kernel
#
# Program (b, query s and a block of BLOCK_H heads, split): the query's keys are one list, the window's
# `window` positions padded to a multiple of BLOCK_N, then its compressed candidates; a split is a run of whole
# BLOCK_N tiles of that list, so each tile is all window rows or all entries. Online softmax in base 2; split 0
# starts from the sink (a key of logit sink[h] and value 0), so the sink counts once; the splits merge by their
# log-sum-exp with mla_decode's merge kernel.
# ----------------------------------------------------------------------------------------------

@_jit
def _attend_tile(q, k, ok, m_i, l_i, acc, scale_log2, DOT_PRECISION: tl.constexpr):
    # one tile of keys k [BLOCK_N, BLOCK_D] (rows where ok) into the running (max, sum, acc) of the q rows
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
    scores = tl.where(ok[None, :], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(scores - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(k.dtype), k, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@_jit
def _v4_decode_split_kernel(
    q_ptr, win_ptr, ent_ptr, idx_ptr, sink_ptr, part_out_ptr, part_lse_ptr, start_ptr,
    scale_log2, start, num_heads, head_dim, window, ring_rows, n_comp, window_span, total,
    stride_qb, stride_qs, stride_qh,   # q [B, Sq, H, D]
    stride_wb, stride_wt,              # window ring [B, R, D]
    stride_eb, stride_et,              # entries [B, N, D]
    stride_ib, stride_is,              # indices [B, Sq, K] (SPARSE)
    stride_ob, stride_or, stride_os,   # partial out [B, Sq*H, splits, D]
    stride_lb, stride_lr, stride_ls,   # partial lse [B, Sq*H, splits]
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    SPARSE: tl.constexpr,              # entries named by each query's index list, else w < (p + 1) // RATIO
    RATIO: tl.constexpr,               # the compression ratio (4 or 128: a shift)
    UPCAST: tl.constexpr,              # fp32 dot operands (interpreter: its bf16 dot is wrong)
    DOT_PRECISION: tl.constexpr,
    START_ON_DEVICE: tl.constexpr,     # the first position read from start_ptr (a captured step), not `start`
):
    b = tl.program_id(0).to(tl.int64)
    if START_ON_DEVICE:
        start = tl.load(start_ptr).to(tl.int32)
    head_blocks = tl.cdiv(num_heads, BLOCK_H)
    query = tl.program_id(1) // head_blocks
    heads = (tl.program_id(1) % head_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads
    split = tl.program_id(2)
    split_len = _split_len(total, tl.num_programs(2), BLOCK_N)
    lo = split * split_len
    hi = tl.minimum(lo + split_len, total)
    pos = start + query

    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    q = tl.load(q_ptr + b * stride_qb + query * stride_qs + heads[:, None] * stride_qh + offs_d[None, :],
                mask=head_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    sink = tl.load(sink_ptr + heads, mask=head_ok, other=float("-inf")).to(tl.float32) * 1.4426950408889634
    first = split == 0
    m_i = tl.where(first, sink, float("-inf"))
    l_i = tl.where(first & head_ok, 1.0, 0.0)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)

    win_seq = win_ptr + b * stride_wb
    # (the window's few tiles unpipelined: two pipelined loops made ptxas spill around the second on sm_86 / 89)
    for n0 in tl.range(lo, tl.minimum(hi, window_span), BLOCK_N, num_stages=1):
        j = n0 + tl.arange(0, BLOCK_N)
        kpos = pos - window + 1 + j
        ok = (j < window) & (kpos >= 0)
        rows = tl.where(ok, kpos, 0) % ring_rows
        k = tl.load(win_seq + rows[:, None].to(tl.int64) * stride_wt + offs_d[None, :],
                    mask=ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        m_i, l_i, acc = _attend_tile(q, k, ok, m_i, l_i, acc, scale_log2, DOT_PRECISION)

    ent_seq = ent_ptr + b * stride_eb
    visible = tl.minimum(n_comp, (pos + 1) // RATIO)           # (HCA: entries w < (p + 1) // ratio)
    if not SPARSE:                                             # tiles past the visible entries add nothing
        hi = tl.minimum(hi, window_span + visible)
    for n0 in range(tl.maximum(lo, window_span), hi, BLOCK_N):
        c = n0 - window_span + tl.arange(0, BLOCK_N)
        if SPARSE:
            idx = tl.load(idx_ptr + b * stride_ib + query * stride_is + c, mask=c < n_comp, other=-1)
            ok = idx >= 0
        else:
            idx = c
            ok = c < visible
        k = tl.load(ent_seq + tl.where(ok, idx, 0)[:, None].to(tl.int64) * stride_et + offs_d[None, :],
                    mask=ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        m_i, l_i, acc = _attend_tile(q, k, ok, m_i, l_i, acc, scale_log2, DOT_PRECISION)

    # a split without keys (or a padded head) stores out 0 and lse -inf, which the merge weighs as 0
    has = l_i > 0.0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    rows_out = query * num_heads + heads
    tl.store(part_out_ptr + b * stride_ob + rows_out[:, None] * stride_or + split * stride_os + offs_d[None, :],
             out.to(part_out_ptr.dtype.element_ty), mask=head_ok[:, None] & d_ok[None, :])
    tl.store(part_lse_ptr + b * stride_lb + rows_out * stride_lr + split * stride_ls, lse, mask=head_ok)


def split_config(head_dim: int, dtype: torch.dtype) -> dict:
    """The split kernel's blocks, warps and stages: mla_decode's for its 512-wide latents (a 16-row head block,
    BLOCK_N 32 rows of 16-bit keys in two stages; fp32 16 rows in one, within sm_86 / sm_89's shared memory)."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    wide, fp32 = block_d >= 256, dtype == torch.float32
    return dict(BLOCK_H=16, BLOCK_N=64 if not wide else (16 if fp32 else 32), BLOCK_D=block_d,
                num_warps=8 if wide else 4, num_stages=1 if wide and fp32 else 2)


def v4_decode_attention(q: torch.Tensor, window: torch.Tensor, start, window_size: int, sink: torch.Tensor,
                        scale: float, entries: torch.Tensor | None = None, indices: torch.Tensor | None = None,
                        ratio: int = 0, num_splits: int | None = None) -> torch.Tensor:
    """V4 decode attention (module docstring) with the split-KV Triton kernel.

    q [B, Sq, H, D], 1 <= Sq <= 4, at positions start..start+Sq-1 (each head row contiguous); start: an int, or an
    integer tensor of one element on q's device (a captured step: nothing of the position baked into the
    launch; entries may then be the cache's whole capacity, the kernel stops at the visible ones); window [B, R, D]: the
    ring, position t at row t mod R, R >= window_size + Sq - 1 (rows contiguous); sink [H] (fp32 logits); scale:
    the logits' factor (head_dim^-0.5); entries [B, N, D] or None (a sliding layer); indices int32 [B, Sq, K] (CSA:
    each query's entries, -1 none) or None: every entry w < (p + 1) // ratio. num_splits: splits of each query's
    key list (None: from heads, keys and SM count, as mla_decode). -> [B, Sq, H, D] in q.dtype."""
    assert triton is not None, "v4_decode_attention needs Triton; use v4_decode_attention_ref"
    on_device = isinstance(start, torch.Tensor)
    if on_device:
        assert start.numel() == 1 and start.device == q.device and not start.is_floating_point(), (
            f"a device start is one integer on {q.device}, got {start.dtype} {tuple(start.shape)} on {start.device}")
    _check_inputs(q, window, 0 if on_device else start, window_size, sink, entries, indices, ratio)
    assert q.dtype in (torch.bfloat16, torch.float16, torch.float32), f"unsupported dtype {q.dtype}"
    for name, t in (("window", window), ("entries", entries)):
        assert t is None or (t.dtype == q.dtype and t.stride(2) == 1), (
            f"{name} must be {q.dtype} with contiguous rows, got {t.dtype} strides {t.stride()}")
    assert q.stride(3) == 1, "q's head rows must be contiguous"
    sparse = indices is not None
    if sparse:
        assert indices.dtype == torch.int32 and indices.stride(2) == 1, "indices must be int32, contiguous along K"
    batch, sq, heads, dim = q.shape
    cfg = split_config(dim, q.dtype)
    block_n = cfg["BLOCK_N"]
    span = triton.cdiv(window_size, block_n) * block_n
    n_comp = 0 if entries is None else (indices.shape[2] if sparse else entries.shape[1])
    total = span + n_comp
    rows = sq * heads
    row_blocks = sq * triton.cdiv(heads, cfg["BLOCK_H"])
    if num_splits is None:
        num_splits = _auto_num_splits(batch, row_blocks, total, rows, dim, dim, q.device)
    assert isinstance(num_splits, int) and 1 <= num_splits <= _MAX_SPLITS, (
        f"num_splits must be an int in 1..{_MAX_SPLITS}, got {num_splits!r}")
    upcast = dispatch.interpreted()
    precision = "ieee" if (upcast or q.dtype == torch.float32) else "tf32"

    out = torch.empty(batch, sq, heads, dim, dtype=q.dtype, device=q.device)
    if num_splits == 1:
        part_out = out.view(batch, rows, 1, dim)
        part_lse = torch.empty(batch, rows, 1, dtype=torch.float32, device=q.device)
    else:
        part_out = torch.empty(batch, rows, num_splits, dim, dtype=q.dtype, device=q.device)
        part_lse = torch.empty(batch, rows, num_splits, dtype=torch.float32, device=q.device)
    ent = entries if entries is not None else window          # pointers the kernel takes but does not read
    idx = indices if sparse else part_lse
    sink = sink if sink.dtype == torch.float32 else sink.float()
    _v4_decode_split_kernel[(batch, row_blocks, num_splits)](
        q, window, ent, idx, sink.contiguous(), part_out, part_lse, start if on_device else part_lse,
        scale * _LOG2E, 0 if on_device else start, heads, dim, window_size, window.shape[1], n_comp, span, total,
        q.stride(0), q.stride(1), q.stride(2),
        window.stride(0), window.stride(1),
        ent.stride(0), ent.stride(1),
        indices.stride(0) if sparse else 0, indices.stride(1) if sparse else 0,
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1), part_lse.stride(2),
        SPARSE=sparse, RATIO=1 if sparse or entries is None else ratio, UPCAST=upcast, DOT_PRECISION=precision,
        START_ON_DEVICE=on_device, **cfg,
    )
    if num_splits > 1:
        lse = torch.empty(batch, rows, dtype=torch.float32, device=q.device)
        _mla_decode_merge_kernel[(batch, triton.cdiv(rows, MERGE_ROWS), triton.cdiv(dim, MERGE_COLS))](
            part_out, part_lse, part_lse, out, lse,
            rows, num_splits, dim, total,
            part_out.stride(0), part_out.stride(1), part_out.stride(2),
            part_lse.stride(0), part_lse.stride(1), part_lse.stride(2),
            out.stride(0), dim, lse.stride(0), 1,
            BLOCK_H=MERGE_ROWS, BLOCK_N=block_n, BLOCK_DL=MERGE_COLS, BLOCK_S=triton.next_power_of_2(num_splits),
            SPARSE=True, num_warps=2,
        )
    return out
