"""Engine behaviour: sampling, stops, context limits, conversation cache reuse, streaming, stats schema."""
from __future__ import annotations

import pytest
import torch

import dsv3lite
from dsv3lite.errors import UserError
from dsv3lite.generate import StopMatcher
from dsv3lite.sampling import SamplingParams, sampling_probs


@pytest.fixture(scope="module")
def llm(v3_dir):
    return dsv3lite.load(v3_dir, device="cpu", ctx_size=128, progress=False, log=lambda m: None)


def run(llm, prompt, **kw):
    chunks = list(llm.generate(prompt, **kw))
    return chunks, [c.token_id for c in chunks]


def test_greedy_is_deterministic_and_equals_argmax_of_forward(llm):
    prompt = llm.tokenizer.encode("To be, or not", add_bos=True)
    llm.stop_ids = set()
    _, ids = run(llm, prompt, max_tokens=6)
    seq = list(prompt)
    for t in ids:                                  # each token is the argmax of a fresh full forward
        assert t == int(llm.forward([seq])[0, -1].argmax())
        seq.append(t)


def test_seeded_sampling_reproducible_and_seed_sensitive(llm):
    llm.stop_ids = set()
    kw = dict(max_tokens=12, temperature=1.5, top_p=0.95, top_k=50)
    a = run(llm, "hello", seed=1, **kw)[1]
    b = run(llm, "hello", seed=1, **kw)[1]
    c = run(llm, "hello", seed=2, **kw)[1]
    assert a == b
    assert a != c


def test_sampling_distribution_filters():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    p = sampling_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (p[2:] == 0).all() and torch.isclose(p.sum(), torch.tensor(1.0))
    p = sampling_probs(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert p[0] == 1.0                             # the first token alone already holds > 50% of the mass
    full = torch.softmax(logits, -1)
    p = sampling_probs(logits, SamplingParams(temperature=1.0, top_p=0.9))
    kept = (full.cumsum(0) - full) < 0.9
    torch.testing.assert_close(p[kept], full[kept] / full[kept].sum())
    assert p[0] > sampling_probs(logits, SamplingParams(temperature=2.0))[0]


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-1),
                                 dict(max_tokens=0), dict(temperature=float("nan"))])
def test_invalid_sampling_values_are_user_errors(llm, bad):
    with pytest.raises(UserError):
        list(llm.generate("hi", **bad))


def test_stop_string_truncates_and_is_never_emitted(llm):
    llm.stop_ids = set()
    chunks, _ = run(llm, "hello", max_tokens=40)
    full = "".join(c.text for c in chunks)
    assert len(full) > 6
    stop = full[3:6]
    chunks, _ = run(llm, "hello", max_tokens=40, stop=[stop])
    text = "".join(c.text for c in chunks)
    assert chunks[-1].finish_reason == "stop"
    assert text == full[:full.index(stop)]


def test_stop_matcher_holds_back_partial_matches():
    m = StopMatcher(["END"])
    assert m.feed("abcE") == ("abc", False)
    assert m.feed("N") == ("", False)
    assert m.feed("Dxyz") == ("", True)
    m = StopMatcher(["END"])
    assert m.feed("abE") == ("ab", False)
    assert m.feed("x") == ("Ex", False)


def test_eos_token_ends_with_stop(llm):
    llm.stop_ids = {int(llm.forward([[0, 5]])[0, -1].argmax())}   # whatever greedy picks first
    chunks, _ = run(llm, [0, 5], max_tokens=10)
    assert len(chunks) == 1 and chunks[0].finish_reason == "stop" and chunks[0].text == ""


def test_length_finish_and_max_tokens(llm):
    llm.stop_ids = set()
    chunks, ids = run(llm, "hello", max_tokens=5)
    assert len(ids) == 5 and chunks[-1].finish_reason == "length"
    assert all(c.finish_reason is None for c in chunks[:-1])


def test_prompt_longer_than_context_is_a_user_error(llm):
    with pytest.raises(UserError, match="context"):
        list(llm.generate(list(range(5, 5 + 200))))


def test_generation_stops_at_context_end(llm):
    llm.stop_ids = set()
    chunks, ids = run(llm, list(range(5, 5 + 120)), max_tokens=50)
    assert chunks[-1].finish_reason == "length"
    assert 120 + len(ids) <= 128


def test_out_of_vocabulary_prompt_ids_are_user_errors(llm):
    with pytest.raises(UserError, match="vocabulary"):
        list(llm.generate([1, 2, 10**6]))


@pytest.mark.parametrize("prompt", [[[1, 2, 3]], [1, "x"], [1, None]])
def test_a_prompt_that_is_not_a_flat_id_list_is_a_user_error(llm, prompt):
    with pytest.raises(UserError, match="flat list of token ids"):
        llm.generate(prompt)


def test_conversation_reuses_latent_cache_and_matches_fresh_run(llm, v3_dir):
    llm.stop_ids = set()
    llm.reset()
    first = [{"role": "user", "content": "Hello there"}]
    reply = "".join(c.text for c in llm.chat(first, max_tokens=8))
    second = first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And then?"}]
    ids_warm = [c.token_id for c in llm.chat(second, max_tokens=8)]
    stats = llm.stats()
    assert stats["cached_prompt_tokens"] > 0
    assert stats["cached_prompt_tokens"] + (stats["prompt_tokens"] - stats["cached_prompt_tokens"]) == stats["prompt_tokens"]
    fresh = dsv3lite.load(v3_dir, device="cpu", ctx_size=128, progress=False, log=lambda m: None)
    fresh.stop_ids = set()
    assert [c.token_id for c in fresh.chat(second, max_tokens=8)] == ids_warm
    assert fresh.stats()["cached_prompt_tokens"] == 0


def test_interrupted_generation_leaves_a_consistent_cache(llm):
    llm.stop_ids = set()
    llm.reset()
    stream = llm.generate("hello", max_tokens=30)
    for i, _ in zip(range(4), stream):
        pass
    stream.close()                                   # as a client disconnect or Ctrl-C does
    _, after = run(llm, "hello", max_tokens=6)
    llm.reset()
    _, clean = run(llm, "hello", max_tokens=6)
    assert after == clean


def test_stats_schema(llm):
    list(llm.generate("hello", max_tokens=4))
    s = llm.stats()
    for key in ("prefill_tok_s", "decode_tok_s", "ttft_s"):
        assert isinstance(s[key], float) and s[key] >= 0
    assert set(s["mtp"]) >= {"enabled", "acceptance_rate", "tokens_per_forward"}
    assert 0.0 <= s["mtp"]["acceptance_rate"] <= 1.0
    assert set(s["expert_cache"]) >= {"hits", "prefetch_hits", "demand_misses", "hit_rate", "h2d_bytes",
                                      "h2d_gb_s", "stall_ms", "cpu_experts", "predictor_precision",
                                      "predictor_recall"}
