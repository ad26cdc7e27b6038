"""DeepSeek-V4 decode attention (kernels/v4_attention.py), indexer scores (kernels/v4_indexer.py) and the
compressors' entries (kernels/v4_compressor.py): each twin is the eager math on a real decode state (window ring,
CSA selection, HCA entries, the compressors' rings), the Triton kernels (in the interpreter without a GPU) match their
twins at small widths and at V4-Flash's (512-wide rows and 64 heads; 64 index heads of 128; 512- and 128-wide
entries), and a tiny V4 decodes the same through them."""
from __future__ import annotations

import pytest
import torch

from dsv3lite.kernels import dispatch
from dsv3lite.kernels.mla_decode import MAX_QUERIES
from dsv3lite.testing_v4 import load_v4, write_v4_hf
from dsv3lite.v4 import attention as v4attn
from dsv3lite.v4.cache import new_cache

triton = pytest.importorskip("triton")
from dsv3lite.kernels.v4_attention import v4_decode_attention, v4_decode_attention_ref  # noqa: E402
from dsv3lite.kernels.v4_compressor import compress_entry, compress_entry_ref  # noqa: E402
from dsv3lite.kernels.v4_indexer import index_scores, index_scores_ref  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCES = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@pytest.fixture(autouse=True, scope="module")
def interpreter_on_cpu():
    assert DEVICE.type == "cuda" or dispatch.interpreted(), "TRITON_INTERPRET=1 must be set before triton is imported"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    pytest.importorskip("transformers")          # (writes the checkpoint; the GPU suite's machine may lack it)
    return write_v4_hf(tmp_path_factory.mktemp("v4attn"), "tiny")


def case(heads, dim, window, ring, start, sq, n_entries, topk, dtype, seed=0):
    """Random inputs: q, the ring, sinks, entries and (topk > 0) index lists with -1 holes."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, sq, heads, dim, generator=gen).to(DEVICE, dtype)
    kv = torch.randn(2, ring, dim, generator=gen).to(DEVICE, dtype)
    sink = torch.randn(heads, generator=gen).to(DEVICE)
    entries = torch.randn(2, n_entries, dim, generator=gen).to(DEVICE, dtype) if n_entries else None
    indices = None
    if topk:
        indices = torch.stack([torch.stack([torch.randperm(n_entries, generator=gen)[:topk] for _ in range(sq)])
                               for _ in range(2)]).to(torch.int32)
        indices[:, :, ::3] = -1                                           # picks the query cannot see
        indices = indices.to(DEVICE)
    return q, kv, start, window, sink, dim ** -0.5, entries, indices


def assert_close(name, got, want, tol):
    got, want = got.float().cpu(), want.float().cpu()
    assert got.shape == want.shape and torch.isfinite(got).all(), name
    diff = (got - want).abs().max().item()
    assert diff <= tol * max(want.abs().max().item(), 1.0), f"{name}: max abs diff {diff:.3g}"


# --- the twin is the eager attention ------------------------------------------------------------------------

def test_twin_is_the_eager_attention_on_decode_states(tiny_dir, monkeypatch):
    """Every _attend call of a tiny V4's decode steps (and a 3-token verify-sized chunk): the twin, fed the same
    window rows as a ring, gives the same bits, in sliding, CSA (selected and all-visible) and HCA layers."""
    model = load_v4(tiny_dir, log=lambda m: None)
    seen, original = [], v4attn.Attention._attend

    def spy(self, q, start, positions, keys, entries, selected):
        out = original(self, q, start, positions, keys, entries, selected)
        if q.shape[1] > MAX_QUERIES:                                          # a prefill chunk
            return out
        rows = self.window + q.shape[1] - 1
        kpos = torch.arange(start + q.shape[1] - keys.shape[1], start + q.shape[1])
        ring = torch.full((keys.shape[0], rows, keys.shape[2]), float("nan"), dtype=keys.dtype)
        ring[:, kpos % rows] = keys                                           # position p at row p mod R
        twin = v4_decode_attention_ref(q, ring, start, self.window, self.attn_sink, self.head_dim ** -0.5, entries,
                                       None if selected is None else selected.to(torch.int32), self.ratio)
        assert torch.equal(out, twin), (self.kind, start)
        seen.append((self.kind, selected is not None))
        return out

    monkeypatch.setattr(v4attn.Attention, "_attend", spy)
    ids = torch.randint(2, model.args.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    cache = new_cache(model.args, 64, with_mtp=False)
    with torch.inference_mode():
        model.hidden(ids[:, :30], 0, cache)
        seen.clear()
        for p in range(30, 37):
            model.hidden(ids[:, p:p + 1], p, cache)
        model.hidden(ids[:, 37:40], 37, cache)
    assert {kind for kind, _ in seen} == {"sliding", "csa", "hca"} and any(sel for _, sel in seen)


# --- the kernel against the twin ----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind,start,sq,splits", [
    ("sliding", 3, 1, 1),          # fewer tokens than the window
    ("sliding", 45, 4, 2),         # ring wrapped, a verify pass, two splits
    ("hca", 50, 2, None),          # all entries visible by position
    ("hca", 46, 3, 2),             # the second query closes a window: it sees one entry more than the first
    ("csa", 61, 3, 3),             # index lists with holes, three splits
    ("csa", 20, 1, None),
])
def test_kernel_matches_twin(kind, start, sq, splits, dtype):
    n_entries = {"sliding": 0, "hca": 4, "csa": 14}[kind]
    args = case(heads=5, dim=40, window=12, ring=15, start=start, sq=sq, n_entries=n_entries,
                topk=6 if kind == "csa" else 0, dtype=dtype, seed=start)
    ratio = 16 if kind == "hca" else 4
    got = v4_decode_attention(*args, ratio=ratio, num_splits=splits)
    want = v4_decode_attention_ref(*args, ratio=ratio)
    assert got.dtype == dtype
    assert_close(f"{kind} start={start} Sq={sq}", got, want, TOLERANCES[dtype])


def test_kernel_at_flash_width():
    """V4-Flash's 64 heads of 512-wide rows, the 128-token window and a few selected entries, split in four."""
    args = case(heads=64, dim=512, window=128, ring=131, start=300, sq=2, n_entries=20, topk=8,
                dtype=torch.bfloat16, seed=1)
    got = v4_decode_attention(*args, ratio=4, num_splits=4)
    assert_close("flash width", got, v4_decode_attention_ref(*args, ratio=4), TOLERANCES[torch.bfloat16])


def test_sink_takes_the_weight_of_a_query_without_keys():
    """A head whose sink dominates gives ~0 output; a query that sees no entry and a window of one row still
    counts the sink once, however the keys are split."""
    q, kv, _, window, sink, scale, entries, _ = case(heads=3, dim=16, window=4, ring=7, start=0, sq=1, n_entries=2,
                                                     topk=0, dtype=torch.float32)
    sink = torch.tensor([30.0, 0.0, -30.0], device=DEVICE)
    outs = [v4_decode_attention(q, kv, 0, window, sink, scale, entries, ratio=4, num_splits=s) for s in (1, 2)]
    want = v4_decode_attention_ref(q, kv, 0, window, sink, scale, entries, ratio=4)
    for got in outs:
        assert_close("sink", got, want, TOLERANCES[torch.float32])
    assert outs[0][:, :, 0].abs().max() < 1e-6                                 # the sink took it all
    p_row = 1 / (1 + torch.exp(-(q[:, 0, 2] @ kv[:, 0].T).diagonal() * scale - 30.0))
    torch.testing.assert_close(want[:, 0, 2], p_row[:, None] * kv[:, 0], rtol=1e-5, atol=1e-6)


# --- the indexer's scores --------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,dim,n,sq", [(9, 12, 300, 3), (9, 12, 2000, 4), (64, 128, 700, 1)])
def test_index_scores_match_twin(heads, dim, n, sq, dtype):
    """Odd head counts and widths (masked), a tile a program and several (2,000 keys), partial tiles; the last
    queries see all but a few keys."""
    gen = torch.Generator().manual_seed(heads)
    q = torch.randn(2, sq, heads, dim, generator=gen).to(DEVICE, dtype)
    keys = torch.randn(2, n, dim, generator=gen).to(DEVICE, dtype)
    weights = (torch.randn(2, sq, heads, generator=gen) * heads ** -0.5).to(DEVICE)
    start = 4 * n - 9
    got = index_scores(q, weights, keys, start, 4)
    want = index_scores_ref(q, weights, keys, torch.arange(start, start + sq, device=DEVICE), 4)
    hidden = torch.isinf(want)
    assert hidden.any() and torch.equal(torch.isinf(got), hidden)                       # the same keys not visible
    assert_close(f"index {heads}x{dim} {dtype}", got.masked_fill(hidden, 0), want.masked_fill(hidden, 0), 1e-5)


# --- the model through the kernel ---------------------------------------------------------------------------

def test_tiny_v4_decodes_the_same_through_the_kernel(tiny_dir, monkeypatch):
    model = load_v4(tiny_dir, log=lambda m: None)
    ids = torch.randint(2, model.args.vocab_size, (1, 35), generator=torch.Generator().manual_seed(4))
    calls, index_calls, compress_calls = [], [], []
    real, real_index = v4attn.v4_decode_attention, v4attn.index_scores
    real_compress = v4attn.v4_compressor.compress_entry
    monkeypatch.setattr(v4attn, "v4_decode_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(v4attn, "index_scores", lambda *a, **k: index_calls.append(1) or real_index(*a, **k))
    monkeypatch.setattr(v4attn.v4_compressor, "compress_entry",
                        lambda *a, **k: compress_calls.append(a[4]) or real_compress(*a, **k))

    def decode(kernels):
        monkeypatch.setenv("DSV3LITE_KERNELS", kernels)
        cache = new_cache(model.args, 40, with_mtp=False)
        with torch.inference_mode():
            steps = [model.logits(model.hidden(ids[:, :24], 0, cache))[:, -1]]
            steps += [model.logits(model.hidden(ids[:, p:p + 1], p, cache))[:, -1] for p in range(24, 32)]
            steps.append(model.logits(model.hidden(ids[:, 32:35], 32, cache))[:, -1])   # a verify-sized step
        return torch.stack(steps)

    want = decode("ref")
    assert not calls and not index_calls and not compress_calls
    got = decode("triton")
    assert len(calls) == 9 * model.args.num_hidden_layers and index_calls            # CSA layers select here
    assert set(compress_calls) == {4, model.args.compress_rate_hca}           # windows close at 27, 31 and 34
    torch.testing.assert_close(got, want, rtol=0, atol=2e-4)


# --- the compressors at decode -------------------------------------------------------------------------------

def compressor_case(width, rope, overlap, ratio, window, ring_rows, dtype, seed=0):
    """Random fp32 rings holding the window's tokens (and others), a norm weight, the rotary tables of the window's
    first position rounded to dtype, and an entries tensor of NaN rows."""
    gen = torch.Generator().manual_seed(seed)
    channels = width * (2 if overlap else 1)
    cv = torch.randn(2, ring_rows, channels, generator=gen).to(DEVICE)
    g = (torch.randn(2, ring_rows, channels, generator=gen) * 3).to(DEVICE)
    weight = (1 + 0.1 * torch.randn(width, generator=gen)).to(DEVICE)
    angles = window * ratio * torch.rand(rope // 2, generator=gen)
    cos, sin = angles.cos().to(DEVICE, dtype), angles.sin().to(DEVICE, dtype)
    entries = torch.full((2, window + 3, width), float("nan"), device=DEVICE, dtype=dtype)
    return cv, g, entries, weight, cos, sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("width,rope,overlap,ratio,window", [
    (24, 8, True, 4, 0),           # window 0 with overlap: series A reaches before position 0
    (24, 8, True, 4, 9),           # ring wrapped
    (40, 8, False, 16, 3),
    (512, 64, True, 4, 70),        # V4-Flash: CSA's compressor
    (128, 64, True, 4, 33),        # V4-Flash: the indexer's keys
    (512, 64, False, 128, 5),      # V4-Flash: HCA
])
def test_compress_entry_matches_twin(width, rope, overlap, ratio, window, dtype):
    ring_rows = ratio * (2 if overlap else 1) + 3
    cv, g, entries, weight, cos, sin = compressor_case(width, rope, overlap, ratio, window, ring_rows, dtype, window)
    compress_entry(cv, g, entries, window, ratio, overlap, weight, 1e-6, cos, sin)
    want = compress_entry_ref(cv, g, window, ratio, overlap, weight, 1e-6, cos, sin, dtype)
    assert_close(f"compressor {width} ratio {ratio} window {window}", entries[:, window], want, TOLERANCES[dtype])
    others = torch.cat((entries[:, :window], entries[:, window + 1:]), dim=1)
    assert torch.isnan(others).all()                                          # only the entry's row is written


def test_compressor_twin_is_the_eager_pool_on_decode_states(tiny_dir):
    """After each decode step of a tiny V4 (eager: the PyTorch path), the entry every compressor emitted equals the
    twin's from the same rings, bit for bit (CSA's compressor and indexer, overlapping; HCA's)."""
    model = load_v4(tiny_dir, log=lambda m: None)
    ids = torch.randint(2, model.args.vocab_size, (1, 48), generator=torch.Generator().manual_seed(2))
    cache = new_cache(model.args, 64, with_mtp=False)
    checked = set()
    with torch.inference_mode():
        model.hidden(ids[:, :13], 0, cache)
        for p in range(13, 48):
            model.hidden(ids[:, p:p + 1], p, cache)
            for block, layer_cache in zip(model.layers, cache):
                attn = block.attn
                modules = {"compressor": attn.compressor,
                           "indexer": attn.indexer.compressor if attn.indexer is not None else None}
                for name, state in layer_cache.compressors.items():
                    comp = modules[name]
                    if (p + 1) % comp.ratio:
                        continue
                    window = p // comp.ratio
                    cos, sin = attn.compress_rotary.at(torch.tensor([window * comp.ratio]), state.entries.dtype)
                    twin = compress_entry_ref(state.cv.kv, state.g.kv, window, comp.ratio, comp.overlap,
                                              comp.norm.weight, comp.norm.eps, cos[0], sin[0], state.entries.dtype)
                    assert torch.equal(state.entries[:, window], twin), (attn.kind, name, p)
                    checked.add((attn.kind, name))
    assert checked == {("csa", "compressor"), ("csa", "indexer"), ("hca", "compressor")}


# --- device positions (a captured step) ------------------------------------------------------------------------

def on_device(value: int) -> torch.Tensor:
    return torch.tensor([value], device=DEVICE)


@pytest.mark.parametrize("kind,start,sq", [("sliding", 45, 2), ("hca", 46, 3), ("csa", 61, 1)])
def test_device_start_reads_only_what_the_host_start_reads(kind, start, sq):
    """The kernel with the first position on the device, over entries padded to a larger capacity with NaN rows
    (a cache's whole capacity), gives the host start's result over the entries there are: the padding is never
    read."""
    n_entries = {"sliding": 0, "hca": 4, "csa": 14}[kind]
    q, kv, _, window, sink, scale, entries, idx = case(heads=5, dim=40, window=12, ring=15, start=start, sq=sq,
                                                       n_entries=n_entries, topk=6 if kind == "csa" else 0,
                                                       dtype=torch.float32, seed=start)
    ratio = 16 if kind == "hca" else 4
    want = v4_decode_attention(q, kv, start, window, sink, scale, entries, idx, ratio=ratio)
    padded = entries
    if entries is not None:
        padded = torch.full((2, 3 * n_entries + 5, 40), float("nan"), device=DEVICE)
        padded[:, :n_entries] = entries
    got = v4_decode_attention(q, kv, on_device(start), window, sink, scale, padded, idx, ratio=ratio)
    assert_close(f"{kind} device start", got, want, TOLERANCES[torch.float32])


def test_device_start_at_flash_width():
    """V4-Flash's 64 heads of 512-wide rows, its 128-token window, an HCA layer at ratio 128: a device start over a
    capacity of NaN-padded entries gives the host start's result over the visible ones."""
    q, kv, _, window, sink, scale, entries, _ = case(heads=64, dim=512, window=128, ring=131, start=1300, sq=1,
                                                     n_entries=10, topk=0, dtype=torch.bfloat16, seed=3)
    want = v4_decode_attention(q, kv, 1300, window, sink, scale, entries, ratio=128, num_splits=2)
    padded = torch.full((2, 40, 512), float("nan"), device=DEVICE, dtype=torch.bfloat16)
    padded[:, :10] = entries
    got = v4_decode_attention(q, kv, on_device(1300), window, sink, scale, padded, ratio=128, num_splits=2)
    assert_close("flash width, device start", got, want, TOLERANCES[torch.bfloat16])


def test_index_scores_with_a_device_start_read_no_key_past_the_visible():
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 2, 9, 12, generator=gen).to(DEVICE)
    weights = torch.randn(1, 2, 9, generator=gen).to(DEVICE)
    keys = torch.randn(1, 300, 12, generator=gen).to(DEVICE)
    start = 4 * 200 + 1                                                  # 200 keys visible, then 201
    keys[:, 202:] = float("nan")
    got = index_scores(q, weights, keys, on_device(start), 4)
    want = index_scores(q, weights, keys[:, :202].clone(), start, 4)
    assert torch.isfinite(got[:, :, :200]).all() and torch.isneginf(got[:, :, 202:]).all()
    assert torch.equal(got[:, :, :202], want)


@pytest.mark.parametrize("width,rope,overlap,ratio", [(24, 8, True, 4), (24, 8, False, 16), (512, 64, True, 4),
                                                     (512, 64, False, 128)])
def test_compress_entry_with_a_device_end_writes_the_completed_window_only(width, rope, overlap, ratio):
    """A step of `queries` tokens ending at a device end: the entry of the window it completes (as the host call
    for that window), and nothing at all for a step that completes none."""
    ring_rows = ratio * (2 if overlap else 1) + 3
    cv, g, entries, weight, cos, sin = compressor_case(width, rope, overlap, ratio, 9, ring_rows, torch.float32)
    want = entries.clone()
    compress_entry(cv, g, want, 6, ratio, overlap, weight, 1e-6, cos, sin)
    got = entries.clone()
    compress_entry(cv, g, got, on_device(7 * ratio + 1), ratio, overlap, weight, 1e-6, cos, sin, queries=2)
    assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))            # the step's tokens 7r-1, 7r: entry 6
    untouched = entries.clone()
    compress_entry(cv, g, untouched, on_device(7 * ratio + 3), ratio, overlap, weight, 1e-6, cos, sin, queries=2)
    assert torch.isnan(untouched).all()                                      # tokens 7r+1, 7r+2: none completes
