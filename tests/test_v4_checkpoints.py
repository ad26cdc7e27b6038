"""DeepSeek-V4 checkpoints in the released layout: routed experts served as released (MXFP4 blobs through the CPU
kernel) against the same experts decoded; the V4-geometry checkpoint (43 layers, 256 experts, top-6, 3 hash
layers, V4-Flash's compress_ratios) written tensor by tensor, loaded and decoded; the real-width slice's
tensor list; DSpark drafters left unread."""
from __future__ import annotations

import json

import pytest
import torch

from dsv3lite.config import ModelArgs
from dsv3lite.errors import UserError
from dsv3lite.experts import BlobExperts
from dsv3lite.kernels import cpu_experts
from dsv3lite.testing_v4 import (FLASH_RATIOS, load_v4, official_tensors, release_dtype, v4_flash_slice_config,
                                 v4_geometry_config, write_v4_pair)
from dsv3lite.v4.cache import new_cache
from dsv3lite.v4.config import V4Args

pytestmark = pytest.mark.usefixtures("one_thread")
QUIET = dict(log=lambda m: None)


@pytest.fixture(scope="module")
def official(tmp_path_factory):
    root = tmp_path_factory.mktemp("v4released")
    return write_v4_pair(root / "official", root / "hf", "tiny")[0]


@pytest.mark.cpu_kernels
def test_released_experts_through_the_kernel(official, monkeypatch):
    decoded = load_v4(official, **QUIET)
    served = load_v4(official, released_experts=True, **QUIET)
    assert all(isinstance(m.experts, BlobExperts) and m.experts.fmt.name == "mxfp4" for m in served.moe_modules())
    ids = torch.randint(2, decoded.args.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ref = decoded(ids)
        monkeypatch.setattr(cpu_experts, "MXFP4_ACT", "fp32")          # exact weights, fp32 activations
        torch.testing.assert_close(served(ids), ref, rtol=0, atol=1e-4)
        # the MTP block's experts too
        state = decoded.hidden(ids[:, :-1])
        torch.testing.assert_close(served.mtp_logits(served.mtp_hidden(state, ids[:, 1:])),
                                   decoded.mtp_logits(decoded.mtp_hidden(state, ids[:, 1:])), rtol=0, atol=1e-4)
        # the default, int8 activations per 32-block: at the seam, within their rounding
        monkeypatch.setattr(cpu_experts, "MXFP4_ACT", "int8")
        gen = torch.Generator().manual_seed(1)
        for dense, blobs in zip(decoded.moe_modules(), served.moe_modules()):
            x = torch.randn(5, decoded.args.hidden_size, generator=gen)
            e = torch.stack([torch.randperm(decoded.args.n_routed_experts, generator=gen)[:2] for _ in range(5)])
            w = torch.rand(5, 2, generator=gen)
            want = dense.experts(x, e, w)
            err = (blobs.experts(x, e, w) - want).norm() / want.norm()
            assert 0 < err < 2e-2


def test_base_checkpoint_fp8_experts_with_float32_scales(tmp_path):
    """V4 Base (§5.5): routed experts FP8 128x128 with F32 `.scale` grids and no expert_dtype; they decode as every
    FP8 weight does (bf16(fp32(q) * s)) to the values of the fp32 copy."""
    official, hf = write_v4_pair(tmp_path / "official", tmp_path / "hf", "tiny", base=True)
    from safetensors import safe_open
    with safe_open(official / "model.safetensors", "pt") as f:
        assert f.get_slice("layers.3.ffn.experts.5.w2.weight").get_dtype() == "F8_E4M3"
        assert f.get_slice("layers.3.ffn.experts.5.w2.scale").get_dtype() == "F32"
    a, b = load_v4(official, mtp=False, **QUIET), load_v4(hf, **QUIET)
    assert a.args.expert_dtype is None
    for name, t in a.state_dict().items():
        assert torch.equal(t, b.state_dict()[name]), name
    with pytest.raises(UserError, match="not MXFP4"):
        load_v4(official, released_experts=True, **QUIET)


def test_dspark_drafter_is_not_read(official, tmp_path):
    """A checkpoint whose config declares the DSpark drafter loads its backbone; mtp.* tensors stay unread."""
    cfg = json.loads((official / "config.json").read_text())
    cfg.update(compress_ratios=cfg["compress_ratios"][:-1] + [0, 0, 0], dspark_target_layer_ids=[2, 3, 4])
    for f in official.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    lines = []
    model = load_v4(tmp_path, log=lines.append)
    assert model.mtp is None and any("DSpark" in line for line in lines)
    ids = torch.randint(2, 300, (1, 12))
    with torch.inference_mode():
        assert torch.equal(model(ids), load_v4(official, mtp=False, **QUIET)(ids))


def test_geometry_checkpoint(v4_geometry_dir):
    cfg, path = v4_geometry_config(), v4_geometry_dir
    args = ModelArgs.from_dir(path)
    assert (args.num_hidden_layers, args.n_routed_experts, args.num_experts_per_tok, args.num_hash_layers) == \
        (43, 256, 6, 3)
    assert [{"sliding": 0, "csa": 4, "hca": 128}[k] for k in args.attn_kinds] == FLASH_RATIOS
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len({f for f in index.values()}) > 10                              # sharded a few layers a file
    model = load_v4(path, released_experts=True, **QUIET)
    assert len(model.layers) == 43 and model.mtp is not None
    ids = torch.randint(0, cfg["vocab_size"], (1, 20), generator=torch.Generator().manual_seed(1))
    routes = {}
    model.add_observer(on_routing=lambda layer, e, s: routes.setdefault(layer, []).append(e.clone()))
    cache = new_cache(args, 32, with_mtp=False)
    with torch.inference_mode():
        full = model(ids)
        state = model.hidden(ids[:, :16], 0, cache)
        steps = [model.hidden(ids[:, p:p + 1], p, cache) for p in range(16, 20)]
        decoded = model.logits(torch.cat([state] + steps, 1))
    assert torch.isfinite(full).all()
    torch.testing.assert_close(decoded, full, rtol=0, atol=1e-3)    # int8 activations: per-call rounding
    for layer in range(3):                                      # hash layers: the experts are tid2eid[token]
        table = model.layers[layer].ffn.gate.tid2eid
        assert torch.equal(routes[layer][0], table[ids.flatten()])
        assert all(len(set(row)) == 6 for row in table[:50].tolist())


def test_flash_slice_tensors():
    """The real-width slice (written by benchmarks): V4-Flash's shapes and released dtypes (§5.1)."""
    cfg = v4_flash_slice_config(layers=3)
    args = V4Args.from_dict(cfg)
    assert args.attn_kinds == ["sliding", "csa", "hca", "sliding"]
    shapes = dict(official_tensors(cfg))
    expect = {"embed.weight": (4096, 4096), "layers.1.attn.wq_b.weight": (32768, 1024),
              "layers.1.attn.wo_a.weight": (8192, 4096), "layers.1.attn.wo_b.weight": (4096, 8192),
              "layers.1.attn.compressor.wkv.weight": (1024, 4096), "layers.2.attn.compressor.wkv.weight": (512, 4096),
              "layers.1.attn.compressor.ape": (4, 1024), "layers.2.attn.compressor.ape": (128, 512),
              "layers.1.attn.indexer.wq_b.weight": (8192, 1024), "layers.1.attn.indexer.weights_proj.weight": (64, 4096),
              "layers.1.attn.indexer.compressor.wkv.weight": (256, 4096), "layers.1.ffn.experts.3.w1.weight":
              (2048, 4096), "layers.1.ffn.experts.3.w2.weight": (4096, 2048), "layers.0.ffn.gate.tid2eid": (4096, 6),
              "layers.1.hc_attn_fn": (24, 16384), "hc_head_fn": (4, 16384), "mtp.0.e_proj.weight": (4096, 4096)}
    for name, shape in expect.items():
        assert shapes[name] == shape, name
    kinds = {n: release_dtype(n) for n in expect}
    assert kinds["layers.1.ffn.experts.3.w1.weight"] == "mxfp4" and kinds["layers.1.attn.wq_b.weight"] == "fp8"
    assert kinds["layers.1.attn.compressor.wkv.weight"] == "bf16" and kinds["layers.1.hc_attn_fn"] == "f32"
    assert kinds["layers.0.ffn.gate.tid2eid"] == "i32" and kinds["mtp.0.e_proj.weight"] == "fp8"


def _greedy(path, **kw) -> list[int]:
    import dsv3lite

    llm = dsv3lite.load(path, device="cpu", ctx_size=96, progress=False, log=lambda m: None, **kw)
    llm.stop_ids = set()
    return [c.token_id for c in llm.generate([5, 9, 17, 33, 2, 41], max_tokens=12)]


def test_quantize_writes_v4_expert_major_directories(official, tmp_path):
    """`quantize --experts mxfp4` of a released checkpoint repacks its experts (the bytes the runtime serves,
    MTP block included) and the directory decodes the source's tokens; another format is said to quantize again."""
    from dsv3lite.experts import expert_source
    from dsv3lite.quant.checkpoint import open_layer_blobs, quantize_checkpoint, read_manifest

    lines = []
    dst = quantize_checkpoint(official, tmp_path / "mxfp4", experts="mxfp4", progress=False, log=lines.append)
    m = read_manifest(dst)
    args = ModelArgs.from_dir(official)
    assert m.format == "mxfp4" and m.moe_layers == list(range(args.num_hidden_layers + 1))
    source = expert_source(official, args, None, blobs_required=True)
    assert source.released
    for layer in (0, args.mtp_layer_id):
        assert torch.equal(open_layer_blobs(dst, m, layer), source.layer_blobs(layer))
    assert not any("quantizes them again" in line for line in lines)
    assert _greedy(dst) == _greedy(official)
    lines = []
    quantize_checkpoint(official, tmp_path / "int8", experts="int8", progress=False, log=lines.append)
    assert any("stores its routed experts as mxfp4" in line for line in lines)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("v4base")
    return write_v4_pair(root / "base", root / "hf", "tiny", base=True)[0]


@pytest.mark.parametrize("fmt", ["mxfp4", "int4", "int8"])
def test_quantize_a_base_checkpoint(base, tmp_path, fmt):
    """A V4 Base checkpoint (FP8 experts) quantized to mxfp4 / int4 / int8: the directory loads and decodes the tokens
    of the same checkpoint with the experts quantized at load."""
    from dsv3lite.quant.checkpoint import quantize_checkpoint

    dst = quantize_checkpoint(base, tmp_path / fmt, experts=fmt, progress=False, log=lambda m: None)
    assert _greedy(dst) == _greedy(base, experts=fmt)
