"""The compiled CPU kernels (kernels/csrc/cpu_kernels.cpp): built at first use, cached per user, or absent.

`library()` compiles the source once with the C++ compiler found on PATH (g++, c++ or clang++; $CXX first) into
~/.cache/dsv3lite/cpu_kernels/<hash>/ ($DSV3LITE_CACHE_DIR or $XDG_CACHE_HOME move it) and loads it with ctypes:
plain C entry points, no torch headers, so a build takes seconds and never needs ninja. Where that cannot work (no
compiler, no AVX2/FMA/F16C, a failed build) it returns None after one line on stderr, and callers run their
pure-PyTorch twins; `pip install` never compiles anything. DSV3LITE_CPU_KERNELS=ref forces the twins (read at
each call, so tests can switch it).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from . import cpu_abi

# one translation unit: the later files use the first's internals (its row kernels, activations, threads)
SOURCES = tuple(Path(__file__).with_name("csrc") / name for name in ("cpu_kernels.cpp", "cpu_v4.cpp"))
# -ffp-contract=off: the kernels' only fused multiply-adds are the written ones (their twins' rounding steps);
# -fno-trapping-math: float compares and selects may be vectorized (no value changes: exceptions are never enabled)
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fno-trapping-math", "-fopenmp", "-fPIC",
         "-shared", "-std=c++17")
# the int4 quantizer also has an AVX-512 build of its code, run where the CPU has AVX-512 (the same bits); a compiler
# that refuses its target attribute gets this define and builds the AVX2 code alone
NO_AVX512 = ("-DDSV3LITE_NO_AVX512",)

_c_i64, _c_int, _c_ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p


def cache_dir() -> Path:
    from ..utils import cache_root

    return cache_root() / "cpu_kernels"


def forced_off() -> bool:
    """True when DSV3LITE_CPU_KERNELS=ref asks for the PyTorch twins."""
    return os.environ.get("DSV3LITE_CPU_KERNELS", "").strip().lower() == "ref"


def _cpu_supported() -> str | None:
    """Why this CPU cannot run the kernels, or None."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the kernels are x86-64 AVX2 code, this is {platform.machine()}"
    try:
        import torch
        capability = torch.backends.cpu.get_cpu_capability()
    except Exception:                                    # older torch: trust the flags in /proc/cpuinfo
        capability = None
    if capability is not None:
        return None if capability.startswith("AVX2") or capability.startswith("AVX512") else \
            f"the CPU lacks AVX2 (torch reports {capability})"
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return "cannot tell whether the CPU has AVX2"
    missing = [f for f in ("avx2", "fma", "f16c") if f not in flags]
    return f"the CPU lacks {', '.join(missing)}" if missing else None


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _build(compiler: str, source: bytes, out: Path) -> None:
    """Compile `source` (the bytes the cache key was made from, not the file, which may have changed since)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so.partial")
    os.close(fd)
    src = Path(tmp).with_suffix(".cpp")
    try:
        src.write_bytes(source)
        proc = subprocess.run([compiler, *FLAGS, "-o", tmp, str(src)], capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:   # a compiler without AVX-512 target attributes: the AVX2 code alone
            proc = subprocess.run([compiler, *FLAGS, *NO_AVX512, "-o", tmp, str(src)], capture_output=True,
                                  text=True, timeout=600)
        if proc.returncode != 0:
            lines = (proc.stderr or proc.stdout).strip().splitlines()
            raise RuntimeError(f"{Path(compiler).name} failed: {lines[-1] if lines else proc.returncode}")
        os.replace(tmp, out)                           # atomic: a concurrent build finds a whole library or none
    finally:
        for leftover in (tmp, src):
            if os.path.exists(leftover):
                os.unlink(leftover)


def source_bytes(read=Path.read_bytes) -> bytes:
    """The library's source: SOURCES joined into one translation unit (a #line before each, so compiler messages
    name the file). read(path) -> bytes (benchmarks/kernel_ab.py reads another revision's)."""
    return b"".join(f'#line 1 "{p.name}"\n'.encode() + read(p) + b"\n" for p in SOURCES)


MOE_ARGTYPES = [_c_ptr, _c_i64, _c_ptr, _c_ptr, _c_i64, _c_ptr, _c_i64, _c_ptr, _c_ptr, _c_int, _c_int, ctypes.c_float,
                _c_int]


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.dsv3_moe.restype = _c_int
    lib.dsv3_moe.argtypes = MOE_ARGTYPES
    lib.dsv3_linear.restype = _c_int
    lib.dsv3_linear.argtypes = [_c_ptr, _c_i64, _c_i64, _c_i64, _c_i64, _c_i64, _c_ptr, _c_ptr, _c_ptr, _c_ptr, _c_int]
    lib.dsv3_attention.restype = _c_int
    lib.dsv3_attention.argtypes = [_c_ptr, _c_ptr, _c_ptr, _c_i64, _c_i64, _c_ptr, _c_ptr, _c_ptr, _c_int]
    lib.dsv3_ffn.restype = _c_int
    lib.dsv3_ffn.argtypes = [_c_ptr, _c_ptr, _c_ptr, _c_i64, _c_ptr, _c_ptr, _c_int]
    lib.dsv3_layers.restype = _c_int
    lib.dsv3_layers.argtypes = [_c_i64, _c_ptr, _c_ptr, _c_ptr, _c_ptr, _c_ptr, _c_i64, _c_i64, _c_ptr, _c_i64, _c_ptr,
                                _c_ptr, _c_ptr, _c_ptr, _c_int]
    lib.dsv4_hc_pre.restype = _c_int
    lib.dsv4_hc_pre.argtypes = [_c_ptr, _c_i64, _c_ptr, _c_i64, _c_ptr, _c_ptr, _c_ptr, _c_ptr, _c_int]
    lib.dsv4_attention.restype = _c_int
    lib.dsv4_attention.argtypes = [_c_ptr, _c_ptr, _c_ptr, _c_ptr, _c_i64, _c_i64, _c_int]
    lib.dsv4_ffn.restype = _c_int
    lib.dsv4_ffn.argtypes = [_c_ptr, _c_ptr, _c_ptr, _c_i64, _c_ptr, _c_ptr, _c_ptr, _c_int]
    lib.dsv4_layers.restype = _c_int
    lib.dsv4_layers.argtypes = [_c_i64, _c_ptr, _c_ptr, _c_ptr, _c_ptr, _c_ptr, _c_ptr, _c_i64, _c_i64, _c_ptr, _c_ptr,
                                _c_ptr, _c_int]
    lib.dsv3_fp8_dequant.restype = _c_int
    lib.dsv3_fp8_dequant.argtypes = [_c_ptr, _c_ptr, _c_ptr, _c_i64, _c_i64, _c_int]
    lib.dsv3_int4_quantize.restype = _c_int
    lib.dsv3_int4_quantize.argtypes = [_c_ptr, _c_i64, _c_ptr, _c_i64, _c_i64, _c_i64, _c_int, _c_ptr, _c_i64,
                                       _c_ptr, _c_i64, _c_ptr, _c_ptr, _c_ptr, _c_int, _c_int]
    return lib


@functools.cache
def _load() -> ctypes.CDLL | str:
    """The loaded library, or the reason there is none."""
    why = _cpu_supported()
    if why:
        return why
    compiler = _compiler()
    if compiler is None:
        return "no C++ compiler on PATH (g++, c++ or clang++)"
    try:
        import torch  # noqa: F401  (loaded first: the library's OpenMP then binds to torch's runtime)
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
        source = source_bytes()
        key = hashlib.sha256(source + " ".join(FLAGS).encode() + version.encode()).hexdigest()[:16]
        path = cache_dir() / key / "libdsv3lite_cpu.so"
        if not path.exists():
            print(f"compiling the CPU kernels once (about 10-30 s; kept in {path.parent})", file=sys.stderr,
                  flush=True)
            _build(compiler, source, path)
        lib = _bind(ctypes.CDLL(str(path)))
        why = cpu_abi.mismatch(lib)          # the descriptors' layouts and the format codes, both sides
        return f"{path} does not fit this package: {why}" if why else lib
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        return f"building them failed ({e})"


def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None (twins run): forced off, or unavailable here (said once on stderr)."""
    if forced_off():
        return None
    lib = _load()
    if isinstance(lib, str):
        _notice(lib)
        return None
    return lib


@functools.cache
def _notice(reason: str) -> None:
    print(f"note: CPU kernels unavailable: {reason}; using the PyTorch path (slower)", file=sys.stderr)


def status() -> str:
    """One line for benchmarks and logs: where the library is, or why there is none."""
    if forced_off():
        return "off (DSV3LITE_CPU_KERNELS=ref)"
    lib = _load()
    return f"compiled ({lib._name})" if not isinstance(lib, str) else f"unavailable: {lib}"
