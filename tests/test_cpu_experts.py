"""CPU expert kernel (kernels/cpu_experts.py): the compiled kernel against its twin for every format, shapes with
tails and padding, decode / few-token / prefill calls, expert subsets and per-pair outputs; the fallback path with
the kernel forced off or unbuildable; and the demo's greedy tokens through it."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

import dsv3lite
from dsv3lite.kernels import cpu_build, cpu_experts
from dsv3lite.quant.formats import get_format
from dsv3lite.quant.int4 import Int4Format

pytestmark = pytest.mark.usefixtures("one_thread")

QUIET = dict(progress=False, log=lambda m: None)
FORMATS = [("bf16", None), ("fp8", None), ("int8", None), ("int4", 128), ("int4", 64), ("int4", 32), ("int4g32", 32)]
SHAPES = [(64, 256), (96, 200), (160, 384)]           # (I, D): tails of 8 (bf16, fp8), int4 padding to a group


def compiled() -> bool:
    """The compiled path must run wherever a compiler is (CI has one); a skip elsewhere."""
    if cpu_build.library() is None:
        if shutil.which("g++") or shutil.which("c++") or shutil.which("clang++"):
            pytest.fail(f"a C++ compiler is here but the CPU kernels are not: {cpu_build.status()}")
        pytest.skip(f"no compiled CPU kernels: {cpu_build.status()}")
    return True


def gen(seed: int = 2) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def fmt_of(name, group):
    return Int4Format(group, clip_search=False) if name == "int4" else get_format(name)


def make_pool(name, group, inter, hidden, n_experts=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    fmt = fmt_of(name, group)
    layout = fmt.layout(inter, hidden)
    blobs = [fmt.pack(torch.randn(inter, hidden, generator=gen) * 0.05, torch.randn(inter, hidden, generator=gen) * 0.05,
                      torch.randn(hidden, inter, generator=gen) * 0.05) for _ in range(n_experts)]
    return fmt, layout, torch.stack(blobs)


def routing(n_tokens, n_experts, k, seed=1):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(n_experts, generator=gen)[:k] for _ in range(n_tokens)])
    return ids, torch.rand(n_tokens, k, generator=gen)


def close(got, want, what):
    err = (got - want).abs().max().item()
    scale = want.abs().max().item()
    assert err <= 2e-5 * max(scale, 1e-3), f"{what}: max |kernel - twin| {err:.3e} (max |twin| {scale:.3e})"


@pytest.mark.parametrize("name,group", FORMATS)
@pytest.mark.parametrize("inter,hidden", SHAPES)
def test_kernel_matches_twin(name, group, inter, hidden):
    compiled()
    _, layout, pool = make_pool(name, group, inter, hidden)
    if not cpu_experts.supports(layout):
        assert name == "int4" and group == 32        # an odd number of 32-groups per row: the format's own path
        return
    for n_tokens in (1, 3, 9):                        # decode, MTP verification, prefill (more than a row pass)
        x = torch.randn(n_tokens, hidden, generator=gen())
        ids, w = routing(n_tokens, pool.shape[0], 2)
        close(cpu_experts.cpu_experts_forward(x, ids, w, pool, layout),
              cpu_experts.cpu_experts_ref(x, ids, w, pool, layout), f"{name} g{group} T={n_tokens}")
        close(cpu_experts.cpu_experts_forward(x, ids, w, pool, layout, per_pair=True),
              cpu_experts.cpu_experts_ref(x, ids, w, pool, layout, per_pair=True), f"{name} per pair T={n_tokens}")


@pytest.mark.parametrize("name,group", [("bf16", None), ("fp8", None), ("int8", None), ("int4", 128),
                                        ("int4g32", 32)])
def test_a_token_gets_the_same_bits_in_any_call(name, group):
    """Decode, MTP verification and prefill compute each token alike: a token's output does not depend on the other
    tokens of the call (nor on the thread count)."""
    compiled()
    _, layout, pool = make_pool(name, group, 128, 256)
    x = torch.randn(11, 256, generator=gen())
    ids, w = routing(11, pool.shape[0], 3)
    together = cpu_experts.cpu_experts_forward(x, ids, w, pool, layout)
    alone = torch.cat([cpu_experts.cpu_experts_forward(x[i:i + 1], ids[i:i + 1], w[i:i + 1], pool, layout)
                       for i in range(11)])
    assert torch.equal(together, alone)
    two = cpu_experts.cpu_experts_forward(x, ids, w, pool, layout, threads=2)
    assert torch.equal(together, two)


def test_expert_subsets_skip_the_others_and_keep_the_order():
    """A mapping of some experts' blobs (the offload runtime's CPU misses): only their pairs count, and summing the
    per-pair outputs in ascending id gives the weighted sum."""
    compiled()
    _, layout, pool = make_pool("int4", 128, 64, 256)
    x = torch.randn(4, 256, generator=gen())
    ids, w = routing(4, pool.shape[0], 3)
    some = {1: pool[1], 4: pool[4], 5: pool[5]}
    got = cpu_experts.cpu_experts_forward(x, ids, w, some, layout)
    close(got, cpu_experts.cpu_experts_ref(x, ids, w, some, layout), "subset")
    per_pair = cpu_experts.cpu_experts_forward(x, ids, w, some, layout, per_pair=True)
    for t in range(4):
        for k in range(3):
            assert (int(ids[t, k]) in some) or not per_pair[t, k].any()
    out = torch.full((4, 256), 7.0)
    assert cpu_experts.cpu_experts_forward(x, ids, w, some, layout, out=out) is out
    assert torch.equal(out, got)


@pytest.mark.parametrize("name,group", [("bf16", None), ("fp8", None), ("int4", 128), ("int4g32", 32)])
def test_expert_forward_runs_the_kernel_on_cpu(name, group):
    compiled()
    fmt, layout, pool = make_pool(name, group, 64, 256)
    x = torch.randn(5, 256, generator=gen())
    close(fmt.expert_forward(pool[2], x, layout), cpu_experts.expert_ref(pool[2], x, layout), "expert_forward")


@pytest.mark.parametrize("name,group", [("bf16", None), ("fp8", None), ("int8", None), ("int4", 128),
                                        ("int4g32", 32)])
def test_twin_is_the_dequantized_expert_up_to_its_rounding(name, group):
    """The twin differs from dequantize-then-matmul only by its documented roundings: none for bf16, the bf16
    rounding of scaled fp8 weights (and of int4g32's codes times scales), and int8 activations for int4, int4g32
    and int8."""
    fmt, layout, pool = make_pool(name, group, 64, 256)
    x = torch.randn(3, 256, generator=gen())
    want = fmt.expert_forward_ref(pool[0], x, layout)
    got = cpu_experts.expert_ref(pool[0], x, layout)
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < {"bf16": 1e-6, "fp8": 1e-2, "int8": 4e-2, "int4": 4e-2, "int4g32": 4e-2}[name], rel


def test_forced_off_runs_the_twin_and_blob_experts_the_format_path(monkeypatch):
    from dsv3lite.experts import BlobExperts

    fmt, layout, pool = make_pool("int4", 128, 64, 256)
    x = torch.randn(2, 256, generator=gen())
    ids, w = routing(2, pool.shape[0], 2)
    monkeypatch.setenv("DSV3LITE_CPU_KERNELS", "ref")
    assert cpu_build.library() is None and not cpu_experts.available(layout)
    assert torch.equal(cpu_experts.cpu_experts_forward(x, ids, w, pool, layout),
                       cpu_experts.cpu_experts_ref(x, ids, w, pool, layout))
    experts = BlobExperts(pool, fmt, layout)
    want = torch.zeros(2, 256)
    for t in range(2):
        for k in ids[t].argsort().tolist():
            want[t] += fmt.expert_forward_ref(pool[int(ids[t, k])], x[t:t + 1], layout)[0] * w[t, k]
    torch.testing.assert_close(experts(x, ids, w), want)


def test_no_compiler_means_one_notice_and_the_twin(monkeypatch, capsys):
    _, layout, pool = make_pool("bf16", None, 64, 256)
    x = torch.randn(1, 256, generator=gen())
    ids, w = routing(1, pool.shape[0], 2)
    monkeypatch.setattr(cpu_build, "_compiler", lambda: None)
    cpu_build._load.cache_clear()
    cpu_build._notice.cache_clear()
    try:
        for _ in range(3):
            y = cpu_experts.cpu_experts_forward(x, ids, w, pool, layout)
        assert torch.equal(y, cpu_experts.cpu_experts_ref(x, ids, w, pool, layout))
        notes = [line for line in capsys.readouterr().err.splitlines() if "CPU kernels unavailable" in line]
        assert notes == ["note: CPU kernels unavailable: no C++ compiler on PATH (g++, c++ or clang++); "
                         "using the PyTorch path (slower)"]
    finally:
        cpu_build._load.cache_clear()


def test_build_goes_to_the_cache_dir(tmp_path, monkeypatch, capsys):
    """A fresh cache directory gets one library, built with one line saying so; a second load reuses it quietly."""
    compiled()
    monkeypatch.setenv("DSV3LITE_CACHE_DIR", str(tmp_path))
    cpu_build._load.cache_clear()
    try:
        capsys.readouterr()
        assert cpu_build.library() is not None
        built = list(tmp_path.rglob("*.so"))
        assert len(built) == 1 and built[0].parent.parent == tmp_path / "cpu_kernels"
        said = capsys.readouterr().err.splitlines()
        assert said == [f"compiling the CPU kernels once (about 10-30 s; kept in {built[0].parent})"]
        cpu_build._load.cache_clear()
        assert cpu_build.library() is not None and list(tmp_path.rglob("*.so")) == built
        assert capsys.readouterr().err == ""
    finally:
        monkeypatch.delenv("DSV3LITE_CACHE_DIR")
        cpu_build._load.cache_clear()


def greedy(llm, n=32):
    llm.stop_ids = set()
    return [c.token_id for c in llm.generate("ROMEO:\n", max_tokens=n)]


@pytest.fixture(scope="module")
def plain_tokens():
    return greedy(dsv3lite.load(device="cpu", mtp=False, **QUIET))


def test_demo_bf16_experts_through_the_kernel_keep_the_greedy_tokens(plain_tokens):
    compiled()
    llm = dsv3lite.load(device="cpu", mtp=False, experts="bf16", **QUIET)
    assert isinstance(llm.model.layers[1].ffn.experts, dsv3lite.experts.BlobExperts)
    assert greedy(llm) == plain_tokens
    mtp = dsv3lite.load(device="cpu", mtp=True, mtp_adaptive=False, experts="bf16", **QUIET)
    assert greedy(mtp) == plain_tokens and mtp.stats()["mtp"]["tokens_per_forward"] > 1.2


@pytest.mark.parametrize("experts", ["int4", "int8", "fp8", "int4g32"])
def test_demo_quantized_experts_kernel_logits_near_the_format_path(experts, monkeypatch):
    """The kernel's own roundings (int8 activations for int4 and int8, unrounded fp8 block products) move the
    logits less than the 4-bit or fp8 quantization itself does (int8's is smaller still: both within 1%), and keep
    the perplexity of the reference slice."""
    compiled()
    from dsv3lite import DEMO_DIR

    card = (DEMO_DIR / "README.md").read_text(encoding="utf-8").split("<!-- reference-slice -->", 1)[1]
    llm = dsv3lite.load(device="cpu", mtp=False, experts=experts, **QUIET)
    ids = torch.tensor([llm.tokenizer.encode(card.split("```text\n", 1)[1], add_bos=True)[:256]])
    plain = dsv3lite.load(device="cpu", mtp=False, **QUIET).forward(ids)
    got = llm.forward(ids)
    monkeypatch.setenv("DSV3LITE_CPU_KERNELS", "ref")
    ref = llm.forward(ids)
    kernel_err = (got - ref).norm() / ref.norm()
    quant_err = (ref - plain).norm() / plain.norm()
    assert kernel_err < max(0.5 * quant_err, 0.01), (kernel_err.item(), quant_err.item())   # int8 weights: ~0.3%
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.97

    def ppl(logits):
        return torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]).exp().item()

    assert ppl(got) == pytest.approx(ppl(ref), rel=0.01)


def test_16bit_activations_round_like_combine_experts():
    """bf16 x: each expert's weighted output is rounded to bf16 and added in bf16, in ascending id, as
    model.combine_experts does over the per-expert path, so both give the same bits."""
    compiled()
    from dsv3lite.model import combine_experts

    fmt, layout, pool = make_pool("int4", 128, 64, 256)
    x = torch.randn(3, 256, generator=gen()).to(torch.bfloat16)
    ids, w = routing(3, pool.shape[0], 3)
    want = combine_experts(lambda e, xs: fmt.expert_forward(pool[e], xs, layout).to(xs.dtype), x, ids, w)
    assert torch.equal(cpu_experts.cpu_experts_forward(x, ids, w, pool, layout), want)


def test_realwidth_writer_at_small_widths(tmp_path):
    """The real-width slice writer (here with small widths): shards with an index, FP8 blocks with their scales,
    the MTP layer, deterministic tensors, a checkpoint the loader takes."""
    from dsv3lite.quant.tensorfile import read_header
    from dsv3lite.testing_realwidth import write_realwidth_checkpoint

    small = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
                 v_head_dim=32)
    a = write_realwidth_checkpoint(tmp_path / "a", dtype="fp8", shards=3, mtp=True, widths=small)
    b = write_realwidth_checkpoint(tmp_path / "b", dtype="bf16", widths=small)
    index = json.loads((a / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) == 3
    header = {}
    for f in sorted(a.glob("model-*.safetensors")):
        header.update(read_header(f))
    assert set(header) == set(index)
    assert header["model.layers.1.mlp.experts.3.down_proj.weight"]["dtype"] == "F8_E4M3"
    assert "model.layers.1.mlp.experts.3.down_proj.weight_scale_inv" in header
    assert header["lm_head.weight"]["dtype"] == "BF16" and "model.layers.3.eh_proj.weight" in header
    assert read_header(b / "model.safetensors")["model.layers.2.self_attn.o_proj.weight"]["dtype"] == "BF16"
    llm = dsv3lite.load(str(a), device="cpu", **QUIET)
    assert llm.model.mtp is not None and len(list(llm.generate("ROMEO:", max_tokens=4))) >= 1


def test_large_models_on_cpu_get_expert_blobs_by_default(monkeypatch, plain_tokens):
    """Past the tiny-model size, an HF checkpoint's experts load as blobs in its own precision for the CPU kernel
    (here: the demo with the size rule at 0); the bf16 blobs hold its bf16 weights exactly."""
    compiled()
    from dsv3lite import generate

    monkeypatch.setattr(generate, "SINGLE_THREAD_DECODE_MAX_ACTIVE_PARAMS", 0)
    llm = dsv3lite.load(device="cpu", mtp=False, **QUIET)
    experts = llm.model.layers[1].ffn.experts
    assert isinstance(experts, dsv3lite.experts.BlobExperts) and experts.fmt.name == "bf16"
    assert greedy(llm) == plain_tokens
