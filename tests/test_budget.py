"""--gpu-mem on the simulated device tier, measured: the weights, slots and KV cache it holds plus the peak of
what a full-context prefill and decode allocate stay within the budget less its allocator slack, over several
budgets and contexts (the test checkpoint's longest context is 256)."""
from __future__ import annotations

import pytest
import torch

import dsv3lite
from dsv3lite.offload.accounting import PeakTracker, held_bytes, held_pointers
from dsv3lite.offload.planner import SLACK_BYTES
from dsv3lite.testing import offload_budget


def measured_bytes(llm, prompt_len: int, new_tokens: int) -> tuple[dict, int]:
    prompt = [5 + i % 300 for i in range(prompt_len)]
    for _ in llm.generate(prompt, max_tokens=2):         # warm: the KV cache and per-shape buffers exist
        pass
    held = held_bytes(llm)
    with PeakTracker(held_pointers(llm)) as tracker:
        llm.reset()
        for _ in llm.generate(prompt, max_tokens=new_tokens):
            pass
    return held, tracker.peak


@pytest.mark.parametrize("ctx,slots,mtp", [(64, 8, False), (160, 12, True), (256, 20, True), (256, 8, False)])
def test_measured_device_bytes_stay_within_the_budget(v3_dir, ctx, slots, mtp):
    budget = offload_budget(v3_dir, slots, "bf16", ctx=ctx, mtp=mtp)
    llm = dsv3lite.load(v3_dir, device="cpu", experts="bf16", gpu_mem=budget, ctx_size=ctx, mtp=mtp,
                        mtp_adaptive=False, progress=False, log=lambda m: None)
    llm.stop_ids = set()
    assert llm.offload is not None and llm.offload.cache.n_slots == slots
    held, peak = measured_bytes(llm, ctx - 8, 4)
    assert held["slots"] == slots * llm.offload.layout.blob_bytes and held["kv_cache"] > 0
    assert peak > 0                                        # the tracker saw the forward's temporaries
    used = sum(held.values()) + peak
    # the budget keeps SLACK_BYTES for allocator rounding on a GPU: what the model itself uses must fit without it
    assert used <= budget - SLACK_BYTES, f"{used} bytes used ({held}, peak workspace {peak}) for {budget}"


# DeepSeek-V3's attention widths (128 heads, K 128 + 64, V 128, latent 512) on a narrow residual stream: there the
# prefill's expanded K/V and attention scores dominate the workspace, as they do at V3's size
V3_ATTENTION = dict(num_attention_heads=128, num_key_value_heads=128, qk_nope_head_dim=128, qk_rope_head_dim=64,
                    v_head_dim=128, kv_lora_rank=512, q_lora_rank=256, hidden_size=256, num_hidden_layers=2,
                    max_position_embeddings=4096)


def test_real_attention_widths_prefill_over_two_chunks_stays_within_the_budget(tmp_path):
    from dsv3lite.testing import write_checkpoint

    path = write_checkpoint(tmp_path / "wide", "v3", **V3_ATTENTION)
    ctx = 600                                              # a 512-token chunk, then one attending to 592 keys
    budget = offload_budget(path, 8, "bf16", ctx=ctx, mtp=False)
    llm = dsv3lite.load(path, device="cpu", experts="bf16", gpu_mem=budget, ctx_size=ctx, mtp=False,
                        progress=False, log=lambda m: None)
    llm.stop_ids = set()
    held, peak = measured_bytes(llm, ctx - 8, 2)
    assert peak > 200 * 2**20                              # the expanded K/V and scores of the second chunk
    used = sum(held.values()) + peak
    assert used <= budget - SLACK_BYTES, f"{used} bytes used ({held}, peak workspace {peak}) for {budget}"


def test_tracker_counts_live_temporaries_and_their_peak():
    with PeakTracker() as t:
        a = torch.ones(1000)                               # 4000 bytes
        b = a.view(10, 100)                                # a view: the same storage
        del a
        c = torch.zeros(500)                               # 2000 more, with b still alive
        assert t.live == 6000
        del b, c
    assert t.live == 0 and t.peak == 6000


def test_cuda_peak_above_the_plan_is_warned_once(v3_dir, monkeypatch):
    lines = []
    llm = dsv3lite.load(v3_dir, device="cpu", experts="bf16", gpu_mem=offload_budget(v3_dir, 8, "bf16"),
                        ctx_size=160, progress=False, log=lines.append)
    rt = llm.offload
    monkeypatch.setattr(rt, "device", torch.device("cuda"))          # only the check itself runs "on CUDA"
    peak = {"bytes": rt.plan.budget}
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: peak["bytes"])
    rt.check_device_memory()
    assert not any("warning" in l for l in lines)                    # at the budget: fine
    peak["bytes"] += 1
    rt.check_device_memory()
    rt.check_device_memory()
    warnings = [l for l in lines if l.startswith("warning: GPU memory peaked")]
    assert len(warnings) == 1 and "--gpu-mem" in warnings[0]


@pytest.mark.parametrize("ctx,slots,mtp", [(64, 8, False), (200, 16, True)])
def test_v4_measured_device_bytes_stay_within_the_budget(v4_dir, ctx, slots, mtp):
    """DeepSeek-V4 (v4/sizes.py: its cache objects, fp32 mHC and norms, its workspace): what a full-context prefill
    and decode hold and allocate fits the plan, past the window and across CSA / HCA boundaries."""
    budget = offload_budget(v4_dir, slots, None, ctx=ctx, mtp=mtp)
    llm = dsv3lite.load(v4_dir, device="cpu", gpu_mem=budget, ctx_size=ctx, mtp=mtp, mtp_adaptive=False,
                        progress=False, log=lambda m: None)
    llm.stop_ids = set()
    assert llm.offload is not None and llm.offload.cache.n_slots == slots
    held, peak = measured_bytes(llm, ctx - 8, 4)
    plan = llm.offload.plan
    assert held["kv_cache"] <= plan.kv_cache and held["weights"] <= sum(plan.components.values())
    assert 0 < sum(held.values()) + peak <= budget - SLACK_BYTES
