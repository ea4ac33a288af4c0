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
    m.DISK_EVICTIONS: ("disk_tier_evictions_total", "Disk-tier entries evicted to make room for new writes."),
    m.DISK_READ_BACK: ("disk_tier_read_back_blocks_total", "Blocks read back from the disk tier into the CPU tier "
                                                           "for loads that landed."),
    m.DISK_WRITE_SKIPS: ("disk_tier_write_skips_total", "Blocks not written to the disk tier: too many writes in "
                                                        "flight, or every disk slot busy."),
    m.DISK_WRITTEN_BYTES: ("disk_tier_written_bytes_total", "Bytes written to the disk tier, summed over workers."),
    m.DISK_READ_BYTES: ("disk_tier_read_bytes_total", "Bytes read from the disk tier, summed over workers."),
    m.REMOTE_READ_BACK: ("shared_tier_read_back_blocks_total", "Blocks fetched from the shared tier into the CPU "
                                                               "tier for loads that landed."),
    m.REMOTE_WRITTEN: ("shared_tier_written_blocks_total", "Blocks every worker wrote to the shared tier."),
    m.REMOTE_WRITE_SKIPS: ("shared_tier_write_skips_total", "Blocks not written to the shared tier: too many writes "
                                                            "in flight."),
    m.REMOTE_WRITTEN_BYTES: ("shared_tier_written_bytes_total", "Bytes written to the shared tier, summed over "
                                                                "workers."),
    m.REMOTE_READ_BYTES: ("shared_tier_read_bytes_total", "Bytes fetched from the shared tier, summed over workers."),
    m.REMOTE_FAILURES: ("shared_tier_failures_total", "Shared-tier puts or gets that failed or were rejected on a "
                                                      "worker (missing, another model, corrupt)."),
    m.DISK_IO_FAILURES: ("disk_tier_io_failures_total", "Disk-tier reads or writes that failed on a worker (I/O "
                                                        "error or corrupt slot); a failed read fails its load."),
}
_DEFERRALS = ("deferrals_total", (
    "Load decisions other than admitting the full hit now, by reason: pool_full (held back this step, does not fit "
    "next to in-flight loads), too_big (recomputed: could not fit even in an idle pool), aged_out (deferred too "
    "long; the prefix is recomputed), held_for_older (admission_policy fair: held back this step so that an older "
    "deferred load keeps its room)."))
_SHARED_REJECTED = ("shared_tier_rejected_blocks_total", (
    "Values read from the shared tier and refused, by reason: mac / unauthenticated (written without the secret: "
    "forged, or by an engine without remote_secret_file), corrupt, key, fingerprint, version, format, length. "
    "Each is a miss; the request recomputes."))
_DISK_REJECTED = ("disk_tier_rejected_blocks_total", (
    "Disk-tier slots dropped on a worker, by reason: mac / unauthenticated (a tag that does not verify, or none, "
    "with disk_secret_file: a planted or moved slot), corrupt (a record or data CRC that fails: torn or damaged). "
    "A dropped slot read for a load fails that load; the request recomputes."))
_LABELLED = ((_DEFERRALS, m.DEFERRAL_PREFIX, m.DEFERRAL_REASONS),
             (_SHARED_REJECTED, m.SHARED_REJECTED_PREFIX, m.SHARED_REJECT_REASONS),
             (_DISK_REJECTED, m.DISK_REJECTED_PREFIX, m.DISK_REJECT_REASONS))
_GAUGES: dict[str, tuple[str, str]] = {
    m.TIER_USED: ("cpu_tier_used_blocks", "CPU-tier slots in use (one KV block of one group each)."),
    m.TIER_CAPACITY: ("cpu_tier_capacity_blocks", "CPU-tier slots in all."),
    m.DEFERRED_REQUESTS: ("deferred_requests", "Requests whose load from the CPU tier is deferred right now."),
    m.STALLED: ("stalled", "1 while the watchdog sees the engine stalled (see stalls_total), else 0."),
    m.EVICTION_BIAS: ("cpu_tier_eviction_bias", "slru's probation bias (0 under lru and arc): ln of how much faster "
                                                "entries stored by requests that shared no prefix age than the "
                                                "others; above 0, one-shot prompts are evicted first."),
    m.DISK_USED: ("disk_tier_used_blocks", "Disk-tier slots in use, per worker (every worker holds the same keys)."),
    m.DISK_CAPACITY: ("disk_tier_capacity_blocks", "Disk-tier slots in all, per worker."),
}
_USAGE = ("cpu_tier_usage_perc", "CPU-tier usage, used over capacity slots; 1 means 100 percent.")
_HISTOGRAMS: dict[str, tuple[str, str]] = {
    m.LOAD_SECONDS: ("load_time_seconds", "Duration of one load job (CPU tier to GPU) on one worker."),
    m.STORE_SECONDS: ("store_time_seconds", "Duration of one store job (GPU to CPU tier) on one worker."),
}

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
