"""MXFP4 expert format: DeepSeek-V4's released routed-expert format, served as released.

Per matrix [N, K], as the checkpoint stores it (docs/dsv4-math.md §5.4), with Kp = K rounded up to 32 (zero
padding; released checkpoints need none):
  codes  uint8 [N, Kp/2]   two e2m1 codes per byte, the LOW nibble the even k (the checkpoint's I8 bytes)
  scales uint8 [N, Kp/32]  one ue8m0 exponent per 32 weights along K: 2^(byte - 127), 0xFF NaN (F8_E8M0 bytes)
  w[n, k] = E2M1[code] * 2^(scales[n, k // 32] - 127), exact in bf16.
A released checkpoint's bytes are repacked into blobs verbatim (`pack_prequantized`), never re-quantized;
`pack` quantizes float weights (V4 Base's FP8 experts, tests). The CPU kernel reads the nibbles and scales
(kernels/cpu_experts.py); on GPUs the fused Triton MoE kernels decode them in registers (kernels/quant_matmul.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .layout import MATRICES, BlobLayout, ExpertFormat

BLOCK = 32                                           # weights per scale along K
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_MAGNITUDES = torch.tensor(E2M1[:8])
_MIDPOINTS = (_MAGNITUDES[1:] + _MAGNITUDES[:-1]) / 2  # rounding boundaries between adjacent magnitudes


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (0..15, any integer dtype) -> float32 values from the bit fields s e1 e0 m: (-1)^s m/2 if e = 0,
    else (-1)^s 2^(e-1) (1 + m/2)."""
    c = codes.to(torch.int32)
    e, m = (c >> 1) & 3, (c & 1).float()
    mag = torch.where(e == 0, m * 0.5, torch.exp2((e - 1).float()) * (1 + m * 0.5))
    return torch.where((c & 8) != 0, -mag, mag)


def ue8m0_decode(exponents: torch.Tensor) -> torch.Tensor:
    """ue8m0 bytes (uint8, or float8_e8m0fnu) -> float32 2^(byte - 127); 0xFF is NaN."""
    b = exponents.view(torch.uint8) if exponents.dtype == torch.float8_e8m0fnu else exponents
    v = torch.ldexp(torch.ones(b.shape, dtype=torch.float32, device=b.device), b.to(torch.int32) - 127)
    return torch.where(b == 255, torch.nan, v)


def ue8m0_encode(scales: torch.Tensor) -> torch.Tensor:
    """float32 powers of two (a decoded ue8m0 grid, as TensorReader returns one) -> their uint8 exponent bytes;
    exact, NaN -> 0xFF. Raises ValueError for a value that is not a power of two in ue8m0's range."""
    s = scales.float()
    mant, exp = torch.frexp(s)
    nan = torch.isnan(s)
    if not bool(((mant == 0.5) & (exp - 1 >= -127) & (exp - 1 <= 127) | nan).all()):
        raise ValueError("MXFP4 scales must be powers of two between 2^-127 and 2^127")
    return torch.where(nan, 255, exp - 1 + 127).to(torch.uint8)


def _as_codes(codes: torch.Tensor) -> torch.Tensor:
    return codes if codes.dtype == torch.uint8 else codes.view(torch.uint8)


def mxfp4_dequant(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes [N, K/2] (uint8 / int8 bytes), scales [N, K/32] (ue8m0 bytes, or float32 powers of two) -> [N, K]."""
    b = _as_codes(codes)
    n = b.shape[0]
    lut = torch.tensor(E2M1, dtype=torch.float32, device=b.device)
    w = torch.stack((lut[(b & 0xF).long()], lut[(b >> 4).long()]), dim=-1).view(n, -1)   # low nibble: even k
    s = scales.float() if scales.dtype == torch.float32 else ue8m0_decode(scales)
    return (w.view(n, -1, BLOCK) * s[..., None]).view(n, -1).to(dtype)


def padded_k(k: int) -> int:
    return -(-k // BLOCK) * BLOCK


def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (codes uint8 [N, Kp/2], scales uint8 [N, Kp/32]), K zero-padded: per block of 32 the
    smallest power-of-two scale with amax / scale <= 6, each value rounded to the nearest e2m1 magnitude (ties to
    the even code)."""
    n, k = w.shape
    kp = padded_k(k)
    w = F.pad(w.float(), (0, kp - k))
    k = kp
    blocks = w.view(n, k // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=-1)
    exp = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.full_like(amax, -127.0)).clamp_(-127, 127)
    scaled = blocks / torch.exp2(exp)[..., None]
    mag = scaled.abs()
    idx = torch.bucketize(mag, _MIDPOINTS.to(w.device))                 # nearest magnitude, ties to the lower
    tie_up = (mag == _MIDPOINTS.to(w.device)[idx.clamp(max=6)]) & (idx % 2 == 1) & (idx < 7)
    idx = (idx + tie_up.long()).clamp_(max=7)                          # a tie goes to the even code
    codes = (idx | ((scaled < 0) & (idx > 0)).long() << 3).view(n, k).to(torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed, (exp + 127).to(torch.uint8)


class Mxfp4Format(ExpertFormat):
    """Per matrix: `codes` uint8 [N, Kp/2] and `scales` uint8 [N, Kp/32] (the released bytes)."""
    name = "mxfp4"
    group_size = BLOCK

    def _parts(self, n: int, k: int):
        return [("codes", "uint8", (n, padded_k(k) // 2)), ("scales", "uint8", (n, padded_k(k) // BLOCK))]

    def _quantize(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        codes, scales = mxfp4_quantize(w)
        return {"codes": codes, "scales": scales}

    def _dequantize(self, parts, shape, dtype):
        return mxfp4_dequant(parts["codes"], parts["scales"], dtype)[:, :shape[1]].contiguous()

    def pack_prequantized(self, gate_codes: torch.Tensor, gate_scales: torch.Tensor, up_codes: torch.Tensor,
                          up_scales: torch.Tensor, down_codes: torch.Tensor, down_scales: torch.Tensor,
                          out: torch.Tensor | None = None) -> torch.Tensor:
        """Blob from a released checkpoint's codes (I8 / uint8 [N, K/2]) and scales (F8_E8M0 / uint8 bytes, or
        float32 powers of two), bytes copied verbatim."""
        if gate_codes.dim() != 2:
            raise ValueError(f"gate: expected 2-d codes [I, D/2], got shape {tuple(gate_codes.shape)}")
        layout: BlobLayout = self.layout(gate_codes.shape[0], gate_codes.shape[1] * 2)     # released: K % 32 == 0
        parts = {}
        for m, c, s in zip(MATRICES, (gate_codes, up_codes, down_codes), (gate_scales, up_scales, down_scales)):
            n, k = layout.matrix_shape(m)
            c = _as_codes(c)
            s = ue8m0_encode(s) if s.dtype == torch.float32 else s.view(torch.uint8)
            kp = padded_k(k)
            if tuple(c.shape) != (n, kp // 2) or tuple(s.shape) != (n, kp // BLOCK):
                raise ValueError(f"{m}: expected codes {(n, kp // 2)} and scales {(n, kp // BLOCK)}, got "
                                 f"{tuple(c.shape)} and {tuple(s.shape)}")
            parts[m] = {"codes": c, "scales": s}
        return self._write(layout, parts, out, gate_codes.device)
