"""The model's decode path with Triton kernels (interpreter on CPU) against the same path with the twins."""
from __future__ import annotations

import pytest
import torch

import dsv3lite
from dsv3lite.kernels import dispatch

pytestmark = pytest.mark.skipif(not dispatch.interpreted() and not torch.cuda.is_available(),
                                reason="needs TRITON_INTERPRET=1 (set by tests/conftest.py) or a GPU")
PROMPT = "The quick brown fox jumps over"


def run(path, monkeypatch, kernels: bool, prompt=PROMPT, **kw):
    monkeypatch.setenv("DSV3LITE_KERNELS", "triton" if kernels else "ref")
    llm = dsv3lite.load(path, device="cpu", ctx_size=96, progress=False, log=lambda m: None, mtp=False, **kw)
    llm.stop_ids = set()
    tokens = [c.token_id for c in llm.generate(prompt, max_tokens=6)]
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


def test_prompts_through_the_grouped_kernels(monkeypatch, v3_dir):
    """A prompt of more than FUSED_MAX_TOKENS tokens: resident blobs take the grouped kernels, an offloaded layer's
    bulk prefill the grouped kernels one expert at a time (fused_expert); both give the twins' tokens."""
    import dsv3lite.experts
    import dsv3lite.offload.runtime
    from dsv3lite.kernels import fused_moe as fm
    from dsv3lite.limits import FUSED_MAX_TOKENS
    from dsv3lite.testing import offload_budget

    monkeypatch.setenv("DSV3LITE_CPU_KERNELS", "ref")     # the blobs' own path on the CPU, not the CPU kernels'
    calls = {"grouped": 0, "expert": 0}

    def counted(name, fn):
        def wrapped(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapped
    monkeypatch.setattr(dsv3lite.experts, "fused_moe_grouped", counted("grouped", fm.fused_moe_grouped))
    monkeypatch.setattr(dsv3lite.offload.runtime, "fused_expert", counted("expert", fm.fused_expert))
    prompt = list(range(5, 5 + FUSED_MAX_TOKENS + 8))
    ref_tokens, _ = run(v3_dir, monkeypatch, False, prompt=prompt, experts="int4")
    assert calls == {"grouped": 0, "expert": 0}
    got_tokens, _ = run(v3_dir, monkeypatch, True, prompt=prompt, experts="int4")
    assert got_tokens == ref_tokens and calls["grouped"] > 0
    budget = offload_budget(v3_dir, 10, "int4", ctx=96)
    offloaded, _ = run(v3_dir, monkeypatch, True, prompt=prompt, experts="int4", gpu_mem=budget, miss_policy="fetch")
    assert offloaded == ref_tokens and calls["expert"] > 0
