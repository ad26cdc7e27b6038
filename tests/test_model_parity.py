"""The network against transformers (the oracle) on tiny random checkpoints of every supported shape."""
from __future__ import annotations

import pytest
import torch

from dsv3lite.loader import load_model

VARIANTS = ["v3", "v2lite", "v2", "moonlight"]
CPU = torch.device("cpu")


def hf_load(path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    # the eager experts loop is the reference semantics (ascending expert id, per-expert rounding)
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, experts_implementation="eager").eval()


def ours(path, dtype=torch.float32):
    return load_model(path, CPU, dtype, progress=False, log=lambda m: None)


def tokens(batch=2, length=24, seed=0, vocab=400):
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("variant", VARIANTS)
@torch.no_grad()
def test_fp32_logits_match_transformers(ckpt_factory, variant):
    path = ckpt_factory(variant)
    x = tokens()
    expected = hf_load(path)(x).logits
    got = ours(path)(x)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_fp8_checkpoint_matches_transformers_on_reference_dequantized_weights(fp8_dirs):
    from dsv3lite.testing import hf_reference_for_fp8

    _, fp8 = fp8_dirs
    x = tokens()
    expected = hf_reference_for_fp8(fp8)(x).logits
    got = ours(fp8)(x)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_fp8_dequant_is_one_fp32_multiply_then_one_bf16_rounding():
    from dsv3lite.loader import dequant_fp8
    from dsv3lite.quant.fp8 import fp8_block_quantize as fp8_quantize_block

    w = torch.randn(576, 200)                 # a partial row block (576 = 4*128 + 64) and column block
    q, s = fp8_quantize_block(w)
    assert s.shape == (5, 2)
    got = dequant_fp8(q, s)
    for i, j in [(0, 0), (511, 127), (512, 128), (575, 199), (300, 150)]:
        expected = (q[i, j].float() * s[i // 128, j // 128]).to(torch.bfloat16)
        assert got[i, j] == expected
    assert got.dtype == torch.bfloat16


@pytest.mark.parametrize("variant", ["v3", "v2lite", "moonlight"])
@torch.no_grad()
def test_cached_decode_and_absorbed_path_match_full_forward(ckpt_factory, variant):
    model = ours(ckpt_factory(variant))
    x = tokens(batch=1, length=20)
    full = model(x)
    a = model.args
    cache = torch.zeros(a.num_hidden_layers, 1, 32, a.latent_dim)
    parts = [model(x[:, :9], 0, cache)]                        # naive prefill
    parts.append(model(x[:, 9:12], 9, cache))                  # a second chunk at an offset (bottom-right mask)
    for t in range(12, 20):                                    # absorbed single-token decode
        parts.append(model(x[:, t:t + 1], t, cache, absorb=True))
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_absorbed_matches_naive_for_multi_token_queries(ckpt_factory):
    model = ours(ckpt_factory("v3"))
    x = tokens(batch=1, length=16)
    a = model.args
    for absorb in (False, True):
        cache = torch.zeros(a.num_hidden_layers, 1, 32, a.latent_dim)
        model(x[:, :12], 0, cache)
        out = model(x[:, 12:16], 12, cache, absorb=absorb)     # Sq = 4, as MTP verification does
        if not absorb:
            naive = out
    torch.testing.assert_close(out, naive, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_bf16_top1_agrees_with_transformers(ckpt_factory):
    path = ckpt_factory("v3")
    x = tokens(batch=4, length=64, seed=3)
    expected = hf_load(path, torch.bfloat16)(x).logits.argmax(-1)
    got = ours(path, torch.bfloat16)(x).argmax(-1)
    agreement = (got == expected).float().mean().item()
    assert agreement >= 0.99, f"bf16 top-1 agreement {agreement:.3f}"


@pytest.mark.parametrize("variant", ["v3", "v2lite"])
def test_greedy_generation_matches_transformers(ckpt_factory, variant):
    import dsv3lite

    path = ckpt_factory(variant)
    llm = dsv3lite.load(path, device="cpu", progress=False, log=lambda m: None)
    prompt = llm.tokenizer.encode("The quick brown fox", add_bos=True)
    hf = hf_load(path)
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                          eos_token_id=None, pad_token_id=None)
    expected = out[0, len(prompt):].tolist()
    llm.stop_ids = set()                      # compare all 32 tokens, as transformers runs without EOS here
    got = [c.token_id for c in llm.generate(prompt, max_tokens=32)]
    assert got == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_gives_the_bits_of_the_spelled_out_formula(dtype):
    from dsv3lite.model import RMSNorm

    norm = RMSNorm(384, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(384, generator=torch.Generator().manual_seed(1)))
    norm = norm.to(dtype)
    x = (3 * torch.randn(2, 7, 384, generator=torch.Generator().manual_seed(0))).to(dtype)
    h = x.float()
    expected = norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    assert torch.equal(norm(x), expected)
