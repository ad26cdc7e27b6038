"""fused_moe: the two-launch Triton MoE kernel against its twin, and the twin against `combine_experts` over
`BlobExperts` (the resident provider), for int4 / fp8 / bf16 blobs in a slot pool.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (tests/conftest.py turns it on). Unused
pool slots hold 0xFF bytes, NaN in every float view of the pool, so reading one shows up as NaN output.
"""
import pytest
import torch

from dsv3lite.experts import BlobExperts
from dsv3lite.kernels import dispatch   # imports no triton
from dsv3lite.quant.formats import get_format
from dsv3lite.quant.int4 import Int4Format

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
triton = pytest.importorskip("triton")

import dsv3lite.kernels.fused_moe as fm  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def interpreter_on_cpu():
    assert DEVICE.type == "cuda" or dispatch.interpreted(), "TRITON_INTERPRET=1 must be set before triton is imported"


@pytest.fixture(autouse=True, scope="module")
def formats_own_path_on_cpu():
    # the Triton kernels' twin is the formats' dequantizing path; the compiled CPU expert kernel, which
    # expert_forward and BlobExperts run on CPU otherwise, has numerics of its own (tests/test_cpu_experts.py)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DSV3LITE_CPU_KERNELS", "ref")
        yield


@pytest.fixture(autouse=True, scope="module")
def one_cpu_thread():
    # tensors here are tiny: torch's intra-op threads only add waiting, badly so on a busy machine
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# The kernel sums in fp32 and rounds once; the twin (like combine_experts) rounds each expert's weighted
# output to x.dtype and adds in x.dtype, so 16-bit outputs differ by a few units in the last place.
TOLERANCES = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
N_EXPERTS, HIDDEN, INTER = 12, 72, 40
# One program per I / D extent: the interpreter pays per program and per tile. Tests marked "default
# blocks" run the GPU's tiling (several blocks and tiles, masked edges).
WIDE = dict(block_n=64, block_d=128, block_k=128)


def assert_close(name, got, want, tol):
    got, want = got.float().cpu(), want.float().cpu()
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.isfinite(got).all(), f"{name}: non-finite output (a slot that should not be read was read?)"
    diff = (got - want).abs()
    scale = max(want.abs().max().item(), 1.0)
    assert diff.max().item() <= tol * scale, (
        f"{name}: max abs diff {diff.max().item():.3g}, mean abs diff {diff.mean().item():.3g} (scale {scale:.3g})")


class Experts:
    """Blobs of N_EXPERTS random experts in one format; pools place them at chosen slots among NaN bytes."""

    def __init__(self, name, group=128, hidden=HIDDEN, inter=INTER, n_experts=N_EXPERTS, seed=0):
        # int4 without the clipping search: quicker to build, the same packing
        self.fmt = Int4Format(group, clip_search=False) if name == "int4" else get_format(name, group)
        self.layout = self.fmt.layout(inter, hidden)
        gen = torch.Generator().manual_seed(seed)
        self.blobs = torch.stack([
            self.fmt.pack(*(torch.randn(shape, generator=gen) * 0.15
                            for shape in ((inter, hidden), (inter, hidden), (hidden, inter))))
            for _ in range(n_experts)]).to(DEVICE)

    def pool(self, slots, n_slots):
        """(slot_of_expert int32 [E], pool [n_slots, blob_bytes]); slots[e] = -1 leaves expert e out."""
        pool = torch.full((n_slots, self.layout.blob_bytes), 0xFF, dtype=torch.uint8, device=DEVICE)
        for e, s in enumerate(slots):
            if s >= 0:
                pool[s] = self.blobs[e]
        return torch.tensor(slots, dtype=torch.int32, device=DEVICE), pool

    def scattered_pool(self, n_slots=20, seed=0):
        slots = torch.randperm(n_slots, generator=torch.Generator().manual_seed(seed))[:len(self.blobs)]
        return self.pool(slots.tolist(), n_slots)

    def resident(self):
        return BlobExperts(self.blobs, self.fmt, self.layout)


_EXPERTS = {}


def experts(name, group=128):
    if (name, group) not in _EXPERTS:
        _EXPERTS[name, group] = Experts(name, group)
    return _EXPERTS[name, group]


def routing(m, k, dtype=torch.float32, seed=0, n_experts=N_EXPERTS):
    """x [M, D], ids [M, K] (distinct per row, not sorted), weights [M, K] fp32."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, HIDDEN, generator=gen).to(DEVICE, dtype)
    ids = torch.stack([torch.randperm(n_experts, generator=gen)[:k] for _ in range(m)]).to(DEVICE)
    weights = torch.rand(m, k, generator=gen).to(DEVICE)
    return x, ids, weights


# --- the twin against the resident provider ------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name,group", [("int4", 32), ("int4", 128), ("fp8", 128), ("bf16", 128), ("int4g32", 32)])
def test_twin_is_combine_experts_over_blob_experts(name, group, dtype):
    ex = experts(name, group)
    slot_of_expert, pool = ex.scattered_pool()
    x, ids, weights = routing(5, 4, dtype)
    want = ex.resident()(x, ids, weights)
    got = fm.fused_moe_ref(x, ids, weights, slot_of_expert, pool, ex.layout)
    assert torch.equal(got, want), f"max abs diff {(got.float() - want.float()).abs().max().item():.3g}"


# --- the kernel against the twin -----------------------------------------------------------------------

@pytest.mark.parametrize("name,group,m,k,blocks", [
    ("int4", 32, 1, 4, "default"), ("int4", 32, 5, 2, "wide"), ("int4", 32, 16, 2, "wide"),
    ("int4", 128, 1, 1, "wide"), ("int4", 128, 2, 4, "default"),
    ("fp8", 128, 1, 4, "wide"), ("fp8", 128, 2, 4, "wide"), ("fp8", 128, 16, 4, "wide"),
    ("bf16", 128, 1, 4, "wide"), ("bf16", 128, 5, 2, "default"),
    ("int4g32", 32, 1, 4, "default"), ("int4g32", 32, 2, 4, "wide"), ("int4g32", 32, 5, 2, "wide"),
])
def test_kernel_matches_twin(name, group, m, k, blocks):
    ex = experts(name, group)
    slot_of_expert, pool = ex.scattered_pool(seed=m)
    x, ids, weights = routing(m, k, seed=m)
    got = fm.fused_moe(x, ids, weights, slot_of_expert, pool, ex.layout, **(WIDE if blocks == "wide" else {}))
    want = fm.fused_moe_ref(x, ids, weights, slot_of_expert, pool, ex.layout)
    assert got.dtype == x.dtype
    assert_close(f"{name} M={m} K={k}", got, want, TOLERANCES[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["int4", "fp8", "int4g32"])
def test_kernel_half_dtypes(name, dtype):
    ex = experts(name, {"int4": 64, "int4g32": 32}.get(name, 128))
    slot_of_expert, pool = ex.scattered_pool()
    x, ids, weights = routing(2, 4, dtype)
    got = fm.fused_moe(x, ids, weights, slot_of_expert, pool, ex.layout, **WIDE)
    assert got.dtype == dtype
    assert_close(f"{name} {dtype}", got, fm.fused_moe_ref(x, ids, weights, slot_of_expert, pool, ex.layout),
                 TOLERANCES[dtype])


@pytest.mark.parametrize("name", ["int4", "int4g32"])
@pytest.mark.parametrize("m,use_dot,block_n,block_d", [(1, True, 32, 64), (3, False, 64, 128), (2, False, 64, 32)])
def test_kernel_inner_products_and_tiles(name, m, use_dot, block_n, block_d):
    ex = experts(name, 32)
    slot_of_expert, pool = ex.scattered_pool()
    x, ids, weights = routing(m, 4, seed=7)
    got = fm.fused_moe(x, ids, weights, slot_of_expert, pool, ex.layout, use_dot=use_dot, block_n=block_n,
                       block_d=block_d)
    want = fm.fused_moe_ref(x, ids, weights, slot_of_expert, pool, ex.layout)
    assert_close(f"use_dot={use_dot}", got, want, TOLERANCES[torch.float32])


# --- invariants of the sum -----------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["int4", "fp8"])
def test_slot_assignment_does_not_change_the_output(name):
    ex = experts(name)
    x, ids, weights = routing(2, 4, seed=3)
    first = fm.fused_moe(x, ids, weights, *ex.scattered_pool(n_slots=12, seed=1), ex.layout, **WIDE)
    second = fm.fused_moe(x, ids, weights, *ex.scattered_pool(n_slots=31, seed=2), ex.layout, **WIDE)
    assert torch.equal(first, second)


def test_order_of_ids_within_a_row_does_not_change_the_output():
    ex = experts("fp8")
    slot_of_expert, pool = ex.scattered_pool()
    x, ids, weights = routing(3, 4, seed=5)
    sorted_ids, perm = ids.sort(dim=1)
    a = fm.fused_moe(x, ids, weights, slot_of_expert, pool, ex.layout, **WIDE)
    b = fm.fused_moe(x, sorted_ids, weights.gather(1, perm), slot_of_expert, pool, ex.layout, **WIDE)
    assert torch.equal(a, b)


def test_missing_experts_are_skipped():
    # experts 0..5 resident at scattered slots; pairs choosing 6..11 contribute nothing, and their slots
    # (none) and the free ones (NaN) are never read
    ex = experts("int4", 32)
    slots = [3, 17, 8, 0, 11, 5] + [-1] * (N_EXPERTS - 6)
    slot_of_expert, pool = ex.pool(slots, 18)
    x, ids, weights = routing(4, 4, seed=9)
    got = fm.fused_moe(x, ids, weights, slot_of_expert, pool, ex.layout, **WIDE)
    want = fm.fused_moe_ref(x, ids, weights, slot_of_expert, pool, ex.layout)
    resident_only = ex.resident()(x, ids, torch.where(ids < 6, weights, torch.zeros_like(weights)))
    assert torch.equal(want, resident_only)
    assert_close("missing", got, want, TOLERANCES[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_external_outputs_take_the_place_of_missing_experts(dtype):
    ex = experts("fp8")
    x, ids, weights = routing(3, 4, dtype, seed=11)
    full_slots, full_pool = ex.scattered_pool()
    full_kernel = fm.fused_moe(x, ids, weights, full_slots, full_pool, ex.layout, **WIDE)
    full_twin = fm.fused_moe_ref(x, ids, weights, full_slots, full_pool, ex.layout)
    # the even experts are computed "elsewhere": their outputs, as the twin computes them, in external_out
    slot_of_expert, pool = ex.pool([s if e % 2 else -1 for e, s in enumerate(full_slots.tolist())], 20)
    external = torch.full((3, 4, HIDDEN), float("nan"), dtype=dtype, device=DEVICE)   # resident pairs: unread
    for e in range(0, N_EXPERTS, 2):
        tok, kk = (ids == e).nonzero(as_tuple=True)
        if len(tok):
            external[tok, kk] = ex.fmt.expert_forward(ex.blobs[e], x[tok], ex.layout).to(dtype)
    twin = fm.fused_moe_ref(x, ids, weights, slot_of_expert, pool, ex.layout, external)
    kernel = fm.fused_moe(x, ids, weights, slot_of_expert, pool, ex.layout, external, **WIDE)
    assert torch.equal(twin, full_twin)
    assert_close("external", kernel, full_kernel, TOLERANCES[dtype])


def test_empty_slot_sets_give_zeros():
    ex = experts("bf16")
    x, ids, weights = routing(2, 4)
    none = torch.full((N_EXPERTS,), -1, dtype=torch.int32, device=DEVICE)
    for pool in (torch.full((4, ex.layout.blob_bytes), 0xFF, dtype=torch.uint8, device=DEVICE),
                 torch.empty(0, ex.layout.blob_bytes, dtype=torch.uint8, device=DEVICE)):
        for fn in (fm.fused_moe, fm.fused_moe_ref):
            out = fn(x, ids, weights, none, pool, ex.layout)   # (the kernel with its default blocks)
            assert torch.equal(out, torch.zeros_like(x)), fn.__name__


def test_zero_tokens():
    ex = experts("bf16")
    x, ids, weights = routing(1, 4)
    x, ids, weights = x[:0], ids[:0], weights[:0]
    slot_of_expert, pool = ex.scattered_pool()
    assert fm.fused_moe(x, ids, weights, slot_of_expert, pool, ex.layout).shape == (0, HIDDEN)


# --- argument checks and dispatch ----------------------------------------------------------------------

def test_rejects_bad_inputs():
    ex = experts("bf16")
    slot_of_expert, pool = ex.scattered_pool()
    x, ids, weights = routing(2, 4)
    with pytest.raises(AssertionError, match="weights must be float32"):
        fm.fused_moe(x, ids, weights.half(), slot_of_expert, pool, ex.layout)
    with pytest.raises(AssertionError, match="slot_of_expert must be int32"):
        fm.fused_moe(x, ids, weights, slot_of_expert.long(), pool, ex.layout)
    with pytest.raises(AssertionError, match="pool must be uint8"):
        fm.fused_moe(x, ids, weights, slot_of_expert, pool[:, :-256], ex.layout)
    with pytest.raises(AssertionError, match="hidden"):
        fm.fused_moe(x[:, :-1], ids, weights, slot_of_expert, pool, ex.layout)
    nf4_layout = get_format("nf4").layout(INTER, HIDDEN)
    with pytest.raises(ValueError, match="nf4"):   # nf4 stays on bitsandbytes
        fm.fused_moe(x, ids, weights, slot_of_expert,
                     torch.zeros(20, nf4_layout.blob_bytes, dtype=torch.uint8, device=DEVICE), nf4_layout)


def test_auto_picks_kernel_or_twin(monkeypatch):
    ex = experts("int4", 32)
    slot_of_expert, pool = ex.scattered_pool()
    x, ids, weights = routing(1, 2)
    args = (x, ids, weights, slot_of_expert, pool, ex.layout)
    monkeypatch.setenv("DSV3LITE_KERNELS", "triton")
    assert torch.equal(fm.fused_moe_auto(*args), fm.fused_moe(*args))   # default blocks
    monkeypatch.setenv("DSV3LITE_KERNELS", "ref")
    assert torch.equal(fm.fused_moe_auto(*args), fm.fused_moe_ref(*args))


def test_auto_sends_nf4_to_the_twin(monkeypatch):
    # nf4 has no kernel here (bitsandbytes runs it): auto must take the twin even where kernels run
    layout = get_format("nf4").layout(INTER, HIDDEN)
    x, ids, weights = routing(2, 4)
    slots = torch.arange(N_EXPERTS, dtype=torch.int32, device=DEVICE)
    pool = torch.zeros(N_EXPERTS, layout.blob_bytes, dtype=torch.uint8, device=DEVICE)
    monkeypatch.setattr(fm, "fused_moe_ref", lambda *args: "twin")
    monkeypatch.setenv("DSV3LITE_KERNELS", "triton")
    assert fm.fused_moe_auto(x, ids, weights, slots, pool, layout) == "twin"


# --- the kernels compile for the H200's architecture ---------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the other tests compile the kernels")
def test_fused_moe_compiles_for_sm90():
    from dsv3lite.testing import compile_for_sm90

    pytest.importorskip("triton.backends.nvidia")
    common = dict(wslot="i64", sslot="i64", M="i32", D="i32", I="i32", n_tiles="i32", stride_wn="i32",
                  stride_sn="i32", stride_im="i32")
    cases = []
    for code, wtype, stype, group, block_k, xtype, use_dot in [
            (0, "*u8", "*fp16", 128, 128, "bf16", False), (0, "*u8", "*fp16", 64, 128, "fp16", True),
            (1, "*fp8e4nv", "*fp32", 128, 64, "bf16", False), (1, "*fp8e4nv", "*fp32", 128, 64, "fp32", False),
            (2, "*bf16", "*bf16", 0, 64, "bf16", True), (4, "*u8", "*bf16", 32, 32, "bf16", False),
            (4, "*u8", "*bf16", 32, 64, "bf16", True)]:
        consts = dict(TOP_K=8, FMT=code, GROUP=group, BLOCK_M=16 if use_dot else 2, BLOCK_KE=8, BLOCK_N=16,
                      BLOCK_K=block_k, USE_DOT=use_dot, UPCAST=False, PRECISION="ieee" if xtype == "fp32" else "tf32")
        gate_up = dict(common, x_ptr="*" + xtype, ids_ptr="*i64", slot_ptr="*i32", wpool_ptr=wtype, spool_ptr=stype,
                       h_ptr="*" + xtype, stride_xm="i32", gate_w="i32", gate_s="i32", gate_z="i32", up_w="i32",
                       up_s="i32", up_z="i32")
        down = dict(common, E="i32", h_ptr="*" + xtype, ids_ptr="*i64", weights_ptr="*fp32", slot_ptr="*i32",
                    wpool_ptr=wtype, spool_ptr=stype, ext_ptr="*" + xtype, y_ptr="*" + xtype, stride_rm="i32",
                    stride_ym="i32", down_w="i32", down_s="i32", down_z="i32")
        cases.append(("_moe_gate_up_kernel", gate_up, consts))
        cases.append(("_moe_down_kernel", down, dict(consts, HAS_EXTERNAL=code == 1)))
    compile_for_sm90("dsv3lite.kernels.fused_moe", cases)


# --- fp8 experts on GPUs without Triton's fp8 type (sm_80 / sm_86): bytes decoded with bit arithmetic ---

@pytest.mark.parametrize("m,dtype", [(1, torch.float32), (2, torch.bfloat16)])
def test_fp8_byte_decode_matches_twin(monkeypatch, m, dtype):
    monkeypatch.setenv("DSV3LITE_FP8_DECODE", "bytes")
    ex = experts("fp8", 128)
    slot_of_expert, pool = ex.scattered_pool(seed=m)
    x, ids, weights = routing(m, 4, dtype, seed=m)
    got = fm.fused_moe(x, ids, weights, slot_of_expert, pool, ex.layout, **WIDE)
    want = fm.fused_moe_ref(x, ids, weights, slot_of_expert, pool, ex.layout)
    assert_close(f"fp8 bytes M={m}", got, want, TOLERANCES[dtype])


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the other tests compile the kernels")
@pytest.mark.parametrize("arch", [80, 86, 89])
def test_fused_moe_fp8_compiles_for_pre_hopper_gpus(arch):
    from dsv3lite.kernels.quant_matmul import FMT_FP8, fp8_code_for
    from dsv3lite.testing import compile_for_gpu

    pytest.importorskip("triton.backends.nvidia")
    code = fp8_code_for((arch // 10, arch % 10))
    wtype = "*fp8e4nv" if code == FMT_FP8 else "*u8"
    common = dict(wslot="i64", sslot="i64", M="i32", D="i32", I="i32", n_tiles="i32", stride_wn="i32",
                  stride_sn="i32", stride_im="i32")
    consts = dict(TOP_K=8, FMT=code, GROUP=128, BLOCK_M=2, BLOCK_KE=8, BLOCK_N=16, BLOCK_K=64, USE_DOT=False,
                  UPCAST=False, PRECISION="tf32")
    gate_up = dict(common, x_ptr="*bf16", ids_ptr="*i64", slot_ptr="*i32", wpool_ptr=wtype, spool_ptr="*fp32",
                   h_ptr="*bf16", stride_xm="i32", gate_w="i32", gate_s="i32", gate_z="i32", up_w="i32",
                   up_s="i32", up_z="i32")
    down = dict(common, E="i32", h_ptr="*bf16", ids_ptr="*i64", weights_ptr="*fp32", slot_ptr="*i32",
                wpool_ptr=wtype, spool_ptr="*fp32", ext_ptr="*bf16", y_ptr="*bf16", stride_rm="i32",
                stride_ym="i32", down_w="i32", down_s="i32", down_z="i32")
    compile_for_gpu("dsv3lite.kernels.fused_moe", [("_moe_gate_up_kernel", gate_up, consts),
                                                   ("_moe_down_kernel", down, dict(consts, HAS_EXTERNAL=True))], arch)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the other tests compile the kernels")
@pytest.mark.parametrize("arch", [80, 86, 89])
def test_fused_moe_int4g32_compiles_for_pre_hopper_gpus(arch):
    """Kimi's int4g32 experts on Ampere and Ada: the decode blocks the launcher plans (fp32 multiply-adds for 1-2
    tokens, tensor cores from 3) for bf16 and fp16 activations."""
    from dsv3lite.kernels.quant_matmul import FMT_INT4G32, plan_blocks
    from dsv3lite.testing import compile_for_gpu

    pytest.importorskip("triton.backends.nvidia")
    common = dict(wslot="i64", sslot="i64", M="i32", D="i32", I="i32", n_tiles="i32", stride_wn="i32",
                  stride_sn="i32", stride_im="i32")
    cases = []
    for m, xtype in ((1, "bf16"), (4, "fp16")):
        bm, bn, bk, dot = plan_blocks(FMT_INT4G32, m, 2048, 7168, 32, None, 16)     # Kimi's gate/up, as launched
        consts = dict(TOP_K=8, FMT=FMT_INT4G32, GROUP=32, BLOCK_M=bm, BLOCK_KE=8, BLOCK_N=bn, BLOCK_K=bk,
                      USE_DOT=dot, UPCAST=False, PRECISION="tf32")
        gate_up = dict(common, x_ptr="*" + xtype, ids_ptr="*i64", slot_ptr="*i32", wpool_ptr="*u8",
                       spool_ptr="*bf16", h_ptr="*" + xtype, stride_xm="i32", gate_w="i32", gate_s="i32",
                       gate_z="i32", up_w="i32", up_s="i32", up_z="i32")
        down = dict(common, E="i32", h_ptr="*" + xtype, ids_ptr="*i64", weights_ptr="*fp32", slot_ptr="*i32",
                    wpool_ptr="*u8", spool_ptr="*bf16", ext_ptr="*" + xtype, y_ptr="*" + xtype, stride_rm="i32",
                    stride_ym="i32", down_w="i32", down_s="i32", down_z="i32")
        cases += [("_moe_gate_up_kernel", gate_up, consts), ("_moe_down_kernel", down, dict(consts, HAS_EXTERNAL=True))]
    compile_for_gpu("dsv3lite.kernels.fused_moe", cases, arch)
