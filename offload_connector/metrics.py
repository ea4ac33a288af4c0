"""Connector statistics in vLLM's conventions: a `KVConnectorStats` payload and `vllm:`-prefixed Prometheus metrics.

How the numbers travel (identical in vLLM 0.32 and 0.33):

1. Each worker's `get_kv_connector_stats()` returns an `OffloadStats` (or None) after every step; it rides
   `KVConnectorOutput.kv_connector_stats` and `KVOutputAggregator` merges the workers with `aggregate`.
2. In `Scheduler.update_from_output` the scheduler calls the scheduler-side connector's `get_kv_connector_stats()`
   too, and merges it into the workers' stats (`workers.aggregate(scheduler)`) unless it `is_empty()`.
3. `Scheduler.make_stats` ships `stats.to_dict()` (plain data, msgpack-encoded) in `SchedulerStats` to the frontend.
4. There `KVConnectorLogging` rebuilds it with the connector class's `build_kv_connector_stats(data)`, aggregates
   the steps of one log interval and logs `reduce()`; `KVConnectorProm` hands every step's dict to the object that
   `build_prom_metrics(...)` (in `metrics_prom`) returned (`OffloadPromMetrics.observe`), which feeds `/metrics`.

Every payload is a delta since the previous one (`OffloadStatsSink.take()` swaps in a fresh object), so Prometheus
counters add payloads and gauges take the latest value.

Metrics (counters are exported with the `_total` suffix; every metric also carries vLLM's `model_name` and `engine`
labels):

| name | type | extra labels | recorded by | meaning |
|---|---|---|---|---|
| `vllm:offload_connector_loaded_bytes_total` | counter | | worker | bytes copied CPU -> GPU, summed over workers |
| `vllm:offload_connector_loaded_blocks_total` | counter | | worker (primary) | KV blocks loaded (one block of one KV cache group each) |
| `vllm:offload_connector_stored_bytes_total` | counter | | worker | bytes copied GPU -> CPU, summed over workers |
| `vllm:offload_connector_stored_blocks_total` | counter | | worker (primary) | KV blocks stored |
| `vllm:offload_connector_load_time_seconds` | histogram | | worker | duration of one load job on one worker |
| `vllm:offload_connector_store_time_seconds` | histogram | | worker | duration of one store job on one worker |
| `vllm:offload_connector_load_failures_total` | counter | | worker | load jobs that failed on a worker (request recomputed) |
| `vllm:offload_connector_store_failures_total` | counter | | worker | store jobs that failed on a worker (blocks not cached) |
| `vllm:offload_connector_load_verify_failures_total` | counter | | worker | load jobs whose landed blocks did not match the checksums stored with them (`verify_loads`); each is also a load failure |
| `vllm:offload_connector_load_timeouts_total` | counter | | worker | load jobs not done within `load_timeout_s` (the copy, or the disk/shared-tier read-back before it), reported failed; each is also a load failure |
| `vllm:offload_connector_loads_reported_early_total` | counter | | worker | load jobs reported to vLLM before their copy landed (`load_completion: "ordered"`), summed over workers: the forward that reads each is ordered after its copy |
| `vllm:offload_connector_loaded_tokens_total` | counter | | scheduler | prompt tokens whose load landed (and verified): the external hits a request really got from the CPU tier. vLLM's `vllm:external_prefix_cache_hits_total` counts granted tokens at admission, failed loads included |
| `vllm:offload_connector_deferrals_total` | counter | `reason` | scheduler | load decisions other than "admit the full hit now" |
| `vllm:offload_connector_deferred_requests` | gauge | | scheduler | requests whose load is deferred right now |
| `vllm:offload_connector_cpu_tier_used_blocks` | gauge | | scheduler | CPU-tier slots in use |
| `vllm:offload_connector_cpu_tier_capacity_blocks` | gauge | | scheduler | CPU-tier slots in all |
| `vllm:offload_connector_cpu_tier_usage_perc` | gauge | | scheduler | used / capacity, 0..1 (as `vllm:kv_cache_usage_perc`) |
| `vllm:offload_connector_cpu_tier_evictions_total` | counter | | scheduler | CPU-tier entries evicted to make room |
| `vllm:offload_connector_cpu_tier_eviction_bias` | gauge | | scheduler | `slru`'s probation bias (0 under `lru` and `arc`): ln of how much faster entries stored by requests that shared no prefix age than the others; above 0, one-shot prompts are evicted first |
| `vllm:offload_connector_cpu_tier_store_rejections_total` | counter | | scheduler | blocks not stored: the tier was full of pinned entries |
| `vllm:offload_connector_stalls_total` | counter | | scheduler | stalls the watchdog detected |
| `vllm:offload_connector_stalled` | gauge | | scheduler | 1 while the watchdog sees a stall |
| `vllm:offload_connector_disk_tier_used_blocks` | gauge | | scheduler | disk-tier slots in use (per worker; every worker holds the same keys) |
| `vllm:offload_connector_disk_tier_capacity_blocks` | gauge | | scheduler | disk-tier slots in all (per worker) |
| `vllm:offload_connector_disk_tier_evictions_total` | counter | | scheduler | disk-tier entries evicted to make room |
| `vllm:offload_connector_disk_tier_read_back_blocks_total` | counter | | scheduler | blocks read back from disk into the CPU tier for loads that landed |
| `vllm:offload_connector_disk_tier_write_skips_total` | counter | | scheduler | blocks not written to disk: too many writes in flight or every slot busy |
| `vllm:offload_connector_disk_tier_written_bytes_total` | counter | | worker | bytes written to the disk tier, summed over workers |
| `vllm:offload_connector_disk_tier_read_bytes_total` | counter | | worker | bytes read from the disk tier, summed over workers |
| `vllm:offload_connector_shared_tier_read_back_blocks_total` | counter | | scheduler | blocks fetched from the shared tier into the CPU tier for loads that landed |
| `vllm:offload_connector_shared_tier_written_blocks_total` | counter | | scheduler | blocks every worker wrote to the shared tier (marker put) |
| `vllm:offload_connector_shared_tier_write_skips_total` | counter | | scheduler | blocks not written to the shared tier: too many writes in flight |
| `vllm:offload_connector_shared_tier_written_bytes_total` | counter | | worker | bytes written to the shared tier, summed over workers |
| `vllm:offload_connector_shared_tier_read_bytes_total` | counter | | worker | bytes fetched from the shared tier, summed over workers |
| `vllm:offload_connector_shared_tier_failures_total` | counter | | worker | shared-tier puts or gets that failed or were rejected (missing, another model, corrupt) |
| `vllm:offload_connector_shared_tier_rejected_blocks_total` | counter | `reason` | worker, scheduler (markers) | values read from the shared tier and refused, by reason (`remote.base.REJECT_REASONS`): `mac` and `unauthenticated` are values written without the secret (forged, or by an engine without `remote_secret_file`); each is a miss |
| `vllm:offload_connector_disk_tier_io_failures_total` | counter | | worker | disk reads or writes that failed on a worker (I/O error, corrupt or rejected slot); a failed read fails its load |
| `vllm:offload_connector_disk_tier_rejected_blocks_total` | counter | `reason` | worker | disk-tier slots dropped, by reason (`corrupt`, `unauthenticated`, `mac`): `mac` and `unauthenticated` are slots whose tag does not verify or is missing under `disk_secret_file` (planted, moved, or written without the secret); each read of one fails its load |

Deferral reasons (a closed set, so the `reason` label stays bounded; add a reason here before recording it):

| reason | counted | meaning |
|---|---|---|
| `pool_full` | every step a load is held back | the load does not fit next to in-flight loads now; `(None, False)` |
| `too_big` | once per request | the request's blocks could not fit even in an idle pool; recomputed instead |
| `aged_out` | once per request | deferred `max_deferral_steps`; the prefix is recomputed |
| `held_for_older` | every step a request is held back | `admission_policy: "fair"`: the request (a load or not) arrived after a deferred load and taking its blocks now would leave that load without room; `(None, False)` |
| `behind_load` | every step a request is held back | `admission_policy: "fair"`: the request has no load of its own, its prefill is longer than one step's token budget and an older request's load is in flight; started now, it would be scheduled before that request every step until its prefill ends; `(None, False)` |

Tensor/pipeline parallelism: every rank copies its own shard, so every rank records bytes and time (bytes add up to
the real traffic), while blocks are logical and only the primary rank records them (`count_blocks=
counts_blocks_here()`), so they are not multiplied by TP x PP. Load/store time histograms therefore count one
observation per worker per job.

This module imports only vLLM and the standard library: the frontend (API server) process imports it through the
connector class without either side of the connector. It names no second tier: each declares its own metrics
(`TierMetrics`, in its package, registered beside its factories in `second_tiers`) and reports through the generic
recorders below.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Literal, Mapping, Sequence

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

Direction = Literal["load", "store"]
DEFERRAL_REASONS: tuple[str, ...] = ("pool_full", "too_big", "aged_out", "held_for_older", "behind_load", "not_started")

# Payload keys. Plain strings, numbers and lists only: the payload is msgpack-encoded on its way to the frontend
# and must decode there as plain data, without this module's classes or custom hooks.
COUNTERS, GAUGES, SAMPLES = "counters", "gauges", "samples"

# Counter keys (payload) -> exported in metrics_prom.
LOADED_BYTES, LOADED_BLOCKS, LOAD_FAILURES = "loaded_bytes", "loaded_blocks", "load_failures"
STORED_BYTES, STORED_BLOCKS, STORE_FAILURES = "stored_bytes", "stored_blocks", "store_failures"
EVICTIONS = "cpu_tier_evictions"
STALLS = "stalls_detected"
STORE_REJECTIONS = "cpu_tier_store_rejections"
LOAD_VERIFY_FAILURES = "load_verify_failures"
LOAD_TIMEOUTS = "load_timeouts"
LOADS_REPORTED_EARLY = "loads_reported_early"
LOADED_TOKENS = "loaded_tokens"
DEFERRAL_PREFIX = "deferrals:"
# Histogram sample keys.
LOAD_SECONDS, STORE_SECONDS = "load_seconds", "store_seconds"
# Gauge keys.
TIER_USED, TIER_CAPACITY, DEFERRED_REQUESTS = "cpu_tier_used_blocks", "cpu_tier_capacity_blocks", "deferred_requests"
STALLED = "stalled"
EVICTION_BIAS = "cpu_tier_eviction_bias"
_GAUGE_KEYS = (TIER_USED, TIER_CAPACITY, DEFERRED_REQUESTS, STALLED, EVICTION_BIAS)


@dataclass(frozen=True)
class TierMetric:
    """One series of a second tier: its payload key, its Prometheus name (after `vllm:offload_connector_`, counters
    with their `_total`) and its help text."""
    key: str
    metric: str
    help: str


@dataclass(frozen=True)
class TierMetrics:
    """A second tier's metrics, declared in its own package and registered beside its factories (`second_tiers`):
    the Prometheus side builds its series from these, and the tier reports through `OffloadStatsSink`'s generic
    recorders with them.

    `planner_totals`: the cumulative counts its scheduler-side planner reports each step (sent as deltas), in the
    order it passes them; `planner_gauges` likewise, sent as values. `io`: its worker client's written bytes, read
    bytes and failed operations. `rejected`: the labelled counter of values it refused; its `key` is a payload prefix,
    each reason of `reject_reasons` counted under `key + reason` (a closed set, so the label stays bounded)."""
    name: str  # the tier's name in the step messages (`transfer_jobs.DISK`, `SHARED`)
    planner_totals: tuple[TierMetric, ...]
    io: tuple[TierMetric, TierMetric, TierMetric]
    planner_gauges: tuple[TierMetric, ...] = ()
    rejected: TierMetric | None = None
    reject_reasons: tuple[str, ...] = ()

    @property
    def counters(self) -> tuple[TierMetric, ...]:
        """Its unlabelled counters."""
        return (*self.planner_totals, *self.io)


_TRANSFER_KEYS: dict[str, tuple[str, str, str, str]] = {
    "load": (LOADED_BYTES, LOADED_BLOCKS, LOAD_FAILURES, LOAD_SECONDS),
    "store": (STORED_BYTES, STORED_BLOCKS, STORE_FAILURES, STORE_SECONDS),
}


def _sig(x: float) -> float:
    # Four significant digits: a log line, not a measurement archive.
    return float(f"{x:.4g}")


def _empty() -> dict[str, dict[str, float | list[float]]]:
    return {COUNTERS: {}, GAUGES: {}, SAMPLES: {}}


@dataclass
class OffloadStats(KVConnectorStats):
    """One interval's statistics: counters (summed), gauges (latest wins), histogram samples (concatenated).

    `data` is `{"counters": {key: number}, "gauges": {key: number}, "samples": {key: [seconds, ...]}}`.
    """

    def __post_init__(self) -> None:
        # The frontend rebuilds from a decoded dict; copy it so aggregating never mutates the caller's payload.
        src = self.data or {}
        self.data = {
            COUNTERS: dict(src.get(COUNTERS) or {}),
            GAUGES: dict(src.get(GAUGES) or {}),
            SAMPLES: {k: list(v) for k, v in (src.get(SAMPLES) or {}).items()},
        }

    # -------------------------------------------------------------- recorders
    def record_transfer(self, direction: Direction, blocks: int, nbytes: int, seconds: float, ok: bool = True,
                        *, count_blocks: bool = True) -> None:
        """One finished load or store job on this worker. A failed job counts only as a failure."""
        nbytes_key, blocks_key, failures_key, seconds_key = _TRANSFER_KEYS[direction]
        if not ok:
            self._add(failures_key, 1)
            return
        self._add(nbytes_key, nbytes)
        if count_blocks:
            self._add(blocks_key, blocks)
        self.data[SAMPLES].setdefault(seconds_key, []).append(float(seconds))

    def record_deferral(self, reason: str, count: int = 1) -> None:
        if reason not in DEFERRAL_REASONS:
            # Fail in tests, not in a dashboard: an unlisted reason would be a label nobody documented.
            raise ValueError(f"unknown deferral reason {reason!r}; known: {DEFERRAL_REASONS}")
        self._add(DEFERRAL_PREFIX + reason, count)

    def record_evictions(self, count: int) -> None:
        self._add(EVICTIONS, count)

    def record_stall(self) -> None:
        self._add(STALLS, 1)

    def record_load_verify_failure(self) -> None:
        self._add(LOAD_VERIFY_FAILURES, 1)

    def record_load_timeout(self) -> None:
        self._add(LOAD_TIMEOUTS, 1)

    def record_load_reported_early(self) -> None:
        self._add(LOADS_REPORTED_EARLY, 1)

    def record_loaded_tokens(self, tokens: int) -> None:
        self._add(LOADED_TOKENS, tokens)

    def set_gauge(self, key: str, value: float) -> None:
        if key not in _GAUGE_KEYS:
            raise ValueError(f"unknown gauge {key!r}")
        self.data[GAUGES][key] = value

    def _add(self, key: str, value: float) -> None:
        if value:
            counters = self.data[COUNTERS]
            counters[key] = counters.get(key, 0) + value

    # ------------------------------------------------- KVConnectorStats API
    def reset(self) -> None:
        self.data = _empty()

    def aggregate(self, other: KVConnectorStats) -> OffloadStats:
        """Merge `other` (a later interval, another worker, or the scheduler side) into self and return self."""
        if other.is_empty():
            return self
        assert isinstance(other, OffloadStats), type(other)
        counters = self.data[COUNTERS]
        for key, value in other.data[COUNTERS].items():
            counters[key] = counters.get(key, 0) + value
        self.data[GAUGES].update(other.data[GAUGES])
        for key, values in other.data[SAMPLES].items():
            self.data[SAMPLES].setdefault(key, []).extend(values)
        return self

    def reduce(self) -> dict[str, int | float]:
        """The log line's summary of one interval: totals, job counts, mean times and per-worker bandwidth."""
        out: dict[str, int | float] = {}
        counters, gauges, samples = self.data[COUNTERS], self.data[GAUGES], self.data[SAMPLES]
        for direction, (nbytes_key, blocks_key, failures_key, seconds_key) in _TRANSFER_KEYS.items():
            times = samples.get(seconds_key, [])
            if not (times or counters.get(failures_key)):
                continue
            out[f"{direction}_jobs"] = len(times)
            out[blocks_key] = counters.get(blocks_key, 0)
            out[nbytes_key] = counters.get(nbytes_key, 0)
            out[failures_key] = counters.get(failures_key, 0)
            if times:
                total = sum(times)
                out[f"{direction}_avg_ms"] = _sig(1000 * total / len(times))
                # Bytes of all workers over the time of all workers: mean bandwidth of one worker's copies.
                out[f"{direction}_GBps"] = _sig(counters.get(nbytes_key, 0) / total / 1e9) if total > 0 else 0.0
        transfer_keys = {key for keys in _TRANSFER_KEYS.values() for key in keys}
        for key, value in counters.items():
            # Every counter but the transfers' (above) and the labelled ones other than the deferrals: the second
            # tiers' by whatever keys they declared.
            if key.startswith(DEFERRAL_PREFIX) or (":" not in key and key not in transfer_keys):
                out[key.replace(":", "_")] = value
        out.update(gauges)
        if gauges.get(TIER_CAPACITY):
            out["cpu_tier_usage_perc"] = _sig(gauges.get(TIER_USED, 0) / gauges[TIER_CAPACITY])
        return out

    def is_empty(self) -> bool:
        return not (self.data[COUNTERS] or self.data[GAUGES] or self.data[SAMPLES])


class OffloadStatsSink:
    """Where one side records; `take()` is that side's `get_kv_connector_stats()`.

    Thread-safe, because the worker may finish transfers on a completion thread while the model runner takes the
    stats. Gauges are sent only when one changed since the last payload, so an idle engine sends nothing (and logs
    nothing); the Prometheus gauges keep their last values meanwhile.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = OffloadStats()
        self._gauges: dict[str, float] = {}
        self._sent_gauges: dict[str, float] = {}
        self._evictions_seen = 0
        self._rejections_seen = 0
        self._tier_seen: dict[str, tuple[int, ...]] = {}
        self._rejected_seen: dict[tuple[str, str, str], int] = {}

    def record_transfer(self, direction: Direction, blocks: int, nbytes: int, seconds: float, ok: bool = True,
                        *, count_blocks: bool = True) -> None:
        """Worker side, once per finished job. `count_blocks`: True on the primary rank only (see module doc)."""
        with self._lock:
            self._stats.record_transfer(direction, blocks, nbytes, seconds, ok, count_blocks=count_blocks)

    def record_deferral(self, reason: str, count: int = 1) -> None:
        """Scheduler side, at each decision of `get_num_new_matched_tokens` named by `reason`."""
        with self._lock:
            self._stats.record_deferral(reason, count)

    def record_tier(self, used_slots: int, total_slots: int, evictions_total: int,
                    store_rejections_total: int = 0, eviction_bias: float = 0.0) -> None:
        """Scheduler side, any number of times per step. The `*_total` arguments are the tier's cumulative counts;
        `eviction_bias` the policy's probation bias (`SegmentedLRUPolicy.bias`; 0 for a policy without one)."""
        with self._lock:
            self._gauges[EVICTION_BIAS] = _sig(eviction_bias)
            rejected = store_rejections_total - self._rejections_seen \
                if store_rejections_total >= self._rejections_seen else store_rejections_total
            self._rejections_seen = store_rejections_total
            if rejected:
                self._stats._add(STORE_REJECTIONS, rejected)
            # A smaller total means the tier was rebuilt (cache reset): count from its new zero.
            delta = evictions_total - self._evictions_seen if evictions_total >= self._evictions_seen \
                else evictions_total
            self._evictions_seen = evictions_total
            self._stats.record_evictions(delta)
            self._gauges[TIER_USED] = used_slots
            self._gauges[TIER_CAPACITY] = total_slots

    def record_second_tier(self, tier: TierMetrics, totals: Sequence[int], gauges: Sequence[float] = ()) -> None:
        """Scheduler side, once per step: a second tier's cumulative counts, in the order of its `planner_totals`
        (sent as deltas; a smaller total means the tier was rebuilt, counted from its new zero), and its gauges in
        the order of its `planner_gauges`."""
        if len(totals) != len(tier.planner_totals) or len(gauges) > len(tier.planner_gauges):
            raise ValueError(f"second tier {tier.name!r} reported {len(totals)} totals and {len(gauges)} gauges; it "
                             f"declares {len(tier.planner_totals)} and {len(tier.planner_gauges)}")
        with self._lock:
            seen = self._tier_seen.get(tier.name, (0,) * len(totals))
            for spec, now, was in zip(tier.planner_totals, totals, seen):
                self._stats._add(spec.key, now - was if now >= was else now)
            self._tier_seen[tier.name] = tuple(totals)
            for spec, value in zip(tier.planner_gauges, gauges):
                self._gauges[spec.key] = value

    def record_tier_io(self, tier: TierMetrics, written_bytes: int, read_bytes: int, failures: int) -> None:
        """Worker side: bytes this worker's second tier wrote and read since the last call, and its failed
        operations (disk I/Os, shared-store calls)."""
        written, read, failed = tier.io
        with self._lock:
            self._stats._add(written.key, written_bytes)
            self._stats._add(read.key, read_bytes)
            self._stats._add(failed.key, failures)

    def record_rejections(self, tier: TierMetrics, source: str, totals: Mapping[str, int]) -> None:
        """A second tier's cumulative rejections by reason; `source` names the store ("worker", "markers") so each
        is sent as its own deltas. Reasons outside the tier's closed set are not recorded, nor anything of a tier
        that declares no rejection counter."""
        if tier.rejected is None:
            return
        with self._lock:
            for reason, now in totals.items():
                if reason not in tier.reject_reasons:
                    continue
                seen = self._rejected_seen.get((tier.name, source, reason), 0)
                self._stats._add(tier.rejected.key + reason, now - seen if now >= seen else now)
                self._rejected_seen[(tier.name, source, reason)] = now

    def record_load_verify_failure(self) -> None:
        """Worker side: a load job whose blocks did not match their stored checksums (also a load failure)."""
        with self._lock:
            self._stats.record_load_verify_failure()

    def record_load_timeout(self) -> None:
        """Worker side: a load job not done within load_timeout_s (copy or read-back; also a load failure)."""
        with self._lock:
            self._stats.record_load_timeout()

    def record_load_reported_early(self) -> None:
        """Worker side: a load job reported before its copy landed (load_completion "ordered")."""
        with self._lock:
            self._stats.record_load_reported_early()

    def record_loaded_tokens(self, tokens: int) -> None:
        """Scheduler side: a request's load landed (and verified); `tokens` it no longer computes."""
        with self._lock:
            self._stats.record_loaded_tokens(tokens)

    def record_stall_state(self, stalled: bool, newly_detected: bool) -> None:
        """Scheduler side, every step: the watchdog's verdict (a counter per detected stall, a 0/1 gauge)."""
        with self._lock:
            if newly_detected:
                self._stats.record_stall()
            self._gauges[STALLED] = 1 if stalled else 0

    def record_deferred_requests(self, count: int) -> None:
        """Scheduler side: how many requests have a deferred load right now."""
        with self._lock:
            self._gauges[DEFERRED_REQUESTS] = count

    def take(self) -> OffloadStats | None:
        """The stats since the last call, or None when there is nothing new (what vLLM expects)."""
        with self._lock:
            stats, self._stats = self._stats, OffloadStats()
            # All gauges together when any changed: usage is used over capacity, so both must arrive as a pair.
            if self._gauges != self._sent_gauges:
                # (the recorders above set only their own keys and those a second tier declared)
                stats.data[GAUGES].update(self._gauges)
                self._sent_gauges = dict(self._gauges)
        return None if stats.is_empty() else stats


def counts_blocks_here() -> bool:
    """Whether this worker is the one that records logical block counts: TP rank 0 of PP stage 0.

    Every TP rank and PP stage moves the same logical blocks (its own shard or layers of them), so counting on all
    of them would multiply block counts by TP x PP. True when vLLM's parallel groups are not set up (tests, tools).
    """
    from vllm.distributed import parallel_state as ps
    if not ps.model_parallel_is_initialized():
        return True
    return ps.get_tensor_model_parallel_rank() == 0 and ps.get_pp_group().rank_in_group == 0


# ------------------------------------------------------------------- hooks the connector class exposes
def build_kv_connector_stats(data: dict[str, object] | None = None) -> OffloadStats:
    """Body of `OffloadConnector.build_kv_connector_stats(cls, data=None)` (same signature in vLLM 0.32 and 0.33)."""
    return OffloadStats(data=data or {})
