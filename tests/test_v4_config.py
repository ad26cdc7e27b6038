"""DeepSeek-V4 configs (dsv3lite/v4/config.py): both config styles give the same network description, DSpark and
V4.1 checkpoints, one-line errors, and the planner's cache sizes against docs/dsv4-math.md §4.1 / §8."""
from __future__ import annotations

import json

import pytest

from dsv3lite.config import ModelArgs
from dsv3lite.errors import UserError
from dsv3lite.limits import MAX_DRAFT_TOKENS
from dsv3lite.testing_v4 import FLASH_RATIOS, flash_config, pro_config, v4_config
from dsv3lite.v4.config import CSA, HCA, SLIDING, V4Args

MiB = 2 ** 20


def transformers_style(cfg: dict) -> dict:
    """The config.json transformers' save_pretrained writes for an official-style one."""
    from transformers import DeepseekV4Config

    hf = DeepseekV4Config(**{k: v for k, v in cfg.items() if k != "model_type"})
    written = json.loads(hf.to_json_string())
    if "expert_dtype" in cfg:                # transformers moved it into quantization_config
        assert written["quantization_config"]["expert_dtype"] == cfg["expert_dtype"]
        del written["expert_dtype"]
    return written


def args_fields(a: V4Args) -> dict:
    return {k: v for k, v in vars(a).items()}


def test_flash_official_config():
    a = ModelArgs.from_dict(flash_config())             # the project's entry point dispatches to the V4 family
    assert isinstance(a, V4Args)
    assert a.attn_kinds[:2] == [SLIDING, SLIDING] and a.attn_kinds[43] == SLIDING
    assert a.attn_kinds[2:43:2] == [CSA] * 21 and a.attn_kinds[3:42:2] == [HCA] * 20
    assert (a.compress_ratio(2), a.compress_ratio(3), a.compress_ratio(0)) == (4, 128, 0)
    assert [a.is_hash_layer(i) for i in (0, 2, 3, 43)] == [True, True, False, False]
    assert a.moe_layer_ids == list(range(43)) and a.mtp_layer_id == 43 and a.has_mtp
    assert (a.expert_dtype, a.fp8_block_size, a.stop_ids()) == ("fp4", (128, 128), {1})
    assert (a.compress_rope_type, a.rope_factor, a.original_max_position_embeddings) == ("yarn", 16, 65536)


@pytest.mark.parametrize("cfg", [flash_config(), pro_config(), v4_config("tiny"), v4_config("odd")],
                         ids=["flash", "pro", "tiny", "odd"])
def test_both_styles_give_the_same_args(cfg):
    official = V4Args.from_dict(cfg)
    written = transformers_style(cfg)
    assert "layer_types" in written and "compress_ratios" not in written and "rope_parameters" in written
    assert args_fields(V4Args.from_dict(written)) == args_fields(official)


def test_transformers_flat_rope_parameters_and_rates_dict():
    cfg = v4_config("tiny")
    flat = dict(cfg, rope_parameters=dict(cfg.pop("rope_scaling"), rope_type="yarn"))
    assert args_fields(V4Args.from_dict(flat)) == args_fields(V4Args.from_dict(v4_config("tiny")))
    rates = dict(v4_config("tiny"), compress_rates={"compressed_sparse_attention": 4,
                                                    "heavily_compressed_attention": 32})
    assert V4Args.from_dict(rates).compress_rate_hca == 16           # the scalar overrides the dict
    del rates["compress_rate_hca"]
    assert V4Args.from_dict(rates).compress_rate_hca == 32


def test_dspark_checkpoints_load_their_backbone_without_the_drafter():
    cfg = dict(flash_config(), compress_ratios=FLASH_RATIOS[:-1] + [0, 0, 0],
               dspark_target_layer_ids=[40, 41, 42], dspark_num_stages=3)
    a = V4Args.from_dict(cfg)
    assert a.drafter == "dspark" and not a.has_mtp and len(a.attn_kinds) == 44
    notes = a.load_notes()
    assert len(notes) == 1 and "DSpark" in notes[0] and "\n" not in notes[0]
    # the planner counts no MTP ring
    plain = V4Args.from_dict(dict(flash_config(), num_nextn_predict_layers=0))
    assert a.kv_fixed_bytes == plain.kv_fixed_bytes


def test_v41_and_unknown_types_are_refused_in_one_line():
    for model_type in ("deepseek_v41", "llama"):
        with pytest.raises(UserError) as e:
            ModelArgs.from_dict({"model_type": model_type})
        msg = str(e.value)
        assert "\n" not in msg and model_type in msg and "deepseek_v4" in msg and "deepseek_v3" in msg
    with pytest.raises(UserError, match="V4.1"):
        ModelArgs.from_dict({"model_type": "deepseek_v41"})


@pytest.mark.parametrize("change,words", [
    (dict(compress_ratios=None), "compress_ratios or layer_types"),
    (dict(compress_ratios=[0, 4, 64, 4, 128, 0]), "0 (sliding), 4 (CSA) or 128"),
    (dict(compress_ratios=[0, 4]), "entries for 5 layers"),
    (dict(layer_types=["sliding_attention"] * 5, compress_ratios=None, mlp_layer_types=["moe", "hash_moe"] * 2 +
          ["moe"]), "mlp_layer_types"),
    (dict(num_key_value_heads=4), "one key-value head"),
    (dict(scoring_func="sigmoid"), "scoring_func"),
    (dict(n_shared_experts=2), "one shared expert"),
    (dict(qk_rope_head_dim=7), "qk_rope_head_dim"),
    (dict(num_attention_heads=3), "o_groups"),
    (dict(rope_scaling=dict(type="yarn", factor=4, attention_factor=1.3)), "attention_factor"),
    (dict(expert_dtype="fp6"), "expert_dtype"),
    (dict(quantization_config={"quant_method": "awq"}), "quant_method"),
    (dict(num_hash_layers=9), "num_hash_layers"),
])
def test_bad_configs_are_one_line_errors(change, words):
    cfg = {k: v for k, v in dict(v4_config("tiny"), **change).items() if v is not None}
    with pytest.raises(UserError) as e:
        V4Args.from_dict(cfg)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_flash_and_pro_cache_sizes_match_the_spec():
    """§4.1: 6,880 B/token + 17.1 MiB (Flash), 9,848 B/token + 25.6 MiB (Pro) with 128-slot rings; the runtime's
    rings and compressor histories keep MAX_DRAFT_TOKENS more slots (rollback of a verify pass)."""
    for cfg, per_token, fixed_mib in ((flash_config(), 6880, 17.1), (pro_config(), 9848, 25.6)):
        a = V4Args.from_dict(cfg)
        assert a.kv_bytes_per_token == per_token
        blocks = a.num_hidden_layers + 1                               # the MTP block's ring included
        n_csa, n_hca = a.attn_kinds.count(CSA), a.attn_kinds.count(HCA)
        extra = MAX_DRAFT_TOKENS * (blocks * 512 * 2 + n_csa * 2 * (1024 + 256) * 4 + n_hca * 2 * 512 * 4)
        assert round((a.kv_fixed_bytes - extra) / MiB, 1) == fixed_mib
        # the spec's per-layer terms: ring 128 KiB, CSA state 64 + 16 KiB, HCA state 512 KiB
        assert a.kv_fixed_bytes - extra == blocks * 128 * 1024 + n_csa * 80 * 1024 + n_hca * 512 * 1024


def test_config_files_of_both_layouts_parse(tmp_path):
    for i, cfg in enumerate((flash_config(), transformers_style(flash_config()))):
        (tmp_path / str(i)).mkdir()
        (tmp_path / str(i) / "config.json").write_text(json.dumps(cfg))
        assert isinstance(ModelArgs.from_dir(tmp_path / str(i)), V4Args)


@pytest.mark.parametrize("which", ["flash", "pro"])
def test_info_and_plan_from_config_json_alone(tmp_path, capsys, which):
    """`info` and `plan` of V4-Flash / V4-Pro read config.json alone: the parameter counts of §7.1, the KV cache per
    layer kind (§4.1), MXFP4 expert blobs of §7.2 as the host tier, and what a card's budget holds."""
    from dsv3lite.cli import main
    from dsv3lite.family import family_of
    from dsv3lite.offload.planner import make_plan
    from dsv3lite.quant.formats import get_format

    cfg, total, expert_mib, per_token = {"flash": (flash_config(), 284.33e9, 12.75, 6880),
                                         "pro": (pro_config(), 1572.99e9, 33.47, 9848)}[which]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["info", "-w", str(tmp_path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    a = V4Args.from_dict(cfg)
    blob = get_format("mxfp4").layout(a.moe_intermediate_size, a.hidden_size).blob_bytes
    assert round(blob / MiB, 2) == expert_mib
    assert abs(doc["total_params"] - total) < 0.01e9 and doc["kv_bytes_per_token"] == per_token
    assert doc["host_tier_bytes"] == (a.num_hidden_layers + 1) * a.n_routed_experts * blob
    kinds = doc["kv_by_layer_kind"]
    assert sum(k["blocks"] for k in kinds.values()) == a.num_hidden_layers + 1
    assert sum(k["bytes_per_token"] * k["blocks"] for k in kinds.values()) == per_token   # the MTP ring adds none
    assert main(["info", "-w", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"{per_token:,} B per token" in out and "csa 320 B/token" in out
    assert "first 3 layers routed by token id" in out
    # plan: 80 GiB holds the resident set and some of the experts; the host tier is every expert's blob
    assert main(["plan", "-w", str(tmp_path), "--gpu-mem", "80G", "--device", "cpu", "--dtype", "bfloat16",
                 "--ctx-size", "32768"]) == 0
    out = capsys.readouterr().out
    plan = make_plan(a, 80 * 2**30, 32768, blob, "mxfp4", dense_bytes=2)
    assert f"experts resident: {plan.n_slots} / {(a.num_hidden_layers + 1) * a.n_routed_experts}" in out
    assert 0 < plan.n_slots < (a.num_hidden_layers + 1) * a.n_routed_experts and "windows, compressed entries" in out
    assert plan.kv_cache == family_of(a).kv_cache_bytes(a, 32768, True, 2) >= per_token * 32768
