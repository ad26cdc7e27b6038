"""mla_decode: the Triton kernel against its twin, and the twin against the math.

Without a GPU the kernel runs in Triton's interpreter on CPU tensors (tests/conftest.py turns it on before
triton is imported); with a GPU the kernel runs on it.
"""
import pytest
import torch

from dsv3lite.kernels import dispatch   # imports no triton

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
triton = pytest.importorskip("triton")

import dsv3lite.kernels.mla_decode as mla  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def interpreter_on_cpu():
    # tests/conftest.py sets TRITON_INTERPRET=1 before anything imports triton when there is no GPU
    assert DEVICE.type == "cuda" or dispatch.interpreted(), "TRITON_INTERPRET=1 must be set before triton is imported"


SCALE = 0.2   # any model scale; deliberately not 1/sqrt(Dk)
# the interpreter upcasts to fp32 before tl.dot; a GPU also rounds the softmax weights to the input dtype
TOLERANCES = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def make_inputs(seqlens, sq=1, heads=4, kv_lora_rank=32, rope_dim=8, dtype=torch.float32, spare_rows=3,
                poison=True, seed=0):
    """Random q and latent cache on DEVICE; cache rows past each sequence's length hold NaN when `poison`."""
    gen = torch.Generator().manual_seed(seed)
    dk = kv_lora_rank + rope_dim
    q = torch.randn(len(seqlens), sq, heads, dk, generator=gen)
    cache = torch.randn(len(seqlens), max(seqlens) + spare_rows, dk, generator=gen)
    if poison:
        for b, length in enumerate(seqlens):
            cache[b, length:] = float("nan")
    lens = torch.tensor(seqlens, dtype=torch.int32)
    return q.to(DEVICE, dtype), cache.to(DEVICE, dtype), lens.to(DEVICE)


def assert_close(name, got, want, atol, rtol=0.0):
    got, want = got.float(), want.float()
    diff = (got - want).abs()
    assert torch.allclose(got, want, atol=atol, rtol=rtol), (
        f"{name}: max abs diff {diff.max().item():.3g}, mean abs diff {diff.mean().item():.3g}")


def check_kernel(seqlens, sq=1, heads=4, kv_lora_rank=32, rope_dim=8, dtype=torch.float32, num_splits=None):
    q, cache, lens = make_inputs(seqlens, sq, heads, kv_lora_rank, rope_dim, dtype)
    out, lse = mla.mla_decode(q, cache, lens, SCALE, kv_lora_rank, num_splits=num_splits)
    ref_out, ref_lse = mla.mla_decode_ref(q, cache, lens, SCALE, kv_lora_rank)
    assert out.shape == (len(seqlens), sq, heads, kv_lora_rank) and out.dtype == dtype
    assert lse.shape == (len(seqlens), sq, heads) and lse.dtype == torch.float32
    tol = TOLERANCES[dtype]
    assert_close("out", out, ref_out, atol=tol, rtol=tol)
    assert_close("lse", lse, ref_lse, atol=1e-4, rtol=1e-5)


def naive_attention(q, cache, seqlens, scale, kv_lora_rank):
    """Float64, every head with its own expanded copy of the rows, softmax written out over a full mask."""
    q, cache = q.double().cpu(), cache.double().cpu()
    batch, sq, heads, dk = q.shape
    tmax = cache.shape[1]
    out = torch.zeros(batch, sq, heads, kv_lora_rank, dtype=torch.float64)
    lse = torch.zeros(batch, sq, heads, dtype=torch.float64)
    for b in range(batch):
        length = int(seqlens[b])
        keys = cache[b].expand(heads, tmax, dk)                  # [H, Tmax, Dk]
        values = keys[..., :kv_lora_rank]                        # [H, Tmax, kv_lora_rank]
        mask = torch.zeros(sq, tmax, dtype=torch.bool)
        for s in range(sq):
            position = length - sq + s
            for t in range(tmax):
                mask[s, t] = t < length and t <= position
        scores = torch.einsum("shd,htd->sht", q[b], keys) * scale
        scores = torch.where(mask[:, None, :], scores, torch.tensor(float("-inf"), dtype=torch.float64))
        peak = scores.max(dim=-1, keepdim=True).values
        weights = torch.exp(scores - peak)
        total = weights.sum(dim=-1, keepdim=True)
        out[b] = torch.einsum("sht,htd->shd", weights / total, values)
        lse[b] = (peak + torch.log(total)).squeeze(-1)
    return out, lse


# --- the twin against the math ---------------------------------------------------------------

@pytest.mark.parametrize("sq", [1, 2, 4])
@pytest.mark.parametrize("kv_lora_rank,rope_dim", [(32, 8), (48, 16)])
def test_ref_matches_naive_attention(sq, kv_lora_rank, rope_dim):
    q, cache, lens = make_inputs([sq + 4, 19], sq, 4, kv_lora_rank, rope_dim, poison=False)
    out, lse = mla.mla_decode_ref(q, cache, lens, SCALE, kv_lora_rank)
    want_out, want_lse = naive_attention(q, cache, lens, SCALE, kv_lora_rank)
    assert_close("out", out.cpu(), want_out, atol=1e-5)
    assert_close("lse", lse.cpu(), want_lse, atol=1e-5)


def test_ref_lse_is_logsumexp_of_scaled_scores():
    sq, kv_lora_rank = 3, 48
    q, cache, lens = make_inputs([5, 21], sq, 4, kv_lora_rank, 16)
    _, lse = mla.mla_decode_ref(q, cache, lens, SCALE, kv_lora_rank)
    for b, length in enumerate(lens.tolist()):
        scores = torch.einsum("shd,td->sht", q[b], cache[b, :length]) * SCALE
        for s in range(sq):   # query s sees the first length - sq + s + 1 rows
            want = torch.logsumexp(scores[s, :, : length - sq + s + 1], dim=-1)
            assert_close(f"lse[{b}, {s}]", lse[b, s], want, atol=1e-5)


def test_ref_is_the_softmax_weighted_latent():
    # Sq=1 sees every valid row: out is the softmax(scores)-weighted mean of the latents.
    q, cache, lens = make_inputs([13], 1, 4, 32, 8)
    out, _ = mla.mla_decode_ref(q, cache, lens, SCALE, 32)
    probs = torch.softmax(torch.einsum("hd,td->ht", q[0, 0], cache[0, :13]) * SCALE, dim=-1)
    assert_close("out", out[0, 0], probs @ cache[0, :13, :32], atol=1e-5)


# --- the kernel against the twin -------------------------------------------------------------

@pytest.mark.parametrize("context", [1, 7, 33, 130])
@pytest.mark.parametrize("num_splits", [None, 3])
def test_kernel_context_lengths(context, num_splits):
    check_kernel([context], num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [1, 3, 8])
@pytest.mark.parametrize("context", [7, 130])   # 7 tokens = one tile: 3 and 8 splits leave empty splits
def test_kernel_forced_splits(num_splits, context):
    check_kernel([context], num_splits=num_splits)


@pytest.mark.parametrize("sq", [1, 2, 3, 4])
def test_kernel_causal_multi_query(sq):
    # batch 2 with different lengths; the first sequence holds only the Sq new tokens. In the second, the
    # last split is [64, 65): for Sq > 1 it holds no key visible to the earlier queries
    check_kernel([sq, 65], sq=sq, kv_lora_rank=48, rope_dim=16, num_splits=2)


@pytest.mark.parametrize("heads,context", [(4, 40), (16, 40), (128, 5)])
def test_kernel_head_counts(heads, context):
    check_kernel([context, context // 2 + 2], sq=2, heads=heads, num_splits=2)


@pytest.mark.parametrize("kv_lora_rank,rope_dim,context", [(32, 8, 45), (48, 16, 45), (512, 64, 9)])
def test_kernel_latent_and_rope_widths(kv_lora_rank, rope_dim, context):
    check_kernel([context], sq=2, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim, num_splits=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_kernel_dtypes(dtype):
    check_kernel([37, 12], sq=2, kv_lora_rank=48, rope_dim=16, dtype=dtype, num_splits=3)


def test_kernel_automatic_splits_on_long_context():
    context = 2 * mla._MIN_SPLIT_TOKENS + 9
    assert mla._auto_num_splits(1, 1, context, 4, 32, 40, torch.device("cpu")) == 2
    check_kernel([context])


def test_auto_num_splits_bounds():
    cpu = torch.device("cpu")
    v3 = (128, 512, 576)                                                        # rows (heads), kv_lora_rank, Dk
    assert mla._auto_num_splits(1, 1, 64, *v3, cpu) == 1                  # short context: one split
    assert mla._auto_num_splits(64, 8, 100_000, *v3, cpu) == 1            # enough programs already
    assert mla._auto_num_splits(1, 1, 10**7, *v3, cpu) <= mla._MAX_SPLITS
    for context in (200, 1000, 5000):
        splits = mla._auto_num_splits(1, 8, context, *v3, cpu)
        assert splits >= 1 and context // splits >= mla._MIN_SPLIT_TOKENS


def test_split_partials_stay_within_half_the_cache(monkeypatch):
    # an H200 (132 SMs) would take 33 splits of a 4K V3 context for two waves; the partial outputs (rows x 512 per
    # split) would then outweigh the 4096 x 576 cache rows they summarise
    monkeypatch.setattr(mla.dispatch, "sm_count", lambda device: 132)
    rows, rank, dk = 128, 512, 576
    for context in (4096, 32768, 131072):
        splits = mla._auto_num_splits(1, rows // 16, context, rows, rank, dk, torch.device("cpu"))
        assert rows * rank * splits <= context * dk // 2, (context, splits)
        assert splits >= min(8, mla.max_splits(context)), (context, splits)     # still enough programs


def test_empty_sequence_gives_zeros_not_nan():
    # a free batch slot (length 0) next to a real one
    q, cache, lens = make_inputs([0, 20], heads=4)
    for out, lse in (mla.mla_decode(q, cache, lens, SCALE, 32, num_splits=3),
                     mla.mla_decode_ref(q, cache, lens, SCALE, 32)):
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        assert torch.isneginf(lse[0]).all()
        assert torch.isfinite(out[1]).all() and torch.isfinite(lse[1]).all()


def test_rejects_bad_inputs():
    q, cache, lens = make_inputs([9], sq=1)
    with pytest.raises(AssertionError, match="Sq"):
        mla.mla_decode(q.expand(1, 5, 4, 40).contiguous(), cache, lens, SCALE, 32)
    with pytest.raises(AssertionError, match="int32"):
        mla.mla_decode(q, cache, lens.long(), SCALE, 32)
    with pytest.raises(AssertionError, match="dtype"):
        mla.mla_decode(q, cache.half(), lens, SCALE, 32)
    with pytest.raises(AssertionError, match="contiguous"):
        mla.mla_decode(q.expand(1, 2, 4, 40).transpose(1, 2), cache, lens, SCALE, 32)   # a [1, 4, 2, 40] view
    with pytest.raises(AssertionError, match="kv_lora_rank"):
        mla.mla_decode(q, cache, lens, SCALE, 40)


# --- sparse decode (per-query index lists, DeepSeek-V3.2) --------------------------------------

def make_indices(seqlens, sq, count, seed=1, holes=True):
    """int32 [B, Sq, count]: distinct rows of each sequence per query, in random order; for Sq > 1 they include
    rows past earlier queries' positions (which must be skipped), and with `holes` some -1 entries."""
    gen = torch.Generator().manual_seed(seed)
    out = torch.full((len(seqlens), sq, count), -1, dtype=torch.int32)
    for b, length in enumerate(seqlens):
        for s in range(sq):
            picked = torch.randperm(length, generator=gen)[:count]
            out[b, s, :len(picked)] = picked.to(torch.int32)
            if holes and count > 2:
                out[b, s, torch.randint(0, count, (2,), generator=gen)] = -1
    return out.to(DEVICE)


def naive_sparse_attention(q, cache, seqlens, scale, kv_lora_rank, indices):
    """naive_attention's math with each query's keys restricted to its index list (float64, a full mask)."""
    batch, sq, _, _ = q.shape
    q64, cache64 = q.double().cpu(), cache.double().cpu()
    out = torch.zeros(batch, sq, q.shape[2], kv_lora_rank, dtype=torch.float64)
    lse = torch.full((batch, sq, q.shape[2]), float("-inf"), dtype=torch.float64)
    for b in range(batch):
        length = int(seqlens[b])
        for s in range(sq):
            rows = [int(i) for i in indices[b, s].tolist() if 0 <= int(i) <= length - sq + s]
            if not rows:
                continue
            keys = cache64[b, rows]                                  # [n, Dk]
            scores = q64[b, s] @ keys.T * scale                      # [H, n]
            peak = scores.max(dim=-1, keepdim=True).values
            weights = torch.exp(scores - peak)
            total = weights.sum(dim=-1, keepdim=True)
            out[b, s] = (weights / total) @ keys[:, :kv_lora_rank]
            lse[b, s] = (peak + torch.log(total)).squeeze(-1)
    return out, lse


def check_sparse_kernel(seqlens, count, sq=1, heads=4, kv_lora_rank=32, rope_dim=8, dtype=torch.float32,
                        num_splits=None):
    q, cache, lens = make_inputs(seqlens, sq, heads, kv_lora_rank, rope_dim, dtype)
    idx = make_indices(seqlens, sq, count)
    out, lse = mla.mla_decode(q, cache, lens, SCALE, kv_lora_rank, num_splits=num_splits, indices=idx)
    ref_out, ref_lse = mla.mla_decode_ref(q, cache, lens, SCALE, kv_lora_rank, indices=idx)
    assert out.shape == (len(seqlens), sq, heads, kv_lora_rank) and out.dtype == dtype
    tol = TOLERANCES[dtype]
    assert_close("out", out, ref_out, atol=tol, rtol=tol)
    assert_close("lse", lse, ref_lse, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("sq", [1, 3])
def test_sparse_ref_matches_naive_attention(sq):
    q, cache, lens = make_inputs([40, 23], sq, 4, 32, 8)
    idx = make_indices([40, 23], sq, 12)
    out, lse = mla.mla_decode_ref(q, cache, lens, SCALE, 32, indices=idx)
    want_out, want_lse = naive_sparse_attention(q, cache, lens, SCALE, 32, idx)
    assert_close("out", out.cpu(), want_out, atol=1e-5)
    assert_close("lse", lse.cpu(), want_lse, atol=1e-5)


def test_sparse_with_every_row_listed_is_dense():
    q, cache, lens = make_inputs([30, 17], 2, 4, 32, 8)
    idx = torch.full((2, 2, 30), -1, dtype=torch.int32)
    for b, length in enumerate([30, 17]):
        idx[b, :, :length] = torch.randperm(length, generator=torch.Generator().manual_seed(b)).to(torch.int32)
    idx = idx.to(DEVICE)
    dense = mla.mla_decode_ref(q, cache, lens, SCALE, 32)
    for out, lse in (mla.mla_decode_ref(q, cache, lens, SCALE, 32, indices=idx),
                     mla.mla_decode(q, cache, lens, SCALE, 32, num_splits=2, indices=idx)):
        assert_close("out", out, dense[0], atol=1e-5)
        assert_close("lse", lse, dense[1], atol=1e-5)


def test_latent_attention_sparse_matches_ref():
    # the model's CPU path: one sequence, indices the indexer's top-k (rows of the sequence, later ones masked)
    q, cache, lens = make_inputs([50], 3, 4, 32, 8, poison=False)
    idx = make_indices([50], 3, 16, holes=False)
    got = mla.latent_attention(q[0], cache[0, :50], SCALE, 32, idx[0])
    want, _ = mla.mla_decode_ref(q, cache, lens, SCALE, 32, indices=idx)
    assert_close("out", got, want[0], atol=1e-5)
    assert_close("mla_attend", mla.mla_attend(q, cache[:, :50], SCALE, 32, idx), want, atol=1e-5)


@pytest.mark.parametrize("count,num_splits", [(1, None), (12, None), (40, 3), (100, 2)])
def test_sparse_kernel_index_counts(count, num_splits):
    check_sparse_kernel([130], count, num_splits=num_splits)


@pytest.mark.parametrize("sq", [1, 2, 4])
def test_sparse_kernel_causal_multi_query(sq):
    # query s skips listed rows past its own position; a short sequence lists fewer rows (-1 padding)
    check_sparse_kernel([sq + 5, 70], 24, sq=sq, kv_lora_rank=48, rope_dim=16, num_splits=2)


@pytest.mark.parametrize("heads", [4, 16, 20])
def test_sparse_kernel_head_counts(heads):
    # 20 heads: the last head block of each query is partial
    check_sparse_kernel([45, 33], 16, sq=2, heads=heads, num_splits=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_sparse_kernel_dtypes(dtype):
    check_sparse_kernel([37, 60], 20, sq=2, kv_lora_rank=48, rope_dim=16, dtype=dtype, num_splits=3)


def test_sparse_kernel_reads_rows_of_a_wider_cache():
    # the model's cache rows hold [latent | indexer key]: attention reads a strided view of the first Dk columns
    q, cache, lens = make_inputs([64], 2, 4, 32, 8, poison=False)
    wide = torch.cat([cache, torch.full_like(cache[..., :16], float("nan"))], dim=-1)
    view = wide[..., :40]
    idx = make_indices([64], 2, 20)
    want = mla.mla_decode_ref(q, cache, lens, SCALE, 32, indices=idx)
    for indices in (idx, None):
        got = mla.mla_decode(q, view, lens, SCALE, 32, num_splits=2, indices=indices)
        ref = want if indices is not None else mla.mla_decode_ref(q, cache, lens, SCALE, 32)
        assert_close("out", got[0], ref[0], atol=1e-4, rtol=1e-4)


def test_sparse_empty_sequence_gives_zeros_not_nan():
    q, cache, lens = make_inputs([0, 20], heads=4)
    idx = make_indices([0, 20], 1, 8)
    for out, lse in (mla.mla_decode(q, cache, lens, SCALE, 32, num_splits=2, indices=idx),
                     mla.mla_decode_ref(q, cache, lens, SCALE, 32, indices=idx)):
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        assert torch.isneginf(lse[0]).all()
        assert torch.isfinite(out[1]).all()


def test_sparse_rejects_bad_indices():
    q, cache, lens = make_inputs([9], sq=2)
    idx = make_indices([9], 2, 4)
    with pytest.raises(AssertionError, match="int32"):
        mla.mla_decode(q, cache, lens, SCALE, 32, indices=idx.long())
    with pytest.raises(AssertionError, match="indices must be"):
        mla.mla_decode(q, cache, lens, SCALE, 32, indices=idx[:, :1])


# --- dispatch ---------------------------------------------------------------------------------

def test_dispatch_rules(monkeypatch):
    assert dispatch.triton_available()
    monkeypatch.setenv("DSV3LITE_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert dispatch.interpreted()
    assert dispatch.use_kernels("cpu") and dispatch.use_kernels(torch.device("cuda"))
    monkeypatch.setenv("DSV3LITE_KERNELS", "ref")
    assert not dispatch.use_kernels("cuda") and not dispatch.use_kernels("cpu")
    monkeypatch.delenv("DSV3LITE_KERNELS")
    assert not dispatch.use_kernels("cpu") and dispatch.use_kernels("cuda")   # the interpreter alone is not enough
    monkeypatch.setenv("DSV3LITE_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not dispatch.interpreted()
    assert not dispatch.use_kernels("cpu") and dispatch.use_kernels("cuda:0")


def test_auto_picks_kernel_or_twin(monkeypatch):
    q, cache, lens = make_inputs([30, 11], sq=2)
    monkeypatch.setenv("DSV3LITE_KERNELS", "triton")
    kernel = mla.mla_decode(q, cache, lens, SCALE, 32, num_splits=2)
    auto = mla.mla_decode_auto(q, cache, lens, SCALE, 32, num_splits=2)
    assert all(torch.equal(a, k) for a, k in zip(auto, kernel))
    monkeypatch.setenv("DSV3LITE_KERNELS", "ref")
    twin = mla.mla_decode_ref(q, cache, lens, SCALE, 32)
    auto = mla.mla_decode_auto(q, cache, lens, SCALE, 32, num_splits=2)
    assert all(torch.equal(a, t) for a, t in zip(auto, twin))
