"""benchmarks/gpu_suite.sh --dry-run: every stage's script starts (its dry-run form: arguments and imports, through
the suite's link folder instead of an install), OUT holds at most 8 files and no folder, and the stages' limits fit
the suite's budget; and a dry run that meets a stage that cannot start, or limits past the budget, fails."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STAGES = ("setup", "compile", "kernels", "sweep", "prefill", "kernel_tests", "graphs", "offload")


def dry_run(out: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_suite.sh"), "--dry-run", str(out)],
                          env={**os.environ, "PYTHON": sys.executable, **env}, capture_output=True, text=True,
                          timeout=600, cwd=str(out.parent))


def test_dry_run_starts_every_stage_and_keeps_to_the_files_and_the_budget(tmp_path):
    run = dry_run(tmp_path / "out")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "dry run ok" in run.stdout and "limits 330 s of 340 s" in run.stdout, run.stdout
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["SUMMARY.md", "raw.tar.gz", "suite.log", "tests.log",
                                                    "tuning.json"]
    summary = (out / "SUMMARY.md").read_text()
    for stage in STAGES:
        assert f"| {stage} | ok |" in summary, stage
    assert "imports from" in (out / "suite.log").read_text() and "/site/dsv3lite/" in (out / "suite.log").read_text()
    named = (out / "tests.log").read_text().splitlines()
    assert "tests/test_kernels_moe.py::test_grouped_byte_decode_of_fp8" in named and len(named) > 150
    assert not (ROOT / "runs").exists() or not any((ROOT / "runs").iterdir())   # nothing written in the checkout


def test_dry_run_fails_on_a_stage_that_cannot_start_and_on_a_budget_overrun(tmp_path):
    run = dry_run(tmp_path / "out", PYTHON="false", SUITE_BUDGET_S="300")
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    assert "the stages' limits add up to 330 s, over 300 s" in run.stdout
    for stage in STAGES:
        assert f"stage {stage}: its script did not start" in run.stdout, stage
    assert "**failed**" in (tmp_path / "out" / "SUMMARY.md").read_text()
