"""CPU-tier cache policies (scheduler/eviction.py) through TierIndex: the order of victims for lru / slru / arc, ARC's
ghost adaptation, pinned entries never evicted whatever the policy (also a random model check of the index and the
policy together), and out-of-tree policies named by module path with their start-up errors."""

import random
import textwrap

import pytest

from offload_connector.config import ConfigError, OffloadConfig
from offload_connector.scheduler.eviction import (ARCPolicy, EvictionPolicy, LRUPolicy, SegmentedLRUPolicy,
                                                  load_policy_factory, make_policy)
from offload_connector.scheduler.tier_index import TierIndex

POLICIES = ["lru", "slru", "arc"]


def keys(n, group=0, tag="a"):
    return [(group, f"{tag}{i}") for i in range(n)]


def stored(tier, ks):
    got = tier.begin_store(ks)
    tier.finish_store([k for k, _ in got])
    return [k for k, _ in got]


def served(tier, ks):
    """A load reads `ks` and lands (pin, touch, unpin: what the scheduler side does)."""
    tier.pin(ks)
    tier.touch(ks)
    tier.unpin(ks)


def evicted_in_order(tier, n, tag="x"):
    removed = []
    tier.on_removed = removed.append
    for i in range(n):
        assert len(tier.begin_store([(0, f"{tag}{i}")])) == 1
        tier.finish_store([(0, f"{tag}{i}")])
    tier.on_removed = None
    return removed


# ------------------------------------------------------------------------------------------------ lru
def test_lru_is_the_default_and_evicts_least_recently_released_tail_first():
    tier = TierIndex(6, [10])
    assert isinstance(tier.policy, LRUPolicy)
    a, b = keys(3, tag="a"), keys(3, tag="b")
    stored(tier, a)
    stored(tier, b)
    served(tier, a)  # a is the most recent now (its head last)
    assert tier.evictable_keys() == [b[2], b[1], b[0], a[2], a[1], a[0]]
    assert evicted_in_order(tier, 4) == [b[2], b[1], b[0], a[2]]


def test_lru_policy_matches_the_old_ordered_dict_exactly():
    """The pre-seam tier kept one OrderedDict; replaying random operations on both gives the same victims."""
    from collections import OrderedDict

    rng = random.Random(7)
    policy, ref = LRUPolicy(100), OrderedDict()
    for _ in range(5000):
        k = (0, rng.randrange(40))
        op = rng.randrange(5)
        if op == 0:
            policy.release(k)
            ref[k] = None
        elif op == 1:
            policy.pin(k)
            ref.pop(k, None)
        elif op == 2:
            policy.touch(k)
            if k in ref:
                ref.move_to_end(k)
        elif op == 3:
            policy.removed(k)
            ref.pop(k, None)
        else:
            assert policy.victim() == (ref.popitem(last=False)[0] if ref else None)
        assert policy.evictable_keys() == list(ref)


# ----------------------------------------------------------------------------------------------- slru
def test_slru_prefixes_that_served_a_load_outlive_one_shot_traffic():
    """Segmented LRU: entries that served a load are evicted only after every entry that never did."""
    tier = TierIndex(10, [10], policy="slru")
    reused, once = keys(3, tag="r"), keys(3, tag="o")
    stored(tier, reused)
    stored(tier, once)
    served(tier, reused)  # a load reads them: they are the most recent *and* protected now
    tier.touch(once)  # plain recency does not protect: `once` never served a load
    flood = keys(6, tag="f")
    stored(tier, flood)
    # 10 slots, 12 entries asked for: the two evicted are `once`'s, although `reused` is older by recency.
    assert all(tier.is_ready(k) for k in reused)
    assert sum(tier.is_ready(k) for k in once) == 1 and tier.evictions == 2


def test_slru_protected_segment_is_capped():
    tier = TierIndex(10, [10], policy="slru")  # 0.3 of 10 slots: at most 3 protected entries
    assert tier.policy.protected_cap == 3
    a = keys(5, tag="a")
    stored(tier, a)
    served(tier, a)  # unpinned tail first: a[4] ... a[0]; the two oldest of those drop back to probation
    stored(tier, keys(7, tag="n"))  # 12 asked for 10 slots: two evictions, from probation
    assert [tier.is_ready(k) for k in a] == [True, True, True, False, False]


def test_slru_share_is_a_constructor_argument_and_a_reloaded_entry_is_protected_again():
    policy = SegmentedLRUPolicy(10, protected_share=0.5)
    assert policy.protected_cap == 5
    with pytest.raises(ValueError):
        SegmentedLRUPolicy(10, protected_share=0)
    tier = TierIndex(10, [10], policy=policy)
    a = keys(6, tag="a")
    stored(tier, a)
    served(tier, a)  # a[5] demoted to probation (cap 5)
    assert tier.evictable_keys()[0] == a[5]
    served(tier, [a[5]])  # served again: protected again, the oldest protected one (a[4]) demoted
    assert tier.evictable_keys()[:1] == [a[4]] and tier.evictable_keys()[-1] == a[5]
    # An evicted entry forgets it served a load: stored again, it starts in probation.
    stored(tier, keys(5, tag="n"))  # 11 > 10: one eviction, a[4] from probation
    assert not tier.has(a[4])
    stored(tier, [a[4]])
    assert tier.evictable_keys().index(a[4]) < tier.evictable_keys().index(a[0])


def test_slru_victims_follow_evictable_keys_under_random_operations():
    """The listed order (used by the invariant checks) is the order victims are taken in, through random releases,
    loads, touches, pins, removals and evictions, with and without the adaptive probation bias."""
    rng = random.Random(11)
    for adaptive in (True, False):
        policy = SegmentedLRUPolicy(20, adaptive=adaptive, ghost_step=0.5)
        pinned: set = set()
        for _ in range(4000):
            k = (0, rng.randrange(30))
            op = rng.randrange(7)
            if op == 0 and k not in pinned and not policy.is_evictable(k):
                policy.stored(k)
                if rng.random() < 0.5:
                    policy.unshared(k)
                policy.release(k)
            elif op == 1 and policy.is_evictable(k):
                policy.pin(k)
                pinned.add(k)
            elif op == 2 and k in pinned:
                policy.loaded(k)
                policy.release(k)
                pinned.discard(k)
            elif op == 3:
                policy.touch(k)
            elif op == 4 and policy.is_evictable(k):
                policy.removed(k)
            elif op == 5:
                order = policy.evictable_keys()
                assert policy.victim() == (order[0] if order else None)
            elif op == 6 and policy.is_evictable(k):
                policy.reoffered(k)
            assert len(set(policy.evictable_keys())) == policy.num_evictable()


# ------------------------------------------------------------------------------------------------ arc
def textbook_arc(c):
    """ARC as published: the target size of T1 starts at 0 (the built-in "arc" starts at 0.7 of the slots)."""
    return ARCPolicy(c, initial_t1_share=0.0)


def test_arc_evicts_recency_list_first_and_keeps_served_entries_in_t2():
    tier = TierIndex(6, [10], policy=textbook_arc(6))
    arc = tier.policy
    assert arc.p == 0
    a, b = keys(3, tag="a"), keys(3, tag="b")
    stored(tier, a)
    stored(tier, b)
    served(tier, a)  # a -> T2
    assert arc.sizes() == {"T1": 3, "T2": 3, "B1": 0, "B2": 0}
    assert [arc.in_list(k) for k in a + b] == ["T2"] * 3 + ["T1"] * 3
    # p = 0: T1 is above its target, so T1 (b, tail first) goes first although a is older by store time.
    assert evicted_in_order(tier, 4) == [b[2], b[1], b[0], (0, "x0")]
    # Their keys are ghosts in B1, bounded by |T1| + |B1| <= c: with x1..x3 in T1 the oldest ghost (b[2]) went.
    assert arc.sizes() == {"T1": 3, "T2": 3, "B1": 3, "B2": 0}
    assert [arc.in_list(k) for k in b] == ["B1", "B1", None] and arc.in_list((0, "x0")) == "B1"


def test_arc_ghost_hits_adapt_the_target():
    tier = TierIndex(4, [10], policy=textbook_arc(4))
    arc = tier.policy
    hot, cold, new = keys(2, tag="h"), keys(2, tag="c"), keys(2, tag="n")
    stored(tier, hot)
    served(tier, hot)  # T2
    stored(tier, cold)  # T1
    stored(tier, new)  # evicts cold (T1 above p = 0) -> B1
    assert [arc.in_list(k) for k in cold] == ["B1", "B1"]
    removed = []
    tier.on_removed = removed.append
    # cold is wanted again (stored after a recompute): the victim is n1 (T1 above p = 0); then, a B1 hit, T1 was
    # too small: p grows by max(1, |B2|/|B1|) = 1. The entry starts in T1 again (it has not served a load).
    stored(tier, [cold[0]])
    assert removed == [new[1]] and arc.p == 1 and arc.in_list(cold[0]) == "T1"
    stored(tier, [cold[1]])
    assert removed == [new[1], new[0]] and arc.p == 2 and arc.in_list(cold[1]) == "T1"
    # |T1| = 2 is not above p = 2: the victim comes from T2, its least recent entry (hot was released tail first).
    stored(tier, [(0, "x")])
    assert removed[-1] == hot[1] and arc.in_list(hot[1]) == "B2"
    # A B2 hit: T2 was too small; p shrinks by max(1, |B1|/|B2|) = 2 (B1 holds n1, n0; B2 holds hot[1]).
    stored(tier, [hot[1]])
    assert removed[-1] == cold[0] and arc.p == 0 and arc.in_list(hot[1]) == "T1"
    # Adaptation is bounded: p stays within [0, c].
    for i in range(10):
        v = tier.evictable_keys()[0]
        stored(tier, keys(1, tag=f"z{i}"))
        stored(tier, [v])
        assert 0 <= arc.p <= 4


def test_arc_original_variant_puts_ghost_hits_in_t2():
    tier = TierIndex(4, [10], policy=ARCPolicy(4, ghost_hits_to_t2=True, initial_t1_share=0.0))
    arc = tier.policy
    hot, cold = keys(2, tag="h"), keys(2, tag="c")
    stored(tier, hot)
    served(tier, hot)  # T2
    stored(tier, cold)
    stored(tier, keys(2, tag="n"))  # cold -> B1 (|T1| + |B1| <= c keeps both ghosts)
    stored(tier, [cold[0]])
    assert arc.p == 1 and arc.in_list(cold[0]) == "T2"


def test_reoffered_entries_count_as_reuse_for_arc_and_optionally_slru_never_for_lru():
    """A store offering a key the tier holds (a request computed the block again, or found it on the GPU) is a
    reuse for ARC (as in vLLM's ARC), for SLRU a touch (recent end of probation, not protected) or with
    reuse_on_store a reuse, and changes nothing under LRU."""
    for policy, expect in (("lru", None), (SegmentedLRUPolicy(10, touch_on_reoffer=False), None),
                           ("slru", "touched"), (SegmentedLRUPolicy(10, reuse_on_store=True), "protected"),
                           ("arc", "T2"), (ARCPolicy(10, reuse_on_store=False), "T1")):
        tier = TierIndex(10, [10], policy=policy)
        a, b = keys(2, tag="a"), keys(2, tag="b")
        stored(tier, a)
        stored(tier, b)
        order = tier.evictable_keys()
        assert tier.begin_store(a + keys(1, tag="c")) != []  # a is offered again, c is new
        if expect is None:
            assert tier.evictable_keys() == order  # c is still pinned by its store
        elif expect == "touched":
            assert order[:2] == [a[1], a[0]]  # a was the oldest (released tail first)...
            assert tier.evictable_keys() == [b[1], b[0], a[1], a[0]]  # ...and is now the most recent
            assert not tier.policy._protected
        elif expect == "protected":
            assert tier.evictable_keys()[-2:] == [a[1], a[0]] and a[0] in tier.policy._protected
        else:
            assert [tier.policy.in_list(k) for k in a] == [expect, expect]


def test_builtin_arc_starts_with_t1_at_seventy_percent():
    tier = TierIndex(10, [10], policy="arc")
    arc = tier.policy
    assert isinstance(arc, ARCPolicy) and arc.p == 7
    hot, cold = keys(3, tag="h"), keys(7, tag="c")
    stored(tier, hot)
    served(tier, hot)
    stored(tier, cold)  # |T1| = 7, not above p = 7: the next victim is T2's least recent entry
    # Then x0 makes |T1| = 8 > 7: T1's least recent evictable entry (cold was released tail first).
    assert evicted_in_order(tier, 2) == [hot[2], cold[6]]
    with pytest.raises(ValueError):
        ARCPolicy(10, initial_t1_share=1.5)


def test_arc_ghost_lists_stay_bounded():
    c = 5
    tier = TierIndex(c, [10], policy="arc")
    arc = tier.policy
    rng = random.Random(3)
    for i in range(400):
        k = (0, f"k{rng.randrange(30)}")
        if not tier.has(k):
            stored(tier, [k])
        elif rng.random() < 0.5:
            served(tier, [k])
        s = arc.sizes()
        assert s["T1"] + s["B1"] <= c and sum(s.values()) <= 2 * c and s["T1"] + s["T2"] == len(tier)
        assert 0 <= arc.p <= c


def test_arc_dropped_entries_leave_no_ghost():
    tier = TierIndex(4, [10], policy="arc")
    a = keys(2)
    stored(tier, a)
    tier.drop([a[0]])
    bad = keys(1, tag="f")
    tier.begin_store(bad)
    tier.finish_store(bad, ok=False)
    assert tier.policy.in_list(a[0]) is None and tier.policy.in_list(bad[0]) is None
    assert tier.policy.sizes() == {"T1": 1, "T2": 0, "B1": 0, "B2": 0}


# ------------------------------------------------------------------------------------- every policy
@pytest.mark.parametrize("policy", POLICIES)
def test_pinned_entries_are_never_evicted(policy):
    tier = TierIndex(4, [10], policy=policy)
    a, b = keys(2, tag="a"), keys(2, tag="b")
    stored(tier, a)
    stored(tier, b)
    served(tier, b)  # b served a load (protected under slru, T2 under arc) ...
    tier.pin(a)  # ... and a is pinned by a load in flight: only b can go
    got = tier.begin_store(keys(3, tag="n"))
    assert len(got) == 2 and tier.store_rejections == 1
    assert all(tier.is_ready(k) and tier.pin_count(k) == 1 for k in a) and not any(tier.has(k) for k in b)
    tier.unpin(a)
    tier.finish_store([k for k, _ in got])
    assert len(tier.begin_store(keys(1, tag="z"))) == 1


@pytest.mark.parametrize("policy", POLICIES)
def test_random_operations_keep_the_policy_in_step_with_the_index(policy):
    """Random stores (some failing), loads, touches, drops and resets on a small tier: the policy lists exactly the
    readable unpinned entries, each once; a victim is never pinned or unreadable (TierIndex would raise)."""
    rng = random.Random(11)
    tier = TierIndex(12, [10, 20], policy=policy)
    storing: list[tuple[list, list]] = []  # (keys, slots) of stores in flight
    loading: list[tuple[list, list]] = []
    for _ in range(4000):
        op = rng.randrange(10)
        if op <= 2:
            base = rng.randrange(6)
            ks = [(rng.randrange(2), f"p{base}-{i}") for i in range(rng.randint(1, 6))]
            got = tier.begin_store(ks)
            if got:
                storing.append(([k for k, _ in got], [s for _, s in got]))
        elif op == 3 and storing:
            job, _ = storing.pop(rng.randrange(len(storing)))
            tier.finish_store(job, ok=rng.random() > 0.15)
        elif op == 4:
            ready = [k for k in list(tier.view().entries) if tier.is_ready(k)]
            if ready:
                job = rng.sample(ready, rng.randint(1, min(4, len(ready))))
                loading.append((job, tier.pin(job)))
                tier.touch(job)
        elif op == 5 and loading:
            job, _ = loading.pop(rng.randrange(len(loading)))
            tier.unpin(job)
            if rng.random() < 0.1:
                tier.drop(job)
        elif op == 6:
            tier.touch([k for k in list(tier.view().entries)[:3]])
        elif op == 7 and rng.random() < 0.02:
            tier.clear()  # the jobs in flight finish after the reset: they release their retired slots
            for _, slots in storing + loading:
                tier.release_retired(slots)
            storing.clear()
            loading.clear()
            assert tier.stats().retired_slots == 0
        idle = {k for k, e in tier.view().entries.items() if e.ready and e.pins == 0}
        listed = tier.evictable_keys()
        assert len(listed) == len(set(listed)) and set(listed) == idle
        assert all(tier.is_evictable(k) for k in idle)
    assert tier.evictions > 100


# ------------------------------------------------------------------------------------- out of tree
MODULE = textwrap.dedent('''
    from collections import OrderedDict
    from offload_connector.scheduler.eviction import EvictionPolicy

    class MRU(EvictionPolicy):
        """Most recently released first (a policy no one should use, easy to tell apart)."""
        def __init__(self, capacity_slots):
            super().__init__(capacity_slots)
            self.order = OrderedDict()
        def release(self, key):
            self.order[key] = None
        def pin(self, key):
            self.order.pop(key, None)
        def victim(self):
            return self.order.popitem(last=True)[0] if self.order else None
        def clear(self):
            self.order.clear()
        def is_evictable(self, key):
            return key in self.order
        def evictable_keys(self):
            return list(reversed(self.order))

    class Rogue(MRU):
        """Returns a key it was never given."""
        def victim(self):
            return (0, "nobody")

    class DuckTyped:
        def __init__(self, capacity_slots): pass
        def stored(self, k): pass
        def release(self, k): pass
        def pin(self, k): pass
        def loaded(self, k): pass
        def touch(self, k): pass
        def reoffered(self, k): pass
        def removed(self, k): pass
        def victim(self): return None
        def clear(self): pass
        def is_evictable(self, k): return False
        def evictable_keys(self): return []

    class Incomplete:
        def __init__(self, capacity_slots): pass
        def victim(self): return None

    class NeedsTwo(MRU):
        def __init__(self, capacity_slots, share):
            super().__init__(capacity_slots)

    not_a_class = 3
''')


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    pkg = tmp_path / "my_evict_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "policies.py").write_text(MODULE)
    (pkg / "broken.py").write_text("raise RuntimeError('boom\\nsecond line')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_evict_pkg"


def test_out_of_tree_policy_by_module_path(plugin):
    cfg = OffloadConfig.from_extra_config({"cpu_bytes": 10, "eviction": f"{plugin}.policies:MRU"})
    assert cfg.eviction == f"{plugin}.policies:MRU"
    tier = TierIndex(3, [10], policy=cfg.eviction)
    assert type(tier.policy).__name__ == "MRU"
    stored(tier, keys(3))  # released tail first: a0 is the most recent
    assert evicted_in_order(tier, 1) == [(0, "a0")]
    # A duck-typed class (no base class) with the whole interface is accepted too.
    assert OffloadConfig.from_extra_config({"cpu_bytes": 10, "eviction": f"{plugin}.policies:DuckTyped"})


def test_out_of_tree_policy_cannot_evict_what_it_was_not_given(plugin):
    tier = TierIndex(1, [10], policy=f"{plugin}.policies:Rogue")
    stored(tier, keys(1))
    with pytest.raises(RuntimeError, match="Rogue chose"):
        tier.begin_store(keys(1, tag="b"))


@pytest.mark.parametrize("spec, why", [
    ("no_such_module_xyz:P", "cannot import 'no_such_module_xyz': ModuleNotFoundError"),
    ("{pkg}.broken:P", "cannot import '{pkg}.broken': RuntimeError: boom second line"),
    ("{pkg}.policies:Missing", "module '{pkg}.policies' has no 'Missing'"),
    ("{pkg}.policies:not_a_class", "'not_a_class' is not a class"),
    ("{pkg}.policies:Incomplete", "'Incomplete' lacks the method(s) ['stored', 'release', 'pin', 'loaded'"),
    ("{pkg}.policies:NeedsTwo", "'NeedsTwo' cannot be constructed as NeedsTwo(capacity_slots)"),
    ("{pkg}.policies", None),
    ("mru", None),
    ("", None),
    (3, None),
    ("a b:C", None),
])
def test_eviction_key_errors_are_one_line_and_name_the_key(plugin, spec, why):
    if isinstance(spec, str):
        spec = spec.format(pkg=plugin)
    with pytest.raises(ConfigError) as err:
        OffloadConfig.from_extra_config({"cpu_bytes": 10, "eviction": spec})
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith("kv_connector_extra_config: 'eviction' must be one of ['lru', 'slru', 'arc'] or "
                          "\"module.path:ClassName\" of an eviction policy class; got ")
    if why is not None:
        assert why.format(pkg=plugin) in msg


@pytest.mark.parametrize("name", POLICIES)
def test_builtin_names_are_accepted_and_build_their_policy(name):
    assert OffloadConfig.from_extra_config({"cpu_bytes": 10, "eviction": name}).eviction == name
    policy = make_policy(name, 10)
    assert isinstance(policy, EvictionPolicy) and policy.name == name
    assert load_policy_factory(name) is type(policy)


def test_config_lists_the_builtin_policies():
    from offload_connector.config import EVICTION_POLICIES
    from offload_connector.scheduler.eviction import BUILTIN_POLICIES

    assert EVICTION_POLICIES == tuple(BUILTIN_POLICIES)


@pytest.mark.parametrize("name", ["lru", "slru", "arc"])
def test_num_evictable_counts_what_evictable_keys_lists(name):
    """`TierIndex.has_room` asks the policy for a count on every second-tier lookup: it must match the list."""
    from offload_connector.scheduler.tier_index import TierIndex
    tier = TierIndex(8, [1], policy=name)
    keys = [(0, i) for i in range(12)]
    for k in keys[:6]:
        tier.begin_store([k])
        tier.finish_store([k])
    tier.pin(keys[:2])
    assert tier.policy.num_evictable() == len(tier.policy.evictable_keys()) == 4
    assert tier.has_room(2 + 4) and not tier.has_room(2 + 4 + 1)
    tier.unpin(keys[:2])
    for k in keys[6:]:
        tier.begin_store([k])
        tier.finish_store([k])
    assert tier.policy.num_evictable() == len(tier.policy.evictable_keys())
