"""Decode on a shared machine: quiet, and with one core taken by another program, dsv3lite against llama.cpp.

The "busy" load is made here: a process spinning at 100% pinned to the last core this process may use (a browser
or a build taking a core on a desktop). Rows, per workload (medians of alternating rounds; quiet and busy rounds
alternate too, so both see the same machine):
  - dsv3lite as users run it: --threads left at its default (the physical cores; decode steps adapt their count,
    dsv3lite/threads.py). The engine lives through the rounds, as a chat or a server does, so a busy round finds
    it settled on the quiet round's choice and must notice the taken core itself;
  - dsv3lite -t 1, and -t N (every core, fixed: what the default did before it adapted);
  - llama.cpp (llama-bench) -t 1 and -t N (N: the physical cores), its own default spinning thread pool.
Workloads: the bundled demo, 64-token prompt then 128 tokens, fp32 (llama.cpp: GGUF F32); a DeepSeek-V3 slice at
its real widths (benchmarks/cpu_peer.py's: 3 layers, 1 dense, 16 experts), 16-token prompt then 32 tokens, int4
experts and int4 dense weights (llama.cpp: Q4_0, run with --repack 0 where its repacking aborts on this graph).
Goal (issue 27): with one core busy, the default keeps >= 0.5x of its quiet decode figure. The machine's other
programs are measured in every round (/proc/stat less this process tree's CPU time): rounds in which they took more
than DISTURBED cores are left out of the medians (a quiet round with a stranger's load is not quiet).

llama.cpp is built and the checkpoints converted as benchmarks/cpu_peer.py does (its helpers and cache folder).

    python benchmarks/contention.py                       # both workloads, 5 rounds
    python benchmarks/contention.py --workloads demo --rounds 5 --no-llama
"""
from __future__ import annotations

import argparse
import contextlib
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
from cpu_peer import (CACHE, DEMO_CONFIGS, SLICE_CONFIGS, NO_REPACK, demo_prompt, dsv3_run, gguf,  # noqa: E402
                      llama_bench, log, slice_dir, wait_for_quiet)

CONDITIONS = ("quiet", "busy")
DISTURBED = 0.15             # a round whose other programs took more than this many cores is left out of the medians


def machine_busy_s() -> float:
    """CPU seconds the whole machine has run (every process), from /proc/stat."""
    fields = [int(v) for v in open("/proc/stat").readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")      # less idle and iowait


def own_s() -> float:
    """CPU seconds of this process and its finished children (llama-bench, the hog once reaped)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


@contextlib.contextmanager
def busy_core(on: bool, others: list):
    """While on: a process spinning on the last core this process may use. Appends to `others` the cores other
    programs used meanwhile (the machine's CPU time less this process's, its children's and the hog's)."""
    t0, machine0, own0 = time.perf_counter(), machine_busy_s(), own_s()
    hog = None
    if on:
        core = max(os.sched_getaffinity(0))
        hog = subprocess.Popen([sys.executable, "-c",
                                f"import os\nos.sched_setaffinity(0, {{{core}}})\nwhile True: pass"])
        time.sleep(0.5)                                # running before the first measured token
    try:
        yield
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
        wall = time.perf_counter() - t0
        others.append(max(machine_busy_s() - machine0 - (own_s() - own0), 0.0) / wall)


def workloads(names: list[str]) -> dict:
    """name -> (checkpoint dir, dsv3lite load options, GGUF kind, GGUF base, prompt tokens, generated tokens, label,
    GGUF folder: cpu_peer.py's, so both share the converted files)."""
    from dsv3lite import DEMO_DIR

    out = {}
    if "demo" in names:
        label, opts, kind = DEMO_CONFIGS[0]
        out["demo"] = (DEMO_DIR, opts, kind, "F32", 64, 128, label, "demo-gguf")
    if "slice" in names:
        label, opts, kind = SLICE_CONFIGS[0]
        out["slice"] = (slice_dir(), opts, kind, "BF16", 16, 32, label, "realwidth-gguf")
    return out


def measure(name: str, spec, cores: int, rounds: int, with_llama: bool) -> dict:
    import dsv3lite
    
    path, opts, kind, base, n_prompt, n_gen, label, gguf_dir = spec
    quiet = dict(device="cpu", mtp=False, progress=False, log=lambda m: None)
    prompt = demo_prompt(dsv3lite.load(device="cpu", progress=False, log=lambda m: None), n_prompt)
    log(f"{name}: loading dsv3lite ({label}): default threads, -t 1, -t {cores}")
    torch.set_num_threads(cores)
    default = dsv3lite.load(str(path), **opts, **quiet)               # adaptive: threads=None
    fixed_one = dsv3lite.load(str(path), threads=1, **opts, **quiet)
    all_cores = dsv3lite.load(str(path), threads=cores, **opts, **quiet)
    model = gguf(path, kind, CACHE / "bench" / gguf_dir, base) if with_llama else None
    rows = {c: {} for c in CONDITIONS}
    others = {c: [] for c in CONDITIONS}

    def run_default():
        torch.set_num_threads(cores)                   # what the CLI sets for a default run
        return dsv3_run(default, prompt, n_gen)

    def run_one():
        torch.set_num_threads(1)
        return dsv3_run(fixed_one, prompt, n_gen)

    def run_all():
        torch.set_num_threads(cores)
        return dsv3_run(all_cores, prompt, n_gen)

    runs = {"dsv3lite default": run_default, "dsv3lite -t 1": run_one, f"dsv3lite -t {cores}": run_all}
    if with_llama:
        runs["llama.cpp -t 1"] = lambda: llama_bench(model, 1, n_prompt, n_gen)
        runs[f"llama.cpp -t {cores}"] = lambda: llama_bench(model, cores, n_prompt, n_gen)
    run_default(), run_one(), run_all()                # warm: kernels compiled, caches filled
    for r in range(rounds):
        for condition in CONDITIONS:
            with busy_core(condition == "busy", others[condition]):
                for row, run in runs.items():
                    rows[condition].setdefault(row, []).append(run())
            log(f"{name} round {r + 1}/{rounds} {condition} (other programs: {others[condition][-1]:.2f} cores): "
                + ", ".join(f"{k} {v[-1]['decode']:.1f}" for k, v in rows[condition].items()))
    clean = [r for r in range(rounds) if max(others[c][r] for c in CONDITIONS) <= DISTURBED] or list(range(rounds))
    res = {c: {k: {m: statistics.median(v[r][m] for r in clean) for m in ("prefill", "decode")}
               for k, v in rows[c].items()} for c in CONDITIONS}
    res["rounds"] = {"all": rounds, "kept": len(clean), "others_cores": others, "rows": rows}
    res["chosen_threads"] = default.threads.chosen
    res["repack"] = model is None or model not in NO_REPACK
    res["llama_kind"] = kind
    return res


def print_table(name: str, spec, res: dict, cores: int) -> None:
    _, _, kind, _, n_prompt, n_gen, label, _ = spec
    repack = "" if res["repack"] else ", --repack 0"
    print(f"\n### {name}: {n_prompt}-token prompt then {n_gen} tokens; dsv3lite {label}, llama.cpp {kind}{repack}\n")
    print("| | quiet decode tok/s | busy decode tok/s | busy / quiet | quiet prefill tok/s | busy prefill tok/s |")
    print("|---|---|---|---|---|---|")
    for row in res["quiet"]:
        q, b = res["quiet"][row], res["busy"][row]
        print(f"| {row} | {q['decode']:.1f} | {b['decode']:.1f} | {b['decode'] / q['decode']:.2f}x | "
              f"{q['prefill']:.0f} | {b['prefill']:.0f} |")
    base = res["quiet"]["dsv3lite default"]["decode"]
    kept = res["rounds"]
    print(f"\nMedians of the {kept['kept']} of {kept['all']} rounds in which other programs took at most "
          f"{DISTURBED} cores.")
    print(f"\nGoal: dsv3lite default busy >= 0.5x its quiet figure: "
          f"{res['busy']['dsv3lite default']['decode'] / base:.2f}x. Threads the default settled on at the end: "
          f"{res['chosen_threads']} of {cores}.")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="demo,slice")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-llama", action="store_true", help="dsv3lite rows only")
    ap.add_argument("--quiet", type=float, default=0.5, help="wait for a 1-minute load below this")
    ap.add_argument("--wait", type=float, default=600, help="seconds to wait for it at most")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()
    from dsv3lite import threads as thread_rules
    from dsv3lite.kernels import cpu_build

    cores = thread_rules.physical_cores()
    print(f"# contention: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs ({cores} physical "
          f"cores), torch {torch.__version__}, CPU kernels {cpu_build.status()}, {time.strftime('%Y-%m-%d')}")
    out = {}
    specs = workloads(args.workloads.split(","))
    for name, spec in specs.items():
        load = wait_for_quiet(args.quiet, args.wait)
        print(f"\n(load average before {name}: {load:.2f})")
        out[name] = measure(name, spec, cores, args.rounds, not args.no_llama)
        out[name]["load"] = load
        print_table(name, spec, out[name], cores)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
