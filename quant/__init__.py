"""Routed-expert storage formats (bf16, fp8, int4, nf4): one contiguous blob per expert."""
from .formats import FORMATS, get_format, format_for_layout  # noqa: F401
from .layout import BlobLayout, Component, ExpertFormat  # noqa: F401
