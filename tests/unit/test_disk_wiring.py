"""The disk tier wired into the connector, without an engine: the scheduler side's planner (what is written, dropped,
read back; reports from several workers; resets; recovery from the workers' files) and one worker's executor over a
real file and a CPU host tier. End to end in a real engine: tests/engine/test_disk_engine.py."""

from __future__ import annotations

import os
import time

import pytest
import torch

from offload_connector.config import ConfigError, OffloadConfig
from offload_connector.disk import DiskFingerprint, DiskStore
from offload_connector.disk.format import HEADER_BYTES, slot_stride
from offload_connector.disk.placement import disk_budget, disk_slots, rank_dir
from offload_connector.transfer_jobs import DISK, TierRead, TierStep, TierWrite, TransferJob
from offload_connector.scheduler.disk_tier import DiskTierPlanner
from offload_connector.scheduler.write_through import max_writing_blocks
from offload_connector.scheduler.tier_index import TierIndex
from offload_connector.worker.disk_io import WorkerDiskTier

SLOT = 4096


def _key(i: int, g: int = 0) -> tuple[int, bytes]:
    return (g, i.to_bytes(32, "little"))


def _planner(cpu_slots: int = 16, disk_slots_: int = 8, reporters: int = 1, max_writing: int = 64):
    tier = TierIndex(cpu_slots, [SLOT, SLOT])
    return tier, DiskTierPlanner(tier, disk_slots_, reporters, max_writing)


def _store(tier: TierIndex, keys: list) -> None:
    tier.begin_store(keys)
    tier.finish_store(keys)


# ------------------------------------------------------------------------------------------ config
def test_config_needs_both_disk_keys_and_names_them() -> None:
    with pytest.raises(ConfigError, match="'disk_bytes' is missing"):
        OffloadConfig.from_extra_config({"cpu_bytes": "1G", "disk_path": "/tmp/x"})
    with pytest.raises(ConfigError, match="'disk_path' is missing"):
        OffloadConfig.from_extra_config({"cpu_bytes": "1G", "disk_bytes": "1G"})
    with pytest.raises(ConfigError, match="'disk_path' must be"):
        OffloadConfig.from_extra_config({"cpu_bytes": "1G", "disk_path": "", "disk_bytes": "1G"})
    with pytest.raises(ConfigError, match="'disk_bytes' must be"):
        OffloadConfig.from_extra_config({"cpu_bytes": "1G", "disk_path": "/tmp/x", "disk_bytes": -5})
    cfg = OffloadConfig.from_extra_config({"cpu_bytes": "1G", "disk_path": "~/kv", "disk_bytes": "2G"})
    assert cfg.disk_path == os.path.expanduser("~/kv") and cfg.disk_bytes == 2 * 2**30


def test_disk_dir_check_refuses_what_cannot_work(tmp_path) -> None:
    from offload_connector.config import check_disk_dir
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="'disk_path'.*cannot be created"):
        check_disk_dir(str(blocker / "sub"), 10**6)
    with pytest.raises(ConfigError, match="'disk_bytes' asks for .* free"):
        check_disk_dir(str(tmp_path / "d"), 2**62)
    check_disk_dir(str(tmp_path / "d"), 10**6, workers=2)
    assert (tmp_path / "d").is_dir()


def test_slot_count_is_one_function_for_both_sides() -> None:
    n = disk_slots(10 * 2**20, SLOT)
    assert n == (10 * 2**20 - HEADER_BYTES) // slot_stride(SLOT)
    assert disk_budget(n, SLOT) <= 10 * 2**20 < disk_budget(n + 1, SLOT)
    with pytest.raises(ValueError, match="'disk_bytes'"):
        disk_slots(HEADER_BYTES, SLOT)
    assert max_writing_blocks(8) == 4 and max_writing_blocks(100) == 25 and max_writing_blocks(1000) == 250


# ------------------------------------------------------------------------------------ scheduler side
def test_landed_store_is_written_through_pinned_until_every_worker_reports() -> None:
    tier, disk = _planner(reporters=2)
    keys = [_key(i) for i in range(3)]
    _store(tier, keys)
    disk.stored(keys, job_id=7)
    step = disk.take_step()
    assert step == TierStep(writes=(TierWrite(7, tuple(keys), tuple(tier.slot_of(k) for k in keys)),))
    assert all(tier.pin_count(k) == 1 for k in keys)  # a write reads the slots: they must not be evicted
    assert not any(disk.readable(k) for k in keys)
    disk.write_finished(7, ok=True)  # one worker of two
    assert not disk.catalog.contains(keys[0]) and tier.pin_count(keys[0]) == 1
    disk.write_finished(7, ok=True)
    assert all(disk.catalog.contains(k) and tier.pin_count(k) == 0 for k in keys)
    # The CPU tier still has them: a lookup reads memory, not disk.
    assert not disk.readable(keys[0])
    tier.drop([keys[0]])
    assert disk.readable(keys[0])
    assert disk.counters.writes_landed == 3 and not disk.busy()


def test_a_write_failed_on_one_worker_is_dropped_on_all() -> None:
    tier, disk = _planner(reporters=2)
    keys = [_key(i) for i in range(2)]
    _store(tier, keys)
    disk.stored(keys, job_id=1)
    disk.take_step()
    disk.write_finished(1, ok=True)
    disk.write_finished(1, ok=False)
    assert not any(disk.catalog.get(k) for k in keys) and disk.catalog.used_slots() == 0
    assert all(tier.pin_count(k) == 0 for k in keys)
    drops = disk.take_step().drops
    assert set(drops) == set(keys)  # the worker that wrote them forgets them too
    assert disk.counters.write_failures == 2


def test_disk_eviction_drops_lru_everywhere_and_never_a_key_being_read() -> None:
    tier, disk = _planner(cpu_slots=32, disk_slots_=4)
    first = [_key(i) for i in range(4)]
    _store(tier, first)
    disk.stored(first, 1)
    disk.take_step()
    disk.write_finished(1, ok=True)
    tier.drop(first)
    back = disk.pin_for_read([first[0]])  # being read back: not a victim
    more = [_key(10), _key(11)]
    _store(tier, more)
    disk.stored(more, 2)
    step = disk.take_step()
    drops, writes = step.drops, step.writes
    assert set(drops) == {first[1], first[2]} and writes[0].keys == tuple(more)
    assert disk.catalog.contains(first[0]) and disk.counters.evictions == 2
    disk.read_finished(back, ok=True)
    assert disk.counters.promoted_blocks == 1


def test_a_failed_read_back_forgets_its_keys_everywhere() -> None:
    tier, disk = _planner()
    keys = [_key(i) for i in range(3)]
    _store(tier, keys)
    disk.stored(keys, 1)
    disk.take_step()
    disk.write_finished(1, ok=True)
    tier.drop(keys)
    back = disk.pin_for_read(keys[:2])
    disk.read_finished(back, ok=False)
    assert not disk.catalog.contains(keys[0]) and not disk.catalog.contains(keys[1]) and disk.catalog.contains(keys[2])
    assert set(disk.take_step().drops) == set(keys[:2])
    assert disk.counters.read_failures == 1


def test_writes_in_flight_are_capped_and_skipped_past_the_cap() -> None:
    tier, disk = _planner(max_writing=2)
    keys = [_key(i) for i in range(5)]
    _store(tier, keys)
    disk.stored(keys, 1)
    assert disk.take_step().writes[0].keys == tuple(keys[:2])
    assert disk.counters.write_skips == 3
    assert all(tier.pin_count(k) == 0 for k in keys[2:])


def test_reset_forgets_the_disk_tier_and_releases_every_slot() -> None:
    tier, disk = _planner()
    sent, unsent = [_key(1), _key(2)], [_key(3)]
    _store(tier, sent + unsent)
    disk.stored(sent, 1)
    disk.take_step()  # job 1 is with the workers
    disk.stored(unsent, 2)  # job 2 is not sent yet
    sent_slots = {tier.slot_of(k) for k in sent}
    disk.clear()
    tier.clear()
    disk.after_tier_clear()
    assert disk.take_step() == TierStep(clear=True)
    assert len(disk.catalog) == 0
    assert set(tier.view().retired) == sent_slots  # job 1's slots wait for its report; job 2's are free
    disk.write_finished(1, ok=False)  # the workers' clear dropped it while it was being written
    assert tier.view().retired == {} and tier.used_slots() == 0
    assert not disk.busy()


# ------------------------------------------------------------------------------------- recovery
def _fp(extra: str = "") -> DiskFingerprint:
    return DiskFingerprint("m", (SLOT, SLOT), (16, 16), "bf16", SLOT, extra)


def _write(store: DiskStore, keys: list) -> None:
    for k in keys:
        assert store.write(k, bytes([k[1][0]]) * SLOT).wait(10)


def test_recovery_keeps_what_every_worker_holds(tmp_path) -> None:
    n = 16
    budget = disk_budget(n, SLOT)
    both, only0 = [_key(i) for i in range(5)], [_key(20), _key(21)]
    with DiskStore(rank_dir(str(tmp_path), 0, 0, 0), _fp("tp0"), budget) as s0:
        _write(s0, both + only0)
    with DiskStore(rank_dir(str(tmp_path), 0, 0, 1), _fp("tp1"), budget) as s1:
        _write(s1, both)
    tier, disk = _planner(disk_slots_=n)
    disk.recover(str(tmp_path), dp_rank=0, pp_size=1, tp_size=2)
    assert {k for k in both if disk.readable(k)} == set(both)
    assert not any(disk.catalog.get(k) for k in only0)
    assert set(disk.take_step().drops) == set(only0)
    assert disk.counters.recovered == 5 and disk.counters.dropped_at_start == 2
    # A worker with no file yet (a new rank): nothing is recoverable, everything found is dropped.
    tier, disk = _planner(disk_slots_=n)
    disk.recover(str(tmp_path), dp_rank=0, pp_size=1, tp_size=3)
    assert len(disk.catalog) == 0 and len(disk.take_step().drops) == 7


def test_recovery_uses_the_smallest_worker_file(tmp_path) -> None:
    with DiskStore(rank_dir(str(tmp_path), 0, 0, 0), _fp(), disk_budget(4, SLOT)) as s0:
        _write(s0, [_key(i) for i in range(4)])
    tier, disk = _planner(disk_slots_=100)
    disk.recover(str(tmp_path), 0, 1, 1)
    assert disk.catalog.num_slots == 4 and len(disk.catalog) == 4


# ------------------------------------------------------------------------------------- worker side
def _worker(tmp_path, fp=None) -> tuple[WorkerDiskTier, torch.Tensor]:
    host = torch.zeros(8, SLOT, dtype=torch.uint8)
    store = DiskStore(str(tmp_path / "w"), fp or _fp(), disk_budget(8, SLOT), on_mismatch="reset")
    return WorkerDiskTier(store, host, [SLOT, SLOT // 2]), host


def _until(pred, timeout: float = 10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        out = pred()
        if out:
            return out
        time.sleep(0.005)
    raise AssertionError("timed out")


def test_worker_writes_then_reads_back_the_same_bytes(tmp_path) -> None:
    w, host = _worker(tmp_path)
    host[0] = torch.arange(SLOT, dtype=torch.int64).remainder(251).to(torch.uint8)
    host[1, : SLOT // 2] = 7  # a group-1 block: half a slot
    keys = (_key(1, g=0), _key(2, g=1))
    w.apply(TierStep(writes=(TierWrite(5, keys, (0, 1)),)))
    done = []
    _until(lambda: done.extend(w.finished_writes()[0]) or done)
    assert done == [5]
    job = TransferJob(9, "r", ((3, 4), ()), ((2, 3), ()), reads=(TierRead(DISK, keys, (2, 3)),))
    ios = w.read_back(job.reads[0])
    _until(lambda: all(io.done() for io in ios))
    assert [io.ok for io in ios] == [True, True]
    assert torch.equal(host[2], host[0]) and torch.equal(host[3, : SLOT // 2], host[1, : SLOT // 2])
    written, read, failures = w.io_deltas()
    assert written == SLOT + SLOT // 2 and read == written and failures == 0
    w.close()


def test_worker_read_of_a_corrupt_slot_fails_the_load(tmp_path) -> None:
    w, host = _worker(tmp_path)
    host[0] = 3
    w.apply(TierStep(writes=(TierWrite(1, (_key(1),), (0,)),)))
    _until(lambda: w.finished_writes()[0])
    path = w.store.path
    with open(path, "r+b") as f:  # flip one byte of slot 0's data
        f.seek(HEADER_BYTES + 100)
        b = f.read(1)
        f.seek(HEADER_BYTES + 100)
        f.write(bytes([b[0] ^ 0xFF]))
    [io] = w.read_back(TierRead(DISK, (_key(1),), (5,)))
    _until(io.done)
    assert not io.ok and "corrupt" in io.error
    assert w.io_deltas()[2] >= 1
    w.close()


def test_worker_clear_and_drops_follow_the_metadata_order(tmp_path) -> None:
    w, host = _worker(tmp_path)
    w.apply(TierStep(writes=(TierWrite(1, (_key(1), _key(2)), (0, 1)),)))
    _until(lambda: w.finished_writes()[0])
    w.apply(TierStep(drops=(_key(1),)))
    assert not w.store.contains(_key(1)) and w.store.contains(_key(2))
    w.apply(TierStep(clear=True, writes=(TierWrite(2, (_key(3),), (2,)),)))
    _until(lambda: w.finished_writes()[0])
    assert w.store.keys() == [_key(3)]
    w.close()


def test_a_different_model_never_reads_the_file(tmp_path) -> None:
    w, host = _worker(tmp_path)
    host[0] = 9
    w.apply(TierStep(writes=(TierWrite(1, (_key(1),), (0,)),)))
    _until(lambda: w.finished_writes()[0])
    w.close()
    other, _ = _worker(tmp_path, DiskFingerprint("another-model", (SLOT, SLOT), (16, 16), "bf16", SLOT))
    assert len(other.store) == 0  # reset, not read
    other.close()
    same, _ = _worker(tmp_path, DiskFingerprint("another-model", (SLOT, SLOT), (16, 16), "bf16", SLOT))
    assert len(same.store) == 0
    same.close()
