"""DeepSeek-V3's real hidden and expert widths (7168, 2048), in the hub's FP8 layout with two shards and an index:
two MoE layers of six experts (top-2), 16 attention heads, a small vocabulary. It loads, offloads with a third of
its experts in slots, and decodes the same tokens as with every expert resident."""
from __future__ import annotations

import pytest

import dsv3lite
from dsv3lite.testing import offload_budget
from dsv3lite.testing_realwidth import write_realwidth_checkpoint

WIDTHS = dict(num_attention_heads=16, num_key_value_heads=16, num_experts_per_tok=2)


@pytest.fixture(scope="module")
def slice_dir(tmp_path_factory):
    return write_realwidth_checkpoint(tmp_path_factory.mktemp("realwidth") / "v3", layers=2, dense_layers=0,
                                      experts=6, vocab=512, dtype="fp8", shards=2, widths=WIDTHS)


def greedy(llm, n=6):
    llm.stop_ids = set()
    return [c.token_id for c in llm.generate(list(range(3, 19)), max_tokens=n)]


def test_real_width_fp8_slice_offloaded_matches_resident(slice_dir):
    kw = dict(device="cpu", ctx_size=64, experts="fp8", progress=False, log=lambda m: None)
    resident = dsv3lite.load(slice_dir, **kw)
    assert resident.args.hidden_size == 7168 and resident.args.moe_intermediate_size == 2048
    expected = greedy(resident)
    del resident
    llm = dsv3lite.load(slice_dir, gpu_mem=offload_budget(slice_dir, 4, "fp8", ctx=64, mtp=False), **kw)
    assert llm.offload is not None and llm.offload.cache.n_slots == 4
    assert greedy(llm) == expected
    s = llm.stats()["expert_cache"]
    assert s["demand_misses"] > 0 and s["host_tier"] == "mmap"            # served from the expert cache's map
