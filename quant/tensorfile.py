"""Streaming safetensors files: the header is written first, each tensor's bytes later, in place.

`quantize` knows every output shape before it reads a single weight, so it writes the header, sizes the file
and then fills tensors (or single rows of a tensor: one expert's blob) at their offsets, holding
only what it is writing. The files are ordinary safetensors (any reader opens them); the data section
starts on a DATA_ALIGN boundary so a mapped row of blobs keeps the alignment its layout promises.
`read_header` and `tensor_spans` read a file's header back (the absolute byte range of each tensor, for
pread and zero-copy memory maps), with one clear error when a file is damaged.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from math import prod
from pathlib import Path

import torch

from ..errors import UserError

DATA_ALIGN = 4096  # the data section starts on a page boundary (header padded with spaces, as the format allows)

DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E8M0": torch.float8_e8m0fnu,     # ue8m0 scales (DeepSeek-V4): 2^(byte - 127)
    "U8": torch.uint8,
    "I8": torch.int8,
    "I32": torch.int32,
    "I64": torch.int64,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class TensorSpan:
    """Where one tensor's bytes lie in its file (absolute offsets)."""
    dtype: str
    shape: tuple[int, ...]
    start: int
    nbytes: int


def entry_nbytes(dtype: str, shape) -> int:
    return prod(shape) * DTYPES[dtype].itemsize


def build_header(entries: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None = None,
                 align: int = DATA_ALIGN) -> tuple[bytes, dict[str, TensorSpan], int]:
    """(the file's first bytes: length + JSON header, name -> span, total file size) for tensors stored in order."""
    doc, spans, offset = {}, {}, 0
    if metadata:
        doc["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for name, dtype, shape in entries:
        n = entry_nbytes(dtype, shape)
        doc[name] = {"dtype": dtype, "shape": [int(s) for s in shape], "data_offsets": [offset, offset + n]}
        spans[name] = (dtype, tuple(int(s) for s in shape), offset, n)
        offset += n
    raw = json.dumps(doc, separators=(",", ":")).encode()
    pad = -(8 + len(raw)) % align
    raw += b" " * pad
    head = len(raw).to_bytes(8, "little") + raw
    spans = {name: TensorSpan(d, s, len(head) + off, n) for name, (d, s, off, n) in spans.items()}
    return head, spans, len(head) + offset


MAX_HEADER_BYTES = 100 * 2**20


def read_header(path: Path) -> dict:
    """The safetensors header of `path` (name -> {dtype, shape, data_offsets}); a clear error when it is damaged."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ValueError("file is shorter than a safetensors header")
            n = int.from_bytes(raw, "little")
            size = path.stat().st_size
            if n > size - 8 or n > MAX_HEADER_BYTES:
                raise ValueError(f"header length {n} does not fit a {size}-byte file")
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        if 8 + n + end > size:
            raise ValueError(f"truncated: tensors need {8 + n + end} bytes, file has {size}")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"cannot read {path}: {e}") from None
    header.pop("__metadata__", None)
    return header


def tensor_spans(path: Path) -> dict[str, TensorSpan]:
    """name -> absolute span for every tensor of a safetensors file; a clear error when it is damaged."""
    header = read_header(path)
    with open(path, "rb") as f:
        start = 8 + int.from_bytes(f.read(8), "little")
    out = {}
    for name, v in header.items():
        begin, end = v["data_offsets"]
        out[name] = TensorSpan(v["dtype"], tuple(v["shape"]), start + begin, end - begin)
    return out


def _pwrite_all(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view.nbytes:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def tensor_bytes(t: torch.Tensor):
    """A buffer over the raw bytes of `t` (CPU), for writing."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


class TensorFileWriter:
    """A safetensors file being filled in place. `create` writes the header and sizes the file; `reopen`
    continues a file made by `create` with the same entries (it checks the header and size)."""

    def __init__(self, path: Path, fd: int, spans: dict[str, TensorSpan]):
        self.path, self.fd, self.spans = path, fd, spans

    @classmethod
    def create(cls, path: Path, entries, metadata=None) -> "TensorFileWriter":
        head, spans, size = build_header(entries, metadata)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _preallocate(fd, size, path)
            _pwrite_all(fd, head, 0)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, spans)

    @classmethod
    def reopen(cls, path: Path, entries, metadata=None) -> "TensorFileWriter":
        head, spans, size = build_header(entries, metadata)
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as e:
            raise UserError(f"cannot continue {path}: {e.strerror}; start over with --force") from None
        ok = os.fstat(fd).st_size == size and os.pread(fd, len(head), 0) == head
        if not ok:
            os.close(fd)
            raise UserError(f"{path} does not match this run (different source or options, or damaged); "
                            f"start over with --force")
        return cls(path, fd, spans)

    def write(self, name: str, t: torch.Tensor) -> None:
        """Write the whole tensor `name` (dtype and size must match its entry)."""
        span = self.spans[name]
        if DTYPE_NAMES.get(t.dtype) != span.dtype or t.numel() * t.element_size() != span.nbytes:
            raise ValueError(f"{name}: expected {span.dtype} {span.shape}, got {t.dtype} {tuple(t.shape)}")
        if span.nbytes:
            _pwrite_all(self.fd, tensor_bytes(t), span.start)

    def write_row(self, name: str, row: int, data: torch.Tensor) -> None:
        """Write row `row` of a 2-d uint8 tensor `name` (one expert's blob of a [n_experts, blob_bytes] tensor)."""
        span = self.spans[name]
        n_rows, row_bytes = span.shape
        if not 0 <= row < n_rows or data.dtype != torch.uint8 or data.numel() != row_bytes:
            raise ValueError(f"{name}: row {row} of {span.shape} cannot take {data.dtype} {tuple(data.shape)}")
        offset = span.start + row * row_bytes
        _pwrite_all(self.fd, tensor_bytes(data), offset)
        _start_writeback(self.fd, offset, row_bytes)

    def sync(self) -> None:
        os.fsync(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _sync_file_range():
    """libc's sync_file_range (Linux), or None."""
    import ctypes
    import ctypes.util

    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _sync_file_range()
SYNC_FILE_RANGE_WRITE = 2


def _start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Start writing `nbytes` at `offset` to the disk without waiting (a later fsync then finds little left)."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, offset, nbytes, SYNC_FILE_RANGE_WRITE)


def _preallocate(fd: int, size: int, path: Path) -> None:
    """Give the file its final size now (sparse: blocks are allocated as tensors land). posix_fallocate would
    reserve them too, but writes into its unwritten extents ran 3-8x slower here; callers check free space."""
    try:
        os.ftruncate(fd, size)
    except OSError as e:
        raise UserError(f"cannot size {path} to {size:,} bytes: {e.strerror}") from None
