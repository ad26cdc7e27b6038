"""The CPU decode step (kernels/cpu_decode.py) against the eager path at DeepSeek-V3's real widths, alternating.

  1. one MoE block at V3's widths (hidden 7168, 128 heads, q/kv lora 1536/512, 2048-wide experts; 4 routed experts,
     fp32 weights as a CPU load keeps them), 100 positions of context: ms for its attention and its feed-forward;
  2. with --slice: the real-width slice of benchmarks/cpu_peer.py (3 layers, 16 experts) loaded with the defaults
     (fp32 dense weights, bf16 expert blobs), decode on either path, and the same with --dense bf16 (the
     checkpoint's own bf16 values, half the bytes): prefill and decode tok/s.

    python benchmarks/cpu_step.py --threads 2 --rounds 3
    python benchmarks/cpu_step.py --slice
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

MODES = {"eager": "eager", "kernel step": ""}            # DSV3LITE_CPU_DECODE per mode


def timed(fn, n: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e3


def block_rows(rounds: int, calls: int) -> dict:
    from dsv3lite.cache import LatentCache, Positions
    from dsv3lite.kernels import cpu_decode
    from dsv3lite.model import Rotary
    from dsv3lite.testing_realwidth import realwidth_moe_block

    block, args = realwidth_moe_block()
    cache = LatentCache(torch.randn(1, 256, args.cache_dim) * 0.5, args.latent_dim)
    h = torch.randn(1, 1, args.hidden_size)
    cos, sin = (t[:, None] for t in Rotary(args)(100, 1, torch.device("cpu")))
    steps = {"eager": (lambda: block.attention(h, Positions(100, 1), cos, sin, cache, True),
                       lambda: block.feed_forward(h)),
             "kernel step": (lambda: cpu_decode.attention(block, h, 100, cos, sin, cache),
                             lambda: cpu_decode.feed_forward(block, h))}
    rows = {f"{m}: {part}": [] for m in MODES for part in ("attention", "feed-forward")}
    with torch.inference_mode():
        assert all(fn() is not None for fn in steps["kernel step"]), "the compiled kernels did not run"
        for _ in range(rounds):
            for mode, (attention, feed_forward) in steps.items():
                rows[f"{mode}: attention"].append(timed(attention, calls))
                rows[f"{mode}: feed-forward"].append(timed(feed_forward, calls))
    return {k: statistics.median(v) for k, v in rows.items()}


def slice_rows(rounds: int, n_prompt: int, n_gen: int) -> dict:
    import dsv3lite
    from cpu_peer import dsv3_run, slice_dir

    load = dict(device="cpu", ctx_size=256, mtp=False, progress=False, log=lambda m: None)
    default = dsv3lite.load(str(slice_dir()), **load)
    packed = dsv3lite.load(str(slice_dir()), dense="bf16", **load)
    runs = {"default, eager": (default, "eager"), "default, kernel step": (default, ""),
            "--dense bf16, kernel step": (packed, "")}
    prompt = list(range(5, 5 + n_prompt))
    for llm, _ in runs.values():
        dsv3_run(llm, prompt, 2)
    rows = {k: [] for k in runs}
    for _ in range(rounds):
        for label, (llm, env) in runs.items():
            os.environ["DSV3LITE_CPU_DECODE"] = env
            rows[label].append(dsv3_run(llm, prompt, n_gen))
    return {k: {m: statistics.median(r[m] for r in v) for m in ("prefill", "decode")} for k, v in rows.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=10, help="calls per timing (block)")
    ap.add_argument("--slice", action="store_true", help="also decode the real-width slice (writes it once, ~5 GB)")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens on the slice (at most 240)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"# cpu_step: {os.cpu_count()} CPUs, {args.threads} threads, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d %H:%M')}, load {os.getloadavg()[0]:.2f}")
    res = block_rows(args.rounds, args.calls)
    print("\n| V3-width MoE block | eager ms | kernel step ms | ratio |\n|---|---|---|---|")
    for part in ("attention", "feed-forward"):
        e, k = res[f"eager: {part}"], res[f"kernel step: {part}"]
        print(f"| {part} | {e:.2f} | {k:.2f} | {e / k:.2f}x |")
    if args.slice:
        s = slice_rows(args.rounds, args.prompt, 16)
        print(f"\n| real-width slice, {args.prompt}-token prompt, 16 tokens | prefill tok/s | decode tok/s |\n|---|---|---|")
        for label, r in s.items():
            print(f"| {label} | {r['prefill']:.1f} | {r['decode']:.2f} |")


if __name__ == "__main__":
    main()
