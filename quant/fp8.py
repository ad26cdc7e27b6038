"""FP8 expert format: e4m3 weights with one float32 scale per 128x128 block (DeepSeek-V3's own format).

The scale is the dequantization multiplier (a checkpoint's `weight_scale_inv`), grid [ceil(N/128), ceil(K/128)].
Dequantization everywhere in the project is bf16(fp32(q) * s[i // 128, j // 128]): one fp32 multiply and
one bf16 rounding, partial edge blocks indexed by floor division; then a cast to the compute dtype.
"""
from __future__ import annotations

import torch

from .layout import BlobLayout, ExpertFormat, MATRICES

BLOCK = 128
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def scale_grid_shape(n: int, k: int) -> tuple[int, int]:
    return (-(-n // BLOCK), -(-k // BLOCK))


def expand_block_scales(s: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """s [ceil(n/128), ceil(k/128)] -> [n, k] with element (i, j) = s[i // 128, j // 128]."""
    return s.repeat_interleave(BLOCK, dim=0)[:n].repeat_interleave(BLOCK, dim=1)[:, :k]


def fp8_block_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (q float8_e4m3fn [N, K], s float32 [ceil(N/128), ceil(K/128)]) with s = amax/448."""
    n, k = w.shape
    w = w.float()
    rb, cb = scale_grid_shape(n, k)
    # zero padding to whole blocks does not change any block's amax
    padded = torch.zeros(rb * BLOCK, cb * BLOCK, dtype=torch.float32, device=w.device)
    padded[:n, :k] = w.abs()
    amax = padded.view(rb, BLOCK, cb, BLOCK).amax(dim=(1, 3))
    s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))  # all-zero block: any scale works
    q = (w / expand_block_scales(s, n, k)).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, s


def e4m3_to_float(q: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn -> float32, exactly as q.float(), by bit arithmetic (torch's own conversion is scalar on CPU,
    about 8x slower): the sign and the 7 exponent-mantissa bits moved into a float16's bits give the value / 256
    (e4m3's subnormals land on float16's), then float32 and an exact * 256."""
    x = q.view(torch.int8).to(torch.int16)     # sign-extended: bits 15..7 are the sign
    x <<= 7
    x &= -16385                                # clear bit 14 (a copy of the sign): s 0eeee mmm 0000000
    w = x.view(torch.float16).float().mul_(256.0)
    if w.numel() == 0:
        return w
    lo, hi = torch.aminmax(w)
    if max(-lo.item(), hi.item()) > FP8_MAX:   # only the NaN codes (0x7f, 0xff) decode past 448 (as 480)
        w = torch.where(w.abs() > FP8_MAX, torch.nan, w)
    return w


def fp8_block_dequant(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """bf16(fp32(q) * s[i // 128, j // 128]) cast to `dtype`; q [N, K] float8_e4m3fn, s float32 block grid. On CPU
    the compiled kernel (kernels/csrc/cpu_kernels.cpp, all cores, the same bits) where there is one, else the twin."""
    n, k = q.shape
    if tuple(s.shape) != scale_grid_shape(n, k):
        raise ValueError(f"scale grid {tuple(s.shape)} does not fit weight {(n, k)}: expected {scale_grid_shape(n, k)}")
    if q.device.type == "cpu" and q.numel():
        from ..kernels import cpu_build

        lib = cpu_build.library()
        if lib is not None:
            qc, sc = q.contiguous(), s.float().contiguous()
            out = torch.empty(n, k, dtype=torch.bfloat16)
            lib.dsv3_fp8_dequant(qc.data_ptr(), sc.data_ptr(), out.data_ptr(), n, k, 0)
            return out if dtype == torch.bfloat16 else out.to(dtype)
    return fp8_block_dequant_ref(q, s, dtype)


def fp8_block_dequant_ref(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The twin of fp8_block_dequant, in PyTorch (any device)."""
    n, k = q.shape
    s = s.float()
    out = torch.empty(n, k, dtype=dtype, device=q.device)
    # one block row at a time on CPU (its fp32 copy stays in cache), the whole matrix at once on a GPU
    rows = BLOCK if q.device.type == "cpu" else n
    for i in range(0, n, rows):
        w = e4m3_to_float(q[i:i + rows])
        r, sr = w.shape[0], s[i // BLOCK:-(-(i + rows) // BLOCK)]
        if k % BLOCK == 0:                     # whole column blocks: each scale broadcast over its block
            w.view(r, k // BLOCK, BLOCK).mul_(sr.repeat_interleave(BLOCK, dim=0)[:r, :, None])
        else:
            w.mul_(expand_block_scales(sr, r, k))
        out[i:i + r] = w if dtype == torch.bfloat16 else w.to(torch.bfloat16)
    return out


class Fp8Format(ExpertFormat):
    """Per matrix: `weight` float8_e4m3fn [N, K] and `scale` float32 [ceil(N/128), ceil(K/128)]."""
    name = "fp8"
    fp8_passthrough = True
    group_size = BLOCK

    def _parts(self, n: int, k: int):
        return [("weight", "float8_e4m3fn", (n, k)), ("scale", "float32", scale_grid_shape(n, k))]

    def _quantize(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        q, s = fp8_block_quantize(w)
        return {"weight": q, "scale": s}

    def _dequantize(self, parts, shape, dtype):
        return fp8_block_dequant(parts["weight"], parts["scale"], dtype)

    def pack_prequantized(self, gate_w: torch.Tensor, gate_s: torch.Tensor, up_w: torch.Tensor, up_s: torch.Tensor,
                          down_w: torch.Tensor, down_s: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Blob from an FP8 checkpoint's weights and scale_inv grids, bytes copied verbatim (never re-quantized)."""
        if gate_w.dim() != 2:
            raise ValueError(f"gate: expected a 2-d weight [I, D], got shape {tuple(gate_w.shape)}")
        layout: BlobLayout = self.layout(*gate_w.shape)
        parts = {}
        for m, w, s in zip(MATRICES, (gate_w, up_w, down_w), (gate_s, up_s, down_s)):
            n, k = layout.matrix_shape(m)
            if w.dtype != torch.float8_e4m3fn or tuple(w.shape) != (n, k):
                raise ValueError(f"{m}: expected float8_e4m3fn weight {(n, k)}, got {w.dtype} {tuple(w.shape)}")
            if s.dtype != torch.float32 or tuple(s.shape) != scale_grid_shape(n, k):
                raise ValueError(f"{m}: expected float32 scale {scale_grid_shape(n, k)}, "
                                 f"got {s.dtype} {tuple(s.shape)}")
            parts[m] = {"weight": w, "scale": s}
        return self._write(layout, parts, out, gate_w.device)
