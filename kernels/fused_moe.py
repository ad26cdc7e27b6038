"""Routed-expert SwiGLU for all selected experts of one MoE layer, reading packed blobs from the slot pool.

    y[t] = sum over k, in ascending expert id, of weights[t, k] * down_e(silu(gate_e x[t]) * up_e x[t]),  e = ids[t, k]

Every expert is one uint8 blob (quant/layout.py); the device tier keeps blobs in one [n_slots, blob_bytes] pool
and `slot_of_expert` says which row holds each expert of this layer. Decode (M = 1..16 tokens), three launches:
  (a) gate+up+silu·mul: one program per (token, k) pair and I-block; the pair whose token is the first (in
      its block of BLOCK_M tokens) to pick expert e (the owner) does the work for every token that picked e, so
      each expert's gate/up bytes are read once per block; it writes h [M*K, I] (x.dtype) at rows t*K + k.
  (b) down: one program per D-block and pair; the owner multiplies the h rows of e by down_e and writes
      weights * result (fp32) at the same rows of `part` [M*K, D]. At batch 1 that is D/16 x 8 programs, each
      streaming one expert's slice: every SM has work (one program per D-block walking all 8 experts left most
      of an H200 idle).
  (c) sum: y[t] = part's rows of token t added in ascending expert id, in fp32, rounded once. The order is fixed
      and nothing is atomic, so y does not depend on which slot holds an expert.
BLOCK_M is 16 on the tensor-core path (3+ tokens) and M itself for 1-2 tokens (fp32 multiply-adds); the K loops
are quant_matmul.py's `_k_loop` (at batch 1 the next tile is read before the current one is multiplied), launch
configurations kernels/tuning.py's. Prefill (more tokens) takes the grouped kernels (`fused_moe_grouped`, below).
Experts with slot -1 (not resident) are skipped, or take their outputs from `external_out` (computed
elsewhere, e.g. on the CPU) so that they still join the sum in its place in the order.
Formats int4 / int4g32 / fp8 / bf16 (nf4 stays on bitsandbytes: fused_moe_auto runs the twin for it).
"""
from __future__ import annotations

import torch

from . import dispatch, tuning
from .dispatch import jit as _jit, tl, triton
from .quant_matmul import (FMT_CODES, FMT_FP8, FMT_FP8_BYTES, GROUPED, _X_DTYPES, _acc_result, _acc_zeros, _cast,
                           _k_loop, _scale_rows, dot_precision, fp8_code, fp8_weight_view, launch_config, num_tiles,
                           plan_blocks)
from ..quant.layout import BlobLayout, MATRICES
from ..quant.table import FORMAT_TABLE

SUM_BLOCK = 256             # columns of y a program of the final sum writes


def _check_inputs(x, expert_ids, weights, slot_of_expert, pool, layout, external_out):
    assert x.dim() == 2 and x.dtype in _X_DTYPES, (
        f"x must be [M, D] float16/bfloat16/float32, got {x.dtype} {tuple(x.shape)}")
    m, d = x.shape
    assert d == layout.hidden, f"x has D={d}, the blob layout hidden={layout.hidden}"
    assert expert_ids.dim() == 2 and expert_ids.shape[0] == m and expert_ids.shape[1] >= 1, (
        f"expert_ids must be [{m}, K], got shape {tuple(expert_ids.shape)}")
    assert expert_ids.dtype in (torch.int32, torch.int64), f"expert_ids must be int32/int64, got {expert_ids.dtype}"
    assert weights.shape == expert_ids.shape and weights.dtype == torch.float32, (
        f"weights must be float32 {tuple(expert_ids.shape)}, got {weights.dtype} {tuple(weights.shape)}")
    assert slot_of_expert.dim() == 1 and slot_of_expert.dtype == torch.int32, (
        f"slot_of_expert must be int32 [E], got {slot_of_expert.dtype} {tuple(slot_of_expert.shape)}")
    assert pool.dtype == torch.uint8 and pool.dim() == 2 and pool.shape[1] == layout.blob_bytes, (
        f"pool must be uint8 [n_slots, {layout.blob_bytes}], got {pool.dtype} {tuple(pool.shape)}")
    assert pool.stride(1) == 1, "pool rows must be contiguous"
    if external_out is not None:
        assert external_out.shape == (m, expert_ids.shape[1], d) and external_out.dtype == x.dtype, (
            f"external_out must be {x.dtype} [{m}, {expert_ids.shape[1]}, {d}], "
            f"got {external_out.dtype} {tuple(external_out.shape)}")
    for name, t in (("expert_ids", expert_ids), ("weights", weights), ("slot_of_expert", slot_of_expert),
                    ("pool", pool), ("external_out", external_out)):
        assert t is None or t.device == x.device, f"{name} is on {t.device}, x on {x.device}"


# ----------------------------------------------------------------------------------------------
# Triton kernels
#
# Both kernels see the expert ids of one block of BLOCK_M tokens as a [BLOCK_M, BLOCK_KE] tile. A token picks
# an expert at most once, so "the tokens that picked e" is one row mask (`has`) plus the column of each
# (`kidx`), and an expert's tokens are rows of a BLOCK_M-row dot. Pool components are reached through typed
# views of the pool (element offsets), slot rows as int64 (the pool may exceed 2^31 elements).
# ----------------------------------------------------------------------------------------------

@_jit
def _owner(ids_ptr, stride_im, pair, M, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_KE: tl.constexpr):
    # For (token, k) pair number `pair`: its expert e, whether it is the first pair in its block of BLOCK_M tokens
    # to pick e (the owner, which does e's work for the block), the block's token rows, which of them picked e
    # (`has` [BLOCK_M]) and as which choice (`kidx` [BLOCK_M]).
    t0 = pair // TOP_K
    rows = (t0 // BLOCK_M) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_KE)
    id_ok = (rows < M)[:, None] & (cols < TOP_K)[None, :]
    ids = tl.load(ids_ptr + rows[:, None] * stride_im + cols[None, :], mask=id_ok, other=-1).to(tl.int32)
    e = tl.load(ids_ptr + t0 * stride_im + pair % TOP_K, mask=t0 < M, other=-1).to(tl.int32)
    match = (ids == e) & id_ok
    earlier = tl.sum(tl.where(match & (rows < t0)[:, None], 1, 0))   # tokens before t0 that picked e
    has = tl.max(match.to(tl.int32), 1) > 0
    kidx = tl.sum(tl.where(match, cols[None, :], 0), 1)
    return e, (earlier == 0) & (t0 < M), rows, has, kidx


@_jit
def _moe_gate_up_kernel(
    x_ptr, ids_ptr, slot_ptr, wpool_ptr, spool_ptr, h_ptr,
    M, D, I, n_tiles,
    stride_xm, stride_im,             # x [M, D], expert_ids [M, TOP_K] row strides
    wslot, sslot,                     # slot row stride in elements of the weight / scale pool views
    gate_w, gate_s, gate_z, up_w, up_s, up_z,   # component element offsets within a blob
    stride_wn, stride_sn,             # gate/up weight and scale row strides (elements)
    TOP_K: tl.constexpr, FMT: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_KE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, PREFETCH: tl.constexpr,
):
    e, owner, rows, has, kidx = _owner(ids_ptr, stride_im, tl.program_id(0), M, TOP_K, BLOCK_M, BLOCK_KE)
    slot = tl.load(slot_ptr + e, mask=owner, other=-1)
    if owner & (slot >= 0):
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < I
        wbase = wpool_ptr + slot.to(tl.int64) * wslot
        sbase = spool_ptr + slot.to(tl.int64) * sslot
        s_off = _scale_rows(offs_n, stride_sn, FMT)
        x_off = rows * stride_xm
        # gate, then up: one accumulator and one tile stream live at a time
        gate = _acc_result(_k_loop(_acc_zeros(BLOCK_M, BLOCK_N, FMT, BLOCK_K, USE_DOT), 0, n_tiles,
                                   x_ptr, x_off, has, D, wbase + gate_w, offs_n * stride_wn, sbase + gate_s,
                                   sbase + gate_z, s_off, n_ok, FMT, GROUP, BLOCK_K, USE_DOT, UPCAST, PRECISION,
                                   PREFETCH), USE_DOT)
        up = _acc_result(_k_loop(_acc_zeros(BLOCK_M, BLOCK_N, FMT, BLOCK_K, USE_DOT), 0, n_tiles,
                                 x_ptr, x_off, has, D, wbase + up_w, offs_n * stride_wn, sbase + up_s,
                                 sbase + up_z, s_off, n_ok, FMT, GROUP, BLOCK_K, USE_DOT, UPCAST, PRECISION,
                                 PREFETCH), USE_DOT)
        h = gate * tl.sigmoid(gate) * up
        h_ptrs = h_ptr + ((rows * TOP_K + kidx) * I)[:, None] + offs_n[None, :]
        tl.store(h_ptrs, _cast(h, h_ptr.dtype.element_ty, UPCAST), mask=has[:, None] & n_ok[None, :])


@_jit
def _moe_down_kernel(
    h_ptr, ids_ptr, weights_ptr, slot_ptr, wpool_ptr, spool_ptr, ext_ptr, part_ptr,
    M, D, I, n_tiles,
    stride_im, stride_rm,             # expert_ids, weights row strides
    wslot, sslot,
    down_w, down_s, down_z,
    stride_wn, stride_sn,             # down weight and scale row strides (elements)
    TOP_K: tl.constexpr, FMT: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_KE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr, HAS_EXTERNAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    # program (D block, pair): the owner of an expert writes weights * down_e(h) of every token of its block that
    # picked e into part [M * TOP_K, D] fp32, at row t * TOP_K + k (its external output when e has no slot, 0 when
    # it has neither); _moe_sum_kernel adds each token's rows in ascending expert id. So every SM has work at
    # batch 1: D / BLOCK_N x TOP_K programs, one expert each.
    e, owner, rows, has, kidx = _owner(ids_ptr, stride_im, tl.program_id(1), M, TOP_K, BLOCK_M, BLOCK_KE)
    if owner:
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < D
        pair_rows = rows * TOP_K + kidx
        route_w = tl.load(weights_ptr + rows * stride_rm + kidx, mask=has, other=0.0)
        slot = tl.load(slot_ptr + e)
        if slot >= 0:
            s_off = _scale_rows(offs_n, stride_sn, FMT)
            wbase = wpool_ptr + slot.to(tl.int64) * wslot
            sbase = spool_ptr + slot.to(tl.int64) * sslot
            out = _acc_result(_k_loop(_acc_zeros(BLOCK_M, BLOCK_N, FMT, BLOCK_K, USE_DOT), 0, n_tiles,
                                      h_ptr, pair_rows * I, has, I, wbase + down_w, offs_n * stride_wn,
                                      sbase + down_s, sbase + down_z, s_off, n_ok,
                                      FMT, GROUP, BLOCK_K, USE_DOT, UPCAST, PRECISION, PREFETCH), USE_DOT)
        elif HAS_EXTERNAL:
            ext = ext_ptr + (pair_rows * D)[:, None] + offs_n[None, :]
            out = tl.load(ext, mask=has[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
        else:
            out = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        tl.store(part_ptr + (pair_rows * D)[:, None] + offs_n[None, :], route_w[:, None] * out,
                 mask=has[:, None] & n_ok[None, :])


@_jit
def _moe_sum_kernel(
    part_ptr, ids_ptr, y_ptr, M, D, stride_im, stride_ym,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_KE: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # y[t] = the sum of part's rows t * TOP_K + k in ascending expert id, in fp32, rounded once
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_KE)
    row_ok = rows < M
    id_ok = row_ok[:, None] & (cols < TOP_K)[None, :]
    ids = tl.load(ids_ptr + rows[:, None] * stride_im + cols[None, :], mask=id_ok, other=2147483647).to(tl.int32)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = row_ok[:, None] & (offs_n < D)[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for _ in tl.static_range(TOP_K):
        e = tl.min(ids, 1)                                         # each row's next expert up
        kidx = tl.min(tl.where(ids == e[:, None], cols[None, :], BLOCK_KE), 1)
        acc += tl.load(part_ptr + ((rows * TOP_K + kidx) * D)[:, None] + offs_n[None, :], mask=mask, other=0.0)
        ids = tl.where(cols[None, :] == kidx[:, None], 2147483647, ids)
    tl.store(y_ptr + (rows * stride_ym)[:, None] + offs_n[None, :], _cast(acc, y_ptr.dtype.element_ty, UPCAST),
             mask=mask)


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------

def _pool_views(pool: torch.Tensor, layout: BlobLayout, fmt: int):
    """(weight pool view, scale pool view, {component: element offset}, {matrix: (weight row, scale row stride)})."""
    entry = FORMAT_TABLE.get(layout.format)
    if entry is None or entry.triton is None:
        raise ValueError(f"fused_moe has no kernel for {layout.format!r} experts; use fused_moe_ref")
    wpart, *rest = entry.parts
    sparts = tuple(p for p in rest if p)
    # fp8 weights as the GPU's kernels read them (its own type, or bytes), every other weight as the table says
    wview = fp8_weight_view(pool, fmt) if fmt in (FMT_FP8, FMT_FP8_BYTES) else pool.view(getattr(torch, entry.weight_dtype))
    sview = pool.view(getattr(torch, entry.scale_dtype)) if entry.scale_dtype else wview
    offsets, strides = {}, {}
    for m in MATRICES:
        comp = layout.components[f"{m}.{wpart}"]
        offsets[f"{m}.w"] = comp.offset // wview.element_size()
        scale_stride = 0
        for kind, part in zip(("s", "z"), sparts):
            c = layout.components[f"{m}.{part}"]
            offsets[f"{m}.{kind}"] = c.offset // sview.element_size()
            scale_stride = c.shape[1]
        offsets.setdefault(f"{m}.s", 0)
        offsets.setdefault(f"{m}.z", offsets[f"{m}.s"])
        strides[m] = (comp.shape[1], scale_stride)
    return wview, sview, offsets, strides


def fused_moe(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, slot_of_expert: torch.Tensor,
              pool: torch.Tensor, layout: BlobLayout, external_out: torch.Tensor | None = None, *,
              use_dot: bool | None = None, block_d: int | None = None, **knobs) -> torch.Tensor:
    """Routed-expert outputs of one MoE layer from packed blobs in the slot pool, with the Triton kernels.

    x [M, D]; expert_ids [M, K] int32/int64, distinct within a row (top-k), in any order (the sum runs in
    ascending expert id), each < E;
    weights [M, K] float32 routing weights; slot_of_expert int32 [E]: the pool row of each expert of this
    layer, -1 when not resident (skipped, or taken from `external_out` [M, K, D] in x.dtype when given);
    pool uint8 [n_slots, layout.blob_bytes] (rows contiguous); layout: int4, int4g32, fp8 or bf16.
    Returns y [M, D] in x.dtype: sum_k weights * expert(x), accumulated in fp32 in ascending expert id.
    Nothing is read from slots that no selected expert maps to. Tuning knobs (None or absent: kernels/tuning.py's
    "moe_gate_up" and "moe_down"): use_dot (tensor cores; 16-token blocks), block_n / block_d (I / D width of a
    program of the gate+up / down launch), block_k, num_warps, num_stages, prefetch (both launches).
    """
    assert triton is not None, "fused_moe needs Triton; use fused_moe_ref (or fused_moe_auto)"
    _check_inputs(x, expert_ids, weights, slot_of_expert, pool, layout, external_out)
    fmt = _kernel_format(layout, x.device)
    assert pool.stride(0) % 16 == 0, f"pool row stride {pool.stride(0)} must be a multiple of 16 bytes"
    m, d = x.shape
    top_k = expert_ids.shape[1]
    inter = layout.inter
    if x.stride(1) != 1:
        x = x.contiguous()
    ids = expert_ids if expert_ids.stride(1) == 1 else expert_ids.contiguous()
    weights = weights if weights.stride(1) == 1 else weights.contiguous()
    y = torch.empty_like(x)
    if m == 0:
        return y
    assert m * max(x.stride(0), top_k * max(inter, d)) < 2**31, "offsets are int32: split the batch"
    wview, sview, off, strides = _pool_views(pool, layout, fmt)
    group = _group(layout, fmt)
    upcast = dispatch.interpreted()
    precision = dot_precision(x.dtype, upcast)
    block_ke = triton.next_power_of_2(top_k)
    wslot, sslot = pool.stride(0) // wview.element_size(), pool.stride(0) // sview.element_size()
    h = torch.empty(m * top_k, inter, dtype=x.dtype, device=x.device)   # rows of skipped pairs stay unwritten
    part = torch.empty(m * top_k, d, dtype=torch.float32, device=x.device)   # each pair's weighted output

    cfg = launch_config("moe_gate_up", m, x.dtype, use_dot, **knobs)
    bm, bn, bk = plan_blocks(fmt, m, inter, d, group, cfg["use_dot"], cfg["block_n"], cfg["block_k"])
    _moe_gate_up_kernel[(m * top_k, triton.cdiv(inter, bn))](
        x, ids, slot_of_expert, wview, sview, h,
        m, d, inter, num_tiles(fmt, d, group, bk),
        x.stride(0), ids.stride(0),
        wslot, sslot,
        off["gate.w"], off["gate.s"], off["gate.z"], off["up.w"], off["up.s"], off["up.z"],
        *strides["gate"],
        TOP_K=top_k, FMT=fmt, GROUP=group, BLOCK_M=bm, BLOCK_KE=block_ke, BLOCK_N=bn, BLOCK_K=bk,
        USE_DOT=cfg["use_dot"], UPCAST=upcast, PRECISION=precision, PREFETCH=cfg["prefetch"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    cfg = launch_config("moe_down", m, x.dtype, use_dot, **dict(knobs, block_n=block_d))
    bm, bd, bk = plan_blocks(fmt, m, d, inter, group, cfg["use_dot"], cfg["block_n"], cfg["block_k"])
    ext = external_out.contiguous() if external_out is not None else y   # y: a dummy pointer, never read
    _moe_down_kernel[(triton.cdiv(d, bd), m * top_k)](
        h, ids, weights, slot_of_expert, wview, sview, ext, part,
        m, d, inter, num_tiles(fmt, inter, group, bk),
        ids.stride(0), weights.stride(0),
        wslot, sslot,
        off["down.w"], off["down.s"], off["down.z"],
        *strides["down"],
        TOP_K=top_k, FMT=fmt, GROUP=group, BLOCK_M=bm, BLOCK_KE=block_ke, BLOCK_N=bd, BLOCK_K=bk,
        USE_DOT=cfg["use_dot"], HAS_EXTERNAL=external_out is not None, UPCAST=upcast, PRECISION=precision,
        PREFETCH=cfg["prefetch"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    _sum_pairs(part, ids, y, top_k, upcast)
    return y


def _sum_pairs(part: torch.Tensor, ids: torch.Tensor, y: torch.Tensor, top_k: int, upcast: bool) -> None:
    """y[t] = the sum of part's rows t * top_k + k (fp32) in ascending expert id, rounded once to y.dtype."""
    m, d = y.shape
    bm = min(16, triton.next_power_of_2(m))
    _moe_sum_kernel[(triton.cdiv(d, SUM_BLOCK), triton.cdiv(m, bm))](
        part, ids, y, m, d, ids.stride(0), y.stride(0),
        TOP_K=top_k, BLOCK_M=bm, BLOCK_KE=triton.next_power_of_2(top_k), BLOCK_N=SUM_BLOCK, UPCAST=upcast,
        num_warps=4,
    )


def _kernel_format(layout: BlobLayout, device: torch.device) -> int:
    """The FMT code the kernels read `layout`'s blobs with on `device`; ValueError for a format without a kernel."""
    fmt = FMT_CODES.get(layout.format)
    if fmt is None:
        raise ValueError(f"fused_moe has no kernel for {layout.format!r} experts; use fused_moe_ref")
    return fp8_code(device) if fmt == FMT_FP8 else fmt


def _group(layout: BlobLayout, fmt: int) -> int:
    return layout.group_size if fmt in GROUPED else (128 if fmt in (FMT_FP8, FMT_FP8_BYTES) else 0)


# ----------------------------------------------------------------------------------------------
# Grouped (prefill): the (token, k) pairs sorted by expert, each expert's pairs cut into tiles of BLOCK_M rows;
# program (tile, column block) runs one expert on one tile with tl.dot, its weights decoded in registers tile by
# tile (`_k_loop`, as in decode: never a dequantized expert in memory). The tile map is computed on the device
# from the routing, its size bounded from the shapes alone (cdiv(pairs, BLOCK_M) + experts): no host sync.
# ----------------------------------------------------------------------------------------------

GROUPED_WORKSPACE_BYTES = 128 << 20     # h and the pairs' outputs of one call; more tokens go in chunks


@_jit
def _tile_rows(tiles_ptr, order_ptr, BLOCK_M: tl.constexpr):
    # tile p of the map: (its expert, its rows of the sorted pairs, which are valid, their (token, k) pair numbers)
    p = tl.program_id(0)
    e = tl.load(tiles_ptr + 3 * p)
    r = tl.load(tiles_ptr + 3 * p + 1) + tl.arange(0, BLOCK_M)
    r_ok = r < tl.load(tiles_ptr + 3 * p + 2)
    pair = tl.load(order_ptr + r, mask=r_ok, other=0)
    return e, r, r_ok, pair


@_jit
def _grouped_gate_up_kernel(
    x_ptr, order_ptr, tiles_ptr, slot_ptr, wpool_ptr, spool_ptr, h_ptr,
    D, I, n_tiles, stride_xm,
    wslot, sslot, gate_w, gate_s, gate_z, up_w, up_s, up_z, stride_wn, stride_sn,
    TOP_K: tl.constexpr, FMT: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, PREFETCH: tl.constexpr,
):
    # h[r] = silu(gate_e x[token]) * up_e x[token] for the sorted pairs r of the tile (x.dtype, rows of h [P, I])
    e, r, r_ok, pair = _tile_rows(tiles_ptr, order_ptr, BLOCK_M)
    slot = tl.load(slot_ptr + e)
    if (slot >= 0) & (tl.max(r_ok.to(tl.int32), 0) > 0):
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < I
        wbase = wpool_ptr + slot.to(tl.int64) * wslot
        sbase = spool_ptr + slot.to(tl.int64) * sslot
        s_off = _scale_rows(offs_n, stride_sn, FMT)
        x_off = (pair // TOP_K) * stride_xm
        gate = _k_loop(tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), 0, n_tiles, x_ptr, x_off, r_ok, D,
                       wbase + gate_w, offs_n * stride_wn, sbase + gate_s, sbase + gate_z, s_off, n_ok,
                       FMT, GROUP, BLOCK_K, True, UPCAST, PRECISION, PREFETCH)
        up = _k_loop(tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), 0, n_tiles, x_ptr, x_off, r_ok, D,
                     wbase + up_w, offs_n * stride_wn, sbase + up_s, sbase + up_z, s_off, n_ok,
                     FMT, GROUP, BLOCK_K, True, UPCAST, PRECISION, PREFETCH)
        h = gate * tl.sigmoid(gate) * up
        tl.store(h_ptr + (r * I)[:, None] + offs_n[None, :], _cast(h, h_ptr.dtype.element_ty, UPCAST),
                 mask=r_ok[:, None] & n_ok[None, :])


@_jit
def _grouped_down_kernel(
    h_ptr, order_ptr, tiles_ptr, weights_ptr, slot_ptr, wpool_ptr, spool_ptr, out_ptr,
    D, I, n_tiles,
    wslot, sslot, down_w, down_s, down_z, stride_wn, stride_sn,
    TOP_K: tl.constexpr, FMT: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, PREFETCH: tl.constexpr,
):
    # out[r] = weight of pair r * down_e h[r], as combine_experts computes it: the expert's output rounded to out's
    # dtype, times the weight in fp32, rounded again; 0 for an expert without a slot
    e, r, r_ok, pair = _tile_rows(tiles_ptr, order_ptr, BLOCK_M)
    if tl.max(r_ok.to(tl.int32), 0) > 0:
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < D
        slot = tl.load(slot_ptr + e)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if slot >= 0:
            s_off = _scale_rows(offs_n, stride_sn, FMT)
            wbase = wpool_ptr + slot.to(tl.int64) * wslot
            sbase = spool_ptr + slot.to(tl.int64) * sslot
            acc = _k_loop(acc, 0, n_tiles, h_ptr, r * I, r_ok, I, wbase + down_w, offs_n * stride_wn,
                          sbase + down_s, sbase + down_z, s_off, n_ok, FMT, GROUP, BLOCK_K, True, UPCAST, PRECISION,
                          PREFETCH)
        route_w = tl.load(weights_ptr + pair, mask=r_ok, other=0.0)
        y = _cast(acc, out_ptr.dtype.element_ty, UPCAST).to(tl.float32)
        tl.store(out_ptr + (r * D)[:, None] + offs_n[None, :],
                 _cast(route_w[:, None] * y, out_ptr.dtype.element_ty, UPCAST), mask=r_ok[:, None] & n_ok[None, :])


def _tile_map(flat_ids: torch.Tensor, n_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, tiles) on the device without a host sync: order [P] the pair numbers sorted by expert (stable: by
    token within an expert); tiles int32 [cdiv(P, block_m) + min(E, P), 3] rows (expert, first row, end row) of
    `order`, each expert's rows cut into tiles of block_m; the rows past the last tile are empty."""
    p = flat_ids.numel()
    order = torch.argsort(flat_ids, stable=True)
    # (not bincount: on a GPU it reads the largest id back to size its output)
    counts = torch.zeros(n_experts, dtype=torch.int64, device=flat_ids.device).scatter_add_(
        0, flat_ids, torch.ones_like(flat_ids))
    tiles_per_expert = (counts + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles_per_expert, 0)
    seg_start = torch.cumsum(counts, 0) - counts
    n_tiles = -(-p // block_m) + min(n_experts, p)
    t = torch.arange(n_tiles, device=flat_ids.device)
    e = torch.searchsorted(tile_end, t, right=True).clamp_(max=n_experts - 1)
    first = seg_start[e] + (t - (tile_end[e] - tiles_per_expert[e])) * block_m
    end = torch.minimum(seg_start[e] + counts[e], first + block_m)
    first = torch.where(t < tile_end[-1], first, end)              # tiles past the last: empty
    return order, torch.stack([e, first, end], 1).to(torch.int32).contiguous()


def fused_moe_grouped(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, slot_of_expert: torch.Tensor,
                      pool: torch.Tensor, layout: BlobLayout, **knobs) -> torch.Tensor:
    """`fused_moe` for many tokens (prefill): the same arguments (no external outputs: experts without a slot are
    left out) and sum, computed expert-major on tensor cores (module comment above). Each pair's weighted output is
    rounded to x.dtype and a token's are added in ascending expert id in x.dtype, as `fused_moe_ref` adds them.
    Tokens go GROUPED_WORKSPACE_BYTES at a time. Knobs (None or absent: kernels/tuning.py's "grouped"): block_m,
    block_n, block_k, num_warps, num_stages, prefetch."""
    assert triton is not None, "fused_moe_grouped needs Triton; use fused_moe_grouped_ref"
    _check_inputs(x, expert_ids, weights, slot_of_expert, pool, layout, None)
    fmt = _kernel_format(layout, x.device)
    assert pool.stride(0) % 16 == 0, f"pool row stride {pool.stride(0)} must be a multiple of 16 bytes"
    m, d = x.shape
    top_k, inter = expert_ids.shape[1], layout.inter
    per_token = top_k * (inter + d) * x.element_size()
    chunk = max(1, GROUPED_WORKSPACE_BYTES // per_token)
    if m > chunk:
        return torch.cat([fused_moe_grouped(x[i:i + chunk], expert_ids[i:i + chunk], weights[i:i + chunk],
                                            slot_of_expert, pool, layout, **knobs) for i in range(0, m, chunk)])
    y = torch.zeros_like(x)
    if m == 0:
        return y
    x = x if x.stride(1) == 1 else x.contiguous()
    cfg = tuning.config("grouped", tuning.regime(m, x.dtype, 0))
    cfg.update({k: v for k, v in knobs.items() if v is not None})
    wview, sview, off, strides = _pool_views(pool, layout, fmt)
    group = _group(layout, fmt)
    upcast = dispatch.interpreted()
    precision = dot_precision(x.dtype, upcast)
    wslot, sslot = pool.stride(0) // wview.element_size(), pool.stride(0) // sview.element_size()
    order, tiles = _tile_map(expert_ids.reshape(-1).long(), slot_of_expert.shape[0], cfg["block_m"])
    pairs = m * top_k
    h = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    out = torch.empty(pairs, d, dtype=x.dtype, device=x.device)
    launch = dict(TOP_K=top_k, FMT=fmt, GROUP=group, BLOCK_M=cfg["block_m"], UPCAST=upcast, PRECISION=precision,
                  PREFETCH=cfg["prefetch"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])

    _, bn, bk = plan_blocks(fmt, 16, inter, d, group, True, cfg["block_n"], cfg["block_k"])
    _grouped_gate_up_kernel[(tiles.shape[0], triton.cdiv(inter, bn))](
        x, order, tiles, slot_of_expert, wview, sview, h,
        d, inter, num_tiles(fmt, d, group, bk), x.stride(0),
        wslot, sslot, off["gate.w"], off["gate.s"], off["gate.z"], off["up.w"], off["up.s"], off["up.z"],
        *strides["gate"], BLOCK_N=bn, BLOCK_K=bk, **launch)
    _, bd, bk = plan_blocks(fmt, 16, d, inter, group, True, cfg["block_n"], cfg["block_k"])
    _grouped_down_kernel[(tiles.shape[0], triton.cdiv(d, bd))](
        h, order, tiles, weights.reshape(-1).contiguous(), slot_of_expert, wview, sview, out,
        d, inter, num_tiles(fmt, inter, group, bk),
        wslot, sslot, off["down.w"], off["down.s"], off["down.z"], *strides["down"],
        BLOCK_N=bd, BLOCK_K=bk, **launch)
    # token t's pairs sit at rows inv[t * K + k] of `out`; sorted, those rows run in ascending expert id
    inv = torch.empty_like(order)
    inv[order] = torch.arange(pairs, device=x.device)
    rows = inv.view(m, top_k).sort(dim=1).values
    for j in range(top_k):
        y += out.index_select(0, rows[:, j])
    return y


def fused_expert(x: torch.Tensor, slot: torch.Tensor, pool: torch.Tensor, layout: BlobLayout) -> torch.Tensor:
    """One expert, the blob in pool row slot[0] (int32 [1] on x's device), on every row of x [N, D] -> [N, D] in
    x.dtype, through the grouped kernels (its weights decoded in registers): the bits `fused_moe_grouped` gives
    that expert's rows, and what `format.expert_forward` computes by dequantizing it."""
    n = x.shape[0]
    return fused_moe_grouped(x, torch.zeros(n, 1, dtype=torch.int32, device=x.device),
                             torch.ones(n, 1, dtype=torch.float32, device=x.device), slot, pool, layout)


def fused_moe_grouped_ref(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                          slot_of_expert: torch.Tensor, pool: torch.Tensor, layout: BlobLayout) -> torch.Tensor:
    """The twin of `fused_moe_grouped`: `fused_moe_ref` (each expert's weighted output rounded to x.dtype, added in
    ascending expert id), which dequantizes one expert at a time."""
    return fused_moe_ref(x, expert_ids, weights, slot_of_expert, pool, layout)


# ----------------------------------------------------------------------------------------------
# PyTorch twin: the CPU path. moe.combine_experts over each expert's blob in its pool row, so with every
# expert resident it gives the same bits as BlobExperts (the resident provider).
# ----------------------------------------------------------------------------------------------

def fused_moe_ref(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, slot_of_expert: torch.Tensor,
                  pool: torch.Tensor, layout: BlobLayout, external_out: torch.Tensor | None = None) -> torch.Tensor:
    """The twin of `fused_moe` (same arguments), for every format, nf4 included (via the format's own forward).

    Each expert's weighted output is rounded to x.dtype and added in ascending expert id (`combine_experts`).
    Reads slot_of_expert and the routing on the host (a device sync on CUDA).
    """
    from ..moe import combine_experts           # here, not at the top: keeps the kernels importable alone
    from ..quant.formats import format_for_layout

    _check_inputs(x, expert_ids, weights, slot_of_expert, pool, layout, external_out)
    fmt = format_for_layout(layout)
    slots = slot_of_expert.tolist()
    flat = expert_ids.flatten().tolist() if external_out is not None else None

    def expert(e: int, xs: torch.Tensor) -> torch.Tensor:
        if slots[e] >= 0:
            return fmt.expert_forward(pool[slots[e]], xs, layout).to(xs.dtype)
        if external_out is None:
            return torch.zeros_like(xs)           # adds +-0: the same as leaving the expert out
        pairs = [i for i, v in enumerate(flat) if v == e]   # combine_experts' row order: ascending (token, k)
        return external_out.reshape(-1, xs.shape[1])[torch.tensor(pairs, device=xs.device)]

    return combine_experts(expert, x, expert_ids, weights)


def fused_moe_auto(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, slot_of_expert: torch.Tensor,
                   pool: torch.Tensor, layout: BlobLayout, external_out: torch.Tensor | None = None) -> torch.Tensor:
    """`fused_moe` where kernels run (dispatch.use_kernels) and the format has one, else `fused_moe_ref`."""
    if layout.format in FMT_CODES and dispatch.use_kernels(x.device):
        return fused_moe(x, expert_ids, weights, slot_of_expert, pool, layout, external_out)
    return fused_moe_ref(x, expert_ids, weights, slot_of_expert, pool, layout, external_out)
