"""`dsv3lite quantize` speed per routed expert on a DeepSeek-V3 slice at real width, and the int4 clip search's
quality against its cost.

    python benchmarks/quantize_speed.py                           # 32 experts, FP8 and bf16 sources
    python benchmarks/quantize_speed.py --experts 64 --sources fp8 --rows fp8:int4 fp8:int4:fast --workdir /big
    python benchmarks/quantize_speed.py --search-table            # clip-search candidates: error vs exhaustive
    python benchmarks/quantize_speed.py --rows bf16:int4 --llama   # and the slice against llama-quantize Q4_K_M

The source is one MoE layer of DeepSeek-V3 (hidden 7168, routed experts 2048 wide, MLA at 128 heads, the shared
expert) written by dsv3lite.testing_realwidth as the hub writes it (bf16, or FP8 e4m3 with 128x128 block scales),
in 4 shards. Each row runs `quantize_checkpoint` in a fresh child process and reports, per routed expert:
  pipeline    the experts phase (read, quantize on --workers threads, write, fsync per layer) / experts
  arithmetic  the same experts quantized from memory by the same threads (no reads, no writes) / experts
  overhead    pipeline / arithmetic - 1
  read, write, fsync  of the pipeline: seconds in reading experts (worker threads, summed), writing blobs and the
              per-layer fsync (main thread), per expert
each also as CPU seconds (the process's, all threads: the figures least disturbed by other jobs on the machine),
plus the dense phase and the peak RSS (of the quantize), and which int4 quantizer ran (the compiled kernel or the
twin; DSV3LITE_CPU_KERNELS=ref forces the twin). The source was just written, so reads come from the page
cache. With --repeat N each figure is the least of N runs (pipeline and arithmetic minimised separately).
`--search-table` times the int4 quantizer on one real-width gate matrix (2048x7168) with each clip-search
candidate set and gives its squared reconstruction error relative to the exhaustive 23-candidate search, on
gaussian, FP8-rounded gaussian and heavy-tailed (Student t, 4 d.o.f.) weights at DeepSeek's init scale.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROWS = ("fp8:int4", "fp8:int4:fast", "fp8:int8", "fp8:fp8", "bf16:int4", "bf16:int4:fast")


def write_source(root: Path, n_experts: int, dtype: str) -> Path:
    from dsv3lite.testing_realwidth import write_realwidth_checkpoint

    return write_realwidth_checkpoint(root, layers=1, dense_layers=0, experts=n_experts, vocab=4096, dtype=dtype,
                                      shards=4)


class _MemoryReader:
    """The weights of some experts held in memory, read like a TensorReader (for the arithmetic-only timing)."""

    def __init__(self, reader, names):
        self.tensors = {n: reader.weight(n) for n in names}

    def weight(self, name, shape=None, scratch=None):
        return self.tensors[name]


def _peak_rss() -> int:
    """This process's peak RSS since exec (VmHWM; ru_maxrss would include the parent's at fork)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def child(src: str, dst: str, fmt: str, fast: bool, workers: int, device: str) -> None:
    """One quantize in this process, then the same experts from memory; prints one JSON line."""
    import psutil

    from dsv3lite.hf_checkpoint import PROJECTIONS, TensorReader, expert_tensor_name
    from dsv3lite.quant import checkpoint as ck

    base_rss = psutil.Process().memory_info().rss
    phase = {}

    def timed(name, fn):
        def run(*a, **kw):
            t0, c0 = time.perf_counter(), time.process_time()
            fn(*a, **kw)
            phase[name], phase[name + "_cpu"] = time.perf_counter() - t0, time.process_time() - c0
        return run

    ck._write_dense, ck._write_experts = timed("dense", ck._write_dense), timed("experts", ck._write_experts)
    parts = {"read": 0.0, "write": 0.0, "sync": 0.0}           # wall seconds inside, summed over threads

    def summed(name, fn):
        def run(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                parts[name] += time.perf_counter() - t0
        return run

    from dsv3lite.quant.tensorfile import TensorFileWriter

    ck.read_expert = summed("read", ck.read_expert)
    TensorFileWriter.write_row = summed("write", TensorFileWriter.write_row)
    TensorFileWriter.sync = summed("sync", TensorFileWriter.sync)
    t0 = time.perf_counter()
    ck.quantize_checkpoint(src, dst, experts=fmt, fast=fast, device=device, workers=workers or None,
                           progress=False, log=lambda m: None)
    total = time.perf_counter() - t0
    peak_rss = _peak_rss()
    in_pipeline = dict(parts)

    plan = ck.plan_quantize(src, dst + ".again", fmt, fast=fast)
    dev = ck.resolve_device(device)
    n_workers = workers or ck.default_workers(dev)
    jobs = [(layer, e) for layer in plan.moe_layers for e in range(plan.args.n_routed_experts)]
    with TensorReader(plan.index) as reader:
        memory = _MemoryReader(reader, [expert_tensor_name(layer, e, p) for layer, e in jobs for p in PROJECTIONS])
    with ck._one_torch_thread_each(n_workers, dev):
        t0, c0 = time.perf_counter(), time.process_time()
        collections.deque(ck.pack_experts(memory, jobs, plan.fmt, plan.layout, dev, n_workers), maxlen=0)  # drained
        arithmetic, arithmetic_cpu = time.perf_counter() - t0, time.process_time() - c0
    print(json.dumps({"experts": len(jobs), "total": total, "dense": phase["dense"], "pipeline": phase["experts"],
                      "arithmetic": arithmetic, "pipeline_cpu": phase["experts_cpu"], "arithmetic_cpu": arithmetic_cpu,
                      "workers": n_workers, "device": dev.type, "peak_rss": peak_rss, "base_rss": base_rss,
                      "int4_kernel": int4_kernel_status(), **in_pipeline}))


def int4_kernel_status() -> str:
    """Which int4 quantizer runs on the CPU: the compiled kernel (kernels/csrc/cpu_kernels.cpp) or the twin."""
    from dsv3lite.kernels import cpu_build
    from dsv3lite.quant import int4

    return "kernel" if hasattr(int4, "int4_quantize_ref") and cpu_build.library() is not None else "twin"


def search_table() -> str:
    from dsv3lite.quant.fp8 import fp8_block_dequant, fp8_block_quantize
    from dsv3lite.quant.int4 import CLIP_SEARCH, EXHAUSTIVE, ClipSearch, int4_dequant, int4_quantize

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    shape = (2048, 7168)
    gauss = torch.randn(shape, generator=gen) * 0.02
    q, s = fp8_block_quantize(torch.randn(shape, generator=gen) * 0.02)
    torch.manual_seed(0)                       # StudentT samples from the global generator: the same matrix each run
    t4 = torch.distributions.StudentT(torch.tensor(4.0)).sample(shape) * 0.02
    mats = {"gaussian": gauss, "FP8 gaussian": fp8_block_dequant(q, s).float(), "Student t4": t4}
    searches = [("exhaustive (earlier default)", EXHAUSTIVE), ("min/max (--fast)", False),
                ("shrink .9 .8 .7", ClipSearch((0.9, 0.8, 0.7), ())),
                ("ends -.05", ClipSearch((), (-0.05,))),
                ("shrink .9 .8, ends -.05", ClipSearch((0.9, 0.8), (-0.05,))),
                ("shrink .85, ends ±.05", ClipSearch((0.85,), (-0.05, 0.05))),
                ("shrink .9 .8, ends ±.05 (default)", CLIP_SEARCH),
                ("shrink .9 .8 .7, ends ±.05", ClipSearch((0.9, 0.8, 0.7), (-0.05, 0.05))),
                ("shrink .9 .8, ends -.1 -.05 +.05", ClipSearch((0.9, 0.8), (-0.1, -0.05, 0.05)))]

    def sq_error(w, search):
        qw, sc, z = int4_quantize(w, 128, search)
        return ((int4_dequant(qw, sc, z, w.shape[1], 128) - w) ** 2).sum().item()

    base = {k: sq_error(w, EXHAUSTIVE) for k, w in mats.items()}
    lines = ["| search | candidates | s per 2048x7168 matrix, 1 thread | "
             + " | ".join(f"error vs exhaustive, {k}" for k in mats) + " |",
             "|---|---|---|" + "---|" * len(mats)]
    for label, search in searches:
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            int4_quantize(gauss, 128, search)
            times.append(time.perf_counter() - t0)
        cand = 1 if search is False else search.candidates
        ratios = " | ".join(f"{sq_error(w, search) / base[k]:.4f}" for k, w in mats.items())
        lines.append(f"| {label} | {cand} | {min(times):.3f} | {ratios} |")
        print(lines[-1], file=sys.stderr, flush=True)
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", type=int, default=32, help="routed experts in the slice's MoE layer")
    ap.add_argument("--rows", nargs="+", default=list(ROWS), help="SOURCE:FORMAT[:fast] (default: %(default)s)")
    ap.add_argument("--workers", type=int, default=0, help="experts in flight (0: quantize's default)")
    ap.add_argument("--device", default="auto", help="auto, cpu or cuda")
    ap.add_argument("--workdir", default=None, help="where the slices go (default: a temp dir)")
    ap.add_argument("--repeat", type=int, default=1, help="runs per row, the fastest kept (a shared machine)")
    ap.add_argument("--search-table", action="store_true", help="only the clip-search table")
    ap.add_argument("--llama", action="store_true",
                    help="also the whole bf16 slice against llama-quantize to Q4_K_M (builds llama.cpp once)")
    ap.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        src, dst, fmt, fast, workers, device = a.child
        return child(src, dst, fmt, fast == "1", int(workers), device)
    head = (f"{datetime.date.today()}, torch {torch.__version__}, {os.cpu_count()} CPUs ({platform.machine()}), "
            f"load average {os.getloadavg()[0]:.1f} at start")
    if a.search_table:
        print(head + "\n\n" + search_table())
        return

    work = Path(tempfile.mkdtemp(prefix="dsv3lite-qspeed-", dir=a.workdir))
    rows, sources = [], {}
    try:
        for row in a.rows:
            source, fmt, *flag = row.split(":")
            if source not in sources:
                t0 = time.perf_counter()
                sources[source] = write_source(work / f"src-{source}", a.experts, source)
                print(f"wrote the {source} slice ({a.experts} experts) in {time.perf_counter() - t0:.0f}s",
                      file=sys.stderr, flush=True)
            runs = []
            for _ in range(a.repeat):
                dst = work / f"out-{row.replace(':', '-')}"
                res = subprocess.run([sys.executable, __file__, "--child", str(sources[source]), str(dst), fmt,
                                      "1" if flag == ["fast"] else "0", str(a.workers), a.device],
                                     capture_output=True, text=True)
                if res.returncode:
                    sys.exit(f"quantize {row} failed:\n{res.stderr}")
                runs.append(json.loads(res.stdout.strip().splitlines()[-1]))
                shutil.rmtree(dst, ignore_errors=True)
            r = {k: min(x[k] for x in runs) if isinstance(v, float) else v for k, v in runs[0].items()}
            rows.append((row, r))
            print(row_text(row, r), file=sys.stderr, flush=True)
        peer = llama_rounds(sources, work, a) if a.llama else None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{head}, {os.getloadavg()[0]:.1f} at the end; {a.experts} experts of 2048x7168\n")
    print("| source | experts | --fast | workers, device, int4 | pipeline s/expert | arithmetic s/expert | overhead "
          "| pipeline CPU s/expert | arithmetic CPU s/expert | CPU overhead | dense phase s | total s "
          "| peak RSS GiB |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(row_text(row, r) for row, r in rows))
    print("\n| source | experts | --fast | pipeline: read s/expert (workers, summed) | write s/expert "
          "| fsync s/expert |\n|---|---|---|---|---|---|")
    for row, r in rows:
        source, fmt, *flag = row.split(":")
        n = r["experts"]
        print(f"| {source} | {fmt} | {'yes' if flag else ''} | {r['read'] / n:.4f} | {r['write'] / n:.4f} "
              f"| {r['sync'] / n:.4f} |")
    if peer:
        print(f"\nThe whole slice (its {a.experts} experts and dense weights), wall seconds, alternating rounds, "
              f"{peer['threads']} threads each, medians of {len(peer['dsv3lite'])}:\n")
        print("| quantizer | output | wall s | peak RSS GiB |\n|---|---|---|---|")
        d, q = statistics.median(peer["dsv3lite"]), statistics.median(peer["llama"])
        print(f"| dsv3lite quantize --experts int4 (HF bf16 dir) | int4 g128 experts (clip search), dense bf16 | "
              f"{d:.1f} | {max(peer['dsv3lite_rss']) / 2**30:.2f} |")
        print(f"| llama-quantize Q4_K_M (bf16 GGUF) | Q4_K / Q6_K, every matrix | {q:.1f} | "
              f"{max(peer['llama_rss']) / 2**30:.2f} |")
        print(f"\ndsv3lite / llama-quantize wall time: {d / q:.2f}x (goal: at most 1x: "
              f"{'met' if d <= q else 'not met'})")


def llama_rounds(sources: dict, work: Path, a) -> dict | None:
    """dsv3lite's quantize of the bf16 slice (int4, the defaults) against llama-quantize to Q4_K_M of the same
    slice converted to a bf16 GGUF, in alternating rounds with the same thread count; wall seconds and peak RSS.
    llama.cpp is built and the slice converted as benchmarks/cpu_peer.py does."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from cpu_peer import gguf, llama_bin

    src = sources.get("bf16") or write_source(work / "src-bf16", a.experts, "bf16")
    base = gguf(src, "BF16", work / "gguf")
    threads = os.cpu_count()
    out: dict = {"threads": threads, "dsv3lite": [], "llama": [], "dsv3lite_rss": [], "llama_rss": []}
    for _ in range(max(a.repeat, 1)):
        dst = work / "peer-out"
        t0 = time.perf_counter()
        cli = str(Path(sys.executable).parent / "dsv3lite")
        res = subprocess.run(["/usr/bin/time", "-f", "%M", cli, "quantize", str(src), str(dst), "--experts", "int4",
                              "--force"], capture_output=True, text=True, errors="replace")
        out["dsv3lite"].append(time.perf_counter() - t0)
        if res.returncode:
            sys.exit(f"dsv3lite quantize failed:\n{res.stderr}")
        out["dsv3lite_rss"].append(int(res.stderr.strip().splitlines()[-1]) * 1024)
        shutil.rmtree(dst, ignore_errors=True)
        q = work / "peer-Q4_K_M.gguf"
        t0 = time.perf_counter()
        res = subprocess.run(["/usr/bin/time", "-f", "%M", str(llama_bin("llama-quantize")), str(base), str(q),
                              "Q4_K_M", str(threads)], capture_output=True, text=True, errors="replace")
        out["llama"].append(time.perf_counter() - t0)
        if res.returncode:
            sys.exit(f"llama-quantize failed:\n{res.stderr[-2000:]}")
        out["llama_rss"].append(int(res.stderr.strip().splitlines()[-1]) * 1024)
        q.unlink(missing_ok=True)
    return out


def row_text(row: str, r: dict) -> str:
    source, fmt, *flag = row.split(":")
    n = r["experts"]
    return (f"| {source} | {fmt} | {'yes' if flag else ''} | {r['workers']}, {r['device']}, {r['int4_kernel']} "
            f"| {r['pipeline'] / n:.3f} | {r['arithmetic'] / n:.3f} | {r['pipeline'] / r['arithmetic'] - 1:+.0%} "
            f"| {r['pipeline_cpu'] / n:.3f} | {r['arithmetic_cpu'] / n:.3f} "
            f"| {r['pipeline_cpu'] / r['arithmetic_cpu'] - 1:+.0%} "
            f"| {r['dense']:.1f} | {r['total']:.1f} | {r['peak_rss'] / 2**30:.2f} |")


if __name__ == "__main__":
    main()
