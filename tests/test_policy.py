"""Eviction policies and the trace simulator on hand-made traces with known answers."""
from __future__ import annotations

import pytest

from dsv3lite.offload.policy import LFU, LRU, DecayedLFU, make_policy
from dsv3lite.offload.trace import Trace, simulate

# the textbook reference string; with 3 frames: MIN = 9 faults, LRU = 12
CLASSIC = [7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2, 1, 2, 0, 1, 7, 0, 1]


def single_key_trace(seq, layer=0):
    return Trace({}, [(i, [(layer, e)]) for i, e in enumerate(seq)], {})


def test_belady_on_the_classic_string():
    assert simulate(single_key_trace(CLASSIC), 3, "belady").demand_loads == 9


def test_lru_on_the_classic_string():
    assert simulate(single_key_trace(CLASSIC), 3, "lru").demand_loads == 12


@pytest.mark.parametrize("policy", ["lru", "lfu", "decayed-lfu"])
def test_no_policy_beats_belady(policy):
    import random

    rng = random.Random(0)
    seq = [min(int(rng.expovariate(0.3)), 15) for _ in range(400)]      # skewed popularity
    trace = single_key_trace(seq)
    for slots in (2, 4, 8):
        assert simulate(trace, slots, "belady").demand_loads <= simulate(trace, slots, policy).demand_loads


def test_frequency_keeps_a_popular_expert_through_a_scan():
    seq = ["A", "A", "A", "B", "C", "A"]
    ids = {"A": 0, "B": 1, "C": 2}
    trace = single_key_trace([ids[s] for s in seq])
    assert simulate(trace, 2, "lru").demand_loads == 4                 # C evicts A
    assert simulate(trace, 2, "lfu").demand_loads == 3                 # C evicts B
    assert simulate(trace, 2, "decayed-lfu").demand_loads == 3


def test_decay_lets_old_popularity_age_out():
    p = DecayedLFU(half_life=2.0)
    for t in range(5):
        p.touch((0, 0), t)                      # popular long ago
    for t in range(20, 22):
        p.touch((0, 1), t)                      # recently used twice
    assert p.victim([(0, 0), (0, 1)], 22) == (0, 0)
    q = LFU()
    for t in range(5):
        q.touch((0, 0), t)
    for t in range(20, 22):
        q.touch((0, 1), t)
    assert q.victim([(0, 0), (0, 1)], 22) == (0, 1)   # plain LFU never forgets


def test_keys_of_the_current_access_are_never_evicted():
    # one access touching 3 keys with 3 slots, then a 4th: the victim must come from the earlier access
    trace = Trace({}, [(0, [(0, 1), (0, 2), (0, 3)]), (1, [(0, 4), (0, 1)])], {})
    for policy in ("lru", "lfu", "decayed-lfu", "belady"):
        r = simulate(trace, 3, policy)
        assert r.demand_loads == 4, policy


def test_prefetch_counts_wasted_loads():
    # layer 0 predicts expert 9 for layer 1 (distance 1) but layer 1 uses expert 5
    trace = Trace({}, [(0, [(0, 1)]), (0, [(1, 5)])], {(0, 1): {1: {9}}})
    r = simulate(trace, 4, "lru", prefetch_distance=1)
    assert r.prefetch_loads == 1 and r.demand_loads == 2
    trace = Trace({}, [(0, [(0, 1)]), (0, [(1, 5)])], {(0, 1): {1: {5}}})
    r = simulate(trace, 4, "lru", prefetch_distance=1)
    assert r.prefetch_loads == 1 and r.demand_loads == 1 and r.wasted_prefetches == 0


def test_token_routed_layers_are_prefetched_exactly_at_each_step():
    """Layers routed by the token id (DeepSeek-V4's hash layers) are loaded at the start of their step, pinned until
    their layer runs (a learned layer's demand load cannot evict them), so they are never a demand miss; the counts
    per layer say so. Without them the same uses are demand misses."""
    steps = [[(0, 1), (0, 2)], [(1, 3)], [(2, 4)]], [[(0, 5), (0, 1)], [(1, 6)], [(2, 7)]]
    trace = Trace({}, [(s, keys) for s, layers in enumerate(steps) for keys in layers], {})
    plain = simulate(trace, 3, "decayed-lfu")
    exact = simulate(trace, 3, "decayed-lfu", token_layers=[0])
    assert plain.layers_sum([0]) == (4, 3, 0)               # (uses, demand loads, prefetch loads)
    assert exact.layers_sum([0]) == (4, 0, 3)
    assert exact.layers_sum([1, 2]) == plain.layers_sum([1, 2]) == (4, 4, 0)
    assert exact.uses == plain.uses == 8 and exact.demand_loads == 4
    assert simulate(trace, 3, "belady", token_layers=[0]).demand_loads == simulate(trace, 3, "belady").demand_loads


def test_unknown_policy_is_a_user_error():
    from dsv3lite.errors import UserError

    with pytest.raises(UserError):
        make_policy("random")
    assert isinstance(make_policy("lru"), LRU)


def test_decayed_lfu_evicts_the_layer_needed_last():
    p = DecayedLFU()
    for layer in (1, 2, 3, 4):                  # one decode step: layers 1..4 in order, one expert each
        p.touch((layer, 0), 0)
    # equal frequency: after layer 4, layer 1 comes next and layer 3 last (before 4 itself)
    assert p.victim([(1, 0), (2, 0), (3, 0)], 0) == (3, 0)
    p.touch((1, 0), 0)                          # now layer 1 was just used: it is needed last
    assert p.victim([(1, 0), (2, 0), (3, 0)], 0) == (1, 0)
