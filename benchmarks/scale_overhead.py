"""Host cost per token at DeepSeek-V3's routing geometry: resident vs offloaded decode, and resident vs llama.cpp.

On a checkpoint with V3's geometry at tiny widths (dsv3lite.testing.write_geometry_checkpoint: 61 layers, 3 dense,
256 routed experts, top-8 in 4 of 8 groups, noaux_tc), the arithmetic per token is negligible, so decode speed is
the runtime's host work per layer. Rows (medians of alternating rounds, CPU, fp32 compute, MTP off):
  - dsv3lite resident, experts dense fp32 (the weights llama.cpp runs as GGUF F32);
  - dsv3lite resident, experts as bf16 blobs (the format the offloaded rows use);
  - the same on the eager path (DSV3LITE_CPU_DECODE=eager): the feed-forward path the offloaded rows take, so the
    ratio against it is the offload scheduler's own cost (their attention takes the CPU decode step either way);
  - dsv3lite offloaded on the simulated device tier with --fractions of the routed experts in slots (bf16);
  - llama.cpp (llama-bench) on the same weights converted to GGUF F32, at each of --threads.
Goals (issue 15): offloaded >= 0.8x resident (same expert format); resident >= 0.5x llama.cpp at its best thread
count. dsv3lite decodes with its own thread choice for a model this small (generate.decode_threads: 1).
llama.cpp is built and the checkpoint converted as benchmarks/cpu_peer.py does (its helpers, imported).

    python benchmarks/scale_overhead.py                       # 96 tokens, 3 rounds, 11% and 25%, threads 1,2
    python benchmarks/scale_overhead.py --rounds 5 --no-llama
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_peer import CACHE, dsv3_run, gguf, llama_bench, log, wait_for_quiet  # noqa: E402

CTX = 256                    # the fixture's max_position_embeddings
EAGER = "resident bf16, eager step"


def geometry_dir() -> Path:
    from dsv3lite.testing import write_geometry_checkpoint

    path = CACHE / "bench" / "v3-geometry"
    if not (path / "config.json").exists():
        log(f"writing the V3-geometry checkpoint to {path}")
        write_geometry_checkpoint(path.with_suffix(".partial"))
        path.with_suffix(".partial").rename(path)
    return path


def engines(path: Path, fractions: list[float]) -> dict:
    """label -> Engine: resident fp32, resident bf16 blobs, offloaded bf16 at each fraction of experts in slots."""
    import dsv3lite
    from dsv3lite.config import ModelArgs
    from dsv3lite.testing import offload_budget

    quiet = dict(device="cpu", ctx_size=CTX, mtp=False, progress=False, log=lambda m: None)
    args = ModelArgs.from_dir(path)
    total = len(args.moe_layer_ids) * args.n_routed_experts
    out = {"resident fp32": dsv3lite.load(str(path), **quiet),
           "resident bf16": dsv3lite.load(str(path), experts="bf16", **quiet)}
    for f in fractions:
        slots = round(f * total)
        log(f"loading offloaded: {slots} of {total} experts in slots")
        llm = dsv3lite.load(str(path), experts="bf16", gpu_mem=offload_budget(path, slots, "bf16", ctx=CTX, mtp=False),
                            **quiet)
        assert llm.offload is not None and llm.offload.cache.n_slots == slots
        out[f"offloaded {f:.0%} ({slots} slots)"] = llm
    return out


def run(path: Path, fractions: list[float], threads: list[int], rounds: int, n_prompt: int, n_gen: int,
        llama: bool) -> dict:
    llms = engines(path, fractions)
    model = gguf(path, "F32", CACHE / "bench" / "v3-geometry-gguf") if llama else None
    prompt = list(range(5, 5 + n_prompt))
    runs = [(label, llm, False) for label, llm in llms.items()]
    runs.insert(2, (EAGER, llms["resident bf16"], True))
    rows: dict[str, list] = {label: [] for label, _, _ in runs} | (
        {f"llama.cpp F32, {t} thread(s)": [] for t in threads} if llama else {})
    hit_rates = {}
    for llm in llms.values():
        dsv3_run(llm, prompt, 8)                           # warm-up: first-call allocations, kernel loads
    for r in range(rounds):
        log(f"round {r + 1}/{rounds}")
        for label, llm, eager in runs:
            os.environ["DSV3LITE_CPU_DECODE"] = "eager" if eager else ""
            rows[label].append(dsv3_run(llm, prompt, n_gen)["decode"])
            os.environ.pop("DSV3LITE_CPU_DECODE")
            if llm.offload is not None:
                hit_rates[label] = llm.stats()["expert_cache"]["hit_rate"]
        for t in threads if llama else ():
            rows[f"llama.cpp F32, {t} thread(s)"].append(llama_bench(model, t, n_prompt, n_gen)["decode"])
    return {"decode_tok_s": {k: statistics.median(v) for k, v in rows.items()}, "hit_rate": hit_rates,
            "layers": llms["resident fp32"].args.num_hidden_layers,
            "moe_layers": len(llms["resident fp32"].args.moe_layer_ids)}


def report(res: dict, n_prompt: int, n_gen: int, rounds: int, load: float) -> None:
    tok_s, layers = res["decode_tok_s"], res["layers"]
    peers = {k: v for k, v in tok_s.items() if k.startswith("llama.cpp")}
    best_peer = max(peers.items(), key=lambda kv: kv[1]) if peers else None
    base, eager = tok_s["resident bf16"], tok_s[EAGER]
    print(f"\n### V3 geometry at tiny widths: {n_prompt}-token prompt then {n_gen} tokens, medians of {rounds} "
          f"rounds, load {load:.2f}\n")
    print("| configuration | decode tok/s | host ms / token | host ms / layer | vs resident (same experts) | "
          "vs resident, eager step | vs llama.cpp best | expert hit rate |")
    print("|---|---|---|---|---|---|---|---|")
    for label, v in tok_s.items():
        ms = 1e3 / v
        same = "" if label.startswith(("llama", "resident fp32")) else f"{v / base:.2f}x"
        vs_eager = f"{v / eager:.2f}x" if label.startswith(("offloaded", EAGER)) else ""
        peer = f"{v / best_peer[1]:.2f}x" if best_peer else ""
        hit = f"{res['hit_rate'][label]:.1%}" if label in res["hit_rate"] else ""
        print(f"| {label} | {v:.1f} | {ms:.2f} | {ms / layers:.3f} | {same} | {vs_eager} | {peer} | {hit} |")
    offloaded = [v for k, v in tok_s.items() if k.startswith("offloaded")]
    if offloaded:
        extra = [(1e3 / v - 1e3 / eager) / res["moe_layers"] for v in offloaded]
        print(f"\noffload bookkeeping over resident on the eager step: {', '.join(f'{e:.3f}' for e in extra)} ms per "
              f"MoE layer ({min(offloaded) / eager:.2f}x worst); goal offloaded >= 0.8x resident: "
              f"{'met' if min(offloaded) >= 0.8 * base else 'not met'} (worst {min(offloaded) / base:.2f}x)")
    if best_peer:
        ratio = tok_s["resident fp32"] / best_peer[1]
        print(f"goal resident >= 0.5x llama.cpp at its best ({best_peer[0]}): {'met' if ratio >= 0.5 else 'not met'} "
              f"({ratio:.2f}x)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fractions", default="0.11,0.25", help="fractions of the routed experts in slots")
    ap.add_argument("--threads", default="1,2", help="llama.cpp thread counts")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    ap.add_argument("--tokens", type=int, default=96, help="tokens decoded per round")
    ap.add_argument("--llama", action=argparse.BooleanOptionalAction, default=True, help="run llama.cpp beside")
    ap.add_argument("--quiet", type=float, default=0.5, help="wait for a 1-minute load below this")
    ap.add_argument("--wait", type=float, default=60, help="seconds to wait for it at most")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()
    print(f"# scale_overhead: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch "
          f"{torch.__version__}, {time.strftime('%Y-%m-%d')}")
    path = geometry_dir()
    load = wait_for_quiet(args.quiet, args.wait)
    res = run(path, [float(f) for f in args.fractions.split(",")], [int(t) for t in args.threads.split(",")],
              args.rounds, args.prompt, args.tokens, args.llama)
    report(res, args.prompt, args.tokens, args.rounds, load)
    if args.json:
        Path(args.json).write_text(json.dumps(res | {"load": load}, indent=2))


if __name__ == "__main__":
    main()
