"""The offloading runtime: owns the routed experts of an offloaded model through the `MoE.experts` seam.

Per layer: the predictor (called after attention) reads the exact routing of this layer and the
predicted routing of the next `lookahead` MoE layers to the host in one transfer, pins those experts and
starts prefetch copies; the layer's MoE then serves each chosen expert from its slot (waiting only for
copies still in flight), or, on a miss, from a demand copy or a CPU computation, whichever the start-up
cost model says is faster. Routed outputs are summed in ascending expert id whatever computed them.

Layers whose experts follow from the token id alone (DeepSeek-V4's hash layers: model.token_route_tables) are
known exactly before a forward runs: the engine announces each forward's tokens as they are sampled
(`expect_tokens`: a prompt before its prefill, each sampled token before its MTP catch-up, each draft before the
verify), and their experts are pinned and prefetched at once, the prompt's union ordered by use.
"""
from __future__ import annotations

import time

import torch
from torch import nn

from ..kernels import cpu_experts, dispatch
from ..kernels.fused_moe import fused_expert, fused_moe
from ..limits import BULK_TOKENS
from ..moe import combine_experts
from ..utils import format_bytes
from ..quant.layout import BlobLayout, ExpertFormat
from .cache import ExpertCache, HostStore
from .cpu_worker import CpuJob, CpuWorker
from .options import MISS_POLICIES, OffloadOptions
from .policy import make_policy
from .predictor import RoutePredictor, distance_order
from .stats import ExpertCacheStats, UseCounts

BULK_WINDOW = 4          # copies kept in flight ahead of compute while streaming a layer in bulk
PREFETCH_BATCH = 2       # prefetch copies queued on the copy engine at once (benchmarks/cache_sim.py --copy-queue:
                         # within 14% of the best batch at 0.47 and 0.1 ms per copy, never worse than all at once)


class CostModel:
    """Measured at start-up: H2D bytes/s from pinned memory and from the host tier as it is then (a mapped tier
    copies through pinned staging buffers: slower, until the background pinner has pinned it), and the CPU's seconds
    for one expert on 1 and on 4 tokens in the format in use, at its real size, with the thread count that will
    compute misses (the expert's weights read from memory, not a cache). A fetch is costed at the rate of where
    that expert's blob is now. A memory-bound kernel costs little more for 4 tokens than for 1: between and beyond
    the two, the cost is taken as linear in the tokens."""

    def __init__(self, h2d_bytes_per_s: float, cpu_s_1: float, cpu_s_4: float, blob_bytes: int, threads: int,
                 h2d_unpinned_bytes_per_s: float | None = None):
        self.h2d_bytes_per_s = h2d_bytes_per_s                          # from pinned memory
        self.h2d_unpinned_bytes_per_s = h2d_unpinned_bytes_per_s or h2d_bytes_per_s
        self.cpu_s_1, self.cpu_s_4 = cpu_s_1, max(cpu_s_4, cpu_s_1)
        self.blob_bytes = blob_bytes
        self.threads = threads

    def fetch_s(self, pinned: bool = True) -> float:
        return self.blob_bytes / (self.h2d_bytes_per_s if pinned else self.h2d_unpinned_bytes_per_s)

    def cpu_s(self, n_tokens: int) -> float:
        return self.cpu_s_1 + (self.cpu_s_4 - self.cpu_s_1) * (max(n_tokens, 1) - 1) / 3

    def prefer_cpu(self, n_tokens: int, pinned: bool = True) -> bool:
        return self.cpu_s(n_tokens) < self.fetch_s(pinned)

    def describe(self) -> str:
        h2d = f"H2D {self.h2d_bytes_per_s / 1e9:.1f} GB/s ({self.fetch_s() * 1e3:.2f} ms per expert)"
        if self.h2d_unpinned_bytes_per_s != self.h2d_bytes_per_s:
            h2d += (f", {self.h2d_unpinned_bytes_per_s / 1e9:.1f} GB/s from the mapped tier until it is pinned "
                    f"({self.fetch_s(False) * 1e3:.2f} ms)")
        return (f"{h2d}, CPU {self.cpu_s_1 * 1e3:.2f} ms per expert for 1 token, {self.cpu_s_4 * 1e3:.2f} for 4 "
                f"({self.threads} thread{'' if self.threads == 1 else 's'})")

    @classmethod
    def measure(cls, cache: ExpertCache, fmt: ExpertFormat, layout: BlobLayout, layer_id: int, dtype,
                worker: CpuWorker | None, limit: float | None = None) -> "CostModel":
        tier_s, pinned_s = cache.time_copies((layer_id, 0))
        h2d, h2d_tier = layout.blob_bytes / max(pinned_s, 1e-9), layout.blob_bytes / max(tier_s, 1e-9)
        n = cache.host.layers[layer_id].shape[0]
        experts = [e % n for e in range(1, 5)]          # distinct where the layer has them, not slot 0's
        if worker is not None:
            t1 = worker.time_experts(layer_id, experts[:2], 1)
            t4 = worker.time_experts(layer_id, experts[2:], 4)
            return cls(h2d, t1, t4, layout.blob_bytes, worker.threads, h2d_tier)
        times = []
        for tokens, group in ((1, experts[:2]), (4, experts[2:])):
            x = torch.zeros(tokens, layout.hidden, dtype=dtype)
            best = float("inf")
            for e in group:
                t0 = time.perf_counter()
                fmt.expert_forward(cache.host.blob((layer_id, e)), x, layout, limit)
                best = min(best, time.perf_counter() - t0)
            times.append(best)
        return cls(h2d, times[0], times[1], layout.blob_bytes, torch.get_num_threads(), h2d_tier)


TOKEN_ROUTED = "token"   # the predictor_by_distance label of experts known from the token ids (hash layers)


class OffloadedExperts(nn.Module):
    """The provider installed in each MoE layer: forwards to the shared runtime."""

    def __init__(self, runtime: "OffloadRuntime", layer_id: int):
        super().__init__()
        self.runtime = runtime
        self.layer_id = layer_id

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.runtime.forward(self.layer_id, x, ids, weights)


class OffloadRuntime:
    def __init__(self, host: HostStore, fmt: ExpertFormat, layout: BlobLayout, n_slots: int,
                 device: torch.device, dtype: torch.dtype, options: OffloadOptions = OffloadOptions(), plan=None,
                 log=None, limit: float | None = None):
        """limit: the experts' SwiGLU clamp (DeepSeek-V4's swiglu_limit; family.py)."""
        assert options.miss_policy in MISS_POLICIES, options.miss_policy
        self.host, self.fmt, self.layout, self.limit = host, fmt, layout, limit
        self.device, self.dtype = device, dtype
        self.options = options
        self.plan = plan                                  # the OffloadPlan that sized the pool, when known
        self.cache = ExpertCache(n_slots, host, device, make_policy(options.cache_policy))
        self.slots = self.cache.slots                     # the bookkeeping: pins, uses, the clock
        self.log = log or (lambda m: None)
        self.predictor: RoutePredictor | None = None
        self.observer = None                              # the model observer handle, once attached
        self.first_moe_layer = min(host.layers)           # a step starts at the first MoE layer
        self.known_ids: dict[int, list[list[int]]] = {}        # layer -> exact routing read after attention
        self.pending: dict[int, list[tuple[int, set[int]]]] = {}  # layer -> [(distance, predicted set)]
        self.prefetch_queue: list = []                    # predicted keys not yet issued, nearest first
        self.memory_checks = 0                            # 1 after a prefill, +1 per decode step up to 3
        self.memory_warned = False
        self.pinner = None                                # the background pinner of a mapped host tier, if any
        self.hot = None                                   # --cpu-mem below the tier: host_memory.HotExperts
        self.prefill_counts: dict[tuple[int, int], int] = {}
        self.uses = UseCounts()
        self.per_layer: dict[int, UseCounts] = {}
        self.predictor_counts: dict[int, list[int]] = {}  # distance -> [true positives, predicted, actual]
        self.kind_counts: dict[str, list[int]] = {}       # "hash" | "learned" layers -> the same
        self.token_tables: dict[int, torch.Tensor] = {}   # hash layer -> tid2eid [vocab, K] on the host (attach)
        self.announced: list[int] = []                    # the tokens announced for the forwards to come
        self.consumed: dict[int, int] = {}                # hash layer -> how many of them its forwards ran
        self.token_pins: set = set()                      # their experts' keys, pinned until their layer runs
        # decode through the fused MoE kernel (it has no SwiGLU clamp)
        self.fused = dispatch.use_kernels(device) and fmt.fused_kernel and limit is None
        self.slot_index = torch.arange(n_slots, dtype=torch.int32, device=device)   # slot i's entry: [i:i+1]
        # CPU tier with the compiled kernel: a decode step's experts in one kernel call (slots and CPU-assigned
        # misses alike), as the resident provider computes them
        self.one_call = device.type == "cpu" and not self.fused and cpu_experts.available(layout, limit)
        self.ptr_table = torch.zeros(max(t.shape[0] for t in host.layers.values()), dtype=torch.int64)
        # the fused kernel's expert -> slot table, one row per MoE layer: written on the host at placement (a numpy
        # view of pinned memory), the layer's row copied to the device before its kernel (no allocation per layer)
        self.table_row = {layer: i for i, layer in enumerate(sorted(host.layers))}
        cuda = device.type == "cuda"
        host_table = torch.full((len(self.table_row), self.ptr_table.shape[0]), -1, dtype=torch.int32,
                                pin_memory=cuda)
        self.slot_table_host, self.slot_table_np = host_table, host_table.numpy()
        self.slot_table = host_table.to(device) if cuda else host_table
        # on a device, CPU-assigned misses of decode steps run on a worker thread (the compiled kernel's layouts)
        self.worker = CpuWorker(host, layout, options.cpu_threads, limit) \
            if options.miss_policy != "fetch" and not self.one_call and CpuWorker.usable(layout, limit) else None
        self.cost = CostModel.measure(self.cache, fmt, layout, next(iter(host.layers)), dtype, self.worker, limit)

    # --- wiring --------------------------------------------------------------------------------
    def provider(self, layer_id: int) -> OffloadedExperts:
        return OffloadedExperts(self, layer_id)

    def attach(self, model) -> None:
        """Predict and prefetch after each of `model`'s attention layers (detach() undoes it)."""
        assert self.observer is None, "already attached"
        self.predictor = RoutePredictor(model, self.options.lookahead)
        self.observer = model.add_observer(on_layer=self.after_attention)
        self.token_tables = {layer: table.to("cpu", torch.int64) for layer, table in model.token_route_tables().items()
                             if layer in self.host.layers}

    def detach(self) -> None:
        if self.observer is not None:
            self.observer.remove()
            self.observer = None

    # --- prediction and prefetch ----------------------------------------------------------------
    def expect_tokens(self, tokens: list[int], more: bool = False) -> None:
        """The tokens the next main forwards run, from their first (more: after those announced before; an MTP
        draft): the hash layers' experts for them are known now, so they are pinned and prefetched at once, the
        nearest layer first and each layer's experts by their use in these tokens (a prompt's union)."""
        if not self.token_tables:
            return
        if not more:
            self.slots.unpin(self.token_pins)
            self.announced, self.token_pins = [], set()
            self.consumed = dict.fromkeys(self.token_tables, 0)
        self.announced += tokens
        known = []
        for layer, table in self.token_tables.items():
            experts, uses = table[torch.tensor(tokens)].flatten().unique(return_counts=True)
            known += [(layer, e) for _, e in sorted(zip((-uses).tolist(), experts.tolist()))]
        self.token_pins |= set(known)
        self.slots.pin(known)
        self.prefetch_queue = known + [k for k in self.prefetch_queue if k not in self.token_pins]
        self._prefetch()

    def _take_announced(self, layer_id: int, n: int) -> None:
        """Hash layer `layer_id` runs a forward of n tokens: the experts of its next n announced tokens are this
        forward's prediction (scored against what it uses); its pins go once nothing announced is left."""
        start = self.consumed.get(layer_id, 0)
        if start >= len(self.announced):
            return
        taken = self.announced[start:start + n]
        self.consumed[layer_id] = start + n
        if len(taken) == n:
            predicted = set(self.token_tables[layer_id][torch.tensor(taken)].flatten().tolist())
            self.pending.setdefault(layer_id, []).append((TOKEN_ROUTED, predicted))
        if start + n >= len(self.announced):
            self.token_pins = {k for k in self.token_pins if k[0] != layer_id}

    def after_attention(self, layer, h: torch.Tensor, routed=None) -> None:
        """The layer observer (model.Observers): routed is the layer's (router input, routing), computed for its
        feed-forward."""
        tokens = h.shape[0] * h.shape[1]
        if tokens > BULK_TOKENS:                     # prefill: the layer's experts are streamed in bulk; the hash
            self.prefetch_queue = [k for k in self.prefetch_queue if k in self.token_pins]   # layers' stay queued
            return
        predicted = self.predictor.predict(layer, h, routed)
        if not predicted:                            # a dense layer with no MoE layer in reach: keep what is queued
            self._prefetch()                         # (the next token's predictions) and issue more of it
            return
        pins: set = set(self.token_pins)
        for target, (distance, rows) in predicted.items():
            chosen = {e for row in rows for e in row}
            pins |= {(target, e) for e in chosen}
            if distance == 0:
                self.known_ids[target] = rows
            else:
                self.pending.setdefault(target, []).append((distance, chosen))
        self.slots.set_pins(pins)
        # nearest layers first (the next token's last); issued after this layer's demand copies (forward), a few
        # at a time (_prefetch), never evicting what is pinned or in flight
        ahead = [(target, e) for target, (distance, rows)
                 in sorted(predicted.items(), key=lambda kv: distance_order(kv[1][0]))
                 if distance != 0 for e in sorted({e for row in rows for e in row})]
        self.prefetch_queue = [k for k in self.prefetch_queue if k in self.token_pins] + ahead
        if not layer.is_moe:
            self._prefetch()                         # no demand copy follows in this layer

    def _prefetch(self) -> None:
        """Issue queued prefetches while fewer than PREFETCH_BATCH are on the copy engine (copies leave a stream
        in issue order and priority does not reorder queued DMA: a demand copy waits behind at most that many)."""
        queue, cache = self.prefetch_queue, self.cache
        i = 0
        while i < len(queue) and cache.prefetches_queued() < PREFETCH_BATCH:
            key = queue[i]
            i += 1
            if cache.lookup(key) is None and cache.load(key, "prefetch") is None:
                i = len(queue)                       # every slot is pinned or in flight
        del queue[:i]

    # --- the MoE of one layer -------------------------------------------------------------------
    def forward(self, layer_id: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        if layer_id == self.first_moe_layer:
            self.slots.advance()
            if 0 < self.memory_checks < 3 and n <= BULK_TOKENS:
                self.memory_checks += 1
                if self.memory_checks == 3:              # the second decode step starts: the first one is done
                    self.check_device_memory()
        rows = self.known_ids.pop(layer_id, None)
        if layer_id in self.token_tables:
            self._take_announced(layer_id, n)            # scored as this forward's prediction (never computed from)
        if rows is None or len(rows) != n:
            rows = ids.tolist()
        counts = self.per_layer.get(layer_id)
        if counts is None:
            counts = self.per_layer[layer_id] = UseCounts()
        if n > BULK_TOKENS:
            self._score_predictions(layer_id, {e for row in rows for e in row})
            return self._bulk(layer_id, x, ids, weights, rows, counts)
        used = sorted({e for row in rows for e in row})
        if n > 1:
            self._count_routing(layer_id, rows)          # a prompt's chunk (or a draft's check): ranks the experts
        self._score_predictions(layer_id, set(used))
        keys = [(layer_id, e) for e in used]
        self.slots.pin(keys)
        place = {e: self._place(layer_id, e, n, counts) for e in used}
        self._prefetch()                             # behind this layer's demand copies, not ahead of them
        on_cpu = {e for e, slot in place.items() if slot is None}
        job = self.worker.submit(layer_id, x, rows, on_cpu) if on_cpu and self.worker is not None else None
        if self.one_call:
            out = self._one_call(layer_id, x, ids, weights, place)
        elif self.fused:
            out = self._fused(layer_id, x, ids, weights, rows, place, job)
        else:
            def compute(e, xs):
                return job.expert(e, x.dtype) if job is not None and e in on_cpu else \
                    self._compute(place[e], layer_id, e, xs)
            out = combine_experts(compute, x, ids, weights, host_ids=rows)
        self.cache.release([s for s in place.values() if s is not None])
        self.slots.unpin(keys)                   # released: the slots may be reused once this compute is done
        self.cache.collect_copy_time()
        self._prefetch()                             # copies that finished meanwhile make room for more
        return out

    def _count_routing(self, layer_id: int, rows: list[list[int]]) -> None:
        counts = self.prefill_counts
        for row in rows:
            for e in row:
                counts[(layer_id, e)] = counts.get((layer_id, e), 0) + 1

    def _place(self, layer_id: int, e: int, n_tokens: int, counts: UseCounts) -> int | None:
        """Slot that will serve expert e (None: compute it on the CPU); updates hit/miss counters."""
        key = (layer_id, e)
        served = self.slots.use(key)
        if served is not None:
            self._count(counts, "prefetch_hits" if served == "prefetch_hit" else "hits")
            return self.slots.lookup(key)
        self._count(counts, "demand_misses")
        miss_policy = self.options.miss_policy
        if not (miss_policy == "cpu" or (miss_policy == "auto" and
                                         self.cost.prefer_cpu(n_tokens, self.host.is_pinned(key)))):
            slot = self.cache.load(key, "demand")
            if slot is None:                          # demand outranks predictions for later layers
                self.slots.keep_pins(layer_id)
                slot = self.cache.load(key, "demand")
            if slot is not None:
                return slot
        self._count(counts, "cpu_experts")
        return None

    def _compute(self, slot: int | None, layer_id: int, e: int, xs: torch.Tensor) -> torch.Tensor:
        if slot is None:
            host_in = xs.to("cpu", non_blocking=False)
            y = self.fmt.expert_forward(self.host.blob((layer_id, e)), host_in, self.layout, self.limit)
            return y.to(device=xs.device, dtype=xs.dtype)
        self.cache.wait(slot)
        if self.fused:                     # the kernels' format on a GPU: weights decoded in registers
            return fused_expert(xs, self.slot_index[slot:slot + 1], self.cache.pool, self.layout)
        return self.fmt.expert_forward(self.cache.slot_view(slot), xs, self.layout, self.limit).to(xs.dtype)

    def _one_call(self, layer_id, x, ids, weights, place) -> torch.Tensor:
        """CPU tier: every selected expert in one call of the CPU kernel, from its slot or (a CPU-assigned miss)
        its host blob: the call, order and bits of the resident provider (experts.BlobExperts)."""
        pool, host = self.cache.pool, self.host
        base, stride = pool.data_ptr(), pool.stride(0)
        ptrs = self.ptr_table
        ptrs.zero_()
        held = []           # host blobs read, held until the kernel returns: a layer swapped meanwhile stays mapped
        for e, slot in place.items():
            if slot is None:
                held.append(host.blob((layer_id, e)))
                ptrs[e] = held[-1].data_ptr()
            else:
                ptrs[e] = base + slot * stride
        return cpu_experts.cpu_experts_forward(x, ids, weights, pool, self.layout, ptrs=ptrs, limit=self.limit)

    def _fused(self, layer_id, x, ids, weights, rows, place, job: CpuJob | None) -> torch.Tensor:
        """Decode through the fused MoE kernel: resident experts read from their slots; CPU-computed misses
        enter as external outputs at their (token, k) positions, summed in the same ascending-id order."""
        i = self.table_row[layer_id]
        row = self.slot_table_np[i]
        for e, slot in place.items():                 # the kernel reads the entries of routed experts only
            if slot is None:
                row[e] = -1
            else:
                row[e] = slot
                self.cache.wait(slot)
        table = self.slot_table[i]
        if x.is_cuda:
            # Safe to reuse the pinned row: the host rewrites it only at this layer's next placement, after the
            # routing read of that step (a device sync), so this copy has run by then.
            table.copy_(self.slot_table_host[i], non_blocking=True)
        external = None
        if job is not None:
            external = job.pairs().to(x.dtype)
        elif any(slot is None for slot in place.values()):
            external = torch.zeros(x.shape[0], ids.shape[1], x.shape[1], dtype=x.dtype, device=x.device)
            for t, row in enumerate(rows):
                for k, e in enumerate(row):
                    if place[e] is None:
                        external[t, k] = self._compute(None, layer_id, e, x[t:t + 1])[0]
        return fused_moe(x, ids, weights, table, self.cache.pool, self.layout, external)

    def _bulk(self, layer_id, x, ids, weights, rows, counts) -> torch.Tensor:
        """Prefill: every expert this layer needs crosses once, streamed in ascending id with a few copies in
        flight ahead of compute; routing counts seed the cache afterwards."""
        used = sorted({e for row in rows for e in row})
        self._count_routing(layer_id, rows)
        per_expert = {e: 0 for e in used}
        for row in rows:
            for e in set(row):
                per_expert[e] += 1
        cache = self.cache
        place: dict[int, int | None] = {}

        def ensure(i: int) -> None:
            e = used[i]
            if e in place:
                return
            self.slots.pin([(layer_id, e)])
            place[e] = self._place(layer_id, e, per_expert[e], counts)

        def compute(e, xs):
            i = used.index(e)
            for j in range(i, min(i + 1 + BULK_WINDOW, len(used))):
                ensure(j)                              # keep copies in flight ahead of compute
            y = self._compute(place[e], layer_id, e, xs)
            if place[e] is not None:
                cache.release([place[e]])
            self.slots.unpin([(layer_id, e)])
            return y

        out = combine_experts(compute, x, ids, weights, host_ids=rows)
        cache.collect_copy_time()
        return out

    # --- warm start -----------------------------------------------------------------------------
    def check_device_memory(self) -> None:
        """CUDA: warn once when the allocator's peak passed the budget the plan was made for (checked after the
        first prefill and the first decode step; on CPU tests/test_budget.py measures the same)."""
        if self.device.type != "cuda" or self.plan is None or self.memory_warned:
            return
        peak = torch.cuda.max_memory_allocated(self.device)
        if peak > self.plan.budget:
            self.memory_warned = True
            self.log(f"warning: GPU memory peaked at {format_bytes(peak)}, above the {format_bytes(self.plan.budget)} "
                     f"planned for --gpu-mem: lower --gpu-mem or --ctx-size to keep to it")

    def end_prefill(self) -> None:
        """Seed the policy from the prompt's routing counts and fill free slots with its most used experts."""
        self.memory_checks = 1
        self.check_device_memory()
        counts, self.prefill_counts = self.prefill_counts, {}
        if not counts:
            return
        if self.hot is not None:
            self.hot.update(counts)                       # here nothing reads the host tier's pinned rows
        self.slots.seed({k: float(v) for k, v in counts.items()})
        free = len(self.slots.free)
        for key, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:free]:
            if self.cache.lookup(key) is None:
                self.cache.load(key, "seed")
        self.slots.set_pins(())

    # --- telemetry ------------------------------------------------------------------------------
    def _count(self, counts: UseCounts, field: str) -> None:
        setattr(counts, field, getattr(counts, field) + 1)
        setattr(self.uses, field, getattr(self.uses, field) + 1)

    def _score_predictions(self, layer_id: int, actual: set[int]) -> None:
        kind = "hash" if layer_id in self.token_tables else "learned"
        for distance, predicted in self.pending.pop(layer_id, []):
            for row in (self.predictor_counts.setdefault(distance, [0, 0, 0]),
                        self.kind_counts.setdefault(kind, [0, 0, 0])):
                row[0] += len(predicted & actual)
                row[1] += len(predicted)
                row[2] += len(actual)

    def close(self) -> None:
        """Stop the CPU worker (the runtime serves no more layers)."""
        self.detach()
        if self.worker is not None:
            self.worker.close()
        if self.hot is not None:
            self.hot.close()

    def reset_stats(self) -> None:
        self.cache.drain()
        self.cache.reset_counts()
        self.uses = UseCounts()
        self.per_layer = {}
        self.predictor_counts = {}
        self.kind_counts = {}
        self.pending = {}
        if self.worker is not None:
            self.worker.reset_counts()

    def stats(self) -> dict:
        """The `expert_cache` entry of the engine's stats (offload/stats.py)."""
        self.cache.collect_copy_time()
        return ExpertCacheStats.collect(
            self.uses, self.per_layer, self.cache.counts, self.predictor_counts, self.kind_counts,
            prefetches_wasted=self.slots.wasted_prefetches, evictions=self.slots.evictions,
            slots=self.slots.n_slots, resident_experts=len(self.slots), host_tier=self.host.mode,
            host_pinned_bytes=self.host.pinned_bytes,
            miss_policy=self.options.miss_policy, **self._worker_stats()).as_dict()

    def _worker_stats(self) -> dict:
        w = self.worker
        return {} if w is None else {"cpu_jobs": w.jobs, "cpu_ms": w.compute_s * 1e3, "cpu_wait_ms": w.wait_s * 1e3}
