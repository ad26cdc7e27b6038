"""Eviction policies for the global expert-slot pool, shared by the runtime and the trace simulator.

Keys are (layer, expert). A policy sees every use (`touch`), every load (`admit`) and every eviction
(`forget`), and picks a victim among the keys the caller says may be evicted. Decayed-frequency LFU is
the default; LRU and plain LFU are kept for comparison; Belady's MIN (offline optimum) needs the future
and lives in the simulator only.
"""
from __future__ import annotations

import math

Key = tuple[int, int]


class Policy:
    name = "base"

    def touch(self, key: Key, now: int) -> None:
        """`key` was used at step `now`."""

    def admit(self, key: Key, now: int) -> None:
        """`key` was loaded into a slot."""

    def forget(self, key: Key) -> None:
        """`key` left the pool."""

    def score(self, key: Key, now: int) -> float:
        raise NotImplementedError

    def victim(self, candidates, now: int) -> Key:
        """The evictable key to drop: lowest score, ties broken by key for determinism."""
        return min(candidates, key=lambda k: (self.score(k, now), k))

    def seed(self, counts: dict[Key, float], now: int) -> None:
        """Warm start from a popularity profile (e.g. prefill routing counts)."""


class LRU(Policy):
    name = "lru"

    def __init__(self):
        self.last: dict[Key, int] = {}
        self.tick = 0

    def touch(self, key, now):
        self.tick += 1
        self.last[key] = self.tick

    def admit(self, key, now):
        self.last.setdefault(key, self.tick)

    def forget(self, key):
        self.last.pop(key, None)

    def score(self, key, now):
        return self.last.get(key, -1)


class LFU(Policy):
    """Use counts that survive eviction (a key that returns keeps its history)."""
    name = "lfu"

    def __init__(self):
        self.count: dict[Key, float] = {}

    def touch(self, key, now):
        self.count[key] = self.count.get(key, 0.0) + 1.0

    def score(self, key, now):
        return self.count.get(key, 0.0)

    def seed(self, counts, now):
        for k, c in counts.items():
            self.count[k] = self.count.get(k, 0.0) + c


class DecayedLFU(Policy):
    """Frequency with fast exponential aging, discounted by how far ahead the key's layer is in the layer cycle.

    freq = sum over uses of 0.5 ** ((now - t_use) / half_life), `now` counting decode steps. Decode visits the
    MoE layers in order every token, so a key of the layer just used is needed again only after every other
    layer: score = freq / (1 + layer_discount * r / n), where r is the number of layers visited before the
    key's layer comes round again (0 for the next layer) and n the number of layers seen. Defaults measured on
    demo-model traces (benchmarks/cache_sim.py): fewer loads than LRU at every cache size from 10% to 50%,
    where plain frequency (long half-life, no layer term) lost to LRU below 25% on the demo's evenly balanced
    experts.
    """
    name = "decayed-lfu"

    def __init__(self, half_life: float = 2.0, layer_discount: float = 16.0):
        self.rate = math.log(2) / half_life
        self.layer_discount = layer_discount
        self.value: dict[Key, tuple[float, int]] = {}     # key -> (score at step t, t)
        self.layer = 0                                     # layer of the latest use
        self.n_layers = 1

    def _at(self, key, now) -> float:
        v, t = self.value.get(key, (0.0, now))
        return v * math.exp(-self.rate * (now - t))

    def touch(self, key, now):
        self.layer, self.n_layers = key[0], max(self.n_layers, key[0] + 1)
        self.value[key] = (self._at(key, now) + 1.0, now)

    def score(self, key, now):
        ahead = (key[0] - self.layer - 1) % self.n_layers
        return self._at(key, now) / (1.0 + self.layer_discount * ahead / self.n_layers)

    def seed(self, counts, now):
        for k, c in counts.items():
            self.value[k] = (self._at(k, now) + c, now)


POLICIES = {"decayed-lfu": DecayedLFU, "lru": LRU, "lfu": LFU}


def make_policy(name: str = "decayed-lfu") -> Policy:
    from ..errors import UserError

    try:
        return POLICIES[name]()
    except KeyError:
        raise UserError(f"unknown cache policy {name!r}: use {', '.join(POLICIES)}") from None
