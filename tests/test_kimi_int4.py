"""Kimi-K2-Thinking and Kimi-K2.5 as released: routed experts in compressed-tensors' pack-quantized int4 (packed by
the compressed-tensors package itself), the rest BF16, served as int4g32 blobs without re-quantizing. Oracles:
compressed-tensors (packing, unpacking, dequantization), transformers on the checkpoint dequantized, resident
generation for offloaded; and the commands a user runs (generate, chat, serve, plan, info, quantize as a repack)."""
from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys

import pytest
import torch

import dsv3lite
from dsv3lite.cli import main
from dsv3lite.config import ModelArgs
from dsv3lite.errors import UserError
from dsv3lite.quant.formats import get_format

pytestmark = pytest.mark.usefixtures("one_thread")
EAGER_STEP = True            # offloaded tokens against resident ones, bit for bit, on the eager path (conftest.py)
PROMPT = "The quick brown fox jumps over the lazy dog"
QUIET = dict(device="cpu", ctx_size=96, progress=False, log=lambda m: None)


@pytest.fixture(scope="module")
def k2_dir(tmp_path_factory):
    from dsv3lite.testing_int4 import write_kimi_k2_int4_checkpoint

    return write_kimi_k2_int4_checkpoint(tmp_path_factory.mktemp("kimi-k2-int4"))


@pytest.fixture(scope="module")
def k25_dir(tmp_path_factory):
    from dsv3lite.testing_int4 import write_kimi_k25_int4_checkpoint

    return write_kimi_k25_int4_checkpoint(tmp_path_factory.mktemp("kimi-k25-int4"))


def raw_tensors(path):
    from safetensors.torch import load_file

    return load_file(path / "model.safetensors")


def greedy(llm, n=16):
    llm.stop_ids = set()
    return [c.token_id for c in llm.generate(PROMPT, max_tokens=n)]


# --- the format against compressed-tensors --------------------------------------------------------------------

def test_format_packs_and_unpacks_as_compressed_tensors():
    from compressed_tensors.compressors import unpack_from_int32

    from dsv3lite.quant.int4g32 import int4g32_codes
    from dsv3lite.testing_int4 import ct_pack, ct_unpack

    fmt = get_format("int4g32")
    gen = torch.Generator().manual_seed(0)
    gate, up = (torch.randn(96, 64, generator=gen) * 0.05).bfloat16(), (torch.randn(96, 64, generator=gen)).bfloat16()
    down = (torch.randn(64, 96, generator=gen) * 0.05).bfloat16()
    gate[3, :32] = 0                                          # an all-zero group: the smallest bf16 step as its scale
    up[5, 7] = 1e4                                            # a group whose other codes round to zero
    ct = [ct_pack(w) for w in (gate, up, down)]
    blob = fmt.pack(gate, up, down)                           # compressed-tensors' round-to-nearest, step for step
    repacked = fmt.pack_prequantized(*[t for c in ct for t in (c["weight_packed"], c["weight_scale"])])
    assert torch.equal(blob, repacked)
    layout = fmt.layout(96, 64)
    for m, c, w in zip(("gate", "up", "down"), ct, (gate, up, down)):
        assert torch.equal(layout.view(blob, f"{m}.qweight"), c["weight_packed"].view(torch.uint8))
        assert torch.equal(layout.view(blob, f"{m}.scales"), c["weight_scale"])
        assert torch.equal(int4g32_codes(c["weight_packed"]), unpack_from_int32(c["weight_packed"], 4, w.shape))
    for got, c, w in zip(fmt.unpack(blob, torch.bfloat16), ct, (gate, up, down)):
        assert torch.equal(got, ct_unpack(c["weight_packed"], c["weight_scale"], list(w.shape)))


def test_a_kimi_expert_blob_holds_its_released_bytes():
    n = 2048 * 7168                              # Kimi-K2's routed expert: gate/up 2048x7168, down 7168x2048
    layout = get_format("int4g32").layout(2048, 7168)
    assert layout.blob_bytes == 3 * (n // 2 + 2 * n // 32)           # codes and bf16 scales, nothing else
    assert layout.components["down.scales"].shape == (7168, 64)
    assert layout.components["gate.qweight"].shape == (2048, 3584)


def test_released_experts_are_repacked_bit_exactly(k2_dir):
    """Every routed expert of the checkpoint, as the runtime gets it (quantize's per-expert code): the released words
    and scales byte for byte, decoding to what compressed-tensors unpacks."""
    from dsv3lite.experts import expert_source
    from dsv3lite.testing_int4 import ct_unpack

    args = ModelArgs.from_dir(k2_dir)
    source = expert_source(k2_dir, args, None, blobs_required=False)
    assert source.fmt.name == "int4g32" and source.released and args.released_experts == "int4g32"
    raw = raw_tensors(k2_dir)
    for layer in args.moe_layer_ids:
        blobs = source.layer_blobs(layer)
        for e in range(args.n_routed_experts):
            dense = source.fmt.unpack(blobs[e], torch.bfloat16, source.layout)
            for m, proj, w in zip(("gate", "up", "down"), ("gate_proj", "up_proj", "down_proj"), dense):
                stem = f"model.layers.{layer}.mlp.experts.{e}.{proj}."
                assert torch.equal(source.layout.view(blobs[e], f"{m}.qweight"),
                                   raw[stem + "weight_packed"].view(torch.uint8))
                assert torch.equal(source.layout.view(blobs[e], f"{m}.scales"), raw[stem + "weight_scale"])
                assert torch.equal(w, ct_unpack(raw[stem + "weight_packed"], raw[stem + "weight_scale"],
                                                raw[stem + "weight_shape"].tolist()))


# --- against transformers on the checkpoint dequantized ---------------------------------------------------------

@pytest.mark.parametrize("which", ["k2", "k25"])
@torch.no_grad()
def test_fp32_logits_match_transformers_on_the_dequantized_checkpoint(which, k2_dir, k25_dir, tmp_path,
                                                                      monkeypatch):
    from transformers import AutoModelForCausalLM, Kimi_K25ForConditionalGeneration

    from dsv3lite.builder import load_network
    from dsv3lite.testing_int4 import write_dequantized_copy

    src = k2_dir if which == "k2" else k25_dir
    cls = AutoModelForCausalLM if which == "k2" else Kimi_K25ForConditionalGeneration
    hf = cls.from_pretrained(write_dequantized_copy(src, tmp_path / "ref"), dtype=torch.float32,
                             experts_implementation="eager").eval()
    x = torch.randint(0, 400, (2, 24), generator=torch.Generator().manual_seed(0))
    want = hf(input_ids=x).logits
    kernel = load_network(src, "cpu", torch.float32, log=lambda m: None)
    assert type(kernel.layers[1].ffn.experts).__name__ == "BlobExperts"         # never dense
    got_kernel = kernel(x)
    monkeypatch.setenv("DSV3LITE_CPU_KERNELS", "ref")                           # the dequantizing path
    torch.testing.assert_close(kernel(x), want, atol=1e-4, rtol=1e-4)
    # the CPU kernel's own rounding (int8 activations per group of 32) moves the logits a little
    assert ((got_kernel - want).norm() / want.norm()).item() < 0.05                 # measured: 0.9% K2, 3.2% K2.5
    assert (got_kernel.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


# --- the config: what is served, and one line for the rest ----------------------------------------------------

def test_config_declares_the_released_experts(k2_dir, k25_dir):
    from dsv3lite.testing_int4 import KIMI_K25_INT4_QUANT

    assert ModelArgs.from_dir(k2_dir).released_experts == "int4g32"
    cfg = json.loads((k25_dir / "config.json").read_text())
    assert ModelArgs.from_dict(cfg).released_experts == "int4g32"                  # inside text_config (K2.5's)
    text = {k: v for k, v in cfg["text_config"].items() if k != "quantization_config"}
    top = dict(cfg, text_config=text, quantization_config=KIMI_K25_INT4_QUANT)       # or at the top level
    assert ModelArgs.from_dict(top).released_experts == "int4g32"
    assert ModelArgs.from_dict(dict(cfg, text_config=text)).released_experts is None


def _weights(**kw):
    from dsv3lite.testing_int4 import KIMI_INT4_QUANT

    group = KIMI_INT4_QUANT["config_groups"]["group_0"]
    return dict(KIMI_INT4_QUANT, config_groups={"group_0": dict(group, weights=dict(group["weights"], **kw))})


def _group(**kw):
    from dsv3lite.testing_int4 import KIMI_INT4_QUANT

    return dict(KIMI_INT4_QUANT, config_groups={"group_0": dict(KIMI_INT4_QUANT["config_groups"]["group_0"], **kw)})


def _top(**kw):
    from dsv3lite.testing_int4 import KIMI_INT4_QUANT

    return dict(KIMI_INT4_QUANT, **kw)


@pytest.mark.parametrize("quant,needle", [
    (lambda: _weights(num_bits=8), "num_bits 8"),
    (lambda: _weights(symmetric=False), "symmetric False"),
    (lambda: _weights(group_size=128), "group_size 128"),
    (lambda: _weights(strategy="channel", group_size=None), "strategy 'channel'"),
    (lambda: _weights(type="float"), "type 'float'"),
    (lambda: _weights(actorder="group"), "activation-ordered"),
    (lambda: _group(input_activations={"num_bits": 8, "type": "int", "dynamic": True}), "activation quantization"),
    (lambda: _top(format="naive-quantized"), "format 'naive-quantized'"),
    (lambda: _top(format="nvfp4-pack-quantized"), "format 'nvfp4-pack-quantized'"),
    (lambda: _top(quantization_status="frozen"), "quantization_status 'frozen'"),
    (lambda: _top(kv_cache_scheme={"num_bits": 8, "type": "float"}), "KV cache"),
    (lambda: _top(ignore=["lm_head", "re:.*shared_experts.*"]), "self_attn.q_proj is quantized too"),
    (lambda: _top(ignore=["re:.*"]), "none of the routed experts"),
    (lambda: _top(ignore=_top()["ignore"] + ["re:.*down_proj"]), "only some"),
    (lambda: _top(config_groups={}), "no config_groups"),
    (lambda: _top(ignore=["re:(unclosed"]), "not a regular expression"),
])
def test_config_refuses_what_is_not_served_in_one_line(k2_dir, quant, needle):
    cfg = json.loads((k2_dir / "config.json").read_text())
    with pytest.raises(UserError, match=re.escape(needle)) as e:
        ModelArgs.from_dict(dict(cfg, quantization_config=quant()))
    assert "\n" not in str(e.value) and "compressed-tensors" in str(e.value)


@pytest.mark.parametrize("damage,needle", [
    ("scale_f16", "expected BF16"), ("shape", "weight_shape is"), ("no_scale", "has no"),
])
def test_damaged_released_tensors_are_one_line(k2_dir, tmp_path, damage, needle):
    import shutil

    from safetensors.torch import save_file

    dst = tmp_path / "damaged"
    shutil.copytree(k2_dir, dst)
    raw = raw_tensors(k2_dir)
    stem = "model.layers.2.mlp.experts.5.down_proj."
    if damage == "scale_f16":
        raw[stem + "weight_scale"] = raw[stem + "weight_scale"].half()
    elif damage == "shape":
        raw[stem + "weight_shape"] = torch.tensor([64, 64])
    else:
        del raw[stem + "weight_scale"]
    save_file(raw, dst / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UserError, match=needle) as e:
        dsv3lite.load(dst, **QUIET)
    assert "\n" not in str(e.value)


# --- serving: resident, offloaded, the commands ---------------------------------------------------------------

def test_offloaded_generation_equals_resident_and_the_expert_cache_is_a_repack(k2_dir):
    from dsv3lite import expert_cache_dir
    from dsv3lite.experts import expert_source
    from dsv3lite.hf_checkpoint import CheckpointIndex
    from dsv3lite.quant.checkpoint import open_layer_blobs, read_manifest, source_hash
    from dsv3lite.testing import offload_budget

    resident = greedy(dsv3lite.load(k2_dir, **QUIET))
    for miss in ("fetch", "cpu"):
        llm = dsv3lite.load(k2_dir, gpu_mem=offload_budget(k2_dir, 10, None, ctx=96), miss_policy=miss, **QUIET)
        assert llm.offload is not None and llm.offload.layout.format == "int4g32"
        assert greedy(llm) == resident
        s = llm.stats()["expert_cache"]
        assert s["demand_misses"] > 0 and (s["cpu_experts"] > 0) == (miss == "cpu")
    args = ModelArgs.from_dir(k2_dir)
    digest = source_hash(k2_dir, CheckpointIndex.open(k2_dir))
    entry = next(e for e in expert_cache_dir.entries() if e.source_hash == digest)
    assert entry.format == "int4g32"
    source = expert_source(k2_dir, args, None, blobs_required=True)
    for layer in args.moe_layer_ids:
        assert torch.equal(open_layer_blobs(entry.path, read_manifest(entry.path), layer), source.layer_blobs(layer))


def cli(capsys, *args):
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return out, err


def test_generate_chat_plan_and_info_commands(capsys, monkeypatch, k2_dir):
    doc = json.loads(cli(capsys, "generate", "-w", k2_dir, "-p", PROMPT, "-m", "8", "--json", "-c", "96")[0])
    assert doc["token_ids"] and doc["finish_reason"] in ("stop", "length")
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello there\n/exit\n"))
    _, err = cli(capsys, "chat", "-w", k2_dir, "-m", "6", "-c", "96")
    assert "tok/s" in err
    a = ModelArgs.from_dir(k2_dir)
    blob = get_format("int4g32").layout(a.moe_intermediate_size, a.hidden_size).blob_bytes
    from dsv3lite.utils import format_bytes

    out, _ = cli(capsys, "plan", "-w", k2_dir, "--gpu-mem", "80M", "-c", "96")
    assert f"x {format_bytes(blob)}, int4g32)" in out
    out, _ = cli(capsys, "info", "-w", k2_dir)
    host = format_bytes(len(a.moe_layer_ids) * a.n_routed_experts * blob)
    assert f"host tier when offloaded: {host}" in out and "int4g32" in out and "as released" in out


def test_quantize_is_a_repack(capsys, k2_dir, tmp_path):
    from dsv3lite.experts import expert_source
    from dsv3lite.quant.checkpoint import open_layer_blobs, read_manifest

    dst = tmp_path / "repacked"
    _, err = cli(capsys, "quantize", k2_dir, dst, "--experts", "int4g32")
    assert "repacking" in err
    manifest = read_manifest(dst)
    args = ModelArgs.from_dir(k2_dir)
    source = expert_source(k2_dir, args, None, blobs_required=True)
    assert manifest.format == "int4g32" and manifest.layout == source.layout
    for layer in args.moe_layer_ids:
        assert torch.equal(open_layer_blobs(dst, manifest, layer), source.layer_blobs(layer))
    assert greedy(dsv3lite.load(dst, **QUIET)) == greedy(dsv3lite.load(k2_dir, **QUIET))
    _, err = cli(capsys, "quantize", k2_dir, tmp_path / "requantized", "--experts", "int4", "--fast")
    assert "dequantizes them and quantizes them again" in err


def test_serve_command_offloaded(k2_dir):
    import httpx

    from dsv3lite.testing import offload_budget

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    budget = offload_budget(k2_dir, 10, None, ctx=96)
    proc = subprocess.Popen([sys.executable, "-m", "dsv3lite.cli", "serve", "--no-ui", "-w", str(k2_dir), "--device",
                             "cpu", "--gpu-mem", str(budget), "--port", "0", "-c", "96", "-m", "4"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        match = re.search(r"http://127\.0\.0\.1:(\d+)", line)
        assert match, (line, proc.stderr.read() if proc.poll() is not None else "")
        r = httpx.post(match.group(0) + "/v1/chat/completions", timeout=60,
                       json={"messages": [{"role": "user", "content": "hi"}], "temperature": 0})
        assert r.status_code == 200 and 1 <= r.json()["usage"]["completion_tokens"] <= 4
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
    assert proc.returncode == 0 and "Traceback" not in err, err
    assert "int4g32" in err
