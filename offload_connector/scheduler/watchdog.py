"""Stall watchdog: notices when the engine stops making progress and says who holds the pool.

A stall is what this connector exists to prevent: steps that schedule no token while requests wait and no transfer
is in flight, so nothing will ever change. vLLM keeps stepping through it (waiting requests keep the engine busy),
which is what lets the scheduler side count such steps from `build_connector_meta`. Waiting for a transfer is not a
stall: its completion changes the state.
"""

from __future__ import annotations

from dataclasses import dataclass

from offload_connector.log import get_logger
from offload_connector.scheduler.ledger import LedgerSnapshot

logger = get_logger(__name__)


@dataclass(frozen=True)
class PoolHolder:
    request_id: str
    status: str
    held: tuple[int, ...]  # live blocks per KV cache group


@dataclass(frozen=True)
class StallReport:
    step: int
    idle_steps: int
    waiting: int
    snapshot: LedgerSnapshot
    holders: tuple[PoolHolder, ...]

    def describe(self) -> str:
        lines = [f"offload_connector: stall: {self.idle_steps} steps without a scheduled token at step {self.step}, "
                 f"{self.waiting} request(s) waiting, no transfer in flight; pool {self.snapshot.free_blocks} free of "
                 f"{self.snapshot.num_blocks} (watermark {self.snapshot.watermark_blocks}), "
                 f"reserved by the ledger {self.snapshot.reserved_blocks}"]
        for h in sorted(self.holders, key=lambda h: -sum(h.held))[:20]:
            lines.append(f"  holds {sum(h.held)} blocks {list(h.held)}: {h.request_id} ({h.status})")
        if len(self.holders) > 20:
            lines.append(f"  ... and {len(self.holders) - 20} more holders")
        if self.snapshot.deferred:
            lines.append(f"  deferred loads: {', '.join(self.snapshot.deferred[:20])}")
        return "\n".join(lines)


class StallWatchdog:
    def __init__(self, threshold_steps: int) -> None:
        self.threshold_steps = threshold_steps
        self.idle_steps = 0
        self.stalled = False
        self.detections = 0
        self.last_report: StallReport | None = None

    def observe(self, scheduled_tokens: int, waiting: int, in_flight: bool) -> bool:
        """Count this step; True exactly when a stall is detected (once per stall, until progress resumes)."""
        if scheduled_tokens > 0 or waiting == 0 or in_flight:
            self.idle_steps = 0
            self.stalled = False
            return False
        self.idle_steps += 1
        if self.stalled or self.idle_steps < self.threshold_steps:
            return False
        self.stalled = True
        self.detections += 1
        return True

    def report(self, report: StallReport) -> None:
        self.last_report = report
        logger.error("%s", report.describe())
