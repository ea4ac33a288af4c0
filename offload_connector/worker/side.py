"""Worker side of the connector.

This release moves no bytes yet: the transfer engine (pinned host tier, CUDA copy kernels, torch reference path)
is the next piece of work. Until it lands the worker refuses any transfer loudly instead of reporting loads it did
not perform, which would silently corrupt outputs. The completion protocol (which request ids to report, when) is
already here because the scheduler side depends on it.
"""

from __future__ import annotations

from typing import Any

from offload_connector.metadata import OffloadMetadata, OffloadWorkerMetadata


class TransfersNotAvailable(RuntimeError):
    pass


class OffloadWorker:
    def __init__(self, vllm_config: Any, kv_cache_config: Any) -> None:
        self.kv_cache_config = kv_cache_config
        self.kv_caches: dict[str, Any] = {}
        self._finished_recving: set[str] = set()
        self._stores_done: list[int] = []

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.kv_caches = dict(kv_caches)

    def start(self, meta: OffloadMetadata) -> None:
        if meta.loads or meta.stores:
            raise TransfersNotAvailable(
                "offload_connector: this build has no worker-side transfer engine yet, so it cannot move KV blocks "
                "between GPU and host memory. Use it for scheduler-side evaluation only.")

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        recving, self._finished_recving = self._finished_recving, set()
        return None, recving or None

    def worker_meta(self) -> OffloadWorkerMetadata | None:
        if not self._stores_done:
            return None
        done, self._stores_done = self._stores_done, []
        return OffloadWorkerMetadata(stores_done=done)
