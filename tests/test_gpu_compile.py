"""Every Triton launcher compiled for sm_80, sm_86, sm_89 and sm_90 through its real launch path, with the blocks,
warps, stages and fp8 decode it picks for that GPU (dsv3lite/testing_gpu.py): shared memory within the
architecture's limit (Triton checks it at launch, as on the device), no register spills (no stack frame or local
memory in the binary), at DeepSeek-V3 / Kimi-K2 sizes, for every dtype the CLI accepts on CUDA.

One compile run per session, two processes (sm_90 + sm_89, sm_86 + sm_80); compiled kernels stay in Triton's cache,
so a second run takes seconds. A GPU runs the kernels themselves (the other kernel tests), so these skip there.
"""
from __future__ import annotations

import concurrent.futures

import pytest
import torch

from dsv3lite import testing_gpu as tg

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernel tests launch the kernels")
pytest.importorskip("triton.backends.nvidia")
FAMILIES = ("mla", "gemv", "moe", "grouped", "sweep")


@pytest.fixture(scope="module")
def compiled() -> dict:
    """{(case, arch): record} for every case of every architecture."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(tg.compile_all, ([90, 89], [86, 80])))
    return {(r["case"], r["arch"]): r for run in runs for r in run}


@pytest.mark.parametrize("arch,family", [(arch, family) for arch in sorted(tg.ARCHS) for family in FAMILIES
                                         if family != "sweep" or arch == 90])
def test_launches_fit_the_gpu(compiled, arch, family):
    limit = tg.ARCHS[arch].shared
    names = [n for n in tg.launcher_cases(arch) if n.split()[0] == family]
    problems = []
    for name in names:
        r = compiled.get((name, arch))
        if r is None:
            problems.append(f"{name}: not run")
            continue
        if r["error"]:
            problems.append(f"{name}: {r['error']}")
        if not r["launches"] and not r["error"]:
            problems.append(f"{name}: launched nothing")
        for k in r["launches"]:
            where = (f"{name}: {k['kernel']} ({k['num_warps']} warps, {k['num_stages']} stages, "
                     f"{ {c: v for c, v in k['constexprs'].items() if c.startswith('BLOCK')} })")
            if k["shared"] > limit:
                problems.append(f"{where}: {k['shared']:,} B of shared memory > {limit:,}")
            if k["stack"] or k["local"]:
                problems.append(f"{where}: {k['regs']} registers, spills {k['stack']} B stack, {k['local']} B local")
    assert names and not problems, f"sm_{arch}:\n" + "\n".join(problems)


def test_every_dtype_and_launcher_is_compiled_on_every_gpu():
    for arch in tg.ARCHS:
        names = tg.launcher_cases(arch)
        for family in ("mla", "gemv", "moe", "grouped"):
            for dtype in tg.DTYPES:
                assert any(n.startswith(family + " ") and f" {dtype}" in n for n in names), (arch, family, dtype)


def test_the_check_catches_the_float32_mla_launch_it_was_written_for(compiled):
    """Issue 26's first defect: fp32 MLA decode asked sm_86 for 112,704 B of shared memory (it has 101,376)."""
    r86 = compiled[tg.PROBE_BEFORE_FIX, 86]
    assert r86["error"] and "OutOfResources" in r86["error"] and "112704" in r86["error"], r86
    r90 = compiled[tg.PROBE_BEFORE_FIX, 90]          # 232,448 B there: it fits, and is recorded
    assert r90["error"] is None and r90["launches"][0]["shared"] == 112704, r90


def test_spills_are_read_from_the_binary(compiled):
    (launch,) = compiled[tg.PROBE_SPILLS, 90]["launches"]
    assert launch["regs"] == 255 and launch["stack"] > 0, launch


def test_max_threads_follows_the_register_file():
    assert tg.max_threads(32) == 1024
    assert tg.max_threads(128) == 512
    assert tg.max_threads(255) == 256          # 256 registers a thread: 8 warps fill the 65,536


def test_batch_one_launches_give_every_sm_of_an_h200_work(compiled):
    """Issue 26: the MoE down projection ran 448 programs on 132 SMs and the MLA merge 8; at DeepSeek-V3's sizes
    each batch-1 launch now has at least two programs per SM (grids as the launchers chose them for sm_90)."""
    sms = tg.ARCHS[90].sms

    def programs(case, kernel):
        (launch,) = [k for k in compiled[case, 90]["launches"] if k["kernel"] == kernel]
        return launch["grid"][0] * launch["grid"][1] * launch["grid"][2]
    assert programs("moe int4-g128 bfloat16 M=1", "_moe_down_kernel") == 7168 // 16 * 8 >= 2 * sms
    assert programs("moe int4-g128 bfloat16 M=1", "_moe_gate_up_kernel") >= 2 * sms
    assert programs("gemv int4 bfloat16 M=1", "_quant_matmul_kernel") >= 2 * sms
    assert programs("mla bfloat16 V3 4K", "_mla_decode_merge_kernel") >= sms
    assert programs("mla bfloat16 V3 4K", "_mla_decode_split_kernel") >= sms
