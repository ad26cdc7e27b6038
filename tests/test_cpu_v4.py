"""DeepSeek-V4's compiled CPU step (kernels/cpu_v4.py over kernels/csrc/cpu_v4.cpp) against its twin, the eager
sub-steps of dsv3lite/v4: the mHC pre, each block's attention (sliding, CSA with the indexer selecting, HCA) and
feed-forward (hash and learned routers, MXFP4 blobs or dense experts, plain or packed dense weights) over a sequence
cut into prefill chunks, decode steps and verify-sized calls, the cache objects' tensors after each; a call of
several tokens against single steps (the same bits); the whole step in one call against the per-block calls. Then
the executor (dsv3lite/executors/cpu_v4.py): generation on the CPU takes it by default (`generate --device cpu`
too) and decodes the eager executor's tokens, resident, offloaded (compiled attention between the host-scheduled
experts); at V4-Flash's geometry in tests/test_v4_engine.py."""
from __future__ import annotations

import copy

import json

import pytest
import torch

import dsv3lite
from dsv3lite.dense import pack_dense
from dsv3lite.executors.cpu_v4 import V4CpuStep
from dsv3lite.kernels import cpu_v4
from dsv3lite.testing import KernelSpy
from dsv3lite.testing_v4 import load_v4, write_v4_hf
from dsv3lite.v4.cache import new_cache
from dsv3lite.v4.config import CSA, HCA, SLIDING

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.cpu_kernels]
SEQ = 70                                   # window 8, CSA 4 (the indexer selects past 4 entries), HCA 16
CUTS = [0, 13, 14, 15, 16, 20, 21, 31, 32, 35, 47, 48, 49, 50, 63, 64, 65, SEQ]   # prefill, steps, verify sizes
TOL = dict(rtol=2e-4, atol=2e-5)


def close_but_for_rounding_flips(got, want):
    """Equal within fp32 summation order, but for a token where an upstream ulp moved one of the routed experts'
    int8-quantized activations to the next step (the experts' kernel is both sides', cpu_experts.py): then within
    one step's effect."""
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
    off = (~torch.isclose(got, want, **TOL)).flatten(2).any(-1)                  # [1, S] tokens beyond tight
    assert off.sum() <= max(1, off.numel() // 10), f"{int(off.sum())} of {off.numel()} tokens differ"


@pytest.fixture(scope="module")
def official(v4_dir):
    """The session's tiny DeepSeek-V4 in the released layout (conftest.py)."""
    return v4_dir


@pytest.fixture(scope="module")
def models(official):
    """label -> the tiny V4 network: MXFP4 experts as released (dense fp32), dense fp32 experts, or the released
    experts with the dense weights packed to fp8 / bf16."""
    quiet = dict(log=lambda m: None)
    made = {"mxfp4": load_v4(official, released_experts=True, **quiet), "dense experts": load_v4(official, **quiet)}
    for dtype in ("fp8", "bf16"):
        made[f"mxfp4, {dtype} dense"] = packed = load_v4(official, released_experts=True, **quiet)
        pack_dense(packed, dtype)
    return made


def tokens(vocab, n, seed=0):
    return torch.randint(2, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def cache_tensors(cache):
    return [t for block in cache.layers for t in [block.window.kv] +
            [x for s in block.compressors.values() for x in (s.cv.kv, s.g.kv, s.entries)]]


@pytest.mark.parametrize("label", ["mxfp4", "dense experts", "mxfp4, fp8 dense", "mxfp4, bf16 dense"])
def test_sub_steps_match_the_eager_ones(models, label):
    """Each block's attention and feed-forward through the kernels against the eager sub-steps on the same input,
    chunk after chunk of a 70-token sequence; the cache objects' tensors equal after every chunk."""
    model = models[label]
    a = model.args
    assert set(a.attn_kinds[:a.num_hidden_layers]) == {SLIDING, CSA, HCA} and a.num_hash_layers > 0
    assert SEQ // a.compress_rate_csa > a.index_topk
    ids = tokens(a.vocab_size, SEQ)
    eager, kernel = new_cache(a, SEQ, with_mtp=False), new_cache(a, SEQ, with_mtp=False)
    seen = []
    handle = model.add_observer(on_routing=lambda layer, i, s: seen.append((layer, i.sort(-1).values, s)))
    try:
        with torch.inference_mode():
            for s0, s1 in zip(CUTS, CUTS[1:]):
                x = model.embed(ids[:, s0:s1]).unsqueeze(2).expand(-1, -1, a.hc_mult, -1).contiguous()
                for i, block in enumerate(model.layers):
                    got = cpu_v4.attention(block, x, s0, kernel[i])
                    x = block.attention(x, s0, eager[i])
                    torch.testing.assert_close(got, x, **TOL)
                    seen.clear()
                    got = cpu_v4.feed_forward(block, x, ids[:, s0:s1])
                    x = block.feed_forward(x, ids[:, s0:s1])
                    close_but_for_rounding_flips(got, x)
                    (_, k_ids, k_scores), (_, e_ids, e_scores) = seen
                    assert torch.equal(k_ids, e_ids)
                    torch.testing.assert_close(k_scores, e_scores, **TOL)
                for k, e in zip(cache_tensors(kernel), cache_tensors(eager)):
                    torch.testing.assert_close(k, e, **TOL)
    finally:
        handle.remove()


def test_hc_pre_matches_hyper_connection(models):
    model = models["mxfp4"]
    hc = model.layers[1].hc_ffn
    x = torch.randn(5, model.args.hc_mult, model.args.hidden_size, generator=torch.Generator().manual_seed(1))
    pre, post, comb, u = cpu_v4.hc_pre(hc, x)
    want = [t[0] for t in hc.weights(x[None])]
    for got, ref in zip((pre, post, comb, u), (*want, hc.collapse(x[None], want[0][None])[0])):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    assert torch.allclose(comb.sum(-2), torch.ones(5, model.args.hc_mult), atol=1e-3)    # columns ~1


def test_the_feed_forward_input_matches_the_eager_half(models):
    """Block.ffn_input through the mHC kernel (the offloaded feed-forward's first half) against the eager half."""
    model = models["mxfp4"]
    block = model.layers[2]
    x = torch.randn(1, 3, model.args.hc_mult, model.args.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        (u, (post, comb)), (eu, (epost, ecomb)) = cpu_v4.ffn_input(block, x), block.ffn_input(x)
    for got, want in ((u, eu), (post, epost), (comb, ecomb)):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def run_layers(model, ids, cuts, per_block: bool):
    """The main layers through the kernels over ids cut at `cuts` -> the streams of every position."""
    a = model.args
    cache = new_cache(a, ids.shape[1], with_mtp=False)
    out = []
    with torch.inference_mode():
        for s0, s1 in zip(cuts, cuts[1:]):
            x = model.embed(ids[:, s0:s1]).unsqueeze(2).expand(-1, -1, a.hc_mult, -1).contiguous()
            if per_block:
                for i, block in enumerate(model.layers):
                    x = cpu_v4.feed_forward(block, cpu_v4.attention(block, x, s0, cache[i]), ids[:, s0:s1])
            else:
                x = cpu_v4.layers(model, x, s0, cache, ids[:, s0:s1])
            out.append(x)
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("label", ["mxfp4", "mxfp4, fp8 dense"])
def test_a_token_gets_the_same_bits_however_many_share_the_call(models, label):
    """Prefill chunks, verify-sized calls and single steps give every token the same bits (MTP verification gets a
    plain step's); the whole step in one call gives the per-block calls' bits."""
    model = models[label]
    ids = tokens(model.args.vocab_size, SEQ, seed=3)
    singles = run_layers(model, ids, [0, 24] + list(range(25, SEQ + 1)), per_block=True)
    assert torch.equal(run_layers(model, ids, [0, 24, 28, 29, 31, 35, 38, 42, 46, 47, 50, 54, 58, 62, 66, SEQ],
                                  per_block=True), singles)
    assert torch.equal(run_layers(model, ids, [0, 5, 24, 27, 40, SEQ], per_block=False)[:, 24:], singles[:, 24:])
    torch.testing.assert_close(singles, run_layers(model, ids, [0, SEQ], per_block=True), rtol=0, atol=0)


def test_logits_through_the_kernels_match_the_eager_network(models):
    model = models["mxfp4"]
    ids = tokens(model.args.vocab_size, SEQ, seed=4)
    with torch.inference_mode():
        ref = model.logits(model.hidden(ids, 0, new_cache(model.args, SEQ, with_mtp=False)))
        got = model.logits(run_layers(model, ids, [0, 30, 31, 32, 36, SEQ], per_block=False))
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_what_the_kernels_leave_to_the_eager_path(models, monkeypatch):
    model = models["mxfp4"]
    block = model.layers[1]
    x = torch.zeros(1, 1, model.args.hc_mult, model.args.hidden_size)
    cache = new_cache(model.args, 8, with_mtp=False)
    with torch.inference_mode():
        assert cpu_v4.covers(model) and cpu_v4.uncovered(model) == []
        assert cpu_v4.attention(block, x.double(), 0, cache[1]) is None           # not fp32
        monkeypatch.setenv("DSV3LITE_CPU_DECODE", "eager")
        assert not cpu_v4.covers(model) and cpu_v4.attention(block, x, 0, cache[1]) is None
        monkeypatch.delenv("DSV3LITE_CPU_DECODE")
    assert cpu_v4.attention(block, x, 0, cache[1]) is None                        # outside inference mode
    offloaded = copy.copy(block.ffn)                        # experts the host schedules: not the kernel's
    offloaded.experts = torch.nn.Identity()
    assert cpu_v4._ffn_plan(type("B", (), dict(ffn=offloaded, hc_ffn=block.hc_ffn, ffn_norm=block.ffn_norm))).desc \
        is None


# --- the executor ------------------------------------------------------------------------------------------------

PROMPT = [5, 9, 17, 33, 2, 41, 8, 77, 120, 3, 64]


def spy_on(monkeypatch) -> KernelSpy:
    return KernelSpy(monkeypatch, cpu_v4, ("layers", "attention", "feed_forward", "ffn_input"))


def engine(path, logs=None, **kw):
    llm = dsv3lite.load(path, device="cpu", ctx_size=kw.pop("ctx_size", 160), progress=False,
                        log=(logs if logs is not None else []).append, **kw)
    llm.stop_ids = set()
    return llm


def greedy(llm, n, prompt=PROMPT) -> list[int]:
    return [c.token_id for c in llm.generate(prompt, max_tokens=n)]


@pytest.fixture(scope="module")
def odd(tmp_path_factory):
    """Odd widths everywhere (transformers' layout, dense experts): the kernels' vector tails."""
    return write_v4_hf(tmp_path_factory.mktemp("v4odd"), "odd")


@pytest.mark.parametrize("which", ["official", "odd"])
def test_generate_on_the_cpu_takes_the_compiled_step_and_decodes_the_eager_tokens(request, monkeypatch, which):
    """Every decode step runs every main layer in one kernel call (the prompt eagerly), with no line about a
    sub-step left eager; the tokens are the eager executor's."""
    logs = []
    llm = engine(request.getfixturevalue(which), logs, mtp=False)
    assert type(llm.executor) is V4CpuStep and llm.decode_threads is None
    assert not [m for m in logs if "compiled CPU decode step" in m]
    got = greedy(llm, 24)
    assert llm.stats()["cpu_step"] == {"whole": 23, "by_block": 0, "eager": 1}
    monkeypatch.setenv("DSV3LITE_CPU_DECODE", "eager")
    assert greedy(llm, 24) == got
    assert llm.stats()["cpu_step"] == {"whole": 0, "by_block": 0, "eager": 24}


def test_a_bfloat16_model_decodes_eagerly_with_one_line(official):
    logs = []
    llm = engine(official, logs, mtp=False, dtype="bfloat16")
    assert [m for m in logs if "compiled CPU decode step" in m] == \
        ["note: the compiled CPU decode step computes in float32; bfloat16 decodes eagerly"]
    greedy(llm, 4)
    assert llm.stats()["cpu_step"] == {"whole": 0, "by_block": 0, "eager": 4} and llm.decode_threads == 1


def test_speculation_verifies_in_one_call_and_drafts_through_the_kernels(official, monkeypatch):
    """MTP: a verify pass (the step's token and its drafts) is one kernel call for every main layer, the MTP
    block's drafts go through its sub-step kernels; greedy output is plain greedy's."""
    plain = greedy(engine(official, mtp=False), 30)
    spec = engine(official, mtp=True, num_draft_tokens=3, mtp_adaptive=False)
    spy = spy_on(monkeypatch)
    assert greedy(spec, 30) == plain
    counts = spec.stats()["cpu_step"]
    assert counts["whole"] == spy.ran["layers"] > 0 and not any(spy.declined.values())
    assert counts["by_block"] > 0 and spy.ran["attention"] == spy.ran["feed_forward"] == counts["by_block"]
    assert counts["eager"] == 2                               # the prompt: the main layers, then the MTP block


def test_offloaded_decode_runs_compiled_attention_between_the_host_scheduled_experts(official, monkeypatch):
    from dsv3lite.testing import offload_budget

    resident = greedy(engine(official, mtp=False), 16)
    logs = []
    off = engine(official, logs, mtp=False, gpu_mem=offload_budget(official, 12, None, ctx=160, mtp=False),
                 miss_policy="fetch")
    assert not [m for m in logs if "compiled CPU decode step" in m]         # host-scheduled experts: by design
    spy = spy_on(monkeypatch)
    assert greedy(off, 16) == resident
    n, steps = off.args.num_hidden_layers, 15
    assert spy.ran["attention"] == spy.ran["ffn_input"] == steps * n                # the experts between
    assert spy.ran["feed_forward"] == 0 and not any(spy.declined.values())
    assert off.stats()["cpu_step"]["by_block"] == steps and off.stats()["expert_cache"]["demand_misses"] > 0


def test_the_command_line_generates_through_the_compiled_step(capsys, v4_dir):
    from dsv3lite.cli import main

    rc = main(["generate", "-w", str(v4_dir), "--device", "cpu", "-p", "hi", "-m", "6", "--no-mtp", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    doc = json.loads(out)
    counts, n = doc["stats"]["cpu_step"], len(doc["token_ids"])
    assert counts["whole"] >= n - 1 and counts["whole"] + counts["eager"] == n and counts["by_block"] == 0
