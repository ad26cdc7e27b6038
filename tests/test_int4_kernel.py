"""The compiled int4 quantizer (kernels/csrc/cpu_kernels.cpp dsv3_int4_quantize) against its pure-PyTorch twin
(quant/int4.py int4_quantize_ref): the same codes, scales and zeros, bit for bit.

Bit identity holds by construction, not by tolerance: both run the same IEEE fp32 operations in the same order.
Division, add, clamp and round-half-even are elementwise; fp16 rounding of scale and zero is round-to-nearest-even
in both (F16C / torch's .half()); the one reduction, each group's sum of squared errors, adds by halves (element
i + g/2 to element i, then g/4, ..) in both (_sum_by_halves; torch's own sum would add in an order that depends on
its vector width), and candidates are compared in the same order with the first of equal errors kept. So the
tests demand torch.equal, with no tolerance; only NaN weights are left unspecified (their groups' codes)."""
from __future__ import annotations


import pytest
import torch

from dsv3lite.kernels import cpu_build
from dsv3lite.quant import int4 as int4_mod
from dsv3lite.quant.fp8 import fp8_block_dequant, fp8_block_quantize
from dsv3lite.quant.int4 import (CLIP_SEARCH, EXHAUSTIVE, GROUP_SIZES, ClipSearch, Int4Format, int4_quantize,
                                 int4_quantize_ref)

SEARCHES = {"search": True, "fast": False}


def _assert_same(got, want, what=""):
    for name, a, b in zip(("qweight", "scales", "zeros"), got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, (what, name, a.dtype, b.dtype, a.shape, b.shape)
        if not torch.equal(a.view(torch.uint8) if a.dtype == torch.uint8 else a.view(torch.int16),
                           b.view(torch.uint8) if b.dtype == torch.uint8 else b.view(torch.int16)):
            differ = (a.view(-1).view(torch.uint8) != b.view(-1).view(torch.uint8)).sum().item()
            raise AssertionError(f"{what} {name}: {differ} bytes of {a.numel() * a.element_size()} differ")


def _weights(shape, seed, scale=0.02):
    """Gaussian at DeepSeek's init scale with some outliers (the search then moves the ends)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=gen) * scale
    w += (torch.rand(shape, generator=gen) < 0.02) * torch.randn(shape, generator=gen) * scale * 4
    return w


@pytest.mark.cpu_kernels
@pytest.mark.parametrize("group", GROUP_SIZES)
@pytest.mark.parametrize("search", SEARCHES.values(), ids=SEARCHES.keys())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_equals_twin_on_float_sources(group, search, dtype):
    for shape in [(67, 7 * 128 + 40), (33, 300), (5, 17), (130, 256)]:       # K not a multiple of the group: padding
        w = _weights(shape, seed=shape[1] + group).to(dtype)
        _assert_same(int4_quantize(w, group, search), int4_quantize_ref(w, group, search), f"{dtype} {shape}")


@pytest.mark.cpu_kernels
@pytest.mark.parametrize("group", GROUP_SIZES)
@pytest.mark.parametrize("search", SEARCHES.values(), ids=SEARCHES.keys())
def test_kernel_equals_twin_on_fp8_sources(group, search):
    """FP8 e4m3 with its 128x128 scale_inv grid, partial edge blocks both ways (200 = 128 + 72 rows, 300 = 2 * 128 +
    44 columns), block scales spread over decades; equal to quantizing the dequantized matrix too."""
    gen = torch.Generator().manual_seed(7 + group)
    w = _weights((200, 300), seed=group)
    q, s = fp8_block_quantize(w)
    s = s * torch.logspace(-2, 2, s.numel()).view(s.shape)     # each block its own magnitude
    got = int4_quantize(q, group, search, scale_inv=s)
    _assert_same(got, int4_quantize_ref(q, group, search, scale_inv=s), "fp8")
    _assert_same(got, int4_quantize_ref(fp8_block_dequant(q, s, torch.float32), group, search), "dequantized")
    codes = torch.randint(0, 256, (130, 260), generator=gen, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x80                                      # every code but NaN, incl. -0
    e4m3 = codes.view(torch.float8_e4m3fn)
    _assert_same(int4_quantize(e4m3, group, search), int4_quantize_ref(e4m3, group, search), "fp8 no scale")


@pytest.mark.cpu_kernels
@pytest.mark.parametrize("search", [EXHAUSTIVE, ClipSearch((0.9, 0.8), ()), ClipSearch((), (-0.05, 0.05)),
                                    ClipSearch((0.5,), (-0.7, 0.3))], ids=["exhaustive", "shrink", "ends", "clamped"])
def test_kernel_equals_twin_for_any_clip_search(search):
    w = _weights((96, 500), seed=11)
    _assert_same(int4_quantize(w, 128, search), int4_quantize_ref(w, 128, search))


@pytest.mark.cpu_kernels
@pytest.mark.parametrize("group", GROUP_SIZES)
def test_kernel_equals_twin_on_edge_groups(group):
    """Zero groups, constant groups, one sign only, signed zeros, ranges below fp16's smallest scale, values on
    the code grid (candidates tie at zero error), huge values, ranges whose scale overflows fp16 (inf scale, NaN
    or inf errors: torch's argmin takes the first NaN, and so does the kernel)."""
    k = 6 * group + 5
    w = _weights((16, k), seed=5)
    w[0] = 0.0
    w[1] = -0.0
    w[2] = 0.37
    w[3] = w[3].abs()
    w[4] = -w[4].abs()
    w[5] = torch.randn(k) * 1e-9
    w[6] = torch.randint(-7, 9, (k,)).float() * 0.125                   # exactly representable levels
    w[7] = w[7] * 1e4
    w[8, ::3] = -0.0
    w[8] = w[8].abs() * torch.where(torch.arange(k) % 3 == 0, -1.0, 1.0)
    w[9, : group // 2] = 1e-30
    w[10] = torch.randn(k) * 1e6                                        # ranges past fp16: inf scales, NaN errors
    w[11, ::2] = 3e5
    spread = torch.randperm(k, generator=torch.Generator().manual_seed(1))
    w[12] = torch.linspace(-5.5e5, 5.5e5, k)[spread]                   # inf scale for min/max, finite shrunk
    for search in (True, False, EXHAUSTIVE):
        _assert_same(int4_quantize(w, group, search), int4_quantize_ref(w, group, search), f"search {search}")


@pytest.mark.cpu_kernels
def test_kernel_at_real_width_and_any_thread_count():
    """One band of a DeepSeek-V3 gate (256 x 7168, FP8): the same bytes on 1 and 2 threads and as the twin."""
    q, s = fp8_block_quantize(_weights((256, 7168), seed=3))
    want = int4_quantize_ref(q, 128, True, scale_inv=s)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            _assert_same(int4_quantize(q, 128, True, scale_inv=s), want, f"{n} threads")
    finally:
        torch.set_num_threads(threads)


@pytest.mark.cpu_kernels
def test_nan_weights_stay_in_their_groups():
    """NaN codes (e4m3 0x7f) poison only their own group; every other group is the twin's."""
    q, s = fp8_block_quantize(_weights((8, 512), seed=2))
    q.view(torch.uint8)[3, 130] = 0x7F
    got, want = int4_quantize(q, 128, True, scale_inv=s), int4_quantize_ref(q, 128, True, scale_inv=s)
    assert got[1][3, 1].isnan() and want[1][3, 1].isnan()
    for t in (*got, *want):
        t.view(torch.uint8).view(8, -1)[3, t.shape[1] // 4 * t.element_size():t.shape[1] // 2 * t.element_size()] = 0
    _assert_same(got, want)


@pytest.mark.cpu_kernels
@pytest.mark.parametrize("clip_search", [True, False])
def test_pack_by_kernel_equals_the_twins_blob(clip_search, monkeypatch):
    """Int4Format.pack / pack_fp8 quantize straight into the blob: the bytes of the twin's pack, gaps zeroed even in
    a dirty `out`."""
    fmt = Int4Format(64, clip_search=clip_search)
    mats = [_weights((192, 320), seed=1), _weights((192, 320), seed=2), _weights((320, 192), seed=3)]
    fp8 = [fp8_block_quantize(w) for w in mats]
    bf16 = [w.to(torch.bfloat16) for w in mats]
    got_fp8, got_bf16 = fmt.pack_fp8(fp8), fmt.pack(*bf16)
    dirty = torch.full_like(got_fp8, 0xA5)
    assert fmt.pack_fp8(fp8, out=dirty) is dirty and torch.equal(dirty, got_fp8)
    monkeypatch.setenv("DSV3LITE_CPU_KERNELS", "ref")
    assert torch.equal(got_fp8, fmt.pack_fp8(fp8))
    assert torch.equal(got_bf16, fmt.pack(*bf16))


def test_forced_off_runs_the_twin(monkeypatch):
    """With the kernels forced off (DSV3LITE_CPU_KERNELS=ref) int4_quantize and the packs are the twin's, and the
    kernel is never called."""
    monkeypatch.setenv("DSV3LITE_CPU_KERNELS", "ref")
    assert cpu_build.forced_off() and cpu_build.library() is None

    def no_kernel(*a, **kw):
        raise AssertionError("the kernel ran although forced off")

    monkeypatch.setattr(int4_mod, "_int4_quantize_kernel", no_kernel)
    w = _weights((40, 300), seed=9)
    q, s = fp8_block_quantize(w)
    _assert_same(int4_quantize(w, 64), int4_quantize_ref(w, 64))
    _assert_same(int4_quantize(q, 128, CLIP_SEARCH, scale_inv=s), int4_quantize_ref(q, 128, CLIP_SEARCH, scale_inv=s))
    fmt = Int4Format(128)
    mats = [_weights((64, 256), seed=1), _weights((64, 256), seed=2), _weights((256, 64), seed=3)]
    assert torch.equal(fmt.pack_fp8([fp8_block_quantize(m) for m in mats]),
                       fmt.pack(*(fp8_block_dequant(*fp8_block_quantize(m)) for m in mats)))


def test_use_kernel_false_is_the_twin(monkeypatch):
    monkeypatch.setattr(int4_mod, "_int4_quantize_kernel", lambda *a, **kw: pytest.fail("kernel called"))
    w = _weights((20, 200), seed=4)
    _assert_same(int4_quantize(w, 32, use_kernel=False), int4_quantize_ref(w, 32))


@pytest.mark.cpu_kernels
def test_bad_scale_grid_is_an_error():
    q, s = fp8_block_quantize(_weights((130, 256), seed=1))
    with pytest.raises(ValueError, match="scale grid"):
        int4_quantize(q, 128, scale_inv=s[:1])


@pytest.mark.cpu_kernels
@pytest.mark.parametrize("group", GROUP_SIZES)
def test_avx2_and_avx512_code_give_the_same_bits(group, monkeypatch):
    """The kernel is compiled for AVX2 and, where the CPU has it, AVX-512 (the one used here when present): the
    same source, elementwise IEEE operations and written-out sums, so the same bits (on an AVX2-only CPU both
    runs take the AVX2 code)."""
    q, s = fp8_block_quantize(_weights((130, 7 * 128 + 40), seed=group))
    w = _weights((70, 500), seed=group + 1).to(torch.bfloat16)
    want = [int4_quantize(q, group, True, scale_inv=s), int4_quantize(w, group, True), int4_quantize(w, group, False)]
    monkeypatch.setattr(int4_mod, "KERNEL_ISA", 1)
    got = [int4_quantize(q, group, True, scale_inv=s), int4_quantize(w, group, True), int4_quantize(w, group, False)]
    for a, b in zip(got, want):
        _assert_same(a, b, f"AVX2 vs best, group {group}")



@pytest.mark.cpu_kernels
def test_a_search_too_large_for_the_kernel_runs_the_twin(monkeypatch):
    monkeypatch.setattr(int4_mod, "_int4_quantize_kernel", lambda *a, **kw: pytest.fail("kernel called"))
    big = ClipSearch(tuple(1.0 - 0.01 * i for i in range(1, int4_mod.KERNEL_MAX_CANDIDATES + 1)), ())
    w = _weights((8, 256), seed=6)
    _assert_same(int4_quantize(w, 128, big), int4_quantize_ref(w, 128, big))
