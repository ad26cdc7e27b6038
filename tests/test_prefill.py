"""Layer-major prefill (dsv3lite/prefill.py): a prompt of several chunks gives transformers' logits and the
chunk-major order's cache, and an offloaded layer's experts cross once per prompt instead of once per chunk."""
from __future__ import annotations

import pytest
import torch

import dsv3lite
from dsv3lite import generate
from dsv3lite.limits import PREFILL_CHUNK
from dsv3lite.testing import offload_budget, write_checkpoint

PROMPT_LEN = 2 * PREFILL_CHUNK + 90              # three chunks, the last one partial


@pytest.fixture(scope="module")
def long_dir(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("prefill") / "m", "v3", max_position_embeddings=2048)


def prompt(seed=0, vocab=400):
    return torch.randint(3, vocab, (PROMPT_LEN,), generator=torch.Generator().manual_seed(seed)).tolist()


def load(path, **kw):
    llm = dsv3lite.load(path, device="cpu", dtype="float32", ctx_size=PROMPT_LEN + 32, mtp=False, progress=False,
                        log=lambda m: None, **kw)
    llm.stop_ids = set()
    return llm


@torch.no_grad()
def test_layer_major_matches_transformers_and_the_chunk_major_cache(long_dir, monkeypatch):
    from transformers import AutoModelForCausalLM

    ids = prompt()
    llm = load(long_dir)
    llm._ensure_cache()
    logits, hidden, _ = llm._prefill(ids)
    cache = llm.cache.tensor.clone()
    hf = AutoModelForCausalLM.from_pretrained(long_dir, dtype=torch.float32, experts_implementation="eager").eval()
    expected = hf(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(logits.float(), expected, atol=2e-4, rtol=2e-4)
    monkeypatch.setattr(generate, "LAYER_MAJOR_TOKENS", PREFILL_CHUNK)      # the chunk-major order
    llm.reset()
    chunked, chunked_hidden, _ = llm._prefill(ids)
    torch.testing.assert_close(logits, chunked, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden, chunked_hidden, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(llm.cache.tensor, cache, atol=1e-5, rtol=1e-5)


def test_offloaded_prefill_moves_each_expert_once_per_prompt(long_dir, monkeypatch):
    ids = prompt(1)
    expected = [c.token_id for c in load(long_dir, experts="bf16").generate(ids, max_tokens=8)]
    budget = offload_budget(long_dir, 8, "bf16", ctx=PROMPT_LEN + 32, mtp=False)

    def prefill_copies():
        llm = load(long_dir, experts="bf16", gpu_mem=budget, miss_policy="fetch")
        rt = llm.offload
        calls = []
        end_prefill = rt.end_prefill
        monkeypatch.setattr(rt, "end_prefill", lambda: (calls.append(rt.cache.counts.h2d_copies), end_prefill()))
        tokens = [c.token_id for c in llm.generate(ids, max_tokens=8)]
        return tokens, calls[0]

    tokens, copies = prefill_copies()
    assert tokens == expected                                  # offloaded = resident, layer-major both
    a = dsv3lite.config.ModelArgs.from_dir(long_dir)
    assert copies <= len(a.moe_layer_ids) * a.n_routed_experts   # each expert of a layer at most once
    monkeypatch.setattr(generate, "LAYER_MAJOR_TOKENS", PREFILL_CHUNK)
    _, chunked_copies = prefill_copies()
    assert chunked_copies > 2 * copies                         # once per chunk: three chunks


@torch.no_grad()
def test_v4_layer_major_equals_chunk_major(v4_dir, monkeypatch):
    """DeepSeek-V4 (streams, mHC around each feed-forward, hash routers reading the chunk's tokens): the layer-major
    prompt gives the chunk-major order's logits, hidden streams and caches (the next position's logits)."""
    ids = prompt(2, vocab=300)
    out = []
    for order in ("layer-major", "chunk-major"):
        if order == "chunk-major":
            monkeypatch.setattr(generate, "LAYER_MAJOR_TOKENS", PREFILL_CHUNK)
        llm = load(v4_dir)
        llm._ensure_cache()
        logits, hidden, _ = llm._prefill(ids)
        nxt = llm.model.logits(llm.model.hidden(torch.tensor([[7]]), len(ids), llm.cache))
        out.append((logits, hidden, nxt))
    for a, b in zip(*out):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_v4_offloaded_prefill_moves_each_expert_once_per_prompt(v4_dir, monkeypatch):
    ids = prompt(3, vocab=300)
    expected = [c.token_id for c in load(v4_dir).generate(ids, max_tokens=6)]
    budget = offload_budget(v4_dir, 6, None, ctx=PROMPT_LEN + 32, mtp=False)

    def prefill_copies():
        llm = load(v4_dir, gpu_mem=budget, miss_policy="fetch")
        rt, calls = llm.offload, []
        end_prefill = rt.end_prefill
        monkeypatch.setattr(rt, "end_prefill", lambda: (calls.append(rt.cache.counts.h2d_copies), end_prefill()))
        return [c.token_id for c in llm.generate(ids, max_tokens=6)], calls[0]

    tokens, copies = prefill_copies()
    assert tokens == expected
    a = dsv3lite.config.ModelArgs.from_dir(v4_dir)
    assert copies <= len(a.moe_layer_ids) * a.n_routed_experts
    monkeypatch.setattr(generate, "LAYER_MAJOR_TOKENS", PREFILL_CHUNK)
    _, chunked_copies = prefill_copies()
    assert chunked_copies > 2 * copies
