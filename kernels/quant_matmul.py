"""Weight-only quantized matmuls for decode (M = 1..16 rows): W4A16 (int4 groups) and W8A16 (fp8 blocks).

y = x @ W^T with W read in its storage format and dequantized tile by tile in registers, exactly as the
format does it (quant/int4.py, quant/fp8.py), then multiplied in x's dtype with fp32 accumulation.
`_k_loop` is the one K loop for every format (its tile read and product per format); fused_moe.py runs it on weights
in the expert slot pool. Launch configurations: kernels/tuning.py.
Every launcher takes component tensors as views (`BlobLayout.view`), so they may point into a pool row.
"""
from __future__ import annotations

import os
import torch
import torch.nn.functional as F

from . import dispatch, tuning
from .dispatch import jit as _jit, tl, triton
from ..quant.fp8 import BLOCK as FP8_BLOCK, fp8_block_dequant, scale_grid_shape
from ..quant.int4 import int4_dequant, padded_k
from ..quant.table import FORMAT_TABLE, TRITON_FP8_BYTES


# the `FMT` constexpr of every kernel, from the formats' table (quant/table.py). FMT_FP8_BYTES: fp8 weights read as
# bytes and decoded with bit arithmetic, for GPUs whose Triton has no fp8e4nv type (compute capability below 8.9)
FMT_CODES = {name: entry.triton for name, entry in FORMAT_TABLE.items() if entry.triton is not None}
FMT_INT4, FMT_FP8, FMT_BF16, FMT_FP8_BYTES = FMT_CODES["int4"], FMT_CODES["fp8"], FMT_CODES["bf16"], TRITON_FP8_BYTES
FMT_INT4G32 = FMT_CODES["int4g32"]
# the kernels' constexpr branches below are written as these literals (Triton reads no Python globals there)
assert (FMT_INT4, FMT_FP8, FMT_BF16, FMT_FP8_BYTES, FMT_INT4G32) == (0, 1, 2, 3, 4), \
    "quant/table.py's Triton codes changed"
GROUPED = (FMT_INT4, FMT_INT4G32)        # formats read a group of K at a time (K tiles: whole groups)
FP8_NATIVE_CAPABILITY = (8, 9)          # Triton's fp8e4nv type: Ada, Hopper and later


def fp8_code_for(capability: tuple[int, int]) -> int:
    """FMT_FP8 (Triton's fp8e4nv type) from compute capability 8.9 on, else FMT_FP8_BYTES."""
    return FMT_FP8 if tuple(capability) >= FP8_NATIVE_CAPABILITY else FMT_FP8_BYTES


def fp8_code(device: torch.device) -> int:
    """How the kernels read fp8 weights on `device`. DSV3LITE_FP8_DECODE=bytes forces the byte decode (tests run
    it in the interpreter, whose fp8 type works like a recent GPU's)."""
    if os.environ.get("DSV3LITE_FP8_DECODE", "").strip().lower() == "bytes":
        return FMT_FP8_BYTES
    cap = dispatch.capability(device)
    return FMT_FP8 if cap is None else fp8_code_for(cap)


def fp8_weight_view(t: torch.Tensor, code: int) -> torch.Tensor:
    """fp8 weight bytes as the kernels read them for `code`: float8_e4m3fn, or uint8 for the byte decode."""
    return t.view(torch.float8_e4m3fn) if code == FMT_FP8 else t.view(torch.uint8)
DOT_MIN_ROWS = 3                        # from this many rows up, tensor-core tl.dot; below, fp32 multiply-adds
_X_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ----------------------------------------------------------------------------------------------
# The K loop: acc += x[:, K range] (x) W[:, K range]^T, BLOCK_K weight elements a tile.
#
# Addresses are a scalar base pointer plus int32 offset vectors (rows of x, rows of W), so little stays
# live across the loop. Weight tiles are loaded as [k, n] (k fastest in memory: coalesced). int4: the packed row
# is a run of groups, each g/2 bytes holding element b of the group in the low nibble and b + g/2 in the high one;
# a tile is BLOCK_K/2 consecutive bytes of the row (part of a group, or several), so x is read as two vectors (the
# low and the high elements of those bytes), with the scale and zero of each byte's group. int4g32 (quant/int4g32.py)
# is read the same way with g = 32, its byte c holding elements 2c and 2c + 1 (x read as its even and odd elements),
# one bf16 scale per group and no zero. fp8: BLOCK_K divides 128, so a tile sits in one column of the scale grid:
# one scale per row per tile.
# `_load_tile` reads a tile, `_tile_product` multiplies it in. With PREFETCH the loop reads tile it + 1 before it
# multiplies tile it (a register double buffer): at batch 1 the multiply-adds no longer wait for the loads they
# follow, so every program keeps two tiles of weight bytes in flight.
# Two inner products (USE_DOT): tl.dot on tensor cores with BLOCK_M >= 16 rows (acc [BLOCK_M, BLOCK_N]), or,
# for 1-2 rows, fp32 multiply-adds into acc [BLOCK_M, KW, BLOCK_N] (KW = BLOCK_K/2 for int4 / int4g32, BLOCK_K
# otherwise) that is summed over KW once after the loop (`_acc_result`): no per-tile reduction, no shared-memory
# shuffles.
# ----------------------------------------------------------------------------------------------

@_jit
def _cast(v, dtype, EMULATE_RNE: tl.constexpr):
    # v -> dtype, rounding to nearest even. Triton's interpreter truncates fp32 -> bf16 (a GPU rounds), so
    # there the rounding is done on the bits first and the cast is exact.
    if EMULATE_RNE:
        if dtype == tl.bfloat16:
            v = _round_bf16(v.to(tl.float32))
    return v.to(dtype)


@_jit
def _round_bf16(v):
    # fp32 v rounded to the nearest bf16 value (ties to even), still fp32: the interpreter's casts truncate
    bits = v.to(tl.uint32, bitcast=True)
    return (((bits + ((bits >> 16) & 1) + 0x7FFF) >> 16) << 16).to(tl.float32, bitcast=True)


@_jit
def _e4m3_to_f32(q):
    # float8 e4m3fn bytes -> their exact fp32 values, by integer arithmetic only (no fp8 type, no denormals):
    # sign | exponent e (4 bits, bias 7) | mantissa m (3 bits); e = 0 is subnormal: m * 2^-9, else (8 + m) * 2^(e - 10);
    # 0x7F / 0xFF are NaN
    b = q.to(tl.int32)
    e = (b >> 3) & 0xF
    m = b & 0x7
    mant = tl.where(e == 0, m, m + 8).to(tl.float32)
    power = ((tl.where(e == 0, -9, e - 10) + 127) << 23).to(tl.float32, bitcast=True)
    v = mant * power
    v = tl.where((b & 0x7F) == 0x7F, float("nan"), v)
    return tl.where((b & 0x80) != 0, -v, v)


@_jit
def _acc_zeros(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FMT: tl.constexpr, BLOCK_K: tl.constexpr,
               USE_DOT: tl.constexpr):
    if USE_DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    elif FMT == 0 or FMT == 4:
        acc = tl.zeros([BLOCK_M, BLOCK_K // 2, BLOCK_N], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_K, BLOCK_N], dtype=tl.float32)
    return acc


@_jit
def _acc_result(acc, USE_DOT: tl.constexpr):
    # [BLOCK_M, BLOCK_N] fp32
    if not USE_DOT:
        acc = tl.sum(acc, 1)
    return acc


@_jit
def _load_tile(it, live, x_ptr, x_off, x_ok, k_in, w_ptr, w_off, s_ptr, z_ptr, s_off, n_ok,
               FMT: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
    # The operands of K tile `it`: (xa, xb, q, s, z). live (scalar): whether the tile is read at all.
    # x_off [BLOCK_M]: element offsets of x's rows from x_ptr (valid where x_ok); k_in: valid input features.
    # w_off [BLOCK_N]: offsets of the weight's rows from w_ptr (int4: of the packed byte rows); s_off [BLOCK_N]:
    # offsets of the rows' scales (int4: and zeros, from z_ptr) from s_ptr, for fp8 those of row n // 128 of the
    # scale grid. n_ok [BLOCK_N]. int4 / int4g32: xa / xb the low / high elements of the tile's bytes,
    # q [BLOCK_K/2, BLOCK_N] bytes, s / z [1 or BLOCK_K/2, BLOCK_N] (int4g32: z unused); fp8 / bf16:
    # xa [BLOCK_M, BLOCK_K], q [BLOCK_K, BLOCK_N], s the fp8 scale [1, BLOCK_N] (xb, z: unused).
    w_ok = tl.where(live, n_ok, False)      # (not n_ok & live: the interpreter makes that int32)
    if FMT == 0 or FMT == 4:   # int4, int4g32
        HALF: tl.constexpr = GROUP // 2
        c = it * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)          # byte columns of the packed rows
        n_groups = tl.cdiv(k_in, GROUP)
        q = tl.load(w_ptr + (w_off[None, :] + c[:, None]), mask=(c < n_groups * HALF)[:, None] & w_ok[None, :],
                    other=0)
        # a group past the last (K short of the tile) reads the last group's scale: finite, met by x = 0
        if BLOCK_K <= GROUP:   # the tile is in one group: one scale (and zero) per row
            s_at = s_off + tl.minimum((it * (BLOCK_K // 2)) // HALF, n_groups - 1)
            s = tl.load(s_ptr + s_at, mask=w_ok, other=0.0).to(tl.float32)[None, :]
            z = tl.load(z_ptr + s_at, mask=w_ok, other=0.0).to(tl.float32)[None, :] if FMT == 0 else s
        else:
            s_at = s_off[None, :] + tl.minimum(c // HALF, n_groups - 1)[:, None]
            s = tl.load(s_ptr + s_at, mask=w_ok[None, :], other=0.0).to(tl.float32)
            z = tl.load(z_ptr + s_at, mask=w_ok[None, :], other=0.0).to(tl.float32) if FMT == 0 else s
        # padded k (>= k_in) must meet x = 0: the padding codes dequantize to about zero, not zero
        if FMT == 0:   # byte b of a group: elements b and b + g/2
            k_lo = (c // HALF) * GROUP + c % HALF
            xa = tl.load(x_ptr + (x_off[:, None] + k_lo[None, :]), mask=x_ok[:, None] & (k_lo < k_in)[None, :],
                         other=0.0)
            xb = tl.load(x_ptr + (x_off[:, None] + (k_lo + HALF)[None, :]),
                         mask=x_ok[:, None] & (k_lo + HALF < k_in)[None, :], other=0.0)
        else:          # int4g32: byte c of the row, elements 2c and 2c + 1: x read whole, split into even and odd
            k = it * BLOCK_K + tl.arange(0, BLOCK_K)       # (two strided reads of x cost ~40 registers more)
            xk = tl.load(x_ptr + (x_off[:, None] + k[None, :]), mask=x_ok[:, None] & (k < k_in)[None, :], other=0.0)
            xa, xb = tl.split(tl.reshape(xk, [xk.shape[0], BLOCK_K // 2, 2]))
    else:
        k = it * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = k < k_in
        xa = tl.load(x_ptr + (x_off[:, None] + k[None, :]), mask=x_ok[:, None] & k_ok[None, :], other=0.0)
        xb = xa
        q = tl.load(w_ptr + (w_off[None, :] + k[:, None]), mask=k_ok[:, None] & w_ok[None, :], other=0.0)
        if FMT == 2:
            s = q                     # (no scale: a stand-in of the loop-carried type)
        else:
            s = tl.load(s_ptr + (s_off + (it * BLOCK_K) // 128), mask=w_ok, other=0.0)[None, :]
        z = s
    return xa, xb, q, s, z


@_jit
def _tile_product(acc, xa, xb, q, s, z, FMT: tl.constexpr, USE_DOT: tl.constexpr, UPCAST: tl.constexpr,
                  PRECISION: tl.constexpr):
    # acc += the tile's products. Weights are rounded to x's dtype, as the formats dequantize. UPCAST (interpreter,
    # whose bf16 tl.dot is wrong): fp32 operands holding those values; the interpreter truncates fp32 -> bf16, so
    # there the bf16 rounding is done on the bits (to nearest even) first.
    if FMT == 0 or FMT == 4:
        if FMT == 0:   # int4: (q - z) * s
            w_lo = ((q & 0xF).to(tl.float32) - z) * s
            w_hi = ((q >> 4).to(tl.float32) - z) * s
            if UPCAST:
                if xa.dtype == tl.bfloat16:
                    w_lo = _round_bf16(w_lo)
                    w_hi = _round_bf16(w_hi)
        else:          # int4g32: bf16((q - 8) * s), the format's one rounding (stored nibble = q + 8)
            w_lo = _cast(((q & 0xF).to(tl.float32) - 8.0) * s, tl.bfloat16, UPCAST)
            w_hi = _cast(((q >> 4).to(tl.float32) - 8.0) * s, tl.bfloat16, UPCAST)
        w_lo = w_lo.to(xa.dtype)
        w_hi = w_hi.to(xa.dtype)
        if UPCAST or not USE_DOT:
            xa = xa.to(tl.float32)
            xb = xb.to(tl.float32)
            w_lo = w_lo.to(tl.float32)
            w_hi = w_hi.to(tl.float32)
        if USE_DOT:
            acc += tl.dot(xa, w_lo, input_precision=PRECISION)
            acc += tl.dot(xb, w_hi, input_precision=PRECISION)
        else:
            acc += xa[:, :, None] * w_lo[None, :, :] + xb[:, :, None] * w_hi[None, :, :]
    else:
        if FMT == 1 or FMT == 3:   # fp8: bf16(fp32(q) * s), then the compute dtype
            if FMT == 3:
                w = _e4m3_to_f32(q) * s
            else:
                w = q.to(tl.float32) * s
            if UPCAST:
                w = _round_bf16(w)
            w = w.to(tl.bfloat16).to(xa.dtype)
        else:          # bf16
            w = q.to(xa.dtype)
        if UPCAST or not USE_DOT:
            xa = xa.to(tl.float32)
            w = w.to(tl.float32)
        if USE_DOT:
            acc += tl.dot(xa, w, input_precision=PRECISION)
        else:
            acc += xa[:, :, None] * w[None, :, :]
    return acc


@_jit
def _scale_rows(offs_n, stride_sn, FMT: tl.constexpr):
    # offsets of the output rows' scales (and zeros): a row each, or for fp8 the row n // 128 of the block grid
    if FMT == 1 or FMT == 3:
        s_off = (offs_n // 128) * stride_sn
    else:
        s_off = offs_n * stride_sn
    return s_off


@_jit
def _k_loop(acc, start, stop, x_ptr, x_off, x_ok, k_in, w_ptr, w_off, s_ptr, z_ptr, s_off, n_ok,
            FMT: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr,
            UPCAST: tl.constexpr, PRECISION: tl.constexpr, PREFETCH: tl.constexpr):
    # acc += tiles start..stop-1 (see `_load_tile` for the arguments)
    if PREFETCH:
        xa, xb, q, s, z = _load_tile(start, start < stop, x_ptr, x_off, x_ok, k_in, w_ptr, w_off, s_ptr, z_ptr,
                                     s_off, n_ok, FMT, GROUP, BLOCK_K)
        for it in range(start, stop):
            nxa, nxb, nq, ns, nz = _load_tile(it + 1, it + 1 < stop, x_ptr, x_off, x_ok, k_in, w_ptr, w_off, s_ptr,
                                              z_ptr, s_off, n_ok, FMT, GROUP, BLOCK_K)
            acc = _tile_product(acc, xa, xb, q, s, z, FMT, USE_DOT, UPCAST, PRECISION)
            xa, xb, q, s, z = nxa, nxb, nq, ns, nz
    else:
        for it in range(start, stop):
            xa, xb, q, s, z = _load_tile(it, True, x_ptr, x_off, x_ok, k_in, w_ptr, w_off, s_ptr, z_ptr, s_off, n_ok,
                                         FMT, GROUP, BLOCK_K)
            acc = _tile_product(acc, xa, xb, q, s, z, FMT, USE_DOT, UPCAST, PRECISION)
    return acc


@_jit
def _quant_matmul_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, out_ptr,
    M, N, K, n_tiles, tiles_per_split,
    stride_xm, stride_wn, stride_sn,   # x [M, K]; weight / scale (and zero) row strides in elements
    stride_os, stride_om,              # out [splits, M, N] (splits = 1: the result itself)
    FMT: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, PREFETCH: tl.constexpr,
):
    split = tl.program_id(2)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    s_off = _scale_rows(offs_n, stride_sn, FMT)

    start = split * tiles_per_split
    acc = _k_loop(_acc_zeros(BLOCK_M, BLOCK_N, FMT, BLOCK_K, USE_DOT), start,
                  tl.minimum(start + tiles_per_split, n_tiles), x_ptr, offs_m * stride_xm, m_ok, K,
                  w_ptr, offs_n * stride_wn, s_ptr, z_ptr, s_off, n_ok,
                  FMT, GROUP, BLOCK_K, USE_DOT, UPCAST, PRECISION, PREFETCH)
    out = out_ptr + split * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, _cast(_acc_result(acc, USE_DOT), out_ptr.dtype.element_ty, UPCAST),
             mask=m_ok[:, None] & n_ok[None, :])


# ----------------------------------------------------------------------------------------------
# Launch planning, shared with fused_moe.py
# ----------------------------------------------------------------------------------------------

def launch_config(kernel: str, m: int, dtype: torch.dtype, use_dot: bool | None = None, **given) -> dict:
    """The knobs of `kernel` (kernels/tuning.py) for m rows of x in `dtype`, with `use_dot` resolved (tl.dot from
    DOT_MIN_ROWS rows up, unless given) and the `given` knobs that are not None over the tuned ones."""
    use_dot = m >= DOT_MIN_ROWS if use_dot is None else bool(use_dot)
    cfg = tuning.config(kernel, tuning.regime(DOT_MIN_ROWS if use_dot else 0, dtype, DOT_MIN_ROWS))
    cfg.update({k: v for k, v in given.items() if v is not None}, use_dot=use_dot)
    return cfg


def plan_blocks(fmt: int, m: int, n: int, k: int, group: int, use_dot: bool, block_n: int,
                block_k: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) for M rows of x times an [N, K] weight in format `fmt`, from the wanted
    block_n / block_k (powers of two), no wider than the weight needs.

    tl.dot needs 16 rows (and a K of 16), so it pays from DOT_MIN_ROWS rows up; fewer rows use fp32 multiply-adds.
    BLOCK_K counts weight elements per row of a K tile: int4 and int4g32 read BLOCK_K/2 bytes (part of a group or
    several groups), fp8 a divisor of the 128-wide scale blocks.
    """
    block_m = 16 if use_dot else min(16, triton.next_power_of_2(m))
    bn = max(16, min(block_n, triton.next_power_of_2(n)))
    assert block_k & (block_k - 1) == 0, f"block_k must be a power of two, got {block_k}"
    if fmt in GROUPED:
        # 32: 16 bytes, a tl.dot's K; at most two groups (past one, a tile reads a scale (and zero) per byte
        # column, which costs registers: int4 g32 tiles of 128 spill on sm_86)
        bk = max(32, min(block_k, 2 * group, triton.next_power_of_2(padded_k(k, group))))
    else:
        assert fmt not in (FMT_FP8, FMT_FP8_BYTES) or block_k <= FP8_BLOCK, (
            f"fp8 block_k must divide {FP8_BLOCK}, got {block_k}")
        bk = max(16, min(block_k, triton.next_power_of_2(k)))   # 16: the smallest K of a tl.dot
    return block_m, bn, bk


def num_tiles(fmt: int, k: int, group_size: int | None, block_k: int) -> int:
    """K tiles per row; int4 / int4g32 tiles cover the zero-padded K (a multiple of the group size)."""
    kp = padded_k(k, group_size) if fmt in GROUPED else k
    return triton.cdiv(kp, block_k)


def dot_precision(dtype: torch.dtype, upcast: bool) -> str:
    # fp32 operands: "ieee", so fp32 models get no tf32 rounding; 16-bit operands ignore it
    return "ieee" if (upcast or dtype == torch.float32) else "tf32"


def _auto_split_k(programs: int, tiles: int, device: torch.device) -> int:
    """About four programs per SM, each with at least two K tiles."""
    wanted = -(-4 * dispatch.sm_count(device) // max(programs, 1))
    return max(1, min(wanted, tiles // 2))


def _check_x(x: torch.Tensor, k: int) -> None:
    assert x.dtype in _X_DTYPES, f"x must be float16, bfloat16 or float32, got {x.dtype}"
    assert x.dim() >= 1 and x.shape[-1] == k, f"x must be [..., {k}], got shape {tuple(x.shape)}"


def _launch(fmt: int, x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, z: torch.Tensor, n: int, k: int,
            group: int, stride_sn: int, split_k: int | None, knobs: dict) -> torch.Tensor:
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out_shape = (*lead, n)
    if m == 0:
        return x.new_empty(out_shape)
    assert n * w.stride(0) < 2**31 and m * x2.stride(0) < 2**31, "offsets are int32: split the weight or x"
    upcast = dispatch.interpreted()
    cfg = launch_config("gemv", m, x.dtype, **knobs)
    bm, bn, bk = plan_blocks(fmt, m, n, k, group, cfg["use_dot"], cfg["block_n"], cfg["block_k"])
    tiles = num_tiles(fmt, k, group, bk)
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm))
    splits = split_k or _auto_split_k(grid[0] * grid[1], tiles, x.device)
    tiles_per_split = triton.cdiv(tiles, max(1, splits))
    splits = triton.cdiv(tiles, tiles_per_split)     # no empty split
    if splits == 1:
        part = torch.empty(1, m, n, dtype=x.dtype, device=x.device)
    else:   # fp32 partial sums, added in a fixed order afterwards (no atomics: the result is reproducible)
        part = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    _quant_matmul_kernel[(*grid, splits)](
        x2, w, s, z, part,
        m, n, k, tiles, tiles_per_split,
        x2.stride(0), w.stride(0), stride_sn,
        part.stride(0), part.stride(1),
        FMT=fmt, GROUP=group, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, USE_DOT=cfg["use_dot"],
        UPCAST=upcast, PRECISION=dot_precision(x.dtype, upcast), PREFETCH=cfg["prefetch"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    out = part[0] if splits == 1 else part.sum(0).to(x.dtype)
    return out.view(out_shape)


# ----------------------------------------------------------------------------------------------
# W4A16
# ----------------------------------------------------------------------------------------------

def _check_int4(qweight, scales, zeros, k, group_size):
    assert group_size >= 32 and group_size & (group_size - 1) == 0, (
        f"group_size must be a power of two >= 32 (the kernel's tile), got {group_size}")
    kp = padded_k(k, group_size)
    assert qweight.dtype == torch.uint8 and qweight.dim() == 2 and qweight.shape[1] == kp // 2, (
        f"qweight must be uint8 [N, {kp // 2}] for K={k}, group {group_size}; "
        f"got {qweight.dtype} {tuple(qweight.shape)}")
    n = qweight.shape[0]
    for name, t in (("scales", scales), ("zeros", zeros)):
        assert t.dtype == torch.float16 and tuple(t.shape) == (n, kp // group_size), (
            f"{name} must be float16 [{n}, {kp // group_size}], got {t.dtype} {tuple(t.shape)}")
    assert scales.stride() == zeros.stride(), "scales and zeros must have the same strides"
    for name, t in (("qweight", qweight), ("scales", scales), ("zeros", zeros)):
        assert t.stride(1) == 1, f"{name} rows must be contiguous, got strides {t.stride()}"
        assert t.device == qweight.device, f"{name} is on {t.device}, qweight on {qweight.device}"
    return n


def w4a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, k: int,
                 group_size: int, *, split_k: int | None = None, **knobs) -> torch.Tensor:
    """x [..., K] @ W^T for an int4 weight W [N, K] in this project's packing -> [..., N] in x.dtype.

    qweight uint8 [N, Kp/2], scales / zeros float16 [N, Kp/g] (Kp = K padded to the group size g),
    w = (q - z) * s in fp32 rounded to x.dtype; fp32 accumulation. Rows of each tensor must be contiguous;
    the tensors may be views into an expert blob or pool row. split_k: K splits (None: from the SM count), their
    fp32 partials summed in a fixed order. knobs (None or absent: kernels/tuning.py's "gemv"): use_dot (tensor-core
    tl.dot rather than fp32 multiply-adds), block_n, block_k, num_warps, num_stages, prefetch.
    """
    assert triton is not None, "w4a16_matmul needs Triton; use w4a16_matmul_ref (or w4a16_matmul_auto)"
    _check_x(x, k)
    n = _check_int4(qweight, scales, zeros, k, group_size)
    assert x.device == qweight.device, f"x is on {x.device}, qweight on {qweight.device}"
    return _launch(FMT_INT4, x, qweight, scales, zeros, n, k, group_size, scales.stride(0), split_k, knobs)


def w4a16_matmul_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, k: int,
                     group_size: int) -> torch.Tensor:
    """The twin of `w4a16_matmul`: dequantize as the int4 format does (to x.dtype), then F.linear."""
    _check_x(x, k)
    _check_int4(qweight, scales, zeros, k, group_size)
    return F.linear(x, int4_dequant(qweight, scales, zeros, k, group_size, x.dtype))


def w4a16_matmul_auto(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, k: int,
                      group_size: int) -> torch.Tensor:
    """`w4a16_matmul` where kernels run (dispatch.use_kernels), else `w4a16_matmul_ref`."""
    if dispatch.use_kernels(x.device):
        return w4a16_matmul(x, qweight, scales, zeros, k, group_size)
    return w4a16_matmul_ref(x, qweight, scales, zeros, k, group_size)


# ----------------------------------------------------------------------------------------------
# W8A16
# ----------------------------------------------------------------------------------------------

def _check_fp8(weight, scale):
    assert weight.dtype == torch.float8_e4m3fn and weight.dim() == 2, (
        f"weight must be float8_e4m3fn [N, K], got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    assert scale.dtype == torch.float32 and tuple(scale.shape) == scale_grid_shape(n, k), (
        f"scale must be float32 {scale_grid_shape(n, k)} for weight {(n, k)}, got {scale.dtype} {tuple(scale.shape)}")
    assert weight.stride(1) == 1 and scale.stride(1) == 1, "weight and scale rows must be contiguous"
    assert scale.device == weight.device, f"scale is on {scale.device}, weight on {weight.device}"
    return n, k


def w8a16_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, *, split_k: int | None = None,
                 **knobs) -> torch.Tensor:
    """x [..., K] @ W^T for an fp8 e4m3 weight [N, K] with float32 128x128 block scales -> [..., N] in x.dtype.

    w = bf16(fp32(q) * scale[n // 128, k // 128]) cast to x.dtype (the project's one FP8 dequantization);
    fp32 accumulation. Tuning knobs as for `w4a16_matmul`.
    """
    assert triton is not None, "w8a16_matmul needs Triton; use w8a16_matmul_ref (or w8a16_matmul_auto)"
    n, k = _check_fp8(weight, scale)
    _check_x(x, k)
    assert x.device == weight.device, f"x is on {x.device}, weight on {weight.device}"
    code = fp8_code(x.device)
    return _launch(code, x, fp8_weight_view(weight, code), scale, scale, n, k, FP8_BLOCK, scale.stride(0), split_k,
                   knobs)


def w8a16_matmul_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The twin of `w8a16_matmul`: `fp8_block_dequant` to x.dtype, then F.linear."""
    _, k = _check_fp8(weight, scale)
    _check_x(x, k)
    return F.linear(x, fp8_block_dequant(weight, scale, x.dtype))


def w8a16_matmul_auto(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`w8a16_matmul` where kernels run (dispatch.use_kernels), else `w8a16_matmul_ref`."""
    if dispatch.use_kernels(x.device):
        return w8a16_matmul(x, weight, scale)
    return w8a16_matmul_ref(x, weight, scale)
