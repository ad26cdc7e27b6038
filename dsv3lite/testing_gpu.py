"""Triton kernels compiled through their real launchers for GPUs this machine does not have (tests, no GPU).

`simulated_gpu(arch)` makes Triton's active driver a stand-in that reports one architecture (sm_80, 86, 89 or 90)
and makes `kernels.dispatch` report that GPU's compute capability and SM count. A launcher then runs as it would on
that GPU: it picks its blocks, warps, stages, fp8 decode and split counts, and Triton specializes, compiles (PTX,
ptxas) and checks shared memory against the architecture's limit exactly as at a real launch (OutOfResources, the
error a user would see). Instead of loading the binary the stand-in reads its registers and stack frame (where
spills go) with cuobjdump, and instead of launching it records the launch. Compiled kernels stay in Triton's cache.

    python -m dsv3lite.testing_gpu 86 90     # every case of launcher_cases() on those architectures, JSON lines
    python -m dsv3lite.testing_gpu --warm I N  # on a GPU: its cases, shard I of N, run (Triton's cache filled)
    python -m dsv3lite.testing_gpu --list      # how many cases each architecture compiles

Needs Triton's NVIDIA backend (ptxas and cuobjdump ship with it) and no TRITON_INTERPRET.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import traceback
from dataclasses import dataclass


@dataclass(frozen=True)
class Arch:
    """What a launcher and Triton ask of a GPU: the opt-in shared memory per block and the SM count."""
    name: str
    shared: int         # bytes of shared memory one block may use (cudaDevAttrMaxSharedMemoryPerBlockOptin)
    sms: int


ARCHS = {80: Arch("A100", 166_912, 108), 86: Arch("RTX 3090 / A6000", 101_376, 82),
         89: Arch("RTX 4090 / L40", 101_376, 128), 90: Arch("H100 / H200", 232_448, 132)}
REGISTERS_PER_SM = 65536


def resource_usage(cubin: bytes) -> dict:
    """{'regs', 'stack', 'local'} of the one function in a cubin, read with cuobjdump -res-usage (a stack
    frame or local memory in these kernels means register spills)."""
    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([knobs.nvidia.cuobjdump.path, "-res-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", text)
    assert found, f"cuobjdump gave no resource line:\n{text}"
    regs, stack, _, local = map(int, found.groups())
    return dict(regs=regs, stack=stack, local=local)


def max_threads(regs: int) -> int:
    """Threads a block of this kernel may have: registers are given out per warp, 8 per thread at a time."""
    per_warp = -(-max(regs, 1) // 8) * 8 * 32
    return min(1024, REGISTERS_PER_SM // per_warp * 32)


class _Utils:
    def __init__(self, gpu: "SimulatedGPU"):
        self.gpu = gpu

    def get_device_properties(self, device):
        a = self.gpu.arch
        return {"max_shared_mem": a.shared, "multiprocessor_count": a.sms, "max_num_regs": REGISTERS_PER_SM,
                "warpSize": 32, "sm_clock_rate": 1, "mem_clock_rate": 1, "mem_bus_width": 1}

    def load_binary(self, name, cubin, shared, device):
        usage = resource_usage(cubin)
        self.gpu.loaded.append(usage)
        return None, None, usage["regs"], usage["stack"] + usage["local"], max_threads(usage["regs"])


class SimulatedGPU:
    """The stand-in driver (see the module docstring). `launches`: one dict per kernel launch."""

    def __init__(self, cc: int):
        from triton.backends.compiler import GPUTarget

        self.cc, self.arch = cc, ARCHS[cc]
        self.target = GPUTarget("cuda", cc, 32)
        self.utils = _Utils(self)
        self.loaded: list[dict] = []
        self.launches: list[dict] = []

    # the driver calls Triton's JIT makes
    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return self.cc          # one device index per architecture: Triton keeps a kernel cache per device

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        import torch
        return torch.device("cpu")

    def launcher_cls(self, src, metadata):
        # called when a compiled kernel is first launched, right before load_binary (which the shared-memory
        # check may pre-empt)
        kernel = dict(kernel=src.fn.__name__, num_warps=metadata.num_warps, num_stages=metadata.num_stages,
                      shared=metadata.shared, constexprs=_named(src))
        loaded = self.loaded

        def launch(grid_0, grid_1, grid_2, *_):
            usage = loaded[index] if index < len(loaded) else {}
            self.launches.append(dict(kernel, **usage, grid=[grid_0, grid_1, grid_2]))
        index = len(loaded)
        return launch


def _named(src) -> dict:
    """A compiled kernel's constexprs by argument name (Triton keys them by argument position)."""
    names = src.fn.arg_names
    return {names[k[0]] if isinstance(k, tuple) and len(k) == 1 else str(k): v for k, v in src.constants.items()
            if isinstance(v, (int, float, str, bool))}


@contextlib.contextmanager
def simulated_gpu(cc: int):
    """Launches inside run as on an sm_`cc` GPU (see the module docstring); yields the SimulatedGPU."""
    from unittest import mock

    from triton.runtime import driver

    from .kernels import dispatch

    gpu = SimulatedGPU(cc)
    previous = driver._active             # None here: no GPU, so no default driver to go back to
    driver.set_active(gpu)
    try:
        with mock.patch.object(dispatch, "capability", lambda device: (cc // 10, cc % 10)), \
                mock.patch.object(dispatch, "sm_count", lambda device: gpu.arch.sms):
            yield gpu
    finally:
        driver._active = previous


# ------------------------------------------------------------------------------------------------
# The cases: every launcher at DeepSeek-V3 / Kimi-K2 sizes, for each dtype the CLI accepts on CUDA
# ------------------------------------------------------------------------------------------------

DTYPES = ("bfloat16", "float16", "float32")
V3 = dict(hidden=7168, inter=2048, top_k=8, heads=128, kv_lora_rank=512, rope_dim=64)
KIMI_HEADS = 64           # Kimi-K2: V3's widths with 64 heads; its released experts are int4g32
# DeepSeek-V4-Flash: mxfp4 routed experts with the SwiGLU clamp, MQA attention over 512-wide rows (V4-Pro: 128
# heads, 1,024 top-k)
V4 = dict(hidden=4096, inter=2048, top_k=6, heads=64, head_dim=512, window=128, index_topk=512, swiglu_limit=10.0,
          index_heads=64, index_dim=128, rope_dim=64)
MOE_FORMATS = (("int4", 128), ("int4", 32), ("fp8", 128), ("bf16", 128), ("int4g32", 32))
# (dtype, rows) per weight-reading launcher: batch-1 decode, tensor cores with 16-bit and fp32 x, 2 fp32 rows
DECODE_SHAPES = (("bfloat16", 1), ("float16", 16), ("float32", 16), ("float32", 2))
# every format in DECODE_SHAPES on the smallest shared memory without Triton's fp8 type and on the H200's
# architecture; sm_80 (sm_86's code, more shared memory) and sm_89 (sm_86's limit, native fp8) compile them for the
# formats whose code they change, and a representative of the others (int4 g128 at batch 1; Kimi's int4g32 in
# 16-bit, as Kimi-K2 decodes on Ampere and Ada)
FULL = (86, 90)


def _mla_case(dtype, heads, context, sq=1, index_topk=0):
    def run(device="cpu"):
        import torch

        from .kernels.mla_decode import mla_decode

        dt = getattr(torch, dtype)
        dk = V3["kv_lora_rank"] + V3["rope_dim"]
        q = torch.empty(1, sq, heads, dk, dtype=dt, device=device)
        cache = torch.empty(1, context, dk, dtype=dt, device=device)
        lens = torch.full((1,), context, dtype=torch.int32, device=device)
        indices = torch.zeros(1, sq, index_topk, dtype=torch.int32, device=device) if index_topk else None
        mla_decode(q, cache, lens, 0.1, V3["kv_lora_rank"], indices=indices)
    return run


def _start(value: int, on_device: bool, device):
    """A launch's first position: the int, or (a captured step's launch) one int64 on the device."""
    import torch

    return torch.full((1,), value, dtype=torch.int64, device=device) if on_device else value


def _v4_attention_case(dtype, heads, entries, topk, sq=1, device_start=False):
    """V4 decode attention at V4's widths: the 131-row window ring, `entries` compressed rows (CSA: `topk` picked
    per query; HCA: topk 0, all visible; none: a sliding layer); device_start: the captured step's launch."""
    def run(device="cpu"):
        import torch

        from .kernels.v4_attention import v4_decode_attention

        dt, dim, window = getattr(torch, dtype), V4["head_dim"], V4["window"]
        q = torch.empty(1, sq, heads, dim, dtype=dt, device=device)
        ring = torch.empty(1, window + 3, dim, dtype=dt, device=device)
        ent = torch.empty(1, entries, dim, dtype=dt, device=device) if entries else None
        idx = torch.zeros(1, sq, topk, dtype=torch.int32, device=device) if topk else None
        sink = torch.zeros(heads, dtype=torch.float32, device=device)
        v4_decode_attention(q, ring, _start(128 * entries, device_start, device), window, sink, dim ** -0.5, ent, idx,
                            ratio=4 if topk else 128)
    return run


def _v4_indexer_case(dtype, keys, sq=1, device_start=False):
    """The V4 indexer's scores at decode: 64 heads of 128 over `keys` index keys (a CSA layer at 4 x keys tokens)."""
    def run(device="cpu"):
        import torch

        from .kernels.v4_indexer import index_scores

        dt = getattr(torch, dtype)
        q = torch.empty(1, sq, V4["index_heads"], V4["index_dim"], dtype=dt, device=device)
        weights = torch.empty(1, sq, V4["index_heads"], dtype=torch.float32, device=device)
        index_scores(q, weights, torch.empty(1, keys, V4["index_dim"], dtype=dt, device=device),
                     _start(4 * keys, device_start, device), 4)
    return run


def _v4_compressor_case(dtype, width, ratio, overlap, device_end=False):
    """A V4 compressor's entry at decode: `width` wide (512: the attention's; 128: the indexer's keys) from fp32 rings
    of a window (two with overlap) plus the drafts' rows, written into the last of a 64K-token cache's entries
    (device_end: the captured step's launch, the window found from the step's end on the device)."""
    def run(device="cpu"):
        import torch

        from .kernels.v4_compressor import compress_entry

        rows = ratio * (2 if overlap else 1) + 3
        channels = width * (2 if overlap else 1)
        ring = torch.empty(1, rows, channels, dtype=torch.float32, device=device)
        entries = torch.empty(1, (1 << 16) // ratio, width, dtype=getattr(torch, dtype), device=device)
        tables = torch.empty(V4["rope_dim"] // 2, dtype=getattr(torch, dtype), device=device)
        last = entries.shape[1] - 1
        compress_entry(ring, ring, entries, _start(last * ratio + 1, True, device) if device_end else last, ratio,
                       overlap, torch.empty(width, dtype=torch.float32, device=device), 1e-6, tables, tables,
                       queries=2 if device_end else 0)
    return run


def _gemv_case(dtype, fmt, m, tune=None, n=7168, k=2048):
    def run(device="cpu"):
        import torch

        from .kernels import quant_matmul as qm, tuning
        from .quant.fp8 import scale_grid_shape
        from .quant.int4 import padded_k

        x = torch.empty(m, k, dtype=getattr(torch, dtype), device=device)
        with _trying(tuning, "gemv", tune):
            if fmt == "int4":
                kp = padded_k(k, 128)
                s = torch.empty(n, kp // 128, dtype=torch.float16, device=device)
                qm.w4a16_matmul(x, torch.empty(n, kp // 2, dtype=torch.uint8, device=device), s, torch.empty_like(s),
                                k, 128)
            else:
                qm.w8a16_matmul(x, torch.empty(n, k, dtype=torch.float8_e4m3fn, device=device),
                                torch.empty(scale_grid_shape(n, k), dtype=torch.float32, device=device))
    return run


def _moe_case(dtype, fmt, group, m, launcher="fused_moe", tune=None, model=V3):
    """One MoE launcher at `model`'s sizes (V4's: with its SwiGLU clamp, a constexpr of the gate+up kernels)."""
    def run(device="cpu"):
        import torch

        from .kernels import fused_moe as fm, tuning
        from .quant.formats import get_format

        layout = get_format(fmt, group).layout(model["inter"], model["hidden"])
        slots = 16
        x = torch.empty(m, model["hidden"], dtype=getattr(torch, dtype), device=device)
        ids = torch.stack([torch.randperm(slots)[:model["top_k"]] for _ in range(m)]).to(device)
        weights = torch.empty(m, model["top_k"], dtype=torch.float32, device=device)
        pool = torch.empty(slots, layout.blob_bytes, dtype=torch.uint8, device=device)
        with _trying(tuning, *(tune or (None, None))):
            getattr(fm, launcher)(x, ids, weights, torch.arange(slots, dtype=torch.int32, device=device), pool,
                                  layout, limit=model.get("swiglu_limit"))
    return run


def _trying(tuning, kernel, knobs):
    return tuning.trying(kernel, "rows", knobs) if knobs else contextlib.nullcontext()


def _cases() -> dict:
    """{name: (function, architectures)}"""
    every = tuple(ARCHS)
    cases = {}
    for dt in DTYPES:
        cases[f"mla {dt} V3 4K"] = (_mla_case(dt, V3["heads"], 4096), every)
    for dt in ("bfloat16", "float32"):
        cases[f"mla {dt} V3.2 sparse"] = (_mla_case(dt, V3["heads"], 8192, index_topk=2048), every)
    cases["mla bfloat16 Kimi-K2 128K verify"] = (_mla_case("bfloat16", KIMI_HEADS, 131072, sq=2), every)
    # DeepSeek-V4: a CSA layer at 64K (Flash's top-512 of 16,384 entries), an HCA layer at 1M (8,192 entries), and
    # V4-Pro's 128 heads with its top-1,024 in an MTP verify pass
    for dt in DTYPES:
        cases[f"v4attn {dt} Flash CSA 64K"] = (_v4_attention_case(dt, V4["heads"], 16384, V4["index_topk"]), every)
    cases["v4attn bfloat16 Flash HCA 1M"] = (_v4_attention_case("bfloat16", V4["heads"], 8192, 0), every)
    cases["v4attn bfloat16 Flash sliding"] = (_v4_attention_case("bfloat16", V4["heads"], 0, 0), every)
    for dt in DTYPES:
        cases[f"v4attn indexer {dt} Flash 64K"] = (_v4_indexer_case(dt, 16384), every)
    cases["v4attn indexer bfloat16 Flash 1M verify"] = (_v4_indexer_case("bfloat16", 262144, sq=4), every)
    cases["v4attn indexer float32 Flash 1M"] = (_v4_indexer_case("float32", 262144), every)   # several tiles a program
    cases["v4attn bfloat16 Pro CSA verify"] = (_v4_attention_case("bfloat16", 128, 16384, 1024, sq=4), every)
    # the compressors' entries at decode: CSA's (overlapping, ratio 4), its indexer's keys, HCA's (ratio 128)
    for dt in DTYPES:
        cases[f"v4attn compressor {dt} Flash CSA"] = (_v4_compressor_case(dt, V4["head_dim"], 4, True), every)
        cases[f"v4attn compressor {dt} Flash HCA"] = (_v4_compressor_case(dt, V4["head_dim"], 128, False), every)
    cases["v4attn compressor bfloat16 Flash indexer"] = (_v4_compressor_case("bfloat16", V4["index_dim"], 4, True),
                                                         every)
    # the captured step's launches: positions read on the device, HCA over a 1M-token cache's whole capacity
    for dt in ("bfloat16", "float32"):
        cases[f"v4attn {dt} Flash HCA 1M captured"] = (_v4_attention_case(dt, V4["heads"], 8192, 0,
                                                                          device_start=True), every)
        cases[f"v4attn {dt} Flash CSA captured"] = (_v4_attention_case(dt, V4["heads"], 16384, V4["index_topk"],
                                                                       device_start=True), every)
        cases[f"v4attn indexer {dt} Flash 64K captured"] = (_v4_indexer_case(dt, 16384, device_start=True), every)
        cases[f"v4attn compressor {dt} Flash CSA captured"] = (_v4_compressor_case(dt, V4["head_dim"], 4, True,
                                                                                   device_end=True), every)
    for fmt in ("int4", "fp8"):
        for dt, m in DECODE_SHAPES:
            archs = every if fmt == "fp8" or m == 1 else FULL + (80,)
            cases[f"gemv {fmt} {dt} M={m}"] = (_gemv_case(dt, fmt, m), archs)
    for fmt, group in MOE_FORMATS:
        f = f"{fmt}-g{group}"
        for dt, m in DECODE_SHAPES:
            everywhere = fmt == "fp8" or (fmt, group, m) == ("int4", 128, 1) or (fmt == "int4g32" and dt != "float32")
            archs = every if everywhere else FULL + (80,) * (m == 16)
            cases[f"moe {f} {dt} M={m}"] = (_moe_case(dt, fmt, group, m), archs)
        for dt in ("bfloat16", "float32"):
            archs = every if fmt in ("fp8", "int4") and group == 128 else FULL
            cases[f"grouped {f} {dt}"] = (_moe_case(dt, fmt, group, 64, "fused_moe_grouped"), archs)
    cases["grouped int4-g128 float16"] = (_moe_case("float16", "int4", 128, 64, "fused_moe_grouped"), every)
    # DeepSeek-V4-Flash's mxfp4 experts, clamped: decode and the grouped prefill kernels on every architecture
    for dt, m in DECODE_SHAPES:
        cases[f"moe mxfp4-V4 {dt} M={m}"] = (_moe_case(dt, "mxfp4", 32, m, model=V4), every)
    for dt in DTYPES:
        cases[f"grouped mxfp4-V4 {dt}"] = (_moe_case(dt, "mxfp4", 32, 64, "fused_moe_grouped", model=V4), every)
    # what the GPU suite's sweep times on the H200: each candidate at batch 1, bf16, int4 (the sweep's format); a
    # winner copied into tuning.DEFAULTS is then compiled for every architecture by the cases above
    from .kernels import tuning

    for kernel, candidates in tuning.CANDIDATES.items():
        for knobs in candidates:
            tag = " ".join(f"{k}={v}" for k, v in knobs.items())
            if kernel == "gemv":
                cases[f"sweep gemv {tag}"] = (_gemv_case("bfloat16", "int4", 1, knobs), (90,))
            else:
                cases[f"sweep {kernel} {tag}"] = (_moe_case("bfloat16", "int4", 128, 1, tune=(kernel, knobs)), (90,))
    return cases


def launcher_cases(cc: int | None = None) -> dict:
    """{case name: a function that calls one launcher on CPU tensors of real sizes (never read)}: those compiled for
    sm_`cc` (all when None)."""
    return {name: fn for name, (fn, archs) in _cases().items() if cc is None or cc in archs}


# Launches that are not a launcher's, compiled beside the cases to show that the checks catch what they look for:
# the configuration the MLA decode launcher picked for fp32 before issue 26 (BLOCK_N 32, 2 stages: 112,704 B of
# shared memory), and a kernel that needs more than 255 registers (16 x 512 fp32 values live in one warp).
def _mla_fp32_before_fix(device="cpu"):
    import torch

    from .kernels import mla_decode as mla

    rows, dk, rank = V3["heads"], V3["kv_lora_rank"] + V3["rope_dim"], V3["kv_lora_rank"]
    q, cache = torch.empty(1, rows, dk), torch.empty(1, 4096, dk)
    part = torch.empty(1, rows, 1, rank)
    lse = torch.empty(1, rows, 1)
    mla._mla_decode_split_kernel[(1, rows // 16, 1)](
        q, cache, torch.full((1,), 4096, dtype=torch.int32), q, part, lse, 0.1, rows, rows, 1, rank, dk - rank, 0,
        q.stride(0), dk, cache.stride(0), cache.stride(1), 0, 0, part.stride(0), part.stride(1), part.stride(2),
        lse.stride(0), lse.stride(1), lse.stride(2), BLOCK_H=16, BLOCK_N=32, BLOCK_DL=512, BLOCK_DPE=64,
        SPARSE=False, UPCAST=False, DOT_PRECISION="ieee", num_warps=8, num_stages=2)


def _spilling_kernel(device="cpu"):
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def live_16x512(x_ptr, y_ptr, n):
        offs = tl.arange(0, 16)[:, None] * 512 + tl.arange(0, 512)[None, :]
        acc = tl.load(x_ptr + offs)
        for i in range(n):
            acc = acc * tl.load(x_ptr + offs + i) + tl.sqrt(acc + i)
        tl.store(y_ptr + offs, acc)

    x = torch.empty(16 * 512 + 64)
    live_16x512[(1,)](x, x, 4, num_warps=1)


PROBE_BEFORE_FIX, PROBE_SPILLS = "mla float32 as launched before the fix", "a kernel that spills"
PROBES = {PROBE_BEFORE_FIX: (_mla_fp32_before_fix, (86, 90)), PROBE_SPILLS: (_spilling_kernel, (90,))}


def run_cases(ccs: list[int], names: list[str] | None = None, out=sys.stdout) -> None:
    """Each case (and each probe) compiled for each of `ccs` it names, or those of `names`; one JSON line per
    (case, arch): its launches, or the error it raised."""
    for cc in ccs:
        cases = dict(launcher_cases(cc), **{n: fn for n, (fn, archs) in PROBES.items() if cc in archs})
        with simulated_gpu(cc) as gpu:
            for name in names or cases:
                if name not in cases:
                    continue
                first = len(gpu.launches)
                error = None
                try:
                    cases[name]()
                except Exception as e:                   # noqa: BLE001 (reported per case)
                    error = f"{type(e).__name__}: {e}"[:2000] or traceback.format_exc()[-1500:]
                print(json.dumps(dict(case=name, arch=cc, launches=gpu.launches[first:], error=error)), file=out,
                      flush=True)


def compile_all(ccs: list[int], names: list[str] | None = None, timeout: int = 900) -> list[dict]:
    """run_cases in a fresh interpreter (no TRITON_INTERPRET); its JSON lines parsed."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    cmd = [sys.executable, "-m", "dsv3lite.testing_gpu", *map(str, ccs)]
    if names:
        cmd += ["--cases", ",".join(names)]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    return [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]


def warm(shard: int, shards: int) -> tuple[int, int]:
    """Run this GPU's cases (every case when its architecture has no list) shard `shard` of `shards`, on the GPU:
    their kernels land in Triton's cache, so later launches at these sizes do not compile (the GPU suite runs the
    shards in parallel before it measures). Tensors are uninitialized; nothing is checked. -> (cases run, cases
    that raised: each printed)."""
    import torch

    major, minor = torch.cuda.get_device_capability()
    cc = 10 * major + minor
    cases = launcher_cases(cc if cc in ARCHS else None)
    names = sorted(cases)[shard::shards]
    failed = 0
    for name in names:
        try:
            cases[name]("cuda")
            torch.cuda.synchronize()
        except Exception as e:                           # noqa: BLE001 (reported; the other cases still run)
            failed += 1
            print(f"failed: {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    return len(names) - failed, failed


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--warm"]:
        ran, failed = warm(int(args[1]), int(args[2]))
        print(f"warmed {ran} cases" + (f", {failed} failed" if failed else ""))
        sys.exit(1 if failed else 0)
    if args[:1] == ["--list"]:
        for cc in ARCHS:
            print(f"sm_{cc}: {len(launcher_cases(cc))} cases")
        sys.exit(0)
    names = None
    if "--cases" in args:
        i = args.index("--cases")
        names = args[i + 1].split(",")
        del args[i:i + 2]
    run_cases([int(a) for a in args], names)
