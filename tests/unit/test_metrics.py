"""Connector statistics: the KVConnectorStats payload, its Prometheus metrics, and vLLM's own stats path."""

from __future__ import annotations

import re

import functools
import pickle
import threading
from typing import Any

import pytest
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from offload_connector import metrics as m
from offload_connector.connector import OffloadConnector
from offload_connector.metrics import OffloadStats, OffloadStatsSink, build_kv_connector_stats
from offload_connector.metrics_prom import METRIC_NAMES, OffloadPromMetrics, build_prom_metrics

LABELNAMES = ["model_name", "engine"]


class MetricsShimConnector(OffloadConnector):
    """The one-line wiring connector.py is to get, so vLLM's own stats path can be exercised before it lands."""

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> OffloadStats:
        return build_kv_connector_stats(data)

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> OffloadPromMetrics:
        return build_prom_metrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def _wired() -> bool:
    return "build_prom_metrics" in OffloadConnector.__dict__


CONNECTORS = ["MetricsShimConnector", pytest.param("OffloadConnector", marks=pytest.mark.skipif(
    not _wired(), reason="connector.py does not expose the metrics hooks yet"))]


def _stats(**kw: Any) -> OffloadStats:
    s = OffloadStats()
    for direction, blocks, nbytes, secs in kw.get("transfers", []):
        s.record_transfer(direction, blocks, nbytes, secs)
    for reason in kw.get("deferrals", []):
        s.record_deferral(reason)
    for key, value in kw.get("gauges", {}).items():
        s.set_gauge(key, value)
    return s


# ---------------------------------------------------------------------------------------------- payload semantics
def test_counters_add_gauges_take_latest_samples_concatenate() -> None:
    a = _stats(transfers=[("load", 4, 400, 0.01), ("store", 2, 200, 0.02)], deferrals=["pool_full"],
               gauges={m.TIER_USED: 10, m.TIER_CAPACITY: 100})
    b = _stats(transfers=[("load", 1, 100, 0.03)], deferrals=["pool_full", "aged_out"],
               gauges={m.TIER_USED: 12})
    out = a.aggregate(b)
    assert out is a
    c = a.data[m.COUNTERS]
    assert (c[m.LOADED_BLOCKS], c[m.LOADED_BYTES], c[m.STORED_BLOCKS], c[m.STORED_BYTES]) == (5, 500, 2, 200)
    assert c["deferrals:pool_full"] == 2 and c["deferrals:aged_out"] == 1 and "deferrals:too_big" not in c
    assert a.data[m.GAUGES] == {m.TIER_USED: 12, m.TIER_CAPACITY: 100}  # b's used wins, a's capacity stays
    assert a.data[m.SAMPLES] == {m.LOAD_SECONDS: [0.01, 0.03], m.STORE_SECONDS: [0.02]}
    assert b.data[m.SAMPLES] == {m.LOAD_SECONDS: [0.03]}  # the merged-in object is not aliased


def test_aggregate_with_empty_and_into_empty() -> None:
    a = _stats(transfers=[("load", 1, 10, 0.5)])
    before = pickle.dumps(a.data)
    assert a.aggregate(OffloadStats()) is a and pickle.dumps(a.data) == before
    e = OffloadStats()
    e.aggregate(a)
    assert e.data == a.data
    e.data[m.SAMPLES][m.LOAD_SECONDS].append(1.0)
    assert a.data[m.SAMPLES][m.LOAD_SECONDS] == [0.5]


def test_failed_transfer_counts_only_as_failure_and_secondary_rank_skips_blocks() -> None:
    s = OffloadStats()
    s.record_transfer("load", 8, 800, 0.1, ok=False)
    s.record_transfer("store", 8, 800, 0.1, count_blocks=False)
    assert s.data[m.COUNTERS] == {m.LOAD_FAILURES: 1, m.STORED_BYTES: 800}
    assert s.data[m.SAMPLES] == {m.STORE_SECONDS: [0.1]}


def test_is_empty_reset_and_unknown_names() -> None:
    s = OffloadStats()
    assert s.is_empty()
    s.record_transfer("load", 0, 0, 0.0)  # a job that moved nothing still took time and is observed
    assert not s.is_empty()
    s.reset()
    assert s.is_empty() and s.data == {m.COUNTERS: {}, m.GAUGES: {}, m.SAMPLES: {}}
    s.set_gauge(m.DEFERRED_REQUESTS, 0)
    assert not s.is_empty()  # a gauge going to 0 is news
    with pytest.raises(ValueError, match="unknown deferral reason"):
        s.record_deferral("because")
    with pytest.raises(ValueError):
        s.set_gauge("nope", 1)


def test_reduce_summarises_an_interval() -> None:
    s = _stats(transfers=[("load", 4, 2_000_000, 0.001), ("load", 4, 2_000_000, 0.003)],
               deferrals=["too_big", "too_big"], gauges={m.TIER_USED: 25, m.TIER_CAPACITY: 100})
    s.record_transfer("store", 1, 1, 1.0, ok=False)
    r = s.reduce()
    assert r["load_jobs"] == 2 and r[m.LOADED_BLOCKS] == 8 and r[m.LOADED_BYTES] == 4_000_000
    assert r["load_avg_ms"] == 2.0 and r["load_GBps"] == 1.0
    assert r["store_jobs"] == 0 and r[m.STORE_FAILURES] == 1 and "store_avg_ms" not in r
    assert r["deferrals_too_big"] == 2 and r["cpu_tier_usage_perc"] == 0.25
    assert OffloadStats().reduce() == {}


def test_build_kv_connector_stats_round_trips_to_dict_without_aliasing() -> None:
    s = _stats(transfers=[("store", 3, 300, 0.2)], gauges={m.TIER_CAPACITY: 7})
    payload = s.to_dict()
    rebuilt = build_kv_connector_stats(payload)
    assert isinstance(rebuilt, OffloadStats) and rebuilt.data == payload
    rebuilt.aggregate(s)
    assert payload[m.COUNTERS][m.STORED_BLOCKS] == 3
    assert build_kv_connector_stats(None).is_empty() and build_kv_connector_stats({}).is_empty()


def test_pickle_round_trip() -> None:
    s = _stats(transfers=[("load", 2, 20, 0.25)], deferrals=["pool_full"], gauges={m.DEFERRED_REQUESTS: 3})
    back = pickle.loads(pickle.dumps(s))
    assert type(back) is OffloadStats and back.data == s.data


def test_payload_survives_vllm_msgpack_in_scheduler_stats() -> None:
    # EngineCore -> frontend: SchedulerStats.kv_connector_stats is the dict, msgpack-encoded by vLLM.
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    s = _stats(transfers=[("load", 2, 20, 0.25)], deferrals=["aged_out"],
               gauges={m.TIER_USED: 1, m.TIER_CAPACITY: 2})
    eco = EngineCoreOutputs(scheduler_stats=SchedulerStats(kv_connector_stats=s.to_dict()))
    back = MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(eco))
    assert back.scheduler_stats.kv_connector_stats == s.to_dict()


# --------------------------------------------------------------------------------------------------------- sink
def test_sink_take_swaps_and_returns_none_when_idle() -> None:
    sink = OffloadStatsSink()
    assert sink.take() is None
    sink.record_transfer("load", 1, 10, 0.1)
    first = sink.take()
    assert first is not None and first.data[m.COUNTERS] == {m.LOADED_BLOCKS: 1, m.LOADED_BYTES: 10}
    assert sink.take() is None


def test_sink_evictions_delta_and_gauges_sent_only_on_change() -> None:
    sink = OffloadStatsSink()
    sink.record_tier(used_slots=5, total_slots=10, evictions_total=0)
    sink.record_deferred_requests(1)
    s = sink.take()
    assert s is not None and s.data[m.COUNTERS] == {}
    assert s.data[m.GAUGES] == {m.TIER_USED: 5, m.TIER_CAPACITY: 10, m.DEFERRED_REQUESTS: 1, m.EVICTION_BIAS: 0.0}
    sink.record_tier(5, 10, 0)
    sink.record_deferred_requests(1)
    assert sink.take() is None  # nothing changed: an idle engine sends nothing
    sink.record_tier(10, 10, 3)
    sink.record_tier(10, 10, 7)  # cumulative: called twice in one step, counted once
    s = sink.take()
    assert s.data[m.COUNTERS] == {m.EVICTIONS: 7}
    assert s.data[m.GAUGES] == {m.TIER_USED: 10, m.TIER_CAPACITY: 10, m.DEFERRED_REQUESTS: 1,
                                m.EVICTION_BIAS: 0.0}  # sent as a set
    sink.record_tier(1, 10, 2)  # the tier was rebuilt (reset): its count restarts
    assert sink.take().data[m.COUNTERS] == {m.EVICTIONS: 2}


def test_sink_is_thread_safe() -> None:
    sink = OffloadStatsSink()
    taken: list[OffloadStats] = []
    stop = threading.Event()

    def taker() -> None:
        while not stop.is_set():
            if (s := sink.take()) is not None:
                taken.append(s)

    t = threading.Thread(target=taker)
    t.start()
    workers = [threading.Thread(target=lambda: [sink.record_transfer("store", 1, 2, 0.0) for _ in range(2000)])
               for _ in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    stop.set()
    t.join()
    total = OffloadStats()
    for s in [*taken, sink.take() or OffloadStats()]:
        total.aggregate(s)
    assert total.data[m.COUNTERS] == {m.STORED_BLOCKS: 8000, m.STORED_BYTES: 16000}
    assert len(total.data[m.SAMPLES][m.STORE_SECONDS]) == 8000


# --------------------------------------------------------------------------------------------------- Prometheus
def _fresh_types(registry: CollectorRegistry) -> dict[type, Any]:
    # vLLM passes the metric classes in; binding a private registry keeps the test off the process-wide one.
    return {cls: functools.partial(cls, registry=registry) for cls in (Gauge, Counter, Histogram)}


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def _cfg() -> Any:
    from types import SimpleNamespace
    return SimpleNamespace(kv_transfer_config=None)


def test_prom_registers_every_name_with_zero_children() -> None:
    reg = CollectorRegistry()
    prom = build_prom_metrics(_cfg(), _fresh_types(reg), LABELNAMES, {0: ["m", "0"], 1: ["m", "1"]})
    assert isinstance(prom, OffloadPromMetrics)
    registered = {family.name for family in reg.collect()}  # prometheus_client drops a counter's "_total" here
    for name in METRIC_NAMES:
        assert name.removesuffix("_total") in registered, name
        assert name.startswith("vllm:offload_connector_")
    s = _samples(reg)
    for engine in ("0", "1"):
        lab = (("engine", engine), ("model_name", "m"))
        assert s[("vllm:offload_connector_loaded_bytes_total", lab)] == 0
        for reason in m.DEFERRAL_REASONS:
            assert s[("vllm:offload_connector_deferrals_total", (*lab, ("reason", reason)))] == 0
        assert s[("vllm:offload_connector_load_time_seconds_count", lab)] == 0


def test_prom_observe_increments_counters_sets_gauges_observes_histograms() -> None:
    reg = CollectorRegistry()
    prom = build_prom_metrics(_cfg(), _fresh_types(reg), LABELNAMES, {0: ["m", "0"], 1: ["m", "1"]})
    step1 = _stats(transfers=[("load", 4, 4096, 0.004), ("store", 2, 2048, 0.2)], deferrals=["pool_full"],
                   gauges={m.TIER_USED: 30, m.TIER_CAPACITY: 120, m.DEFERRED_REQUESTS: 2})
    step1.record_evictions(5)
    step1.record_transfer("load", 1, 1, 1.0, ok=False)
    prom.observe(step1.to_dict(), engine_idx=1)
    step2 = _stats(transfers=[("load", 1, 1024, 0.004)], deferrals=["too_big"], gauges={m.TIER_USED: 60})
    prom.observe(step2.to_dict(), engine_idx=1)
    prom.observe({m.COUNTERS: {"from_a_newer_version": 1}}, engine_idx=1)  # unknown keys are ignored
    s = _samples(reg)
    e1 = (("engine", "1"), ("model_name", "m"))
    e0 = (("engine", "0"), ("model_name", "m"))
    p = "vllm:offload_connector_"
    assert s[(p + "loaded_bytes_total", e1)] == 5120 and s[(p + "loaded_blocks_total", e1)] == 5
    assert s[(p + "stored_bytes_total", e1)] == 2048 and s[(p + "stored_blocks_total", e1)] == 2
    assert s[(p + "load_failures_total", e1)] == 1 and s[(p + "store_failures_total", e1)] == 0
    assert s[(p + "cpu_tier_evictions_total", e1)] == 5
    assert s[(p + "deferrals_total", (*e1, ("reason", "pool_full")))] == 1
    assert s[(p + "deferrals_total", (*e1, ("reason", "too_big")))] == 1
    assert s[(p + "deferrals_total", (*e1, ("reason", "aged_out")))] == 0
    assert s[(p + "cpu_tier_used_blocks", e1)] == 60 and s[(p + "cpu_tier_capacity_blocks", e1)] == 120
    # step2 carried `used` alone, so usage kept step1's pair (30/120): the sink always sends the two together.
    assert s[(p + "cpu_tier_usage_perc", e1)] == 0.25
    assert s[(p + "deferred_requests", e1)] == 2
    assert s[(p + "load_time_seconds_count", e1)] == 2 and s[(p + "load_time_seconds_sum", e1)] == 0.008
    assert s[(p + "load_time_seconds_bucket", tuple(sorted((*e1, ("le", "0.005")))))] == 2
    assert s[(p + "store_time_seconds_bucket", tuple(sorted((*e1, ("le", "0.1")))))] == 0
    assert s[(p + "store_time_seconds_bucket", tuple(sorted((*e1, ("le", "0.25")))))] == 1
    assert s[(p + "loaded_bytes_total", e0)] == 0  # engines are kept apart


# ----------------------------------------------------------------------------------- through vLLM's stats path
def _kv_transfer_config(connector: str) -> Any:
    from vllm.config import KVTransferConfig
    module = __name__ if connector == "MetricsShimConnector" else "offload_connector"
    return KVTransferConfig(kv_connector=connector, kv_connector_module_path=module, kv_role="kv_both",
                            kv_connector_extra_config={"cpu_bytes": 1 << 30})


def _worker_and_scheduler_payload() -> dict[str, Any]:
    """Two TP workers and the scheduler side, merged the way vLLM merges them, as the frontend receives it."""
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.v1.outputs import KVConnectorOutput

    from offload_bench.sim.vllm_compat import runner_output

    workers = []
    for rank in range(2):
        sink = OffloadStatsSink()
        sink.record_transfer("load", 16, 1000, 0.01, count_blocks=rank == 0)
        sink.record_transfer("store", 8, 500, 0.02, count_blocks=rank == 0)
        out = runner_output([], [], KVConnectorOutput(kv_connector_stats=sink.take()))
        workers.append(out)
    merged = KVOutputAggregator(expected_finished_count=2).aggregate(workers)
    worker_stats = merged.kv_connector_output.kv_connector_stats
    sched = OffloadStatsSink()
    sched.record_deferral("pool_full")
    sched.record_tier(3, 12, 1)
    sched_stats = sched.take()
    # Scheduler.update_from_output: worker_stats.aggregate(scheduler_stats), then make_stats -> to_dict().
    return worker_stats.aggregate(sched_stats).to_dict()


@pytest.mark.parametrize("connector", CONNECTORS)
def test_vllm_logging_and_prom_path(connector: str) -> None:
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging, KVConnectorProm
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics

    payload = _worker_and_scheduler_payload()
    assert payload[m.COUNTERS][m.LOADED_BLOCKS] == 16 and payload[m.COUNTERS][m.LOADED_BYTES] == 2000
    ktc = _kv_transfer_config(connector)

    logging = KVConnectorLogging(ktc)
    logging.observe(payload)
    logging.observe(payload)
    lines: list[str] = []
    logging.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    assert len(lines) == 1 and "loaded_blocks=32" in lines[0] and "deferrals_pool_full=2" in lines[0], lines

    unregister_vllm_metrics()
    try:
        prom = KVConnectorProm(SimpleNamespace(kv_transfer_config=ktc), LABELNAMES, {0: ["tiny", "0"]})
        assert isinstance(prom.prom_metrics, OffloadPromMetrics)
        prom.observe(payload, engine_idx=0)
        text = generate_latest(REGISTRY).decode()
    finally:
        unregister_vllm_metrics()
    assert 'vllm:offload_connector_loaded_blocks_total{engine="0",model_name="tiny"} 16.0' in text
    assert 'vllm:offload_connector_stored_bytes_total{engine="0",model_name="tiny"} 1000.0' in text
    assert 'vllm:offload_connector_deferrals_total{engine="0",model_name="tiny",reason="pool_full"} 1.0' in text
    assert 'vllm:offload_connector_cpu_tier_usage_perc{engine="0",model_name="tiny"} 0.25' in text


def test_prometheus_stat_logger_exports_our_metrics() -> None:
    """vLLM's PrometheusStatLogger, built from a real VllmConfig, records a SchedulerStats carrying our payload."""
    from vllm.v1.metrics.loggers import PrometheusStatLogger
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics
    from vllm.v1.metrics.stats import SchedulerStats

    from offload_bench.sim.layouts import build_vllm_config

    vc = build_vllm_config("tiny-llama", max_model_len=512, max_num_batched_tokens=256, num_gpu_blocks=64,
                           kv_transfer_config=_kv_transfer_config("MetricsShimConnector"))
    try:
        logger = PrometheusStatLogger(vc, engine_indexes=[0])
        logger.record(scheduler_stats=SchedulerStats(kv_connector_stats=_worker_and_scheduler_payload()),
                      iteration_stats=None, engine_idx=0)
        families = {f.name: f for f in text_string_to_metric_families(generate_latest(REGISTRY).decode())}
    finally:
        unregister_vllm_metrics()
    loaded = families["vllm:offload_connector_loaded_blocks"]  # the parser drops the counter's _total suffix
    assert [s.value for s in loaded.samples if s.name.endswith("_total")] == [16.0]
    assert {s.labels["engine"] for s in loaded.samples} == {"0"}
    stored_time = families["vllm:offload_connector_store_time_seconds"]
    assert [s.value for s in stored_time.samples if s.name.endswith("_count")] == [2.0]  # one per worker


def test_counts_blocks_without_parallel_groups() -> None:
    assert m.counts_blocks_here() is True  # tools and tests run outside vLLM's process groups


def test_module_imports_neither_side() -> None:
    # The frontend imports these through the connector class; they must not drag in the scheduler or worker side.
    import ast
    import inspect

    from offload_connector import metrics_prom

    for mod in (m, metrics_prom):
        tree = ast.parse(inspect.getsource(mod))
        names = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)] + \
                [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        assert not [n for n in names if n and (".scheduler" in n or ".worker" in n or n.startswith("torch"))]
    # One direction only: the Prometheus side reads the payload keys, the payload knows nothing of Prometheus.
    tree = ast.parse(inspect.getsource(m))
    ours = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and
            n.module.startswith("offload_connector")] + \
           [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
            if a.name.startswith("offload_connector")]
    assert ours == [], ours
    # ... and names no second tier: each declares its own metrics, registered beside its factories.
    source = inspect.getsource(m).split('"""', 2)[2]  # the code, past the module docstring's metric table
    assert not re.search(r"\b(disk|shared|remote)_tier", source), "metrics.py names a second tier"
    from offload_connector.second_tiers import SECOND_TIERS, tier_metrics
    from offload_connector.transfer_jobs import DISK, SHARED
    assert set(SECOND_TIERS) == {DISK, SHARED}
    assert {name: tier_metrics(name).name for name in SECOND_TIERS} == {DISK: DISK, SHARED: SHARED}


def test_a_second_tier_reports_through_the_generic_recorders_with_the_metrics_it_declares() -> None:
    """A tier that is not one of ours: its totals go out as deltas under its own keys, a rebuilt tier counts from
    its new zero, its gauges as values, its rejections by reason within its closed set, and a report that does not
    match its declaration is refused."""
    tier = m.TierMetrics(
        name="toy",
        planner_totals=(m.TierMetric("toy_a", "toy_a_total", "a"), m.TierMetric("toy_b", "toy_b_total", "b")),
        io=(m.TierMetric("toy_w", "toy_w_total", "w"), m.TierMetric("toy_r", "toy_r_total", "r"),
            m.TierMetric("toy_f", "toy_f_total", "f")),
        planner_gauges=(m.TierMetric("toy_used", "toy_used", "u"),),
        rejected=m.TierMetric("toy_rejected:", "toy_rejected_total", "x"), reject_reasons=("mac",))
    sink = m.OffloadStatsSink()
    sink.record_second_tier(tier, (5, 2), (7,))
    sink.record_tier_io(tier, 100, 50, 1)
    sink.record_rejections(tier, "worker", {"mac": 2, "other": 9})
    first = sink.take()
    assert first.data[m.COUNTERS] == {"toy_a": 5, "toy_b": 2, "toy_w": 100, "toy_r": 50, "toy_f": 1,
                                      "toy_rejected:mac": 2}
    assert first.data[m.GAUGES]["toy_used"] == 7
    reduced = first.reduce()
    assert reduced["toy_a"] == 5 and reduced["toy_w"] == 100 and "toy_rejected_mac" not in reduced
    sink.record_second_tier(tier, (6, 1), (7,))  # b went down: the tier was rebuilt
    assert sink.take().data[m.COUNTERS] == {"toy_a": 1, "toy_b": 1}
    with pytest.raises(ValueError, match="toy"):
        sink.record_second_tier(tier, (1,))


def test_stall_state_counter_once_and_gauge_while_stalled():
    sink = m.OffloadStatsSink()
    sink.record_stall_state(stalled=True, newly_detected=True)
    first = sink.take()
    assert first.data[m.COUNTERS][m.STALLS] == 1 and first.data[m.GAUGES][m.STALLED] == 1
    sink.record_stall_state(stalled=True, newly_detected=False)
    assert sink.take() is None  # nothing new: no second count, gauge unchanged
    sink.record_stall_state(stalled=False, newly_detected=False)
    assert sink.take().data[m.GAUGES][m.STALLED] == 0


def test_store_rejections_are_counted_as_deltas_of_the_tier_total():
    sink = m.OffloadStatsSink()
    sink.record_tier(4, 4, evictions_total=0, store_rejections_total=3)
    assert sink.take().data[m.COUNTERS][m.STORE_REJECTIONS] == 3
    sink.record_tier(4, 4, evictions_total=0, store_rejections_total=5)
    assert sink.take().data[m.COUNTERS] == {m.STORE_REJECTIONS: 2}


def test_eviction_bias_is_a_gauge_sent_when_it_moves_and_exported():
    sink = m.OffloadStatsSink()
    sink.record_tier(4, 8, evictions_total=0, eviction_bias=1.234567)
    assert sink.take().data[m.GAUGES][m.EVICTION_BIAS] == 1.235  # four significant digits
    sink.record_tier(4, 8, evictions_total=0, eviction_bias=1.234567)
    assert sink.take() is None
    sink.record_tier(4, 8, evictions_total=0, eviction_bias=-0.5)
    stats = sink.take()
    assert stats.data[m.GAUGES][m.EVICTION_BIAS] == -0.5
    reg = CollectorRegistry()
    prom = build_prom_metrics(_cfg(), _fresh_types(reg), LABELNAMES, {0: ["m", "0"]})
    prom.observe(stats.to_dict(), engine_idx=0)
    assert _samples(reg)[("vllm:offload_connector_cpu_tier_eviction_bias", (("engine", "0"), ("model_name", "m")))] \
        == -0.5


def test_loads_reported_early_are_counted_and_exported():
    sink = m.OffloadStatsSink()
    sink.record_load_reported_early()
    sink.record_load_reported_early()
    stats = sink.take()
    assert stats.data[m.COUNTERS][m.LOADS_REPORTED_EARLY] == 2
    assert stats.reduce()[m.LOADS_REPORTED_EARLY] == 2
    reg = CollectorRegistry()
    prom = build_prom_metrics(_cfg(), _fresh_types(reg), LABELNAMES, {0: ["m", "0"]})
    prom.observe(stats.to_dict(), engine_idx=0)
    assert _samples(reg)[("vllm:offload_connector_loads_reported_early_total",
                          (("engine", "0"), ("model_name", "m")))] == 2
