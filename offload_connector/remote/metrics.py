"""The shared tier's metrics (`metrics.TierMetrics`), registered beside its factories in `second_tiers`."""

from __future__ import annotations

from offload_connector.metrics import TierMetric, TierMetrics
from offload_connector.remote.framing import REJECT_REASONS

METRICS = TierMetrics(
    name="shared",
    # RemotePlanner.record_stats passes (fetched blocks, write skips, writes landed).
    planner_totals=(
        TierMetric("shared_tier_read_back_blocks", "shared_tier_read_back_blocks_total",
                   "Blocks fetched from the shared tier into the CPU tier for loads that landed."),
        TierMetric("shared_tier_write_skips", "shared_tier_write_skips_total",
                   "Blocks not written to the shared tier: too many writes in flight."),
        TierMetric("shared_tier_written_blocks", "shared_tier_written_blocks_total",
                   "Blocks every worker wrote to the shared tier."),
    ),
    io=(
        TierMetric("shared_tier_written_bytes", "shared_tier_written_bytes_total",
                   "Bytes written to the shared tier, summed over workers."),
        TierMetric("shared_tier_read_bytes", "shared_tier_read_bytes_total",
                   "Bytes fetched from the shared tier, summed over workers."),
        TierMetric("shared_tier_failures", "shared_tier_failures_total",
                   "Shared-tier puts or gets that failed or were rejected on a worker (missing, another model, "
                   "corrupt)."),
    ),
    rejected=TierMetric("shared_rejected:", "shared_tier_rejected_blocks_total",
                        "Values read from the shared tier and refused, by reason: mac / unauthenticated (written "
                        "without the secret: forged, or by an engine without remote_secret_file), corrupt, key, "
                        "fingerprint, version, format, length. Each is a miss; the request recomputes."),
    reject_reasons=REJECT_REASONS,
)
