"""The real-width slice's decode against llama.cpp Q4_0 with and without llama.cpp's weight repacking.

benchmarks/cpu_peer.py's table (c) compares dsv3lite (int4 experts + int4 dense) with llama.cpp Q4_0 on a
DeepSeek-V3 slice at its real widths; on an AMX CPU llama.cpp's default repacking (AMX tiles) aborts on that graph
(ggml 0.25.3), so that table ran it with --repack 0 (plain blocks). This script runs both llama.cpp settings side
by side on the same slice, where the default works (a CPU without AMX repacks Q4_0 into its interleaved AVX2 /
AVX-512 layout, CPU_REPACK): alternating rounds, same threads, medians, so the README's ratio can say what it
compares. The slice, the GGUF and llama.cpp itself come from cpu_peer.py's helpers and cache folder.

    python benchmarks/slice_repack.py                 # 5 rounds, 2 threads
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_peer import CACHE, SLICE_CONFIGS, demo_prompt, dsv3_run, gguf, llama_bin, log, slice_dir  # noqa: E402


def bench(model: Path, threads: int, n_prompt: int, n_gen: int, repack: bool) -> dict[str, float] | None:
    """llama-bench's prefill and decode tok/s, with its default repacking or --repack 0; None when it aborts."""
    cmd = [str(llama_bin("llama-bench")), "-m", str(model), "-t", str(threads), "-p", str(n_prompt), "-n",
           str(n_gen), "-r", "1", "-o", "json", "--repack", "1" if repack else "0"]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        return None
    return {("prefill" if r["n_prompt"] else "decode"): float(r["avg_ts"]) for r in json.loads(run.stdout)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    import dsv3lite

    label, opts, kind = SLICE_CONFIGS[0]
    path = slice_dir()
    model = gguf(path, kind, CACHE / "bench" / "realwidth-gguf", "BF16")
    prompt = demo_prompt(dsv3lite.load(device="cpu", progress=False, log=lambda m: None), 16)
    torch.set_num_threads(args.threads)
    llm = dsv3lite.load(str(path), device="cpu", mtp=False, threads=args.threads, progress=False,
                        log=lambda m: None, **opts)
    dsv3_run(llm, prompt, 4)
    rows = {f"dsv3lite {label}": [], f"llama.cpp {kind}, default repacking": [], f"llama.cpp {kind}, --repack 0": []}
    for r in range(args.rounds):
        rows[f"dsv3lite {label}"].append(dsv3_run(llm, prompt, 32))
        for repack, name in ((True, f"llama.cpp {kind}, default repacking"), (False, f"llama.cpp {kind}, --repack 0")):
            got = bench(model, args.threads, len(prompt), 32, repack)
            if got is not None:
                rows[name].append(got)
        log(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {v[-1]['decode']:.1f}" for k, v in rows.items() if v))
    print(f"# slice_repack: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {args.threads} "
          f"threads, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}, load {os.getloadavg()[0]:.2f}\n")
    ours = statistics.median(x["decode"] for x in rows[f"dsv3lite {label}"])
    print("| | decode tok/s | prefill tok/s | dsv3lite decode / this |")
    print("|---|---|---|---|")
    for name, runs in rows.items():
        if not runs:
            print(f"| {name} | aborts | aborts | |")
            continue
        d, p = (statistics.median(x[m] for x in runs) for m in ("decode", "prefill"))
        print(f"| {name} | {d:.1f} | {p:.0f} | {ours / d:.2f}x |")


if __name__ == "__main__":
    main()
