"""The disk tier's metrics (`metrics.TierMetrics`), registered beside its factories in `second_tiers`."""

from __future__ import annotations

from offload_connector.metrics import TierMetric, TierMetrics

METRICS = TierMetrics(
    name="disk",
    # DiskPlanner.record_stats passes (evictions, read-back blocks, write skips) and (used, capacity).
    planner_totals=(
        TierMetric("disk_tier_evictions", "disk_tier_evictions_total",
                   "Disk-tier entries evicted to make room for new writes."),
        TierMetric("disk_tier_read_back_blocks", "disk_tier_read_back_blocks_total",
                   "Blocks read back from the disk tier into the CPU tier for loads that landed."),
        TierMetric("disk_tier_write_skips", "disk_tier_write_skips_total",
                   "Blocks not written to the disk tier: too many writes in flight, or every disk slot busy."),
    ),
    planner_gauges=(
        TierMetric("disk_tier_used_blocks", "disk_tier_used_blocks",
                   "Disk-tier slots in use, per worker (every worker holds the same keys)."),
        TierMetric("disk_tier_capacity_blocks", "disk_tier_capacity_blocks", "Disk-tier slots in all, per worker."),
    ),
    io=(
        TierMetric("disk_tier_written_bytes", "disk_tier_written_bytes_total",
                   "Bytes written to the disk tier, summed over workers."),
        TierMetric("disk_tier_read_bytes", "disk_tier_read_bytes_total",
                   "Bytes read from the disk tier, summed over workers."),
        TierMetric("disk_tier_io_failures", "disk_tier_io_failures_total",
                   "Disk-tier reads or writes that failed on a worker (I/O error or corrupt slot); a failed read "
                   "fails its load."),
    ),
    rejected=TierMetric("disk_rejected:", "disk_tier_rejected_blocks_total",
                        "Disk-tier slots dropped on a worker, by reason: mac / unauthenticated (a tag that does not "
                        "verify, or none, with disk_secret_file: a planted or moved slot), corrupt (a record or data "
                        "CRC that fails: torn or damaged). A dropped slot read for a load fails that load; the request "
                        "recomputes."),
    # disk.store.DiskStats' drop counters, by the same names (a test checks they agree).
    reject_reasons=("corrupt", "unauthenticated", "mac"),
)
