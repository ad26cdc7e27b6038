"""The slot table (offload/slots.py) against the scan-based bookkeeping it replaced, kept here as the reference:
randomized operation sequences for every policy, the simulator against the old simulator, and the runtime's
cache against the simulator on the same accesses."""
from __future__ import annotations

import math
import random

import pytest
import torch

from dsv3lite.offload.policy import LFU, LRU, POLICIES, make_policy
from dsv3lite.offload.slots import SlotTable
from dsv3lite.offload.trace import Trace, simulate


# --- the reference: the scan-based policies and bookkeeping as they were ----------------------------------

class OldLRU(LRU):
    """LRU and LFU kept their bookkeeping; what changed is how a victim is found (the scan below)."""

    def score(self, key, now):
        return self.order(key)


class OldLFU(LFU):
    def score(self, key, now):
        return self.order(key)


class OldDecayedLFU:
    """The exp-based decayed frequency as it was (the policy now keeps it in log space)."""

    def __init__(self, half_life=2.0, layer_discount=16.0):
        self.rate = math.log(2) / half_life
        self.layer_discount = layer_discount
        self.value, self.layer, self.n_layers = {}, 0, 1

    def _at(self, key, now):
        v, t = self.value.get(key, (0.0, now))
        return v * math.exp(-self.rate * (now - t))

    def touch(self, key, now):
        self.layer, self.n_layers = key[0], max(self.n_layers, key[0] + 1)
        self.value[key] = (self._at(key, now) + 1.0, now)

    def admit(self, key, now):
        pass

    def forget(self, key):
        pass

    def score(self, key, now):
        ahead = (key[0] - self.layer - 1) % self.n_layers
        return self._at(key, now) / (1.0 + self.layer_discount * ahead / self.n_layers)

    def seed(self, counts, now):
        for k, c in counts.items():
            self.value[k] = (self._at(k, now) + c, now)


OLD_POLICIES = {"lru": OldLRU, "lfu": OldLFU, "decayed-lfu": OldDecayedLFU}


class ScanTable:
    """The old ExpertCache bookkeeping: first free slot by scan, victim = min score over every evictable key
    (benchmarks/slot_bench.py times it against the slot table)."""

    def __init__(self, n_slots, policy):
        self.policy, self.n_slots, self.now = policy, n_slots, 0
        self.key_of = [None] * n_slots
        self.slot_of, self.pins, self.in_flight = {}, set(), set()
        self.kind, self.used = [""] * n_slots, [False] * n_slots
        self.evictions = self.wasted_prefetches = 0

    def advance(self, now=None):
        self.now = self.now + 1 if now is None else now

    def set_pins(self, keys):
        self.pins = set(keys)

    def use(self, key):
        self.policy.touch(key, self.now)
        slot = self.slot_of.get(key)
        if slot is None:
            return None
        served = "prefetch_hit" if self.kind[slot] == "prefetch" and not self.used[slot] else "hit"
        self.used[slot] = True
        return served

    def allocate(self, key, kind, in_flight=False):
        if len(self.slot_of) < self.n_slots:
            slot = self.key_of.index(None)
        else:
            candidates = [k for k in self.slot_of if k not in self.pins and k not in self.in_flight]
            if not candidates:
                return None
            victim = min(candidates, key=lambda k: (self.policy.score(k, self.now), k))
            slot = self.slot_of.pop(victim)
            if self.kind[slot] == "prefetch" and not self.used[slot]:
                self.wasted_prefetches += 1
            self.evictions += 1
            self.policy.forget(victim)
        self.key_of[slot], self.slot_of[key] = key, slot
        self.kind[slot], self.used[slot] = kind, kind == "demand"
        if in_flight:
            self.in_flight.add(key)
        self.policy.admit(key, self.now)
        return slot

    def seed(self, counts):
        self.policy.seed(counts, self.now)


def ref_simulate(trace, slots, policy, prefetch_distance=0):
    """The old simulator (dict of resident keys, scan victims), LRU / LFU / decayed-LFU, with the runtime's pins:
    the keys predicted for the layers ahead are pinned with the current ones (demand loads may unpin them)."""
    pol = OLD_POLICIES[policy]()
    resident = {}
    out = {"uses": 0, "demand": 0, "prefetch": 0, "wasted": 0}

    def load(key, now, pinned, prefetched):
        if len(resident) >= slots:
            candidates = [k for k in resident if k not in pinned]
            if not candidates:
                return False
            victim = min(candidates, key=lambda k: (pol.score(k, now), k))
            if resident.pop(victim):
                out["wasted"] += 1
            pol.forget(victim)
        resident[key] = prefetched
        pol.admit(key, now)
        return True

    for step, keys in trace.accesses:
        want = []
        if prefetch_distance and keys:
            layer = keys[0][0]
            for d in range(1, prefetch_distance + 1):
                want += sorted((layer + d, e) for e in trace.predictions.get((step, layer + d), {}).get(d, ()))
        pinned = set(keys) | set(want)          # the runtime pins predicted keys with the current ones
        for key in keys:
            out["uses"] += 1
            pol.touch(key, step)
            if key in resident:
                resident[key] = False
            else:
                out["demand"] += 1
                if not load(key, step, pinned, False):
                    load(key, step, set(keys), False)     # demand outranks predictions
        for key in want:
            if key not in resident and load(key, step, pinned, True):
                out["prefetch"] += 1
    return out, tuple(sorted(resident))


# --- randomized runs against the reference ---------------------------------------------------------------

def zipf_expert(rng, n_experts):
    return min(int(rng.paretovariate(1.2)) - 1, n_experts - 1)


def zipf_key(rng, n_layers, n_experts):
    return (rng.randrange(n_layers), zipf_expert(rng, n_experts))


def zipf_row(rng, n_experts, top_k):
    """top_k distinct experts of one token, skewed towards low ids."""
    row = set()
    while len(row) < top_k:
        row.add(zipf_expert(rng, n_experts))
    return sorted(row)


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("seed", range(6))
def test_slot_table_matches_the_scan_reference(policy, seed):
    rng = random.Random(seed)
    n_slots, n_layers, n_experts = rng.choice([1, 3, 8, 17]), rng.randint(1, 6), 12
    new, ref = SlotTable(n_slots, make_policy(policy)), ScanTable(n_slots, OLD_POLICIES[policy]())
    key = lambda: zipf_key(rng, n_layers, n_experts)
    for op in range(400):
        r = rng.random()
        if r < 0.08:
            now = new.now + rng.choice([0, 1, 1, 2])
            new.advance(now)
            ref.advance(now)
        elif r < 0.45:
            k = key()
            assert new.use(k) == ref.use(k), (op, k)
        elif r < 0.7:
            k = key()
            if k not in ref.slot_of:
                kind, fly = rng.choice(["demand", "prefetch", "seed"]), rng.random() < 0.2
                assert new.allocate(k, kind, fly) == ref.allocate(k, kind, fly), (op, k)
        elif r < 0.78:
            keys = [key() for _ in range(rng.randint(0, 4))]
            new.set_pins(keys)
            ref.set_pins(keys)
        elif r < 0.84:
            keys = [key() for _ in range(2)]
            new.pin(keys)
            ref.pins |= set(keys)
        elif r < 0.88:
            keys = list(ref.pins)[:2]
            new.unpin(keys)
            ref.pins -= set(keys)
        elif r < 0.9:
            layer = rng.randrange(n_layers)
            new.keep_pins(layer)
            ref.pins = {k for k in ref.pins if k[0] == layer}
        elif r < 0.97:
            if ref.in_flight:
                k = rng.choice(sorted(ref.in_flight))
                new.mark_ready(k)
                ref.in_flight.discard(k)
        else:
            counts = {key(): float(rng.randint(1, 5)) for _ in range(3)}
            new.seed(counts)
            ref.seed(counts)
        assert new.slot_of == ref.slot_of and new.pins == ref.pins and new.in_flight == ref.in_flight, op
        assert (new.evictions, new.wasted_prefetches) == (ref.evictions, ref.wasted_prefetches), op
        if rng.random() < 0.3:
            new.check()
    new.check()
    assert ref.evictions > 0


def test_slot_table_invariants_are_asserted():
    table = SlotTable(2, make_policy("lru"))
    table.allocate((0, 1), "demand")
    with pytest.raises(AssertionError):
        table.allocate((0, 1), "demand")            # already resident
    table.set_pins([(0, 1)])
    table.allocate((0, 2), "prefetch", in_flight=True)
    assert table.allocate((0, 3), "demand") is None  # one key pinned, the other in flight
    table.mark_ready((0, 2))
    assert table.allocate((0, 3), "demand") == 1     # the prefetch, never used, is evicted
    assert table.wasted_prefetches == 1 and table.evictions == 1
    with pytest.raises(AssertionError):
        table.advance(-1)                           # the clock runs forward
    table.check()


def test_equal_scores_across_groups_go_to_the_lower_order_then_the_lower_key():
    import numpy as np

    from dsv3lite.offload.policy import Policy

    class Grouped(Policy):                          # order = expert id; layer 1 is biased by +0.5
        grouped = True

        def order(self, key):
            return float(key[1]) / 2

        def group(self, key):
            return key[0]

        def biases(self, n_groups):
            return np.array([0.0, 0.5, 0.0][:n_groups])

    table = SlotTable(4, Grouped())
    for key in [(0, 2), (1, 1), (2, 3), (0, 4)]:
        table.allocate(key, "demand")
    # scores: (0, 2) -> 1.0, (1, 1) -> 0.5 + 0.5 = 1.0, (2, 3) -> 1.5: a tie, won by the lower order
    assert table.victim() == (1, 1) == table.policy.victim(table.resident_keys())
    table.pin([(1, 1)])
    assert table.victim() == (0, 2)
    table.check()


def test_biases_that_rise_and_fall_in_any_pattern_give_the_scanned_victim():
    """The slot table caches which groups' biases fell per pair of bias tuples: a policy that cycles through a
    few tuples (cache hits) and one that makes new ones every time (misses), against the scan."""
    from dsv3lite.offload.policy import Policy

    class Cycling(Policy):                          # order = use count; the biases: one of `rows`, picked on touch
        grouped = True
        orders_grow = True

        def __init__(self, rows, fresh):
            self.count, self.rows, self.row, self.fresh = {}, rows, 0, fresh

        def touch(self, key, now):
            self.count[key] = self.count.get(key, 0.0) + 1.0
            self.row = (self.row + key[1]) % len(self.rows)

        def order(self, key):
            return self.count.get(key, 0.0)

        def group(self, key):
            return key[0]

        def biases(self, n_groups):
            row = self.rows[self.row][:n_groups]
            return tuple(list(row)) if self.fresh else row

    rng = random.Random(5)
    rows = [tuple(float(rng.randint(-3, 3)) for _ in range(4)) for _ in range(5)]
    for fresh in (False, True):
        table = SlotTable(6, Cycling(rows, fresh))
        for op in range(600):
            key = (rng.randrange(4), rng.randrange(5))
            if rng.random() < 0.5:
                table.use(key)
            elif key not in table:
                table.allocate(key, "demand", in_flight=rng.random() < 0.2)
            if rng.random() < 0.2:
                table.set_pins([(rng.randrange(4), rng.randrange(5)) for _ in range(2)])
            if table.in_flight and rng.random() < 0.3:
                table.mark_ready(sorted(table.in_flight)[0])
            table.check()
        assert table.evictions > 50


def random_trace(rng, n_steps, layers, n_experts, top_k, lookahead):
    accesses, predictions = [], {}
    for step in range(n_steps):
        for layer in layers:
            used = zipf_row(rng, n_experts, top_k)
            accesses.append((step, [(layer, e) for e in used]))
            for d in range(1, lookahead + 1):
                guess = set(used[:-1]) | {rng.randrange(n_experts)}
                predictions.setdefault((step, layer), {})[d] = guess
    return Trace({}, accesses, predictions)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_simulator_matches_the_old_simulator(policy):
    rng = random.Random(1)
    trace = random_trace(rng, 60, [1, 2, 3, 4, 5], 16, 4, 2)
    for slots in (4, 9, 20, 40):
        for d in (0, 1, 2):
            new = simulate(trace, slots, policy, prefetch_distance=d)
            old, resident = ref_simulate(trace, slots, policy, prefetch_distance=d)
            assert (new.uses, new.demand_loads, new.prefetch_loads, new.wasted_prefetches) == \
                (old["uses"], old["demand"], old["prefetch"], old["wasted"]), (slots, d)
            assert new.resident == resident, (slots, d)


def ref_belady(trace, slots):
    """The old MIN simulator: evict the resident key used farthest in the future (never the current access's)."""
    seq = [k for _, keys in trace.accesses for k in keys]
    next_use, last = {}, {}
    for pos in range(len(seq) - 1, -1, -1):
        next_use[pos], last[seq[pos]] = last.get(seq[pos], 1 << 60), pos
    resident, loads, pos = {}, 0, 0
    for _, keys in trace.accesses:
        for k in keys:
            if k not in resident:
                loads += 1
                if len(resident) >= slots:
                    del resident[max((c for c in resident if c not in keys), key=lambda c: (resident[c], c))]
            resident[k] = next_use[pos]
            pos += 1
    return loads


def test_belady_through_the_slot_table_matches_the_old_one_and_is_never_beaten():
    rng = random.Random(2)
    trace = random_trace(rng, 60, [1, 2, 3], 16, 4, 0)
    for slots in (4, 10, 24):
        best = simulate(trace, slots, "belady").demand_loads
        assert best == ref_belady(trace, slots)
        assert all(best <= simulate(trace, slots, p).demand_loads for p in POLICIES)


# --- the runtime's cache and the simulator on the same accesses ------------------------------------------

@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_runtime_cache_and_simulator_make_the_same_choices(policy):
    from dsv3lite.offload.cache import HostStore
    from dsv3lite.offload.options import OffloadOptions
    from dsv3lite.offload.runtime import OffloadRuntime
    from dsv3lite.quant.formats import get_format

    fmt = get_format("bf16")
    layout = fmt.layout(8, 16)
    layers, n_experts, top_k, n_slots = [1, 2, 3, 4], 12, 3, 9
    gen = torch.Generator().manual_seed(0)
    blobs = {l: torch.stack([fmt.pack(*(torch.randn(s, generator=gen) * 0.1 for s in ((8, 16), (8, 16), (16, 8))))
                             for _ in range(n_experts)]) for l in layers}
    rt = OffloadRuntime(HostStore(blobs, layout.blob_bytes, "memory"), fmt, layout, n_slots, torch.device("cpu"),
                        torch.float32, OffloadOptions(lookahead=0, miss_policy="fetch", cache_policy=policy))
    rng = random.Random(3)
    accesses = []
    for step in range(1, 41):                   # the runtime's clock starts a step at the first MoE layer
        for layer in layers:
            n = rng.choice([1, 1, 1, 2])        # decode steps and short verify forwards
            ids = torch.tensor([zipf_row(rng, n_experts, top_k) for _ in range(n)])
            rt.forward(layer, torch.randn(n, 16), ids, torch.full(ids.shape, 1.0 / top_k))
            accesses.append((step, [(layer, e) for e in sorted(set(ids.flatten().tolist()))]))
    sim = simulate(Trace({}, accesses, {}), n_slots, policy)
    s = rt.stats()
    assert s["demand_misses"] == sim.demand_loads > 0 and s["evictions"] == sim.evictions > 0
    assert s["hits"] + s["prefetch_hits"] + s["demand_misses"] == sim.uses
    assert tuple(sorted(rt.cache.resident_keys())) == sim.resident
    rt.slots.check()
