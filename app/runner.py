"""One worker thread that runs every generation of the server and the web UI on their shared Engine.

Requests take a place in line when they arrive (`reserve`), become jobs when they are ready (`submit`), and run one
at a time in the order of their places; the asyncio side only awaits chunks, so the event loop never blocks on the
model. A cancelled job (client gone, Stop pressed) closes its engine generator at the next token, which leaves the
engine's latent cache consistent and frees the engine for the next job at once.
"""
from __future__ import annotations

import asyncio
import threading
import time
from typing import Callable, Iterator

from dsv3lite.generate import Chunk

_WAITING = object()      # a place in line whose request is still being prepared
_END = object()


class Job:
    """One generation: `start()` runs on the worker and returns the engine's chunk iterator."""

    def __init__(self, start: Callable[[], Iterator[Chunk]], loop: asyncio.AbstractEventLoop):
        self.start = start
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.stopped = False                  # cancelled by a shutdown (not by its client)
        self.status = "queued"                # queued | running | done | cancelled | failed
        self.error: BaseException | None = None
        self.stats: dict | None = None        # engine.stats() right after this job
        self.tokens = 0
        self.unknown_tokens = 0               # ids past the tokenizer's vocabulary (they decode to nothing)
        self.finish_reason: str | None = None
        self.routing: list[list[int]] | None = None   # tokens per (MoE layer, expert) of this job, when counted
        self.t_start = self.t_first = None

    def cancel(self) -> None:
        self.cancelled.set()

    def outcome(self) -> str:
        """done | failed | cancelled (its client went away) | stopped (a shutdown), as soon as it is known; a job
        whose client left before it finished counts as cancelled even while the worker is still closing it."""
        if self.error is not None:
            return "failed"
        if self.stopped:
            return "stopped"
        if self.finish_reason is not None:
            return "done"
        return "cancelled" if self.cancelled.is_set() else self.status

    def _put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:                  # the event loop is closed: nobody is listening any more
            self.cancel()

    async def chunks(self):
        """Async iterator over the chunks; raises the job's error (UserError or other) if it failed."""
        while True:
            item = await self.queue.get()
            if item is _END:
                if self.error is not None:
                    raise self.error
                return
            yield item


class RoutingRecorder:
    """Counts, per MoE layer and expert, the tokens routed there during one job (for the UI's heat map), from the
    model's routing observer."""

    def __init__(self, model):
        import torch

        self.layer_ids = [m.layer_id for m in model.moe_modules()]
        self._rows = {layer: row for row, layer in enumerate(self.layer_ids)}
        self._n_experts = model.args.n_routed_experts
        device = next(model.parameters()).device
        self.counts = torch.zeros(len(self.layer_ids), self._n_experts, dtype=torch.long, device=device)
        self._handle = model.add_observer(on_routing=self._on_routing)

    def _on_routing(self, layer_id: int, ids, scores) -> None:
        n = self._n_experts
        self.counts[self._rows[layer_id]] += ids.flatten().bincount(minlength=n)[:n]

    def reset(self) -> None:
        self.counts.zero_()

    def snapshot(self) -> list[list[int]]:
        return self.counts.cpu().tolist()

    def close(self) -> None:
        self._handle.remove()


class EngineRunner:
    """Serializes generations on one Engine in arrival order, on a dedicated thread."""

    def __init__(self, engine, count_routing: bool = False):
        self.engine = engine
        self.routing = RoutingRecorder(engine.model) if count_routing else None
        self._cv = threading.Condition()
        self._line: dict[int, object] = {}      # place in line -> Job, _WAITING, or None (request dropped)
        self._issued = 0
        self._next = 0
        self._closed = False
        self.current: Job | None = None
        self.last_stats: dict = {}
        self.counters = {"jobs": 0, "completed": 0, "cancelled": 0, "failed": 0, "completion_tokens": 0}
        self._thread = threading.Thread(target=self._work, name="dsv3lite-engine", daemon=True)
        self._thread.start()

    # --- the asyncio side ---------------------------------------------------------------------------------------
    def reserve(self) -> int:
        """A place in line, taken when a request arrives; pass it to submit() or drop() exactly once."""
        with self._cv:
            place = self._issued
            self._issued += 1
            self._line[place] = _WAITING
            return place

    def submit(self, place: int, start: Callable[[], Iterator[Chunk]]) -> Job:
        job = Job(start, asyncio.get_running_loop())
        with self._cv:
            if self._closed:                  # stopping: the job ends at once (see stop)
                self._line.pop(place, None)
                job.stopped = True
                job.cancel()
                job._put(_END)
                return job
            self._line[place] = job
            self._cv.notify_all()
        return job

    def run(self, start: Callable[[], Iterator[Chunk]]) -> Job:
        """reserve() and submit() in one (for requests that need no preparation)."""
        return self.submit(self.reserve(), start)

    def drop(self, place: int) -> None:
        with self._cv:
            if self._line.get(place) is _WAITING:
                self._line[place] = None
                self._cv.notify_all()

    def queued(self) -> int:
        with self._cv:
            return sum(1 for v in self._line.values() if v is not None)

    def stop(self) -> None:
        """A shutdown, without waiting: queued jobs end now and the running one at its next token, each marked
        `stopped` (their responses say the server is shutting down); later submissions end at once."""
        with self._cv:
            self._closed = True
            for item in self._line.values():
                if isinstance(item, Job):
                    item.stopped = True
                    item.cancel()
                    item._put(_END)
            self._line.clear()
            if self.current is not None:
                self.current.stopped = True
                self.current.cancel()
            self._cv.notify_all()

    def close(self) -> None:
        """Cancel everything queued or running and stop the worker."""
        self.stop()
        self._thread.join(timeout=10)
        if self.routing is not None:
            self.routing.close()

    def live(self) -> dict:
        """What the engine is doing now: for live stats while a reply streams."""
        job = self.current
        out = {"busy": job is not None, "queued": self.queued(), **self.counters}
        if job is not None and job.t_first is not None:
            elapsed = time.perf_counter() - job.t_first
            out.update(tokens=job.tokens, decode_tok_s=(job.tokens - 1) / elapsed if elapsed > 0 else 0.0)
        return out

    # --- the worker ---------------------------------------------------------------------------------------------
    def _take(self) -> Job | None:
        with self._cv:
            while True:
                if self._closed:
                    return None
                item = self._line.get(self._next, _WAITING)
                if item is not _WAITING:
                    del self._line[self._next]
                    self._next += 1
                    if item is not None:
                        self.current = item       # under the lock: stop() finds it queued or current
                        return item
                    continue
                self._cv.wait()

    def _work(self) -> None:
        self.last_stats = self.engine.stats()
        while (job := self._take()) is not None:
            self._run(job)

    def _run(self, job: Job) -> None:
        self.counters["jobs"] += 1
        if job.cancelled.is_set():
            job.status = "cancelled"
            self.counters["cancelled"] += 1
            self.current = None
            job._put(_END)
            return
        job.status = "running"
        job.t_start = time.perf_counter()
        if self.routing is not None:
            self.routing.reset()
        stream = None
        tokenizer = getattr(self.engine, "tokenizer", None)
        vocab = getattr(tokenizer, "vocab_size", None)
        try:
            stream = job.start()
            for chunk in stream:
                if job.t_first is None:
                    job.t_first = time.perf_counter()
                job.tokens += 1
                job.finish_reason = chunk.finish_reason
                if vocab is not None and chunk.token_id is not None and chunk.token_id >= vocab:
                    job.unknown_tokens += 1
                job._put(chunk)
                if job.cancelled.is_set():
                    break
        except BaseException as e:               # UserError -> 400; anything else -> 500; the worker carries on
            job.error = e if isinstance(e, Exception) else RuntimeError(repr(e))
        finally:
            close = getattr(stream, "close", None)
            if close is not None:
                try:
                    close()                      # stops generation; the engine keeps a consistent cache
                except Exception as e:
                    job.error = job.error or e
            self.current = None
        job.status = "failed" if job.error is not None else "cancelled" if job.cancelled.is_set() else "done"
        self.counters[{"failed": "failed", "cancelled": "cancelled", "done": "completed"}[job.status]] += 1
        self.counters["completion_tokens"] += job.tokens
        try:
            if self.routing is not None:
                job.routing = self.routing.snapshot()
            job.stats = self.last_stats = self.engine.stats()
        except Exception as e:                   # stats must never take the worker down
            job.stats = self.last_stats
            job.error = job.error or e
        job._put(_END)
