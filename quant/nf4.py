"""NF4 expert format: bitsandbytes 4-bit NormalFloat, blocksize 64, float32 absmax (no double quantization).

Per matrix [N, K] (flattened row-major, numel = N*K):
  qweight uint8 [ceil(numel/2)]   element 2i in the high nibble of byte i, element 2i+1 in the low nibble
  absmax  float32 [ceil(numel/64)]
w = NF4_CODE[q] * absmax[i // 64] in fp32, then cast. Packing needs bitsandbytes (imported only here, lazily:
the GPU benchmark machine has none); dequantization has a pure-torch twin that matches it bit for bit.
"""
from __future__ import annotations

import torch

from ..errors import UserError
from .layout import BlobLayout, ExpertFormat, MATRICES

BLOCKSIZE = 64

# The 16 NF4 levels (normal-distribution quantiles scaled to [-1, 1]), as float32 values.
NF4_CODE = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)


# bitsandbytes' CPU backend warns at import that an optional kernel package ("pip install kernels") is missing; the
# nf4 format does not use that kernel, so the line only misleads
_QUIET_LOGGERS = ("bitsandbytes.backends.cpu.ops",)


def _bnb():
    import logging

    for name in _QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        import bitsandbytes
        import bitsandbytes.functional
    except ImportError as e:
        raise UserError("the nf4 expert format needs bitsandbytes, which is not installed here: "
                        "install it or use int4 / fp8 experts") from e
    return bitsandbytes


def nf4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (qweight uint8 [ceil(numel/2)], absmax float32 [ceil(numel/64)]) via bitsandbytes."""
    bnb = _bnb()
    q, state = bnb.functional.quantize_4bit(w.float().contiguous(), blocksize=BLOCKSIZE, quant_type="nf4",
                                            compress_statistics=False)
    return q.reshape(-1), state.absmax.float().reshape(-1)


def nf4_dequant(qweight: torch.Tensor, absmax: torch.Tensor, shape: tuple[int, int],
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Pure-torch twin of bitsandbytes' dequantize_4bit for nf4: code[q] * absmax[block] in fp32, then cast."""
    numel = shape[0] * shape[1]
    codes = torch.stack([qweight >> 4, qweight & 0xF], dim=-1).reshape(-1)[:numel]
    table = torch.tensor(NF4_CODE, dtype=torch.float32, device=qweight.device)
    scale = absmax.float().repeat_interleave(BLOCKSIZE)[:numel]
    return (table[codes.long()] * scale).view(shape).to(dtype)


def _quant_state(absmax: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype):
    bnb = _bnb()
    code = torch.tensor(NF4_CODE, dtype=torch.float32, device=absmax.device)
    return bnb.functional.QuantState(absmax=absmax, shape=torch.Size(shape), code=code, blocksize=BLOCKSIZE,
                                     quant_type="nf4", dtype=dtype)


class Nf4Format(ExpertFormat):
    """Per matrix: `qweight` uint8 [ceil(numel/2)] and `absmax` float32 [ceil(numel/64)]; the matrix shape
    comes from the layout (`BlobLayout.matrix_shape`)."""
    name = "nf4"
    group_size = BLOCKSIZE

    def check_available(self) -> None:
        _bnb()

    def _parts(self, n: int, k: int):
        numel = n * k
        return [("qweight", "uint8", (-(-numel // 2),)), ("absmax", "float32", (-(-numel // BLOCKSIZE),))]

    def _quantize(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        qweight, absmax = nf4_quantize(w)
        return {"qweight": qweight, "absmax": absmax}

    def _dequantize(self, parts, shape, dtype):
        return nf4_dequant(parts["qweight"], parts["absmax"], shape, dtype)

    def dequantize_bnb(self, blob: torch.Tensor, dtype: torch.dtype = torch.float32,
                       layout: BlobLayout | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """unpack() through bitsandbytes' own dequantize_4bit (the oracle for the pure-torch twin)."""
        bnb = _bnb()
        layout = self._resolve(blob, layout)
        out = []
        for m in MATRICES:
            shape = layout.matrix_shape(m)
            # blocks run over the flattened matrix: dequantize it as one row (bitsandbytes' CPU kernel blocks
            # each row on its own, which differs when a row is not a whole number of blocks)
            flat = (shape[0] * shape[1],)
            state = _quant_state(layout.view(blob, f"{m}.absmax"), flat, dtype)
            qweight = layout.view(blob, f"{m}.qweight").view(-1, 1)
            out.append(bnb.functional.dequantize_4bit(qweight, state).view(shape))
        return tuple(out)

    def expert_forward(self, blob: torch.Tensor, x: torch.Tensor, layout: BlobLayout | None = None,
                       limit: float | None = None) -> torch.Tensor:
        """SwiGLU through bitsandbytes' matmul_4bit on the packed weights (its own kernels on GPU); with a clamp
        `limit` (swiglu_act), the ref."""
        bnb = _bnb()
        layout = self._resolve(blob, layout)
        if limit is not None or (x.device.type == "cpu" and (layout.hidden % BLOCKSIZE or layout.inter % BLOCKSIZE)):
            # bitsandbytes' CPU kernel blocks each row on its own: rows that are not whole blocks need the twin
            # (and bitsandbytes has no clamp)
            return self.expert_forward_ref(blob, x, layout, limit)

        def linear(inp, m):
            state = _quant_state(layout.view(blob, f"{m}.absmax"), layout.matrix_shape(m), x.dtype)
            return bnb.matmul_4bit(inp, layout.view(blob, f"{m}.qweight").view(-1, 1).t(), quant_state=state)

        return linear(torch.nn.functional.silu(linear(x, "gate")) * linear(x, "up"), "down")

