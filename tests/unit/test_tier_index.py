import pytest

from offload_connector.scheduler.tier_index import TierIndex


def keys(n, group=0, tag="a"):
    return [(group, f"{tag}{i}") for i in range(n)]


def test_store_publish_pin_and_evict_lru_tail_first():
    tier = TierIndex(4, [100, 100])
    first = keys(3)
    reserved = tier.begin_store(first)
    assert [k for k, _ in reserved] == first
    assert not any(tier.is_ready(k) for k in first)  # not readable until the copy finishes
    tier.finish_store(first)
    assert all(tier.is_ready(k) for k in first)
    assert tier.stats().used_bytes == 300
    # Two more blocks need one eviction: the tail of the older prefix goes first, its head survives.
    second = keys(2, tag="b")
    tier.begin_store(second)
    assert tier.evictions == 1
    assert tier.is_ready(first[0]) and tier.is_ready(first[1]) and not tier.has(first[2])


def test_pinned_entries_are_never_evicted():
    tier = TierIndex(2, [10])
    a = keys(2)
    tier.begin_store(a)
    tier.finish_store(a)
    tier.pin(a)
    assert tier.begin_store(keys(1, tag="b")) == []
    assert tier.store_rejections == 1 and all(tier.is_ready(k) for k in a)
    tier.unpin(a)
    assert len(tier.begin_store(keys(1, tag="b"))) == 1


def test_failed_store_frees_slot_and_unready_cannot_be_pinned():
    tier = TierIndex(1, [10])
    k = keys(1)
    tier.begin_store(k)
    with pytest.raises(KeyError):
        tier.pin(k)
    tier.finish_store(k, ok=False)
    assert len(tier) == 0 and tier.stats().used_bytes == 0
    assert len(tier.begin_store(keys(1, tag="z"))) == 1


def test_store_stops_at_first_block_without_room():
    tier = TierIndex(2, [10])
    got = tier.begin_store(keys(3))  # nothing evictable: a prefix with a hole is useless
    assert [k for k, _ in got] == keys(2)


def test_clear_frees_idle_entries_and_retires_those_in_use():
    tier = TierIndex(6, [10])
    removed = []
    tier.on_removed = removed.append
    idle, loading, storing = keys(2, tag="i"), keys(2, tag="l"), keys(1, tag="s")
    for k in (idle, loading):
        tier.begin_store(k)
        tier.finish_store(k)
    load_slots = tier.pin(loading)
    tier.pin(loading[:1])  # a second load reads the first block too
    store_slot = [s for _, s in tier.begin_store(storing)]
    tier.clear()
    # Readable entries are announced removed; the one still being written never was announced.
    assert sorted(removed) == sorted(idle + loading)
    assert len(tier) == 0 and not any(tier.is_ready(k) for k in idle + loading) and not tier.has(storing[0])
    assert tier.used_slots() == 3 and tier.stats().retired_slots == 3
    # The free slots are reused; the retired ones never, even for the same keys stored again.
    got = tier.begin_store(keys(6, tag="n"))
    assert len(got) == 3 and not {s for _, s in got} & set(load_slots + store_slot)
    tier.release_retired(store_slot)  # the store landed after the reset: its slot comes back, nothing published
    tier.release_retired(load_slots)  # one load finished: the first slot still has a reader
    assert tier.stats().retired_slots == 1
    tier.release_retired(load_slots[:1])
    assert tier.stats().retired_slots == 0 and tier.used_slots() == 3
    assert len(tier.begin_store(keys(3, tag="m"))) == 3
    tier.release_retired([0, 1, 2])  # not retired (any more): ignored
    assert tier.used_slots() == 6


def test_on_removed_reports_evictions_and_dropped_readable_entries():
    tier = TierIndex(2, [10])
    removed = []
    tier.on_removed = removed.append
    a = keys(2)
    tier.begin_store(a)
    tier.finish_store(a)
    tier.begin_store(keys(1, tag="b"))  # evicts the tail of a
    assert removed == [a[1]]
    tier.drop([a[0]])
    assert removed == [a[1], a[0]]
    failed = keys(1, tag="c")
    tier.begin_store(failed)
    tier.finish_store(failed, ok=False)  # never readable: not announced
    assert removed == [a[1], a[0]]


# Spare entries: windows stored in room nobody else uses (scheduler/stores.py, `spare_windows`).

def _stored(tier, ks, spare=False):
    """Store and publish `ks` (as spare entries with `spare`); returns them."""
    tier.begin_store(ks, spare=set(ks) if spare else ())
    tier.finish_store(ks)
    return ks

@pytest.mark.parametrize("policy", ["lru", "slru", "arc"])
def test_spare_entries_take_only_free_or_spare_room(policy):
    tier = TierIndex(4, [10], policy=policy)
    regular = _stored(tier, keys(3))
    spare = keys(3, tag="s")
    got = tier.begin_store(spare, spare=set(spare))
    # One free slot: the first spare key takes it; the others would need a regular entry's slot, so they are skipped.
    assert [k for k, _ in got] == spare[:1] and tier.spare_skips == 2
    assert all(tier.is_ready(k) for k in regular) and tier.evictions == 0
    tier.finish_store(spare[:1])
    assert tier.is_spare(spare[0]) and not tier.policy.is_evictable(spare[0])  # the policy never sees it
    # Another spare offer evicts the idle spare entry, never a regular one.
    got = tier.begin_store(spare[1:2], spare={spare[1]})
    assert [k for k, _ in got] == spare[1:2] and not tier.has(spare[0]) and tier.spare_evictions == 1
    assert all(tier.is_ready(k) for k in regular)


@pytest.mark.parametrize("policy", ["lru", "slru", "arc"])
def test_a_spare_key_never_takes_the_slot_a_later_regular_key_of_the_same_store_needs(policy):
    # Prefix order puts a window's spare blocks before the full-attention blocks at its point; three free slots and
    # three regular keys: the regular keys get them all, the spare one is skipped, nothing is refused.
    tier = TierIndex(3, [10], policy=policy)
    spare, regular = (1, "s0"), keys(3)
    got = tier.begin_store([regular[0], spare, *regular[1:]], spare={spare})
    assert sorted(k for k, _ in got) == sorted(regular)
    assert tier.store_rejections == 0 and tier.spare_skips == 1 and not tier.has(spare)


def test_spare_keys_past_a_refused_regular_key_are_not_stored():
    tier = TierIndex(2, [10])
    held = keys(2, tag="p")
    tier.begin_store(held)  # pinned by their store: nothing to evict
    spare = (1, "s0")
    assert tier.begin_store([keys(1)[0], spare], spare={spare}) == []
    assert tier.store_rejections == 1 and not tier.has(spare)


@pytest.mark.parametrize("policy", ["lru", "slru", "arc"])
def test_rank_reorders_regular_and_spare_entries_each_among_their_kind_and_skips_pinned_ones(policy):
    tier = TierIndex(8, [10], policy=policy)
    regular = _stored(tier, keys(4))
    spare = _stored(tier, keys(3, tag="s"), spare=True)
    tier.pin(regular[3:], served=False)
    assert tier.evictable_keys()[:3] == spare[::-1]  # released tail first: the head is the newest
    tier.rank([regular[2], spare[0], regular[0], spare[2], regular[1], regular[3]])
    evictable = tier.evictable_keys()
    # The spare entries still go first, the one not ranked now the oldest; the regular ones follow in the order given.
    assert evictable[:3] == [spare[1], spare[0], spare[2]]
    assert evictable[3:] == [regular[2], regular[0], regular[1]]
    assert regular[3] not in evictable


@pytest.mark.parametrize("policy", ["lru", "slru", "arc"])
def test_a_regular_store_evicts_idle_spare_entries_first(policy):
    tier = TierIndex(4, [10], policy=policy)
    spare = _stored(tier, keys(2, tag="s"), spare=True)
    regular = _stored(tier, keys(2))  # the tier is full: 2 regular, 2 spare
    assert tier.evictable_keys()[:2] == spare[::-1]  # spare ones go first, a prefix from its tail
    more = keys(2, tag="b")
    tier.begin_store(more)
    assert tier.spare_evictions == 2 and not any(tier.has(k) for k in spare)
    assert all(tier.is_ready(k) for k in regular)


@pytest.mark.parametrize("policy", ["lru", "slru", "arc"])
def test_a_spare_entry_that_serves_a_load_or_is_offered_by_a_regular_store_becomes_regular(policy):
    tier = TierIndex(8, [10], policy=policy)
    spare = _stored(tier, keys(3, tag="s"), spare=True)
    # Served a load: regular from then on, and the policy knows it (evictable once unpinned).
    tier.pin(spare[:1])
    assert not tier.is_spare(spare[0])
    tier.unpin(spare[:1])
    assert tier.policy.is_evictable(spare[0])
    # A regular store offering it again promotes it without a new slot (no copy) ...
    assert tier.begin_store(spare[1:2]) == []
    assert not tier.is_spare(spare[1]) and tier.policy.is_evictable(spare[1])
    # ... and both are handed to the second tiers now; a write-through pin (served=False) promotes nothing.
    assert tier.take_promoted() == spare[:2] and tier.take_promoted() == []
    tier.pin(spare[2:], served=False)
    assert tier.is_spare(spare[2]) and not tier.is_evictable(spare[2])
    tier.unpin(spare[2:])
    assert tier.is_evictable(spare[2]) and not tier.policy.is_evictable(spare[2])
    # A spare offer of a regular entry says nothing to the policy.
    before = tier.policy.evictable_keys()
    assert tier.begin_store(spare[:1], spare={spare[0]}) == []
    assert tier.policy.evictable_keys() == before and not tier.is_spare(spare[0])


def test_spare_entries_are_cleared_and_dropped_like_the_others():
    tier = TierIndex(4, [10])
    spare = keys(2, tag="s")
    tier.begin_store(spare, spare=set(spare))
    tier.finish_store(spare[:1])
    tier.finish_store(spare[1:], ok=False)  # a failed store frees its slot
    assert not tier.has(spare[1]) and tier.stats().used_slots == 1
    tier.clear()
    assert len(tier) == 0 and tier.evictable_keys() == []
    assert len(tier.begin_store(keys(4))) == 4


@pytest.mark.parametrize("policy", ["lru", "slru", "arc"])
def test_spare_entries_of_one_shot_prompts_are_evicted_before_the_others(policy):
    tier = TierIndex(6, [10], policy=policy)
    shared = keys(2, tag="p")  # windows of a prompt that shared a prefix when it arrived (a parent of later branches)
    tier.begin_store(shared, spare=set(shared))
    tier.finish_store(shared)
    oneshot = keys(2, tag="o")  # and, stored after them, of a prompt that shared nothing
    tier.begin_store(oneshot, unshared=True, spare=set(oneshot))
    tier.finish_store(oneshot)
    assert tier.evictable_keys()[:4] == [oneshot[1], oneshot[0], shared[1], shared[0]]
    regular = _stored(tier, keys(4))  # two free slots, then the one-shot prompt's windows, though newer
    assert all(tier.is_ready(k) for k in regular + shared) and not any(tier.has(k) for k in oneshot)
    more = keys(1, tag="b")
    tier.begin_store(more)  # then the others, oldest first
    assert not tier.has(shared[1]) and tier.is_ready(shared[0])
    assert tier.spare_evictions == 3 and all(tier.has(k) for k in regular)


def test_a_spare_entry_offered_again_is_renewed_within_its_class():
    tier = TierIndex(3, [10])
    oneshot = keys(2, tag="o")
    tier.begin_store(oneshot, unshared=True, spare=set(oneshot))
    tier.finish_store(oneshot)
    tier.begin_store(oneshot[:1], unshared=True, spare={oneshot[0]})  # offered again: the recent end
    assert tier.evictable_keys() == [oneshot[1], oneshot[0]]
    tier.begin_store(oneshot[1:], spare={oneshot[1]})  # by a request that shared a prefix: a shared window now
    assert tier.evictable_keys() == [oneshot[0], oneshot[1]] and tier.is_spare(oneshot[1])
    tier.pin(oneshot[:1])  # served a load: regular now, out of both spare lists
    tier.unpin(oneshot[:1])
    assert tier.evictable_keys()[0] == oneshot[1] and not tier.is_spare(oneshot[0])
    tier.clear()
    assert tier.evictable_keys() == []
