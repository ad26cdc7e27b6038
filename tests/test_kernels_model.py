"""The model's decode path with Triton kernels (interpreter on CPU) against the same path with the twins."""
from __future__ import annotations

import pytest
import torch

import dsv3lite
from dsv3lite.kernels import dispatch

pytestmark = pytest.mark.skipif(not dispatch.interpreted() and not torch.cuda.is_available(),
                                reason="needs TRITON_INTERPRET=1 (set by tests/conftest.py) or a GPU")
PROMPT = "The quick brown fox jumps over"


def run(path, monkeypatch, kernels: bool, **kw):
    monkeypatch.setenv("DSV3LITE_KERNELS", "triton" if kernels else "ref")
    llm = dsv3lite.load(path, device="cpu", ctx_size=96, progress=False, log=lambda m: None, mtp=False, **kw)
    llm.stop_ids = set()
    tokens = [c.token_id for c in llm.generate(PROMPT, max_tokens=6)]
    with torch.inference_mode():       # logits of one decode step on the same cache state
        step = llm._forward([tokens[-1]], len(llm.cached_tokens), all_logits=True)[1]
    return tokens, step


@pytest.mark.parametrize("experts", ["int4", "fp8", "bf16"])
def test_kernels_give_the_twins_tokens(monkeypatch, v3_dir, experts):
    ref_tokens, ref_logits = run(v3_dir, monkeypatch, False, experts=experts)
    got_tokens, got_logits = run(v3_dir, monkeypatch, True, experts=experts)
    assert got_tokens == ref_tokens
    torch.testing.assert_close(got_logits, ref_logits, atol=2e-3, rtol=2e-3)


def test_kernels_with_offloaded_experts(monkeypatch, v3_dir):
    from dsv3lite.testing import offload_budget

    budget = offload_budget(v3_dir, 10, "int4", ctx=96)
    ref_tokens, _ = run(v3_dir, monkeypatch, False, experts="int4", gpu_mem=budget, miss_policy="cpu")
    got_tokens, _ = run(v3_dir, monkeypatch, True, experts="int4", gpu_mem=budget, miss_policy="cpu")
    assert got_tokens == ref_tokens


def test_kernels_give_the_twins_tokens_on_the_demo_model(monkeypatch):
    from dsv3lite import DEMO_DIR

    ref_tokens, ref_logits = run(DEMO_DIR, monkeypatch, False, experts="int4")
    got_tokens, got_logits = run(DEMO_DIR, monkeypatch, True, experts="int4")
    assert got_tokens == ref_tokens
    torch.testing.assert_close(got_logits, ref_logits, atol=2e-3, rtol=2e-3)
