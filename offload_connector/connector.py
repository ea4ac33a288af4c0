"""`OffloadConnector`: the class vLLM loads from `kv_connector_module_path="offload_connector"`.

A thin facade: the scheduler role delegates to `scheduler.core.OffloadScheduler`, the worker role to
`worker.side.OffloadWorker`. Each role builds only its own side, so the scheduler process never imports worker or
CUDA code and the worker never imports the scheduler side.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from offload_connector.compat import check_installed_vllm

check_installed_vllm()

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from offload_connector import metrics, metrics_prom
from offload_connector.config import OffloadConfig, check_at_startup
from offload_connector.metadata import OffloadMetadata

try:  # vLLM >= 0.32 labels external hits by source; HOST feeds the per-tier hit metrics.
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    _HOST_SOURCE = CacheHitSource.HOST
    # The shared tier is a remote store, which vLLM files under its fallback label (no member names a shared store).
    _SOURCES = {"host": CacheHitSource.HOST, "disk": CacheHitSource.DISK,
                "shared": CacheHitSource.EXTERNAL_UNSPECIFIED}
except ImportError:  # pragma: no cover
    _HOST_SOURCE = None
    _SOURCES = {}

if TYPE_CHECKING:
    import torch
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from offload_connector.metrics_prom import OffloadPromMetrics
    from offload_connector.scheduler.core import OffloadScheduler
    from offload_connector.worker.side import OffloadWorker


class OffloadConnector(KVConnectorBase_V1, SupportsHMA):
    if _HOST_SOURCE is not None:
        _cache_hit_source = _HOST_SOURCE

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        self.offload_config = OffloadConfig.from_extra_config(extra)
        self.scheduler_side: OffloadScheduler | None = None
        self.worker_side: OffloadWorker | None = None
        if kv_cache_config is None:
            raise ValueError("OffloadConnector needs the KV cache config (vLLM >= 0.32 passes it)")
        if role == KVConnectorRole.SCHEDULER:
            from offload_connector.scheduler.core import OffloadScheduler
            self.scheduler_side = OffloadScheduler(self.offload_config, vllm_config, kv_cache_config)
        else:
            from offload_connector.worker.side import OffloadWorker
            self.worker_side = OffloadWorker(self.offload_config, vllm_config, kv_cache_config)

    # A best-effort cache: a preempted request need not wait for its KV to be delivered anywhere.
    @property
    def requires_kv_delivery(self) -> bool:
        return False

    # ------------------------------------------------------- start-up checks: the earliest calls vLLM makes to us
    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, object]) -> bool:
        # VllmConfig.__post_init__ asks this whenever CUDA graphs include full graphs (the CUDA default; not with
        # --enforce-eager, never on the CPU backend): in the API server, before any engine process starts. A bad
        # `kv_connector_extra_config` stops start-up here with one ConfigError. Host memory is checked later
        # (get_required_kvcache_layout), in the engine only: a VllmConfig built for a simulation must not need it.
        OffloadConfig.from_extra_config(extra_config)
        return False  # loads and stores are whole-block copies between steps, nothing runs inside a graph

    @classmethod
    def supports_lookahead_block_hashes(cls, kv_transfer_config: KVTransferConfig) -> bool:
        # vLLM 0.34 asks this when it resolves the hash lookahead for EAGLE/MTP. Every key, hit and store follows
        # `request.block_hashes` (a block is stored only once it has a hash, with its KV final), so hashes that also
        # cover the drafter's next tokens need nothing else here, and vLLM stops dropping the last block of a hit.
        return True

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        # EngineCore._initialize_kv_caches -> resolve_kv_cache_layout asks this on every platform, once, after the
        # workers load the model and before memory profiling, the KV cache, the connectors and the host tier are
        # made: the first call with the whole config. Checks the keys and that every local worker's host tier fits.
        check_at_startup(vllm_config)
        return None

    # ----------------------------------------------------------- scheduler role
    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        assert self.scheduler_side is not None
        self.scheduler_side.bind(kv_cache_manager)

    def on_new_request(self, request: Request) -> None:
        if self.scheduler_side is not None:
            self.scheduler_side.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler_side is not None
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def may_load_async(self, request: Request) -> bool:
        # vLLM 0.34: with --max-num-inflight-kv-loads, True lets this request's load start while the batch is full.
        assert self.scheduler_side is not None
        return self.scheduler_side.may_load_async(request)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self.scheduler_side is not None
        self.scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        # Asked after update_state_after_alloc: the tokens of the load just issued, by the tier that held them.
        if num_external_tokens == 0:
            return {}
        assert self.scheduler_side is not None
        split = self.scheduler_side.hit_sources(request.request_id)
        if not _SOURCES or sum(split.values()) != num_external_tokens:
            return {_HOST_SOURCE: num_external_tokens} if _HOST_SOURCE is not None else {}
        return {_SOURCES[name]: n for name, n in split.items()}

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler_side is not None
        return self.scheduler_side.build_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self.scheduler_side is not None:
            self.scheduler_side.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, object] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, object] | None]:
        assert self.scheduler_side is not None
        return self.scheduler_side.request_finished(request, block_ids)

    def has_pending_push_work(self) -> bool:
        # Keeps the engine stepping while stores are in flight, so their completions are collected.
        return self.scheduler_side is not None and self.scheduler_side.has_pending_work()

    def reset_cache(self) -> bool | None:
        # vLLM's hook for `POST /reset_prefix_cache?reset_external=true` and the cache resets of pause, sleep and
        # weight updates; called on the scheduler-side connector only, between steps. Empties the CPU tier (copies
        # in flight keep their slots until they finish: see OffloadScheduler.reset_cache).
        if self.scheduler_side is None:
            return None
        return self.scheduler_side.reset_cache()

    def take_events(self):
        # KV cache events for the CPU tier (BlockStored / BlockRemoved, medium "CPU"); vLLM publishes them with the
        # GPU prefix cache's events after every step when --kv-events-config enables them.
        if self.scheduler_side is None:
            return ()
        return self.scheduler_side.take_events()

    def ledger_snapshot(self):
        """Read-only view of the reservation ledger (per group: free, reserved, held; per-request rows)."""
        assert self.scheduler_side is not None
        return self.scheduler_side.snapshot()

    # -------------------------------------------------------------- worker role
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker_side is not None
        self.worker_side.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        # Runs before the forward pass: the last moment to finish stores whose source blocks it overwrites.
        if self.worker_side is not None and isinstance(kv_connector_metadata, OffloadMetadata):
            self.worker_side.fence(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: object) -> None:
        assert self.worker_side is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, OffloadMetadata)
        self.worker_side.start(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads complete asynchronously, before the request is scheduled

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: object, **kwargs: object) -> None:
        return None  # stores are whole-block copies issued after the step, not per layer

    def wait_for_save(self) -> None:
        # Not a wait: stores run in the background. vLLM calls this after sampling when drafts are on, the first
        # point where a recurrent state a decode step reached is in its boundary's block (TransferJob.after_sampling).
        if self.worker_side is not None:
            self.worker_side.after_sampling()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self.worker_side is not None
        return self.worker_side.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        # Overridden (not get_finished) to report failed loads: hybrid models cannot use block-level load errors.
        assert self.worker_side is not None
        sending, recving, failed = self.worker_side.transfer_results()
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving, failed_recving=failed)

    def build_connector_worker_meta(self):
        return self.worker_side.worker_meta() if self.worker_side is not None else None

    def shutdown(self) -> None:
        if self.worker_side is not None:
            self.worker_side.shutdown()

    # ------------------------------------------------------------------ metrics (both roles)
    def get_kv_connector_stats(self) -> metrics.OffloadStats | None:
        if self.worker_side is not None:
            return self.worker_side.take_stats()
        assert self.scheduler_side is not None
        return self.scheduler_side.take_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, object] | None = None) -> metrics.OffloadStats:
        return metrics.build_kv_connector_stats(data)

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> OffloadPromMetrics:
        return metrics_prom.build_prom_metrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
