"""Expert prediction beyond the current step: the MTP layer as the layer after the last main layer, and the next
token's first MoE layers predicted before that token exists (from the last main layer or the MTP layer), in the
runtime, in traces and in the cache simulator."""
from __future__ import annotations

import pytest
import torch

import dsv3lite
from dsv3lite.offload.predictor import NEXT_FROM_LAST, NEXT_FROM_MTP, RoutePredictor
from dsv3lite.offload.trace import Trace, TraceRecorder, simulate
from dsv3lite.testing import offload_budget


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory):
    from dsv3lite.testing import add_mtp_weights, write_checkpoint

    return add_mtp_weights(write_checkpoint(tmp_path_factory.mktemp("mtp") / "m", "v3"))


def load(path, **kw):
    llm = dsv3lite.load(path, device="cpu", ctx_size=160, progress=False, log=lambda m: None, **kw)
    llm.stop_ids = set()
    return llm


def test_targets_follow_the_step_into_the_mtp_layer_and_the_next_token(mtp_dir):
    llm = load(mtp_dir, mtp=True)
    model = llm.model
    pred = RoutePredictor(model, lookahead=2)
    first, last, mtp = model.layers[0], model.layers[-1], model.mtp.block
    moe = [b.layer_id for b in model.layers if b.is_moe]

    def ids(layer):
        return [(d, b.layer_id) for d, b in pred.targets(layer)]

    nxt = [l for l in moe[:2] if l != last.layer_id]          # (a layer this step still runs keeps its own entry)
    assert nxt and ids(first)[-1][0] != NEXT_FROM_LAST
    assert ids(last) == [(0, last.layer_id)] + [(NEXT_FROM_LAST, l) for l in nxt]   # MTP not seen yet
    assert ids(mtp) == [(0, mtp.layer_id)] + [(NEXT_FROM_MTP, l) for l in moe[:2]]
    ids(first)                                                   # a new step: MTP ran in the last one
    assert ids(last) == [(0, last.layer_id), (1, mtp.layer_id)]  # auto: the MTP layer predicts the next token
    assert ids(first) and not any(l == mtp.layer_id for _, l in ids(last))   # MTP did not run: not predicted
    both = RoutePredictor(model, lookahead=2, next_token=(NEXT_FROM_LAST, NEXT_FROM_MTP))
    both.targets(mtp), both.targets(first)
    assert [d for d, _ in both.targets(last)][-len(nxt):] == [NEXT_FROM_LAST] * len(nxt)


def test_offloaded_mtp_layer_is_prefetched_and_next_token_predictions_are_scored(mtp_dir):
    expected = [c.token_id for c in load(mtp_dir, experts="bf16", mtp=False).generate("hello there", max_tokens=16)]
    llm = load(mtp_dir, experts="bf16", mtp=True, mtp_adaptive=False, gpu_mem=offload_budget(mtp_dir, 12, "bf16"))
    assert [c.token_id for c in llm.generate("hello there", max_tokens=16)] == expected
    s = llm.stats()["expert_cache"]
    mtp_layer = llm.args.mtp_layer_id
    assert s["per_layer"][mtp_layer]["prefetch_hits"] + s["per_layer"][mtp_layer]["hits"] > 0
    by = s["predictor_by_distance"]
    assert NEXT_FROM_MTP in by and 0 < by[NEXT_FROM_MTP]["recall"] <= 1
    assert list(by)[:2] == [1, 2]                                # layers ahead first, then the sources


def test_each_layer_routes_once_the_predictor_hands_its_exact_routing_to_the_layer(mtp_dir, monkeypatch):
    """Offloaded decode evaluates each layer's gate once, as resident decode does: the MoE reuses the predictor's
    exact norm and gate output instead of computing them again (the lookahead predictions are batched apart);
    tokens unchanged. Resident decode on the eager path, whose gate is the module counted here (the CPU decode
    step routes inside its kernel)."""
    from dsv3lite.model import Gate

    monkeypatch.setenv("DSV3LITE_CPU_DECODE", "eager")

    calls = {"gate": 0}
    forward = Gate.forward

    def counted(self, x):
        calls["gate"] += 1
        return forward(self, x)

    monkeypatch.setattr(Gate, "forward", counted)
    resident = load(mtp_dir, experts="bf16", mtp=False)
    expected = [c.token_id for c in resident.generate("route once", max_tokens=8)]
    resident_calls, calls["gate"] = calls["gate"], 0
    llm = load(mtp_dir, experts="bf16", mtp=False, gpu_mem=offload_budget(mtp_dir, 12, "bf16", mtp=False))
    assert [c.token_id for c in llm.generate("route once", max_tokens=8)] == expected
    assert resident_calls > 0 and calls["gate"] == resident_calls


def test_batched_lookahead_predictions_match_each_layer_s_own_router(mtp_dir):
    """The batched predictions (one RMS statistic, one top-k over all targets) choose what each target layer's own
    norm and router choose on the same hidden state (up to ties at the last bit)."""
    llm = load(mtp_dir, experts="bf16", mtp=False)
    blocks = [b for b in llm.model.layers if b.is_moe]
    pred = RoutePredictor(llm.model, lookahead=2)
    h = torch.randn(5, llm.args.hidden_size)
    with torch.inference_mode():
        got = pred.lookahead_ids(blocks, h)
        for b, ids in zip(blocks, got):
            exact = b.ffn.gate.select(b.ffn.gate.scores(b.ffn_norm(h)))
            same = [set(r) == set(e) for r, e in zip(ids.tolist(), exact.tolist())]
            assert sum(same) >= len(same) - 1, b.layer_id


def test_trace_stamps_next_token_predictions_with_the_step_they_predict(mtp_dir):
    llm = load(mtp_dir, mtp=True, mtp_adaptive=False)
    rec = TraceRecorder(llm.model, 2)
    for j, _ in enumerate(llm.generate("hello there", max_tokens=6)):
        if j == 0:
            rec.phase = "decode"
    rec.detach()
    mtp_steps = {ev["step"] for ev in rec.events if ev["layer"] == llm.args.mtp_layer_id and ev["distance"] == 0}
    for source in (NEXT_FROM_LAST, NEXT_FROM_MTP):
        stamped = {ev["step"] for ev in rec.events if ev["distance"] == source}
        assert stamped and stamped == {s + 1 for s in mtp_steps}


def test_simulated_next_token_prefetch_removes_the_first_layers_misses():
    # two layers, each step a new expert per layer; the next-token source predicts layer 1 of the next step exactly
    steps = range(6)
    accesses = [(s, [(layer, 10 * s + layer)]) for s in steps for layer in (1, 2)]
    predictions = {(s + 1, 1): {NEXT_FROM_LAST: {10 * (s + 1) + 1}} for s in steps}
    trace = Trace({}, accesses, predictions)
    plain = simulate(trace, 4, "lru")
    ahead = simulate(trace, 4, "lru", next_token=NEXT_FROM_LAST)
    assert plain.demand_loads == 12
    assert ahead.demand_loads == 7 and ahead.prefetch_loads == 6          # layer 1 misses only at step 0 (the
    # last prefetch is for a step the trace does not have)
    assert ahead.uses == plain.uses and ahead.wasted_prefetches == 0


def test_copy_queue_model_demand_copies_wait_behind_queued_prefetches_unless_batched():
    from dsv3lite.offload.trace import CopyTiming

    # layer 1 misses one expert; after its attention the router predicts eight experts of layer 2
    trace = Trace({}, [(0, [(1, 0)]), (0, [(2, 0)])], {(0, 2): {1: set(range(8))}})
    ahead = simulate(trace, 16, "lru", prefetch_distance=1, timing=CopyTiming(layer_s=1.0, copy_s=1.0))
    assert ahead.stall_s == 9.0 and ahead.prefetch_loads == 8     # the demand copy ran after all eight
    batched = simulate(trace, 16, "lru", prefetch_distance=1, timing=CopyTiming(layer_s=1.0, copy_s=1.0, batch=2))
    # demand first (ready at 1); two prefetches behind it (2, 3); at the layer's end (t=2) one finished: a third
    assert batched.stall_s == 1.0 and batched.prefetch_loads == 3
    assert simulate(trace, 16, "lru", prefetch_distance=1).stall_s == 0.0   # no timing: loads only
