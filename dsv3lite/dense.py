"""Non-expert weights on the CPU in a packed format (`--dense int8|int4|fp8|bf16`): a pass after loading that
swaps the model's nn.Linear modules (attention projections, dense MLPs, shared experts, lm_head, MTP eh_proj) for
`PackedLinear` ones computed from the packed bytes by kernels/cpu_linear.py, so a decode step reads about as
many bytes as a llama.cpp Q4 / Q8 file.

One vocabulary with `quantize --dense` (which stores bf16 or an FP8 source's fp8 tensors) and one packing per
dtype: bf16 is a cast, fp8 quant.fp8's 128x128 block quantizer, int4 quant.int4's group quantizer (group 128, with
its clipping search), int8 quant.int8's symmetric quantizer (per group of 128). An FP8 checkpoint's dense weights reach the model
dequantized (loader), so `--dense fp8` quantizes those values again (block scales may differ in the last bits).
Kept as they are: the routers (fp32), norms, embeddings (one row read per token), and the Linear modules whose
weight the model reads directly (`KEEP`: MLA's wkv_b, absorbed into the latent attention; V3.2's fp32
weights_proj).
"""
from __future__ import annotations

import time

import torch
from torch import nn

from .errors import UserError
from .footprint import DENSE_DTYPES
from .kernels.cpu_linear import GROUP, linear_forward
from .utils import format_bytes

KEEP = ("wkv_b", "weights_proj")                    # nn.Linear attributes whose .weight the model reads itself


def check_dense(dense: str | None, device: torch.device) -> None:
    """UserError for a dense dtype this run cannot use."""
    if dense is None:
        return
    if dense not in DENSE_DTYPES:
        raise UserError(f"unknown dense dtype {dense!r}: use one of {', '.join(DENSE_DTYPES)}")
    if device.type != "cpu":
        raise UserError(f"--dense {dense} packs the non-expert weights for the CPU kernels; on {device.type} "
                        f"they stay in --dtype (drop --dense, or run with --device cpu)")


def pack_weight(w: torch.Tensor, dtype: str) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(weight, scale, zero) of one [N, K] matrix in `dtype`, the layout kernels/cpu_linear.py reads."""
    from .quant.fp8 import fp8_block_quantize
    from .quant.int4 import int4_quantize
    from .quant.int8 import int8_quantize

    w = w.detach().float().cpu()
    if dtype == "bf16":
        return w.to(torch.bfloat16).contiguous(), None, None
    if dtype == "fp8":
        q, s = fp8_block_quantize(w)
        return q.contiguous(), s.contiguous(), None
    if dtype == "int4":
        q, s, z = int4_quantize(w, GROUP)
        return q.contiguous(), s.contiguous(), z.contiguous()
    if dtype == "int8":
        q, s = int8_quantize(w)
        return q.contiguous(), s.contiguous(), None
    raise UserError(f"unknown dense dtype {dtype!r}: use one of {', '.join(DENSE_DTYPES)}")


class PackedLinear(nn.Module):
    """A bias-free nn.Linear whose weight is packed (int8 / int4 / fp8 / bf16) and computed by the CPU kernel."""

    def __init__(self, dtype: str, in_features: int, out_features: int, weight: torch.Tensor,
                 scale: torch.Tensor | None, zero: torch.Tensor | None):
        super().__init__()
        self.fmt, self.in_features, self.out_features = dtype, in_features, out_features
        self.register_buffer("packed", weight, persistent=False)
        self.register_buffer("scale", scale, persistent=False)
        self.register_buffer("zero", zero, persistent=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, dtype: str) -> "PackedLinear":
        if linear.bias is not None:
            raise ValueError("PackedLinear has no bias")
        return cls(dtype, linear.in_features, linear.out_features, *pack_weight(linear.weight, dtype))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale, self.zero) if t is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [..., in] -> [..., out]
        y = linear_forward(x.reshape(-1, self.in_features), self.fmt, self.out_features, self.packed, self.scale,
                           self.zero)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.fmt}"


def pack_dense(model: nn.Module, dtype: str, log=None) -> int:
    """Swap every nn.Linear of `model` (but `KEEP`) for a PackedLinear in `dtype`, in place; returns the bytes of
    the packed weights. The float weights are freed module by module."""
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
