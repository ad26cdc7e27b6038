"""Routed-expert storage formats: the registry. A format is one module (a class deriving from
`layout.ExpertFormat`) plus one line in quant/table.py's FORMAT_TABLE (which also holds what the kernels know of
it); the CLI's choices come from FORMATS.
"""
from __future__ import annotations

import importlib

from ..errors import UserError
from .bf16 import Bf16Format
from .fp8 import Fp8Format
from .int4 import Int4Format
from .layout import ALIGN, BlobLayout, Component, ExpertFormat, swiglu_ref
from .nf4 import Nf4Format
from .table import FORMAT_TABLE, FORMATS

FORMAT_CLASSES: dict[str, type[ExpertFormat]] = {
    name: getattr(importlib.import_module(f"{__package__}.{entry.module}"), entry.cls)
    for name, entry in FORMAT_TABLE.items()}


def get_format(name: str, group_size: int | None = None) -> ExpertFormat:
    """The expert format called `name` (one of FORMATS); `group_size` applies where the format has one."""
    cls = FORMAT_CLASSES.get(name)
    if cls is None:
        raise UserError(f"unknown expert format {name!r}: use one of {', '.join(FORMATS)}")
    return cls.create(group_size)


def format_for_layout(layout: BlobLayout) -> ExpertFormat:
    """The format that reads blobs of `layout` (e.g. one loaded from a manifest)."""
    return get_format(layout.format, layout.group_size)


__all__ = ["ALIGN", "FORMATS", "FORMAT_CLASSES", "BlobLayout", "Bf16Format", "Component", "ExpertFormat",
           "Fp8Format", "Int4Format", "Nf4Format", "format_for_layout", "get_format", "swiglu_ref"]
