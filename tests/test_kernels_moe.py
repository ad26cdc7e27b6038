"""fused_moe: the two-launch Triton MoE kernel against its twin, and the twin against `combine_experts` over
`BlobExperts` (the resident provider), for int4 / int4g32 / fp8 / bf16 blobs in a slot pool.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (tests/conftest.py turns it on). Unused
pool slots hold 0xFF bytes, NaN in every float view of the pool, so reading one shows up as NaN output.
"""
import pytest
import torch

from dsv3lite.experts import BlobExperts
from dsv3lite.limits import FUSED_MAX_TOKENS as FUSED_MAX
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


# --- the grouped kernels (prefill): expert-major tiles on tensor cores ----------------------------------

@pytest.mark.parametrize("name,group,dtype", [
    ("int4", 32, torch.float32), ("int4", 128, torch.float16), ("int4", 128, torch.bfloat16),
    ("fp8", 128, torch.float32), ("fp8", 128, torch.bfloat16), ("bf16", 128, torch.float16),
    ("int4g32", 32, torch.float32), ("int4g32", 32, torch.float16), ("int4g32", 32, torch.bfloat16),
])
def test_grouped_matches_twin(name, group, dtype):
    # 40 tokens x 4 of 12 experts in tiles of 16 pairs: experts whose pairs fill several tiles, and part of one
    ex = experts(name, group)
    slot_of_expert, pool = ex.scattered_pool(seed=2)
    x, ids, weights = routing(40, 4, dtype, seed=2)
    got = fm.fused_moe_grouped(x, ids, weights, slot_of_expert, pool, ex.layout, block_m=16)
    want = fm.fused_moe_grouped_ref(x, ids, weights, slot_of_expert, pool, ex.layout)
    assert got.dtype == dtype
    assert_close(f"grouped {name} {dtype}", got, want, TOLERANCES[dtype])


def test_grouped_byte_decode_of_fp8(monkeypatch):
    monkeypatch.setenv("DSV3LITE_FP8_DECODE", "bytes")
    ex = experts("fp8", 128)
    slot_of_expert, pool = ex.scattered_pool(seed=4)
    x, ids, weights = routing(20, 4, seed=4)
    assert_close("grouped fp8 bytes", fm.fused_moe_grouped(x, ids, weights, slot_of_expert, pool, ex.layout),
                 fm.fused_moe_grouped_ref(x, ids, weights, slot_of_expert, pool, ex.layout), TOLERANCES[torch.float32])


def test_grouped_leaves_out_experts_without_a_slot():
    ex = experts("int4", 32)
    slot_of_expert, pool = ex.pool([3, 17, 8, 0, 11, 5] + [-1] * (N_EXPERTS - 6), 18)   # free slots: NaN bytes
    x, ids, weights = routing(24, 4, seed=9)
    got = fm.fused_moe_grouped(x, ids, weights, slot_of_expert, pool, ex.layout, block_m=16)
    want = ex.resident()(x, ids, torch.where(ids < 6, weights, torch.zeros_like(weights)))
    assert_close("grouped, missing experts", got, want, TOLERANCES[torch.float32])


def test_grouped_in_chunks(monkeypatch):
    # (tiles then hold other rows: the interpreter's dot, numpy's matmul, may round a row differently by position)
    ex = experts("fp8")
    slot_of_expert, pool = ex.scattered_pool(seed=5)
    x, ids, weights = routing(30, 4, seed=5)
    whole = fm.fused_moe_grouped(x, ids, weights, slot_of_expert, pool, ex.layout, block_m=16)
    per_token = 4 * (INTER + HIDDEN) * x.element_size()
    monkeypatch.setattr(fm, "GROUPED_WORKSPACE_BYTES", 7 * per_token)            # 5 chunks, the last of 2 tokens
    chunked = fm.fused_moe_grouped(x, ids, weights, slot_of_expert, pool, ex.layout, block_m=16)
    assert_close("grouped in chunks", chunked, whole, TOLERANCES[torch.float32])


def test_grouped_sum_is_the_offloaded_prefills():
    # the offloaded prefill computes each expert alone (fused_expert) and sums in combine_experts: the same bits
    from dsv3lite.moe import combine_experts

    ex = experts("int4", 128)
    slot_of_expert, pool = ex.scattered_pool(seed=6)
    x, ids, weights = routing(36, 4, seed=6)
    grouped = fm.fused_moe_grouped(x, ids, weights, slot_of_expert, pool, ex.layout)   # the default tiles, as
                                                                                        # fused_expert's
    def one(e, xs):
        return fm.fused_expert(xs, slot_of_expert[e:e + 1], pool, ex.layout)
    assert torch.equal(combine_experts(one, x, ids, weights), grouped)


def test_grouped_reads_nothing_back_to_the_host():
    # no sync per MoE layer of a prompt: the tile map and the sum stay on the device (what a CUDA graph could hold)
    from dsv3lite.testing import HostReads

    ex = experts("int4", 32)
    slot_of_expert, pool = ex.scattered_pool(seed=7)
    x, ids, weights = routing(20, 4, seed=7)
    probe = HostReads()
    with probe.mode():
        fm.fused_moe_grouped(x, ids, weights, slot_of_expert, pool, ex.layout, block_m=16)
    assert probe.found == []


def test_tile_map_covers_every_pair_once():
    gen = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(10, generator=gen)[:3] for _ in range(50)])   # 150 pairs, 10 experts
    ids[:30] = torch.tensor([7, 8, 9])                                              # expert 7: 30+ pairs
    order, tiles = fm._tile_map(ids.flatten(), 12, 8)                              # experts 10, 11: none
    flat = ids.flatten()
    assert tiles.shape == (-(-150 // 8) + 12, 3)                                   # bound: pairs / 8 + experts
    seen = []
    for e, first, end in tiles.tolist():
        assert 0 <= end - first <= 8
        rows = order[first:end]
        assert (flat[rows] == e).all()
        seen += rows.tolist()
    assert sorted(seen) == list(range(150))
    assert (flat[order].diff() >= 0).all()                                         # expert-major


def test_blob_experts_take_the_grouped_kernels_for_a_prompt(monkeypatch):
    ex = experts("int4", 32)
    x, ids, weights = routing(FUSED_MAX + 4, 4, seed=8)
    resident = ex.resident()
    monkeypatch.setenv("DSV3LITE_KERNELS", "ref")
    want = resident(x, ids, weights)
    monkeypatch.setenv("DSV3LITE_KERNELS", "triton")
    calls = []
    monkeypatch.setattr("dsv3lite.experts.fused_moe_grouped",
                        lambda *a, **k: calls.append(a[0].shape[0]) or fm.fused_moe_grouped(*a, **k))
    assert_close("BlobExperts prompt", resident(x, ids, weights), want, TOLERANCES[torch.float32])
    assert calls == [FUSED_MAX + 4]


# --- launch configuration ------------------------------------------------------------------------------

def test_decode_defaults_are_tuned_per_regime():
    from dsv3lite.kernels import tuning
    from dsv3lite.kernels.quant_matmul import launch_config

    assert launch_config("moe_down", 1, torch.bfloat16)["use_dot"] is False
    assert launch_config("moe_down", 16, torch.float32) == dict(tuning.DEFAULTS["moe_down"]["dot32"], use_dot=True)
    assert launch_config("gemv", 16, torch.bfloat16, block_n=64)["block_n"] == 64
    for kernel, candidates in tuning.CANDIDATES.items():
        for cand in candidates:
            assert set(cand) <= set(tuning.DEFAULTS[kernel]["rows"]), (kernel, cand)


def test_tuning_file_overrides_the_defaults(monkeypatch, tmp_path):
    import json

    from dsv3lite.kernels import tuning

    path = tmp_path / "tuning.json"
    path.write_text(json.dumps({"moe_down": {"rows": {"block_n": 32, "prefetch": False}}}))
    monkeypatch.setenv(tuning.ENV, str(path))
    tuning._overrides.cache_clear()
    try:
        got = tuning.config("moe_down", "rows")
        assert (got["block_n"], got["prefetch"]) == (32, False)
        assert got["num_warps"] == tuning.DEFAULTS["moe_down"]["rows"]["num_warps"]
        ex = experts("fp8")
        slot_of_expert, pool = ex.scattered_pool()
        x, ids, weights = routing(1, 4, seed=3)
        assert_close("tuned", fm.fused_moe(x, ids, weights, slot_of_expert, pool, ex.layout),
                     fm.fused_moe_ref(x, ids, weights, slot_of_expert, pool, ex.layout), TOLERANCES[torch.float32])
        path.write_text(json.dumps({"moe_down": {"rows": {"blocks": 3}}}))
        tuning._overrides.cache_clear()
        with pytest.raises(AssertionError, match="unknown knobs"):
            tuning.config("moe_down", "rows")
    finally:
        tuning._overrides.cache_clear()
