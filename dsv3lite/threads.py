"""Threads: how many every parallel region of a run uses (`--threads/-t`), and the rule that adapts the count of
decode steps when cores are taken by other programs.

One count reaches every parallel region: torch's operators and the compiled CPU kernels share one OpenMP runtime
(kernels/cpu_build.py), so torch.set_num_threads sets both; the offloading CPU worker and quantize take it as
their default. A decode step is hundreds of short parallel regions, each ending at a barrier: when another
program holds one of the cores, every region waits for the thread the scheduler parked there, and a 2-core
machine with one busy core decodes several times slower with 2 threads than with 1. So unless the count is
fixed with --threads, decode steps measure what they take with the counts at hand (the limit, one less, half,
... 1) and keep the fastest, measured again every few seconds and as soon as steps slow down.
"""
from __future__ import annotations

import contextlib
import os
import statistics
import time

from .errors import UserError

PROBE_STEPS = 4            # decode steps timed per candidate count (the first after a switch is not counted)
REPROBE_S = (1.0, 4.0)     # seconds between measurements: doubled from the first while the choice holds
SLOWDOWN = 1.6             # two steps this much slower than the chosen count's figure start a measurement now
HOPELESS = 1.1             # more threads whose first two timed steps are this much slower than the best are dropped
FEWER = 1.1                # the fewest threads whose figure is within this of the best are chosen (a wrong "more"
                           # costs several times what a wrong "fewer" does)


def physical_cores() -> int:
    """Cores this process may run on, one per physical core (hyper-threads share a core's arithmetic units)."""
    try:
        allowed = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        allowed = os.cpu_count() or 1
    try:
        import psutil

        physical = psutil.cpu_count(logical=False) or allowed
    except ImportError:
        physical = allowed
    return max(1, min(allowed, physical))


def resolve(threads: int | None) -> int:
    """--threads N as a count (None: the physical cores); one line for anything else."""
    if threads is None:
        return physical_cores()
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise UserError(f"threads must be an integer >= 1, got {threads!r}")
    return threads


def apply(threads: int) -> None:
    """Make `threads` the count of every parallel region started from this thread from now on."""
    import torch

    torch.set_num_threads(threads)


def worker_threads(threads: int) -> int:
    """The offloading CPU worker's default: every thread but the one the main thread drives the device with."""
    return max(1, threads - 1)


def candidates(limit: int) -> list[int]:
    """The counts an adaptive policy measures: the limit, one less (a core taken), then halving down to 1."""
    out, n = [limit], limit - 1
    while n >= 1:
        if n not in out:
            out.append(n)
        n = n // 2 if n > 1 else 0
    return out


class ThreadPolicy:
    """Intra-op threads of decode steps. Fixed (--threads N): N. Adaptive (the default): of `candidates(limit)`,
    each timed over PROBE_STEPS steps (the chosen count first; more threads plainly slower cut after two,
    `_hopeless`), the fewest within FEWER of the fastest; measured again after 1 s of decoding (the interval
    doubling to 4 s while the choice holds), after a pause of over 1 s (a new reply), or at once when steps run
    SLOWDOWN times slower than the chosen count's figure."""

    def __init__(self, limit: int, adaptive: bool = True, clock=time.perf_counter):
        self.limit, self.adaptive, self.clock = limit, adaptive, clock
        self.chosen = limit
        self.figures: dict[int, float] = {}       # count -> seconds per step when last measured (_figure)
        self.round: dict[int, float] = {}         # the same, of the round being measured
        self._queue: list[int] = []               # counts still to measure in this round
        self._samples: list[float] = []
        self._since = None                        # clock of the last measurement's end
        self._interval = REPROBE_S[0]
        self._slow: list[float] = []              # consecutive steps past SLOWDOWN times the chosen figure
        self._slowed: dict[int, float] = {}       # the chosen count's figure from those steps
        self._last_step = None                    # clock at the end of the last step
        self.rounds = 0

    def current(self, cap: int | None = None) -> int:
        """The count for work that is not measured (prefill), and for a step when nothing is measured."""
        return min(self.chosen, cap or self.chosen)

    @contextlib.contextmanager
    def step(self, cap: int | None = None):
        """Run one decode step with the count this policy picks (at most `cap`: the tiny-model rule), timing it."""
        import torch

        n = self._pick(cap)
        prev = torch.get_num_threads()
        if n != prev:
            torch.set_num_threads(n)
        t0 = self.clock()
        try:
            yield n
        finally:
            seconds = self.clock() - t0
            if n != prev:
                torch.set_num_threads(prev)
            self._record(n, seconds, cap)

    def _hopeless(self, n: int, timed: list[float]) -> bool:
        """Whether to cut the measurement of `n` threads short after two timed steps: more threads than the best
        so far (or, measured first, more than one) and both steps plainly slower than it (or than their own last
        figure), as threads waiting at barriers for a busy core are. A lone thread keeps its steps: it may start
        on the busy core until the scheduler moves it."""
        if len(timed) != 2 or n == 1:
            return False
        if self.round:
            best = min(self.round, key=self.round.get)
            return n > best and min(timed) > HOPELESS * self.round[best]
        before = self.figures.get(n)
        return before is not None and min(timed) > SLOWDOWN * before

    def _limit(self, cap: int | None) -> int:
        return min(self.limit, cap) if cap else self.limit

    def _pick(self, cap: int | None) -> int:
        limit = self._limit(cap)
        if not self.adaptive or limit == 1:
            return limit
        now = self.clock()
        if self._last_step is not None and now - self._last_step > REPROBE_S[0]:
            self._since, self._interval = None, REPROBE_S[0]      # idle a while (between replies): measure afresh
        if not self._queue and (self._since is None or now - self._since > self._interval):
            first = min(self.chosen, limit)               # its figure is the bar the others must beat
            self._samples, self.round = [], dict(self._slowed)   # (after a slowdown: its slow steps' figure)
            self._queue = [c for c in dict.fromkeys([first, *candidates(limit)]) if c not in self.round]
            self._slowed = {}
        return self._queue[0] if self._queue else min(self.chosen, limit)

    def _record(self, n: int, seconds: float, cap: int | None) -> None:
        self._last_step = self.clock()
        if not self.adaptive or self._limit(cap) == 1:
            return
        if not self._queue:                       # exploiting: a slowdown (a core taken) measures again now
            best = self.figures.get(n)
            self._slow = self._slow + [seconds] if best is not None and seconds > SLOWDOWN * best else []
            if len(self._slow) >= 2:
                self._slowed = {n: statistics.median(self._slow)}
                self._since, self._slow, self._interval = None, [], REPROBE_S[0]
            return
        if n != self._queue[0]:
            return
        self._samples.append(seconds)
        timed = self._samples[1:]
        if len(timed) < PROBE_STEPS and not self._hopeless(n, timed):
            return
        self.round[n] = self.figures[n] = _figure(n, timed)
        self._samples = []
        self._queue.pop(0)
        if not self._queue:                       # a round is measured: the fewest threads within FEWER of the best
            best = min(self.round.values())
            chosen = min(c for c, f in self.round.items() if f <= FEWER * best)
            self._interval = min(2 * self._interval, REPROBE_S[1]) if chosen == self.chosen else REPROBE_S[0]
            self.chosen, self._since = chosen, self.clock()
            self.rounds += 1


def _figure(n: int, timed: list[float]) -> float:
    """Seconds per step of `n` threads from its timed steps: a lone thread's fastest (its first steps may run on a
    busy core until the scheduler moves it), several threads' median (one step may fall where the other program
    was off its core)."""
    return min(timed) if n == 1 else statistics.median(timed)
