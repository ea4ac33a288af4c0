"""The default policy's probation classes (scheduler/eviction/slru.py): entries stored by requests that shared no
prefix with anything cached ("unshared": one-shot prompts, first turns) and the others, weighed by a bias that ghost
hits move. Through TierIndex, the policy alone, and the scheduler side on vLLM's real scheduler (which requests are
marked unshared, and a re-offer making an entry shared)."""

import random

from offload_bench.sim.custom import build_custom
from offload_bench.sim.driver import SchedulerDriver
from offload_bench.sim.requests import make_request, tokens
from offload_bench.sim.scenarios import connector_config
from offload_bench.sim.tagcopy import TagCopier
from offload_connector.scheduler.eviction import SegmentedLRUPolicy
from offload_connector.scheduler.tier_index import TierIndex


def store(tier, ks, unshared=False):
    got = tier.begin_store(ks, unshared=unshared)
    tier.finish_store([k for k, _ in got])
    return [k for k, _ in got]


def ks(tag, n):
    return [(0, f"{tag}{i}") for i in range(n)]


def victims(tier, n, tag):
    """Stores `n` new shared keys one by one and returns the entries they evicted, in order."""
    removed = []
    tier.on_removed = removed.append
    for i in range(n):
        store(tier, [(0, f"{tag}{i}")])
    tier.on_removed = None
    return removed


def test_without_ghost_hits_probation_is_one_lru_over_both_classes():
    """Bias 0: random stores (either class), touches, loads and re-offers give the same victims and the same
    `evictable_keys` as `adaptive=False`."""
    for seed in range(20):
        rng = random.Random(seed)
        tiers = [TierIndex(40, [1], policy=SegmentedLRUPolicy(40, adaptive=a)) for a in (True, False)]
        out: list[list] = [[], []]
        for t, o in zip(tiers, out):
            t.on_removed = o.append
        for n in range(300):
            op = rng.random()
            present = sorted(k for k in tiers[0].keys() if tiers[0].is_ready(k))
            picked = rng.sample(present, min(3, len(present)))
            size, unshared = rng.randint(1, 4), rng.random() < 0.5
            for t in tiers:
                if op < 0.5:
                    store(t, ks(f"n{n}-", size), unshared=unshared)
                elif op < 0.7:
                    t.touch(picked)
                elif op < 0.85:
                    t.pin(picked)
                    t.unpin(picked)
                else:
                    store(t, picked)  # re-offers
            assert tiers[0].evictable_keys() == tiers[1].evictable_keys()
        assert out[0] == out[1] and len(out[0]) > 100
        assert tiers[0].policy.bias == 0.0  # fresh keys only: no evicted key was stored again


def test_unshared_ghost_hits_lower_the_bias_and_shared_ones_raise_it_within_bounds():
    tier = TierIndex(10, [1], policy=SegmentedLRUPolicy(10, ghost_step=0.5, max_bias=1.0))
    p = tier.policy
    store(tier, ks("u", 5), unshared=True)
    store(tier, ks("s", 5))
    victims(tier, 10, "x")  # everything evicted: u* ghosts of the unshared class, s* of the shared one
    store(tier, ks("u", 1))  # an unshared entry's request came back
    assert p.bias == -0.5
    store(tier, ks("s", 5)[1:])  # four shared ghosts: +2.0, capped at +1.0
    assert p.bias == 1.0
    store(tier, ks("s", 1))  # a ghost counts once
    assert p.bias == 1.0 and (0, "s0") not in p._ghosts[False]


def test_a_positive_bias_evicts_younger_unshared_entries_before_older_shared_ones():
    tier = TierIndex(8, [1], policy=SegmentedLRUPolicy(8, max_bias=2.0))
    tier.policy.bias = 2.0  # unshared entries age e^2 = 7.4x as fast
    store(tier, ks("s", 2))  # oldest
    store(tier, ks("u", 6), unshared=True)
    assert victims(tier, 6, "x") == [(0, f"u{i}") for i in (5, 4, 3, 2, 1, 0)]  # tail first, as ever
    # With the opposite bias the older shared entries go first (and sooner than their age alone says).
    tier = TierIndex(8, [1], policy=SegmentedLRUPolicy(8, max_bias=2.0))
    tier.policy.bias = -2.0
    store(tier, ks("u", 6), unshared=True)
    store(tier, ks("s", 2))
    assert victims(tier, 2, "x") == [(0, "s1"), (0, "s0")]


def test_evictable_keys_is_the_order_of_victims_taken_with_no_release_in_between():
    """One store of several keys takes its victims before any of them is released: they are the first entries of
    `evictable_keys`, for any bias (between releases the weighted ages do not change)."""
    for bias in (-3.0, -0.5, 0.0, 0.7, 3.0):
        tier = TierIndex(12, [1], policy=SegmentedLRUPolicy(12, max_bias=5.0))
        tier.policy.bias = bias
        rng = random.Random(int(bias * 10))
        for i in range(6):
            store(tier, ks(f"r{i}-", 2), unshared=rng.random() < 0.5)
        expected = tier.evictable_keys()[:7]
        removed = []
        tier.on_removed = removed.append
        assert len(tier.begin_store(ks("new", 7))) == 7
        assert removed == expected


def test_a_reoffered_or_loaded_unshared_entry_becomes_shared():
    tier = TierIndex(10, [1], policy="slru")
    p = tier.policy
    u = store(tier, ks("u", 3), unshared=True)
    assert set(p._probation[True]) == set(u) and not p._probation[False]
    store(tier, u[:1])  # a later request computed u0 again and offered it
    tier.pin(u[1:2])  # a load read u1
    tier.unpin(u[1:2])
    assert list(p._probation[True]) == [u[2]] and list(p._probation[False]) == [u[0]]
    assert u[1] in p._protected
    assert p.num_evictable() == len(p.evictable_keys()) == 3


def test_the_follow_up_tail_outlives_one_shot_filler_once_shared_content_comes_back():
    """The RAG shape: a query's short tail (shared class) and a stream of one-shot filler (unshared) through a tier
    that holds a few rounds of it. Some shared content is evicted and stored again (queries recomputing what the
    tier lost): its ghosts raise the bias and the tail survives the filler; one LRU (adaptive=False) loses it."""
    def run(adaptive):
        tier = TierIndex(200, [1], policy=SegmentedLRUPolicy(200, adaptive=adaptive))
        rng = random.Random(1)
        for rnd in range(30):  # earlier queries whose content comes back after it was evicted
            store(tier, ks(f"q{rnd % 6}-", 20))
            store(tier, ks(f"f{rnd}-", 40), unshared=True)
        tail = store(tier, ks("tail", 10))
        for i in range(8):
            store(tier, ks(f"g{i}-", 40), unshared=True)
            store(tier, ks(f"q{rng.randrange(6)}-", 20))
        return all(tier.is_ready(k) for k in tail), tier.policy.bias

    kept, bias = run(True)
    assert kept and bias > 1.0
    assert run(False) == (False, 0.0)


def test_a_policy_without_the_hint_still_works():
    """A policy class written before `unshared` existed (named by module path, not derived from EvictionPolicy)
    still gets its stores."""
    class Plain:
        def __init__(self, capacity_slots):
            self.capacity_slots = capacity_slots
            self.order = []

        def stored(self, key): pass
        def loaded(self, key): pass
        def touch(self, key): pass
        def reoffered(self, key): pass

        def release(self, key):
            self.order.append(key)

        def pin(self, key):
            if key in self.order:
                self.order.remove(key)

        removed = pin

        def victim(self):
            return self.order.pop(0) if self.order else None

        def clear(self):
            self.order.clear()

        def is_evictable(self, key):
            return key in self.order

        def evictable_keys(self):
            return list(self.order)

        def num_evictable(self):
            return len(self.order)

    assert not hasattr(Plain, "unshared")
    tier = TierIndex(4, [1], policy=Plain(4))
    store(tier, ks("a", 4), unshared=True)
    assert store(tier, ks("b", 2), unshared=True) == ks("b", 2) and tier.evictions == 2


def test_the_scheduler_marks_the_stores_of_requests_that_shared_nothing():
    """vLLM's real scheduler, gpt-oss-like layout: "a" shares nothing, so its entries are unshared; "b" resumes from
    a's first 512 tokens (GPU prefix cache), so it is shared, and the blocks of a's it offers again become shared;
    a's blocks past the shared prefix stay unshared."""
    sched, hbs = build_custom((("full", 16, 0), ("sliding", 16, 128)), num_blocks=600, max_num_batched_tokens=512,
                              max_model_len=4096, kv_transfer_config=connector_config("exact", 1 << 30))
    drv = SchedulerDriver(sched, TagCopier(1))
    side = drv.side
    a_tokens = tokens(1, 1024)
    a = make_request("a", a_tokens, 2, hbs)
    drv.add([a])
    assert not drv.run().stalled
    policy = side.tier.policy
    assert policy._probation[True] and not policy._probation[False] and not policy._protected
    keys_a = side.layout.keys(a)
    full = side.layout.groups[0]
    a_full = {keys_a(full.index, i) for i in range(1024 // full.block_size)}
    assert a_full <= set(policy._probation[True])
    b = make_request("b", a_tokens[:512] + tokens(2, 300), 2, hbs)
    drv.add([b])
    assert not drv.run().stalled
    shared_part = {keys_a(full.index, i) for i in range(512 // full.block_size)}
    assert shared_part <= set(policy._probation[False])
    assert a_full - shared_part <= set(policy._probation[True])
    keys_b = side.layout.keys(b)
    b_own = {keys_b(full.index, i) for i in range(512 // full.block_size, 812 // full.block_size)}
    assert b_own and b_own <= set(policy._probation[False])
    # The scheduler side reports the policy's bias as a gauge each step.
    from offload_connector import metrics as m
    policy.bias = 1.5
    assert side.take_stats().data[m.GAUGES][m.EVICTION_BIAS] == 1.5


def test_a_layout_without_full_attention_still_tells_unshared_requests():
    """Only sliding-window groups: the full-attention prefix means nothing there, so the hit and vLLM's prefix cache
    decide (a first request is unshared, one resuming from its prefix is not)."""
    sched, hbs = build_custom((("sliding", 16, 128),), num_blocks=400, max_num_batched_tokens=256,
                              max_model_len=4096,
                              kv_transfer_config=connector_config("exact", 1 << 30, spare_windows=False))
    drv = SchedulerDriver(sched, TagCopier(1))
    first = tokens(3, 600)
    drv.add([make_request("a", first, 2, hbs)])
    assert not drv.run().stalled
    policy = drv.side.tier.policy
    assert policy._probation[True] and not policy._probation[False]
    drv.add([make_request("b", first[:512] + tokens(4, 200), 2, hbs)])
    assert not drv.run().stalled
    assert policy._probation[False]
