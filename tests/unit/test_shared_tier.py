"""The shared tier wired into the connector, without an engine: the scheduler side's planner (markers only once every
worker wrote its shard, lookups, failed fetches, reset epochs) and one worker's executor, over an in-process store
that implements `RemoteStore`'s five raw operations (the interface every backend implements; Redis and Mooncake
themselves: tests/unit/test_remote_store.py, two real engines sharing Redis: tests/engine/test_shared_engine.py)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from offload_connector.config import ConfigError, OffloadConfig
from offload_connector.transfer_jobs import SHARED, TierRead, TierStep, TierWrite
from offload_connector.remote import RemoteFingerprint, RemoteStore
from offload_connector.scheduler.remote_tier import PRESENT_TTL_STEPS, Fetch, RemoteTierPlanner
from offload_connector.scheduler.tier_index import TierIndex
from offload_connector.worker.remote_io import WorkerRemoteTier

SLOT = 4096


class DictStore(RemoteStore):
    """A shared store in this process: the dict is the pool, each instance one client."""
    kind = "dict"

    def __init__(self, fingerprint: RemoteFingerprint, pool: dict[str, bytes]) -> None:
        super().__init__(fingerprint)
        self.pool = pool
        self.fail_puts = False

    def _put_raw(self, names: list[str], values: list[bytes]) -> list[bool]:
        if self.fail_puts:
            return [False] * len(names)
        self.pool.update(zip(names, map(bytes, values)))
        return [True] * len(names)

    def _get_raw(self, names: list[str]) -> list[Any]:
        return [self.pool.get(n) for n in names]

    def _exists_raw(self, names: list[str]) -> list[bool]:
        return [n in self.pool for n in names]

    def _remove_raw(self, names: list[str]) -> None:
        for n in names:
            self.pool.pop(n, None)

    def _close_raw(self) -> None:
        pass


MARKERS = RemoteFingerprint(model="m", layout="oc-markers", dtype="bf16", group_block_bytes=(1, 1),
                            block_sizes=(16, 16), tp_size=2)


def _key(i: int, g: int = 0) -> tuple[int, bytes]:
    return (g, i.to_bytes(32, "little"))


def _planner(pool: dict, reporters: int = 1, max_writing: int = 64) -> tuple[TierIndex, RemoteTierPlanner]:
    tier = TierIndex(16, [SLOT, SLOT])
    return tier, RemoteTierPlanner(DictStore(MARKERS, pool), tier, reporters, max_writing)


def _store(tier: TierIndex, keys: list) -> None:
    tier.begin_store(keys)
    tier.finish_store(keys)


def test_config_keys_for_the_shared_tier() -> None:
    # A shared tier must say who may write it (tests/unit/test_shared_auth.py: the secret file); here, everyone.
    cfg = OffloadConfig.from_extra_config({"cpu_bytes": "1G", "remote_store": "redis", "remote_allow_unauthenticated":
                                           True, "remote_options": {"url": "redis://h:6379/0"}})
    assert cfg.remote_store == "redis" and dict(cfg.remote_options) == {"url": "redis://h:6379/0"}
    with pytest.raises(ConfigError, match="'remote_store' must be one of \\['mooncake', 'redis'\\]"):
        OffloadConfig.from_extra_config({"cpu_bytes": "1G", "remote_store": "memcached"})
    with pytest.raises(ConfigError, match="unknown option 'uri'"):
        OffloadConfig.from_extra_config({"cpu_bytes": "1G", "remote_store": "redis", "remote_options": {"uri": "x"}})
    with pytest.raises(ConfigError, match="'remote_options' needs 'remote_store'"):
        OffloadConfig.from_extra_config({"cpu_bytes": "1G", "remote_options": {"url": "x"}})
    with pytest.raises(ConfigError, match="'remote_options' must be a JSON object"):
        OffloadConfig.from_extra_config({"cpu_bytes": "1G", "remote_store": "redis", "remote_options": [1]})
    with pytest.raises(ConfigError, match="must not set 'client'"):
        OffloadConfig.from_extra_config({"cpu_bytes": "1G", "remote_store": "redis", "remote_options": {"client": 1}})


def test_marker_goes_in_only_once_every_worker_wrote_its_shard() -> None:
    pool: dict = {}
    tier, remote = _planner(pool, reporters=2)
    keys = [_key(1), _key(2)]
    _store(tier, keys)
    remote.stored(keys, 5)
    [write] = remote.take_step().writes
    assert write.keys == tuple(keys) and all(tier.pin_count(k) == 1 for k in keys)
    remote.write_finished(5, ok=True)
    assert pool == {} and tier.pin_count(keys[0]) == 1  # one shard of two: no marker yet
    remote.write_finished(5, ok=True)
    assert len(pool) == 2 and all(tier.pin_count(k) == 0 for k in keys)
    # Another engine (its own planner, same pool) sees them once its CPU tier lacks them.
    _, other = _planner(pool)
    assert other.present("r", keys + [_key(3)], step=1) == frozenset(keys)
    # Written once: the same blocks stored again are not written again.
    remote.stored(keys, 6)
    assert remote.take_step().writes == ()


def test_a_write_failed_on_one_worker_leaves_no_marker() -> None:
    pool: dict = {}
    tier, remote = _planner(pool, reporters=2)
    keys = [_key(1)]
    _store(tier, keys)
    remote.stored(keys, 1)
    remote.take_step()
    remote.write_finished(1, ok=True)
    remote.write_finished(1, ok=False)
    assert pool == {} and tier.pin_count(keys[0]) == 0 and remote.counters.write_failures == 1
    _, other = _planner(pool)
    assert other.present("r", keys, 1) == frozenset()


def test_presence_is_cached_per_request_then_refreshed() -> None:
    pool: dict = {}
    tier, writer = _planner(pool)
    _, reader = _planner(pool)
    assert reader.present("r", [_key(1)], step=10) == frozenset()
    _store(tier, [_key(1)])
    writer.stored([_key(1)], 1)
    writer.take_step()
    writer.write_finished(1, ok=True)
    assert reader.present("r", [_key(1)], step=10 + PRESENT_TTL_STEPS - 1) == frozenset()
    assert reader.present("r", [_key(1)], step=10 + PRESENT_TTL_STEPS) == frozenset([_key(1)])
    assert reader.counters.lookups == 2


def test_a_failed_fetch_removes_the_markers_for_every_engine() -> None:
    pool: dict = {}
    tier, writer = _planner(pool)
    keys = [_key(1), _key(2)]
    _store(tier, keys)
    writer.stored(keys, 1)
    writer.take_step()
    writer.write_finished(1, ok=True)
    _, reader = _planner(pool)
    reader.fetch_finished(Fetch(list(keys)), ok=False)
    assert pool == {} and reader.counters.fetch_failures == 1


def test_reset_moves_to_a_new_epoch_and_releases_pinned_slots() -> None:
    pool: dict = {}
    tier, remote = _planner(pool)
    keys = [_key(1)]
    _store(tier, keys)
    remote.stored(keys, 1)
    remote.take_step()
    remote.write_finished(1, ok=True)
    assert remote.present("r", keys, 1) == frozenset()  # still in this engine's CPU tier
    tier.drop(keys)
    assert remote.present("r2", keys, 1) == frozenset(keys)
    pending = [_key(2)]
    _store(tier, pending)
    remote.stored(pending, 2)  # not sent yet
    remote.clear()  # moves to namespace epoch 1
    tier.clear()
    remote.after_tier_clear()
    assert tier.view().retired == {} and remote.take_step() == TierStep(epoch=1)
    assert remote.present("r3", keys, 2) == frozenset()  # what was written before the reset is not seen


def test_worker_puts_its_shard_and_fetches_it_back(tmp_path) -> None:
    pool: dict = {}
    shard = RemoteFingerprint(model="m", layout="oc-slot", dtype="bf16", group_block_bytes=(SLOT, SLOT // 2),
                              block_sizes=(16, 16), tp_rank=1, tp_size=2)
    host = torch.zeros(8, SLOT, dtype=torch.uint8)
    w = WorkerRemoteTier(DictStore(shard, pool), host, [SLOT, SLOT // 2])
    host[0] = torch.arange(SLOT).remainder(253).to(torch.uint8)
    host[1, : SLOT // 2] = 9
    keys = (_key(1, 0), _key(2, 1))
    w.apply(TierStep(writes=(TierWrite(4, keys, (0, 1)),)))
    end = time.monotonic() + 10
    done: list[int] = []
    while not done and time.monotonic() < end:
        done = w.finished_writes()[0]
    assert done == [4] and len(pool) == 2
    [io] = w.read_back(TierRead(SHARED, keys, (5, 6)))
    while not io.done() and time.monotonic() < end:
        time.sleep(0.005)
    assert io.ok and torch.equal(host[5], host[0]) and torch.equal(host[6, : SLOT // 2], host[1, : SLOT // 2])
    written, read, failures = w.io_deltas()
    assert written == read == SLOT + SLOT // 2 and failures == 0
    # Another rank's shard of the same block is another key: a rank-0 reader misses.
    other = WorkerRemoteTier(DictStore(RemoteFingerprint(**{**shard.__dict__, "tp_rank": 0}), pool), host,
                             [SLOT, SLOT // 2])
    [miss] = other.read_back(TierRead(SHARED, keys[:1], (5,)))
    while not miss.done() and time.monotonic() < end:
        time.sleep(0.005)
    assert not miss.ok and "missing or rejected" in miss.error
    w.close()
    other.close()
