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
