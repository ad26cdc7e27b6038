"""MXFP4 (quant/mxfp4.py) and ue8m0 decoding against docs/dsv4-math.md §5.3-5.4 for every byte value; the format's
blobs (released bytes repacked verbatim); the CPU kernel (kernels/csrc/cpu_kernels.cpp) against its twin, with the
SwiGLU clamp and both activation formats; the loader's reading of F8_E8M0 / I8 tensors."""
from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import save_file

from dsv3lite.hf_checkpoint import CheckpointIndex, TensorReader
from dsv3lite.kernels import cpu_experts
from dsv3lite.quant.formats import get_format
from dsv3lite.quant.fp8 import fp8_block_dequant
from dsv3lite.quant.layout import swiglu_ref
from dsv3lite.quant.mxfp4 import e2m1_decode, mxfp4_dequant, mxfp4_quantize, ue8m0_decode, ue8m0_encode

pytestmark = pytest.mark.usefixtures("one_thread")

# the spec's table (§5.4), written out: code -> value
SPEC_E2M1 = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
ALL_BYTES = torch.arange(256, dtype=torch.uint8)


def gen(seed=3):
    return torch.Generator().manual_seed(seed)


def test_e2m1_every_byte_matches_the_spec_table_and_bit_layout():
    w = mxfp4_dequant(ALL_BYTES[:, None].repeat(1, 16), torch.full((256, 1), 127, dtype=torch.uint8))  # scale 1
    low, high = w[:, 0].tolist(), w[:, 1].tolist()
    for b in range(256):
        assert low[b] == SPEC_E2M1[b & 15] and high[b] == SPEC_E2M1[b >> 4], b        # low nibble = even k
        for code, v in ((b & 15, low[b]), (b >> 4, high[b])):
            s, e, m = code >> 3, (code >> 1) & 3, code & 1
            assert v == (-1) ** s * (m / 2 if e == 0 else 2 ** (e - 1) * (1 + m / 2))
            assert math.copysign(1, v) == (-1) ** s                               # -0 keeps its sign
    assert e2m1_decode(torch.arange(16)).tolist() == SPEC_E2M1
    assert torch.equal(w.to(torch.bfloat16).float(), w)                          # exact in bf16


def test_ue8m0_every_byte():
    expect = [math.ldexp(1.0, b - 127) for b in range(255)]
    for decoded in (ue8m0_decode(ALL_BYTES), ue8m0_decode(ALL_BYTES.view(torch.float8_e8m0fnu)),
                    ALL_BYTES.view(torch.float8_e8m0fnu).float()):                 # the loader's .float()
        assert decoded[:255].tolist() == expect and math.isnan(decoded[255])
    assert torch.equal(ue8m0_encode(ue8m0_decode(ALL_BYTES)), ALL_BYTES)
    with pytest.raises(ValueError):
        ue8m0_encode(torch.tensor([3.0]))


def test_twin_decodes_every_code_and_scale_byte_as_the_format():
    """The kernel's twin decodes e2m1 from its bit fields, the format from its table: equal for every code byte
    under every scale byte (NaN where the scale is 0xFF)."""
    codes = ALL_BYTES[None].repeat(256, 1)                    # row s: all 256 code bytes, 512 weights
    scales = ALL_BYTES[:, None].repeat(1, 16)                 # row s: scale byte s
    twin = cpu_experts.matrix_weights_ref("mxfp4", codes, scales, None, 256, 512, 32)
    fmt = mxfp4_dequant(codes, scales)
    assert torch.equal(torch.isnan(twin), torch.isnan(fmt)) and torch.isnan(fmt[255]).all()
    assert torch.equal(twin[:255], fmt[:255])


def test_mxfp4_scale_applies_per_32_along_k():
    codes = torch.randint(0, 256, (3, 64), dtype=torch.uint8, generator=gen())
    scales = torch.randint(100, 150, (3, 4), dtype=torch.uint8, generator=gen(4))
    w = mxfp4_dequant(codes, scales)
    table = torch.tensor(SPEC_E2M1)
    for n in range(3):
        for k in range(128):
            code = (int(codes[n, k // 2]) >> (4 * (k % 2))) & 0xF
            assert w[n, k].item() == table[code].item() * 2.0 ** (int(scales[n, k // 32]) - 127)


def test_quantize_round_trips_representable_values_and_rounds_to_nearest():
    codes = torch.randint(0, 256, (5, 48), dtype=torch.uint8, generator=gen())
    scales = torch.randint(110, 140, (5, 3), dtype=torch.uint8, generator=gen(5))
    codes[:, ::16] |= 0x07                           # each block holds a +-6: its scale is the smallest that fits
    w = mxfp4_dequant(codes, scales)
    assert torch.equal(mxfp4_dequant(*mxfp4_quantize(w)), w)
    x = torch.randn(7, 96, generator=gen(6))
    back = mxfp4_dequant(*mxfp4_quantize(x))[:, :96]
    step = mxfp4_dequant(torch.full((7, 48), 0x77, dtype=torch.uint8), mxfp4_quantize(x)[1]) / 6 * 2  # 2 ulp at 6
    assert ((back - x).abs() <= step / 2 + 1e-12).all()
    # ties go to the even code: 0.25 -> 0, 0.75 -> 1, 2.5 -> 2, 5 -> 4 (a block whose amax is 6: scale 1)
    ties = torch.tensor([[0.25, 0.75, 2.5, 5.0, 6.0] + [0.0] * 27])
    assert mxfp4_dequant(*mxfp4_quantize(ties))[0, :5].tolist() == [0.0, 1.0, 2.0, 4.0, 6.0]


def test_format_keeps_released_bytes_and_flash_expert_size():
    fmt = get_format("mxfp4")
    assert fmt.layout(2048, 4096).blob_bytes == int(12.75 * 2 ** 20)         # §7.2: 12.75 MiB a V4-Flash expert
    inter, hidden = 64, 96
    parts = []
    for n, k in ((inter, hidden), (inter, hidden), (hidden, inter)):
        parts += [torch.randint(-128, 128, (n, k // 2), dtype=torch.int8, generator=gen(n + k)),
                  torch.randint(0, 255, (n, k // 32), dtype=torch.uint8, generator=gen(n * k)).view(
                      torch.float8_e8m0fnu)]
    blob = fmt.pack_prequantized(*parts)
    layout = fmt.layout(inter, hidden)
    for i, m in enumerate(("gate", "up", "down")):
        assert torch.equal(layout.view(blob, f"{m}.codes"), parts[2 * i].view(torch.uint8))
        assert torch.equal(layout.view(blob, f"{m}.scales"), parts[2 * i + 1].view(torch.uint8))
    # float32 scales (as TensorReader.weight returns them) repack to the same bytes
    floats = [p.float() if p.dtype == torch.float8_e8m0fnu else p for p in parts]
    assert torch.equal(fmt.pack_prequantized(*floats), blob)
    for w, c, s in zip(fmt.unpack(blob, layout=layout), parts[0::2], parts[1::2]):
        assert torch.equal(w, mxfp4_dequant(c, s))


def test_fp8_weights_with_ue8m0_scales_dequantize_exactly(tmp_path):
    q = (torch.randn(200, 300, generator=gen()) * 50).to(torch.float8_e4m3fn)
    s = torch.randint(115, 135, (2, 3), dtype=torch.uint8, generator=gen(7)).view(torch.float8_e8m0fnu)
    codes = torch.randint(-128, 128, (8, 32), dtype=torch.int8, generator=gen(8))
    cs = torch.randint(120, 130, (8, 2), dtype=torch.uint8, generator=gen(9)).view(torch.float8_e8m0fnu)
    save_file({"a.weight": q, "a.scale": s, "e.weight": codes, "e.scale": cs}, tmp_path / "model.safetensors")
    with TensorReader(CheckpointIndex.open(tmp_path)) as reader:
        w, scale = reader.weight("a.weight")
        assert reader.nbytes("a.weight") == 200 * 300 + 6
        deq = fp8_block_dequant(w, scale)
        exact = q.float() * torch.exp2(s.view(torch.uint8).float() - 127).repeat_interleave(128, 0)[:200] \
            .repeat_interleave(128, 1)[:, :300]
        assert torch.equal(deq.float(), exact)
        e, es = reader.weight("e.weight")
        assert e.dtype == torch.int8 and torch.equal(mxfp4_dequant(e, es), mxfp4_dequant(codes, cs))


# ---- the CPU kernel ---------------------------------------------------------------------------------------------

def _blobs(n_experts, inter, hidden, seed=0):
    fmt = get_format("mxfp4")
    g = gen(seed)
    mats = [[torch.randn(s, generator=g) * 0.1 for s in ((inter, hidden), (inter, hidden), (hidden, inter))]
            for _ in range(n_experts)]
    return torch.stack([fmt.pack(*m) for m in mats]), fmt.layout(inter, hidden)


@pytest.mark.cpu_kernels
@pytest.mark.parametrize("inter,hidden", [(64, 128), (32, 96), (96, 200), (5, 7)])
@pytest.mark.parametrize("act", ["int8", "fp32"])
@pytest.mark.parametrize("limit", [None, 0.1])
def test_kernel_matches_twin(inter, hidden, act, limit):
    blobs, layout = _blobs(5, inter, hidden)
    for tokens in (1, 3, 9):
        x = torch.randn(tokens, hidden, generator=gen(tokens))
        ids = torch.stack([torch.randperm(5, generator=gen(t))[:3] for t in range(tokens)])
        ids[0, 1] = ids[0, 0]                                                # a repeated expert counts twice
        w = torch.rand(tokens, 3, generator=gen(11))
        for per_pair in (False, True):
            got = cpu_experts.cpu_experts_forward(x, ids, w, blobs, layout, per_pair=per_pair, limit=limit, act=act)
            ref = cpu_experts.cpu_experts_ref(x, ids, w, blobs, layout, per_pair=per_pair, limit=limit, act=act)
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
    # experts without a blob are skipped, in both
    subset = {0: blobs[0], 3: blobs[3]}
    ids = torch.tensor([[0, 1, 3], [3, 2, 0]])
    x = torch.randn(2, hidden, generator=gen(12))
    got = cpu_experts.cpu_experts_forward(x, ids, torch.ones(2, 3), subset, layout, limit=limit, act=act)
    torch.testing.assert_close(got, cpu_experts.cpu_experts_ref(x, ids, torch.ones(2, 3), subset, layout,
                                                                limit=limit, act=act), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("limit", [None, 0.1])
def test_twin_is_the_dequantized_expert_up_to_activation_rounding(limit):
    blobs, layout = _blobs(1, 64, 128)
    x = torch.randn(4, 128, generator=gen(13))
    fmt = get_format("mxfp4")
    exact = fmt.expert_forward_ref(blobs[0], x, layout, limit)
    gate, up, down = fmt.unpack(blobs[0], layout=layout)
    assert torch.equal(exact, swiglu_ref(x, gate, up, down, limit))
    fp32 = cpu_experts.expert_ref(blobs[0], x, layout, limit, act="fp32")
    torch.testing.assert_close(fp32, exact, rtol=1e-5, atol=1e-6)                # fp32 activations: exact weights
    int8 = cpu_experts.expert_ref(blobs[0], x, layout, limit, act="int8")
    assert (int8 - exact).norm() / exact.norm() < 2e-2                          # int8 activations per 32
    if limit is not None:                                                        # the clamp is active here
        assert not torch.allclose(exact, fmt.expert_forward_ref(blobs[0], x, layout))
