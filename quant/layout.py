"""Blob layouts for routed experts, and the base class every expert format derives from.

One routed expert (SwiGLU: gate [I, D], up [I, D], down [D, I]) is one contiguous uint8 blob, so it
crosses PCIe in one copy. Kernels read each component at a fixed byte offset by reinterpreting the
uint8 storage, so every offset is a multiple of ALIGN and so is the blob size (rows of a
[n_slots, blob_bytes] pool then stay aligned too).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from math import prod

import torch
import torch.nn.functional as F

from ..layers import swiglu_act     # the SwiGLU (clamped with a limit) every expert path computes

ALIGN = 256                        # bytes; component offsets and blob sizes are multiples of this
MATRICES = ("gate", "up", "down")  # blob order; names of components are f"{matrix}.{part}"

_DTYPES = {
    "uint8": torch.uint8,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
}


def align_up(n: int, alignment: int = ALIGN) -> int:
    return -(-n // alignment) * alignment


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown component dtype {name!r}; known: {', '.join(_DTYPES)}") from None


@dataclass
class Component:
    """One typed array inside a blob: `shape` elements of `dtype` starting at byte `offset`."""
    name: str
    offset: int
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * torch_dtype(self.dtype).itemsize


@dataclass
class BlobLayout:
    """Where each component of one expert lives in its blob. Equal for all experts of a model."""
    format: str                    # "bf16" | "fp8" | "int4" | "int8" | "nf4" | "mxfp4"
    inter: int                     # I: moe_intermediate_size
    hidden: int                    # D: hidden_size
    group_size: int | None         # int4: group along K; fp8: 128 (block edge); nf4: 64 (block); bf16: None
    blob_bytes: int
    components: dict[str, Component] = field(default_factory=dict)

    @classmethod
    def build(cls, format: str, inter: int, hidden: int, group_size: int | None,
              parts: list[tuple[str, str, tuple[int, ...]]]) -> BlobLayout:
        """Place (name, dtype, shape) parts one after another, each at the next ALIGN boundary."""
        components, offset = {}, 0
        for name, dtype, shape in parts:
            comp = Component(name, offset, dtype, tuple(int(s) for s in shape))
            components[name] = comp
            offset = align_up(offset + comp.nbytes)
        return cls(format, inter, hidden, group_size, max(offset, ALIGN), components)

    def matrix_shape(self, matrix: str) -> tuple[int, int]:
        """[out_features, in_features] of gate/up ([I, D]) or down ([D, I])."""
        if matrix not in MATRICES:
            raise ValueError(f"unknown matrix {matrix!r}; expected one of {MATRICES}")
        return (self.hidden, self.inter) if matrix == "down" else (self.inter, self.hidden)

    def view(self, blob: torch.Tensor, name: str) -> torch.Tensor:
        """Typed view (no copy) of component `name` in `blob`: a uint8 [blob_bytes] tensor or a pool row."""
        if blob.dtype != torch.uint8 or blob.dim() != 1 or blob.numel() != self.blob_bytes:
            raise ValueError(f"expected a uint8 blob of shape [{self.blob_bytes}], "
                             f"got {blob.dtype} {tuple(blob.shape)}")
        if blob.stride(0) != 1:
            raise ValueError("blob must be contiguous")
        try:
            comp = self.components[name]
        except KeyError:
            raise KeyError(f"{self.format} blob has no component {name!r}; "
                           f"it has {', '.join(self.components)}") from None
        raw = blob[comp.offset:comp.offset + comp.nbytes]
        return raw.view(torch_dtype(comp.dtype)).view(comp.shape)

    def to_json(self) -> dict:
        return {
            "format": self.format,
            "inter": self.inter,
            "hidden": self.hidden,
            "group_size": self.group_size,
            "blob_bytes": self.blob_bytes,
            "components": {name: {"offset": c.offset, "dtype": c.dtype, "shape": list(c.shape)}
                           for name, c in self.components.items()},
        }

    @classmethod
    def from_json(cls, d: dict) -> BlobLayout:
        components = {name: Component(name, int(c["offset"]), str(c["dtype"]), tuple(int(s) for s in c["shape"]))
                      for name, c in d["components"].items()}
        layout = cls(str(d["format"]), int(d["inter"]), int(d["hidden"]),
                     None if d.get("group_size") is None else int(d["group_size"]),
                     int(d["blob_bytes"]), components)
        layout.check()
        return layout

    def check(self) -> None:
        """Raise ValueError unless offsets and size are aligned, components fit and do not overlap."""
        if self.blob_bytes % ALIGN:
            raise ValueError(f"blob_bytes {self.blob_bytes} is not a multiple of {ALIGN}")
        end = 0
        for c in sorted(self.components.values(), key=lambda c: c.offset):
            torch_dtype(c.dtype)
            if c.offset % ALIGN:
                raise ValueError(f"component {c.name} at offset {c.offset} is not {ALIGN}-byte aligned")
            if c.offset < end:
                raise ValueError(f"component {c.name} overlaps the one before it")
            end = c.offset + c.nbytes
        if end > self.blob_bytes:
            raise ValueError(f"components end at byte {end}, past blob_bytes {self.blob_bytes}")


def swiglu_ref(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
               limit: float | None = None) -> torch.Tensor:
    """down(silu(gate x) * up x) with weights stored [out_features, in_features]; x: [N, D]. limit: see swiglu_act."""
    return F.linear(swiglu_act(F.linear(x, gate), F.linear(x, up), limit), down)


class ExpertFormat:
    """A routed-expert storage format: layout, pack (float -> blob), unpack (blob -> float), reference forward.

    Subclasses define `name`, `group_size`, `_parts(out, in)` (the components of one matrix), `_quantize(w)`
    (float matrix -> {part: tensor}) and `_dequantize(views, shape, dtype)`.
    """
    name: str = ""
    group_size: int | None = None
    fp8_passthrough: bool = False      # packs a DeepSeek FP8 source's bytes and block scales as they are

    @property
    def kernels(self):
        """What the kernels know of this format (quant/table.py's entry)."""
        from .table import FORMAT_TABLE
        return FORMAT_TABLE[self.name]

    @property
    def fused_kernel(self) -> bool:
        """Whether the Triton fused MoE kernel reads this format's blobs from the slot pool."""
        return self.kernels.triton is not None

    @classmethod
    def create(cls, group_size: int | None = None) -> "ExpertFormat":
        """The format with `group_size` where it has one (formats without a group size ignore it)."""
        return cls()

    @property
    def label(self) -> str:
        """How messages name it: "int4 (group 128)", "fp8", ..."""
        return self.name

    def check_available(self) -> None:
        """Raise UserError now if this format cannot run here (a missing library), before any work."""

    def __init__(self) -> None:
        self._layouts: dict[int, list[BlobLayout]] = {}  # blob_bytes -> layouts built, for unpack(blob)

    def _parts(self, n: int, k: int) -> list[tuple[str, str, tuple[int, ...]]]:
        raise NotImplementedError

    def _quantize(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def _dequantize(self, parts: dict[str, torch.Tensor], shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def layout(self, inter: int, hidden: int) -> BlobLayout:
        """Blob layout for an expert with moe_intermediate_size `inter` and hidden_size `hidden`."""
        if inter <= 0 or hidden <= 0:
            raise ValueError(f"expert dims must be positive, got inter={inter} hidden={hidden}")
        parts = []
        for m in MATRICES:
            n, k = (hidden, inter) if m == "down" else (inter, hidden)
            parts += [(f"{m}.{part}", dtype, shape) for part, dtype, shape in self._parts(n, k)]
        layout = BlobLayout.build(self.name, inter, hidden, self.group_size, parts)
        known = self._layouts.setdefault(layout.blob_bytes, [])
        if layout not in known:
            known.append(layout)
        return layout

    def _resolve(self, blob: torch.Tensor, layout: BlobLayout | None) -> BlobLayout:
        if layout is not None:
            if layout.format != self.name or layout.group_size != self.group_size:
                raise ValueError(f"layout is {layout.format} (group {layout.group_size}), "
                                 f"format is {self.name} (group {self.group_size})")
            return layout
        known = self._layouts.get(blob.numel(), [])
        if len(known) != 1:
            raise ValueError(f"cannot tell the expert dims of a {blob.numel()}-byte {self.name} blob: pass layout=")
        return known[0]

    def pack(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """Quantize float weights (gate/up [I, D], down [D, I]) into one uint8 blob on their device.

        `out`: an existing uint8 [blob_bytes] tensor (a pool row, a mapped file) to fill instead.
        """
        if gate.dim() != 2 or gate.shape != up.shape or tuple(down.shape) != (gate.shape[1], gate.shape[0]):
            raise ValueError(f"expected gate/up [I, D] and down [D, I], got {tuple(gate.shape)}, "
                             f"{tuple(up.shape)}, {tuple(down.shape)}")
        layout = self.layout(gate.shape[0], gate.shape[1])
        return self._write(layout, {m: self._quantize(w) for m, w in zip(MATRICES, (gate, up, down))}, out, gate.device)

    def _write(self, layout: BlobLayout, parts: dict[str, dict[str, torch.Tensor]],
               out: torch.Tensor | None, device: torch.device) -> torch.Tensor:
        blob = torch.zeros(layout.blob_bytes, dtype=torch.uint8, device=device) if out is None else out
        if out is not None:
            layout.view(out, next(iter(layout.components)))  # checks dtype, shape, contiguity
            out.zero_()
        for m, tensors in parts.items():
            for part, t in tensors.items():
                view = layout.view(blob, f"{m}.{part}")
                if t.dtype != view.dtype or t.shape != view.shape:
                    raise ValueError(f"{m}.{part}: expected {view.dtype} {tuple(view.shape)}, "
                                     f"got {t.dtype} {tuple(t.shape)}")
                view.copy_(t)
        return blob

    def unpack(self, blob: torch.Tensor, dtype: torch.dtype = torch.float32,
               layout: BlobLayout | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Dequantized dense (gate, up, down) in `dtype`.

        Without `layout`, the layout this format last built for a blob of this size is used.
        """
        layout = self._resolve(blob, layout)
        out = []
        for m in MATRICES:
            views = {name.split(".", 1)[1]: layout.view(blob, name)
                     for name in layout.components if name.startswith(m + ".")}
            out.append(self._dequantize(views, layout.matrix_shape(m), dtype))
        return tuple(out)

    def expert_forward_ref(self, blob: torch.Tensor, x: torch.Tensor, layout: BlobLayout | None = None,
                           limit: float | None = None) -> torch.Tensor:
        """x [N, D] -> down(silu(gate x) * up x) [N, D] in x.dtype, from weights dequantized to x.dtype; limit:
        the SwiGLU clamp (swiglu_act)."""
        gate, up, down = self.unpack(blob, x.dtype, layout)
        return swiglu_ref(x, gate, up, down, limit)

    def expert_forward(self, blob: torch.Tensor, x: torch.Tensor, layout: BlobLayout | None = None,
                       limit: float | None = None) -> torch.Tensor:
        """The fastest path for this format: on CPU the compiled kernel from the packed blob where there is one
        (kernels/cpu_experts.py, its own numerics), else the ref. Formats with a path of their own override this
        (nf4: bitsandbytes)."""
        if x.device.type == "cpu":
            from ..kernels.cpu_experts import expert_forward_cpu

            y = expert_forward_cpu(blob, x, self._resolve(blob, layout), limit)
            if y is not None:
                return y
        return self.expert_forward_ref(blob, x, layout, limit)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(group_size={self.group_size})"
