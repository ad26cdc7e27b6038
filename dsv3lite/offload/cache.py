"""Host tier and device tier of the routed experts.

HostStore: every routed expert as one contiguous blob ([n_experts, blob_bytes] per MoE layer), pinned
when host RAM allows (one expert = one H2D copy), else served from the mmap'd quantized checkpoint (copied
through a few pinned staging buffers, `StagingRing`, until pinned).

ExpertCache: one global pool of equal-size slots shared by all MoE layers ([n_slots, blob_bytes] uint8
on the device), no write-back; its bookkeeping (expert->slot, pins, in-flight marks, victims) is a
`SlotTable`. On CUDA, copies run on dedicated streams (demand copies on a higher-priority stream than
prefetches) with one event per slot; compute waits only on the slots it reads (the compute stream waits on the
copy's event, the host never blocks on a copy), and a slot is overwritten only after the compute that last read
it has finished. On CPU the same logic runs against a simulated device
tier: a slot pool in host memory, filled by real copies.
"""
from __future__ import annotations

import time
from collections import deque

import torch

from .policy import Key, Policy
from .slots import SlotTable
from .stats import CopyCounts


class HostStore:
    """Per MoE layer, a uint8 [n_experts, blob_bytes] tensor (pinned, pageable or mmap'd). A mapped layer may be
    replaced by its pinned copy while serving (`swap`, the background pinner), and single experts of a mapped
    layer may be served from pinned rows (`hot`: the most used ones under --cpu-mem). Readers take a blob or a
    layer's tensor once per use and keep that reference, so an old mapping stays valid for them; a pinned row is
    reused only once nothing reads it (host_memory.HotExperts). `resident_cap` (CPU, --cpu-mem): the bound on the
    mapped blobs' resident pages, told of every blob read from the map."""

    def __init__(self, layers: dict[int, torch.Tensor], blob_bytes: int, mode: str, resident_cap=None):
        self.layers = layers
        self.blob_bytes = blob_bytes
        self.base_mode = mode               # "pinned" | "memory" | "mmap"
        self.pinned_layers: set[int] = set(layers) if mode == "pinned" else set()
        self.hot: dict[Key, torch.Tensor] = {}    # (layer, expert) -> its pinned row
        self.resident_cap = resident_cap
        self._addresses: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}   # layer -> (its tensor, addresses)

    @property
    def mode(self) -> str:
        """"pinned", "memory", "mmap", "mmap, N of M layers pinned" while the background pinner runs, or
        "mmap, N most used experts pinned" under --cpu-mem."""
        if self.base_mode == "mmap" and self.pinned_layers:
            n, m = len(self.pinned_layers), len(self.layers)
            return "pinned" if n == m else f"mmap, {n} of {m} layers pinned"
        if self.base_mode == "mmap" and self.hot:
            return f"mmap, {len(self.hot)} most used experts pinned"
        return self.base_mode

    @property
    def pinned_bytes(self) -> int:
        return sum(self.layers[l].numel() for l in self.pinned_layers) + len(self.hot) * self.blob_bytes

    def swap(self, layer: int, pinned: torch.Tensor) -> None:
        """Serve `layer` from its pinned copy from now on (same shape and bytes)."""
        assert pinned.shape == self.layers[layer].shape and pinned.dtype == torch.uint8
        self.layers[layer] = pinned
        self.pinned_layers.add(layer)

    def pin_expert(self, key: Key, row: torch.Tensor) -> None:
        """Serve `key` from `row` (its blob's bytes, pinned) from now on."""
        assert row.shape == (self.blob_bytes,) and row.dtype == torch.uint8
        self.hot[key] = row
        self._addresses.pop(key[0], None)

    def unpin_expert(self, key: Key) -> torch.Tensor:
        """Serve `key` from the map again; returns its row (still read by copies issued before this call)."""
        row = self.hot.pop(key)
        self._addresses.pop(key[0], None)
        return row

    def is_pinned(self, key: Key) -> bool:
        """Whether `key`'s blob is read from pinned memory now."""
        return key in self.hot or key[0] in self.pinned_layers

    def source(self, key: Key) -> tuple[torch.Tensor, bool]:
        """(the blob to copy `key` from, whether it is pinned). The layer is read before its pinned mark, so a swap
        in between can only call pinned memory pageable (a slower copy), never the reverse."""
        blob = self.blob(key)
        return blob, self.is_pinned(key)

    def blob(self, key: Key) -> torch.Tensor:
        """The blob to read `key` from now (every read of the host tier goes through here or `addresses`)."""
        row = self.hot.get(key)
        if row is not None:
            return row
        layer, e = key
        blob = self.layers[layer][e]
        if self.resident_cap is not None:
            self.resident_cap.touch((blob.data_ptr(),))
        return blob

    def addresses(self, layer: int) -> torch.Tensor:
        """int64 [n_experts]: where each blob of `layer` is read from now (its pinned row, else the layer's tensor).
        Cached with the layer's tensor (a swap by another thread cannot leave addresses into a freed mapping)."""
        blobs = self.layers[layer]
        cached = self._addresses.get(layer)
        if cached is None or cached[0] is not blobs:
            table = blobs.data_ptr() + torch.arange(blobs.shape[0], dtype=torch.int64) * blobs.stride(0)
            for (l, e), row in list(self.hot.items()):
                if l == layer:
                    table[e] = row.data_ptr()
            cached = self._addresses[layer] = (blobs, table)
        return cached[1]

    @property
    def total_bytes(self) -> int:
        return sum(t.numel() for t in self.layers.values())


class StagingRing:
    """Copies from pageable host memory (a mapped tier not yet pinned) go through a few pinned buffers: the issuing
    thread copies the blob into a free buffer (a memcpy), then the device copy runs from it asynchronously at the
    pinned rate. A pageable source makes the driver stage the copy itself, which holds the issuing thread for the
    whole transfer at about half the rate. A buffer is reused once the copy that read it has finished (`issued`
    hands over that copy's end event). `pin` allocates a buffer (host_memory.pinned_empty)."""

    def __init__(self, n: int, blob_bytes: int, pin=None):
        from .host_memory import pinned_empty

        pin = pin or (lambda shape: pinned_empty(shape))
        self.buffers = [pin((blob_bytes,)) for _ in range(n)]
        self.done: list = [None] * n                 # end event of the last copy from each buffer
        self.next = 0

    def stage(self, src: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(a pinned buffer holding src's bytes, its index for `issued`)."""
        i = self.next
        self.next = (i + 1) % len(self.buffers)
        if self.done[i] is not None:
            self.done[i].synchronize()                # the copy that last read this buffer has finished
            self.done[i] = None
        self.buffers[i].copy_(src)
        return self.buffers[i], i

    def issued(self, i: int, end_event) -> None:
        self.done[i] = end_event


STAGING_BUFFERS = 4      # pinned staging buffers of a mapped tier: as many copies as a bulk layer keeps ahead


class ExpertCache:
    """The pool, the copies and their events; every bookkeeping decision (which slot, which victim, what is
    pinned or in flight) is the slot table's (`self.slots`, offload/slots.py)."""

    def __init__(self, n_slots: int, host: HostStore, device: torch.device, policy: Policy):
        self.host = host
        self.device = device
        self.cuda = device.type == "cuda"
        self.slots = SlotTable(n_slots, policy)
        self.pool = torch.empty(n_slots, host.blob_bytes, dtype=torch.uint8, device=device)
        self.ready: list = [None] * n_slots        # CUDA event recorded after the slot's copy (None: waited for)
        self.copy_end: list = [None] * n_slots     # the end event of the slot's latest copy (clears its in-flight mark)
        self.stalls: deque = deque()               # (before, after) events around compute-stream waits on copies
        self.released: list = [None] * n_slots     # CUDA event recorded after the last compute that read the slot
        self.counts = CopyCounts()
        self.staging: StagingRing | None = None    # made at the first copy from pageable memory (CUDA)
        if self.cuda:
            self.demand_stream = torch.cuda.Stream(device, priority=-1)
            self.prefetch_stream = torch.cuda.Stream(device, priority=0)
            # per stream, copies in issue order (they finish in that order): (key, slot, start, end events)
            self.copies = {self.demand_stream: deque(), self.prefetch_stream: deque()}

    @property
    def n_slots(self) -> int:
        return self.slots.n_slots

    # --- queries -----------------------------------------------------------------------------
    def lookup(self, key: Key) -> int | None:
        return self.slots.lookup(key)

    def slot_view(self, slot: int) -> torch.Tensor:
        return self.pool[slot]

    def resident_keys(self) -> list[Key]:
        return self.slots.resident_keys()

    # --- loading -----------------------------------------------------------------------------
    def load(self, key: Key, kind: str) -> int | None:
        """Start copying `key` into a slot; None when every slot is pinned or in flight."""
        slot = self.slots.lookup(key)
        if slot is not None:
            return slot
        if self.cuda and self.slots.full:
            self._retire()                       # copies that finished no longer block their slots
        slot = self.slots.allocate(key, kind, in_flight=self.cuda)
        if slot is None:
            return None
        if self.cuda:
            stream = self.demand_stream if kind == "demand" else self.prefetch_stream
            start, end = self._copy(slot, key, stream)
            self.ready[slot] = self.copy_end[slot] = end
            self.copies[stream].append((key, slot, start, end))
        else:
            t0 = time.perf_counter()
            self.pool[slot].copy_(self.host.blob(key))
            self.counts.copy_s += time.perf_counter() - t0
        self.released[slot] = None
        self.counts.h2d_bytes += self.host.blob_bytes
        self.counts.h2d_copies += 1
        if kind == "prefetch":
            self.counts.prefetches += 1
        return slot

    def wait(self, slot: int) -> None:
        """Make the compute stream wait for the slot's copy; the host never blocks. A wait on a copy still running
        is timed on the device (two events around it): that is the stall, folded in by collect_copy_time."""
        ev = self.ready[slot]
        if ev is None:
            return
        self.ready[slot] = None
        stream = torch.cuda.current_stream(self.device)
        if self.slots.key_of[slot] in self.slots.in_flight and not ev.query():
            before = torch.cuda.Event(enable_timing=True)
            after = torch.cuda.Event(enable_timing=True)
            before.record(stream)
            stream.wait_event(ev)
            after.record(stream)
            self.stalls.append((before, after))
        else:
            stream.wait_event(ev)

    def release(self, slots: list[int]) -> None:
        """Mark the end of the compute that read `slots` (CUDA: an event on the compute stream)."""
        if not self.cuda or not slots:
            return
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        for i in slots:
            self.released[i] = ev

    def _copy(self, slot: int, key: Key, stream, src: torch.Tensor | None = None):
        """CUDA: queue the copy of `key`'s blob (or `src`) into `slot` on `stream`, after the last compute that read
        the slot; a pageable blob goes through the staging ring. -> (start, end) timing events."""
        pinned = True
        if src is None:
            src, pinned = self.host.source(key)
        staged = None
        if not pinned:
            if self.staging is None:
                self.staging = StagingRing(STAGING_BUFFERS, self.host.blob_bytes)
            src, staged = self.staging.stage(src)
        with torch.cuda.stream(stream):
            if self.released[slot] is not None:
                stream.wait_event(self.released[slot])   # the last compute that read this slot is done
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            self.pool[slot].copy_(src, non_blocking=True)
            end.record(stream)
        if staged is not None:
            self.staging.issued(staged, end)
        return start, end

    def time_copies(self, key: Key, repeats: int = 3) -> tuple[float, float]:
        """Best seconds of one host->device copy of `key`'s blob into slot 0 (before any slot is used): (from the
        tier as loads copy it now, from pinned memory). On the CPU, and for a pinned tier, the two are one."""
        assert not self.slots.slot_of, "time_copies overwrites slot 0: call it before any load"
        tier = self._time(lambda: self._copy(0, key, self.demand_stream) if self.cuda else
                          self.pool[0].copy_(self.host.blob(key)), repeats)
        if not self.cuda or self.host.is_pinned(key):
            return tier, tier
        from .host_memory import pinned_empty

        pinned = pinned_empty((self.host.blob_bytes,))
        pinned.copy_(self.host.blob(key))
        return tier, self._time(lambda: self._copy(0, key, self.demand_stream, pinned), repeats)

    def _time(self, copy, repeats: int) -> float:
        best = float("inf")
        for _ in range(repeats):
            if self.cuda:
                torch.cuda.synchronize(self.device)
            t0 = time.perf_counter()
            copy()
            if self.cuda:
                torch.cuda.synchronize(self.device)
            best = min(best, time.perf_counter() - t0)
        return best

    def _retire(self) -> None:
        """Fold finished copies into copy_s and clear their in-flight marks: each copy's end event is queried
        until it has finished, oldest first per stream, so a call costs O(finished copies + streams)."""
        for queue in self.copies.values():
            while queue and queue[0][3].query():
                key, slot, start, end = queue.popleft()
                self.counts.copy_s += start.elapsed_time(end) / 1e3
                if self.copy_end[slot] is end:
                    self.copy_end[slot] = None
                    self.slots.mark_ready(key)
        while self.stalls and self.stalls[0][1].query():
            before, after = self.stalls.popleft()
            self.counts.stall_s += before.elapsed_time(after) / 1e3

    def fence(self):
        """A callable that returns once every copy issued so far has finished (any thread may call it)."""
        if not self.cuda:
            return lambda: None
        events = []
        for stream in self.copies:
            ev = torch.cuda.Event()
            ev.record(stream)
            events.append(ev)
        return lambda: [ev.synchronize() for ev in events] and None

    def prefetches_queued(self) -> int:
        """Prefetch copies issued and not yet finished (CPU: copies are synchronous, none)."""
        if not self.cuda:
            return 0
        self._retire()
        return len(self.copies[self.prefetch_stream])

    def collect_copy_time(self) -> None:
        """Fold finished CUDA copies' durations into copy_s (cheap; called once per layer)."""
        if self.cuda:
            self._retire()

    def reset_counts(self) -> None:
        self.counts = CopyCounts()
        self.slots.reset_counts()

    def drain(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self.collect_copy_time()
