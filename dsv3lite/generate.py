"""The Engine behind `dsv3lite.load()`: prefill, decode over the latent cache, sampling, stop handling, stats.

One Engine owns one model, one tokenizer and one latent cache (batch 1). A conversation keeps its cache:
each call prefills only the tokens after the longest prefix it shares with what is already cached.
"""
from __future__ import annotations

import contextlib
import math
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from .errors import UserError

PREFILL_CHUNK = 512
ABSORB_MAX_TOKENS = 4        # forwards of up to this many tokens use the absorbed (latent) attention
MAX_DRAFT_TOKENS = 3


@dataclass
class Chunk:
    """One streamed step: new text (may be empty while a stop string is pending), the token, why it ended."""
    text: str
    token_id: int | None
    finish_reason: str | None = None       # None while streaming; "stop" | "length" on the last chunk


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        checks = [
            (isinstance(self.max_tokens, int) and self.max_tokens >= 1, f"max_tokens must be an integer >= 1, got {self.max_tokens!r}"),
            (_finite(self.temperature) and self.temperature >= 0, f"temperature must be >= 0, got {self.temperature!r}"),
            (_finite(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}"),
            (isinstance(self.top_k, int) and self.top_k >= 0, f"top_k must be an integer >= 0, got {self.top_k!r}"),
            (self.seed is None or isinstance(self.seed, int), f"seed must be an integer, got {self.seed!r}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise UserError(msg)


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def sampling_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution sampling draws from: logits [V] (any dtype) -> fp32 probabilities [V] after
    temperature, top-k and top-p. Temperature 0 is a one-hot on the argmax."""
    logits = logits.float()
    if p.temperature == 0:
        return torch.zeros_like(logits).scatter_(0, logits.argmax().view(1), 1.0)
    logits = logits / p.temperature
    if 0 < p.top_k < logits.numel():
        kth = logits.topk(p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(0) - sorted_probs          # mass strictly above each token
        sorted_probs = sorted_probs.masked_fill(before >= p.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        probs = probs / probs.sum()
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from `probs` (any device); draws use the CPU generator so a seed gives the same text anywhere."""
    probs = probs.float().cpu()
    if probs.max() == 1.0:
        return int(probs.argmax())
    return int(torch.multinomial(probs, 1, generator=generator))


class StopMatcher:
    """Holds back streamed text that might be the start of a stop string."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """-> (text safe to emit, stopped)."""
        if not self.stops:
            return text, False
        self.pending += text
        hits = [(self.pending.find(s), s) for s in self.stops if s in self.pending]
        if hits:
            at = min(i for i, _ in hits)
            out, self.pending = self.pending[:at], ""
            return out, True
        keep = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(s[:n]):
                    keep = max(keep, n)
                    break
        out = self.pending[:len(self.pending) - keep]
        self.pending = self.pending[len(self.pending) - keep:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class _Emitter:
    """Turns sampled tokens into streamed chunks: stop ids, stop strings, max_tokens, context room."""

    def __init__(self, engine: "Engine", params: SamplingParams, stats: "RunStats"):
        self.engine, self.params, self.stats = engine, params, stats
        self.decoder = engine.tokenizer.stream_decoder() if engine.tokenizer is not None else None
        self.stopper = StopMatcher(params.stop)

    def _flush(self) -> str:
        return self.decoder.flush() if self.decoder else ""

    def push(self, token: int) -> Chunk:
        self.stats.generated_tokens += 1
        if token in self.engine.stop_ids:
            return Chunk(self.stopper.flush() + self._flush(), token, "stop")
        text, stopped = self.stopper.feed(self.decoder.push(token) if self.decoder else "")
        if stopped:
            return Chunk(text, token, "stop")
        out_of_room = len(self.engine.cached_tokens) + 1 >= self.engine.ctx_size
        if self.stats.generated_tokens >= self.params.max_tokens or out_of_room:
            tail, stopped = self.stopper.feed(self._flush())
            return Chunk(text + tail + ("" if stopped else self.stopper.flush()), token,
                         "stop" if stopped else "length")
        return Chunk(text, token)


class MTPTimer:
    """Decides whether speculation pays: a few plain steps are timed first, then speculative steps; after
    JUDGE_AFTER of them, MTP is turned off if it produced fewer tokens per second than plain decoding."""
    PROBE_PLAIN = 3
    JUDGE_AFTER = 16

    def __init__(self, adaptive: bool = True):
        self.adaptive = adaptive
        self.plain_s: list[float] = []
        self.spec_s = 0.0
        self.spec_tokens = 0
        self.spec_steps = 0
        self.judged = not adaptive

    def probing(self) -> bool:
        return self.adaptive and len(self.plain_s) < self.PROBE_PLAIN

    def plain(self, dt: float) -> None:
        self.plain_s.append(dt)

    def spec(self, dt: float, tokens: int) -> None:
        self.spec_s += dt
        self.spec_tokens += tokens
        self.spec_steps += 1

    def verdict(self) -> str | None:
        if self.judged or self.spec_steps < self.JUDGE_AFTER or not self.plain_s:
            return None
        self.judged = True
        plain_rate = 1.0 / sorted(self.plain_s)[len(self.plain_s) // 2]
        spec_rate = self.spec_tokens / self.spec_s
        if spec_rate < 0.97 * plain_rate:
            return f"measured {spec_rate:.1f} tok/s with MTP vs {plain_rate:.1f} tok/s without"
        return None


def empty_expert_cache_stats() -> dict:
    return {"hits": 0, "prefetch_hits": 0, "demand_misses": 0, "hit_rate": 0.0, "h2d_bytes": 0,
            "h2d_gb_s": 0.0, "stall_ms": 0.0, "cpu_experts": 0, "predictor_precision": 0.0,
            "predictor_recall": 0.0}


@dataclass
class RunStats:
    prompt_tokens: int = 0
    prefilled_tokens: int = 0
    cached_prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    ttft_s: float = 0.0
    main_forwards: int = 0            # decode forwards of the main model
    drafted: int = 0
    accepted: int = 0


# A decode step of a model this small is a few hundred tiny operators: on CPU, waking a second OpenMP thread for
# each costs more than it saves (measured on the demo model, 2 cores: 1 thread ~20% faster than 2). Larger models
# decode with every thread.
SINGLE_THREAD_DECODE_MAX_ACTIVE_PARAMS = 50_000_000


def decode_threads(args, device: torch.device) -> int | None:
    """Intra-op threads for CPU decode steps: 1 for tiny models, None (torch's setting) otherwise."""
    from .footprint import footprint

    if device.type != "cpu" or footprint(args).active > SINGLE_THREAD_DECODE_MAX_ACTIVE_PARAMS:
        return None
    return 1


@contextlib.contextmanager
def intra_op_threads(n: int | None):
    """Run the block with torch's intra-op thread count set to n (None: unchanged), then restore it."""
    prev = torch.get_num_threads()
    if n is None or n == prev:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


class Engine:
    """Generation over one model. Thread-safe: one generation at a time (a lock)."""

    def __init__(self, model, tokenizer, device: torch.device, dtype: torch.dtype, ctx_size: int = 4096,
                 mtp: bool = True, weights: str | None = None, log=None, num_draft_tokens: int = 1,
                 mtp_adaptive: bool = True):
        self.model = model
        self.tokenizer = tokenizer
        self.device, self.dtype = device, dtype
        self.args = model.args
        self.weights = weights
        self.log = log or (lambda msg: print(msg, file=sys.stderr))
        self.ctx_size = int(ctx_size)
        if self.ctx_size < 1:
            raise UserError(f"ctx_size must be >= 1, got {ctx_size}")
        self.mtp_requested = bool(mtp)
        self.mtp_enabled = bool(mtp) and model.mtp is not None
        self.mtp_off_reason = None if self.mtp_enabled else (
            "disabled by the caller" if not mtp else "the checkpoint has no MTP weights")
        if not 1 <= int(num_draft_tokens) <= MAX_DRAFT_TOKENS:
            raise UserError(f"--num-draft-tokens must be in 1..{MAX_DRAFT_TOKENS}, got {num_draft_tokens}")
        self.num_draft_tokens = int(num_draft_tokens)
        self.mtp_timer = MTPTimer(mtp_adaptive)
        self.mtp_valid = 0                                # valid MTP-cache positions (pairs (h_i, t_{i+1}))
        self.mtp_out: torch.Tensor | None = None          # MTP output of the last valid pair (drafts come from it)
        self.lock = threading.Lock()
        self.cache: torch.Tensor | None = None           # [n_blocks, 1, ctx, latent_dim]
        self.cached_tokens: list[int] = []                # tokens whose latents are valid in self.cache
        self.last = RunStats()
        self.offload = None                               # the offloading runtime, when experts are offloaded
        self.stop_ids = set(tokenizer.stop_ids) | self.args.stop_ids() if tokenizer is not None else self.args.stop_ids()
        self.decode_threads = decode_threads(self.args, device)

    # --- public API ---------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, input_ids) -> torch.Tensor:
        """LongTensor [B, T] -> float32 logits [B, T, vocab]; no cache involved."""
        ids = torch.as_tensor(input_ids, dtype=torch.long)
        if ids.dim() == 1:
            ids = ids[None]
        self._check_ids(ids.flatten().tolist())
        return self.model(ids.to(self.device)).float()

    def generate(self, prompt, max_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, seed: int | None = None, stop=None) -> Iterator[Chunk]:
        """Stream the completion of `prompt` (str, BOS added, or list[int] used as given)."""
        params = SamplingParams(max_tokens, temperature, top_p, top_k, seed, stop or [])
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_bos=True)
        else:
            ids = [int(t) for t in prompt]
        return self._generate(ids, params)

    def chat(self, messages: list[dict], max_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
             top_k: int = 0, seed: int | None = None, stop=None) -> Iterator[Chunk]:
        """Stream the assistant's reply to `messages` (rendered with the checkpoint's chat template)."""
        ids = self.tokenizer.encode_chat(messages, add_generation_prompt=True)
        params = SamplingParams(max_tokens, temperature, top_p, top_k, seed, stop or [])
        return self._generate(ids, params)

    def reset(self) -> None:
        """Forget the cached conversation."""
        self.cached_tokens = []
        self.mtp_valid = 0

    def stats(self) -> dict:
        s = self.last
        decode_tokens = max(s.generated_tokens - 1, 0)
        expert = self.offload.stats() if self.offload is not None else empty_expert_cache_stats()
        return {
            "prefill_tok_s": s.prefilled_tokens / s.prefill_s if s.prefill_s > 0 else 0.0,
            "decode_tok_s": decode_tokens / s.decode_s if s.decode_s > 0 else 0.0,
            "ttft_s": s.ttft_s,
            "prompt_tokens": s.prompt_tokens,
            "cached_prompt_tokens": s.cached_prompt_tokens,
            "generated_tokens": s.generated_tokens,
            "mtp": {"enabled": self.mtp_enabled,
                    "acceptance_rate": s.accepted / s.drafted if s.drafted else 0.0,
                    "tokens_per_forward": decode_tokens / s.main_forwards if s.main_forwards else 0.0,
                    **({} if self.mtp_enabled else {"reason": self.mtp_off_reason})},
            "expert_cache": expert,
            "memory": self._memory(),
        }

    # --- internals ----------------------------------------------------------------------------
    def _memory(self) -> dict:
        import psutil
        out = {"host_rss_bytes": psutil.Process().memory_info().rss}
        if self.device.type == "cuda":
            out["gpu_peak_bytes"] = torch.cuda.max_memory_allocated(self.device)
        return out

    def _check_ids(self, ids: list[int]) -> None:
        bad = [t for t in ids if t < 0 or t >= self.args.vocab_size]
        if bad:
            raise UserError(f"token id {bad[0]} is outside the model's vocabulary (0..{self.args.vocab_size - 1})")

    def _ensure_cache(self) -> torch.Tensor:
        n_blocks = len(self.model.blocks())
        if self.cache is None or self.cache.shape[0] != n_blocks:
            self.cache = torch.zeros(n_blocks, 1, self.ctx_size, self.args.latent_dim, dtype=self.dtype,
                                     device=self.device)
            self.reset()
        return self.cache

    def _main_cache(self) -> torch.Tensor:
        return self.cache[: self.args.num_hidden_layers]

    def _forward(self, tokens: list[int], start: int, all_logits: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Main model over `tokens` at positions start.. -> (final-normed hidden [S, D], logits [S or 1, V])."""
        x = torch.tensor([tokens], dtype=torch.long, device=self.device)
        h = self.model.hidden(x, start, self._main_cache(), absorb=len(tokens) <= ABSORB_MAX_TOKENS)[0]
        return h, self.model.head(h if all_logits else h[-1:])

    def _prefill(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Make the cache hold `ids`, reusing the cached prefix. -> (last logits [V], hidden of the
        positions computed [n - start, D], start)."""
        common = 0
        for a, b in zip(self.cached_tokens, ids):
            if a != b:
                break
            common += 1
        common = min(common, len(ids) - 1)                 # at least one token runs, for its logits
        if self.mtp_enabled:
            # MTP pair i is (h_i, t_{i+1}): recompute from the first pair that is stale, for its hidden
            common = max(min(common, self.mtp_valid, len(ids) - 1), 0)
        self.mtp_valid = min(self.mtp_valid, common)
        self.cached_tokens = self.cached_tokens[:common]
        self.last.cached_prompt_tokens = common
        hiddens, logits = [], None
        for start in range(common, len(ids), PREFILL_CHUNK):
            chunk = ids[start:start + PREFILL_CHUNK]
            h, logits = self._forward(chunk, start, all_logits=False)
            hiddens.append(h)
            self.cached_tokens = ids[:start + len(chunk)]
        return logits[-1], torch.cat(hiddens), common

    def _mtp_catch_up(self, hidden: torch.Tensor, next_tokens: list[int], start: int) -> None:
        """Run the MTP layer on accepted pairs (h_i, t_{i+1}) at positions start..; keep the last output."""
        assert start == self.mtp_valid, "MTP cache out of step with the main cache"
        mtp_cache = self.cache[self.args.num_hidden_layers]
        out = None
        for i in range(0, len(next_tokens), PREFILL_CHUNK):
            toks = torch.tensor([next_tokens[i:i + PREFILL_CHUNK]], dtype=torch.long, device=self.device)
            h = hidden[i:i + PREFILL_CHUNK][None]
            out = self.model.mtp_hidden(h, toks, start + i, mtp_cache, absorb=toks.shape[1] <= ABSORB_MAX_TOKENS)
        self.mtp_valid = start + len(next_tokens)
        self.mtp_out = out[0, -1]

    def _draft(self, k: int, params: SamplingParams, gen) -> tuple[list[int], list[torch.Tensor]]:
        """k draft tokens from the MTP head (its own output fed back for drafts 2..k), with their q vectors."""
        mtp_cache = self.cache[self.args.num_hidden_layers]
        drafts, qs = [], []
        out = self.mtp_out
        for j in range(k):
            q = sampling_probs(self.model.head(out), params)
            d = sample(q, gen)
            drafts.append(d)
            qs.append(q)
            if j + 1 < k:       # speculative MTP positions; catch-up overwrites them
                toks = torch.tensor([[d]], dtype=torch.long, device=self.device)
                out = self.model.mtp_hidden(out[None, None], toks, self.mtp_valid + j, mtp_cache, absorb=True)[0, -1]
        return drafts, qs

    def _generate(self, ids: list[int], params: SamplingParams) -> Iterator[Chunk]:
        if not ids:
            raise UserError("the prompt is empty")
        self._check_ids(ids)
        if len(ids) >= self.ctx_size:
            raise UserError(f"the prompt is {len(ids)} tokens but the context holds {self.ctx_size} "
                            f"(raise --ctx-size or shorten the prompt)")
        return self._run(ids, params)

    @torch.inference_mode()
    def _run(self, ids: list[int], params: SamplingParams) -> Iterator[Chunk]:
        with self.lock:
            self._ensure_cache()
            self.last = stats = RunStats(prompt_tokens=len(ids))
            gen = None
            if params.seed is not None:
                gen = torch.Generator().manual_seed(params.seed)
            if self.offload is not None:
                self.offload.reset_stats()
            t0 = time.perf_counter()
            logits, hidden, start = self._prefill(ids)
            if self.offload is not None:
                self.offload.end_prefill()
            stats.prefilled_tokens = len(ids) - stats.cached_prompt_tokens
            token = sample(sampling_probs(logits, params), gen)
            if self.mtp_enabled:
                self._mtp_catch_up(hidden, ids[start + 1:] + [token], start)
            stats.prefill_s = time.perf_counter() - t0
            stats.ttft_s = stats.prefill_s
            t_first = time.perf_counter()
            emit = _Emitter(self, params, stats)
            new = [token]
            while True:
                for t in new:
                    chunk = emit.push(t)
                    stats.decode_s = time.perf_counter() - t_first
                    yield chunk
                    if chunk.finish_reason:
                        return
                token = new[-1]
                with intra_op_threads(self.decode_threads):
                    new = self._step(token, params, gen, stats)

    def _step(self, token: int, params: SamplingParams, gen, stats: RunStats) -> list[int]:
        """One decode step from `token` (sampled, not yet cached) -> the new tokens it yields (1..k+1)."""
        from .speculative import accept_drafts

        m = len(self.cached_tokens)
        k = min(self.num_draft_tokens, self.ctx_size - m - 2) if self.mtp_active() else 0
        t0 = time.perf_counter()
        if k > 0:
            drafts, qs = self._draft(k, params, gen)
            h, logits = self._forward([token] + drafts, m, all_logits=True)
            a, nxt = accept_drafts([sampling_probs(l, params) for l in logits], drafts, qs, gen)
            self.cached_tokens += [token] + drafts[:a]
            new = drafts[:a] + [nxt]
            self._mtp_catch_up(h[:a + 1], new, m)
            stats.drafted += k
            stats.accepted += a
            self.mtp_timer.spec(time.perf_counter() - t0, len(new))
        else:
            h, logits = self._forward([token], m, all_logits=True)
            self.cached_tokens.append(token)
            new = [sample(sampling_probs(logits[0], params), gen)]
            self.mtp_timer.plain(time.perf_counter() - t0)
            if self.mtp_enabled:
                self._mtp_catch_up(h, new, m)
        stats.main_forwards += 1
        return new

    def mtp_active(self) -> bool:
        """Speculate this step? Off when MTP is off, or after measurements showed it slower than plain decoding."""
        if not self.mtp_enabled:
            return False
        verdict = self.mtp_timer.verdict()
        if verdict is not None:
            self.mtp_enabled = False
            self.mtp_off_reason = verdict
            self.log(f"note: MTP speculation turned off: {verdict}")
            return False
        return not self.mtp_timer.probing()
