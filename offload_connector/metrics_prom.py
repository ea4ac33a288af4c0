"""Prometheus side of the connector's statistics: registers the `vllm:offload_connector_*` metrics and feeds them
from each step's `OffloadStats` payload. The metric table is in `offload_connector.metrics`.

vLLM builds this object in the frontend process (`KVConnectorProm`, through the connector class's
`build_prom_metrics`) with its own metric classes: `prometheus_client`'s, or Ray's wrappers under Ray. So metrics
are created through `metric_types`, never by importing `prometheus_client` classes directly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prometheus_client import Counter, Gauge, Histogram
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

from offload_connector import metrics as m
from offload_connector.second_tiers import SECOND_TIERS, tier_metrics

if TYPE_CHECKING:
    from vllm.config import VllmConfig

PREFIX = "vllm:offload_connector_"

# One load or store job moves a request's new blocks: from a millisecond (a few blocks) to seconds (a long prefix).
TRANSFER_TIME_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

# payload counter key -> (metric name, help)
_COUNTERS: dict[str, tuple[str, str]] = {
    m.LOADED_BYTES: ("loaded_bytes_total", "Bytes copied from the CPU tier to GPU KV blocks, summed over workers."),
    m.LOADED_BLOCKS: ("loaded_blocks_total", "KV blocks (one block of one KV cache group each) loaded."),
    m.STORED_BYTES: ("stored_bytes_total", "Bytes copied from GPU KV blocks to the CPU tier, summed over workers."),
    m.STORED_BLOCKS: ("stored_blocks_total", "KV blocks (one block of one KV cache group each) stored."),
    m.LOAD_FAILURES: ("load_failures_total", "Load jobs that failed on a worker; their requests recompute."),
    m.STORE_FAILURES: ("store_failures_total", "Store jobs that failed on a worker; their blocks are not cached."),
    m.LOAD_VERIFY_FAILURES: ("load_verify_failures_total", "Load jobs whose landed blocks did not match the checksums "
                                                           "stored with them (verify_loads); also load failures."),
    m.LOAD_TIMEOUTS: ("load_timeouts_total", "Load jobs not done within load_timeout_s (the copy, or the disk or "
                                             "shared-tier read-back before it), reported failed; also load failures."),
    m.LOADS_REPORTED_EARLY: ("loads_reported_early_total", "Load jobs reported to vLLM before their copy landed "
                                                           "(load_completion \"ordered\"); the forward that reads "
                                                           "each is ordered after its copy."),
    m.LOADED_TOKENS: ("loaded_tokens_total", "Prompt tokens whose load from the CPU tier landed (and verified). "
                                             "vllm:external_prefix_cache_hits counts granted tokens at admission, "
                                             "failed loads included."),
    m.EVICTIONS: ("cpu_tier_evictions_total", "CPU-tier entries evicted to make room for new stores."),
    m.STORE_REJECTIONS: ("cpu_tier_store_rejections_total", "Blocks not stored because every CPU-tier slot was "
                                                           "pinned by an in-flight load or store."),
    m.STALLS: ("stalls_total", "Stalls the watchdog detected: no token scheduled for stall_watchdog_steps steps "
                               "while requests waited and no transfer was in flight."),
}
_DEFERRALS = ("deferrals_total", (
    "Load decisions other than admitting the full hit now, by reason: pool_full (held back this step, does not fit "
    "next to in-flight loads), too_big (recomputed: could not fit even in an idle pool), aged_out (deferred too "
    "long; the prefix is recomputed), held_for_older (admission_policy fair: held back this step so that an older "
    "deferred load keeps its room), behind_load (admission_policy fair: a prefill longer than one step, with no "
    "load of its own, held back while an older request's load is in flight, so that request keeps its place), "
    "not_started (admitted, but vLLM did not start the load: its max_num_inflight_kv_loads cap)."))
# (metric name, help), payload key prefix, reasons: one counter with a `reason` label each
_LABELLED: tuple[tuple[tuple[str, str], str, tuple[str, ...]], ...] = ((_DEFERRALS, m.DEFERRAL_PREFIX,
                                                                        m.DEFERRAL_REASONS),)
_GAUGES: dict[str, tuple[str, str]] = {
    m.TIER_USED: ("cpu_tier_used_blocks", "CPU-tier slots in use (one KV block of one group each)."),
    m.TIER_CAPACITY: ("cpu_tier_capacity_blocks", "CPU-tier slots in all."),
    m.DEFERRED_REQUESTS: ("deferred_requests", "Requests whose load from the CPU tier is deferred right now."),
    m.STALLED: ("stalled", "1 while the watchdog sees the engine stalled (see stalls_total), else 0."),
    m.EVICTION_BIAS: ("cpu_tier_eviction_bias", "slru's probation bias (0 under lru and arc): ln of how much faster "
                                                "entries stored by requests that shared no prefix age than the "
                                                "others; above 0, one-shot prompts are evicted first."),
}
_USAGE = ("cpu_tier_usage_perc", "CPU-tier usage, used over capacity slots; 1 means 100 percent.")
_HISTOGRAMS: dict[str, tuple[str, str]] = {
    m.LOAD_SECONDS: ("load_time_seconds", "Duration of one load job (CPU tier to GPU) on one worker."),
    m.STORE_SECONDS: ("store_time_seconds", "Duration of one store job (GPU to CPU tier) on one worker."),
}

# Each second tier's series, as it declared them (`second_tiers`: its package's `TierMetrics`).
for _tier in (tier_metrics(name) for name in SECOND_TIERS):
    _COUNTERS.update({c.key: (c.metric, c.help) for c in _tier.counters})
    _GAUGES.update({g.key: (g.metric, g.help) for g in _tier.planner_gauges})
    if _tier.rejected is not None:
        _LABELLED += (((_tier.rejected.metric, _tier.rejected.help), _tier.rejected.key, _tier.reject_reasons),)

# Every metric name this module registers, for tests and for whoever checks /metrics.
METRIC_NAMES: tuple[str, ...] = tuple(
    PREFIX + name for name, _ in (*_COUNTERS.values(), *(spec for spec, _, _ in _LABELLED), *_GAUGES.values(),
                                  _USAGE, *_HISTOGRAMS.values()))


class OffloadPromMetrics(KVConnectorPromMetrics):
    """Registers every metric at construction, with one child per engine (and per deferral reason), so `/metrics`
    lists them with zeros before the first transfer."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        engines = per_engine_labelvalues.items()
        # Children stay Any: vLLM types the metric classes as one union, and `observe` reads all three kinds through
        # one variable.
        self._counters: dict[str, dict[int, Any]] = {}
        for key, (name, doc) in _COUNTERS.items():
            metric = self._counter_cls(name=PREFIX + name, documentation=doc, labelnames=labelnames)
            self._counters[key] = {idx: metric.labels(*values) for idx, values in engines}
        for (name, doc), prefix, reasons in _LABELLED:  # one child per engine and reason
            metric = self._counter_cls(name=PREFIX + name, documentation=doc, labelnames=[*labelnames, "reason"])
            for reason in reasons:
                self._counters[prefix + reason] = {idx: metric.labels(*values, reason) for idx, values in engines}
        self._gauges: dict[str, dict[int, Any]] = {}
        # "mostrecent": with several API-server processes the freshest snapshot is the value; vLLM's own gauges
        # do the same.
        for key, (name, doc) in (*_GAUGES.items(), ("usage", _USAGE)):
            metric = self._gauge_cls(name=PREFIX + name, documentation=doc, labelnames=labelnames,
                                     multiprocess_mode="mostrecent")
            self._gauges[key] = {idx: metric.labels(*values) for idx, values in engines}
        self._histograms: dict[str, dict[int, Any]] = {}
        for key, (name, doc) in _HISTOGRAMS.items():
            metric = self._histogram_cls(name=PREFIX + name, documentation=doc, labelnames=labelnames,
                                         buckets=list(TRANSFER_TIME_BUCKETS))
            self._histograms[key] = {idx: metric.labels(*values) for idx, values in engines}

    # Any as in vLLM's signature: each of the payload's keys holds a dict of another shape (numbers, sample lists).
    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Record one step's payload (`OffloadStats.to_dict()`) for engine `engine_idx`."""
        for key, value in (transfer_stats_data.get(m.COUNTERS) or {}).items():
            child = self._counters.get(key, {}).get(engine_idx)
            # Skip keys a newer payload may carry: a mixed-version frontend must not crash the stats loop.
            if child is not None and value > 0:
                child.inc(value)
        gauges = transfer_stats_data.get(m.GAUGES) or {}
        for key, value in gauges.items():
            child = self._gauges.get(key, {}).get(engine_idx)
            if child is not None:
                child.set(value)
        if gauges.get(m.TIER_CAPACITY):
            self._gauges["usage"][engine_idx].set(gauges.get(m.TIER_USED, 0) / gauges[m.TIER_CAPACITY])
        for key, values in (transfer_stats_data.get(m.SAMPLES) or {}).items():
            child = self._histograms.get(key, {}).get(engine_idx)
            if child is not None:
                for seconds in values:
                    child.observe(seconds)


def default_metric_types() -> dict[type, type]:
    """The `metric_types` vLLM's `KVConnectorProm` passes outside Ray."""
    return {Gauge: Gauge, Counter: Counter, Histogram: Histogram}


def build_prom_metrics(vllm_config: VllmConfig, metric_types: dict[type, type], labelnames: list[str],
                       per_engine_labelvalues: dict[int, list[object]]) -> OffloadPromMetrics:
    """Body of `OffloadConnector.build_prom_metrics(cls, vllm_config, metric_types, labelnames,
    per_engine_labelvalues)` (same signature in vLLM 0.32 and 0.33)."""
    return OffloadPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
