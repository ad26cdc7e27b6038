"""MTP speculative decoding: the draft head against transformers, greedy equality, rollback, exact sampling."""
from __future__ import annotations

import pytest
import torch

import dsv3lite
from dsv3lite.speculative import accept_drafts


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory):
    from dsv3lite.testing import add_mtp_weights, write_checkpoint

    path = tmp_path_factory.mktemp("ckpt-mtp")
    write_checkpoint(path, "v3")
    return add_mtp_weights(path)


def load(path, **kw):
    llm = dsv3lite.load(path, device="cpu", ctx_size=160, progress=False, log=lambda m: None, **kw)
    llm.stop_ids = set()
    return llm


def test_draft_logits_match_transformers_mtp_layer(mtp_dir):
    from transformers import AutoModelForCausalLM

    from dsv3lite.loader import load_model
    from dsv3lite.testing import hf_mtp_logits

    hf = AutoModelForCausalLM.from_pretrained(mtp_dir, dtype=torch.float32, experts_implementation="eager").eval()
    x = torch.randint(0, 400, (2, 24), generator=torch.Generator().manual_seed(0))
    expected = hf_mtp_logits(hf, mtp_dir, x)
    model = load_model(mtp_dir, torch.device("cpu"), torch.float32, progress=False, log=lambda m: None)
    with torch.no_grad():
        got = model.head(model.mtp_hidden(model.hidden(x)[:, :-1], x[:, 1:]))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_with_mtp_equals_greedy_without(mtp_dir, k):
    plain = load(mtp_dir, mtp=False)
    spec = load(mtp_dir, mtp=True, num_draft_tokens=k, mtp_adaptive=False)
    for prompt in ("The quick brown fox jumps",):
        expected = [c.token_id for c in plain.generate(prompt, max_tokens=40)]
        got = [c.token_id for c in spec.generate(prompt, max_tokens=40)]
        assert got == expected
    s = spec.stats()["mtp"]
    assert s["enabled"] and 0.0 <= s["acceptance_rate"] <= 1.0 and s["tokens_per_forward"] >= 1.0


def test_caches_after_rollback_match_a_run_that_never_drafted(mtp_dir):
    spec = load(mtp_dir, mtp=True, num_draft_tokens=2, mtp_adaptive=False)
    list(spec.generate("hello world", max_tokens=30, temperature=1.0, seed=5))   # accepts and rejects
    tokens = list(spec.cached_tokens)
    never = load(mtp_dir, mtp=True, mtp_adaptive=False)
    never.speculator.active = lambda: False   # MTP cache kept up to date, no drafting
    list(never.generate(tokens, max_tokens=1))
    n = len(tokens)
    main = spec.args.num_hidden_layers
    torch.testing.assert_close(spec.cache.tensor[:main, :, :n], never.cache.tensor[:main, :, :n], atol=1e-5, rtol=1e-5)
    valid = min(spec.speculator.valid, never.speculator.valid) - 1           # the last pair depends on the next token
    assert valid > 10
    torch.testing.assert_close(spec.cache.tensor[main, :, :valid], never.cache.tensor[main, :, :valid], atol=1e-5,
                               rtol=1e-5)


def test_checkpoint_without_mtp_weights_runs_with_mtp_off_and_says_why(v3_dir):
    notes = []
    llm = dsv3lite.load(v3_dir, device="cpu", progress=False, log=notes.append)
    assert any("MTP" in n for n in notes)
    list(llm.generate("hi", max_tokens=3))
    s = llm.stats()["mtp"]
    assert s["enabled"] is False and "no MTP weights" in s["reason"]


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.mark.parametrize("k", [1, 3])
def test_rejection_sampling_keeps_the_target_distribution(k):
    gen = torch.Generator().manual_seed(0)
    vocab = 6
    target = [torch.softmax(torch.randn(vocab, generator=gen) * 1.5, 0) for _ in range(k + 1)]
    draft = [torch.softmax(torch.randn(vocab, generator=gen) * 1.5, 0) for _ in range(k)]
    n = 6000
    counts = torch.zeros(vocab)
    for _ in range(n):
        drafts = [int(torch.multinomial(q, 1, generator=gen)) for q in draft]
        a, nxt = accept_drafts(target, drafts, draft, gen)
        first = drafts[0] if a > 0 else nxt
        counts[first] += 1
    # chi-square, 5 degrees of freedom: 99.9th percentile is 20.5
    assert _chi_square(counts, target[0]) < 20.5


def test_greedy_verification_is_argmax_agreement():
    p = [torch.tensor([0.1, 0.7, 0.2]), torch.tensor([0.5, 0.2, 0.3]), torch.tensor([0.2, 0.2, 0.6])]
    onehot = lambda i: torch.nn.functional.one_hot(torch.tensor(i), 3).float()
    greedy_p = [onehot(int(x.argmax())) for x in p]
    assert accept_drafts(greedy_p, [1, 0], [onehot(1), onehot(0)], None) == (2, 2)
    assert accept_drafts(greedy_p, [1, 2], [onehot(1), onehot(2)], None) == (1, 0)
    assert accept_drafts(greedy_p, [0, 0], [onehot(0), onehot(0)], None) == (0, 1)


def test_engine_speculative_step_samples_the_target_distribution(mtp_dir):
    """At a fixed context, the first token of a speculative step (accepted draft or correction) follows the
    main model's top-k distribution."""
    from dsv3lite.generate import RunStats
    from dsv3lite.sampling import SamplingParams

    spec = load(mtp_dir, mtp=True, mtp_adaptive=False)
    prompt = spec.tokenizer.encode("hello world", add_bos=True)
    first = int(spec.forward([prompt])[0, -1].argmax())
    probs = torch.softmax(spec.forward([prompt + [first]])[0, -1], 0)
    top = probs.topk(4)
    target = torch.zeros_like(probs).scatter_(0, top.indices, top.values / top.values.sum())
    counts = torch.zeros_like(probs)
    stats = RunStats()
    for seed in range(300):
        spec.reset()
        list(spec.generate(prompt, max_tokens=1))          # prefill; the greedy first token is `first`
        assert spec.cached_tokens == prompt
        params = SamplingParams(max_tokens=2, temperature=1.0, top_k=4, seed=seed)
        with torch.inference_mode():
            new = spec._step(first, params, torch.Generator().manual_seed(seed), stats)
        counts[new[0]] += 1
    assert stats.drafted == 300                            # every step speculated
    # 3 degrees of freedom: the 99.9th percentile is 16.3
    assert _chi_square(counts, target) < 16.3


def test_mtp_is_judged_against_plain_steps_timed_after_the_speculative_ones():
    """The first steps after a prompt run slower than later ones: plain decoding is timed again before the verdict,
    and that later timing is what speculation must beat."""
    from dsv3lite.speculative import MTPTimer

    timer = MTPTimer()
    for _ in range(MTPTimer.PROBE_PLAIN):
        assert timer.probing()
        timer.plain(2.0)                                      # slow first steps: 0.5 tok/s
    assert not timer.probing()
    for _ in range(MTPTimer.JUDGE_AFTER):
        timer.spec(1.5, tokens=1, drafted=1, accepted=1)      # 0.67 tok/s: beats the first steps only
        assert timer.verdict() is None
    for _ in range(MTPTimer.PROBE_PLAIN):
        assert timer.probing()                                # the second probe, before judging
        timer.plain(1.0)
    assert not timer.probing()
    assert "with MTP vs 1.0 tok/s without" in timer.verdict()


def test_mtp_turns_itself_off_when_drafts_are_rarely_accepted():
    from dsv3lite.speculative import MTPTimer

    fast = MTPTimer()
    for _ in range(MTPTimer.PROBE_PLAIN):
        fast.plain(1.0)
    for _ in range(MTPTimer.JUDGE_AFTER - 1):
        fast.spec(0.1, tokens=1, drafted=1, accepted=0)        # faster than plain, but nothing accepted
        assert fast.verdict() is None
    fast.spec(0.1, tokens=1, drafted=1, accepted=0)
    assert "0% of the last 16 drafts" in fast.verdict()
    good = MTPTimer()
    for _ in range(MTPTimer.PROBE_PLAIN):
        good.plain(1.0)
    for _ in range(3 * MTPTimer.JUDGE_AFTER):
        good.spec(1.0, tokens=2, drafted=1, accepted=1)
        assert good.verdict() is None
    off = MTPTimer(adaptive=False)
    for _ in range(MTPTimer.JUDGE_AFTER):
        off.spec(0.1, tokens=1, drafted=1, accepted=0)
    assert off.verdict() is None                                # not adaptive: never judged


def test_tokens_per_forward_agrees_with_the_acceptance(mtp_dir):
    """A reply cut by max_tokens right after an accepted draft (prefill token, then one forward whose draft is
    accepted, max_tokens 2): the stats count what the forwards produced, so 100% acceptance with one draft is 2
    tokens per forward (it read 1.00 when the cut token was left out); and over real replies 1 + the acceptance."""
    from dsv3lite.generate import RunStats

    spec = load(mtp_dir, mtp=True, num_draft_tokens=1, mtp_adaptive=False)
    spec.last = RunStats(prompt_tokens=3, generated_tokens=2, main_forwards=1, drafted=1, accepted=1)
    s = spec.stats()["mtp"]
    assert s["acceptance_rate"] == 1.0 and s["tokens_per_forward"] == 2.0
    for n in range(2, 9):
        list(spec.generate("The quick brown fox jumps", max_tokens=n, temperature=1.0, seed=n))
        s = spec.stats()["mtp"]
        assert s["tokens_per_forward"] == pytest.approx(1 + s["acceptance_rate"]), (n, s)
