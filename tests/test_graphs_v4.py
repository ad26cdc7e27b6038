"""DeepSeek-V4's decode step as CUDA-graph segments (dsv3lite/executors/graphs.py), run here with the stand-in capture:
each block's feed-forward (mHC mixes, router, shared and resident routed experts) captures and its attention runs
between the segments; the steps give the eager decode's streams and cache, the engine's tokens (plain, MTP
verification, offloaded), observers see what they see in eager decode, and the captured work reads nothing back to
the host (the Triton kernels in the interpreter)."""
from __future__ import annotations

import pytest
import torch

import dsv3lite
from dsv3lite.executors import graphs
from dsv3lite.executors.graphs import DecodeGraphs, eager_capture
from dsv3lite.testing import HostReads, offload_budget

EAGER_STEP = True                 # the reference step is the eager model path (conftest.py), not the C++ step
pytestmark = pytest.mark.usefixtures("one_thread")
CTX = 96
PROMPT = [5, 9, 17, 33, 2, 41, 8, 77, 120, 3, 64]


@pytest.fixture(scope="module")
def official(v4_dir):
    """The session's tiny DeepSeek-V4 in the released layout (conftest.py)."""
    return v4_dir


def load(path, **kw):
    llm = dsv3lite.load(path, device="cpu", ctx_size=CTX, progress=False, log=lambda m: None, **kw)
    llm.stop_ids = set()
    return llm


def greedy(llm, n=16):
    llm.reset()
    return [c.token_id for c in llm.generate(PROMPT, max_tokens=n)]


def with_graphs(llm, capture=eager_capture):
    logs: list[str] = []
    llm.graphs = DecodeGraphs(llm.model, log=logs.append, capture=capture)
    return logs


def eager_and_graph_steps(model, tol: float):
    """22 decode steps after the prompt, past compressed windows of every kind, through the model's eager forward
    and through the graphs on fresh caches: the streams and every cache tensor agree within `tol`; -> the runner."""
    tokens = PROMPT + [7 * i + 3 for i in range(22)]
    runs = []
    for graphs_on in (False, True):
        runner = DecodeGraphs(model, capture=eager_capture)
        cache = model.new_cache(CTX, torch.float32, torch.device("cpu"))
        with torch.inference_mode():
            model.hidden(torch.tensor([tokens[:len(PROMPT)]]), 0, cache)
            out = [runner.hidden([tokens[p]], p, cache) if graphs_on else
                   model.hidden(torch.tensor([[tokens[p]]]), p, cache) for p in range(len(PROMPT), len(tokens))]
        runs.append((out, [t.clone() for t in cache.tensors()]))
    (eager, eager_cache), (replayed, cache) = runs
    assert replayed[0].shape == eager[0].shape == (1, 1, model.args.hc_mult, model.args.hidden_size)
    for a, b in zip(eager + eager_cache, replayed + cache):
        torch.testing.assert_close(b, a, rtol=tol, atol=tol)
    return runner


def test_graph_steps_give_the_eager_streams_and_cache(official):
    """Decode steps through the segments give eager decode's streams, and leave every cache object (ring,
    compressors' state and entries, indexer keys) as eager decode does."""
    model = load(official, mtp=False).model
    assert graphs.supported(model)
    runner = eager_and_graph_steps(model, 1e-5)
    # off the kernels: the embedding, then one segment a block (its feed-forward, resident blob experts inside it)
    assert runner.stats() == {"graphs_per_step": {1: 1 + model.args.num_hidden_layers}, "off": None}


@pytest.mark.parametrize("mtp", [False, True])
def test_engine_tokens_with_graphs_equal_eager_ones(official, mtp):
    llm = load(official, mtp=mtp, mtp_adaptive=False)
    expected = greedy(llm)
    logs = with_graphs(llm)
    assert greedy(llm) == expected and not logs
    sizes = llm.graphs.stats()["graphs_per_step"]
    assert set(sizes) == ({2} if mtp else {1})                 # MTP verification: every step is 2 tokens
    assert llm.stats()["cuda_graphs"]["off"] is None


def test_offloaded_graph_steps_equal_resident_ones(official):
    """Host-scheduled experts run between the segments, after the offloading predictor (a layer observer) has seen
    the layer's routing from the segment before."""
    expected = greedy(load(official, mtp=False))
    budget = offload_budget(official, 12, None, ctx=CTX, mtp=False)
    off = load(official, mtp=False, gpu_mem=budget, miss_policy="fetch")
    logs = with_graphs(off)
    assert greedy(off) == expected and not logs
    n = off.model.args.num_hidden_layers
    assert off.graphs.stats()["graphs_per_step"] == {1: 1 + 2 * n}  # each block: before and after its experts
    s = off.stats()["expert_cache"]
    assert s["predictor_by_layer_kind"]["hash"]["recall"] == 1.0


def test_observers_see_what_they_see_in_eager_decode(official):
    llm = load(official, mtp=False)
    seen: dict[str, list] = {"eager": [], "graphs": []}
    where = ["eager"]

    def on_layer(block, h, routed):
        seen[where[0]].append(("layer", block.layer_id, h.clone(), routed[1][1].sort(dim=-1).values.clone()))

    def on_routing(layer_id, ids, scores):
        seen[where[0]].append(("routing", layer_id, ids.sort(dim=-1).values.clone()))

    handle = llm.model.add_observer(on_layer=on_layer, on_routing=on_routing)
    try:
        greedy(llm, n=6)
        where[0] = "graphs"
        with_graphs(llm)
        greedy(llm, n=6)
    finally:
        handle.remove()
    def one_token(e):                   # a decode step's (the prompt runs eagerly either way)
        return (e[2].shape[1] if e[0] == "layer" else e[2].shape[0]) == 1

    decode = [[e for e in seen[w] if one_token(e)] for w in ("eager", "graphs")]
    assert len(decode[0]) == len(decode[1]) > 0
    for a, b in zip(*decode):
        assert a[:2] == b[:2]
        for x, y in zip(a[2:], b[2:]):
            torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-5)


def test_captured_work_reads_nothing_back_to_the_host(official, monkeypatch):
    """Every segment's ops under an operator probe on the kernel path (the Triton kernels in the interpreter),
    resident and offloaded: the feed-forwards, hash layers included, read nothing back."""
    monkeypatch.setenv("DSV3LITE_KERNELS", "triton")
    probe = HostReads()
    budget = offload_budget(official, 12, None, ctx=CTX, mtp=False)
    for extra in (dict(mtp=False), dict(mtp=False, gpu_mem=budget, miss_policy="fetch")):
        llm = load(official, **extra)
        logs = with_graphs(llm, probe.capture)
        greedy(llm, n=4)
        assert not logs and llm.graphs.plans
    assert probe.found == []


@pytest.mark.parametrize("kernels", ["ref", "triton"])
def test_the_workspace_estimate_covers_what_the_graphs_hold(official, monkeypatch, kernels):
    """What a step's graphs keep between steps (their static inputs and outputs; measured here, where the stand-in
    keeps them as plain tensors) fits the planner's allowance for them (v4/sizes.py), for each step size, with the
    attention between the segments and captured."""
    from dsv3lite.v4.sizes import decode_graph_bytes

    monkeypatch.setenv("DSV3LITE_KERNELS", kernels)

    llm = load(official, mtp=False)
    model = llm.model
    runner = DecodeGraphs(model, capture=eager_capture)
    cache = model.new_cache(CTX, torch.float32, torch.device("cpu"))
    owned = {t.data_ptr() for t in cache.tensors()}
    with torch.inference_mode():
        for n in (1, 4):
            runner.hidden(list(range(3, 3 + n)), 0, cache)
    held = {t.data_ptr(): t.numel() * t.element_size() for t in runner._keep
            if isinstance(t, torch.Tensor) and t.data_ptr() not in owned}
    assert 0 < sum(held.values()) <= decode_graph_bytes(model.args, CTX, 4)


@pytest.mark.parametrize("mode", ["resident", "offloaded", "mtp"])
def test_attention_captures_on_the_triton_kernels(official, monkeypatch, mode):
    """Where the kernels run (here the Triton interpreter) the whole resident step is one graph: every block's
    attention is captured too, its ring, compressors and indexer reading the positions from the device. Tokens
    equal the eager step's on the same kernels, plain, offloaded (one graph a block's experts apart) and with MTP
    verification (2-token steps)."""
    monkeypatch.setenv("DSV3LITE_KERNELS", "triton")
    kw = dict(mtp=mode == "mtp", mtp_adaptive=False)
    if mode == "offloaded":
        kw.update(gpu_mem=offload_budget(official, 12, None, ctx=CTX, mtp=False), miss_policy="fetch")
    llm = load(official, **kw)
    steps = 5 if mode == "offloaded" else 14                # (the interpreter runs each offloaded expert apart)
    expected = greedy(llm, n=steps)
    logs = with_graphs(llm)
    assert greedy(llm, n=steps) == expected and not logs
    n = llm.model.args.num_hidden_layers
    assert llm.graphs.stats()["graphs_per_step"] == {"resident": {1: 1}, "offloaded": {1: n + 1},
                                                      "mtp": {2: 1}}[mode]


def test_device_positions_give_the_host_positions_streams_and_entries(official, monkeypatch):
    """Decode steps through the captured attention (device positions): the streams and every cache tensor within
    float error of the host-position kernel path (the kernels attend over the cache's whole capacity there, so
    their splits differ)."""
    monkeypatch.setenv("DSV3LITE_KERNELS", "triton")
    runner = eager_and_graph_steps(load(official, mtp=False).model, 1e-4)
    assert runner.stats()["graphs_per_step"] == {1: 1}
