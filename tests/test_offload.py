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
