"""The bundled demo model: loads with no arguments, generates, matches transformers, and reproduces the
perplexity its model card states for the reference slice (no corpus needed: the slice is in the card)."""
from __future__ import annotations

import json
import math
import re

import pytest
import torch
import torch.nn.functional as F

import dsv3lite
from dsv3lite import DEMO_DIR
from dsv3lite.config import ModelArgs
from dsv3lite.quant.tensorfile import read_header

CARD = DEMO_DIR / "README.md"
QUIET = dict(progress=False, log=lambda m: None)


@pytest.fixture(scope="module")
def llm():
    return dsv3lite.load(device="cpu", dtype="float32", **QUIET)


def card_slice() -> tuple[str, float]:
    """The reference slice (```text block after the <!-- reference-slice --> marker) and its stated perplexity."""
    card = CARD.read_text(encoding="utf-8")
    section = card.split("<!-- reference-slice -->", 1)[1]
    text = re.search(r"```text\n(.*?)\n```", section, re.S).group(1)
    ppl = float(re.search(r"reference-slice perplexity: \*\*([0-9.]+)\*\*", section).group(1))
    return text, ppl


def test_default_load_generates_for_romeo():
    llm = dsv3lite.load()                     # no arguments: the bundled demo
    assert llm.weights == str(DEMO_DIR)
    chunks = list(llm.generate("ROMEO:", max_tokens=24))
    text = "".join(c.text for c in chunks)
    assert chunks[-1].finish_reason in ("stop", "length")
    assert len(chunks) >= 2 and re.search(r"[A-Za-z]{2}", text), text


def test_checkpoint_is_a_small_deepseek_v3_with_mtp():
    args = ModelArgs.from_dir(DEMO_DIR)
    cfg = json.loads((DEMO_DIR / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v3" and cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    assert args.num_hidden_layers >= 6 and args.first_k_dense_replace == 1 and args.q_lora_rank
    assert args.n_routed_experts >= 32 and args.num_experts_per_tok >= 4 and args.n_shared_experts == 1
    assert args.n_group >= 4 and 1 < args.topk_group < args.n_group
    assert args.rope_type == "yarn" and args.mscale == args.mscale_all_dim == 1.0
    assert args.num_nextn_predict_layers == 1
    path = DEMO_DIR / "model.safetensors"
    assert path.stat().st_size <= 30 * 10**6
    header = read_header(path)
    mtp = [n for n in header if n.startswith(f"model.layers.{args.num_hidden_layers}.")]
    assert f"model.layers.{args.num_hidden_layers}.eh_proj.weight" in mtp
    assert {v["dtype"] for k, v in header.items() if "e_score_correction_bias" not in k} == {"BF16"}


def test_logits_match_transformers(llm):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(DEMO_DIR, dtype=torch.float32,
                                                           experts_implementation="eager").eval()
    text, _ = card_slice()
    ids = torch.tensor([llm.tokenizer.encode("ROMEO:\n" + text, add_bos=True)[:128]])
    with torch.no_grad():
        expected = hf(ids).logits
    torch.testing.assert_close(llm.forward(ids), expected, atol=1e-4, rtol=1e-4)


def test_reference_slice_perplexity_matches_card(llm):
    text, stated = card_slice()
    ids = llm.tokenizer.encode(text, add_bos=True)
    logits = llm.forward([ids])[0]
    ppl = math.exp(F.cross_entropy(logits[:-1], torch.tensor(ids[1:])).item())
    assert ppl == pytest.approx(stated, rel=0.01)


def test_mtp_draft_matches_transformers_mtp_layer(llm):
    transformers = pytest.importorskip("transformers")
    from dsv3lite.testing import hf_mtp_logits

    hf = transformers.AutoModelForCausalLM.from_pretrained(DEMO_DIR, dtype=torch.float32,
                                                           experts_implementation="eager").eval()
    text, _ = card_slice()
    x = torch.tensor([llm.tokenizer.encode(text, add_bos=True)[:64]])
    expected = hf_mtp_logits(hf, DEMO_DIR, x)
    model = llm.model
    with torch.no_grad():
        got = model.head(model.mtp_hidden(model.hidden(x)[:, :-1], x[:, 1:]))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def greedy(llm, prompt="ROMEO:\n", n=40):
    llm.stop_ids = set()
    return [c.token_id for c in llm.generate(prompt, max_tokens=n)]


@pytest.fixture(scope="module")
def plain_tokens():
    return greedy(dsv3lite.load(device="cpu", mtp=False, **QUIET))


def test_mtp_is_on_by_default_and_greedy_output_is_unchanged(plain_tokens):
    llm = dsv3lite.load(device="cpu", mtp_adaptive=False, **QUIET)
    assert greedy(llm) == plain_tokens
    s = llm.stats()["mtp"]
    assert s["enabled"] and s["tokens_per_forward"] > 1.3
    assert s["acceptance_rate"] >= 0.5          # a trained MTP head, not random drafts


@pytest.mark.parametrize("miss", ["fetch", "cpu", "auto"])
def test_offloaded_demo_streams_the_same_tokens(plain_tokens, miss):
    from dsv3lite.testing import offload_budget

    n_experts = ModelArgs.from_dir(DEMO_DIR).n_routed_experts
    slots = n_experts + 8                       # of 5 x 32 routed experts: constant eviction
    llm = dsv3lite.load(device="cpu", mtp=False, experts="bf16", miss_policy=miss, ctx_size=512,
                        gpu_mem=offload_budget(DEMO_DIR, slots, "bf16", ctx=512, mtp=False), **QUIET)
    assert llm.offload is not None and llm.offload.cache.n_slots == slots
    assert greedy(llm) == plain_tokens
    s = llm.stats()["expert_cache"]
    assert s["demand_misses"] > 0 and 0 < s["hit_rate"] < 1


@pytest.mark.parametrize("k", [1, 3])
def test_offloaded_demo_with_mtp_streams_the_same_tokens(plain_tokens, k):
    from dsv3lite.testing import offload_budget

    slots = ModelArgs.from_dir(DEMO_DIR).n_routed_experts + 8      # of 6 x 32 (MTP layer's experts included)
    llm = dsv3lite.load(device="cpu", mtp=True, mtp_adaptive=False, num_draft_tokens=k, experts="bf16",
                        ctx_size=512, gpu_mem=offload_budget(DEMO_DIR, slots, "bf16", ctx=512, mtp=True), **QUIET)
    assert llm.offload is not None and llm.offload.cache.n_slots == slots
    assert greedy(llm) == plain_tokens
    assert llm.stats()["mtp"]["tokens_per_forward"] > 1.2
    assert llm.stats()["expert_cache"]["demand_misses"] > 0
