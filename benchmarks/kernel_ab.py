"""The compiled CPU kernels of a git revision against the working tree's: one DeepSeek-V3 routed expert (gate/up
2048x7168, down 7168x2048) per call, batch 1, in alternating calls of the two libraries, weights rotated through
~400 MB so every call reads them from memory.

    python benchmarks/kernel_ab.py --base HEAD~1                 # int4 and bf16 experts, 2 threads
    python benchmarks/kernel_ab.py --base 91c1393 --formats int4,int8,fp8,bf16 --calls 60

Both sources are built with kernels/cpu_build.py's flags into a temporary folder. Prints the median ms per expert of
each and the ratio (base / working tree: above 1 is faster now).
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
D, I = 7168, 2048
ROTATE_BYTES = 400e6


def build(source: bytes, out: Path):
    from dsv3lite.kernels import cpu_build

    src = out.with_suffix(".cpp")
    src.write_bytes(source)
    subprocess.run([cpu_build._compiler(), *cpu_build.FLAGS, "-o", str(out), str(src)], check=True)
    lib = ctypes.CDLL(str(out))           # dsv3_moe alone (a base revision may lack later entry points); a base
    lib.dsv3_moe.restype = ctypes.c_int   # from before its limit and act arguments ignores them
    lib.dsv3_moe.argtypes = cpu_build.MOE_ARGTYPES
    return lib


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="HEAD", help="git revision of the kernels to compare against")
    ap.add_argument("--formats", default="int4,bf16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=40, help="calls of each library per format")
    args = ap.parse_args()
    from dsv3lite.kernels import cpu_experts
    from dsv3lite.quant.formats import get_format

    torch.set_num_threads(args.threads)
    def at_base(path: Path) -> bytes:                   # a source file at the base revision (absent: empty)
        git = subprocess.run(["git", "show", f"{args.base}:{path.relative_to(ROOT)}"], cwd=ROOT, capture_output=True)
        return git.stdout if git.returncode == 0 else b""

    from dsv3lite.kernels import cpu_build

    with tempfile.TemporaryDirectory() as tmp:
        libs = {args.base: build(cpu_build.source_bytes(at_base), Path(tmp) / "base.so"),
                "working tree": build(cpu_build.source_bytes(), Path(tmp) / "new.so")}
        print(f"| format | {args.base} ms | working tree ms | ratio |\n|---|---|---|---|")
        for name in args.formats.split(","):
            fmt = get_format(name)
            layout = fmt.layout(I, D)
            torch.manual_seed(0)
            blob = fmt.pack(*(torch.randn(*s, dtype=torch.bfloat16) * 0.02 for s in ((I, D), (I, D), (D, I))))
            n = max(2, int(ROTATE_BYTES // layout.blob_bytes))
            pool = blob[None].repeat(n, 1).contiguous()
            ptrs, desc = cpu_experts.blob_pointers(pool, n, layout), cpu_experts.layout_desc(layout)
            x, out = torch.randn(1, D), torch.empty(1, D)
            ids, weights = torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, 1)
            times = {k: [] for k in libs}
            e = 0
            for _ in range(args.calls):
                for label, lib in libs.items():
                    ids[0, 0], e = e, (e + 1) % n
                    t0 = time.perf_counter()
                    lib.dsv3_moe(x.data_ptr(), 1, ids.data_ptr(), weights.data_ptr(), 1, ptrs.data_ptr(), n,
                                 desc.data_ptr(), out.data_ptr(), 0, 0, float("inf"), 0)
                    times[label].append(time.perf_counter() - t0)
            old, new = (statistics.median(times[k]) * 1e3 for k in libs)
            print(f"| {name} | {old:.2f} | {new:.2f} | {old / new:.2f}x |")


if __name__ == "__main__":
    main()
