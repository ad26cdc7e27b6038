"""quant_matmul: W4A16 / W8A16 Triton kernels against their twins, and the twins against the formats' math.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (tests/conftest.py turns it on before
triton is imported); with a GPU they run on it. Without a GPU the kernels are also compiled for sm_90
(H100/H200) with the installed Triton, so GPU-only compile errors show up here.
"""
import pytest
import torch
import torch.nn.functional as F

from dsv3lite.kernels import dispatch   # imports no triton
from dsv3lite.quant.formats import get_format
from dsv3lite.quant.fp8 import fp8_block_dequant, fp8_block_quantize
from dsv3lite.quant.int4 import int4_dequant, int4_quantize

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
triton = pytest.importorskip("triton")

import dsv3lite.kernels.quant_matmul as qm  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def interpreter_on_cpu():
    assert DEVICE.type == "cuda" or dispatch.interpreted(), "TRITON_INTERPRET=1 must be set before triton is imported"


@pytest.fixture(autouse=True, scope="module")
def one_cpu_thread():
    # tensors here are tiny: torch's intra-op threads only add waiting, badly so on a busy machine
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# The kernel rounds weights exactly as the twin does; only the order of fp32 accumulation differs, and a
# 16-bit output is rounded once from fp32 (the twin's matmul may round differently in its last bit).
TOLERANCES = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def assert_close(name, got, want, tol):
    got, want = got.float().cpu(), want.float().cpu()
    diff = (got - want).abs()
    scale = max(want.abs().max().item(), 1.0)
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.isfinite(got).all(), f"{name}: non-finite output"
    assert diff.max().item() <= tol * scale, (
        f"{name}: max abs diff {diff.max().item():.3g}, mean abs diff {diff.mean().item():.3g} (scale {scale:.3g})")


def make_int4(n, k, group, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    return tuple(t.to(DEVICE) for t in int4_quantize(w, group, clip_search=False))


def make_fp8(n, k, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen) * 3   # rows on different scales
    return tuple(t.to(DEVICE) for t in fp8_block_quantize(w))


def make_x(m, k, dtype, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=gen).to(DEVICE, dtype)


# --- the twins against the formats' math -------------------------------------------------------------

def test_w4a16_twin_is_the_dequantized_matmul():
    q, s, z = make_int4(24, 72, 32)
    x = make_x(3, 72, torch.float32)
    w = int4_dequant(q, s, z, 72, 32).double()
    assert_close("twin", qm.w4a16_matmul_ref(x, q, s, z, 72, 32), x.double() @ w.T, 1e-6)


def test_w8a16_twin_is_the_dequantized_matmul():
    wq, sc = make_fp8(130, 200)
    x = make_x(2, 200, torch.float32)
    w = fp8_block_dequant(wq, sc, torch.float64)
    assert_close("twin", qm.w8a16_matmul_ref(x, wq, sc), x.double() @ w.T, 1e-6)


# --- W4A16 kernel against its twin --------------------------------------------------------------------

@pytest.mark.parametrize("m", [1, 2, 5, 16])
@pytest.mark.parametrize("n,k,group", [(50, 40, 32), (33, 200, 64), (17, 130, 128), (64, 256, 128)])
def test_w4a16_matches_twin(m, n, k, group):
    q, s, z = make_int4(n, k, group)
    x = make_x(m, k, torch.float32)
    assert_close("w4a16", qm.w4a16_matmul(x, q, s, z, k, group), qm.w4a16_matmul_ref(x, q, s, z, k, group),
                 TOLERANCES[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 5])
def test_w4a16_half_dtypes(dtype, m):
    q, s, z = make_int4(40, 136, 64)
    x = make_x(m, 136, dtype)
    out = qm.w4a16_matmul(x, q, s, z, 136, 64)
    assert out.dtype == dtype
    assert_close("w4a16", out, qm.w4a16_matmul_ref(x, q, s, z, 136, 64), TOLERANCES[dtype])


def test_w4a16_ignores_padding_and_x_beyond_k():
    # padding codes set to 15 under a large scale, and x a view whose row continues with NaN past K
    k, group = 40, 32
    q, s, z = make_int4(20, k, group)
    codes = q.clone()
    codes[:, (k % group) // 2 + group // 2 * (k // group):] |= 0xF0   # high nibbles: elements >= k in the last group
    wide = torch.full((3, k + 24), float("nan"), device=DEVICE)
    wide[:, :k] = make_x(3, k, torch.float32)
    x = wide[:, :k]
    want = qm.w4a16_matmul_ref(x, codes, s, z, k, group)
    assert torch.isfinite(want).all()
    assert_close("w4a16", qm.w4a16_matmul(x, codes, s, z, k, group), want, TOLERANCES[torch.float32])


@pytest.mark.parametrize("use_dot", [False, True])
@pytest.mark.parametrize("split_k", [1, 2, 3])
def test_w4a16_inner_products_and_splits(use_dot, split_k):
    q, s, z = make_int4(48, 330, 32)
    x = make_x(2, 330, torch.float32)
    want = qm.w4a16_matmul_ref(x, q, s, z, 330, 32)
    got = qm.w4a16_matmul(x, q, s, z, 330, 32, use_dot=use_dot, split_k=split_k, block_k=64)
    assert_close(f"use_dot={use_dot} split_k={split_k}", got, want, TOLERANCES[torch.float32])
    again = qm.w4a16_matmul(x, q, s, z, 330, 32, use_dot=use_dot, split_k=split_k, block_k=64)
    assert torch.equal(got, again), "split-K partials must be summed in a fixed order"


def test_w4a16_on_blob_views_in_a_pool_row():
    # the components as BlobLayout views of an int4 expert blob in the middle of a pool of NaN bytes
    fmt = get_format("int4", 64)
    inter, hidden = 40, 72
    layout = fmt.layout(inter, hidden)
    gen = torch.Generator().manual_seed(3)
    mats = [torch.randn(shape, generator=gen) * 0.05 for shape in ((inter, hidden), (inter, hidden), (hidden, inter))]
    pool = torch.full((3, layout.blob_bytes), 0xFF, dtype=torch.uint8)
    fmt.pack(*mats, out=pool[1])
    pool = pool.to(DEVICE)
    for m, (n, k) in (("gate", (inter, hidden)), ("down", (hidden, inter))):
        parts = [layout.view(pool[1], f"{m}.{p}") for p in ("qweight", "scales", "zeros")]
        x = make_x(2, k, torch.float32)
        want = F.linear(x, fmt.unpack(pool[1], layout=layout)[0 if m == "gate" else 2])
        assert_close(m, qm.w4a16_matmul(x, *parts, k, 64), want, TOLERANCES[torch.float32])
        assert_close(m, qm.w4a16_matmul_ref(x, *parts, k, 64), want, 1e-6)


def test_w4a16_leading_dims():
    q, s, z = make_int4(20, 64, 32)
    x = make_x(6, 64, torch.float32).view(2, 3, 64)
    out = qm.w4a16_matmul(x, q, s, z, 64, 32)
    assert out.shape == (2, 3, 20)
    assert_close("w4a16", out, qm.w4a16_matmul_ref(x, q, s, z, 64, 32), TOLERANCES[torch.float32])


# --- W8A16 kernel against its twin --------------------------------------------------------------------

@pytest.mark.parametrize("m", [1, 2, 5, 16])
@pytest.mark.parametrize("n,k", [(50, 40), (130, 200), (257, 129)])   # partial edge blocks in both dims
def test_w8a16_matches_twin(m, n, k):
    wq, sc = make_fp8(n, k)
    x = make_x(m, k, torch.float32)
    assert_close("w8a16", qm.w8a16_matmul(x, wq, sc), qm.w8a16_matmul_ref(x, wq, sc), TOLERANCES[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 5])
def test_w8a16_half_dtypes(dtype, m):
    wq, sc = make_fp8(140, 160)
    x = make_x(m, 160, dtype)
    out = qm.w8a16_matmul(x, wq, sc)
    assert out.dtype == dtype
    assert_close("w8a16", out, qm.w8a16_matmul_ref(x, wq, sc), TOLERANCES[dtype])


@pytest.mark.parametrize("use_dot,block_k", [(False, 128), (True, 32)])
def test_w8a16_tiles(use_dot, block_k):
    wq, sc = make_fp8(136, 300)
    x = make_x(3, 300, torch.float32)
    got = qm.w8a16_matmul(x, wq, sc, use_dot=use_dot, block_k=block_k, block_n=64, split_k=2)
    assert_close("w8a16", got, qm.w8a16_matmul_ref(x, wq, sc), TOLERANCES[torch.float32])


def test_w8a16_bf16_rounding_of_the_weights():
    # one fp32 multiply then one bf16 rounding: with fp32 x the kernel must see exactly the bf16 weights
    wq, sc = make_fp8(20, 128)
    sc = sc * 1.37   # scales that make fp32(q) * s fall between bf16 values
    x = torch.zeros(1, 128, device=DEVICE)
    x[0, 5] = 1.0   # picks column 5 exactly
    got = qm.w8a16_matmul(x, wq, sc)[0]
    want = (wq[:, 5].float() * sc[:, 0].repeat_interleave(128)[:20]).to(torch.bfloat16).float()
    assert torch.equal(got.cpu(), want.cpu())


# --- argument checks and dispatch --------------------------------------------------------------------

def test_rejects_bad_inputs():
    q, s, z = make_int4(20, 64, 32)
    x = make_x(2, 64, torch.float32)
    with pytest.raises(AssertionError, match="x must be"):
        qm.w4a16_matmul(x[:, :60], q, s, z, 64, 32)
    with pytest.raises(AssertionError, match="qweight"):
        qm.w4a16_matmul(x, q, s, z, 64, 128)
    with pytest.raises(AssertionError, match="group_size"):
        qm.w4a16_matmul(x, q, s, z, 64, 16)
    with pytest.raises(AssertionError, match="scales"):
        qm.w4a16_matmul(x, q, s.float(), z, 64, 32)
    with pytest.raises(AssertionError, match="float16, bfloat16 or float32"):
        qm.w4a16_matmul(x.double(), q, s, z, 64, 32)
    wq, sc = make_fp8(20, 64)
    with pytest.raises(AssertionError, match="scale must be"):
        qm.w8a16_matmul(x, wq, sc[:, :0])
    with pytest.raises(AssertionError, match="float8_e4m3fn"):
        qm.w8a16_matmul(x, wq.view(torch.uint8), sc)


def test_auto_picks_kernel_or_twin(monkeypatch):
    q, s, z = make_int4(20, 64, 32)
    wq, sc = make_fp8(20, 64)
    x = make_x(2, 64, torch.float32)
    monkeypatch.setenv("DSV3LITE_KERNELS", "triton")
    assert torch.equal(qm.w4a16_matmul_auto(x, q, s, z, 64, 32), qm.w4a16_matmul(x, q, s, z, 64, 32))
    assert torch.equal(qm.w8a16_matmul_auto(x, wq, sc), qm.w8a16_matmul(x, wq, sc))
    monkeypatch.setenv("DSV3LITE_KERNELS", "ref")
    assert torch.equal(qm.w4a16_matmul_auto(x, q, s, z, 64, 32), qm.w4a16_matmul_ref(x, q, s, z, 64, 32))
    assert torch.equal(qm.w8a16_matmul_auto(x, wq, sc), qm.w8a16_matmul_ref(x, wq, sc))


def test_plan_blocks():
    for fmt, group in ((qm.FMT_INT4, 128), (qm.FMT_FP8, 128), (qm.FMT_BF16, 0)):
        assert qm.plan_blocks(fmt, 1, 7168, 2048, group, False, 32, 64)[0] == 1
        assert qm.plan_blocks(fmt, 2, 7168, 2048, group, False, 32, 64)[0] == 2
        assert qm.plan_blocks(fmt, 5, 7168, 2048, group, True, 32, 64)[0] == 16     # a tl.dot's 16 rows
    assert qm.plan_blocks(qm.FMT_INT4, 1, 64, 40, 32, False, 32, 128)[2] == 64     # K=40 pads to 64
    assert qm.plan_blocks(qm.FMT_INT4, 1, 64, 4096, 128, False, 32, 16)[2] == 32   # 16 bytes: a tl.dot's K
    assert qm.plan_blocks(qm.FMT_FP8, 1, 64, 40, 128, False, 32, 128)[2] == 64     # no wider than K needs
    assert qm.plan_blocks(qm.FMT_FP8, 1, 20, 400, 128, False, 64, 64)[1] == 32     # nor than N needs
    with pytest.raises(AssertionError, match="fp8 block_k"):
        qm.plan_blocks(qm.FMT_FP8, 1, 64, 4096, 128, False, 32, 256)


@pytest.mark.parametrize("block_k", [32, 64, 256])
@pytest.mark.parametrize("prefetch", [True, False])
def test_w4a16_tiles_within_and_across_groups(block_k, prefetch):
    # group 128: a 32- or 64-element tile is part of one group (one scale per row), a 256-element one spans two
    # (a scale per byte column); K = 330 leaves the last group short; split_k=2 ends a split mid-row
    q, s, z = make_int4(40, 330, 128)
    x = make_x(2, 330, torch.float32)
    want = qm.w4a16_matmul_ref(x, q, s, z, 330, 128)
    for use_dot in (False, True):
        got = qm.w4a16_matmul(x, q, s, z, 330, 128, block_k=block_k, prefetch=prefetch, use_dot=use_dot, split_k=2)
        assert_close(f"block_k={block_k} prefetch={prefetch} use_dot={use_dot}", got, want, TOLERANCES[torch.float32])


# --- fp8 on GPUs without Triton's fp8 type: weights read as bytes, decoded with bit arithmetic --------

@triton.jit
def _e4m3_decode_kernel(q_ptr, out_ptr):
    offs = triton.language.arange(0, 256)
    triton.language.store(out_ptr + offs, qm._e4m3_to_f32(triton.language.load(q_ptr + offs)))


def test_e4m3_byte_decode_matches_torch_on_all_256_codes():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).to(DEVICE)
    got = torch.empty(256, dtype=torch.float32, device=DEVICE)
    _e4m3_decode_kernel[(1,)](codes, got)
    want = codes.view(torch.float8_e4m3fn).float()
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(torch.signbit(got), torch.signbit(want))          # -0.0 stays negative
    assert int(torch.isnan(got).sum()) == 2 and float(got[0x7E]) == 448.0 and float(got[1]) == 2.0 ** -9


def test_fp8_decode_is_chosen_by_compute_capability(monkeypatch):
    assert [qm.fp8_code_for(c) for c in ((8, 0), (8, 6), (8, 9), (9, 0), (10, 0))] == \
        [qm.FMT_FP8_BYTES, qm.FMT_FP8_BYTES, qm.FMT_FP8, qm.FMT_FP8, qm.FMT_FP8]
    monkeypatch.setenv("DSV3LITE_FP8_DECODE", "bytes")
    assert qm.fp8_code(DEVICE) == qm.FMT_FP8_BYTES


@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a16_byte_decode_matches_twin(monkeypatch, m, dtype):
    monkeypatch.setenv("DSV3LITE_FP8_DECODE", "bytes")
    wq, sc = make_fp8(130, 200)
    x = make_x(m, 200, dtype)
    assert_close("w8a16 bytes", qm.w8a16_matmul(x, wq, sc), qm.w8a16_matmul_ref(x, wq, sc), TOLERANCES[dtype])
