"""Expert offloading on the simulated device tier (CPU): token identity with resident experts, the
planner's budget, telemetry, and clear errors for bad budgets."""
from __future__ import annotations

import pytest
import torch

import dsv3lite
from dsv3lite.config import ModelArgs
from dsv3lite.errors import UserError
from dsv3lite.offload.setup import plan_for
from dsv3lite.testing import offload_budget as budget_for

EAGER_STEP = True            # offloaded and capped tokens against resident ones, bit for bit (conftest.py)
PROMPT = "The quick brown fox jumps over the lazy dog, and then it runs away into the forest."


def load(path, **kw):
    llm = dsv3lite.load(path, device="cpu", ctx_size=160, progress=False, log=lambda m: None, **kw)
    llm.stop_ids = set()
    return llm


def greedy(llm, n=24):
    return [c.token_id for c in llm.generate(PROMPT, max_tokens=n)]


@pytest.fixture(scope="module")
def resident_tokens(v3_dir):
    return {fmt: greedy(load(v3_dir, experts=fmt)) for fmt in ("bf16", "int4")}


@pytest.mark.parametrize("experts,slots,miss,policy", [
    ("bf16", 8, "fetch", "decayed-lfu"),      # 8 of 32 experts: constant eviction
    ("bf16", 8, "cpu", "lru"),
    ("int4", 10, "auto", "lfu"),
    ("int4", 20, "fetch", "decayed-lfu"),
])
def test_offloaded_generation_is_token_identical_to_resident(v3_dir, resident_tokens, experts, slots, miss, policy):
    llm = load(v3_dir, experts=experts, gpu_mem=budget_for(v3_dir, slots, experts), miss_policy=miss,
               cache_policy=policy)
    assert llm.offload is not None and llm.offload.cache.n_slots == slots
    assert greedy(llm) == resident_tokens[experts]
    s = llm.stats()["expert_cache"]
    uses = s["hits"] + s["prefetch_hits"] + s["demand_misses"]
    assert uses > 0 and s["demand_misses"] > 0                    # the budget really forces misses
    assert s["hit_rate"] == pytest.approx((s["hits"] + s["prefetch_hits"]) / uses)
    if miss == "cpu":
        assert s["cpu_experts"] == s["demand_misses"]
    if miss == "fetch":
        assert s["cpu_experts"] == 0
    assert s["h2d_bytes"] % llm.offload.layout.blob_bytes == 0 and s["h2d_bytes"] > 0
    assert 0 <= s["predictor_recall"] <= 1 and 0 <= s["predictor_precision"] <= 1


def test_offloaded_mtp_is_token_identical(tmp_path):
    from dsv3lite.testing import add_mtp_weights, write_checkpoint

    path = add_mtp_weights(write_checkpoint(tmp_path / "m", "v3"))
    expected = greedy(load(path, experts="bf16", mtp=False))
    llm = load(path, experts="bf16", mtp=True, mtp_adaptive=False, gpu_mem=budget_for(path, 8, "bf16"))
    assert 3 in llm.offload.host.layers                       # the MTP layer's experts live in the same cache
    assert greedy(llm) == expected
    assert llm.stats()["mtp"]["enabled"]


def test_every_budget_plan_fits(v3_dir):
    args = ModelArgs.from_dir(v3_dir)
    for slots in (8, 9, 17, 31):
        budget = budget_for(v3_dir, slots, "int4") + 1000
        plan, *_ = plan_for(v3_dir, args, budget, 160, "int4", True, torch.float32)
        assert plan.n_slots == slots
        assert plan.resident + plan.slots_total <= budget


def test_too_small_budget_names_the_minimum(v3_dir):
    tiny = budget_for(v3_dir, 2, "bf16")
    with pytest.raises(UserError, match="minimum --gpu-mem"):
        load(v3_dir, experts="bf16", gpu_mem=tiny)


def test_gpu_mem_auto_needs_cuda(v3_dir):
    with pytest.raises(UserError, match="CUDA"):
        load(v3_dir, gpu_mem="auto")


def test_all_experts_fitting_means_no_offload(v3_dir):
    llm = load(v3_dir, experts="bf16", gpu_mem="64G")
    assert llm.offload is None


def test_plan_command_reads_no_weights(capsys, monkeypatch, v3_dir):
    import safetensors

    from dsv3lite import loader
    from dsv3lite.cli import main

    def forbidden(*a, **k):
        raise AssertionError("plan must not read weights")

    monkeypatch.setattr(safetensors, "safe_open", forbidden)
    monkeypatch.setattr(loader.Loader, "load", forbidden)
    rc = main(["plan", "-w", str(v3_dir), "--gpu-mem", "80M", "--experts", "int4", "-c", "160"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "expert slots" in out and "experts resident" in out


def test_expert_cache_stats_and_bookkeeping_after_generation(v3_dir):
    from dsv3lite.offload.stats import empty_expert_cache_stats

    llm = load(v3_dir, experts="bf16", gpu_mem=budget_for(v3_dir, 8, "bf16"), miss_policy="fetch")
    greedy(llm, 8)
    s = llm.stats()["expert_cache"]
    assert set(s) == set(empty_expert_cache_stats())                 # one key list, offloaded or not
    assert s["slots"] == s["resident_experts"] == 8 and s["evictions"] > 0
    assert s["h2d_bytes"] == llm.offload.cache.counts.h2d_copies * llm.offload.layout.blob_bytes
    llm.offload.slots.check()                                         # the slot table's invariants hold
    llm.offload.detach()
    assert llm.offload.observer is None and not llm.model.observers.attention


def test_plan_and_info_show_the_host_tier_bytes(capsys):
    from dsv3lite.cli import main
    from dsv3lite.quant.formats import get_format
    from dsv3lite.utils import format_bytes

    a = ModelArgs.from_dir(dsv3lite.demo.DEMO_DIR)
    blob = get_format("bf16").layout(a.moe_intermediate_size, a.hidden_size).blob_bytes
    expected = format_bytes((len(a.moe_layer_ids) + 1) * a.n_routed_experts * blob)     # MTP layer included
    assert main(["plan", "--gpu-mem", "150M"]) == 0
    assert f"host tier: {expected} of expert blobs" in capsys.readouterr().out
    assert main(["info"]) == 0
    assert f"host tier when offloaded: {expected}" in capsys.readouterr().out


# --- the cost of a miss by where its blob is, and copies from a mapped tier ------------------------------

def _host_store(mode: str):
    from dsv3lite.offload.cache import HostStore
    from dsv3lite.quant.formats import get_format

    fmt = get_format("bf16")
    layout = fmt.layout(32, 64)
    gen = torch.Generator().manual_seed(0)
    blobs = {l: torch.stack([fmt.pack(*(torch.randn(s, generator=gen) * 0.1 for s in ((32, 64), (32, 64), (64, 32))))
                             for _ in range(6)]) for l in (1, 2)}
    return fmt, layout, HostStore(blobs, layout.blob_bytes, mode)


def test_cost_model_prices_a_fetch_at_the_rate_of_where_the_blob_is():
    from dsv3lite.offload.runtime import CostModel

    c = CostModel(h2d_bytes_per_s=4e9, cpu_s_1=1e-3, cpu_s_4=1.2e-3, blob_bytes=2_000_000, threads=2,
                  h2d_unpinned_bytes_per_s=1e9)
    assert c.fetch_s() == pytest.approx(0.5e-3) and c.fetch_s(pinned=False) == pytest.approx(2e-3)
    assert not c.prefer_cpu(1) and c.prefer_cpu(1, pinned=False)
    assert "from the mapped tier until it is pinned" in c.describe()
    assert CostModel(1e9, 1e-3, 1e-3, 10, 1).fetch_s(False) == CostModel(1e9, 1e-3, 1e-3, 10, 1).fetch_s()


def test_a_miss_is_fetched_once_its_layer_is_pinned():
    """--miss-policy auto with a mapped tier whose copies are slow until pinned: layer 1's miss goes to the CPU
    while it is mapped, to a copy once the background pinner has swapped it in."""
    from dsv3lite.offload.options import OffloadOptions
    from dsv3lite.offload.runtime import CostModel, OffloadRuntime
    from dsv3lite.offload.stats import UseCounts

    fmt, layout, host = _host_store("mmap")
    rt = OffloadRuntime(host, fmt, layout, 4, torch.device("cpu"), torch.float32,
                        options=OffloadOptions(miss_policy="auto"))
    try:
        rt.cost = CostModel(h2d_bytes_per_s=1e12, cpu_s_1=1e-3, cpu_s_4=1e-3, blob_bytes=layout.blob_bytes,
                            threads=1, h2d_unpinned_bytes_per_s=1e3)
        counts = UseCounts()
        assert rt._place(1, 0, 1, counts) is None and counts.cpu_experts == 1
        host.swap(1, host.layers[1].clone())
        assert rt._place(1, 1, 1, counts) is not None and counts.cpu_experts == 1
        assert rt._place(2, 0, 1, counts) is None                       # layer 2: still mapped
    finally:
        rt.close()


def test_staging_ring_copies_through_pinned_buffers_and_reuses_one_after_its_copy():
    from dsv3lite.offload.cache import StagingRing

    class Event:
        def __init__(self, log, name):
            self.log, self.name = log, name

        def synchronize(self):
            self.log.append(self.name)

    waited = []
    ring = StagingRing(2, 8, pin=lambda shape: torch.zeros(shape, dtype=torch.uint8))
    sources = [torch.full((8,), i, dtype=torch.uint8) for i in range(5)]
    used = []
    for i, src in enumerate(sources):
        buf, slot = ring.stage(src)
        assert torch.equal(buf, src) and buf.data_ptr() != src.data_ptr()
        used.append(slot)
        ring.issued(slot, Event(waited, f"copy {i}"))
    assert used == [0, 1, 0, 1, 0]
    assert waited == ["copy 0", "copy 1", "copy 2"]                   # each reuse waited for the copy before
