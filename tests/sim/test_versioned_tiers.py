"""Stored KV is scoped by the vLLM release that wrote it: a disk tier written by an engine of another release (and,
with 0.34's default block size of 64 instead of 16, another layout of the same model) is refused at start-up with
the fingerprint's differences, and a shared tier's keys differ, so neither is ever served.

The cross-release test writes a disk tier from another of this project's environments (a subprocess of its Python)
for the Gemma 4 31B layout that release plans, and opens it here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from offload_connector.compat import vllm_release
from offload_connector.disk import DiskFingerprint, DiskStore
from offload_connector.disk.format import HEADER_BYTES, slot_stride
from offload_connector.disk.index import FingerprintMismatch
from offload_connector.remote.base import RemoteFingerprint, RemoteKey
from tests.engine_helpers import REPO

# Which other environment to write with, from this one's release.
OTHER_ENV = {"0.32": ".venv-vllm034", "0.33": ".venv-vllm034", "0.34": ".venv-vllm033"}

WRITE = textwrap.dedent("""
    import json, sys
    import torch
    from offload_bench.sim.scenarios import GEMMA4_SEED, connector_config, plan_scenario
    from offload_connector.disk import DiskStore
    from offload_connector.disk.format import HEADER_BYTES, slot_stride
    from offload_connector.groups import group_block_bytes
    from offload_connector.worker.shard import WorkerRank, fingerprint_for

    vc, sim = plan_scenario(GEMMA4_SEED, connector_config("exact", 1 << 30))
    kc = sim.worker_kv_cache_config
    group_bytes = [group_block_bytes(g, kc) for g in kc.kv_cache_groups]
    fp = fingerprint_for(vc, kc, group_bytes, max(group_bytes), WorkerRank(0, 0, 0, 1, 1))
    with DiskStore(sys.argv[1], fp, HEADER_BYTES + 2 * slot_stride(fp.slot_bytes)) as store:
        assert store.write((0, b"block"), torch.ones(fp.slot_bytes, dtype=torch.uint8)).wait()
    print(fp.to_json().decode())
""")


def _gemma_fingerprint(python: str, directory: str) -> DiskFingerprint:
    # Each release's own default block size (the suite may pin the simulation's to 16).
    env = {**{k: v for k, v in os.environ.items() if k != "OC_SIM_BLOCK_SIZE"},
           "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'benchmarks'}", "VLLM_TARGET_DEVICE": "cpu",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run([python, "-c", WRITE, directory], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return DiskFingerprint.from_json(done.stdout.strip().splitlines()[-1].encode())


def test_fingerprints_name_the_release() -> None:
    base = dict(model="m", group_block_bytes=(4096,), block_sizes=(16,), dtype="bf16", slot_bytes=4096)
    a, b = DiskFingerprint(**base, vllm="0.33"), DiskFingerprint(**base, vllm="0.34")
    assert a.differences(b) == ["vllm: '0.34' on disk, '0.33' wanted"]
    # A file written before the field existed reads as release "" and is refused too.
    legacy = json.loads(a.to_json())
    del legacy["vllm"]
    assert DiskFingerprint.from_json(json.dumps(legacy).encode()).vllm == ""
    ra = RemoteFingerprint.from_disk(a, layout="oc-slot")
    rb = RemoteFingerprint.from_disk(b, layout="oc-slot")
    assert ra.vllm == "0.33" and RemoteKey(ra).name(0, b"h") != RemoteKey(rb).name(0, b"h")
    assert vllm_release() and vllm_release().count(".") == 1


def test_a_disk_tier_from_another_release_is_never_served(tmp_path) -> None:
    release = vllm_release()
    other = REPO / OTHER_ENV.get(release, ".venv-vllm033") / "bin" / "python"
    if not other.exists():
        pytest.skip(f"{other.parent.parent.name} is not set up (scripts/setup-envs builds it)")
    theirs = _gemma_fingerprint(str(other), str(tmp_path / "theirs"))
    ours = _gemma_fingerprint(sys.executable, str(tmp_path / "ours"))
    assert theirs.vllm != ours.vllm == release
    assert theirs.model == ours.model
    diffs = ours.differences(theirs)
    assert any(d.startswith("vllm: ") for d in diffs), diffs
    # 0.34 lays Gemma 4 out in blocks of 64/128 tokens, 0.32/0.33 in 16/32: the same model, other blocks.
    if {theirs.vllm, ours.vllm} == {"0.33", "0.34"}:
        assert theirs.block_sizes != ours.block_sizes and any(d.startswith("block_sizes") for d in diffs)
    with pytest.raises(FingerprintMismatch, match="vLLM release .*vllm: '" + theirs.vllm):
        DiskStore(str(tmp_path / "theirs"), ours, HEADER_BYTES + 2 * slot_stride(ours.slot_bytes))
    with DiskStore(str(tmp_path / "theirs"), ours, HEADER_BYTES + 2 * slot_stride(ours.slot_bytes),
                   on_mismatch="reset") as store:
        assert len(store) == 0 and not store.contains((0, b"block"))
