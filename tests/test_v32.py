"""DeepSeek-V3.2 (sparse attention with the lightning indexer) against transformers on tiny random checkpoints:
logits on the sparse and dense paths, cached decoding past index_topk, offloading, MTP, FP8, the planner and info."""
from __future__ import annotations

import io
import json
import sys

import pytest
import torch

import dsv3lite
from dsv3lite.config import ModelArgs
from dsv3lite.errors import UserError
from dsv3lite.kernels import dispatch
from dsv3lite.loader import load_model

pytestmark = pytest.mark.usefixtures("one_thread")
CPU = torch.device("cpu")
TOPK = 8                       # the v32 fixture's index_topk: below the prompts, so attention goes sparse
PROMPT = "The quick brown fox jumps"


def hf_load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, experts_implementation="eager").eval()


def ours(path, dtype=torch.float32):
    return load_model(path, CPU, dtype, progress=False, log=lambda m: None)


def tokens(batch=2, length=24, seed=0):
    return torch.randint(0, 400, (batch, length), generator=torch.Generator().manual_seed(seed))


def run(path, n=40, **load_options):
    """(greedy tokens after PROMPT, the engine), stop ids ignored."""
    llm = dsv3lite.load(path, device="cpu", ctx_size=96, progress=False, log=lambda m: None, **load_options)
    llm.stop_ids = set()
    return [c.token_id for c in llm.generate(PROMPT, max_tokens=n)], llm


@pytest.fixture(scope="module")
def v32_dir(ckpt_factory):
    return ckpt_factory("v32")


@pytest.fixture(scope="module")
def v32_mtp_dir(tmp_path_factory):
    from dsv3lite.testing import add_mtp_weights, write_checkpoint

    return add_mtp_weights(write_checkpoint(tmp_path_factory.mktemp("ckpt-v32-mtp"), "v32"))


# --- the network ------------------------------------------------------------------------------------

@pytest.mark.parametrize("index_topk", [TOPK, 64])        # 8 < 24 prompt tokens: sparse; 64: dense
@torch.no_grad()
def test_fp32_logits_match_transformers(ckpt_factory, index_topk):
    path = ckpt_factory("v32", index_topk=index_topk)
    x = tokens()
    expected = hf_load(path)(x).logits
    model = ours(path)
    got = model(x)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    model.args.index_topk = 10 ** 6                           # every query attends densely
    dense = model(x)
    sparse_positions = (dense - got).abs().amax(dim=(0, 2)) > 1e-3
    assert sparse_positions[:TOPK].sum() == 0                 # within index_topk tokens attention is dense
    assert sparse_positions[TOPK:].all() == (index_topk == TOPK)


@torch.no_grad()
def test_cached_prefill_and_absorbed_decode_match_full_forward(v32_dir):
    model = ours(v32_dir)
    x = tokens(batch=1)
    full = model(x)
    a = model.args
    assert a.cache_dim == a.latent_dim + a.index_head_dim
    cache = torch.zeros(a.num_hidden_layers, 1, 32, a.cache_dim)
    parts = [model(x[:, :5], 0, cache), model(x[:, 5:12], 5, cache)]         # prefill chunks, dense then sparse
    for t in range(12, 20):
        parts.append(model(x[:, t:t + 1], t, cache, absorb=True))           # sparse absorbed decode
    parts.append(model(x[:, 20:24], 20, cache, absorb=True))                 # Sq = 4, as MTP verification
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=1e-5)


def test_greedy_generation_matches_transformers(v32_dir):
    n = 40
    got, llm = run(v32_dir, n)
    prompt = llm.tokenizer.encode(PROMPT, add_bos=True)
    assert len(prompt) + n - TOPK >= 24                       # 24+ decode steps past index_topk
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = hf_load(v32_dir).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                        do_sample=False, eos_token_id=None, pad_token_id=None)
    assert got == out[0, len(prompt):].tolist()


def test_offloaded_generation_is_token_identical_to_resident(v32_dir):
    from dsv3lite.testing import offload_budget

    expected, _ = run(v32_dir, 30, experts="bf16")
    got, llm = run(v32_dir, 30, experts="bf16", gpu_mem=offload_budget(v32_dir, 8, "bf16", ctx=96))
    assert llm.offload is not None and llm.offload.cache.n_slots == 8
    assert got == expected
    assert llm.stats()["expert_cache"]["demand_misses"] > 0


@pytest.mark.skipif(not torch.cuda.is_available() and not dispatch.interpreted(),
                    reason="needs TRITON_INTERPRET=1 (set by tests/conftest.py) or a GPU")
def test_sparse_decode_through_the_kernel_gives_the_twins_tokens(monkeypatch, v32_dir):
    runs = []
    for mode in ("ref", "triton"):
        monkeypatch.setenv("DSV3LITE_KERNELS", mode)
        runs.append(run(v32_dir, 8, mtp=False)[0])
    assert runs[0] == runs[1]


# --- MTP ----------------------------------------------------------------------------------------------

def test_mtp_draft_logits_match_transformers(v32_mtp_dir):
    from dsv3lite.testing import hf_mtp_logits

    x = tokens()
    expected = hf_mtp_logits(hf_load(v32_mtp_dir), v32_mtp_dir, x)     # 23 MTP positions: sparse there too
    model = ours(v32_mtp_dir)
    with torch.no_grad():
        got = model.head(model.mtp_hidden(model.hidden(x)[:, :-1], x[:, 1:]))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("k", [1, 2])
def test_mtp_greedy_equals_plain_greedy(v32_mtp_dir, k):
    expected, _ = run(v32_mtp_dir, mtp=False)
    got, spec = run(v32_mtp_dir, mtp=True, num_draft_tokens=k, mtp_adaptive=False)
    assert got == expected
    assert spec.stats()["mtp"]["enabled"] and spec.last.drafted > 0      # every step verified k drafts


# --- checkpoints and config ---------------------------------------------------------------------------

@torch.no_grad()
def test_fp8_checkpoint_matches_transformers_on_reference_dequantized_weights(v32_dir, tmp_path):
    from dsv3lite.testing import hf_reference_for_fp8, write_fp8_copy

    fp8 = write_fp8_copy(v32_dir, tmp_path / "fp8")
    from safetensors import safe_open
    with safe_open(fp8 / "model.safetensors", "pt") as f:
        assert f.get_slice("model.layers.1.self_attn.indexer.wq_b.weight").get_dtype() == "F8_E4M3"
    x = tokens()
    torch.testing.assert_close(ours(fp8)(x), hf_reference_for_fp8(fp8)(x).logits, atol=1e-4, rtol=1e-4)


def test_bf16_keeps_the_indexer_weights_proj_in_fp32(v32_dir):
    model = ours(v32_dir, torch.bfloat16)
    indexer = model.layers[0].attn.indexer
    assert indexer.weights_proj.weight.dtype == torch.float32 and indexer.wq_b.weight.dtype == torch.bfloat16
    assert model(tokens(batch=1)).isfinite().all()


# DeepSeek-V3.2's own config.json (its fields that matter here)
V32_FULL = dict(model_type="deepseek_v32", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128, q_lora_rank=1536,
                kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256,
                n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4, first_k_dense_replace=3,
                routed_scaling_factor=2.5, index_topk=2048, index_n_heads=64, index_head_dim=128,
                num_nextn_predict_layers=1, max_position_embeddings=163840,
                rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                              "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})


def test_full_size_footprint_counts_the_indexer_like_transformers():
    from transformers import DeepseekV32Config
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Attention

    from dsv3lite.footprint import attention_params, indexer_params

    a = ModelArgs.from_dict(V32_FULL)
    assert a.kv_bytes_per_token == (576 + 128) * 2 * 61          # latent + indexer key, bf16, 61 layers
    hf_cfg = DeepseekV32Config(**{k: v for k, v in V32_FULL.items() if k not in ("model_type", "rope_scaling")},
                               rope_parameters=dict(V32_FULL["rope_scaling"], rope_type="yarn", rope_theta=10000.0))
    with torch.device("meta"):
        attn = DeepseekV32Attention(hf_cfg, 0)
    assert indexer_params(a) == sum(p.numel() for p in attn.indexer.parameters())
    assert attention_params(a) == sum(p.numel() for p in attn.parameters()) + 2 * a.hidden_size   # + layer norms


def test_config_rules():
    with pytest.raises(UserError, match="q_lora_rank"):
        ModelArgs.from_dict(dict(V32_FULL, q_lora_rank=None))
    with pytest.raises(UserError, match="index_topk"):
        ModelArgs.from_dict(dict(V32_FULL, index_topk=0))
    assert ModelArgs.from_dict(dict(V32_FULL, model_type="deepseek_v3")).cache_dim == 576   # V3: no indexer
    types = ["dense", "sparse", "dense"] + ["sparse"] * 58           # transformers' mlp_layer_types win
    a = ModelArgs.from_dict(dict(V32_FULL, mlp_layer_types=types))
    assert a.moe_layer_ids[:3] == [1, 3, 4] and len(a.moe_layer_ids) == 59
    with pytest.raises(UserError, match="mlp_layer_types"):
        ModelArgs.from_dict(dict(V32_FULL, mlp_layer_types=["dense"]))


# --- the command line ----------------------------------------------------------------------------------

def cli(capsys, *argv):
    from dsv3lite.cli import main

    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return out, err


def test_info_and_plan_count_the_indexer_keys(capsys, v32_dir):
    from dsv3lite.offload.setup import plan_for

    a = ModelArgs.from_dir(v32_dir)
    doc = json.loads(cli(capsys, "info", "-w", v32_dir, "--json")[0])
    assert doc["model_type"] == "deepseek_v32"
    assert doc["kv_bytes_per_token"] == (a.latent_dim + a.index_head_dim) * 2 * a.num_hidden_layers
    plan, *_ = plan_for(v32_dir, a, 1 << 40, 160, "int4", False, torch.float32)
    assert plan.kv_cache == a.num_hidden_layers * 160 * (a.latent_dim + a.index_head_dim) * 4
    out, _ = cli(capsys, "plan", "-w", v32_dir, "--gpu-mem", "1G", "--experts", "int4", "-c", "160", "--no-mtp")
    assert "latents + indexer keys (160 tokens)" in out


def test_generate_and_chat_commands_run(capsys, monkeypatch, v32_dir):
    doc = json.loads(cli(capsys, "generate", "-w", v32_dir, "-p", PROMPT, "-m", "20", "--json")[0])
    assert doc["prompt_tokens"] + len(doc["token_ids"]) > TOPK and doc["finish_reason"] in ("stop", "length")
    monkeypatch.setattr(sys, "stdin", io.StringIO("To be, or not to be, that is the question.\n/exit\n"))
    out, err = cli(capsys, "chat", "-w", v32_dir, "-m", "12")
    assert "tok/s" in err
