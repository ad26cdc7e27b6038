"""Speculative decoding with the model's own MTP head: one `Speculator` per Engine owns it all.

Drafts d_1..d_k come from the MTP head with probabilities q_j; the main model scores them in one forward,
giving p_j. Draft j is accepted with probability min(1, p_j(d_j) / q_j(d_j)); the first rejected position
samples from norm(max(0, p_j - q_j)); if every draft is accepted, a bonus token is sampled from p_{k+1}.
This keeps the target distribution exactly; with temperature 0 (one-hot p and q) it reduces to "accept
while the main model's argmax equals the draft".

The Speculator drafts, verifies, accepts, rolls back (the main cache keeps only accepted tokens; the MTP
cache is caught up on the accepted pairs), times plain against speculative steps and turns itself off when
speculation does not pay. The MTP layer has its own latent cache: `valid` counts its positions that hold
pairs (h_i, t_{i+1}) of the current conversation.
"""
from __future__ import annotations

import time

import torch

from .errors import UserError
from .limits import ABSORB_MAX_TOKENS, MAX_DRAFT_TOKENS, PREFILL_CHUNK
from .sampling import SamplingParams, sample, sampling_probs


def accept_drafts(target: list[torch.Tensor], drafts: list[int], draft_probs: list[torch.Tensor],
                  generator: torch.Generator | None) -> tuple[int, int]:
    """target: k+1 probability vectors from the main model; drafts: k tokens; draft_probs: their k q vectors.
    -> (number of drafts accepted, the next token: the correction at the first rejection or the bonus)."""
    for j, (d, q) in enumerate(zip(drafts, draft_probs)):
        p = target[j]
        pd, qd = float(p[d]), float(q[d])
        if qd > 0 and pd >= qd:
            continue                                          # min(1, p/q) = 1: always accepted
        u = float(torch.rand((), generator=generator))
        if qd > 0 and u < pd / qd:
            continue
        residual = (p - q).clamp_(min=0)
        if float(residual.sum()) <= 0:
            residual = p.clone()
        return j, sample(residual / residual.sum(), generator)
    return len(drafts), sample(target[len(drafts)], generator)


class MTPTimer:
    """Decides whether speculation pays: a few plain steps are timed first, then speculative steps; after
    JUDGE_AFTER of them, a few plain steps again, and MTP is turned off if it produced fewer tokens per second than
    those later plain steps did (the first steps after a prompt run slower than later ones: on the demo, with the CPU
    decode step, 1.5-2.0 ms against 0.9-1.0, enough to keep a losing MTP on). Acceptance is watched all along: a window of JUDGE_AFTER
    speculative steps accepting under MIN_ACCEPTANCE of the drafts turns MTP off too (every draft then costs a
    verify position, e.g. its experts on an offloaded model)."""
    PROBE_PLAIN = 3                                 # plain steps timed before speculating, and again before judging
    JUDGE_AFTER = 16
    MIN_ACCEPTANCE = 0.1

    def __init__(self, adaptive: bool = True):
        self.adaptive = adaptive
        self.plain_s: list[float] = []
        self.spec_s = 0.0
        self.spec_tokens = 0
        self.spec_steps = 0
        self.judged = not adaptive
        self.window = [0, 0, 0]                     # speculative steps, drafts, drafts accepted since the last look

    def probing(self) -> bool:
        if not self.adaptive or self.judged:
            return False
        n = len(self.plain_s)
        return n < self.PROBE_PLAIN or (self.spec_steps >= self.JUDGE_AFTER and n < 2 * self.PROBE_PLAIN)

    def plain(self, dt: float) -> None:
        if len(self.plain_s) < 2 * self.PROBE_PLAIN:        # the probes' samples only (not every later plain step)
            self.plain_s.append(dt)

    def spec(self, dt: float, tokens: int, drafted: int = 0, accepted: int = 0) -> None:
        self.spec_s += dt
        self.spec_tokens += tokens
        self.spec_steps += 1
        w = self.window
        w[0], w[1], w[2] = w[0] + 1, w[1] + drafted, w[2] + accepted

    def verdict(self) -> str | None:
        if not self.adaptive:
            return None
        steps, drafted, accepted = self.window
        if steps >= self.JUDGE_AFTER:
            self.window = [0, 0, 0]
            if drafted and accepted / drafted < self.MIN_ACCEPTANCE:
                return f"only {accepted / drafted:.0%} of the last {drafted} drafts were accepted"
        if self.judged or self.spec_steps < self.JUDGE_AFTER or len(self.plain_s) < 2 * self.PROBE_PLAIN:
            return None
        self.judged = True
        later = sorted(self.plain_s[self.PROBE_PLAIN:])
        plain_rate = 1.0 / later[len(later) // 2]
        spec_rate = self.spec_tokens / self.spec_s
        if spec_rate < 0.97 * plain_rate:
            return f"measured {spec_rate:.1f} tok/s with MTP vs {plain_rate:.1f} tok/s without"
        return None


class Speculator:
    """MTP drafting and verification for one Engine (batch 1). `step` is one decode step, speculative or plain."""

    def __init__(self, model, executor, enabled: bool = True, num_draft_tokens: int = 1, adaptive: bool = True,
                 log=None, on_tokens=None):
        """on_tokens(tokens, more=False): told each token the next main forward runs as soon as it is sampled (more:
        a draft, after the tokens told before; the offloading runtime prefetches what the token ids decide)."""
        self.model, self.executor = model, executor        # the executor runs the MTP block (executors/)
        self.on_tokens = on_tokens or (lambda tokens, more=False: None)
        self.layer = model.args.num_hidden_layers          # the MTP block's index in the model's cache
        self.available = model.mtp is not None
        self.log = log or (lambda msg: None)
        self.enabled = bool(enabled) and self.available
        self.off_reason = None if self.enabled else (
            "disabled by the caller" if not enabled else "the checkpoint has no MTP weights")
        self.num_draft_tokens = self._checked_drafts(num_draft_tokens)
        self.timer = MTPTimer(adaptive)
        self.valid = 0                                     # valid MTP-cache positions (pairs (h_i, t_{i+1}))
        self.out: torch.Tensor | None = None               # MTP output of the last valid pair (drafts come from it)

    @staticmethod
    def _checked_drafts(k) -> int:
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_DRAFT_TOKENS:
            raise UserError(f"--num-draft-tokens must be in 1..{MAX_DRAFT_TOKENS}, got {k!r}")
        return k

    # --- control ------------------------------------------------------------------------------
    def configure(self, enabled: bool | None = None, num_draft_tokens: int | None = None,
                  adaptive: bool | None = None, reason: str | None = None) -> None:
        """Change speculation between generations. Turning it on again rebuilds the MTP cache (it was not
        kept up to date while off); `reason` is reported while it is off."""
        if num_draft_tokens is not None:
            self.num_draft_tokens = self._checked_drafts(num_draft_tokens)
        if adaptive is not None:
            self.timer = MTPTimer(bool(adaptive))
        if enabled is None or bool(enabled) == self.enabled:
            return
        if enabled:
            if not self.available:
                raise UserError("this checkpoint has no MTP weights: MTP cannot be turned on")
            self.enabled, self.off_reason, self.valid = True, None, 0
        else:
            self.enabled, self.off_reason = False, reason or "disabled by the caller"

    def active(self) -> bool:
        """Speculate this step? Off when MTP is off, or after measurements showed it slower than plain decoding."""
        if not self.enabled:
            return False
        verdict = self.timer.verdict()
        if verdict is not None:
            self.enabled, self.off_reason = False, verdict
            self.log(f"note: MTP speculation turned off: {verdict}")
            return False
        return not self.timer.probing()

    def keep(self, common: int) -> int:
        """The main cache keeps `common` tokens of a new prompt: how many it may keep so that the MTP cache can
        be caught up from there (its pair i needs h_i, so recompute from the first stale pair)."""
        if self.enabled:
            common = max(min(common, self.valid), 0)
        self.valid = min(self.valid, common)
        return common

    def reset(self) -> None:
        self.valid = 0

    def stats(self, drafted: int, accepted: int, main_forwards: int) -> dict:
        # tokens per forward: what the forwards produced (each its sampled token plus its accepted drafts), as the
        # acceptance counts them, whether or not max_tokens or a stop let all of them out
        return {"enabled": self.enabled,
                "acceptance_rate": accepted / drafted if drafted else 0.0,
                "tokens_per_forward": (main_forwards + accepted) / main_forwards if main_forwards else 0.0,
                **({} if self.enabled else {"reason": self.off_reason})}

    # --- the MTP layer ------------------------------------------------------------------------
    def catch_up(self, cache, hidden: torch.Tensor, next_tokens: list[int], start: int) -> None:
        """Run the MTP layer on accepted pairs (h_i, t_{i+1}) at positions start..; keep the last output."""
        if not self.enabled:
            return
        assert start == self.valid, "MTP cache out of step with the main cache"
        mtp_cache = cache[self.layer]
        mtp_cache.truncate(start)              # drafts' speculative positions are not part of its state
        out = None
        for i in range(0, len(next_tokens), PREFILL_CHUNK):
            ids = next_tokens[i:i + PREFILL_CHUNK]
            out = self.executor.mtp_hidden(hidden[i:i + PREFILL_CHUNK][None], ids, start + i, mtp_cache,
                                           absorb=len(ids) <= ABSORB_MAX_TOKENS)
        self.valid = start + len(next_tokens)
        self.out = out[0, -1]

    def draft(self, cache, k: int, params: SamplingParams, gen) -> tuple[list[int], list[torch.Tensor]]:
        """k draft tokens from the MTP head (its own output fed back for drafts 2..k), with their q vectors."""
        mtp_cache = cache[self.layer]
        drafts, qs = [], []
        out = self.out
        for j in range(k):
            q = sampling_probs(self.model.mtp_logits(out), params)
            d = sample(q, gen)
            self.on_tokens([d], more=True)
            drafts.append(d)
            qs.append(q)
            if j + 1 < k:       # speculative MTP positions; catch-up truncates them away
                out = self.executor.mtp_hidden(out[None, None], [d], self.valid + j, mtp_cache, absorb=True)[0, -1]
        return drafts, qs

    # --- one decode step ------------------------------------------------------------------------
    def step(self, forward, cache: torch.Tensor, token: int, m: int, room: int, params: SamplingParams, gen,
             stats) -> tuple[list[int], list[int]]:
        """One decode step from `token` (sampled, not yet cached) at position m. forward(tokens, start) ->
        (hidden [S, D], logits [S, V]) runs the main model; room: positions left after this step's token.
        -> (the new tokens it yields (1..k+1), the tokens the main cache now holds beyond m)."""
        k = min(self.num_draft_tokens, room) if self.active() else 0
        t0 = time.perf_counter()
        if k > 0:
            drafts, qs = self.draft(cache, k, params, gen)
            h, logits = forward([token] + drafts, m)
            a, nxt = accept_drafts([sampling_probs(l, params) for l in logits], drafts, qs, gen)
            self.on_tokens([nxt])
            kept, new = [token] + drafts[:a], drafts[:a] + [nxt]
            cache.truncate(m + len(kept), main=True)      # the rejected drafts' state, rolled back
            self.catch_up(cache, h[:a + 1], new, m)
            stats.drafted += k
            stats.accepted += a
            self.timer.spec(time.perf_counter() - t0, len(new), k, a)
            return new, kept
        h, logits = forward([token], m)
        new = [sample(sampling_probs(logits[0], params), gen)]
        self.on_tokens(new)
        self.timer.plain(time.perf_counter() - t0)
        self.catch_up(cache, h, new, m)
        return new, [token]
