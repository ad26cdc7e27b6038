"""A real-width DeepSeek-V4-Flash slice on the CPU: write it (released layout, tensor by tensor), load it with the
routed experts served as released (MXFP4 blobs through the packed kernel), prefill and decode through the cache
objects. Eager network (dsv3lite/v4): the figures of the family as phase 1 wrote it, before any fused CPU path.

    python benchmarks/v4_slice.py --dir /tmp/v4-flash-slice          # writes the slice there once
    python benchmarks/v4_slice.py --dir /tmp/v4-flash-slice --layers 3 --experts 16 --prompt 64 --tokens 16

Prints write and load seconds, peak RSS after each, prefill and decode tok/s.
"""
from __future__ import annotations

import argparse
import resource
import time
from pathlib import Path

import torch


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/v4-flash-slice")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    from dsv3lite.kernels import cpu_build
    from dsv3lite.testing_v4 import load_v4, v4_flash_slice_config, write_v4_official
    from dsv3lite.v4.cache import new_cache

    torch.set_num_threads(args.threads)
    path = Path(args.dir)
    print(f"# CPU kernels: {cpu_build.status()}; {args.threads} threads")
    if not (path / "config.json").exists():
        t0 = time.perf_counter()
        write_v4_official(path, v4_flash_slice_config(args.layers, args.experts))
        size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        print(f"write: {time.perf_counter() - t0:.1f} s, {size / 2 ** 30:.2f} GiB, peak RSS {peak_rss_gib():.2f} GiB")
    t0 = time.perf_counter()
    model = load_v4(path, released_experts=True, log=lambda m: None)
    print(f"load: {time.perf_counter() - t0:.1f} s, peak RSS {peak_rss_gib():.2f} GiB")
    a = model.args
    ids = torch.randint(0, a.vocab_size, (1, args.prompt + args.tokens), generator=torch.Generator().manual_seed(0))
    cache = new_cache(a, args.prompt + args.tokens, with_mtp=False)
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.logits(model.hidden(ids[:, :args.prompt], 0, cache)[:, -1:])
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        for p in range(args.prompt, args.prompt + args.tokens):
            model.logits(model.hidden(ids[:, p:p + 1], p, cache))
        decode = time.perf_counter() - t0
    print(f"| layers | experts | prefill tok/s ({args.prompt}) | decode tok/s ({args.tokens}) | peak RSS GiB |")
    print("|---|---|---|---|---|")
    print(f"| {a.num_hidden_layers} ({', '.join(a.attn_kinds[:a.num_hidden_layers])}) | {a.n_routed_experts} | "
          f"{args.prompt / prefill:.1f} | {args.tokens / decode:.2f} | {peak_rss_gib():.2f} |")


if __name__ == "__main__":
    main()
