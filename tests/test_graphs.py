"""The decode step as CUDA-graph segments (dsv3lite/executors/graphs.py), run here with the stand-in capture: its steps give
the eager decode's hidden states and tokens (resident, blob experts, MTP verification, offloaded, at V3's routing
geometry), observers see what they see in eager decode, and a replay that differs from the eager ops, or a capture
that fails, turns graphs off with one line and the step still gives the right answer."""
from __future__ import annotations

import pytest
import torch

import dsv3lite
from dsv3lite.executors import graphs
from dsv3lite.executors.graphs import DecodeGraphs, eager_capture
from dsv3lite.testing import HostReads, offload_budget, write_geometry_checkpoint

EAGER_STEP = True                 # the reference step is the eager model path (conftest.py), not the C++ step
pytestmark = pytest.mark.usefixtures("one_thread")
PROMPT = "The capital of France is"


def load(**kw):
    llm = dsv3lite.load(None, device="cpu", progress=False, log=lambda m: None, **kw)
    llm.stop_ids = set()
    return llm


def with_graphs(llm, capture=eager_capture):
    logs: list[str] = []
    llm.graphs = DecodeGraphs(llm.model, log=logs.append, capture=capture)
    return logs


def greedy(llm, n=12, prompt=PROMPT):
    llm.reset()
    return [c.token_id for c in llm.generate(prompt, max_tokens=n)]


@pytest.fixture(scope="module")
def demo():
    return load(mtp=False)


def decode_pair(llm, steps=5):
    """Hidden states of `steps` decode steps after a 4-token prompt, eager and through graphs, and their caches."""
    model = llm.model
    main = llm._ensure_cache()
    cache = main.tensor
    runner = DecodeGraphs(model, capture=eager_capture)
    tokens = [11, 23, 5, 42] + [7 * i + 3 for i in range(steps)]
    with torch.inference_mode():
        cache.zero_()
        model.hidden(torch.tensor([tokens[:4]]), 0, main)
        start = cache.clone()
        eager = [model.hidden(torch.tensor([[t]]), 4 + i, main, absorb=True) for i, t in enumerate(tokens[4:])]
        eager_cache = cache.clone()
        cache.copy_(start)
        replayed = [runner.hidden([t], 4 + i, main) for i, t in enumerate(tokens[4:])]
    return eager, replayed, eager_cache, cache.clone(), runner


def test_graph_steps_give_the_eager_hidden_states_and_cache(demo):
    eager, replayed, eager_cache, cache, runner = decode_pair(demo)
    for a, b in zip(eager, replayed):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache, eager_cache, rtol=1e-5, atol=1e-5)
    n_moe = sum(b.is_moe for b in demo.model.layers)
    # dense experts read their routing on the host: one segment before each MoE layer's experts, one after the last
    assert runner.stats() == {"graphs_per_step": {1: n_moe + 1}, "off": None}


def test_blob_experts_make_the_whole_step_one_graph():
    llm = load(mtp=False, experts="int4")
    eager, replayed, _, _, runner = decode_pair(llm, steps=3)
    for a, b in zip(eager, replayed):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert runner.stats()["graphs_per_step"] == {1: 1}


def test_engine_tokens_with_graphs_equal_eager_ones_with_and_without_mtp():
    for mtp in (False, True):
        llm = load(mtp=mtp, mtp_adaptive=False)
        expected = greedy(llm)
        logs = with_graphs(llm)
        assert greedy(llm) == expected and not logs
        sizes = llm.graphs.stats()["graphs_per_step"]
        assert set(sizes) == ({2} if mtp else {1})             # MTP verification: every step is 2 tokens
        assert llm.stats()["cuda_graphs"]["off"] is None


def test_observers_see_what_they_see_in_eager_decode(demo):
    seen: dict[str, list] = {"eager": [], "graphs": []}
    where = ["eager"]

    def on_attention(block, h):
        seen[where[0]].append(("attention", block.layer_id, h.clone()))

    def on_routing(layer_id, ids, scores):
        seen[where[0]].append(("routing", layer_id, ids.sort(dim=-1).values.clone()))

    handle = demo.model.add_observer(on_attention=on_attention, on_routing=on_routing)
    try:
        demo.graphs = None
        greedy(demo, n=4)
        with_graphs(demo)
        where[0] = "graphs"
        greedy(demo, n=4)
        runner = demo.graphs
        handle.remove()
        greedy(demo, n=3)
        assert len(runner.plans) == 1            # new observers: the plans captured for the old ones are gone
    finally:
        handle.remove()
        demo.graphs = None
    # prefill runs eagerly both times; the decode steps' calls come in the same order with the same values
    assert [e[:2] for e in seen["eager"]] == [e[:2] for e in seen["graphs"]]
    for (kind, _, a), (_, _, b) in zip(seen["eager"], seen["graphs"]):
        if kind == "routing":
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def baked_capture(fn):
    """A capture that keeps the first step's values (what a graph does with a position read as a Python int)."""
    static = {k: v.clone() for k, v in fn().items()}
    return static, lambda: None


def failing_capture(fn):
    raise RuntimeError("operation not permitted when stream is capturing\nmore detail")


@pytest.mark.parametrize("capture, reason", [(baked_capture, "differs from the eager one"),
                                             (failing_capture, "capture failed in embed")])
def test_a_wrong_replay_or_a_failed_capture_turns_graphs_off_with_one_line(demo, capture, reason):
    demo.graphs = None
    expected = greedy(demo)
    logs = with_graphs(demo, capture)
    try:
        assert greedy(demo) == expected
        assert len(logs) == 1 and reason in logs[0] and "decoding eagerly" in logs[0] and "\n" not in logs[0]
        assert demo.graphs.stats()["off"] is not None and not demo.graphs.plans
    finally:
        demo.graphs = None


def test_graphs_step_aside_where_they_do_not_apply(demo, monkeypatch):
    runner = DecodeGraphs(demo.model, capture=eager_capture)
    main = demo._ensure_cache()
    with torch.inference_mode():
        assert runner.hidden(list(range(5)), 0, main) is None                  # more tokens than a decode step
        assert runner.hidden([1], main.capacity, main) is None                 # past the context
    monkeypatch.setenv(graphs.ENV, "0")
    assert not graphs.enabled()
    monkeypatch.setenv(graphs.ENV, "1")
    assert graphs.enabled()


def test_the_predictor_reuses_the_routing_a_graph_computed(v3_dir):
    """Offloaded on the simulated tier: tokens equal resident ones, and each MoE layer's router runs once a step
    (the predictor takes the graph's routing instead of computing it again)."""
    kw = dict(device="cpu", ctx_size=160, progress=False, log=lambda m: None, mtp=False, experts="bf16")
    resident = dsv3lite.load(v3_dir, **kw)
    llm = dsv3lite.load(v3_dir, gpu_mem=offload_budget(v3_dir, 8, "bf16", ctx=160, mtp=False), miss_policy="fetch",
                        **kw)
    assert llm.offload is not None
    for engine in (resident, llm):
        engine.stop_ids = set()
    expected = greedy(resident)
    with_graphs(llm)
    calls = []
    for moe in llm.model.moe_modules():
        moe.gate.register_forward_hook(lambda *a: calls.append(1))
    assert greedy(llm) == expected
    n_moe = sum(b.is_moe for b in llm.model.layers)
    decode_steps = llm.stats()["generated_tokens"] - 1
    assert llm.graphs.stats()["graphs_per_step"] == {1: n_moe + 1}
    # the prefill, each step's replay, and 3 more: the stand-in runs the ops to warm up, to capture and in the
    # second step's check (the predictor computing the routing again would add one per step)
    assert len(calls) == n_moe * (1 + decode_steps + 3)
    assert llm.stats()["expert_cache"]["demand_misses"] > 0


def test_offloaded_graph_steps_at_v3_geometry_equal_resident_ones(tmp_path):
    widths = dict(hidden_size=32, moe_intermediate_size=16, intermediate_size=64, q_lora_rank=16, kv_lora_rank=16)
    path = write_geometry_checkpoint(tmp_path / "geometry", **widths)
    kw = dict(device="cpu", ctx_size=64, experts="bf16", progress=False, log=lambda m: None, mtp=False)
    resident = dsv3lite.load(path, **kw)
    offloaded = dsv3lite.load(path, gpu_mem=offload_budget(path, 200, "bf16", ctx=64, mtp=False), miss_policy="fetch", **kw)
    prompt = list(range(5, 21))
    for llm in (resident, offloaded):
        llm.stop_ids = set()
        with_graphs(llm)
    tokens = [greedy(llm, n=6, prompt=prompt) for llm in (resident, offloaded)]
    assert tokens[0] == tokens[1]
    assert resident.graphs.stats()["graphs_per_step"] == {1: 1}                  # 61 layers, one graph
    assert offloaded.graphs.stats()["graphs_per_step"] == {1: 59}                # one per MoE layer, plus one
    # a replay copies in only what its ops read and no graph wrote: the routed output of the layer before it
    (plan,) = offloaded.graphs.plans.values()
    assert sum(len(item.copied) for item in plan.items if hasattr(item, "copied")) == 58
    assert offloaded.stats()["expert_cache"]["demand_misses"] > 0


def test_graph_steps_on_the_triton_decode_kernel(monkeypatch, v3_dir):
    """The graphs' attention reads the length on the device and the whole cache (the Triton kernel, in the
    interpreter here), the eager kernel path a slice of it, split as the whole cache (4 splits at this context):
    the same tokens and the same logits, bit for bit."""
    from dsv3lite.kernels import dispatch

    assert dispatch.interpreted(), "tests/conftest.py runs Triton in its interpreter (TRITON_INTERPRET=1)"
    monkeypatch.setenv("DSV3LITE_KERNELS", "triton")
    llm = dsv3lite.load(v3_dir, device="cpu", ctx_size=512, progress=False, log=lambda m: None, mtp=False,
                        experts="int4")
    llm.stop_ids = set()

    def run():
        tokens = greedy(llm, n=5, prompt="The quick brown fox jumps over the lazy dog. " * 4)   # 2 splits used
        with torch.inference_mode():
            return tokens, llm._forward([tokens[-1]], len(llm.cached_tokens), all_logits=True)[1]

    ref_tokens, ref_logits = run()
    logs = with_graphs(llm)
    got_tokens, got_logits = run()
    assert got_tokens == ref_tokens and not logs
    assert torch.equal(got_logits, ref_logits)


def test_the_workspace_estimate_covers_what_the_graphs_hold(demo):
    """What a step's graphs keep between steps (their static inputs and outputs; measured here, where the
    stand-in keeps them as plain tensors) fits the planner's allowance for them, for each step size."""
    from dsv3lite.offload.planner import decode_graph_bytes

    demo.graphs = None
    runner = DecodeGraphs(demo.model, capture=eager_capture)
    main = demo._ensure_cache()
    cache = main.tensor
    with torch.inference_mode():
        for n in (1, 4):
            runner.hidden(list(range(3, 3 + n)), 0, main)
    held = {t.data_ptr(): t.numel() * t.element_size() for t in runner._keep
            if isinstance(t, torch.Tensor) and t.data_ptr() != cache.data_ptr()}
    assert 0 < sum(held.values()) <= decode_graph_bytes(demo.args, demo.ctx_size, cache.element_size())


def test_captured_work_reads_nothing_back_to_the_host(monkeypatch, v3_dir):
    """Every segment's ops, run under an operator probe on the kernel path (the Triton decode kernel in the
    interpreter), for a resident engine with blob experts, an offloaded one and MTP verification steps."""
    monkeypatch.setenv("DSV3LITE_KERNELS", "triton")
    probe = HostReads()
    with probe.mode():
        torch.ones(3).sum().item()                              # the probe sees what it looks for
    assert probe.found == ["aten._local_scalar_dense.default"]
    probe.found.clear()
    kw = dict(device="cpu", ctx_size=96, progress=False, log=lambda m: None)
    budget = offload_budget(v3_dir, 10, "int4", ctx=96, mtp=False)
    for extra in (dict(experts="int4", mtp=False), dict(experts="int4", mtp=False, gpu_mem=budget),
                  dict(experts="int4", mtp=True, mtp_adaptive=False)):
        llm = dsv3lite.load(v3_dir, **kw, **extra)
        llm.stop_ids = set()
        logs = with_graphs(llm, probe.capture)
        greedy(llm, n=4, prompt="The quick brown fox jumps over")
        assert not logs and llm.graphs.plans
    # on a GPU, resident blob experts are the fused MoE kernel inside the graph (here the CPU kernel runs them)
    from dsv3lite.kernels.fused_moe import fused_moe

    experts = llm.model.moe_modules()[0].experts
    x = torch.randn(2, experts.layout.hidden)
    ids = torch.tensor([[0, 3], [3, 5]])
    with probe.mode():
        fused_moe(x, ids, torch.rand(2, 2), experts.slot_table, experts.blobs, experts.layout)
    assert probe.found == []


def test_resident_experts_on_a_gpu_are_blobs_for_the_fused_kernel(v3_dir, monkeypatch):
    """With no --experts, a GPU run packs an HF checkpoint's resident experts as blobs in their own precision (the
    fused kernel: no routing read back, one graph a step); the CPU does so past the tiny-model size only."""
    from dsv3lite.builder import kernel_blobs_at_load
    from dsv3lite.config import ModelArgs

    args = ModelArgs.from_dir(v3_dir)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert kernel_blobs_at_load(args, None, cuda) == "the fused MoE kernel"
    assert kernel_blobs_at_load(args, "int4", cuda) is None               # --experts: quantized as asked
    assert kernel_blobs_at_load(args, None, cpu) is None                  # a tiny model keeps dense experts
    monkeypatch.setenv("DSV3LITE_KERNELS", "ref")                         # the twins on a GPU: dense experts
    assert kernel_blobs_at_load(args, None, cuda) is None


@pytest.mark.parametrize("kernels", ["ref", "triton"])
def test_the_graphs_attention_at_deepseek_v3_widths(monkeypatch, kernels):
    """MLA with device positions (what a graph captures: the position and length on the device, the whole cache
    read) against the eager absorbed attention on one block at V3's widths (hidden 7168, 128 heads, lora 1536 / 512), at position
    100 of a 128-row cache: the twin on the CPU, and the Triton decode kernel in the interpreter."""
    from dsv3lite.cache import LatentCache, Positions
    from dsv3lite.model import Rotary
    from dsv3lite.testing_realwidth import realwidth_moe_block

    monkeypatch.setenv("DSV3LITE_KERNELS", kernels)
    block, args = realwidth_moe_block()
    cos_t, sin_t = Rotary(args).tables(128, torch.device("cpu"))
    cache = torch.randn(1, 128, args.cache_dim) * 0.5
    x = block.attn_norm(torch.randn(1, 1, args.hidden_size))
    with torch.inference_mode():
        eager_cache = cache.clone()
        want = block.attn(x, Positions(100, 1), cos_t[100:101, None], sin_t[100:101, None],
                          LatentCache(eager_cache, args.latent_dim), absorb=True)
        positions = torch.tensor([100])
        got = block.attn(x, Positions.on_device(positions, torch.tensor([101], dtype=torch.int32)),
                         cos_t.index_select(0, positions)[:, None], sin_t.index_select(0, positions)[:, None],
                         LatentCache(cache, args.latent_dim), absorb=True)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(cache, eager_cache)                    # the same row written, nothing else touched
