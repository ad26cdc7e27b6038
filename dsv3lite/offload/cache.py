"""Host tier and device tier of the routed experts.

HostStore: every routed expert as one contiguous blob ([n_experts, blob_bytes] per MoE layer), pinned
when host RAM allows (one expert = one H2D copy), else served from the mmap'd quantized checkpoint.

ExpertCache: one global pool of equal-size slots shared by all MoE layers ([n_slots, blob_bytes] uint8
on the device), an expert->slot table, no write-back. On CUDA, copies run on dedicated streams (demand
copies on a higher-priority stream than prefetches) with one event per slot; compute waits only on the
slots it reads, and a slot is overwritten only after the compute that last read it has finished. On CPU
the same logic runs against a simulated device tier: a slot pool in host memory, filled by real copies.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .policy import Key, Policy


class HostStore:
    """Per MoE layer, a uint8 [n_experts, blob_bytes] tensor (pinned, pageable or mmap'd)."""

    def __init__(self, layers: dict[int, torch.Tensor], blob_bytes: int, mode: str):
        self.layers = layers
        self.blob_bytes = blob_bytes
        self.mode = mode                    # "pinned" | "memory" | "mmap"

    def blob(self, key: Key) -> torch.Tensor:
        layer, e = key
        return self.layers[layer][e]

    @property
    def total_bytes(self) -> int:
        return sum(t.numel() for t in self.layers.values())


@dataclass
class Counters:
    hits: int = 0                 # served from a slot that was ready before it was needed
    prefetch_hits: int = 0        # first use of a slot a prefetch filled (ready or still in flight)
    demand_misses: int = 0        # needed and not resident: fetched on demand or computed on the CPU
    cpu_experts: int = 0          # demand misses computed on the CPU
    h2d_bytes: int = 0
    h2d_copies: int = 0
    prefetches: int = 0
    prefetches_wasted: int = 0    # evicted before any use
    evictions: int = 0
    stall_s: float = 0.0          # time compute waited for copies
    copy_s: float = 0.0           # time the copy engine spent (CPU: the memcpy itself)
    # predictor: per lookahead distance, [true positives, predicted, actual]
    predictor: dict[int, list[int]] = field(default_factory=dict)

    @property
    def uses(self) -> int:
        return self.hits + self.prefetch_hits + self.demand_misses


@dataclass
class Slot:
    key: Key | None = None
    kind: str = ""                 # how it was filled: "demand" | "prefetch" | "seed"
    used: bool = False             # used since it was filled
    ready: object = None           # CUDA event recorded after the copy (None: ready)
    released: object = None        # CUDA event recorded after the last compute that read it
    timing: tuple | None = None    # (start event, end event, bytes) of its copy, CUDA only


class ExpertCache:
    def __init__(self, n_slots: int, host: HostStore, device: torch.device, policy: Policy):
        self.host = host
        self.device = device
        self.cuda = device.type == "cuda"
        self.policy = policy
        self.pool = torch.empty(n_slots, host.blob_bytes, dtype=torch.uint8, device=device)
        self.slots = [Slot() for _ in range(n_slots)]
        self.slot_of: dict[Key, int] = {}
        self.pinned: set[Key] = set()
        self.stats = Counters()
        self.now = 0
        self._pending_timing: list[tuple] = []
        if self.cuda:
            self.demand_stream = torch.cuda.Stream(device, priority=-1)
            self.prefetch_stream = torch.cuda.Stream(device, priority=0)

    @property
    def n_slots(self) -> int:
        return len(self.slots)

    # --- queries -----------------------------------------------------------------------------
    def lookup(self, key: Key) -> int | None:
        return self.slot_of.get(key)

    def in_flight(self, slot: int) -> bool:
        ev = self.slots[slot].ready
        return ev is not None and not ev.query()

    def slot_view(self, slot: int) -> torch.Tensor:
        return self.pool[slot]

    def resident_keys(self) -> list[Key]:
        return list(self.slot_of)

    # --- loading -----------------------------------------------------------------------------
    def _free_slot(self) -> int | None:
        """A free slot, or the policy's victim among resident keys that are neither pinned nor in flight."""
        if len(self.slot_of) < self.n_slots:
            for i, s in enumerate(self.slots):
                if s.key is None:
                    return i
        candidates = [k for k, i in self.slot_of.items() if k not in self.pinned and not self.in_flight(i)]
        if not candidates:
            return None
        victim = self.policy.victim(candidates, self.now)
        i = self.slot_of.pop(victim)
        s = self.slots[i]
        if s.kind == "prefetch" and not s.used:
            self.stats.prefetches_wasted += 1
        self.stats.evictions += 1
        self.policy.forget(victim)
        s.key = None
        return i

    def load(self, key: Key, kind: str) -> int | None:
        """Start copying `key` into a slot; None when every slot is pinned or in flight."""
        if key in self.slot_of:
            return self.slot_of[key]
        i = self._free_slot()
        if i is None:
            return None
        s = self.slots[i]
        src = self.host.blob(key)
        if self.cuda:
            stream = self.demand_stream if kind == "demand" else self.prefetch_stream
            with torch.cuda.stream(stream):
                if s.released is not None:
                    stream.wait_event(s.released)            # the last compute that read this slot is done
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record(stream)
                self.pool[i].copy_(src, non_blocking=True)
                end.record(stream)
            s.ready = end
            self._pending_timing.append((start, end))
        else:
            t0 = time.perf_counter()
            self.pool[i].copy_(src)
            self.stats.copy_s += time.perf_counter() - t0
            s.ready = None
        s.key, s.kind, s.used, s.released = key, kind, False, None
        self.slot_of[key] = i
        self.policy.admit(key, self.now)
        self.stats.h2d_bytes += self.host.blob_bytes
        self.stats.h2d_copies += 1
        if kind == "prefetch":
            self.stats.prefetches += 1
        return i

    def wait(self, slot: int) -> None:
        """Make the compute stream wait for the slot's copy; the host blocks only when it is still in flight
        (that wait is the stall)."""
        ev = self.slots[slot].ready
        if ev is None:
            return
        if not ev.query():
            t0 = time.perf_counter()
            ev.synchronize()
            self.stats.stall_s += time.perf_counter() - t0
        torch.cuda.current_stream(self.device).wait_event(ev)
        self.slots[slot].ready = None

    def release(self, slots: list[int]) -> None:
        """Mark the end of the compute that read `slots` (CUDA: an event on the compute stream)."""
        if not self.cuda or not slots:
            return
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        for i in slots:
            self.slots[i].released = ev

    def collect_copy_time(self) -> None:
        """Fold finished CUDA copies' durations into copy_s (cheap; called once per step)."""
        still = []
        for start, end in self._pending_timing:
            if end.query():
                self.stats.copy_s += start.elapsed_time(end) / 1e3
            else:
                still.append((start, end))
        self._pending_timing = still

    def drain(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self.collect_copy_time()
