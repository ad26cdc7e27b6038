"""`--dense` on a GPU (dsv3lite/dense.py): PackedLinear's GPU path (the W8A16 / W4A16 kernels for M <= 16 rows, the
twins over row chunks for prefill), packing while loading (the same bytes as packing after; an FP8 checkpoint's own
bytes with --dense fp8), the model's memory with packing at load, the default --dense fp8 for an FP8 checkpoint that
needs it, and the checks on the option for cuda.

Without a GPU the GPU path runs on CPU tensors (backend "gpu"), its kernels in Triton's interpreter
(tests/conftest.py sets TRITON_INTERPRET=1 before triton is imported; DSV3LITE_KERNELS=triton here), with fp32 and
fp16 activations (the interpreter's bf16 tl.dot is wrong); with a GPU it runs there.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dsv3lite.dense as dense
from dsv3lite.dense import KEEP, PackedLinear, check_dense, pack_dense, pack_weight, packed_matmul
from dsv3lite.errors import UserError
from dsv3lite.kernels import dispatch
from dsv3lite.quant.fp8 import fp8_block_dequant, fp8_block_quantize
from dsv3lite.quant.int4 import int4_dequant

pytestmark = pytest.mark.usefixtures("one_thread")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CPU = torch.device("cpu")
QUIET = dict(progress=False, log=lambda m: None)
# the kernels round the weights as the twins do; what differs is the order of fp32 accumulation and, for fp16
# activations, the one rounding of the output (relative to the output's largest magnitude)
TOL = {torch.float32: 2e-5, torch.float16: 2e-3}
SMALL = dict(hidden_size=256, intermediate_size=384, moe_intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=4, q_lora_rank=192, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
             v_head_dim=32)


def dequantized(p: PackedLinear) -> torch.Tensor:
    """The packed weight as the formats dequantize it (the twins' weight), fp32."""
    if p.fmt == "fp8":
        return fp8_block_dequant(p.packed, p.scale, torch.float32)
    if p.fmt == "int4":
        return int4_dequant(p.packed, p.scale, p.zero, p.in_features, 128, torch.float32)
    return p.packed.float()


def assert_close(name, got, want, tol):
    got, want = got.float().cpu(), want.float().cpu()
    assert got.shape == want.shape and torch.isfinite(got).all(), name
    err, scale = (got - want).abs().max().item(), max(want.abs().max().item(), 1.0)
    assert err <= tol * scale, f"{name}: max |got - want| {err:.3g} (scale {scale:.3g})"


@pytest.fixture
def kernels_on(monkeypatch):
    """The Triton kernels, not their twins: on CPU tensors in the interpreter."""
    pytest.importorskip("triton")
    monkeypatch.setenv("DSV3LITE_KERNELS", "triton")
    assert dispatch.use_kernels(DEVICE), "TRITON_INTERPRET=1 must be set before triton is imported"


@pytest.fixture(scope="module")
def weight():
    g = torch.Generator().manual_seed(0)
    return torch.randn(200, 320, generator=g) * torch.rand(200, 1, generator=g) * 0.1   # partial 128-blocks


# --- PackedLinear's GPU path ----------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_gpu_path_decode_runs_the_kernels(kernels_on, monkeypatch, weight, fmt):
    """M = 1, 4, 16 rows: the W8A16 / W4A16 kernel (counted), equal to the plain Linear on the dequantized weight."""
    import dsv3lite.kernels.quant_matmul as qm

    p = PackedLinear.from_weight(weight.to(DEVICE), fmt, backend="gpu")
    kernel = {"fp8": "w8a16_matmul", "int4": "w4a16_matmul"}[fmt]
    calls = []
    real = getattr(qm, kernel)
    monkeypatch.setattr(qm, kernel, lambda *a, **k: calls.append(1) or real(*a, **k))
    w = dequantized(p)
    g = torch.Generator().manual_seed(1)
    for m, dt in ((1, torch.float32), (4, torch.float32), (16, torch.float32), (4, torch.float16)):
        x = torch.randn(m, 320, generator=g).to(DEVICE, dt)
        assert_close(f"{fmt} M={m} {dt}", p(x), F.linear(x.float(), w.to(dt).float()), TOL[dt])
    assert len(calls) == 4


@pytest.mark.parametrize("fmt", ["fp8", "int4", "bf16"])
def test_gpu_path_prefill_dequantizes_row_chunks(monkeypatch, weight, fmt):
    """M > 16 rows: the twins over row chunks of the weight (here 128 rows: 2 chunks, the last partial), no kernel;
    the result is the plain Linear on the dequantized weight, and the chunking changes nothing."""
    import dsv3lite.kernels.quant_matmul as qm

    p = PackedLinear.from_weight(weight.to(DEVICE), fmt, backend="gpu")
    x = torch.randn(2, 20, 320, generator=torch.Generator().manual_seed(2)).to(DEVICE)    # M = 40, leading dims
    whole = p(x)
    monkeypatch.setattr(dense, "CHUNK_ELEMENTS", 128 * 320)
    for name in ("w8a16_matmul", "w4a16_matmul"):
        monkeypatch.setattr(qm, name, lambda *a, **k: pytest.fail("no kernel for prefill rows"))
    chunked = p(x)
    assert chunked.shape == (2, 20, 200)
    assert_close(f"{fmt} chunked", chunked, whole, 1e-6)
    assert_close(f"{fmt} prefill", chunked, F.linear(x, dequantized(p)), TOL[torch.float32])


def test_gpu_path_bf16_is_a_cast(weight):
    p = PackedLinear.from_weight(weight, "bf16", backend="gpu")
    assert p.packed.dtype == torch.bfloat16 and p.scale is None and p.zero is None
    x = torch.randn(3, 320, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    assert torch.equal(p(x), F.linear(x, weight.to(torch.bfloat16)))


def test_cpu_path_is_unchanged(weight):
    """Weights on the CPU: kernels/cpu_linear.py as before (its own numerics: int4 against int8 activations)."""
    from dsv3lite.kernels.cpu_linear import linear_forward

    x = torch.randn(5, 320, generator=torch.Generator().manual_seed(4))
    for fmt in ("fp8", "int4", "int8", "bf16"):
        p = PackedLinear.from_weight(weight, fmt)
        assert p.backend == "cpu"
        assert torch.equal(p(x), linear_forward(x, fmt, 200, p.packed, p.scale, p.zero))


# --- the option on cuda -------------------------------------------------------------------------------------

def test_check_dense_on_cuda(weight):
    cuda = torch.device("cuda")
    for d in ("fp8", "int4", "bf16"):
        check_dense(d, cuda)
    with pytest.raises(UserError) as e:
        check_dense("int8", cuda)
    assert "\n" not in str(e.value) and "int8" in str(e.value) and "--device cpu" in str(e.value)
    with pytest.raises(UserError, match="no GPU kernel"):
        PackedLinear.from_weight(weight, "int8", backend="gpu")
    with pytest.raises(UserError, match="no GPU kernel"):
        packed_matmul(weight[:2], "int8", 200, *pack_weight(weight, "int8"), backend="gpu")
    with pytest.raises(UserError, match="mps"):
        check_dense("fp8", torch.device("mps"))


# --- packing ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["fp8", "int4", "int8", "bf16"])
def test_packing_by_row_chunks_changes_nothing(monkeypatch, fmt):
    w = torch.randn(300, 200, generator=torch.Generator().manual_seed(5))
    whole = pack_weight(w, fmt)
    monkeypatch.setattr(dense, "CHUNK_ELEMENTS", 128 * 200)            # 3 chunks of rows, the last partial
    for a, b in zip(pack_weight(w, fmt), whole):
        assert (a is None and b is None) or (a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)))


def test_fp8_source_keeps_its_bytes():
    q, s = fp8_block_quantize(torch.randn(300, 200, generator=torch.Generator().manual_seed(6)))
    got_q, got_s, zero = pack_weight(q, "fp8", s)
    assert zero is None and torch.equal(got_q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(got_s, s)
    # other dtypes: the values the loader would give (bf16 dequantized), packed
    for fmt in ("int4", "bf16"):
        for a, b in zip(pack_weight(q, fmt, s), pack_weight(fp8_block_dequant(q, s, torch.bfloat16), fmt)):
            assert (a is None and b is None) or torch.equal(a, b)


# --- packing while loading ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def realwidth(tmp_path_factory):
    """Small-width slices of V3 written as the hub does: bf16, and FP8 (e4m3 + 128x128 scale_inv) with MTP."""
    from dsv3lite.testing_realwidth import write_realwidth_checkpoint

    root = tmp_path_factory.mktemp("dense-load")
    return {dt: write_realwidth_checkpoint(root / dt, layers=2, experts=8, vocab=300, dtype=dt, mtp=dt == "fp8",
                                           widths=SMALL) for dt in ("bf16", "fp8")}


def load(root, dense_dtype=None, dtype=torch.float32, log=None, device=DEVICE):
    """The model of `root` on `device` (the GPU where there is one: packing and the GPU path there)."""
    from dsv3lite.loader import Loader

    return Loader(root, device, dtype, progress=False, log=log or (lambda m: None), dense=dense_dtype).load()


def packed_modules(model) -> dict[str, PackedLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, PackedLinear)}


def same_bytes(a: PackedLinear, b: PackedLinear) -> bool:
    return all((x is None and y is None) or (x.dtype == y.dtype and torch.equal(bytes_of(x), bytes_of(y)))
               for x, y in zip((a.packed, a.scale, a.zero), (b.packed, b.scale, b.zero)))


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.uint8)


@pytest.mark.parametrize("fmt", ["fp8", "int4", "int8", "bf16"])
def test_packing_while_loading_equals_packing_after(realwidth, fmt):
    """A bf16 checkpoint (fp32 compute) and an FP8 one with --dense other than fp8: the bytes of packing the loaded
    model; every Linear but KEEP packed. (int8 on a GPU: the one-line error.)"""
    if DEVICE.type == "cuda" and fmt == "int8":
        with pytest.raises(UserError, match="no GPU kernel"):
            load(realwidth["bf16"], fmt)
        return
    for src in ("bf16", "fp8") if fmt != "fp8" else ("bf16",):
        lines = []
        during = load(realwidth[src], fmt, log=lines.append)
        after = load(realwidth[src])
        pack_dense(after, fmt)
        a, b = packed_modules(during), packed_modules(after)
        assert a.keys() == b.keys() and len(a) >= 10
        assert all(same_bytes(a[n], b[n]) for n in a), src
        assert not [n for n, m in during.named_modules() if isinstance(m, torch.nn.Linear) and n.rpartition(".")[2] not in KEEP]
        assert sum("while loading" in line for line in lines) == 1


def test_fp8_checkpoint_with_dense_fp8_keeps_the_checkpoint_bytes(realwidth):
    """--dense fp8 on an FP8 checkpoint: each FP8 weight's e4m3 bytes and scale_inv exactly as stored; the bf16 ones
    (lm_head, eh_proj) block-quantized; the CPU and the GPU paths on those bytes agree, and stay near the model
    loaded without --dense (whose lm_head and eh_proj are not quantized)."""
    from dsv3lite.hf_checkpoint import CheckpointIndex, TensorReader, checkpoint_name

    root = realwidth["fp8"]
    lines = []
    model = load(root, "fp8", log=lines.append)
    mods = packed_modules(model)
    kept = 0
    with TensorReader(CheckpointIndex.open(root)) as reader:
        for name, p in mods.items():
            w, s = reader.weight(checkpoint_name(name + ".weight", model.args))
            if s is None:
                want = pack_weight(w.float(), "fp8")
            else:
                want, kept = (w, s, None), kept + 1
            assert torch.equal(bytes_of(p.packed), bytes_of(want[0])) and torch.equal(bytes_of(p.scale), bytes_of(want[1]))
    assert kept == len(mods) - 2                                     # lm_head and eh_proj are bf16 in the checkpoint
    assert isinstance(model.head, PackedLinear) and isinstance(model.mtp.eh_proj, PackedLinear)
    assert any(f"{kept} of them the checkpoint's fp8 bytes" in line for line in lines)
    plain = load(root)
    tokens = torch.tensor([[3, 17, 42, 99, 5, 250]], device=DEVICE)
    with torch.inference_mode():
        want = plain(tokens)
        if DEVICE.type == "cpu":
            on_cpu = model(tokens)
            for p in mods.values():      # the GPU path on the same bytes (its twins, on CPU)
                p.backend = "gpu"
        on_gpu = model(tokens)
    assert all(p.backend == "gpu" for p in mods.values())
    if DEVICE.type == "cpu":
        assert_close("cpu vs gpu path", on_cpu, on_gpu, 1e-2)   # the CPU kernel scales each block's partial dot
    assert_close("gpu path vs no --dense", on_gpu, want, 5e-2)


def test_memory_with_packing_while_loading(realwidth, monkeypatch):
    """With --dense int4 at bf16 compute no float copy of a packed weight remains, and the non-expert tensors the
    model holds while loading stay well below their bf16 bytes: at every step, those placed so far plus the one
    matrix being packed. (Routed experts, here dense in the model, are left out: offloading provides them.)"""
    from dsv3lite.loader import Loader

    def held(model) -> int:
        named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
        tensors = {id(t): t for n, t in named if t is not None and not t.is_meta and ".experts." not in n}
        return sum(t.numel() * t.element_size() for t in tensors.values())

    peak = [0]
    real = Loader._pack_into

    def tracked(self, model, module_name, weight, scale, dtype):
        real(self, model, module_name, weight, scale, dtype)
        peak[0] = max(peak[0], held(model) + weight.numel() * 2)          # + this matrix's bf16 copy while packing

    monkeypatch.setattr(Loader, "_pack_into", tracked)
    model = load(realwidth["bf16"], "int4", dtype=torch.bfloat16)
    monkeypatch.undo()
    bf16 = held(load(realwidth["bf16"], dtype=torch.bfloat16))
    for p in packed_modules(model).values():
        assert p.packed.dtype == torch.uint8 and p.scale.dtype == p.zero.dtype == torch.float16
    floats = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.rpartition(".")[2] not in KEEP]
    assert not floats
    assert held(model) < 0.5 * bf16 and peak[0] < 0.6 * bf16, (held(model), peak[0], bf16)


# --- the default --dense on CUDA ------------------------------------------------------------------------------

def test_default_dense_fp8_for_an_fp8_checkpoint_that_needs_it(realwidth):
    """On cuda (simulated: the decision reads shapes only), a budget between the fp8-dense and bf16-dense minimums
    gets --dense fp8 with one log line; an explicit --dense, a roomy budget, CPU or a bf16 checkpoint get no change;
    below the fp8 minimum, a note when --dense int4 would fit."""
    from dsv3lite.builder import choose_dense
    from dsv3lite.config import ModelArgs
    from dsv3lite.offload.setup import plan_for

    cuda, ctx = torch.device("cuda"), 256
    root, bf16 = realwidth["fp8"], realwidth["bf16"]
    args, bf16_args = ModelArgs.from_dir(root), ModelArgs.from_dir(bf16)

    def minimum(d):
        p = plan_for(root, args, 1 << 40, ctx, "int4", True, torch.bfloat16, d)[0]
        return p.resident + 2 * args.num_experts_per_tok * p.slot_bytes

    int4, fp8, full = minimum("int4"), minimum("fp8"), minimum(None)
    assert int4 < fp8 < full
    budget = (fp8 + full) // 2

    def choice(d, device=cuda, at=budget, where=root, a=args):
        lines = []
        return choose_dense(where, a, d, device, at, ctx, "int4", True, torch.bfloat16, lines.append), lines

    got, lines = choice(None)
    assert got == "fp8" and len(lines) == 1 and "--dense fp8" in lines[0] and "expert slots" in lines[0]
    assert choice("int4") == ("int4", []) and choice("bf16") == ("bf16", [])
    assert choice(None, at=full + (64 << 20)) == (None, [])
    assert choice(None, device=CPU) == (None, [])
    got, lines = choice(None, at=(int4 + fp8) // 2)                         # fp8 does not fit, int4 does
    assert got is None and len(lines) == 1 and "--dense int4" in lines[0]
    assert choice(None, at=int4 // 2) == (None, [])                         # nothing fits: the budget error follows
    got, lines = choice(None, where=bf16, a=bf16_args)                      # a bf16 checkpoint: never fp8 by default
    assert got is None and all("--dense fp8" not in line for line in lines)
