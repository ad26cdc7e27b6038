"""DeepSeek-V3's routing geometry (61 layers, 256 experts, top-8 within 4 of 8 groups) at tiny widths: the
offloaded engine on the simulated tier with a small slot pool gives resident's tokens, the MTP layer included, and
the router really applies the group limit (transformers' logits as the oracle)."""
from __future__ import annotations

import pytest
import torch

import dsv3lite
from dsv3lite.testing import V3_GEOMETRY, geometry_model, offload_budget, write_geometry_checkpoint

EAGER_STEP = True            # offloaded and capped tokens against resident ones, bit for bit (conftest.py)
pytestmark = pytest.mark.usefixtures("one_thread")

WIDTHS = dict(hidden_size=32, moe_intermediate_size=16, intermediate_size=64, q_lora_rank=16, kv_lora_rank=16)
PROMPT = list(range(5, 21))
CTX = 64


@pytest.fixture(scope="module")
def geometry_dir(tmp_path_factory):
    return write_geometry_checkpoint(tmp_path_factory.mktemp("geometry"), mtp=True, **WIDTHS)


def load(path, **kw):
    llm = dsv3lite.load(path, device="cpu", ctx_size=CTX, experts="bf16", progress=False, log=lambda m: None, **kw)
    llm.stop_ids = set()
    return llm


@pytest.fixture(scope="module")
def resident(geometry_dir):
    return load(geometry_dir, mtp=True, mtp_adaptive=False)


def greedy(llm, n=8):
    llm.reset()
    return [c.token_id for c in llm.generate(PROMPT, max_tokens=n)]


def test_offloaded_is_token_identical_to_resident_at_v3_geometry(geometry_dir, resident):
    slots = 48                                                # 48 of 59 x 256 experts: constant eviction
    llm = load(geometry_dir, mtp=True, mtp_adaptive=False,
               gpu_mem=offload_budget(geometry_dir, slots, "bf16", ctx=CTX), miss_policy="fetch")
    assert llm.offload.cache.n_slots == slots and 61 in llm.offload.host.layers    # the MTP layer's experts too
    assert greedy(llm) == greedy(resident)
    s = llm.stats()
    assert s["expert_cache"]["demand_misses"] > 0 and s["mtp"]["enabled"]


def test_routing_applies_the_group_limit_as_transformers_does(resident):
    per_group = V3_GEOMETRY["n_routed_experts"] // V3_GEOMETRY["n_group"]
    gates = {moe.layer_id: moe.gate for moe in resident.model.moe_modules()}
    limited, rows = 0, 0

    def watch(layer_id, ids, scores):
        nonlocal limited, rows
        for row in ids:
            assert len(set((row // per_group).tolist())) <= V3_GEOMETRY["topk_group"]
        # without the limit, the top-8 of the biased scores would leave the chosen groups on some rows
        free = (scores + gates[layer_id].bias).topk(ids.shape[1], dim=-1).indices
        limited += sum(set(a.tolist()) != set(b.tolist()) for a, b in zip(free, ids))
        rows += ids.shape[0]

    handle = resident.model.add_observer(on_routing=watch)
    try:
        got = resident.forward(torch.tensor([PROMPT]))
    finally:
        handle.remove()
    assert rows and limited > 0, "the group limit never changed a choice: the fixture does not exercise it"

    # transformers with the same weights, routed experts rounded to bf16 as the engine holds them
    hf = geometry_model(**WIDTHS)
    hf.config._experts_implementation = "eager"
    with torch.no_grad():
        for layer in hf.model.layers[V3_GEOMETRY["first_k_dense_replace"]:]:
            for p in layer.mlp.experts.parameters():
                p.copy_(p.to(torch.bfloat16).float())
        want = hf(torch.tensor([PROMPT])).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
