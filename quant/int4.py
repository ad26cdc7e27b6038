"""INT4 expert format: group-wise asymmetric 4-bit along K (the input dim), packed for the Triton kernel.

Per matrix [N, K], with Kp = K rounded up to the group size g (zero padding):
  qweight uint8 [N, Kp/2]    within each group of g consecutive k, byte b (0 <= b < g/2) holds element b
                             in its low nibble and element b + g/2 in its high nibble, so a kernel splits a
                             byte tile into two contiguous halves of k with no interleave
  scales  float16 [N, Kp/g]
  zeros   float16 [N, Kp/g]  w = (q - z) * s, computed in fp32
Padded columns dequantize to about zero; kernels must treat x beyond K as zero.

Each group's range always includes 0 (so z stays in [0, 15], where fp16 holds it to 2^-8) and is chosen by
a clipping search: shrink [min, max] by a few ratios, then move each end on its own, keeping per group the
candidate with the least squared reconstruction error, evaluated with the fp16-rounded scale and zero (7
candidates, within 2% of the error of the earlier 23; benchmarks/quantize_speed.py --search-table).

On the CPU a compiled kernel does it all in one pass per group (kernels/csrc/cpu_kernels.cpp dsv3_int4_quantize:
FP8 decoding, the search, packing), with the same operations in the same order as the PyTorch twin
int4_quantize_ref, which runs elsewhere (GPU, no compiler, DSV3LITE_CPU_KERNELS=ref): the same bits either way.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import UserError
from .fp8 import BLOCK, fp8_block_dequant, scale_grid_shape
from .layout import MATRICES, ExpertFormat
from .table import INT4_GROUP_SIZES

GROUP_SIZES = INT4_GROUP_SIZES
QMAX = 15
MIN_RATIO = 0.3
FP16_TINY = 2.0 ** -24  # smallest positive float16
CHUNK_ELEMENTS_CPU = 1 << 17  # a row chunk and its temporaries stay in a core's L2 (measured best of 2^13..2^18)
CHUNK_ELEMENTS_GPU = 1 << 26


@dataclass(frozen=True)
class ClipSearch:
    """Candidate ranges per group: [min, max] shrunk by each of `shrink` (both ends together), then each end on
    its own moved by each of `end_steps` around the best ratio so far (lower end first)."""
    shrink: tuple[float, ...]
    end_steps: tuple[float, ...]

    @property
    def candidates(self) -> int:
        return 1 + len(self.shrink) + 2 * len(self.end_steps)


# the search quantize uses; measured against EXHAUSTIVE in benchmarks/quantize_speed.py --search-table
CLIP_SEARCH = ClipSearch(shrink=(0.9, 0.8), end_steps=(-0.05, 0.05))
# the earlier search: 23 candidates (kept as the reference the cheaper one is measured against)
EXHAUSTIVE = ClipSearch(shrink=tuple(1.0 - 0.05 * i for i in range(1, 11)),
                        end_steps=tuple(0.05 * d for d in (-3, -2, -1, 1, 2, 3)))


def padded_k(k: int, group_size: int) -> int:
    return -(-k // group_size) * group_size


def _scale_zero(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16-representable (scale, zero) as fp32 for a range [lo, hi] widened to include 0."""
    lo, hi = lo.clamp(max=0.0), hi.clamp(min=0.0)
    s = ((hi - lo) / QMAX).clamp(min=FP16_TINY).half().float()
    z = ((0.0 - lo) / s).half().float()      # 0 - lo, not -lo: a zero lo gives +0 whatever its sign
    return s, z


def _quant_codes(wg: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    # wg [N, G, g]; s, z [N, G, 1] -> float codes in 0..15 (clamping before rounding: the bounds are integers)
    return (wg / s).add_(z).clamp_(0, QMAX).round_()


def _sum_by_halves(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim, keeping it (size 1), in a fixed order: while the width n > 1, element i + ceil(n/2) is
    added to element i. Elementwise adds only, so every device and the compiled quantizer (which writes the same
    loop) round alike; torch's own sum adds in an order that depends on the vector width."""
    while x.shape[-1] > 1:
        n, h = x.shape[-1], -(-x.shape[-1] // 2)
        top = x[..., :n - h] + x[..., h:]
        x = top if n == 2 * h else torch.cat([top, x[..., n - h:h]], dim=-1)
    return x


def _group_sq_error(wg, s, z, valid):
    """Sum of squared reconstruction errors per group: wg [N, G, g], s and z [..., N, G, 1] -> [..., N, G, 1]."""
    t = (wg / s).add_(z)                           # the code before rounding
    err = t.clamp(0, QMAX).round_().sub_(t)        # (q - z) * s - w == (q - t) * s
    if valid is not None:
        err.mul_(valid)
    return _sum_by_halves(err.mul_(err)).mul_(s * s)


def _chunked_errors(wg, s, z, valid, rows):
    """_group_sq_error over row chunks of `rows` (each chunk's temporaries stay in cache)."""
    n = wg.shape[0]
    err = torch.empty(torch.broadcast_shapes(s.shape, wg.shape[:-1] + (1,)), device=wg.device)
    for i in range(0, n, rows):
        err[..., i:i + rows, :, :] = _group_sq_error(wg[i:i + rows], s[..., i:i + rows, :, :],
                                                     z[..., i:i + rows, :, :], valid)
    return err


def _least_error(wg, valid, rows, lo, hi, best, r_lo, r_hi):
    """The incumbent best = (r_lo, r_hi, error), each [N, G, 1], replaced per group by the candidate of least error
    among r_lo, r_hi [C, N, G, 1] (broadcastable) where one is below its error; the first of equal errors wins, as
    when candidates are tried one by one."""
    c, shape = max(r_lo.shape[0], r_hi.shape[0]), lo.shape
    r_lo, r_hi = r_lo.expand((c,) + shape), r_hi.expand((c,) + shape)
    s, z = _scale_zero(lo * r_lo, hi * r_hi)
    err = torch.cat([best[2][None], _chunked_errors(wg, s, z, valid, rows)])      # [1 + C, N, G, 1]
    pick = err.movedim(0, -1).contiguous().argmin(dim=-1)[None]                   # [1, N, G, 1]; C innermost: faster
    r_lo, r_hi = (torch.cat([b[None], r]) for b, r in zip(best, (r_lo, r_hi)))
    return r_lo.gather(0, pick)[0], r_hi.gather(0, pick)[0], err.gather(0, pick)[0]


def _search_scale_zero(wg: torch.Tensor, valid: torch.Tensor | None, search: ClipSearch | None, rows: int):
    """Per-group (s, z) [N, G, 1]: per-group steps on the whole matrix at once, each stage's candidates batched, the
    error sums (the only work over every element) in row chunks of `rows`."""
    lo, hi = wg.amin(dim=-1, keepdim=True), wg.amax(dim=-1, keepdim=True)  # padding is 0: neutral
    s, z = _scale_zero(lo, hi)
    if search is None:
        return s, z
    one = torch.ones_like(lo)
    best = (one, one, _chunked_errors(wg, s, z, valid, rows))
    if search.shrink:
        ratios = torch.tensor(search.shrink, device=wg.device).view(-1, 1, 1, 1)
        best = _least_error(wg, valid, rows, lo, hi, best, ratios, ratios)
    if search.end_steps:
        steps = torch.tensor(search.end_steps, device=wg.device).view(-1, 1, 1, 1)
        best = _least_error(wg, valid, rows, lo, hi, best, (best[0] + steps).clamp(MIN_RATIO, 1.0), best[1][None])
        best = _least_error(wg, valid, rows, lo, hi, best, best[0][None], (best[1] + steps).clamp(MIN_RATIO, 1.0))
    return _scale_zero(lo * best[0], hi * best[1])


def _chunk_rows(n: int, kp: int, device: torch.device) -> int:
    """Rows per chunk: a power of two up to 128, or a multiple of 128, so a chunk never straddles FP8 blocks."""
    rows = max(1, (CHUNK_ELEMENTS_CPU if device.type == "cpu" else CHUNK_ELEMENTS_GPU) // kp)
    return rows // BLOCK * BLOCK if rows >= BLOCK else 1 << (rows.bit_length() - 1)


_SRC_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float8_e4m3fn: 3}  # the kernel's sources
KERNEL_ISA = 0   # the kernel's code: 0 AVX-512 where the CPU has it, 1 AVX2 only (the same bits; for tests)
KERNEL_MAX_CANDIDATES = 64   # per search stage (cpu_kernels.cpp MAX_CANDIDATES); a larger search runs the twin


def _search_of(clip_search: bool | ClipSearch) -> ClipSearch | None:
    return CLIP_SEARCH if clip_search is True else (clip_search or None)


def _kernel_library(w: torch.Tensor, group_size: int, scale_inv: torch.Tensor | None, search: ClipSearch | None):
    """The compiled CPU kernels when they can quantize w (on the CPU, a source dtype, group size and search they
    take), else None."""
    if (w.device.type != "cpu" or w.dim() != 2 or w.dtype not in _SRC_KINDS or group_size not in GROUP_SIZES
            or w.numel() == 0 or (scale_inv is not None and (w.dtype != torch.float8_e4m3fn
                                                             or scale_inv.device.type != "cpu"))
            or (search is not None and max(1 + len(search.shrink), len(search.end_steps)) > KERNEL_MAX_CANDIDATES)):
        return None
    from ..kernels import cpu_build

    return cpu_build.library()


def _int4_quantize_kernel(lib, w, group_size, search, scale_inv, out=None):
    """int4_quantize by the compiled kernel (kernels/csrc/cpu_kernels.cpp dsv3_int4_quantize: the twin's
    operations in its order, rows on torch's CPU threads), into `out` = (qweight, scales, zeros) if given."""
    n, k = w.shape
    g = group_size
    kp = padded_k(k, g)
    if scale_inv is not None and tuple(scale_inv.shape) != scale_grid_shape(n, k):
        raise ValueError(f"scale grid {tuple(scale_inv.shape)} does not fit weight {(n, k)}: "
                         f"expected {scale_grid_shape(n, k)}")
    if out is None:
        out = (torch.empty(n, kp // 2, dtype=torch.uint8), torch.empty(n, kp // g, dtype=torch.float16),
               torch.empty(n, kp // g, dtype=torch.float16))
    qweight, scales, zeros = out
    wc = w.contiguous()
    sc = None if scale_inv is None else scale_inv.float().contiguous()
    shrink = torch.tensor(search.shrink if search else (), dtype=torch.float32)
    steps = torch.tensor(search.end_steps if search else (), dtype=torch.float32)
    rc = lib.dsv3_int4_quantize(wc.data_ptr(), _SRC_KINDS[w.dtype], None if sc is None else sc.data_ptr(), n, k, g,
                                int(search is not None), shrink.data_ptr(), shrink.numel(), steps.data_ptr(),
                                steps.numel(), qweight.data_ptr(), scales.data_ptr(), zeros.data_ptr(),
                                torch.get_num_threads(), KERNEL_ISA)
    if rc != 0:
        raise RuntimeError(f"dsv3_int4_quantize failed ({rc})")
    return qweight, scales, zeros


def int4_quantize(w: torch.Tensor, group_size: int = 128, clip_search: bool | ClipSearch = True,
                  scale_inv: torch.Tensor | None = None, use_kernel: bool = True):
    """w [N, K] float -> (qweight uint8 [N, Kp/2], scales float16 [N, Kp/g], zeros float16 [N, Kp/g]).

    `clip_search`: True for CLIP_SEARCH, False for plain min/max ranges, or a ClipSearch. With `scale_inv`
    (an FP8 checkpoint's block grid), w is float8_e4m3fn, dequantized here the project's one way
    (quant.fp8.fp8_block_dequant), so the result equals quantizing the dequantized matrix.
    On the CPU (fp32, bf16, fp16 or FP8 sources, the group sizes of GROUP_SIZES) the compiled kernel runs where
    there is one, on torch's CPU threads; else, or with use_kernel=False, the twin int4_quantize_ref. Both give
    the same bits (tests/test_int4_kernel.py) except for NaN weights, whose codes neither specifies."""
    if use_kernel:
        search = _search_of(clip_search)
        lib = _kernel_library(w, group_size, scale_inv, search)
        if lib is not None:
            return _int4_quantize_kernel(lib, w, group_size, search, scale_inv)
    return int4_quantize_ref(w, group_size, clip_search, scale_inv)


def int4_quantize_ref(w: torch.Tensor, group_size: int = 128, clip_search: bool | ClipSearch = True,
                      scale_inv: torch.Tensor | None = None):
    """The pure-PyTorch twin of int4_quantize (any device; the definition the kernel follows).

    Every step is elementwise or within one group, and row chunks are independent: the result does not depend
    on the chunking, the thread count or the device (CPU and CUDA round every operation alike; the error sums add
    by halves, _sum_by_halves, not in torch's vector-width-dependent order)."""
    search = _search_of(clip_search)
    n, k = w.shape
    g = group_size
    kp = padded_k(k, g)
    rows = _chunk_rows(n, kp, w.device)
    valid = None
    if kp != k:
        valid = torch.zeros(kp, dtype=torch.float32, device=w.device)
        valid[:k] = 1.0
        valid = valid.view(kp // g, g)
    if scale_inv is None and kp == k and w.dtype == torch.float32:
        wp = w.contiguous()
    else:
        wp = torch.empty(n, kp, dtype=torch.float32, device=w.device)
        wp[:, k:] = 0.0
        for i in range(0, n, rows):              # FP8 blocks dequantized a chunk at a time, in cache
            chunk = w[i:i + rows]
            if scale_inv is not None:
                chunk = fp8_block_dequant(chunk, scale_inv[i // BLOCK:-(-(i + rows) // BLOCK)], torch.float32)
            wp[i:i + rows, :k] = chunk
    wg = wp.view(n, kp // g, g)
    s, z = _search_scale_zero(wg, valid, search, rows)
    qweight = torch.empty(n, kp // g, g // 2, dtype=torch.uint8, device=w.device)
    for i in range(0, n, rows):
        q = _quant_codes(wg[i:i + rows], s[i:i + rows], z[i:i + rows]).to(torch.uint8)   # [r, G, g]
        torch.bitwise_or(q[..., : g // 2], q[..., g // 2:] << 4, out=qweight[i:i + rows])
    return qweight.view(n, kp // 2), s.squeeze(-1).half(), z.squeeze(-1).half()


def int4_unpack_codes(qweight: torch.Tensor, group_size: int) -> torch.Tensor:
    """qweight uint8 [N, Kp/2] -> codes uint8 [N, Kp] in natural k order."""
    n, half = qweight.shape
    g = group_size
    b = qweight.view(n, half * 2 // g, g // 2)
    return torch.cat([b & 0xF, b >> 4], dim=-1).view(n, half * 2)


def int4_dequant(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, k: int,
                 group_size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(q - z) * s in fp32, padding columns dropped -> [N, K] in `dtype`."""
    n = qweight.shape[0]
    q = int4_unpack_codes(qweight, group_size).float().view(n, -1, group_size)
    w = (q - zeros.float().unsqueeze(-1)) * scales.float().unsqueeze(-1)
    return w.view(n, -1)[:, :k].to(dtype).contiguous()


class Int4Format(ExpertFormat):
    """Per matrix: `qweight` uint8 [N, Kp/2], `scales` and `zeros` float16 [N, Kp/g]."""
    name = "int4"

    @classmethod
    def create(cls, group_size: int | None = None) -> "Int4Format":
        return cls(group_size or 128)

    @property
    def label(self) -> str:
        return f"int4 (group {self.group_size})"

    def __init__(self, group_size: int = 128, clip_search: bool = True) -> None:
        super().__init__()
        if group_size not in GROUP_SIZES:
            raise UserError(f"int4 group size must be one of {', '.join(map(str, GROUP_SIZES))}, got {group_size}")
        self.group_size = group_size
        self.clip_search = clip_search  # False: plain min/max ranges (quantize --fast)

    def _parts(self, n: int, k: int):
        kp = padded_k(k, self.group_size)
        groups = kp // self.group_size
        return [("qweight", "uint8", (n, kp // 2)), ("scales", "float16", (n, groups)),
                ("zeros", "float16", (n, groups))]

    def _quantize(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        qweight, scales, zeros = int4_quantize(w, self.group_size, self.clip_search)
        return {"qweight": qweight, "scales": scales, "zeros": zeros}

    def pack(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
             out: torch.Tensor | None = None) -> torch.Tensor:
        blob = self._pack_by_kernel([(gate, None), (up, None), (down, None)], out)
        return super().pack(gate, up, down, out) if blob is None else blob

    def _pack_by_kernel(self, weights, out: torch.Tensor | None) -> torch.Tensor | None:
        """The blob with each matrix quantized by the compiled kernel straight into its place (the bytes _write
        gives: gaps zero), or None where the kernel cannot take all three."""
        (gate, _), (up, _), (down, _) = weights
        search = _search_of(self.clip_search)
        if (gate.dim() != 2 or gate.shape != up.shape or tuple(down.shape) != (gate.shape[1], gate.shape[0])
                or any(_kernel_library(w, self.group_size, s, search) is None for w, s in weights)):
            return None
        from ..kernels import cpu_build

        lib = cpu_build.library()
        layout = self.layout(*gate.shape)
        if out is None:
            blob = torch.empty(layout.blob_bytes, dtype=torch.uint8)
        else:
            layout.view(out, next(iter(layout.components)))  # checks dtype, shape, contiguity
            blob = out
        end = 0
        for c in sorted(layout.components.values(), key=lambda c: c.offset):
            blob[end:c.offset].zero_()
            end = c.offset + c.nbytes
        blob[end:].zero_()
        for m, (w, s) in zip(MATRICES, weights):
            views = tuple(layout.view(blob, f"{m}.{part}") for part in ("qweight", "scales", "zeros"))
            _int4_quantize_kernel(lib, w, self.group_size, search, s, out=views)
        return blob

    def pack_fp8(self, weights, out: torch.Tensor | None = None) -> torch.Tensor:
        """Blob from an FP8 checkpoint's (weight, scale_inv) of gate, up and down: the bytes pack() gives for the
        dequantized weights, each row chunk dequantized inside the quantizer (no full-size float copy)."""
        blob = self._pack_by_kernel(weights, out)
        if blob is not None:
            return blob
        gate = weights[0][0]
        parts = {}
        for m, (w, s) in zip(MATRICES, weights):
            qweight, scales, zeros = int4_quantize(w, self.group_size, self.clip_search, scale_inv=s)
            parts[m] = {"qweight": qweight, "scales": scales, "zeros": zeros}
        return self._write(self.layout(*gate.shape), parts, out, gate.device)

    def _dequantize(self, parts, shape, dtype):
        return int4_dequant(parts["qweight"], parts["scales"], parts["zeros"], shape[1], self.group_size, dtype)
