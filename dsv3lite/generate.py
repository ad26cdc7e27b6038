"""The Engine behind `dsv3lite.load()`: prefill, decode over the latent cache, sampling, stop handling, stats.

One Engine owns one model, one tokenizer and one latent cache (batch 1). A conversation keeps its cache:
each call prefills only the tokens after the longest prefix it shares with what is already cached.
"""
from __future__ import annotations

import contextlib
import sys
import threading
import time
from dataclasses import dataclass
from typing import Iterator

import torch

from . import executors
from .cache import ModelCache
from .errors import UserError
from .executors.prefill import prefill_hidden
from .limits import ABSORB_MAX_TOKENS, LAYER_MAJOR_TOKENS, PREFILL_CHUNK
from .offload.stats import empty_expert_cache_stats
from .sampling import SamplingParams, sample, sampling_probs
from .speculative import Speculator
from .threads import ThreadPolicy


@dataclass
class Chunk:
    """One streamed step: new text (may be empty while a stop string is pending), the token, why it ended."""
    text: str
    token_id: int | None
    finish_reason: str | None = None       # None while streaming; "stop" | "length" on the last chunk


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
# decode with every thread, and so does a model the CPU decode step runs whole (executors/cpu.py: its kernels
# use one thread for small matrices by themselves; the demo decodes 1.6-1.8x faster on 2 than on 1): Engine.decode_threads.
SINGLE_THREAD_DECODE_MAX_ACTIVE_PARAMS = 50_000_000


def decode_threads(args, device: torch.device) -> int | None:
    """Intra-op threads for eager CPU decode steps: 1 for tiny models, None (torch's setting) otherwise."""
    from .family import family_of

    if device.type != "cpu" or family_of(args).footprint(args).active > SINGLE_THREAD_DECODE_MAX_ACTIVE_PARAMS:
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
                 mtp_adaptive: bool = True, offload=None, cuda_graphs: bool = True,
                 threads: ThreadPolicy | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.device, self.dtype = device, dtype
        self.args = model.args
        self.weights = weights
        self.log = log or (lambda msg: print(msg, file=sys.stderr))
        self.ctx_size = int(ctx_size)
        if self.ctx_size < 1:
            raise UserError(f"ctx_size must be >= 1, got {ctx_size}")
        # how forward passes run (executors/): chosen once; on a GPU, decode steps replayed from CUDA graphs
        # (--no-cuda-graphs or DSV3LITE_GRAPHS=0: the eager step), on the CPU the compiled step
        self.executor = executors.choose(model, device, cuda_graphs, log=self.log)
        self._base_executor = getattr(self.executor, "fallback", self.executor)
        self.speculator = Speculator(model, self._base_executor, mtp, num_draft_tokens, mtp_adaptive, log=self.log,
                                     on_tokens=offload.expect_tokens if offload is not None else None)
        self.lock = threading.Lock()
        self.cache: ModelCache | None = None              # every block's cache (the model's kinds), one sequence
        self.cached_tokens: list[int] = []                # tokens whose state is valid in self.cache
        self.last = RunStats()
        self.offload = offload                            # the offloading runtime, when experts are offloaded
        self.stop_ids = set(tokenizer.stop_ids) | self.args.stop_ids() if tokenizer is not None else self.args.stop_ids()
        self._eager_threads = decode_threads(self.args, device)      # the size rule, once
        # intra-op threads of every step (threads.py): fixed, or adapting when other programs take cores
        self.threads = threads or ThreadPolicy(torch.get_num_threads(), adaptive=False)

    @property
    def graphs(self):
        """The decode graphs in use (executors/graphs.py's DecodeGraphs), or None (decode steps run without them).
        Assigning one installs it (tests give one a stand-in capture); None goes back to the step without."""
        return getattr(self.executor, "graphs", None)

    @graphs.setter
    def graphs(self, runner) -> None:
        from .executors.graphs import GraphStep

        self.executor = self._base_executor if runner is None else GraphStep(self._base_executor, runner)

    @property
    def decode_threads(self) -> int | None:
        """Intra-op threads for this engine's decode steps: torch's setting where the CPU decode step runs every
        block (DSV3LITE_CPU_DECODE is read at each step), else decode_threads' size rule."""
        return None if self._base_executor.runs_whole() else self._eager_threads

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
            ids = self._text_tokenizer("a text prompt").encode(prompt, add_bos=True)
        else:
            try:
                ids = [int(t) for t in prompt]
            except (TypeError, ValueError):
                raise UserError("a prompt is a string or a flat list of token ids (one sequence)") from None
        return self._generate(ids, params)

    def chat(self, messages: list[dict], max_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
             top_k: int = 0, seed: int | None = None, stop=None) -> Iterator[Chunk]:
        """Stream the assistant's reply to `messages` (rendered with the checkpoint's chat template)."""
        ids = self._text_tokenizer("chat").encode_chat(messages, add_generation_prompt=True)
        params = SamplingParams(max_tokens, temperature, top_p, top_k, seed, stop or [])
        return self._generate(ids, params)

    def reset(self) -> None:
        """Forget the cached conversation."""
        self.cached_tokens = []
        self.speculator.reset()

    def configure_mtp(self, enabled: bool | None = None, num_draft_tokens: int | None = None,
                      adaptive: bool | None = None, reason: str | None = None) -> None:
        """Turn MTP speculation on or off, or change its draft count or adaptivity, between generations
        (waits for a running generation to finish). `reason` is what stats() reports while it is off."""
        with self.lock:
            self.speculator.configure(enabled, num_draft_tokens, adaptive, reason)

    @property
    def mtp_enabled(self) -> bool:
        return self.speculator.enabled

    @property
    def mtp_off_reason(self) -> str | None:
        return self.speculator.off_reason

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
            "mtp": self.speculator.stats(s.drafted, s.accepted, s.main_forwards),
            "expert_cache": expert,
            "memory": self._memory(),
            "cuda_graphs": self.graphs.stats() if self.graphs is not None else None,
            "cpu_step": self._base_executor.stats(),
        }

    # --- internals ----------------------------------------------------------------------------
    def _text_tokenizer(self, what: str):
        if self.tokenizer is None:
            raise UserError(f"{what} needs a tokenizer, and {self.weights or 'this checkpoint'} has no tokenizer.json: "
                            f"pass token ids (a list of ints) instead")
        return self.tokenizer

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

    def _ensure_cache(self) -> ModelCache:
        if self.cache is None or len(self.cache) != len(self.model.blocks()):
            self.cache = self.model.new_cache(self.ctx_size, self.dtype, self.device)
            self.reset()
        return self.cache

    def _forward(self, tokens: list[int], start: int, all_logits: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Main model over `tokens` at positions start.. -> (its hidden state [S, ...] (what MTP reads), logits
        [S or 1, V])."""
        h = self.executor.hidden(tokens, start, self.cache, absorb=len(tokens) <= ABSORB_MAX_TOKENS)[0]
        return h, self.model.logits(h if all_logits else h[-1:])

    def _prefill(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Make the cache hold `ids`, reusing the cached prefix. -> (last logits [V], hidden of the
        positions computed [n - start, D], start)."""
        common = 0
        for a, b in zip(self.cached_tokens, ids):
            if a != b:
                break
            common += 1
        # at least one token runs, for its logits; every main layer's cache (and the MTP block's, while it drafts)
        # must be able to keep it; the speculator's catch-up rolls the MTP block's cache back itself
        common = self.speculator.keep(min(common, len(ids) - 1))
        common = self.cache.keepable(common, main=not self.speculator.enabled)
        self.speculator.keep(common)
        self.cache.truncate(common, main=True)
        self.cached_tokens = self.cached_tokens[:common]
        self.last.cached_prompt_tokens = common
        self.speculator.on_tokens(ids[common:])            # what the token ids decide is fetched before layer 0
        hiddens, logits = [], None
        for start in range(common, len(ids), LAYER_MAJOR_TOKENS):
            group = ids[start:start + LAYER_MAJOR_TOKENS]
            if len(group) <= PREFILL_CHUNK:
                h, logits = self._forward(group, start, all_logits=False)
            else:                                      # layer-major: each MoE layer's experts once per group
                x = torch.tensor([group], dtype=torch.long, device=self.device)
                h = prefill_hidden(self.model, x, start, self.cache)[0]
                logits = self.model.logits(h[-1:])
            hiddens.append(h)
            self.cached_tokens = ids[:start + len(group)]
        return logits[-1], torch.cat(hiddens), common

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
            self._base_executor.reset_stats()
            t0 = time.perf_counter()
            # prompts run eagerly on every device (the compiled CPU step takes decode steps): the size rule's threads
            with intra_op_threads(self.threads.current(self._eager_threads)):
                logits, hidden, start = self._prefill(ids)
                if self.offload is not None:
                    self.offload.end_prefill()
                stats.prefilled_tokens = len(ids) - stats.cached_prompt_tokens
                token = sample(sampling_probs(logits, params), gen)
                self.speculator.on_tokens([token])
                self.speculator.catch_up(self.cache, hidden, ids[start + 1:] + [token], start)
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
                with self.threads.step(self.decode_threads):
                    new = self._step(token, params, gen, stats)

    def _step(self, token: int, params: SamplingParams, gen, stats: RunStats) -> list[int]:
        """One decode step from `token` (sampled, not yet cached) -> the new tokens it yields (1..k+1)."""
        m = len(self.cached_tokens)
        new, kept = self.speculator.step(self._forward, self.cache, token, m, self.ctx_size - m - 2, params, gen,
                                         stats)
        self.cached_tokens += kept
        stats.main_forwards += 1
        return new
