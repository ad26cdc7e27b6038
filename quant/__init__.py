"""Routed-expert storage formats (one line each in table.py): one contiguous blob per expert. The names below load
on first use, so that `quant.table` (the formats' table, the command line's choices) imports without torch."""
from .table import FORMATS  # noqa: F401

_LAZY = {"get_format": "formats", "format_for_layout": "formats", "BlobLayout": "layout", "Component": "layout",
         "ExpertFormat": "layout"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
