"""The shared tier on one worker: its client of the shared store and the scheduler's instructions for it.

Each worker writes and reads its own shard of every block, under a fingerprint of its own (its TP rank, its PP
stage's layers), from and into CPU-tier slots the scheduler keeps pinned (writes) or reserved (reads). The client's
calls are blocking network round trips, so they run on one background thread, off the step; a load that needs
shared-tier blocks is copied to the GPU only once they have all arrived and verified (`OffloadWorker`).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Sequence

from offload_connector.log import get_logger
from offload_connector.transfer_jobs import SHARED, TierRead, TierStep, TierWrite

if TYPE_CHECKING:
    import numpy as np
    import torch

    from offload_connector.disk import DiskFingerprint
    from offload_connector.keys import BlockKey
    from offload_connector.remote import RemoteStore
    from offload_connector.worker.second_tier import ClientContext
    from offload_connector.worker.shard import WorkerRank

logger = get_logger(__name__)

# A Redis call that gets no answer in this long fails (its blocks miss; a load waiting for them fails and recomputes),
# so a hung server never holds a request forever. Set "socket_timeout_s" in remote_options to change it.
FETCH_TIMEOUT_S = 10.0


def with_default_timeout(kind: str, options: dict[str, object], seconds: float) -> dict[str, object]:
    if kind == "redis" and "socket_timeout_s" not in options and "client" not in options:
        return {**options, "socket_timeout_s": seconds}
    return options


def follow_epoch(store: RemoteStore, held: int, step: TierStep) -> int:
    """Move `store` to the scheduler's namespace epoch of this step (it moves on at each cache reset) if it is not
    there yet; returns the epoch the store is now in."""
    if step.epoch != held:
        store.set_epoch(step.epoch)
    return step.epoch


def io_deltas(store: RemoteStore, seen: tuple[int, int, int]) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """A store's (bytes put, bytes fetched, failed or rejected blocks) since `seen`, and the totals to pass next."""
    s = store.stats()
    now = (s.put_bytes, s.get_bytes, s.put_failures + s.errors + sum(s.rejected.values()))
    return (max(0, now[0] - seen[0]), max(0, now[1] - seen[1]), max(0, now[2] - seen[2])), now


class FetchIO:
    """Completion handle of one load's shared-tier reads (`done()`, then `ok` and `error`)."""

    def __init__(self, future: Future) -> None:
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    @property
    def ok(self) -> bool:
        return self._future.result()[0]

    @property
    def error(self) -> str | None:
        return self._future.result()[1]


class WorkerRemoteTier:
    name = SHARED

    def __init__(self, store: RemoteStore, host: torch.Tensor, group_bytes: Sequence[int]) -> None:
        self.store = store  # an offload_connector.remote.RemoteStore under this worker's own fingerprint
        self._host = host  # the CPU tier: a (num_slots, slot_bytes) uint8 CPU tensor
        self._group_bytes = list(group_bytes)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="oc-remote")
        self._writes: dict[int, Future] = {}
        self._epoch = 0  # the scheduler's namespace epoch the store is set to
        self._seen = (0, 0, 0)

    @classmethod
    def open(cls, kind: str, options: dict[str, object], disk_fingerprint: DiskFingerprint, rank: WorkerRank,
             host: torch.Tensor, group_bytes: Sequence[int], mac_key: bytes | None = None) -> "WorkerRemoteTier":
        """This worker's client, under a fingerprint of its own shard (model, its blocks' bytes and layers, its TP
        and PP position); with `mac_key` it tags its writes and reads only values whose tags verify."""
        from offload_connector.remote import RemoteFingerprint, make_remote_store
        fp = RemoteFingerprint.from_disk(disk_fingerprint, layout="oc-slot", tp_rank=rank.tp, tp_size=rank.tp_size,
                                         pp_rank=rank.pp, pp_size=rank.pp_size)
        store = make_remote_store(kind, fingerprint=fp, mac_key=mac_key,
                                  **with_default_timeout(kind, options, FETCH_TIMEOUT_S))
        logger.info("offload_connector worker side: shared tier %s (tp %d/%d, pp %d/%d, %s)", kind, rank.tp,
                    rank.tp_size, rank.pp, rank.pp_size,
                    "values tagged and verified with the secret" if mac_key is not None else "unauthenticated")
        return cls(store, host, group_bytes)

    def _buffers(self, keys: Sequence[BlockKey], slots: Sequence[int]) -> list[np.ndarray]:
        return [self._host[slot, : self._group_bytes[int(key[0])]].numpy() for key, slot in zip(keys, slots)]

    def apply(self, step: TierStep) -> None:
        """This step's writes, under the scheduler's namespace epoch (it moves on at each cache reset)."""
        self._epoch = follow_epoch(self.store, self._epoch, step)
        for write in step.writes:
            self._writes[write.job_id] = self._pool.submit(self._put, write)

    def _put(self, write: TierWrite) -> bool:
        keys, bufs = list(write.keys), self._buffers(write.keys, write.host_slots)
        ok = self.store.put(keys, bufs)
        retry = [i for i, good in enumerate(ok) if not good]
        if retry:  # once: a store under load times out now and then (seen with Mooncake on 2 busy cores)
            again = self.store.put([keys[i] for i in retry], [bufs[i] for i in retry])
            for i, good in zip(retry, again):
                ok[i] = good
        return all(ok)

    def read_back(self, read: TierRead) -> list[FetchIO]:
        return [FetchIO(self._pool.submit(self._get, read))]

    def _get(self, read: TierRead) -> tuple[bool, str | None]:
        keys, bufs = list(read.keys), self._buffers(read.keys, read.slots)
        got = self.store.get(keys, bufs)
        retry = [i for i, ok in enumerate(got) if not ok]
        if retry:  # once, as for puts; a block really gone (evicted) misses again and fails the load
            again = self.store.get([keys[i] for i in retry], [bufs[i] for i in retry])
            for i, ok in zip(retry, again):
                got[i] = ok
        missing = [k for k, ok in zip(read.keys, got) if not ok]
        if missing:
            return False, f"shared tier: {len(missing)} of {len(got)} blocks missing or rejected (first {missing[0]!r})"
        return True, None

    def finished_writes(self) -> tuple[list[int], list[int]]:
        done, failed = [], []
        for job_id, future in list(self._writes.items()):
            if future.done():
                del self._writes[job_id]
                try:
                    ok = future.result()
                except Exception as exc:  # noqa: BLE001 - a shared cache tier must not take the worker down
                    logger.warning("offload_connector: shared-tier write %d failed: %s", job_id, exc)
                    ok = False
                (done if ok else failed).append(job_id)
        return done, failed

    def io_deltas(self) -> tuple[int, int, int]:
        """(bytes written, bytes read, failed operations) since the last call."""
        delta, self._seen = io_deltas(self.store, self._seen)
        return delta

    def rejected(self) -> dict[str, int]:
        """Values this worker's store refused since it opened, by reason (cumulative)."""
        return self.store.stats().rejected

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.store.close()


def open_client(ctx: ClientContext) -> WorkerRemoteTier | None:
    """The registered worker-side factory (`second_tiers.py`): this worker's shared-tier client when `remote_store`
    is set."""
    config = ctx.config
    if config.remote_store is None:
        return None
    from offload_connector.remote.secret import shared_tier_mac_key
    return WorkerRemoteTier.open(config.remote_store, dict(config.remote_options), ctx.fingerprint, ctx.rank, ctx.host,
                                 ctx.group_bytes, mac_key=shared_tier_mac_key(config))
