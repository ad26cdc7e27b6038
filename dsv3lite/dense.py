"""Non-expert weights in a packed format (`--dense int8|int4|fp8|bf16`): the model's nn.Linear modules (attention
projections, dense MLPs, shared experts, lm_head, MTP eh_proj) become `PackedLinear` ones computed from the packed
bytes, so a decode step reads about as many bytes as a llama.cpp Q4 / Q8 file, and on a GPU the non-expert weights
of DeepSeek-V3 leave room for expert slots on a 24 GB card.

One vocabulary with `quantize --dense` (which stores bf16 or an FP8 source's fp8 tensors) and one packing per
dtype: bf16 is a cast, fp8 quant.fp8's 128x128 block quantizer, int4 quant.int4's group quantizer (group 128, with
its clipping search), int8 quant.int8's symmetric quantizer (per group of 128). The layouts are the same on every
device; what computes them (`packed_matmul`) depends on where they live:
  CPU   kernels/cpu_linear.py (the compiled kernel or its twin), every format;
  GPU   M <= DECODE_ROWS rows: the W8A16 (fp8) / W4A16 (int4) kernels of kernels/quant_matmul.py (their twins where
        kernels do not run); more rows (prefill): the twins (dequantize, matmul) over row chunks of the weight, so
        the dequantized temporary stays small; bf16 a plain matmul. int8 has no GPU kernel: a UserError.
The Loader packs each weight as it reads it (`Loader(dense=...)`, via `PackedLinear.from_weight`), so the model
never holds the float copy of all of them; an FP8 checkpoint's weights with `--dense fp8` keep the checkpoint's
own bytes and block scales (no dequantize / requantize round trip). `pack_dense` packs an already loaded model.
Kept as they are: the routers (fp32), norms, embeddings (one row read per token), and the Linear modules whose
weight the model reads directly (`KEEP`: MLA's wkv_b, absorbed into the latent attention; V3.2's fp32
weights_proj).
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

from .errors import UserError
from .footprint import DENSE_DTYPES
from .kernels.cpu_experts import MAX_GROUPS
from .kernels.cpu_linear import GROUP, linear_forward
from .quant.fp8 import BLOCK as FP8_BLOCK
from .utils import format_bytes

KEEP = ("wkv_b", "weights_proj")                    # nn.Linear attributes whose .weight the model reads itself
GPU_DENSE = ("fp8", "int4", "bf16")                 # the --dense dtypes with a GPU path (int8: CPU only)
DECODE_ROWS = 16                                    # up to this many rows: the W8A16 / W4A16 kernels
CHUNK_ELEMENTS = 1 << 22                            # weight elements per row chunk dequantized (prefill) or packed


def check_dense(dense: str | None, device: torch.device) -> None:
    """UserError for a dense dtype this run cannot use."""
    if dense is None:
        return
    if dense not in DENSE_DTYPES:
        raise UserError(f"unknown dense dtype {dense!r}: use one of {', '.join(DENSE_DTYPES)}")
    if device.type == "cpu":
        return
    if device.type != "cuda":
        raise UserError(f"--dense {dense} packs the non-expert weights for the CPU or CUDA kernels; on "
                        f"{device.type} they stay in --dtype (drop --dense, or run with --device cpu)")
    if dense not in GPU_DENSE:
        raise UserError(f"--dense {dense} has no GPU kernel: on cuda use --dense {' | '.join(GPU_DENSE)} "
                        f"(int8 runs with --device cpu)")


def backend_for(device: torch.device) -> str:
    """'cpu' (kernels/cpu_linear.py) for weights on the CPU, else 'gpu' (kernels/quant_matmul.py)."""
    return "cpu" if torch.device(device).type == "cpu" else "gpu"


def chunk_rows(k: int) -> int:
    """Rows of a [N, K] weight per chunk: about CHUNK_ELEMENTS elements, a multiple of fp8's 128-row blocks."""
    return max(FP8_BLOCK, CHUNK_ELEMENTS // max(k, 1) // FP8_BLOCK * FP8_BLOCK)


# --- packing ---------------------------------------------------------------------------------------------

def _rows(w: torch.Tensor, scale_inv: torch.Tensor | None, r0: int, r1: int, device, value_dtype) -> torch.Tensor:
    """Rows r0:r1 of w on `device` as the model would hold them: an FP8 source dequantized (bf16, the project's one
    FP8 dequantization), then rounded to value_dtype (None: as they are). r0 is a multiple of 128."""
    part = w[r0:r1].to(device)
    if scale_inv is not None:
        from .quant.fp8 import fp8_block_dequant

        part = fp8_block_dequant(part, scale_inv[r0 // FP8_BLOCK:-(-r1 // FP8_BLOCK)].to(device), torch.bfloat16)
    return part if value_dtype is None else part.to(value_dtype)


def _pack_values(v: torch.Tensor, dtype: str) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    from .quant.fp8 import fp8_block_quantize
    from .quant.int4 import int4_quantize
    from .quant.int8 import int8_quantize

    v = v.detach().float()
    if dtype == "bf16":
        return v.to(torch.bfloat16).contiguous(), None, None
    if dtype == "fp8":
        q, s = fp8_block_quantize(v)
        return q.contiguous(), s.contiguous(), None
    if dtype == "int4":
        q, s, z = int4_quantize(v, GROUP)
        return q.contiguous(), s.contiguous(), z.contiguous()
    if dtype == "int8":
        q, s = int8_quantize(v)
        return q.contiguous(), s.contiguous(), None
    raise UserError(f"unknown dense dtype {dtype!r}: use one of {', '.join(DENSE_DTYPES)}")


def pack_weight(w: torch.Tensor, dtype: str, scale_inv: torch.Tensor | None = None, *,
                value_dtype: torch.dtype | None = None, device=None
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(weight, scale, zero) of one [N, K] matrix in `dtype` on `device` (default: w's), the layout kernels/cpu_linear.py
    and kernels/quant_matmul.py read.

    w is a float matrix, or an FP8 checkpoint's float8_e4m3fn one with its block `scale_inv`: with dtype fp8 its
    bytes and scales are kept as they are; else it is dequantized as the loader does. value_dtype: the dtype the
    model would hold the weight in (its compute dtype), applied before packing, so the result equals packing the
    loaded model's weight. Rows go to `device` and are packed a chunk (`chunk_rows`) at a time: every packing is
    row-local (fp8 per 128-row block), so the result does not depend on the chunking."""
    device = w.device if device is None else torch.device(device)
    if scale_inv is not None and dtype == "fp8":
        return w.to(device).contiguous(), scale_inv.to(device=device, dtype=torch.float32).contiguous(), None
    n = w.shape[0]
    rows = chunk_rows(w.shape[1])
    if n <= rows:
        return _pack_values(_rows(w, scale_inv, 0, n, device, value_dtype), dtype)
    out = None
    for r0 in range(0, n, rows):
        got = _pack_values(_rows(w, scale_inv, r0, min(n, r0 + rows), device, value_dtype), dtype)
        if out is None:     # component 1 of fp8 is the block grid: one row per 128 weight rows
            out = [None if t is None else torch.empty((-(-n // FP8_BLOCK) if dtype == "fp8" and i == 1 else n,
                                                       *t.shape[1:]), dtype=t.dtype, device=t.device)
                   for i, t in enumerate(got)]
        for i, t in enumerate(got):
            if t is not None:
                at = r0 // FP8_BLOCK if dtype == "fp8" and i == 1 else r0
                out[i][at:at + t.shape[0]].copy_(t)
    return tuple(out)


# --- computing ---------------------------------------------------------------------------------------------

def _matmul_rows(x: torch.Tensor, fmt: str, weight, scale, zero, r0: int, r1: int, kernel: bool) -> torch.Tensor:
    """x [M, K] @ W[r0:r1]^T on the GPU path: the format's kernel (`*_auto`: the twin where kernels do not run) or
    its twin (dequantize the rows, matmul). r0 is a multiple of 128."""
    from .kernels import quant_matmul as qm

    if fmt == "fp8":
        s = scale[r0 // FP8_BLOCK:-(-r1 // FP8_BLOCK)]
        return (qm.w8a16_matmul_auto if kernel else qm.w8a16_matmul_ref)(x, weight[r0:r1], s)
    if fmt == "int4":
        fn = qm.w4a16_matmul_auto if kernel else qm.w4a16_matmul_ref
        return fn(x, weight[r0:r1], scale[r0:r1], zero[r0:r1], x.shape[1], GROUP)
    if fmt == "bf16":
        return F.linear(x, weight[r0:r1].to(x.dtype))
    raise UserError(f"--dense {fmt} has no GPU kernel: on cuda use --dense {' | '.join(GPU_DENSE)} "
                    f"(int8 runs with --device cpu)")


def packed_matmul(x: torch.Tensor, fmt: str, n: int, weight: torch.Tensor, scale: torch.Tensor | None,
                  zero: torch.Tensor | None, backend: str = "cpu") -> torch.Tensor:
    """x [M, K] -> x @ W^T [M, N] in x.dtype for a weight packed by `pack_weight`: the one dispatch of PackedLinear.

    backend 'cpu': kernels/cpu_linear.py. backend 'gpu': M <= DECODE_ROWS, the W8A16 / W4A16 kernel; more rows, the
    twins over row chunks of the weight (a dequantized chunk of about CHUNK_ELEMENTS at a time); a bf16 weight with
    bf16 x, one matmul whatever M."""
    if backend == "cpu":
        return linear_forward(x, fmt, n, weight, scale, zero)
    x = x if x.stride(-1) == 1 else x.contiguous()
    m = x.shape[0]
    if m <= DECODE_ROWS or (fmt == "bf16" and x.dtype == weight.dtype):
        return _matmul_rows(x, fmt, weight, scale, zero, 0, n, kernel=True)
    rows = chunk_rows(x.shape[1])
    if n <= rows:
        return _matmul_rows(x, fmt, weight, scale, zero, 0, n, kernel=False)
    y = x.new_empty(m, n)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        y[:, r0:r1] = _matmul_rows(x, fmt, weight, scale, zero, r0, r1, kernel=False)
    return y


class PackedLinear(nn.Module):
    """A bias-free nn.Linear whose weight is packed (int8 / int4 / fp8 / bf16), computed by `packed_matmul`:
    the CPU kernel for weights on the CPU, the W8A16 / W4A16 kernels for weights on a GPU (backend 'gpu'; tests
    run that path on CPU tensors, the kernels in Triton's interpreter)."""

    def __init__(self, dtype: str, in_features: int, out_features: int, weight: torch.Tensor,
                 scale: torch.Tensor | None, zero: torch.Tensor | None, backend: str | None = None):
        super().__init__()
        self.backend = backend or backend_for(weight.device)
        if self.backend == "gpu":
            check_dense(dtype, torch.device("cuda"))
        self.fmt, self.in_features, self.out_features = dtype, in_features, out_features
        self.register_buffer("packed", weight, persistent=False)
        self.register_buffer("scale", scale, persistent=False)
        self.register_buffer("zero", zero, persistent=False)

    @classmethod
    def from_weight(cls, w: torch.Tensor, dtype: str, scale_inv: torch.Tensor | None = None, *,
                    value_dtype: torch.dtype | None = None, device=None, backend: str | None = None) -> "PackedLinear":
        """From one [N, K] weight (float, or an FP8 checkpoint's with its scale_inv): see pack_weight."""
        device = w.device if device is None else torch.device(device)
        backend = backend or backend_for(device)
        if backend == "gpu":
            check_dense(dtype, torch.device("cuda"))       # before any packing work
        return cls(dtype, w.shape[1], w.shape[0],
                   *pack_weight(w, dtype, scale_inv, value_dtype=value_dtype, device=device), backend=backend)

    @classmethod
    def from_linear(cls, linear: nn.Linear, dtype: str, backend: str | None = None) -> "PackedLinear":
        if linear.bias is not None:
            raise ValueError("PackedLinear has no bias")
        return cls.from_weight(linear.weight.detach(), dtype, backend=backend)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale, self.zero) if t is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [..., in] -> [..., out]
        y = packed_matmul(x.reshape(-1, self.in_features), self.fmt, self.out_features, self.packed, self.scale,
                          self.zero, self.backend)
        return y.view(*x.shape[:-1], self.out_features)

    def cpu_matrix(self):
        """(format, out, in, (weight, scale, zero)) for the CPU kernels' row dots (kernels/cpu_decode.py), or None
        when they cannot read it."""
        parts = (self.packed, self.scale, self.zero)
        if self.backend != "cpu" or -(-self.in_features // GROUP) > MAX_GROUPS \
                or not all(t is None or (t.device.type == "cpu" and t.is_contiguous()) for t in parts):
            return None
        return self.fmt, self.out_features, self.in_features, parts

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.fmt}" + (", gpu" if self.backend == "gpu" else "")


def packable(model: nn.Module, name: str) -> bool:
    """Whether the tensor `name` of `model` is the weight of an nn.Linear that --dense packs (not KEEP, no bias)."""
    mod_name, _, attr = name.rpartition(".")
    if attr != "weight" or mod_name.rpartition(".")[2] in KEEP:
        return False
    try:
        mod = model.get_submodule(mod_name)
    except AttributeError:                  # no such module: the caller reports the name
        return False
    return isinstance(mod, nn.Linear) and mod.bias is None


def pack_dense(model: nn.Module, dtype: str, log=None) -> int:
    """Swap every nn.Linear of `model` (but `KEEP`) for a PackedLinear in `dtype`, in place; returns the bytes of
    the packed weights. The float weights are freed module by module. (The Loader packs while it loads instead:
    Loader(dense=...).)"""
    t0 = time.perf_counter()
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, nn.Linear) and name not in KEEP]
    before = packed = 0
    with torch.no_grad():
        for parent, name, child in targets:
            before += child.weight.numel() * child.weight.element_size()
            new = PackedLinear.from_linear(child, dtype)
            packed += new.nbytes
            setattr(parent, name, new)
    if log is not None:
        log(f"packed {len(targets)} dense weight matrices to {dtype} in {time.perf_counter() - t0:.1f}s: "
            f"{format_bytes(before)} -> {format_bytes(packed)}")
    return packed
