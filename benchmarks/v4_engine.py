"""DeepSeek-V4 through the engine on the CPU, as users run it (dsv3lite.load, generate): load time, peak RSS,
prefill and decode tok/s, on the real-width V4-Flash slice and on the V4-geometry checkpoint, resident and offloaded.

Each configuration runs in a process of its own (so its load time and peak RSS are its own), in alternating rounds;
the table gives the median of the rounds. Compared: the compiled CPU step (the default: executors/cpu_v4.py) against
the eager executor (DSV3LITE_CPU_DECODE=eager) on both checkpoints, and the geometry checkpoint offloaded (--slots
of its experts on the simulated device tier, the compiled attention between the host-scheduled experts) against
resident; with --by-hand also the slice's network run by hand (benchmarks/v4_slice.py's loop: the engine's cost).

    python benchmarks/v4_engine.py --slice-dir /tmp/v4-flash-slice --geometry-dir /tmp/v4-geometry --rounds 3

The checkpoints are written there once (released layout, tensor by tensor) when absent. MTP off (their MTP blocks
are random: drafts would be rejected).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


def prompt_ids(n: int, vocab: int) -> list[int]:
    return torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(0)).tolist()


def run_engine(path: str, prompt: int, tokens: int, slots: int | None) -> dict:
    """One configuration through dsv3lite.load: load, then one generation (prompt, then `tokens` greedy tokens)."""
    import dsv3lite
    from dsv3lite.testing import offload_budget

    ctx = prompt + tokens + 8
    extra = {} if slots is None else dict(gpu_mem=offload_budget(path, slots, None, ctx=ctx, mtp=False),
                                         miss_policy="fetch")
    t0 = time.perf_counter()
    llm = dsv3lite.load(path, device="cpu", ctx_size=ctx, mtp=False, progress=False, log=lambda m: None, **extra)
    load_s = time.perf_counter() - t0
    llm.stop_ids = set()
    ids = prompt_ids(prompt, llm.args.vocab_size)
    list(llm.generate(ids[:8], max_tokens=2))                       # first calls (buffers, views) out of the timing
    llm.reset()
    list(llm.generate(ids, max_tokens=tokens))
    s = llm.stats()
    out = {"load_s": load_s, "prefill_tok_s": s["prefill_tok_s"], "decode_tok_s": s["decode_tok_s"],
           "peak_rss_gib": peak_rss_gib(), "compiled": s["cpu_step"]["whole"] + s["cpu_step"]["by_block"]}
    if slots is not None:
        out["hit_rate"] = s["expert_cache"]["hit_rate"]
    return out


def run_by_hand(path: str, prompt: int, tokens: int) -> dict:
    """The slice's network with the experts served as the engine serves them, prefill then decode through its cache
    objects, with no engine around it."""
    from dsv3lite.testing_v4 import load_v4

    t0 = time.perf_counter()
    model = load_v4(path, released_experts=True, mtp=False)
    load_s = time.perf_counter() - t0
    ids = torch.tensor([prompt_ids(prompt, model.args.vocab_size)])
    with torch.inference_mode():
        cache = model.new_cache(prompt + tokens + 8, torch.float32, torch.device("cpu"))
        model.logits(model.hidden(ids[:, :8], 0, cache)[:, -1:])
        cache = model.new_cache(prompt + tokens + 8, torch.float32, torch.device("cpu"))
        t0 = time.perf_counter()
        state = model.hidden(ids, 0, cache)
        tok = model.logits(state[:, -1:]).argmax(-1)
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        for p in range(prompt, prompt + tokens - 1):
            tok = model.logits(model.hidden(tok, p, cache)).argmax(-1)
        decode = time.perf_counter() - t0
    return {"load_s": load_s, "prefill_tok_s": prompt / prefill, "decode_tok_s": (tokens - 1) / decode,
            "peak_rss_gib": peak_rss_gib()}


def child(args) -> None:
    torch.set_num_threads(args.threads)
    if args.by_hand:
        out = run_by_hand(args.child, args.prompt, args.tokens)
    else:
        out = run_engine(args.child, args.prompt, args.tokens, args.child_slots)
    print(json.dumps(out))


def ensure(path: Path, cfg: dict) -> None:
    from dsv3lite.testing_v4 import write_v4_official

    if not (path / "config.json").exists():
        t0 = time.perf_counter()
        write_v4_official(path, cfg)
        print(f"# wrote {path} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slice-dir", default="/tmp/v4-flash-slice")
    ap.add_argument("--geometry-dir", default="/tmp/v4-geometry")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--geometry-prompt", type=int, default=64)
    ap.add_argument("--geometry-tokens", type=int, default=32)
    ap.add_argument("--slots", type=int, default=1240, help="geometry offloaded: slots of its 11,264 experts (11%%)")
    ap.add_argument("--child-slots", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--by-hand", action="store_true", help="also the slice's network run by hand (eager)")
    args = ap.parse_args()
    if args.child:
        return child(args)
    from dsv3lite.kernels import cpu_build
    from dsv3lite.testing_v4 import v4_flash_slice_config, v4_geometry_config

    slice_dir, geometry_dir = Path(args.slice_dir), Path(args.geometry_dir)
    ensure(slice_dir, v4_flash_slice_config())
    ensure(geometry_dir, v4_geometry_config())
    common = ["--threads", str(args.threads)]
    slice_run = [str(slice_dir), "--prompt", str(args.prompt), "--tokens", str(args.tokens)]
    geometry_run = [str(geometry_dir), "--prompt", str(args.geometry_prompt), "--tokens", str(args.geometry_tokens)]
    eager = {"DSV3LITE_CPU_DECODE": "eager"}
    configs = {                                # name -> (child arguments, environment)
        "slice, compiled": (slice_run, {}),
        "slice, eager": (slice_run, eager),
        **({"slice, network by hand": (slice_run + ["--by-hand"], {})} if args.by_hand else {}),
        "geometry, resident, compiled": (geometry_run, {}),
        "geometry, resident, eager": (geometry_run, eager),
        f"geometry, offloaded ({args.slots} slots), compiled": (geometry_run + ["--child-slots", str(args.slots)],
                                                                {}),
    }
    env = dict(os.environ, DSV3LITE_EXPERT_CACHE=os.environ.get("DSV3LITE_EXPERT_CACHE", "/tmp/v4-expert-cache"))
    for name, (argv, extra) in configs.items():        # the expert caches written once, outside the timed rounds
        if "--by-hand" not in argv:
            subprocess.run([sys.executable, __file__, "--child", *argv, "--tokens", "2", *common], env=env,
                           check=True, capture_output=True)
    results: dict[str, list[dict]] = {name: [] for name in configs}
    for r in range(args.rounds):
        for name, (argv, extra) in configs.items():
            out = subprocess.run([sys.executable, __file__, "--child", *argv, *common], env={**env, **extra},
                                 check=True, capture_output=True, text=True).stdout
            results[name].append(json.loads(out.strip().splitlines()[-1]))
            print(f"# round {r + 1} {name}: {results[name][-1]}", file=sys.stderr)
    print(f"# CPU kernels: {cpu_build.status()}; {args.threads} threads; medians of {args.rounds} rounds")
    print("| configuration | load s | peak RSS GiB | prefill tok/s | decode tok/s | hit rate | compiled forwards |")
    print("|---|---|---|---|---|---|---|")
    for name, runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        hit = f"{med['hit_rate']:.0%}" if "hit_rate" in med else "-"
        compiled = f"{med['compiled']:.0f}" if "compiled" in med else "-"
        print(f"| {name} | {med['load_s']:.1f} | {med['peak_rss_gib']:.2f} | {med['prefill_tok_s']:.1f} | "
              f"{med['decode_tok_s']:.2f} | {hit} | {compiled} |")


if __name__ == "__main__":
    main()
