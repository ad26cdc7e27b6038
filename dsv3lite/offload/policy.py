"""Eviction policies for the global expert-slot pool, shared by the runtime and the trace simulator.

Keys are (layer, expert). A policy sees every use (`touch`), every load (`admit`) and every eviction
(`forget`), and defines an eviction order; the slot table (offload/slots.py) indexes resident keys by it, so
choosing a victim never scans the pool. Decayed-frequency LFU is the default; LRU and plain LFU are kept for
comparison; Belady's MIN (offline optimum) needs the future and lives in the simulator only.

The order: `order(key)` is a number that changes only when the key is touched or seeded (never with time),
compared within the key's `group(key)`; across groups the policy adds a per-group `biases()` offset. The victim
is the key with the lowest `priority(key)` = (order + bias of its group, order, key), ties broken by key.
A new policy is one class here plus one line in POLICIES.
"""
from __future__ import annotations

import math
from operator import itemgetter

Key = tuple[int, int]


class _Orders(dict):
    """key -> order, `default` for a key without one (not stored): its `__getitem__` is a policy's `order`, a C
    callable (the slot table asks for orders on every load)."""
    __slots__ = ("default",)

    def __init__(self, default):
        super().__init__()
        self.default = default

    def __missing__(self, key):
        return self.default


class Policy:
    name = "base"
    grouped = False         # True: orders compare within a group only, groups through biases()
    orders_grow = False     # True: a resident key's order never decreases (the slot table re-indexes lazily)

    def touch(self, key: Key, now: int) -> None:
        """`key` was used at step `now`."""

    def admit(self, key: Key, now: int) -> None:
        """`key` was loaded into a slot."""

    def forget(self, key: Key) -> None:
        """`key` left the pool."""

    def seed(self, counts: dict[Key, float], now: int) -> None:
        """Warm start from a popularity profile (e.g. prefill routing counts)."""

    def order(self, key: Key) -> float:
        """Eviction order within the key's group (lower: evicted first); changes only on touch/seed."""
        raise NotImplementedError

    group = ().count        # key -> its group, here 0 for every key (a C callable: the slot table asks on every use)

    def biases(self, n_groups: int) -> tuple[float, ...]:
        """Per-group offsets added to the order when groups are compared (grouped policies only). A grouped
        policy returns the same tuple object while they do not change: the slot table re-ranks its groups
        when it gets a new one."""
        return (0.0,) * n_groups

    def priority(self, key: Key) -> tuple:
        """The full eviction order (lowest: the victim), as the slot table's index computes it."""
        g = self.group(key)
        o = self.order(key)
        return (o + self.biases(g + 1)[g], o, key)

    def victim(self, candidates, now: int | None = None) -> Key:
        """The key to drop among explicit `candidates` (a scan; the slot table uses its index instead)."""
        return min(candidates, key=self.priority)


class LRU(Policy):
    name = "lru"
    orders_grow = True

    def __init__(self):
        self.last: dict[Key, int] = _Orders(-1)
        self.order = self.last.__getitem__      # -1: never used
        self.tick = 0

    def touch(self, key, now):
        self.tick += 1
        self.last[key] = self.tick

    def admit(self, key, now):
        self.last.setdefault(key, self.tick)

    def forget(self, key):
        self.last.pop(key, None)


class LFU(Policy):
    """Use counts that survive eviction (a key that returns keeps its history)."""
    name = "lfu"
    orders_grow = True

    def __init__(self):
        self.count: dict[Key, float] = _Orders(0.0)
        self.order = self.count.__getitem__     # 0.0: never used

    def touch(self, key, now):
        self.count[key] = self.count.get(key, 0.0) + 1.0

    def seed(self, counts, now):
        for k, c in counts.items():
            self.count[k] = self.count.get(k, 0.0) + c


def _log_add(a: float, b: float) -> float:
    """log(exp(a) + exp(b)) without overflow (a or b may be -inf)."""
    if a < b:
        a, b = b, a
    return a if b == -math.inf else a + math.log1p(math.exp(b - a))


class DecayedLFU(Policy):
    """Frequency with fast exponential aging, discounted by how far ahead the key's layer is in the layer cycle.

    freq = sum over uses of 0.5 ** ((now - t_use) / half_life), `now` counting decode steps. Decode visits the
    MoE layers in order every token, so a key of the layer just used is needed again only after every other
    layer: score = freq / (1 + layer_discount * r / n), where r is the number of layers visited before the
    key's layer comes round again (0 for the next layer) and n the number of layers seen. Defaults measured on
    demo-model traces (benchmarks/cache_sim.py): fewer loads than LRU at every cache size from 10% to 50%,
    where plain frequency (long half-life, no layer term) lost to LRU below 25% on the demo's evenly balanced
    experts.

    Kept in log space: order = log(sum over uses of exp(rate * t_use)) = log(freq) + rate * now, which aging
    does not change (it shifts every key alike), so keys of one layer keep their order as time passes; the
    layer term is the group bias -log(1 + layer_discount * r / n). Groups are layers.
    """
    name = "decayed-lfu"
    grouped = True
    orders_grow = True

    def __init__(self, half_life: float = 2.0, layer_discount: float = 16.0):
        self.rate = math.log(2) / half_life
        self.layer_discount = layer_discount
        self.mass: dict[Key, float] = _Orders(-math.inf)   # key -> log(sum of exp(rate * t_use)); absent: never used
        self.order = self.mass.__getitem__    # -inf when never used
        self.layer = 0                        # layer of the latest use
        self.n_layers = 1
        self._rows_shape = (0, 0)            # (n_layers, n_groups) the rows below were built for
        self._rows: list[tuple[float, ...]] = []   # per latest layer: the group biases

    def touch(self, key, now):
        layer = self.layer = key[0]
        if layer >= self.n_layers:
            self.n_layers = layer + 1
        t, m = self.rate * now, self.mass.get(key)
        self.mass[key] = t if m is None else _log_add(m, t)

    def seed(self, counts, now):
        for k, c in counts.items():
            if c > 0:
                self.mass[k] = _log_add(self.mass.get(k, -math.inf), math.log(c) + self.rate * now)

    group = itemgetter(0)       # the layer (a C callable: the slot table asks on every use)

    def biases(self, n_groups):
        n = self.n_layers
        if self._rows_shape != (n, n_groups):
            self._rows_shape = (n, n_groups)
            self._rows = [tuple(-math.log(1.0 + self.layer_discount * ((g - latest - 1) % n) / n)
                                for g in range(n_groups)) for latest in range(n)]
        return self._rows[self.layer]


POLICIES = {"decayed-lfu": DecayedLFU, "lru": LRU, "lfu": LFU}


def make_policy(name: str = "decayed-lfu") -> Policy:
    from ..errors import UserError

    try:
        return POLICIES[name]()
    except KeyError:
        raise UserError(f"unknown cache policy {name!r}: use {', '.join(POLICIES)}") from None
