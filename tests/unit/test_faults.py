"""worker/faults.py: the debug section's faults wrapped around a fake copier and the transfer engine, each doing what
its key says, and nothing installed without a debug section."""

import logging
import time

import pytest
import torch

from offload_connector.config import DebugConfig
from offload_connector.metadata import TransferJob
from offload_connector.worker.faults import (
    CorruptingCopier, FaultyTransferEngine, LateCopy, WorkerFaults, install_faults,
)
from offload_connector.worker.transfers import TransferEngine


class _Done:
    def query(self):
        return True

    def wait(self):
        pass

    def order_before(self, stream):
        pass


class FakeCopier:
    """Records every copy; each lands at once."""
    name = "fake"

    def __init__(self):
        self.copies = []

    def copy(self, direction, ids, stream=None):
        self.copies.append((direction, [None if p is None else [int(b) for b in p[1]] for p in ids]))
        return _Done()


def _job(job_id, rid, blocks, slots, **extra):
    return TransferJob(job_id, rid, (tuple(blocks),), (tuple(slots),), **extra)


def _messages(caplog):
    # Each record once: conftest also hangs caplog's handler on the connector's loggers, and a record may reach it
    # along both paths.
    return [r.getMessage() for r in {id(r): r for r in caplog.records}.values()]


def _engine(debug, rank=0, copier=None, **kwargs):
    faults = install_faults(debug, lambda: rank)
    copier = copier or FakeCopier()
    if faults is None:
        return None, copier, TransferEngine(copier, 1, [8], torch.device("cpu"), **kwargs)
    engine = faults.transfer_engine(copier, 1, [8], torch.device("cpu"), segments=[[0]],
                                    views=[torch.zeros(4, 8, dtype=torch.uint8)], **kwargs)
    return faults, copier, engine


def test_nothing_is_installed_without_a_debug_section():
    asked = []
    assert install_faults(DebugConfig(), lambda: asked.append(1) or 0) is None
    assert asked == []  # the rank is not even asked for


def test_a_worker_without_a_debug_section_runs_the_plain_engine():
    from tests.unit.test_worker import PAGE, aliased_gemma_like, make_worker
    config, caches, _ = aliased_gemma_like()
    worker = make_worker(config, caches, 8 * 2 * PAGE)
    assert worker.faults is None and type(worker.engine) is TransferEngine
    worker = make_worker(config, caches, 8 * 2 * PAGE, debug={"load_delay_steps": 1})
    assert isinstance(worker.faults, WorkerFaults) and type(worker.engine) is FaultyTransferEngine


def test_fail_load_reports_every_load_failed_without_copying(caplog):
    with caplog.at_level(logging.WARNING):
        faults, copier, engine = _engine(DebugConfig(fail_load=True))
    assert sum("debug.fail_load is on" in m for m in _messages(caplog)) == 1
    engine.submit_load(_job(1, "a", [3], [0]))
    engine.submit_load(_job(2, "b", [4], [1], fail_reason="no room"))  # the scheduler's reason wins
    assert [(r.job.request_id, r.ok, r.nbytes) for r in engine.poll()] == [("a", False, 0), ("b", False, 0)]
    assert copier.copies == []
    assert "failed: injected failure" in caplog.text and "failed: no room" in caplog.text
    engine.submit_store(_job(3, "c", [5], [2]))  # stores still copy
    assert [r.ok for r in engine.poll()] == [True] and copier.copies == [("d2h", [[5]])]


@pytest.mark.parametrize("rank", [0, 1])
def test_fail_ranks_fail_only_the_named_worker_and_can_be_cleared(rank):
    faults, copier, engine = _engine(DebugConfig(fail_load_ranks=(1,), fail_store_ranks=(1,)), rank=rank)
    assert (faults.rank, faults.fail_loads, faults.fail_stores) == (rank, rank == 1, rank == 1)
    engine.submit_store(_job(1, "a", [2], [0]))
    engine.submit_load(_job(2, "b", [5], [0]))
    assert [(r.kind, r.ok) for r in engine.poll()] == [("store", rank == 0), ("load", rank == 0)]
    assert len(copier.copies) == (0 if rank == 1 else 2)
    faults.fail_loads = faults.fail_stores = False  # what the engine tests' clear_worker_faults does
    engine.submit_store(_job(3, "c", [2], [0]))
    engine.submit_load(_job(4, "d", [5], [0]))
    assert [r.ok for r in engine.poll()] == [True, True]


def test_corrupt_load_negates_the_first_loaded_block_after_the_copy():
    views = [torch.full((4, 8), 0x11, dtype=torch.uint8), torch.full((4, 8), 0x22, dtype=torch.uint8)]
    inner = FakeCopier()
    copier = CorruptingCopier(inner, [[0, 1], []], views)
    assert copier.name == "fake"
    before = [v.clone() for v in views]
    ids = [(torch.tensor([0, 1]), torch.tensor([2, 3])), None]
    copier.copy("d2h", ids)
    assert all(torch.equal(v, b) for v, b in zip(views, before))  # stores untouched
    copier.copy("h2d", ids)
    assert inner.copies == [("d2h", [[2, 3], None]), ("h2d", [[2, 3], None])]
    for v, b in zip(views, before):
        assert torch.equal(v[2, 0::2], b[2, 0::2]) and torch.equal(v[2, 1::2], b[2, 1::2] ^ 0x80)
        assert torch.equal(v[[0, 1, 3]], b[[0, 1, 3]])  # only the first block of the load


def test_corrupt_load_is_installed_around_the_engines_copier():
    faults, copier, engine = _engine(DebugConfig(corrupt_load=True))
    assert isinstance(engine._copier, CorruptingCopier)
    faults, copier, engine = _engine(DebugConfig(fail_load=True))
    assert engine._copier is copier


def test_copy_delay_issues_loads_late_and_only_loads():
    faults, copier, engine = _engine(DebugConfig(copy_delay_s=0.2))
    engine.submit_store(_job(1, "a", [2], [0]))
    assert copier.copies == [("d2h", [[2]])]  # at once
    engine.submit_load(_job(2, "b", [5], [0]))
    assert [r.kind for r in engine.poll()] == ["store"]  # the load has not landed: not issued yet
    assert len(copier.copies) == 1
    time.sleep(0.25)
    results = engine.poll()
    assert ("load", True) in [(r.kind, r.ok) for r in results] and copier.copies[-1] == ("h2d", [[5]])


def test_late_copy_waits_out_its_delay():
    issued = []
    late = LateCopy(lambda: (issued.append(time.perf_counter()) or _Done(), None), 0.15)
    assert not late.started and not late.query() and issued == []
    t0 = time.perf_counter()
    late.order_before(None)  # a copy not issued yet is waited for on the host
    assert time.perf_counter() - t0 > 0.1 and len(issued) == 1 and late.started and late.query()
    late.wait()
    assert len(issued) == 1  # issued once


def test_a_late_copy_that_raises_lands_as_a_failure():
    def boom():
        raise RuntimeError("copy failed")
    late = LateCopy(boom, 0.0)
    assert late.query() and late.failure == "copy failed"


def test_load_delay_steps_holds_load_reports_that_many_steps():
    faults = WorkerFaults(DebugConfig(load_delay_steps=2), 0)
    assert faults.report_loads([("a", True)]) == []
    assert faults.report_loads([("b", False)]) == []
    assert faults.report_loads([]) == [("a", True)]
    assert faults.report_loads([]) == [("b", False)]
    assert faults.report_loads([]) == [] and faults.held == []


def test_load_delay_steps_in_the_worker_holds_reports_but_counts_the_load_when_it_lands():
    from offload_connector.metadata import OffloadMetadata
    from tests.unit.test_worker import PAGE, aliased_gemma_like, job, make_worker
    config, caches, _ = aliased_gemma_like()
    worker = make_worker(config, caches, 8 * 2 * PAGE, debug={"load_delay_steps": 2})
    worker.start(OffloadMetadata(step=1, stores=(job(1, "a", [(2, 5, 0)]),)))
    worker.transfer_results()
    worker.take_stats()
    worker.start(OffloadMetadata(step=2, loads=(job(2, "b", [(2, 9, 0)]),)))
    assert worker.transfer_results() == (set(), set(), set())
    assert worker.take_stats().data["counters"]["loaded_bytes"] > 0  # counted when it landed
    assert worker.transfer_results() == (set(), set(), set())
    assert worker.transfer_results() == (set(), {"b"}, set())


def test_each_fault_is_announced_once_at_install(caplog):
    with caplog.at_level(logging.WARNING):
        install_faults(DebugConfig(corrupt_load=True, copy_delay_s=1.5, fail_store_ranks=(0,)), lambda: 0)
    messages = _messages(caplog)
    assert sum("debug.corrupt_load is on" in m for m in messages) == 1
    assert sum("debug.copy_delay_s is on: the copy of every load is issued 1.5 s late" in m for m in messages) == 1
    assert sum("debug.fail_store_ranks names this worker (rank 0)" in m for m in messages) == 1
    assert not any("fail_load" in m for m in messages)
