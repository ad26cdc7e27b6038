"""The MXFP4 CPU expert kernel at DeepSeek-V4-Flash's widths (gate/up 2048x4096, down 4096x2048, 12.75 MiB an
expert): its two activation formats (int8 per 32-block, fp32) side by side, and int4 g128 (the same bytes per
weight) through the existing kernel for scale. One layer's call: 6 distinct experts per token, T tokens; weights
rotated through ~600 MB so every call reads them from memory; the variants alternate call by call.

    python benchmarks/mxfp4_cpu.py                      # T = 1, 4, 32; 2 threads
    python benchmarks/mxfp4_cpu.py --tokens 1 --calls 30

Prints the median ms per call and the weight bytes read per second.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

D, I, K = 4096, 2048, 6
ROTATE_BYTES = 600e6


def pool_of(fmt, n):
    """n distinct-address copies of one random expert blob (the kernel's work does not depend on the values)."""
    torch.manual_seed(0)
    blob = fmt.pack(*(torch.randn(*s) * 0.02 for s in ((I, D), (I, D), (D, I))))
    return blob[None].repeat(n, 1).contiguous()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,4,32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=20, help="calls of each variant per token count")
    args = ap.parse_args()
    from dsv3lite.kernels import cpu_build, cpu_experts
    from dsv3lite.quant.formats import get_format

    torch.set_num_threads(args.threads)
    print(f"# CPU kernels: {cpu_build.status()}; {args.threads} threads")
    variants = {}
    for label, name, act in (("mxfp4, int8 activations", "mxfp4", "int8"),
                             ("mxfp4, fp32 activations", "mxfp4", "fp32"), ("int4 g128", "int4", None)):
        fmt = get_format(name, 128)
        layout = fmt.layout(I, D)
        n = max(K, int(ROTATE_BYTES // layout.blob_bytes))
        pool = pool_of(fmt, n)
        variants[label] = (layout, pool, cpu_experts.blob_pointers(pool, n, layout), act, n)
    print("| tokens | variant | ms per call | GB/s of weights |\n|---|---|---|---|")
    for t in (int(v) for v in args.tokens.split(",")):
        x = torch.randn(t, D)
        weights = torch.full((t, K), 1.0 / K)
        times = {k: [] for k in variants}
        start = 0
        for _ in range(args.calls):
            for label, (layout, pool, ptrs, act, n) in variants.items():
                ids = (torch.arange(K)[None] + start + torch.arange(t)[:, None] * 0).remainder(n)
                t0 = time.perf_counter()
                cpu_experts.cpu_experts_forward(x, ids, weights, pool, layout, ptrs=ptrs, act=act,
                                                limit=10.0 if act else None)
                times[label].append(time.perf_counter() - t0)
            start += K
        for label, (layout, *_rest) in variants.items():
            ms = statistics.median(times[label]) * 1e3
            print(f"| {t} | {label} | {ms:.2f} | {K * layout.blob_bytes / ms / 1e6:.1f} |")


if __name__ == "__main__":
    main()
