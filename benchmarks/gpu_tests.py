"""The kernel tests on the GPU, in parallel shards, every test named in the log (the GPU suite's kernel_tests stage).

Collects the tests of FILES, deals them round-robin to N pytest processes (compiling kernels is most of the time,
and it is per process: the machine's cores compile in parallel), runs every test (no -x) with -v -rA, and writes:
  OUT/tests.log         every test with its outcome, shard by shard, then the failures' reports
  OUT/kernel_tests.md   counts, the failed and skipped tests by name, and the time
A shard still running at --budget-s is stopped; the tests it did not reach are listed as not run.

    python benchmarks/gpu_tests.py OUT [--shards 12] [--budget-s 70] [--files F ...] [--dry-run]
--dry-run collects the tests and names them without running any (what the suite's dry run checks).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FILES = ("tests/test_kernels_moe.py", "tests/test_kernels_quant.py", "tests/test_kernels_mla.py",
         "tests/test_dense_cuda.py")
OUTCOME = re.compile(r"^(\S+::\S+.*?) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)")


def pytest_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--rootdir", str(ROOT), *args]


def collect(files) -> list[str]:
    run = subprocess.run(pytest_cmd("--collect-only", "-q", *[str(ROOT / f) for f in files]),
                         capture_output=True, text=True, cwd=os.getcwd())
    ids = [line.strip() for line in run.stdout.splitlines() if "::" in line]
    if run.returncode != 0 or not ids:
        sys.stderr.write(run.stdout[-3000:] + run.stderr[-3000:])
        raise SystemExit(f"gpu_tests.py: collecting the tests failed (exit {run.returncode})")
    return ids


def run_shards(ids: list[str], shards: int, budget_s: float, logs: Path) -> tuple[list[str], float]:
    """Run the shards in parallel; their -v output, and the seconds it took."""
    start = time.time()
    procs = []
    for i in range(shards):
        part = ids[i::shards]
        if not part:
            continue
        log = (logs / f"shard{i}.log").open("w")
        nodes = [str(ROOT / node) for node in part]         # (ids are relative to the root, the shards run elsewhere)
        procs.append((subprocess.Popen(pytest_cmd("-v", "-rA", "--no-header", "--color=no", *nodes), stdout=log,
                                       stderr=subprocess.STDOUT, cwd=os.getcwd()), log, i))
    for proc, log, _ in procs:
        try:
            proc.wait(timeout=max(1.0, budget_s - (time.time() - start)))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    outputs = [(logs / f"shard{i}.log").read_text(errors="replace") for _, _, i in procs]
    for _, _, i in procs:
        (logs / f"shard{i}.log").unlink()
    return outputs, time.time() - start


def _short(node: str) -> str:
    # a node id as "file name::test[params]" (pytest prints paths relative to where it was started)
    path, rest = node.split("::", 1)
    return f"{Path(path).name}::{rest}"


def report(ids: list[str], outputs: list[str], seconds: float, shards: int) -> tuple[str, bool]:
    """(the markdown summary, whether every collected test passed or was skipped)."""
    outcome = {}
    for text in outputs:
        for line in text.splitlines():
            m = OUTCOME.match(line.strip())
            if m:
                outcome[_short(m.group(1))] = m.group(2)
    by = {}
    for node in ids:
        by.setdefault(outcome.get(_short(node), "NOT RUN"), []).append(node)
    counts = ", ".join(f"{len(v)} {k.lower()}" for k, v in sorted(by.items()))
    lines = [f"# Kernel tests on the GPU ({len(ids)} tests, {shards} shards, {seconds:.0f} s): {counts}", ""]
    for kind in ("FAILED", "ERROR", "NOT RUN", "SKIPPED"):
        if by.get(kind):
            lines += [f"{kind.lower()}:", ""] + [f"- `{n}`" for n in by[kind]] + [""]
    lines.append("Every test's name and outcome: tests.log.")
    ok = not any(by.get(k) for k in ("FAILED", "ERROR", "NOT RUN", "XPASS"))
    return "\n".join(lines) + "\n", ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--shards", type=int, default=max(1, min(12, (os.cpu_count() or 2) - 2)))
    ap.add_argument("--budget-s", type=float, default=70.0)
    ap.add_argument("--files", nargs="+", default=FILES, help="test files, relative to the repository root")
    ap.add_argument("--dry-run", action="store_true", help="collect and name the tests, run none")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    ids = collect(a.files)
    if a.dry_run:
        (a.out / "tests.log").write_text("\n".join(ids) + "\n")
        (a.out / "kernel_tests.md").write_text(f"# Kernel tests (dry run): {len(ids)} tests would run in "
                                               f"{min(a.shards, len(ids))} shards\n")
        print(f"gpu_tests.py: dry run: {len(ids)} tests collected from {len(a.files)} files")
        return 0
    outputs, seconds = run_shards(ids, a.shards, a.budget_s, a.out)
    (a.out / "tests.log").write_text("".join(f"===== shard {i}\n{text}\n" for i, text in enumerate(outputs)))
    text, ok = report(ids, outputs, seconds, a.shards)
    (a.out / "kernel_tests.md").write_text(text)
    print(text, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
