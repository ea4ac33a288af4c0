"""What the worker side asks of a second tier (the disk tier, the shared store), whatever it is.

`OffloadWorker` holds them by name (`name`, the tier's key in the step messages) and calls only these: this step's
planned operations, reads of a load's blocks into their CPU-tier slots, and what finished, moved and was refused since
the last step. A new second tier implements this contract and nothing in `worker/side.py` names it.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from offload_connector.transfer_jobs import TierRead, TierStep


@runtime_checkable
class ReadHandle(Protocol):
    """Completion of one read started by `read_back`: poll `done()`, then read `ok` and `error`."""

    def done(self) -> bool: ...

    @property
    def ok(self) -> bool: ...

    @property
    def error(self) -> str | None: ...


@runtime_checkable
class WorkerSecondTier(Protocol):
    name: str

    def apply(self, step: TierStep) -> None:
        """This step's operations (clear, drops, writes, epoch), as the scheduler planned them."""

    def read_back(self, read: TierRead) -> list[ReadHandle]:
        """Start reading a load's keys of this tier into their CPU-tier slots."""

    def finished_writes(self) -> tuple[list[int], list[int]]:
        """(done, failed) write jobs since the last call."""

    def io_deltas(self) -> tuple[int, int, int]:
        """(bytes written, bytes read, failed operations) since the last call."""

    def rejected(self) -> dict[str, int]:
        """Blocks refused on read so far, by reason (cumulative)."""

    def close(self) -> None:
        """Wait for the writes in flight and release the tier."""
