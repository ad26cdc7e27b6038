"""Routed-expert storage formats: the registry (`get_format`, `FORMATS`) and the bf16 format.

Each format turns one expert's float weights into one aligned uint8 blob and back (see `layout.py`);
fp8, int4 and nf4 live in their own modules.
"""
from __future__ import annotations

import torch

from ..errors import UserError
from .fp8 import Fp8Format
from .int4 import Int4Format
from .layout import ALIGN, BlobLayout, Component, ExpertFormat, swiglu_ref
from .nf4 import Nf4Format

FORMATS = ("bf16", "fp8", "int4", "nf4")


class Bf16Format(ExpertFormat):
    """Per matrix: `weight` bfloat16 [N, K]."""
    name = "bf16"
    group_size = None

    def _parts(self, n: int, k: int):
        return [("weight", "bfloat16", (n, k))]

    def _quantize(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"weight": w.to(torch.bfloat16)}

    def _dequantize(self, parts, shape, dtype):
        return parts["weight"].to(dtype)


def get_format(name: str, group_size: int = 128) -> ExpertFormat:
    """The expert format called `name` ("bf16" | "fp8" | "int4" | "nf4"); `group_size` applies to int4 only."""
    if name == "bf16":
        return Bf16Format()
    if name == "fp8":
        return Fp8Format()
    if name == "int4":
        return Int4Format(group_size)
    if name == "nf4":
        return Nf4Format()
    raise UserError(f"unknown expert format {name!r}: use one of {', '.join(FORMATS)}")


def format_for_layout(layout: BlobLayout) -> ExpertFormat:
    """The format that reads blobs of `layout` (e.g. one loaded from a manifest)."""
    return get_format(layout.format, layout.group_size if layout.format == "int4" else 128)


__all__ = ["ALIGN", "FORMATS", "BlobLayout", "Bf16Format", "Component", "ExpertFormat", "Fp8Format",
           "Int4Format", "Nf4Format", "format_for_layout", "get_format", "swiglu_ref"]
