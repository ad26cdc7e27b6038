"""Slot bookkeeping of the expert cache, without tensors: expert key -> slot, free slots, pins, in-flight and
use marks, and the choice of a victim through the eviction policy.

Shared by the runtime's `ExpertCache` (which adds the pool, the copies and their events) and by the trace
simulator, so the two make the same choices. Every operation is O(1) or O(log n) in the pool size: resident
keys are indexed by the policy's order in one lazy min-heap per policy group (a layer for decayed-LFU), and a
victim is the best of the groups' tops, kept in a second heap of groups ranked by order + the policy's group
bias. Biases move as decode walks the layers (decayed-LFU: every layer, up for most groups): an entry whose
bias rose since it was scored is a lower bound, rescored only when it reaches the top; entries whose bias
fell are rescored at once (in decode, one group per layer; which groups fell is cached per pair of bias
tuples, so no step compares every group). A group whose entry is at the top of the ranked heap (the last
victim's, usually) is rescored in place. Pinned and in-flight keys are kept off the heaps lazily: set aside
when they surface (or when they are loaded unevictable), pushed back at their current order when they become
evictable again. Stale heap entries are dropped when they surface and a heap is rebuilt when stale entries
outnumber live ones.
"""
from __future__ import annotations

import math
from heapq import heapify, heappop, heappush, heapreplace
from itertools import compress
from operator import add, lt

from .policy import Key, Policy

KINDS = ("demand", "prefetch", "seed")       # why a slot was filled


class _Group:
    """Resident keys of one policy group: a min-heap of (order, key) with stale entries, the indexed orders (for
    a policy whose orders grow, at most the current ones), and the keys set aside, off the heap, while they
    could not be evicted."""
    __slots__ = ("heap", "order", "blocked")

    def __init__(self):
        self.heap: list[tuple[float, Key]] = []
        self.order: dict[Key, float] = {}
        self.blocked: set[Key] = set()


class SlotTable:
    def __init__(self, n_slots: int, policy: Policy):
        assert n_slots > 0, "an expert cache needs at least one slot"
        self.policy = policy
        self.n_slots = n_slots
        self.now = 0                                   # the policy's clock (decode steps)
        self.key_of: list[Key | None] = [None] * n_slots
        self.slot_of: dict[Key, int] = {}
        self.free: list[int] = list(range(n_slots - 1, -1, -1))   # a stack: lowest slot first
        self.pins: set[Key] = set()                    # never evicted (being used or predicted soon)
        self.in_flight: set[Key] = set()               # resident keys whose copy may still be running
        self.unused_prefetch: set[Key] = set()         # loaded by a prefetch, not used since
        self.evictions = 0
        self.wasted_prefetches = 0                     # evicted before any use
        self._groups: list[_Group] = []
        self._top_order: list[float] = []              # per group: order of its best evictable key (inf: none)
        self._top_key: list[Key | None] = []           # per group: that key
        self._entry: list[tuple | None] = []           # per group: (score, order, key, group) as ranked
        self._ranked: list[tuple] = []                 # heap of the groups' entries, stale ones included
        self._scored: list[float] = []                 # per group: the bias its entry was scored with
        self._dirty: set[int] = set()                  # groups whose best key must be recomputed
        self._biases: tuple[float, ...] = ()           # the policy's group biases at the last victim()
        self._fallen_cache: dict[tuple[int, int], tuple] = {}   # see _fallen
        self._admit = policy.admit if type(policy).admit is not Policy.admit else None    # None: a no-op
        self._forget = policy.forget if type(policy).forget is not Policy.forget else None

    # --- queries -------------------------------------------------------------------------------------
    def lookup(self, key: Key) -> int | None:
        return self.slot_of.get(key)

    def __contains__(self, key: Key) -> bool:
        return key in self.slot_of

    def __len__(self) -> int:
        return len(self.slot_of)

    @property
    def full(self) -> bool:
        return not self.free

    def resident_keys(self) -> list[Key]:
        return list(self.slot_of)

    def evictable(self, key: Key) -> bool:
        return key in self.slot_of and key not in self.pins and key not in self.in_flight

    # --- time and uses -------------------------------------------------------------------------------
    def advance(self, now: int | None = None) -> None:
        """Move the policy's clock to `now` (default: the next step)."""
        now = self.now + 1 if now is None else now
        assert now >= self.now, f"the clock runs forward ({self.now} -> {now})"
        self.now = now

    def use(self, key: Key) -> str | None:
        """Record a use of `key` (resident or not) -> "hit", "prefetch_hit" (first use of a prefetched slot) or
        None when it is not resident."""
        self.policy.touch(key, self.now)
        if key not in self.slot_of:
            return None
        self._reordered(key)
        if key in self.unused_prefetch:
            self.unused_prefetch.discard(key)
            return "prefetch_hit"
        return "hit"

    def seed(self, counts: dict[Key, float]) -> None:
        """Warm start the policy from a popularity profile (resident keys are re-indexed)."""
        self.policy.seed(counts, self.now)
        for key in counts:
            if key in self.slot_of:
                self._reordered(key)

    # --- pins and in-flight marks --------------------------------------------------------------------
    def pin(self, keys) -> None:
        for key in keys:
            if key not in self.pins:
                self.pins.add(key)
                self._block(key)

    def unpin(self, keys) -> None:
        for key in keys:
            if key in self.pins:
                self.pins.discard(key)
                if key not in self.in_flight:
                    self._unblock(key)

    def set_pins(self, keys) -> None:
        """Pin exactly `keys` (any iterable of keys)."""
        old, new = self.pins, set(keys)
        self.pins = new
        for key in old - new:
            if key not in self.in_flight:
                self._unblock(key)
        for key in new - old:
            self._block(key)

    def keep_pins(self, layer: int) -> None:
        """Unpin every key outside `layer` (a demand load of that layer outranks predictions for later ones)."""
        self.set_pins([k for k in self.pins if k[0] == layer])

    def mark_ready(self, key: Key) -> None:
        """The copy into `key`'s slot has finished (idempotent)."""
        if key in self.in_flight:
            self.in_flight.discard(key)
            if key not in self.pins:
                self._unblock(key)

    # --- loading -------------------------------------------------------------------------------------
    def victim(self) -> Key | None:
        """The resident key the policy evicts next (never pinned, never in flight); None when there is none."""
        n = len(self._groups)
        if n == 0:
            return None
        if not self.policy.grouped:
            if self._dirty:
                self._refresh_tops()
            return self._top_key[0]
        biases = self.policy.biases(n)
        ranked, entry, scored = self._ranked, self._entry, self._scored
        changed = self._refresh_tops() if self._dirty else []     # groups to rescore: entry stale or too high
        if biases is not self._biases:
            if len(scored) != n:                       # new groups: rank every group afresh
                self._scored = scored = list(biases)
                self._entry = entry = list(zip(map(add, self._top_order, biases), self._top_order, self._top_key,
                                               range(n)))
                self._ranked = ranked = entry.copy()
                heapify(ranked)
                changed = ()
            else:                                      # groups whose bias fell below their score's
                for g in self._fallen(self._biases, biases):
                    if biases[g] < scored[g]:
                        changed.append(g)
            self._biases = biases
        if changed:
            top_order, top_key = self._top_order, self._top_key
            for g in changed:                          # a group twice in `changed`: rescored twice, no harm
                o = top_order[g]
                b = scored[g] = biases[g]
                old = entry[g]
                new = entry[g] = (o + b, o, top_key[g], g)
                if ranked[0] is old:                   # the last victim's group, usually: replace it in place
                    if len(ranked) > 2 and new < ranked[1] and new < ranked[2]:
                        ranked[0] = new                # still the best: no sifting
                    else:
                        heapreplace(ranked, new)
                else:
                    heappush(ranked, new)
        if len(ranked) > 2 * n + 16:
            self._ranked = ranked = entry.copy()
            heapify(ranked)
        while True:                                    # every group's current entry is on the heap
            best = ranked[0]
            g = best[3]
            if entry[g] is not best:
                heappop(ranked)                        # stale: that group's top changed since
            elif scored[g] != biases[g]:               # a lower bound (its bias rose since): score it now
                o = best[1]
                b = scored[g] = biases[g]
                best = entry[g] = (o + b, o, best[2], g)
                if len(ranked) > 2 and best < ranked[1] and best < ranked[2]:
                    ranked[0] = best
                    return best[2]
                heapreplace(ranked, best)
            else:
                return best[2]                         # None: no group has an evictable key

    def _fallen(self, old, new) -> list[int]:
        """The groups whose bias is lower in `new` than in `old` (both as the policy returned them). A policy
        cycles through a few bias tuples (decayed-LFU: one per latest layer, and one group falls per step), so
        the answer is cached per pair of tuple objects; the cache holds both, so their ids are not reused."""
        if type(old) is not tuple or type(new) is not tuple:
            return list(compress(range(len(new)), map(lt, new, old)))
        cache = self._fallen_cache
        hit = cache.get((id(old), id(new)))
        if hit is None:
            if len(cache) >= 4096:                     # a policy that makes new tuples: bound the cache
                cache.clear()
            hit = cache[id(old), id(new)] = (old, new, list(compress(range(len(new)), map(lt, new, old))))
        return hit[2]

    def allocate(self, key: Key, kind: str, in_flight: bool = False) -> int | None:
        """A slot for `key`: a free one, else the victim's (evicted here); None when every resident key is
        pinned or in flight. `in_flight`: its copy is still running (mark_ready ends it)."""
        slot_of = self.slot_of
        assert key not in slot_of, f"{key} is already resident"
        assert kind in KINDS, kind
        if self.free:
            slot = self.free.pop()
        else:
            victim = self.victim()
            if victim is None:
                return None
            slot = self._evict(victim)
        assert self.key_of[slot] is None
        self.key_of[slot] = key
        slot_of[key] = slot
        if kind == "prefetch":
            self.unused_prefetch.add(key)
        if in_flight:
            self.in_flight.add(key)
        if self._admit is not None:
            self._admit(key, self.now)
        self._index_add(key)
        return slot

    def _evict(self, key: Key) -> int:
        assert key not in self.pins and key not in self.in_flight, f"{key} is pinned or in flight"
        slot = self.slot_of.pop(key)
        self.key_of[slot] = None
        if key in self.unused_prefetch:
            self.unused_prefetch.discard(key)
            self.wasted_prefetches += 1
        self.evictions += 1
        if self._forget is not None:
            self._forget(key)
        g = self.policy.group(key)
        grp = self._groups[g]
        del grp.order[key]
        grp.blocked.discard(key)
        self._dirty.add(g)
        return slot

    def reset_counts(self) -> None:
        self.evictions = self.wasted_prefetches = 0

    # --- the victim index ----------------------------------------------------------------------------
    # Each group caches its best evictable key (_top_order, _top_key) and its ranked entry (score, order, key,
    # group); the cache stays valid until a change could alter that best key, which marks the group dirty for
    # the next victim() to recompute from its heap. With a policy whose orders only grow while a key is
    # resident, a use does not touch the heap: a key's entry is refreshed when it surfaces at the top.
    def _group(self, g: int) -> _Group:
        while g >= len(self._groups):
            self._groups.append(_Group())
            self._top_order.append(math.inf)
            self._top_key.append(None)
            self._entry.append(None)
        return self._groups[g]

    def _index_add(self, key: Key) -> None:
        g = self.policy.group(key)
        groups = self._groups
        grp = groups[g] if g < len(groups) else self._group(g)
        order = grp.order[key] = self.policy.order(key)
        if key in self.pins or key in self.in_flight:
            grp.blocked.add(key)                       # set aside: on the heap when it becomes evictable
        else:
            self._push(grp, order, key)
            self._dirty_if_better(g, order, key)

    def _reordered(self, key: Key) -> None:
        """The resident `key` was used or seeded: its order changed."""
        g = self.policy.group(key)
        if self._top_key[g] == key:
            self._dirty.add(g)
        if self.policy.orders_grow:
            return                                     # it grew: refreshed when it surfaces
        grp = self._groups[g]
        order = self.policy.order(key)
        if grp.order[key] != order:
            grp.order[key] = order
            if key not in grp.blocked:
                self._push(grp, order, key)
            if key not in self.pins and key not in self.in_flight:
                self._dirty_if_better(g, order, key)

    def _dirty_if_better(self, g: int, order: float, key: Key) -> None:
        top = self._top_order[g]                       # inf when the group has no evictable key
        if order < top or (order == top and key < self._top_key[g]):
            self._dirty.add(g)

    @staticmethod
    def _push(grp: _Group, order: float, key: Key) -> None:
        heappush(grp.heap, (order, key))
        if len(grp.heap) > 2 * len(grp.order) + 32:          # mostly stale: rebuild from the live orders
            grp.heap = [(o, k) for k, o in grp.order.items() if k not in grp.blocked]
            heapify(grp.heap)

    def _block(self, key: Key) -> None:
        """`key` just became unevictable: only its group's cached top can be affected."""
        if key in self.slot_of:
            g = self.policy.group(key)
            if self._top_key[g] == key:
                self._dirty.add(g)

    def _unblock(self, key: Key) -> None:
        """`key` just became evictable: back on its heap if it was set aside; it may be its group's best."""
        if key in self.slot_of:
            g = self.policy.group(key)
            grp = self._groups[g]
            if key in grp.blocked:                     # back on the heap, at its current order
                grp.blocked.discard(key)
                order = grp.order[key] = self.policy.order(key)
                self._push(grp, order, key)
            else:
                order = grp.order[key]
            self._dirty_if_better(g, order, key)

    def _refresh_tops(self) -> list[int]:
        """Find the best evictable key of every dirty group (the dirty set is emptied) -> the groups whose best
        key changed."""
        groups, top_order, top_key = self._groups, self._top_order, self._top_key
        pins, in_flight, order = self.pins, self.in_flight, self.policy.order
        changed = []
        for g in self._dirty:
            grp = groups[g]
            heap, indexed = grp.heap, grp.order
            while heap:
                o, k = heap[0]
                if indexed.get(k) != o:
                    heappop(heap)                       # stale: evicted or re-indexed since
                elif k in pins or (in_flight and k in in_flight):
                    heappop(heap)
                    grp.blocked.add(k)                  # back on the heap when it becomes evictable
                else:
                    current = order(k)
                    if current == o:
                        break
                    indexed[k] = current                # used since it was indexed: re-index it now
                    heapreplace(heap, (current, k))
            else:
                o, k = math.inf, None                   # no evictable key
            if o != top_order[g] or k != top_key[g]:
                top_order[g], top_key[g] = o, k
                changed.append(g)
        self._dirty.clear()
        return changed

    # --- invariants ----------------------------------------------------------------------------------
    def check(self) -> None:
        """Assert every invariant (O(n): for tests and debugging)."""
        assert len(self.slot_of) + len(self.free) == self.n_slots
        assert len(set(self.free)) == len(self.free) and all(self.key_of[s] is None for s in self.free)
        assert all(self.key_of[s] == k for k, s in self.slot_of.items())
        assert self.unused_prefetch <= self.slot_of.keys() and self.in_flight <= self.slot_of.keys()
        indexed, policy = {}, self.policy
        for g, grp in enumerate(self._groups):
            live = {(o, k) for o, k in grp.heap if grp.order.get(k) == o}
            for k, o in grp.order.items():
                assert policy.group(k) == g, k
                assert o <= policy.order(k) if policy.orders_grow else o == policy.order(k), f"{k} mis-indexed"
                assert k in grp.blocked or (o, k) in live, f"{k} is neither on its heap nor set aside"
            assert all(k in grp.order and not self.evictable(k) for k in grp.blocked if (grp.order[k], k) not in live)
            if g not in self._dirty:
                best = min(((policy.order(k), k) for k in grp.order if self.evictable(k)), default=(math.inf, None))
                assert best == (self._top_order[g], self._top_key[g]), f"group {g}: cached best is stale"
            indexed.update(grp.order)
        assert indexed.keys() == self.slot_of.keys()
        candidates = [k for k in self.slot_of if self.evictable(k)]
        expected = self.policy.victim(candidates) if candidates else None
        assert self.victim() == expected, f"indexed victim {self.victim()} != scanned {expected}"
