"""CPU-assigned misses on the worker thread: the pairs it computes, their place in the layer's fixed-order sum
(the fused kernel's external outputs and `combine_experts`), and the cost model that sends misses there."""
from __future__ import annotations


import random

import pytest
import torch

from dsv3lite.kernels import cpu_experts
from dsv3lite.offload import runtime as offload_runtime
from dsv3lite.offload.cache import HostStore
from dsv3lite.offload.cpu_worker import CpuWorker
from dsv3lite.offload.options import OffloadOptions
from dsv3lite.offload.runtime import CostModel, OffloadRuntime
from dsv3lite.quant.formats import get_format

pytestmark = pytest.mark.cpu_kernels

INTER, HIDDEN, N_EXPERTS, TOP_K = 64, 128, 12, 4
LAYERS = (1, 2)


def host_store(fmt_name: str, seed: int = 0):
    fmt = get_format(fmt_name)
    layout = fmt.layout(INTER, HIDDEN)
    gen = torch.Generator().manual_seed(seed)
    shapes = ((INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER))
    blobs = {l: torch.stack([fmt.pack(*(torch.randn(s, generator=gen) * 0.1 for s in shapes))
                             for _ in range(N_EXPERTS)]) for l in LAYERS}
    return fmt, layout, HostStore(blobs, layout.blob_bytes, "memory")


def routing(rng: random.Random, n_tokens: int) -> list[list[int]]:
    return [rng.sample(range(N_EXPERTS), TOP_K) for _ in range(n_tokens)]


@pytest.mark.parametrize("fmt_name", ["bf16", "int4", "fp8"])
def test_worker_computes_exactly_the_assigned_pairs(fmt_name):
    fmt, layout, host = host_store(fmt_name)
    worker = CpuWorker(host, layout, threads=2)
    rng = random.Random(1)
    try:
        for step, n_tokens in enumerate([1, 3, 1, 2]):          # buffers reused across token counts and layers
            layer = LAYERS[step % 2]
            rows = routing(rng, n_tokens)
            assigned = set(rng.sample(sorted({e for r in rows for e in r}), 3))
            x = torch.randn(n_tokens, HIDDEN)
            got = worker.submit(layer, x, rows, assigned).pairs().clone()
            ids = torch.tensor(rows)
            blobs = {e: host.layers[layer][e] for e in assigned}
            want = cpu_experts.cpu_experts_forward(x, ids, torch.ones(ids.shape), blobs, layout, per_pair=True)
            assert torch.equal(got, want)
            skipped = torch.tensor([[e not in assigned for e in r] for r in rows])
            assert not got[skipped].any()                         # pairs left to the device stay zero
        assert worker.jobs == 4 and worker.compute_s > 0
    finally:
        worker.close()


def runtime(fmt, layout, host, miss_policy, n_slots=4):
    return OffloadRuntime(host, fmt, layout, n_slots, torch.device("cpu"), torch.float32,
                          OffloadOptions(lookahead=0, miss_policy=miss_policy, cache_policy="lru"))


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("fmt_name", ["bf16", "int4"])
def test_misses_on_the_worker_give_the_resident_bits(monkeypatch, fmt_name, fused):
    """Every miss computed by the worker, summed with the slots' outputs in ascending id: the same bits as
    computing all experts from resident blobs (the CPU kernel's per-token results do not depend on the batch)."""
    from dsv3lite.experts import BlobExperts
    from dsv3lite.kernels.fused_moe import fused_moe_ref

    fmt, layout, host = host_store(fmt_name)
    rt = runtime(fmt, layout, host, "cpu")
    if fused:      # the fused kernel's path with its twin (the interpreter's kernel is tested in test_kernels_moe)
        monkeypatch.setattr(offload_runtime, "fused_moe", fused_moe_ref)
        monkeypatch.setattr(offload_runtime.dispatch, "use_kernels", lambda device: True)
        rt.close()
        rt = runtime(fmt, layout, host, "cpu")
        assert rt.fused and rt.worker is not None
    resident = {l: BlobExperts(host.layers[l], fmt, layout) for l in LAYERS}
    rng = random.Random(2)
    try:
        for step in range(12):
            layer = LAYERS[step % 2]
            n = rng.choice([1, 1, 2, 4])
            ids = torch.tensor(routing(rng, n))
            w = torch.rand(ids.shape)
            x = torch.randn(n, HIDDEN)
            assert torch.equal(rt.forward(layer, x, ids, w), resident[layer](x, ids, w)), step
        s = rt.stats()
        assert s["cpu_experts"] == s["demand_misses"] > 0           # with 4 slots, misses every layer
        if fused:                                                   # the device path: misses on the worker
            assert s["cpu_jobs"] > 0 and s["cpu_ms"] > 0 and s["cpu_wait_ms"] >= 0
        else:                                                       # the CPU tier: one kernel call per layer
            assert rt.one_call and rt.worker is None and s["cpu_jobs"] == 0
    finally:
        rt.close()


def test_fetch_policy_starts_no_worker():
    fmt, layout, host = host_store("bf16")
    rt = runtime(fmt, layout, host, "fetch")
    assert rt.worker is None and "cpu_jobs" in rt.stats() and rt.stats()["cpu_jobs"] == 0


def test_cost_model_is_timed_at_one_and_four_tokens_with_the_worker_threads(monkeypatch):
    fmt, layout, host = host_store("int4")
    monkeypatch.setattr(offload_runtime.dispatch, "use_kernels", lambda device: True)   # the device path's worker
    rt = runtime(fmt, layout, host, "auto")
    try:
        c = rt.cost
        assert c.threads == rt.worker.threads and 0 < c.cpu_s_1 <= c.cpu_s_4 < 1
        assert c.cpu_s(1) == c.cpu_s_1 and c.cpu_s(4) == pytest.approx(c.cpu_s_4)
        assert "for 1 token" in c.describe() and f"({rt.worker.threads} thread" in c.describe()
    finally:
        rt.close()


def test_cost_model_interpolates_and_compares_with_a_copy():
    c = CostModel(h2d_bytes_per_s=1e9, cpu_s_1=1e-3, cpu_s_4=1.6e-3, blob_bytes=2_000_000, threads=2)
    assert c.fetch_s() == pytest.approx(2e-3)
    assert c.cpu_s(2) == pytest.approx(1.2e-3) and c.cpu_s(7) == pytest.approx(2.2e-3)
    assert c.prefer_cpu(1) and c.prefer_cpu(5) and not c.prefer_cpu(6)   # 2.0 ms: no faster than the copy
