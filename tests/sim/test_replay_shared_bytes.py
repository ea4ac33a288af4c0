"""A bounded shared store (--shared-bytes): the simulated pool evicts least-recently-used values as Redis'
allkeys-lru does, counting each block's real bytes. An eviction under a live marker makes a load's fetch fail, the
load fails (vLLM recomputes) and the markers go: the router replay must run through it with exact admissions and
checked loads."""

from __future__ import annotations

import pytest

from offload_bench.cli import main
from offload_bench.replay.router import SHARED, RouterConfig, header, render, run_router
from offload_bench.replay.timemodel import time_model_for
from offload_bench.replay.workloads import agent_tool_prefix
from offload_bench.sim.remote import SimPool, SimSharedStore, TAG_VALUE_BYTES, encode_tag

MODEL = "gpt-oss-20b"


# ------------------------------------------------------------------------------------------------ SimPool
def test_pool_evicts_least_recently_put_first():
    pool = SimPool(capacity_bytes=300)
    for name in "abc":
        assert pool.put(name, b"v", 100)
    assert pool.put("d", b"v", 100)  # full: "a" is the oldest
    assert list(pool.values) == ["b", "c", "d"]
    assert (pool.evictions, pool.evicted_bytes, pool.used_bytes) == (1, 100, 300)


def test_get_refreshes_recency_and_exists_does_not():
    pool = SimPool(capacity_bytes=300)
    for name in "abc":
        pool.put(name, b"v", 100)
    assert pool.get("a") == b"v"  # "a" is now the most recent: "b" goes first
    assert pool.contains("b")  # a look, not a use
    assert pool.get("zz") is None  # a miss refreshes nothing
    pool.put("d", b"v", 150)
    assert list(pool.values) == ["a", "d"]
    assert (pool.evictions, pool.evicted_bytes, pool.used_bytes) == (2, 200, 250)


def test_pool_counts_the_size_given_not_the_value_length():
    pool = SimPool(capacity_bytes=1000)
    pool.put("big", b"x", 900)
    pool.put("small", b"y" * 50, 50)
    assert pool.used_bytes == 950
    pool.put("more", b"z", 100)  # 1050 > 1000: "big" (900 counted bytes, one value byte) goes
    assert list(pool.values) == ["small", "more"] and pool.evicted_bytes == 900


def test_overwrite_replaces_the_old_size_without_evicting():
    pool = SimPool(capacity_bytes=300)
    pool.put("a", b"v", 200)
    pool.put("b", b"v", 100)
    assert pool.put("a", b"w", 200)  # the old "a" is freed first: fits without evicting "b"
    assert list(pool.values) == ["b", "a"] and pool.used_bytes == 300 and pool.evictions == 0
    pool.discard("a")
    assert pool.used_bytes == 100 and pool.evictions == 0


def test_a_value_larger_than_the_capacity_is_refused():
    pool = SimPool(capacity_bytes=100)
    pool.put("a", b"v", 60)
    assert pool.put("huge", b"v", 101) is False
    assert list(pool.values) == ["a"] and pool.used_bytes == 60  # nothing evicted for it
    assert (pool.refused, pool.evictions) == (1, 0)
    assert pool.put("exact", b"v", 100)  # the whole capacity fits, once the rest is evicted
    assert list(pool.values) == ["exact"] and pool.evictions == 1


def test_unbounded_pool_never_evicts():
    pool = SimPool()
    for i in range(100):
        assert pool.put(str(i), b"v", 2**40)
    assert len(pool.values) == 100 and pool.evictions == 0 and pool.used_bytes == 100 * 2**40


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "1GiB"])
def test_pool_capacity_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="capacity_bytes"):
        SimPool(capacity_bytes=bad)


def test_store_counts_shard_values_as_their_groups_blocks_and_markers_as_their_length():
    from offload_connector.remote import RemoteFingerprint

    fp = RemoteFingerprint(model="m", layout="oc-slot", dtype="bf16", group_block_bytes=(4096, 1024),
                           block_sizes=(16, 16))
    pool = SimPool(capacity_bytes=2 * 4096 + 1024)  # both groups' blocks and a marker fit; one more block does not
    shards = SimSharedStore(fp, pool, block_bytes=(4096, 1024))
    keys = [(0, b"\x01" * 32), (1, b"\x02" * 32)]
    assert shards.put(keys, [encode_tag(k) for k in keys]) == [True, True]
    assert pool.used_bytes == 4096 + 1024  # not 2 x the framed 256-byte tag
    markers = SimSharedStore(RemoteFingerprint(**{**fp.__dict__, "layout": "oc-markers"}), pool)
    assert markers.put([keys[0]], [b"\x01"]) == [True]
    marker_len = len(pool.values[markers.keys.name(*keys[0])])
    assert 1 < marker_len < TAG_VALUE_BYTES and pool.used_bytes == 4096 + 1024 + marker_len
    shards.set_epoch(1)  # another key prefix: the group is still read from the key
    assert shards.put([keys[0]], [encode_tag(keys[0])]) == [True]
    assert pool.evictions == 1 and pool.evicted_bytes == 4096  # the oldest value, the epoch-0 group-0 shard
    assert shards.get([keys[1]], [bytearray(TAG_VALUE_BYTES)]) == [False]  # epoch 1 never reads epoch 0


def test_an_evicted_shard_fails_the_fetch():
    from offload_connector.remote import RemoteFingerprint

    fp = RemoteFingerprint(model="m", layout="oc-slot", dtype="bf16", group_block_bytes=(4096,), block_sizes=(16,))
    pool = SimPool(capacity_bytes=8192)
    a, b = SimSharedStore(fp, pool, block_bytes=(4096,)), SimSharedStore(fp, pool, block_bytes=(4096,))
    keys = [(0, bytes([i]) * 32) for i in range(3)]
    a.put(keys[:2], [encode_tag(k) for k in keys[:2]])
    assert b.get([keys[0]], [bytearray(TAG_VALUE_BYTES)]) == [True]  # keys[0] used: keys[1] is now the oldest
    a.put([keys[2]], [encode_tag(keys[2])])
    got = b.get(keys, [bytearray(TAG_VALUE_BYTES) for _ in keys])
    assert got == [True, False, True] and pool.evicted_bytes == 4096


# ------------------------------------------------------------------------------------------------ router run
def _cfg(shared_bytes: int | None) -> RouterConfig:
    # A slow shared link (0.5 GB/s) leaves time between a lookup and its fetch for the other engine's puts to evict
    # what the lookup saw: the reduced run then has a failed fetch at 512 MiB, not only lookups that miss.
    return RouterConfig(model=MODEL, num_gpu_blocks=2304, cpu_bytes=8 * 2**30, max_num_batched_tokens=1024,
                        max_model_len=32768, max_num_seqs=64, time_model=time_model_for(MODEL), limit=40,
                        stall_steps=100, columns=(SHARED,), shared_bandwidth_gbps=0.5, shared_bytes=shared_bytes,
                        # Spare windows (not written through) and the layout's denser checkpoints (128 tokens apart
                        # on gpt-oss) leave fewer fetches for the race this run needs: both pinned as measured.
                        offload_extra=(("spare_windows", False), ("window_checkpoint_tokens", 8192)))


@pytest.fixture(scope="module")
def bounded_and_unbounded():
    bounded = run_router(agent_tool_prefix(0), _cfg(512 * 2**20))
    unbounded = run_router(agent_tool_prefix(0), _cfg(None))
    return bounded, unbounded.runs[0].result


def test_bounded_store_evicts_fails_fetches_and_recomputes(bounded_and_unbounded):
    out, unbounded = bounded_and_unbounded
    r = out.runs[0].result
    assert not r.stalled and r.first_stall_step is None, r.stopped_reason
    assert r.requests_completed == r.requests_total == 40
    assert r.extra["shared_store_capacity_bytes"] == 512 * 2**20
    assert r.extra["shared_evictions"] > 0 and r.extra["shared_evicted_bytes"] > 0
    assert 0 < r.extra["shared_store_bytes"] <= 512 * 2**20
    assert r.extra["shared_bytes_put"] > 512 * 2**20  # more was written than fits: the store had to evict
    # The failure path: a marker outlived a shard, the fetch failed, the load failed and its markers were removed.
    assert r.extra["shared_fetch_failures"] > 0 and r.extra["shared_loads_failed"] > 0
    assert r.extra["shared_put_tag_mismatches"] == 0 and r.extra["shared_puts_refused"] == 0
    assert r.extra["admissions_checked"] > 0 and r.extra["admission_mismatches"] == 0
    assert r.extra["loads_content_checked"] > 0
    assert unbounded.extra["shared_evictions"] == 0 and unbounded.extra["shared_fetch_failures"] == 0
    assert unbounded.extra["shared_store_bytes"] > 512 * 2**20  # the bound did bind
    assert r.tokens_recomputed >= unbounded.tokens_recomputed
    assert r.extra["tokens_loaded_from_shared"] < unbounded.extra["tokens_loaded_from_shared"]


def test_table_and_header_show_the_capacity_and_evictions(bounded_and_unbounded):
    out, unbounded = bounded_and_unbounded
    r = out.runs[0].result
    text = render([r, unbounded])
    row = next(line for line in text.splitlines() if "shared store evictions" in line)
    assert f"{r.extra['shared_evictions']:,} / " in row
    assert "capacity 0.5 GiB (536,870,912 bytes)" in header(out) and "allkeys-lru" in header(out)


# ------------------------------------------------------------------------------------------------ the command line
@pytest.mark.parametrize("argv, message", [
    (["--shared-bytes", "1GiB"], "--shared-bytes needs --engines 2 or more"),
    (["--engines", "2", "--shared-bytes", "0"], "argument --shared-bytes: '0' is not a byte size"),
    (["--engines", "2", "--shared-bytes=-5G"], "argument --shared-bytes: '-5G' is not a byte size"),
    (["--engines", "2", "--shared-bytes", "2P"], "argument --shared-bytes: '2P' is not a byte size"),
])
def test_shared_bytes_refusals_are_one_line_errors(argv, message, capsys):
    try:
        rc = main(["replay", "--no-progress", *argv])
    except SystemExit as exc:  # argparse's own checks exit from the parser
        rc = exc.code
    err = capsys.readouterr().err
    assert rc == 2
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_router_config_refuses_a_bad_shared_bytes(bad):
    with pytest.raises(ValueError, match="shared_bytes must be an int >= 1"):
        RouterConfig(model=MODEL, num_gpu_blocks=2304, cpu_bytes=8 * 2**30, max_num_batched_tokens=1024,
                     max_model_len=32768, max_num_seqs=64, time_model=time_model_for(MODEL), shared_bytes=bad)
