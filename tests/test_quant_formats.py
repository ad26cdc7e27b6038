"""Routed-expert storage formats: layouts, pack/unpack round trips, FP8 numerics, INT4 packing and clipping, NF4."""
from __future__ import annotations

import json
import sys

import pytest
import torch

from dsv3lite.errors import UserError
from dsv3lite.quant.formats import ALIGN, FORMATS, BlobLayout, Int4Format, get_format, swiglu_ref
from dsv3lite.quant.fp8 import FP8_MAX, fp8_block_dequant, fp8_block_quantize
from dsv3lite.quant.int4 import int4_quantize, int4_unpack_codes, padded_k
from dsv3lite.quant.layout import MATRICES


def _expert(inter: int, hidden: int, seed: int = 0, std: float = 0.02):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(shape, generator=g) * std for shape in ((inter, hidden), (inter, hidden), (hidden, inter)))


def _fmt_param():
    return [pytest.param(name, id=name) for name in FORMATS]


# ---- layouts --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", _fmt_param())
@pytest.mark.parametrize("inter,hidden", [(2048, 7168), (96, 200), (5, 7)])
def test_layout_alignment_and_no_overlap(name, inter, hidden):
    layout = get_format(name).layout(inter, hidden)
    layout.check()
    assert layout.blob_bytes % ALIGN == 0
    spans = sorted((c.offset, c.offset + c.nbytes) for c in layout.components.values())
    for c in layout.components.values():
        assert c.offset % ALIGN == 0 and c.nbytes > 0
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert end <= start
    assert spans[-1][1] <= layout.blob_bytes
    # packed tightly: the only slack is alignment padding
    assert layout.blob_bytes - sum(c.nbytes for c in layout.components.values()) < ALIGN * len(layout.components)
    assert {n.split(".")[0] for n in layout.components} == set(MATRICES)


def test_deepseek_v3_expert_sizes():
    # D=7168, I=2048: 3 matrices of 14,680,064 weights each
    n = 2048 * 7168
    assert get_format("bf16").layout(2048, 7168).blob_bytes == 3 * 2 * n
    assert get_format("fp8").layout(2048, 7168).blob_bytes == 3 * (n + 16 * 56 * 4)  # 3584 B of scales: aligned
    int4 = get_format("int4", 128).layout(2048, 7168)
    assert int4.components["gate.scales"].shape == (2048, 56) and int4.components["down.scales"].shape == (7168, 16)
    assert int4.blob_bytes == 3 * (n // 2 + 2 * 2 * n // 128)
    assert get_format("nf4").layout(2048, 7168).blob_bytes == 3 * (n // 2 + 4 * n // 64)


@pytest.mark.parametrize("name", _fmt_param())
def test_view_types_shapes_and_shared_storage(name):
    if name == "nf4":
        pytest.importorskip("bitsandbytes")
    fmt = get_format(name)
    inter, hidden = 24, 40
    layout = fmt.layout(inter, hidden)
    pool = torch.zeros(3, layout.blob_bytes, dtype=torch.uint8)
    blob = fmt.pack(*_expert(inter, hidden), out=pool[1])
    assert blob.data_ptr() == pool[1].data_ptr() and pool[0].eq(0).all() and pool[2].eq(0).all()
    for cname, comp in layout.components.items():
        v = layout.view(pool[1], cname)
        assert v.dtype == getattr(torch, comp.dtype) and tuple(v.shape) == comp.shape
        assert v.data_ptr() == pool[1].data_ptr() + comp.offset  # a view, not a copy
    # writing through a view lands in the pool row
    v = layout.view(pool[1], next(iter(layout.components)))
    v.view(torch.uint8).view(-1)[0] = 0xAB
    assert pool[1, 0].item() == 0xAB
    with pytest.raises(ValueError):
        layout.view(pool[1][:-ALIGN], next(iter(layout.components)))


@pytest.mark.parametrize("name", _fmt_param())
def test_layout_json_round_trip(name):
    layout = get_format(name).layout(96, 200)
    again = BlobLayout.from_json(json.loads(json.dumps(layout.to_json())))
    assert again == layout
    assert all(isinstance(c.shape, tuple) for c in again.components.values())


def test_from_json_rejects_misaligned():
    d = get_format("int4").layout(96, 200).to_json()
    d["components"]["up.qweight"]["offset"] += 16
    with pytest.raises(ValueError):
        BlobLayout.from_json(d)


def test_unknown_format_is_user_error():
    with pytest.raises(UserError) as e:
        get_format("int3")
    for name in FORMATS:
        assert name in str(e.value)
    with pytest.raises(UserError):
        get_format("int4", group_size=100)


def test_unpack_needs_a_known_layout():
    fmt = get_format("bf16")
    blob = get_format("bf16").pack(*_expert(16, 32))
    with pytest.raises(ValueError):
        fmt.unpack(blob)  # this instance never built a layout for these dims
    gate, _, _ = fmt.unpack(blob, layout=fmt.layout(16, 32))
    assert gate.shape == (16, 32)
    with pytest.raises(ValueError):
        get_format("fp8").unpack(blob, layout=fmt.layout(16, 32))


# ---- bf16 -----------------------------------------------------------------------------------------------------

def test_bf16_round_trip_exact():
    fmt = get_format("bf16")
    weights = _expert(48, 72)
    for w, back in zip(weights, fmt.unpack(fmt.pack(*weights))):
        assert torch.equal(back, w.to(torch.bfloat16).float())


# ---- fp8 ------------------------------------------------------------------------------------------------------

def _fp8_dequant_by_blocks(q, s):
    """The reference formula written block by block: bf16(fp32(q) * s[bi, bj])."""
    out = torch.empty(q.shape, dtype=torch.bfloat16)
    for bi in range(s.shape[0]):
        for bj in range(s.shape[1]):
            rows, cols = slice(bi * 128, (bi + 1) * 128), slice(bj * 128, (bj + 1) * 128)
            out[rows, cols] = (q[rows, cols].float() * s[bi, bj]).to(torch.bfloat16)
    return out


@pytest.mark.parametrize("shape", [(576, 200), (130, 7), (256, 384), (7, 130)])
def test_fp8_dequant_matches_reference_formula_bit_exact(shape):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 0.05
    q, s = fp8_block_quantize(w)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert tuple(s.shape) == (-(-shape[0] // 128), -(-shape[1] // 128))
    ref = _fp8_dequant_by_blocks(q, s)
    assert torch.equal(fp8_block_dequant(q, s).view(torch.int16), ref.view(torch.int16))
    assert torch.equal(fp8_block_dequant(q, s, torch.float32), ref.float())


@pytest.mark.parametrize("shape", [(576, 200), (130, 7)])
def test_fp8_quantize_error_per_block(shape):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(2)) * 0.05
    w[:128, :7] = 0.0  # an all-zero block
    q, s = fp8_block_quantize(w)
    assert torch.isfinite(s).all() and (s > 0).all()
    n, k = shape
    s_full = s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    # each non-zero block's amax lands on the largest e4m3 value
    qa = q.float().abs()
    for bi in range(s.shape[0]):
        for bj in range(s.shape[1]):
            block = w[bi * 128:(bi + 1) * 128, bj * 128:(bj + 1) * 128]
            if block.abs().max() > 0:
                assert qa[bi * 128:(bi + 1) * 128, bj * 128:(bj + 1) * 128].max() == FP8_MAX
                assert s[bi, bj] == block.abs().max() / FP8_MAX
    deq = fp8_block_dequant(q, s, torch.float32)
    # e4m3: 3 mantissa bits (relative 2^-4), subnormal step 2^-9 (absolute 2^-10 in q units); then bf16 (2^-8)
    bound = w.abs() * (2 ** -4 + 2 ** -8) * 1.01 + s_full * 2 ** -10
    assert ((deq - w).abs() <= bound).all()
    assert deq[:128, :7].eq(0).all()


def test_fp8_pack_unpack_uses_block_formula():
    fmt = get_format("fp8")
    weights = _expert(200, 130, seed=3)
    blob = fmt.pack(*weights)
    layout = fmt.layout(200, 130)
    for m, back in zip(MATRICES, fmt.unpack(blob, torch.bfloat16)):
        ref = _fp8_dequant_by_blocks(layout.view(blob, f"{m}.weight"), layout.view(blob, f"{m}.scale"))
        assert torch.equal(back.view(torch.int16), ref.view(torch.int16))


def test_fp8_prequantized_passthrough_bit_exact():
    fmt = get_format("fp8")
    inter, hidden = 130, 200
    g = torch.Generator().manual_seed(4)
    tensors = []
    for n, k in ((inter, hidden), (inter, hidden), (hidden, inter)):
        raw = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=g)  # every byte pattern, NaNs included
        scale = torch.rand((-(-n // 128), -(-k // 128)), generator=g) * 1e-3
        tensors += [raw.view(torch.float8_e4m3fn), scale]
    blob = fmt.pack_prequantized(*tensors)
    layout = fmt.layout(inter, hidden)
    for i, m in enumerate(MATRICES):
        w, s = tensors[2 * i], tensors[2 * i + 1]
        assert torch.equal(layout.view(blob, f"{m}.weight").view(torch.uint8), w.view(torch.uint8))
        assert torch.equal(layout.view(blob, f"{m}.scale").view(torch.int32), s.view(torch.int32))
    with pytest.raises(ValueError):
        fmt.pack_prequantized(tensors[0], tensors[1][:1], *tensors[2:])
    with pytest.raises(ValueError):
        fmt.pack_prequantized(tensors[0].float(), *tensors[1:])


# ---- int4 -----------------------------------------------------------------------------------------------------

def _int4_reference_codes(w, scales, zeros, g):
    """Codes the stored (scale, zero) imply: nearest grid point, clamped to 0..15, padded to Kp with zeros."""
    n, k = w.shape
    kp = padded_k(k, g)
    wp = torch.zeros(n, kp)
    wp[:, :k] = w
    s = scales.float().repeat_interleave(g, dim=1)
    z = zeros.float().repeat_interleave(g, dim=1)
    return (wp / s + z).round().clamp(0, 15).to(torch.uint8)


@pytest.mark.parametrize("g", [32, 64, 128])
def test_int4_nibble_packing(g):
    w = torch.randn(6, 2 * g + 5, generator=torch.Generator().manual_seed(5))
    qweight, scales, zeros = int4_quantize(w, g)
    codes = _int4_reference_codes(w, scales, zeros, g)
    # byte b of a group: element b in the low nibble, element b + g/2 in the high nibble
    for row in range(w.shape[0]):
        for group in range(codes.shape[1] // g):
            for b in range(g // 2):
                byte = qweight[row, group * g // 2 + b].item()
                assert byte & 0xF == codes[row, group * g + b].item()
                assert byte >> 4 == codes[row, group * g + b + g // 2].item()
    assert torch.equal(int4_unpack_codes(qweight, g), codes)


@pytest.mark.parametrize("g", [32, 64, 128])
@pytest.mark.parametrize("k", [256, 200, 7])
def test_int4_plain_round_trip_within_half_step(g, k):
    fmt = Int4Format(g, clip_search=False)
    inter = 40
    weights = (torch.randn(inter, k), torch.randn(inter, k) * 0.02 + 0.01, torch.randn(k, inter) * 3)
    blob = fmt.pack(*weights)
    layout = fmt.layout(inter, k)
    for m, w, back in zip(MATRICES, weights, fmt.unpack(blob)):
        assert back.shape == w.shape
        s = layout.view(blob, f"{m}.scales").float().repeat_interleave(g, dim=1)[:, :w.shape[1]]
        z = layout.view(blob, f"{m}.zeros").float()
        assert (z >= 0).all() and (z <= 15.5).all()
        # half a step, plus fp16 rounding of scale (15 * 2^-11) and zero (2^-8) shifting the grid
        assert ((back - w).abs() <= s * (0.5 + 2 ** -6)).all()


@pytest.mark.parametrize("g", [32, 128])
@pytest.mark.parametrize("k", [512, 300])
def test_int4_clip_search_never_worse_than_min_max(g, k):
    gen = torch.Generator().manual_seed(6)
    # heavy-tailed weights, where clipping pays
    w = torch.randn(64, k, generator=gen) * 0.02 * (1 + 3 * (torch.rand(64, k, generator=gen) < 0.02))
    kp = padded_k(k, g)

    def group_sq_error(clip):
        qweight, scales, zeros = int4_quantize(w, g, clip_search=clip)
        codes = int4_unpack_codes(qweight, g).float()
        back = ((codes.view(64, -1, g) - zeros.float()[..., None]) * scales.float()[..., None]).view(64, kp)[:, :k]
        err = torch.zeros(64, kp)
        err[:, :k] = (back - w) ** 2
        return err.view(64, -1, g).sum(-1), back, scales, zeros

    plain, _, _, _ = group_sq_error(False)
    clipped, back, scales, zeros = group_sq_error(True)
    assert (clipped <= plain).all()          # the search always has the plain range as a candidate
    assert clipped.sum() < 0.95 * plain.sum()
    # inside the chosen grid, still within half a step
    s = scales.float().repeat_interleave(g, 1)[:, :k]
    z = zeros.float().repeat_interleave(g, 1)[:, :k]
    inside = (w >= -z * s) & (w <= (15 - z) * s)
    assert (((back - w).abs() <= s * (0.5 + 2 ** -6)) | ~inside).all()


def test_int4_pack_matches_int4_quantize_and_layout():
    fmt = get_format("int4", 64)
    weights = _expert(40, 100, seed=7)
    blob = fmt.pack(*weights)
    layout = fmt.layout(40, 100)
    for m, w in zip(MATRICES, weights):
        qweight, scales, zeros = int4_quantize(w, 64)
        assert torch.equal(layout.view(blob, f"{m}.qweight"), qweight)
        assert torch.equal(layout.view(blob, f"{m}.scales"), scales)
        assert torch.equal(layout.view(blob, f"{m}.zeros"), zeros)
    assert layout.components["gate.qweight"].shape == (40, 64)
    assert layout.components["down.qweight"].shape == (100, 32)  # K=40 padded to 64


def test_int4_degenerate_groups():
    w = torch.zeros(4, 128)
    w[1] = 0.5
    w[2] = -3.0
    w[3, :5] = 1e-7
    fmt = Int4Format(128)
    back = fmt.unpack(fmt.pack(w, w, w.T.contiguous()))[0]
    assert torch.isfinite(back).all()
    assert back[0].eq(0).all()
    torch.testing.assert_close(back[1:3], w[1:3], rtol=1e-3, atol=0)
    assert (back[3] - w[3]).abs().max() < 1e-7


# ---- nf4 ------------------------------------------------------------------------------------------------------

def test_nf4_code_table_matches_bitsandbytes():
    F = pytest.importorskip("bitsandbytes.functional")
    from dsv3lite.quant.nf4 import NF4_CODE
    assert torch.equal(torch.tensor(NF4_CODE, dtype=torch.float32), F.get_4bit_type("nf4", device="cpu"))


@pytest.mark.parametrize("inter,hidden", [(64, 48), (10, 36), (5, 7)])
def test_nf4_twin_matches_bitsandbytes_exactly(inter, hidden):
    F = pytest.importorskip("bitsandbytes.functional")
    fmt = get_format("nf4")
    weights = _expert(inter, hidden, seed=8)
    blob = fmt.pack(*weights)
    layout = fmt.layout(inter, hidden)
    for dtype in (torch.float32, torch.bfloat16):
        for a, b in zip(fmt.unpack(blob, dtype), fmt.dequantize_bnb(blob, dtype)):
            assert a.dtype == dtype and torch.equal(a, b)
    # the blob holds exactly what bitsandbytes produced
    q, state = F.quantize_4bit(weights[0].contiguous(), blocksize=64, quant_type="nf4", compress_statistics=False)
    assert torch.equal(layout.view(blob, "gate.qweight"), q.view(-1))
    assert torch.equal(layout.view(blob, "gate.absmax"), state.absmax)
    # bitsandbytes' own dequantization of the stored (flattened, block-wise) vector; its CPU kernel blocks each
    # row separately, so the oracle sees the matrix as one row
    state.shape = torch.Size([weights[0].numel()])
    assert torch.equal(fmt.unpack(blob)[0], F.dequantize_4bit(q, state).view(weights[0].shape))
    # error: half the widest gap between neighbouring NF4 levels (0.152), times the block absmax
    for w, back in zip(weights, fmt.unpack(blob)):
        mag = w.reshape(-1).abs()
        pad = (-mag.numel()) % 64
        absmax = torch.cat([mag, mag.new_zeros(pad)]).view(-1, 64).amax(1).repeat_interleave(64)[:mag.numel()]
        assert ((back - w).reshape(-1).abs() <= absmax * 0.153 + 1e-7).all()


def test_nf4_bitsandbytes_forward_matches_ref():
    pytest.importorskip("bitsandbytes")
    fmt = get_format("nf4")
    blob = fmt.pack(*_expert(64, 96, seed=9))
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(10))
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        torch.testing.assert_close(fmt.expert_forward(blob, x.to(dtype)), fmt.expert_forward_ref(blob, x.to(dtype)),
                                   rtol=tol, atol=tol * 1e-2)


def test_nf4_without_bitsandbytes(monkeypatch):
    pytest.importorskip("bitsandbytes")
    fmt = get_format("nf4")
    blob = fmt.pack(*_expert(16, 64, seed=13))
    expected = fmt.unpack(blob)
    for mod in ("bitsandbytes", "bitsandbytes.functional"):
        monkeypatch.setitem(sys.modules, mod, None)  # as on a machine without it
    for a, b in zip(fmt.unpack(blob), expected):    # the pure-torch twin still reads blobs
        assert torch.equal(a, b)
    with pytest.raises(UserError, match="bitsandbytes"):
        fmt.pack(*_expert(16, 64))


# ---- all formats ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", _fmt_param())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_expert_forward_ref_is_swiglu_of_unpacked(name, dtype):
    if name == "nf4":
        pytest.importorskip("bitsandbytes")
    fmt = get_format(name)
    inter, hidden = 64, 96
    weights = _expert(inter, hidden, seed=11, std=0.1)
    blob = fmt.pack(*weights)
    x = torch.randn(7, hidden, generator=torch.Generator().manual_seed(12)).to(dtype)
    y = fmt.expert_forward_ref(blob, x)
    assert y.dtype == dtype and y.shape == (7, hidden)
    gate, up, down = (w.double() for w in fmt.unpack(blob, dtype))
    xd = x.double()
    expected = (torch.nn.functional.silu(xd @ gate.T) * (xd @ up.T)) @ down.T
    # bf16 activations round gate/up outputs and the product on the way: compare against the output scale
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    err = (y.double() - expected).abs().max() / expected.abs().max()
    assert err < tol, f"max diff {err:.3g} of max |y|"
    # and close to the unquantized expert (loose: quantization error)
    full = swiglu_ref(x.float(), *weights)
    rel = (y.float() - full).norm() / full.norm()
    assert rel < {"bf16": 0.01, "fp8": 0.08, "int8": 0.02, "int4": 0.2, "nf4": 0.2, "mxfp4": 0.2, "int4g32": 0.2}[name]


@pytest.mark.parametrize("name", _fmt_param())
def test_pack_rejects_mismatched_shapes(name):  # shapes are checked before any quantizing
    fmt = get_format(name)
    gate, up, down = _expert(8, 16)
    with pytest.raises(ValueError):
        fmt.pack(gate, up, down.T)
    with pytest.raises(ValueError):
        fmt.pack(gate, up[:4], down)


def test_nf4_prints_no_line_about_a_kernel_package_it_does_not_use(v3_dir):
    import os
    import subprocess
    import sys

    pytest.importorskip("bitsandbytes")
    env = {**os.environ, "DSV3LITE_EXPERT_CACHE": "off", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "dsv3lite.cli", "generate", "-w", str(v3_dir), "--experts", "nf4",
                        "-p", "hi", "-m", "2"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "pip install kernels" not in r.stderr and "gemm_4bit" not in r.stderr
