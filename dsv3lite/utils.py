"""Small shared helpers: the one size parser, byte/rate formatting, device and dtype resolution. (torch is imported
where a helper needs it: the command line's help must not wait for it.)"""
from __future__ import annotations

import re
from pathlib import Path

from .errors import UserError

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def parse_size(text: str | int | float) -> int:
    """Bytes from '80G' / '80GiB' (binary, 80*2^30), '80GB' (decimal, 80e9), '512M', '1.5T' or a plain integer."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if text < 0:
            raise UserError(f"size must not be negative: {text}")
        return int(text)
    m = _SIZE_RE.match(str(text))
    if not m:
        raise UserError(f"cannot parse size {text!r}: use e.g. 80G, 80GiB (binary), 80GB (decimal), 512M or a byte count")
    number, unit, suffix = m.group(1), m.group(2).lower(), m.group(3).lower()
    if not unit and suffix == "ib":
        raise UserError(f"cannot parse size {text!r}: 'iB' needs a unit such as K, M, G or T")
    decimal = suffix == "b" and unit != ""
    base = 1000 if decimal else 1024
    return int(float(number) * base ** _POWERS[unit])


def format_bytes(n: float) -> str:
    """1.50 GiB-style rendering (binary units, as nvidia-smi and torch print them)."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def format_count(n: float) -> str:
    """Parameter counts the way model cards print them: 671B, 37.5B, 16.0M."""
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= div:
            return f"{n / div:.1f}{suffix}"
    return str(int(n))


_DTYPES = {
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "float32": "float32", "fp32": "float32", "float": "float32",
}


def resolve_device(device, present: bool = True):
    """'auto' picks CUDA when present; 'cuda' without a GPU is a clear error unless `present` is False (a plan for
    a CUDA run, computed on any machine)."""
    import torch

    name = "auto" if device is None else str(device)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not (name == "cpu" or name == "cuda" or re.fullmatch(r"cuda:\d+", name)):
        raise UserError(f"unknown device {name!r}: use auto, cuda (or cuda:N) or cpu")
    if name.startswith("cuda") and present and not torch.cuda.is_available():
        raise UserError("--device cuda was asked for but no CUDA GPU is available (use --device cpu)")
    return torch.device(name)


def resolve_dtype(dtype, device):
    """Default: bfloat16 on CUDA, float32 on CPU."""
    import torch

    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return getattr(torch, _DTYPES[str(dtype).lower()])
    except KeyError:
        raise UserError(f"unknown dtype {dtype!r}: use bfloat16, float16 or float32") from None


def write_problem(directory) -> str | None:
    """Why files cannot be created in `directory` (made when missing), e.g. "Read-only file system" or "No space
    left on device", found by creating one; None when they can."""
    import tempfile

    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory) as f:
            f.write(b"\0")
            f.flush()
    except OSError as e:
        return e.strerror or str(e)
    return None


def checkpoint_dir(path, what: str):
    """`path` as an existing checkpoint directory (one holding config.json), else a one-line UserError naming
    `what` (e.g. "weights directory", "source checkpoint")."""
    path = Path(path).expanduser()
    if not path.exists():
        raise UserError(f"{what} not found: {path}")
    if not path.is_dir():
        raise UserError(f"the {what} must be a checkpoint directory, got a file: {path}")
    if not (path / "config.json").is_file():
        raise UserError(f"no config.json in {path}: not a checkpoint directory")
    return path


def terminal_bar_fits() -> bool:
    """Whether a progress bar on stderr can be seen: a terminal with a width (a zero-width pseudo-terminal, as
    some job runners give, draws nothing: print lines there)."""
    import os
    import sys

    try:
        return sys.stderr.isatty() and os.get_terminal_size(sys.stderr.fileno()).columns > 0
    except (OSError, ValueError, AttributeError):
        return False


def cache_root():
    """dsv3lite's per-user cache (compiled CPU kernels, converted tokenizers): $DSV3LITE_CACHE_DIR, else
    $XDG_CACHE_HOME/dsv3lite, else ~/.cache/dsv3lite."""
    import os

    root = os.environ.get("DSV3LITE_CACHE_DIR")
    if root:
        return Path(root).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "dsv3lite"
