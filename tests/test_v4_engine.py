"""DeepSeek-V4 through the engine (dsv3lite.load) from a released-layout checkpoint: generation decodes as the network
does; MTP speculation (greedy equal to plain decoding with drafts accepted and rejected, sampled tokens exact in
distribution, every cache kind rolled back to what a run that never drafted holds); offloaded equal to resident,
with the hash layers' experts known exactly from the token ids, on the tiny and the V4-geometry checkpoints."""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

import dsv3lite
from dsv3lite import generate
from dsv3lite.testing import offload_budget
from dsv3lite.testing_v4 import load_v4

pytestmark = pytest.mark.usefixtures("one_thread")
CTX = 160
PROMPT = [5, 9, 17, 33, 2, 41, 8, 77, 120, 3, 64]


@pytest.fixture(scope="module")
def official(v4_dir):
    """The session's tiny DeepSeek-V4 in the released layout (conftest.py)."""
    return v4_dir


def load(path, **kw):
    llm = dsv3lite.load(path, device="cpu", ctx_size=kw.pop("ctx_size", CTX), progress=False, log=lambda m: None,
                        **kw)
    llm.stop_ids = set()
    return llm


def tokens(chunks) -> list[int]:
    return [c.token_id for c in chunks]


def test_generate_decodes_as_the_network(official, monkeypatch):
    """The engine (prefill in chunks, then one token a step through the cache objects) gives the tokens of the
    network run by hand in the same steps; the released MXFP4 experts are served as released (clamped)."""
    monkeypatch.setattr(generate, "PREFILL_CHUNK", 4)                 # chunk-major, 4 tokens a forward
    monkeypatch.setattr(generate, "LAYER_MAJOR_TOKENS", 4)
    llm = load(official, mtp=False)
    got = tokens(llm.generate(PROMPT, max_tokens=30))
    model = load_v4(official, released_experts=True, mtp=False)
    assert type(llm.model.layers[0].ffn.experts) is type(model.layers[0].ffn.experts)
    assert llm.model.layers[0].ffn.experts.limit == model.args.swiglu_limit
    cache = model.new_cache(CTX, torch.float32, torch.device("cpu"))
    expected, seq = [], list(PROMPT)
    with torch.inference_mode():
        for s in range(0, len(PROMPT), 4):
            state = model.hidden(torch.tensor([PROMPT[s:s + 4]]), s, cache)
        while len(expected) < 30:
            expected.append(int(model.logits(state[:, -1:]).argmax()))
            seq.append(expected[-1])
            state = model.hidden(torch.tensor([[seq[-1]]]), len(seq) - 1, cache)
    assert got == expected
    assert llm.stats()["generated_tokens"] == 30 and llm.stats()["prefill_tok_s"] > 0


def oracle_drafts(llm, sequence: list[int], rate: float, seed: int) -> None:
    """Replace each draft, with probability `rate`, by the token plain greedy decoding gives at its position
    (sequence: the prompt and that decoding), with a one-hot q: the tiny checkpoint's random MTP block rarely agrees
    with its main model, and speculation is to be seen accepting drafts as well as rejecting them."""
    own, rng, vocab = llm.speculator.draft, random.Random(seed), llm.args.vocab_size

    def draft(cache, k, params, gen):
        drafts, qs = own(cache, k, params, gen)
        m = llm.speculator.valid                                 # the position of the step's token
        if m + 1 >= len(sequence):
            return drafts, qs
        drafts = [sequence[m + 1 + j] if m + 1 + j < len(sequence) and rng.random() < rate else d
                  for j, d in enumerate(drafts)]
        llm.speculator.on_tokens([sequence[m]])                  # the forward's tokens, as drafting announces them
        llm.speculator.on_tokens(drafts, more=True)
        return drafts, [F.one_hot(torch.tensor(d), vocab).float() for d in drafts]
    llm.speculator.draft = draft


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_speculation_equals_plain_decoding(official, k):
    expected = tokens(load(official, mtp=False).generate(PROMPT, max_tokens=40))
    spec = load(official, mtp=True, num_draft_tokens=k, mtp_adaptive=False)
    oracle_drafts(spec, PROMPT + expected, rate=0.7, seed=k)
    assert tokens(spec.generate(PROMPT, max_tokens=40)) == expected
    s = spec.stats()["mtp"]
    assert s["enabled"] and 0.2 < s["acceptance_rate"] < 1 and s["tokens_per_forward"] > 1.2
    # the next turn reuses the cached prefix (the speculator's and every cache kind's) and still decodes as plain
    turn = spec.cached_tokens + [7, 11]
    fresh = tokens(load(official, mtp=False).generate(turn, max_tokens=12))
    assert tokens(spec.generate(turn, max_tokens=12)) == fresh
    assert spec.stats()["cached_prompt_tokens"] == len(turn) - 2


def test_rollback_leaves_every_cache_as_a_run_that_never_drafted(official):
    """After speculative decoding with 3 drafts a step, partly accepted, the main blocks' caches (sliding, CSA,
    HCA) and the MTP block's give the next position what the caches of a run that never drafted give it."""
    expected = tokens(load(official, mtp=False).generate(PROMPT, max_tokens=45))
    spec = load(official, mtp=True, num_draft_tokens=3, mtp_adaptive=False)
    oracle_drafts(spec, PROMPT + expected, rate=0.6, seed=7)
    list(spec.generate(PROMPT, max_tokens=45))
    assert 0 < spec.stats()["mtp"]["acceptance_rate"] < 1
    seq = list(spec.cached_tokens)
    never = load(official, mtp=True, mtp_adaptive=False)
    never.speculator.active = lambda: False                   # the MTP cache kept up to date, no drafting
    list(never.generate(seq, max_tokens=1))
    assert never.cached_tokens == seq and spec.speculator.valid == never.speculator.valid == len(seq)
    n, mtp = len(seq), spec.args.num_hidden_layers
    outs = []
    with torch.inference_mode():
        for llm in (spec, never):
            h = llm.model.hidden(torch.tensor([[expected[-1]]]), n, llm.cache)
            d = llm.model.mtp_hidden(h, torch.tensor([[3]]), n, llm.cache[mtp])
            outs.append((llm.model.logits(h), llm.model.mtp_logits(d)))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_sampled_speculative_step_follows_the_target_distribution(official):
    """At a fixed context, the first token of a speculative step (accepted draft or correction) follows the main
    model's top-k distribution (tests/test_mtp.py's method). The drafts are drawn from a q near the target (uniform
    over its top 6), so that both acceptance and correction happen; the MTP block still runs as drafting runs it."""
    from dsv3lite.generate import RunStats
    from dsv3lite.sampling import SamplingParams, sample

    spec = load(official, mtp=True, mtp_adaptive=False, num_draft_tokens=2)
    first = int(spec.forward([PROMPT])[0, -1].argmax())
    probs = torch.softmax(spec.forward([PROMPT + [first]])[0, -1], 0)
    top = probs.topk(4)
    target = torch.zeros_like(probs).scatter_(0, top.indices, top.values / top.values.sum())
    q = torch.zeros_like(probs).scatter_(0, probs.topk(6).indices, 1 / 6)
    own = spec.speculator.draft

    def draft(cache, k, params, gen):
        own(cache, k, params, gen)
        return [sample(q, gen) for _ in range(k)], [q] * k
    spec.speculator.draft = draft
    counts, stats = torch.zeros_like(probs), RunStats()
    for seed in range(300):
        spec.reset()
        list(spec.generate(PROMPT, max_tokens=1))            # prefill; the greedy first token is `first`
        params = SamplingParams(max_tokens=2, temperature=1.0, top_k=4, seed=seed)
        with torch.inference_mode():
            new = spec._step(first, params, torch.Generator().manual_seed(seed), stats)
        counts[new[0]] += 1
    assert stats.drafted == 600 and 100 < stats.accepted < 500
    assert _chi_square(counts, target) < 16.3                   # 3 degrees of freedom: the 99.9th percentile


def test_offloaded_equals_resident_and_hash_experts_come_from_the_token_ids(official):
    """Offloaded decoding gives the resident tokens; the hash layers' experts, known from each token as it is
    sampled, are never a demand miss once the slots can hold them, and their prediction is exact (recall 1)."""
    prompt = PROMPT[:2]                                         # the prompt's union fits the slots too
    resident = tokens(load(official, mtp=False).generate(prompt, max_tokens=30))
    budget = offload_budget(official, 12, None, ctx=CTX, mtp=False)
    off = load(official, mtp=False, gpu_mem=budget, miss_policy="fetch")
    assert off.offload is not None and off.offload.limit == off.args.swiglu_limit
    assert tokens(off.generate(prompt, max_tokens=30)) == resident
    s = off.stats()["expert_cache"]
    hash_layers = range(off.args.num_hash_layers)
    assert all(s["per_layer"][i]["demand_misses"] == 0 for i in hash_layers)
    assert s["predictor_by_layer_kind"]["hash"] == {"precision": 1.0, "recall": 1.0}
    assert s["predictor_by_distance"]["token"]["recall"] == 1.0
    assert 0 < s["predictor_by_layer_kind"]["learned"]["recall"] < 1
    assert sum(s["per_layer"][i]["demand_misses"] for i in s["per_layer"]) > 0      # offloading does work here


def test_offloaded_speculation_equals_resident(official):
    expected = tokens(load(official, mtp=False).generate(PROMPT, max_tokens=30))
    budget = offload_budget(official, 16, None, ctx=CTX, mtp=True)
    off = load(official, mtp=True, num_draft_tokens=2, mtp_adaptive=False, gpu_mem=budget)
    oracle_drafts(off, PROMPT + expected, rate=0.6, seed=3)
    assert tokens(off.generate(PROMPT, max_tokens=30)) == expected
    s = off.stats()
    assert 0 < s["mtp"]["acceptance_rate"] < 1
    assert s["expert_cache"]["predictor_by_layer_kind"]["hash"]["recall"] == 1.0


def test_dense_packs_v4_and_plan_and_info_count_it(official, monkeypatch, capsys):
    """--dense int8 on the CPU: the loader packs V4's projections, shared experts, head and MTP projections while
    loading; the compiled step (the prompt too, over packed weights) gives the eager executor's tokens, and MTP
    speculation the same tokens; greedy output stays close to the unpacked model's; `plan` and `info` count the
    packed bytes (fewer than unpacked), and a run holds no more packed bytes than the plan counts."""
    import json

    from dsv3lite.cli import main
    from dsv3lite.dense import PackedLinear

    logs = []
    llm = dsv3lite.load(official, device="cpu", ctx_size=CTX, progress=False, log=logs.append, mtp=False,
                        dense="int8")
    llm.stop_ids = set()
    assert any("dense weight matrices to int8" in m for m in logs)
    packed = [m for m in llm.model.modules() if isinstance(m, PackedLinear)]
    assert packed and llm.model.head in packed
    got = tokens(llm.generate(PROMPT, max_tokens=12))
    assert llm.stats()["cpu_step"] == {"whole": 12, "by_block": 0, "eager": 0}         # the prompt and 11 steps
    monkeypatch.setenv("DSV3LITE_CPU_DECODE", "eager")
    assert tokens(llm.generate(PROMPT, max_tokens=12)) == got
    monkeypatch.delenv("DSV3LITE_CPU_DECODE")
    spec = load(official, mtp=True, dense="int8", num_draft_tokens=2, mtp_adaptive=False)
    assert tokens(spec.generate(PROMPT, max_tokens=12)) == got and spec.stats()["cpu_step"]["eager"] == 0
    plain = tokens(load(official, mtp=False).generate(PROMPT, max_tokens=12))
    assert sum(a == b for a, b in zip(got, plain)) >= 6           # int8 weights: close to the unpacked model
    capsys.readouterr()
    sizes = {}
    for dense in (None, "int8"):
        assert main(["info", "-w", str(official), "--json"] + (["--dense", dense] if dense else [])) == 0
        sizes[dense] = json.loads(capsys.readouterr().out)["component_bytes"]
    assert sizes["int8"]["attention+norms"] < sizes[None]["attention+norms"]
    assert sizes["int8"]["embeddings"] == sizes[None]["embeddings"]           # embeddings are not packed
    from dsv3lite.config import ModelArgs
    from dsv3lite.v4 import sizes as v4_sizes
    from dsv3lite.footprint import DENSE_WEIGHT_BYTES

    a = ModelArgs.from_dir(official)
    planned = v4_sizes.resident_components(a, 4, False, DENSE_WEIGHT_BYTES["int8"])
    held = sum(m.nbytes for m in packed)
    assert held <= sum(planned.values()) - planned["embeddings"] - planned["routers (fp32)"]
    assert main(["plan", "-w", str(official), "--gpu-mem", "1G", "--dense", "int8", "--device", "cpu"]) == 0


def test_eager_executor_and_the_predictor_through_mhc(official):
    """V4 runs on its compiled CPU step on the CPU and on a GPU on the decode graphs over the eager executor; the
    predictor's distance 0 is the layer event's routing, and a later block's prediction is its own router input
    of the current streams through its gate (bias, no groups); hash layers are not predicted from the streams."""
    from dsv3lite.executors import choose
    from dsv3lite.executors.cpu_v4 import V4CpuStep
    from dsv3lite.executors.eager import Eager
    from dsv3lite.executors.graphs import GraphStep
    from dsv3lite.offload.predictor import RoutePredictor

    model = load_v4(official, released_experts=True)
    assert type(choose(model, torch.device("cpu"))) is V4CpuStep
    on_gpu = choose(model, torch.device("cuda"))
    assert type(on_gpu) is GraphStep and type(on_gpu.fallback) is Eager
    assert type(choose(model, torch.device("cuda"), cuda_graphs=False)) is Eager
    pred = RoutePredictor(model, lookahead=2)
    seen = {}
    handle = model.add_observer(on_layer=lambda block, h, routed: seen.setdefault(
        block.layer_id, (pred.predict(block, h, routed), h.clone(), routed[1][1].tolist())))
    n, hashed = model.args.num_hidden_layers, model.args.num_hash_layers
    with torch.inference_mode():
        model(torch.tensor([PROMPT]))
        handle.remove()
        for layer in range(n):
            predicted, h, routing = seen[layer]
            assert predicted.pop(layer) == (0, routing)
            assert all(t >= hashed for t in predicted)
            assert {t for t, (d, _) in predicted.items() if isinstance(d, int)} == \
                {t for t in (layer + 1, layer + 2) if hashed <= t < n}
            for target, (_, rows) in predicted.items():
                gate = model.layers[target].ffn.gate
                x = model.layers[target].router_input(h).flatten(0, 1)
                assert rows == (gate.scores(x) + gate.bias).topk(2, dim=-1, sorted=False).indices.tolist()


def test_geometry_offloaded_equals_resident(v4_geometry_dir, monkeypatch):
    """V4-Flash's routing geometry (43 layers, 256 experts, top-6, 3 hash layers) at about 10% of its experts; the
    compiled CPU step (resident: every layer in one call; offloaded: its attention between the host-scheduled
    experts) decodes the eager executor's tokens."""
    prompt = list(range(5, 17))
    llm = load(v4_geometry_dir, mtp=False, ctx_size=64)
    resident = tokens(llm.generate(prompt, max_tokens=6))
    assert llm.stats()["cpu_step"]["whole"] == 5
    monkeypatch.setenv("DSV3LITE_CPU_DECODE", "eager")
    assert tokens(llm.generate(prompt, max_tokens=6)) == resident
    monkeypatch.delenv("DSV3LITE_CPU_DECODE")
    budget = offload_budget(v4_geometry_dir, 1100, None, ctx=64, mtp=False)
    off = load(v4_geometry_dir, mtp=False, ctx_size=64, gpu_mem=budget, miss_policy="fetch")
    assert off.offload.cache.n_slots == 1100
    assert tokens(off.generate(prompt, max_tokens=6)) == resident
    assert off.stats()["cpu_step"]["by_block"] == 5
    s = off.stats()["expert_cache"]
    assert s["predictor_by_layer_kind"]["hash"] == {"precision": 1.0, "recall": 1.0}
    assert all(s["per_layer"][i]["demand_misses"] == 0 for i in range(off.args.num_hash_layers))
    assert 0 < s["predictor_by_layer_kind"]["learned"]["recall"] < 1       # predicted from the streams
    assert s["demand_misses"] > 0


def test_trace_records_the_hash_layers_and_replays_them_exactly(official, tmp_path, capsys):
    """`dsv3lite trace` on a V4 checkpoint names its hash layers; replayed with them (benchmarks/cache_sim.py --v4),
    their experts, known from each token as it is sampled, are never a demand miss, where without them they are."""
    import json

    from dsv3lite.cli import main
    from dsv3lite.offload.trace import read_trace, simulate

    out_file = tmp_path / "t.jsonl"
    rc = main(["trace", "-w", str(official), "-p", "hello there", "-m", "12", "-o", str(out_file), "--no-mtp"])
    assert rc == 0, capsys.readouterr().err
    meta = json.loads(out_file.read_text().splitlines()[0])["meta"]
    assert meta["token_layers"] == [0, 1]                   # the tiny variant's num_hash_layers
    trace = read_trace(out_file)
    plain = simulate(trace, 6, "decayed-lfu")
    exact = simulate(trace, 6, "decayed-lfu", token_layers=meta["token_layers"])
    assert plain.layers_sum([0, 1])[1] > 0
    assert exact.layers_sum([0, 1])[1] == 0 and exact.layers_sum([0, 1])[0] == plain.layers_sum([0, 1])[0]
