"""Shared fixtures: tiny random checkpoints written once per test session (nothing is downloaded)."""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# expert caches of the tests' checkpoints go to a folder of this session (removed at its end), not the user's
_EXPERT_CACHE = tempfile.mkdtemp(prefix="dsv3lite-test-expert-cache-")
os.environ["DSV3LITE_EXPERT_CACHE"] = _EXPERT_CACHE
atexit.register(shutil.rmtree, _EXPERT_CACHE, True)
# Triton reads this once, when it is imported: without a GPU, kernels are tested in its interpreter.
# Model code still runs the PyTorch twins on CPU unless a test sets DSV3LITE_KERNELS=triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    """Tests marked cpu_kernels need the compiled CPU kernels (a C++ compiler on PATH): without them they skip
    locally, and under CI, where the compiler is installed, that skip is a failure (below), as a failed build is."""
    marked = [item for item in items if item.get_closest_marker("cpu_kernels")]
    if not marked:
        return
    from dsv3lite.kernels import cpu_build

    if cpu_build.library() is None:
        skip = pytest.mark.skip(reason=f"CPU kernels {cpu_build.status()}")
        for item in marked:
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under CI (CI=true) a skipped test is a failure: every test's dependency (transformers, triton, bitsandbytes,
    chromium) is installed there, so a skip would only hide a broken install. Locally, skips stay skips."""
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("CI", "").lower() in ("1", "true", "yes") and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped under CI, where it must run: {reason}"


@pytest.fixture(scope="module", autouse=True)
def _eager_step_where_asked(request):
    """A module with EAGER_STEP = True runs with the CPU decode step off (DSV3LITE_CPU_DECODE=eager): the offloading
    tests compare offloaded tokens with resident ones bit for bit on the path the offloaded feed-forward takes (the
    kernel step's sums run in another order; tests/test_cpu_decode.py checks it against that path)."""
    if not getattr(request.module, "EAGER_STEP", False):
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DSV3LITE_CPU_DECODE", "eager")
        yield


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny-model tests: on a small shared CPU, thread hand-offs cost far
    more than the work. Use with pytestmark = pytest.mark.usefixtures("one_thread")."""
    from dsv3lite.generate import intra_op_threads

    with intra_op_threads(1):
        yield


@pytest.fixture(scope="session")
def ckpt_factory(tmp_path_factory):
    """ckpt_factory(variant, **overrides) -> directory of a tiny HF checkpoint (cached per arguments)."""
    from dsv3lite.testing import write_checkpoint

    made = {}

    def make(variant: str = "v3", **overrides):
        key = (variant, tuple(sorted(overrides.items())))
        if key not in made:
            path = tmp_path_factory.mktemp(f"ckpt-{variant}")
            made[key] = write_checkpoint(path, variant, **overrides)
        return made[key]

    return make


@pytest.fixture(scope="session")
def v3_dir(ckpt_factory):
    return ckpt_factory("v3")


@pytest.fixture(scope="session")
def fp8_dirs(tmp_path_factory, ckpt_factory):
    """(bf16-source dir, FP8 copy dir) for the FP8 variant (dims not multiples of 128)."""
    from dsv3lite.testing import write_fp8_copy

    src = ckpt_factory("v3fp8")
    dst = tmp_path_factory.mktemp("ckpt-fp8") / "fp8"
    return src, write_fp8_copy(src, dst)


@pytest.fixture(scope="session")
def v4_dir(tmp_path_factory):
    """A tiny DeepSeek-V4 checkpoint in the released layout (FP8 ue8m0 dense weights, MXFP4 experts, an MTP block)
    with a tokenizer and a chat template."""
    from dsv3lite.testing_v4 import write_v4_pair

    root = tmp_path_factory.mktemp("ckpt-v4")
    return write_v4_pair(root / "official", root / "hf", "tiny")[0]


@pytest.fixture(scope="session")
def v4_geometry_dir(tmp_path_factory):
    """DeepSeek-V4-Flash's geometry (43 layers, 256 experts, top-6, 3 hash layers, its compress_ratios) at tiny widths,
    in the released layout."""
    from dsv3lite.testing_v4 import v4_geometry_config, write_v4_official

    return write_v4_official(tmp_path_factory.mktemp("ckpt-v4geometry") / "geometry", v4_geometry_config())
