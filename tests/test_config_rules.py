"""A checkpoint that would run and print garbage is refused in one line: config fields out of type or range (the
rule table in config_rules.py), a layer count that disagrees with the checkpoint, integer weights without a scale;
tensors without a place are named; non-finite logits end the run with one line instead of decoding as token 0."""
from __future__ import annotations

import json
import math
import shutil
from dataclasses import fields

import pytest
import torch

import dsv3lite
from dsv3lite import config_rules
from dsv3lite.cli import main
from dsv3lite.config import ModelArgs

pytestmark = pytest.mark.usefixtures("one_thread")


def with_config(src, dst, **changes):
    """A copy of checkpoint `src` whose config.json has `changes` (a key set to ... is removed); weights linked."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name != "config.json":
            (dst / f.name).symlink_to(f)
    cfg = json.loads((src / "config.json").read_text())
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    (dst / "config.json").write_text(json.dumps(cfg, allow_nan=True))
    return dst


def one_line_error(capsys, argv, *needles):
    rc = main([str(a) for a in argv])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert rc != 0 and len(errors) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in errors[0], errors[0]


BAD = [
    ({"num_hidden_layers": -1}, "num_hidden_layers must be >= 1, got -1"),
    ({"num_hidden_layers": 0}, "num_hidden_layers must be >= 1"),
    ({"rms_norm_eps": -1}, "rms_norm_eps must be > 0"),
    ({"num_experts_per_tok": 0}, "num_experts_per_tok must be >= 1"),
    ({"topk_group": 5}, "topk_group must not exceed n_group"),
    ({"rope_parameters": {"factor": 0}}, "rope_factor must be > 0, got 0"),
    ({"rope_parameters": {"factor": 0.5}}, "YaRN rope factor must be >= 1"),
    ({"rope_parameters": {"rope_theta": "big"}}, "rope_theta must be a number"),
    ({"rope_parameters": {"original_max_position_embeddings": -4}}, "original_max_position_embeddings must be >= 1"),
    ({"num_nextn_predict_layers": -1}, "num_nextn_predict_layers must be >= 0"),
    ({"hidden_size": -256}, "hidden_size must be >= 1, got -256"),
    ({"hidden_size": "abc"}, "hidden_size must be an integer, got 'abc'"),
    ({"hidden_size": 6.5}, "hidden_size must be an integer, got 6.5"),
    ({"hidden_size": float("nan")}, "hidden_size must be an integer, got nan"),
    ({"rms_norm_eps": float("inf")}, "rms_norm_eps must be finite"),
    ({"vocab_size": True}, "vocab_size must be an integer"),
    ({"qk_rope_head_dim": 15}, "qk_rope_head_dim must be even"),
    ({"tie_word_embeddings": "no"}, "tie_word_embeddings must be true or false"),
    ({"scoring_func": "relu"}, "scoring_func must be one of sigmoid, softmax"),
    ({"eos_token_id": [1, -2]}, "eos_token_id must be >= 0"),
    ({"num_experts_per_tok": 20, "n_routed_experts": 16}, "num_experts_per_tok must not exceed n_routed_experts"),
    ({"num_experts_per_tok": 12}, "num_experts_per_tok must not exceed the experts of topk_group groups"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}}, "weight_block_size"),
]


@pytest.mark.parametrize("changes,needle", BAD, ids=[next(iter(c)) + f"={list(c.values())[0]!r}" for c, _ in BAD])
def test_a_field_out_of_range_or_type_is_one_line(capsys, tmp_path, v3_dir, changes, needle):
    bad = with_config(v3_dir, tmp_path / "bad", **changes)
    one_line_error(capsys, ["plan", "-w", bad, "--gpu-mem", "1G", "--device", "cpu"], "config:", needle)
    one_line_error(capsys, ["info", "-w", bad], needle)


def test_a_bad_config_stops_a_run_before_it_loads(capsys, tmp_path, v3_dir):
    bad = with_config(v3_dir, tmp_path / "bad", rms_norm_eps=-1)
    one_line_error(capsys, ["generate", "-w", bad, "-p", "hi", "-m", "2"], "rms_norm_eps must be > 0")


def test_every_field_the_model_reads_has_a_rule():
    exempt = {"model_type", "mlp_layer_types", "fp8_block_size"}          # checked where they are read
    ruled = {f.name for f in fields(ModelArgs) if f.init} - exempt
    assert ruled == set(config_rules.FIELD_RULES)


def test_a_family_adds_rules_through_the_table(monkeypatch):
    base = ModelArgs(model_type="deepseek_v2", scoring_func="softmax", topk_method="greedy", n_group=1,
                     topk_group=1)
    assert base.index_topk == 0
    monkeypatch.setitem(config_rules.FAMILY_RULES, "deepseek_v2", {"n_shared_experts": config_rules.Rule("int", lo=3)})
    with pytest.raises(dsv3lite.errors.UserError, match="n_shared_experts must be >= 3, got 1"):
        ModelArgs(model_type="deepseek_v2", scoring_func="softmax", topk_method="greedy", n_group=1, topk_group=1)
    ModelArgs()                                            # other families keep the shared rules


def test_published_configs_pass():
    import runpy
    from pathlib import Path

    models = runpy.run_path(str(Path(__file__).parents[1] / "scripts" / "memory_table.py"))["MODELS"]
    for cfg in models.values():
        ModelArgs.from_dict(json.loads(json.dumps(cfg)))


@pytest.mark.parametrize("layers,needle", [(7, "its MTP layer is model.layers.6"), (5, "decoder has 6 layers")])
def test_a_layer_count_that_disagrees_with_the_checkpoint_is_one_line(capsys, tmp_path, layers, needle):
    from dsv3lite import DEMO_DIR

    bad = with_config(DEMO_DIR, tmp_path / "bad", num_hidden_layers=layers)
    for argv in (["generate", "-p", "hi", "-m", "2"], ["generate", "-p", "hi", "-m", "2", "--no-mtp"],
                 ["plan", "--gpu-mem", "1G", "--device", "cpu"]):
        one_line_error(capsys, argv + ["-w", bad], f"num_hidden_layers {layers}", needle)


def test_tensors_without_a_place_are_named(tmp_path, v3_dir):
    from safetensors.torch import load_file, save_file

    dst = tmp_path / "extra"
    shutil.copytree(v3_dir, dst)
    tensors = load_file(dst / "model.safetensors")
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    tensors["vision_tower.patch_embed.weight"] = torch.ones(2, 2)
    save_file(tensors, dst / "model.safetensors")
    lines = []
    dsv3lite.load(dst, device="cpu", progress=False, log=lines.append)
    notes = [line for line in lines if "no place" in line]
    assert len(notes) == 1 and "2 checkpoint tensors" in notes[0]
    assert "model.layers.0.self_attn.rotary_emb.inv_freq" in notes[0] and "vision_tower.patch_embed.weight" in notes[0]
    quiet = []
    dsv3lite.load(v3_dir, device="cpu", progress=False, log=quiet.append)
    assert not any("no place" in line for line in quiet)


def test_integer_weights_without_a_scale_are_refused(capsys, tmp_path, v3_dir):
    from safetensors.torch import load_file, save_file

    dst = tmp_path / "int8"
    shutil.copytree(v3_dir, dst)
    tensors = load_file(dst / "model.safetensors")
    name = "model.layers.0.self_attn.o_proj.weight"
    tensors[name] = tensors[name].round().to(torch.int8)
    save_file(tensors, dst / "model.safetensors")
    one_line_error(capsys, ["generate", "-w", dst, "-p", "hi", "-m", "2"], name, "int8", "no quantization")


def test_non_finite_logits_end_the_run_in_one_line(capsys, tmp_path, v3_dir):
    from safetensors.torch import load_file, save_file

    dst = tmp_path / "nan"
    shutil.copytree(v3_dir, dst)
    tensors = load_file(dst / "model.safetensors")
    tensors["model.norm.weight"][3] = math.nan
    save_file(tensors, dst / "model.safetensors")
    for extra in ([], ["--temp", "0.7"], ["--json"]):
        one_line_error(capsys, ["generate", "-w", dst, "-p", "hi", "-m", "3", *extra], "logits are not finite")


def test_non_finite_logits_are_a_500_on_the_server(tmp_path, v3_dir):
    import httpx
    from safetensors.torch import load_file, save_file

    from dsv3lite.app.server import ServerThread, create_app

    dst = tmp_path / "nan"
    shutil.copytree(v3_dir, dst)
    tensors = load_file(dst / "model.safetensors")
    tensors["lm_head.weight"][5, 0] = math.inf
    save_file(tensors, dst / "model.safetensors")
    llm = dsv3lite.load(dst, device="cpu", ctx_size=64, progress=False, log=lambda m: None)
    lines = []
    with ServerThread(create_app(llm, ui=False, log=lines.append)) as s:
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 500 and r.json()["error"]["code"] == "model_fault"
    assert not any("Traceback" in line for line in lines)
