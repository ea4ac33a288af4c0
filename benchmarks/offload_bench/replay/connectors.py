"""The connectors a replay compares, each on its own real vLLM `Scheduler` over the same KV layout.

- `offload`: ours, `reservation: "exact"`; its real worker over the simulated copy backend (`sim.tagcopy.TagCopier`,
  timed by `ClockTiming`; checks loaded contents).
- `offload-vllm-reservation`: ours with `reservation: "vllm"` (trusts vLLM's own async-load reservation).
- `vllm-offloading`: vLLM's in-tree `OffloadingConnector`, its real scheduler and worker classes; only the copy
  engine under the worker is simulated (`TimedFakeOffloadingWorker`).
- `vllm-offloading-patched`: the same, on a scheduler whose async-load admission count has the upstream fix for
  sliding-window / chunked-local groups (sim/vllm_patched.py), applied to that one scheduler's managers only.
- `none`: no connector; every prefix outside the GPU prefix cache is recomputed.

Instrumentation is attached by wrapping bound methods on the instances (the scheduler's `schedule` and
`update_from_output`, the connector's `get_num_new_matched_tokens` and `update_state_after_alloc`): the drivers and
the connectors run unmodified.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from offload_bench.replay import CONNECTORS
from offload_bench.replay.engines import (ClockTiming, TimedFakeOffloadingWorker, TransferTally, block_id_bytes,
                                          spec_bytes)
from offload_bench.replay.metrics import Recorder
from offload_bench.replay.timemodel import SimClock
from offload_bench.sim.driver import SchedulerDriver, StepRecord
from offload_bench.sim.layouts import build_scheduler, build_sim_model, build_vllm_config
from offload_bench.sim.scenarios import connector_config
from offload_bench.sim.tagcopy import TagCopier
from offload_bench.sim.vllm_compat import waiting_count

__all__ = ["CONNECTORS", "EngineSettings", "ReplayEngine", "VLLM_OFFLOADING"]

# Columns that run vLLM's in-tree OffloadingConnector (and so share its worker simulation and tier read-outs).
VLLM_OFFLOADING = ("vllm-offloading", "vllm-offloading-patched")


@dataclass(frozen=True)
class EngineSettings:
    """The simulated engine's shape; the replay and soak commands' configs extend it."""

    model: str
    num_gpu_blocks: int
    cpu_bytes: int
    max_num_batched_tokens: int
    max_model_len: int
    max_num_seqs: int
    check_loads: bool = True
    # Extra kv_connector_extra_config keys for our connector's columns (e.g. window_checkpoint_tokens), as JSON
    # pairs so the frozen settings stay hashable.
    offload_extra: tuple[tuple[str, Any], ...] = ()
    # Batches vLLM keeps in flight under pipeline parallelism (the stages' layer split is not simulated), and the MTP
    # drafts per step (speculative decoding as the model's MTP: sim.layouts.attach_mtp; 0: off).
    pipeline_parallel_size: int = 1
    num_speculative_tokens: int = 0
    # vLLM 0.34 with MTP: block hashes that also cover the drafter's next tokens, so no hit drops its last block
    # (False: the speculative config's `disable_lookahead_block_hashes`; every column of a run alike).
    lookahead_block_hashes: bool = True
    # vLLM 0.34's --max-num-inflight-kv-loads (None: unset): loads may start while the running batch is full, up to
    # this many in flight, for a connector whose `may_load_async` says so (ours does; vLLM's connectors do not).
    max_num_inflight_kv_loads: int | None = None


class ReplayEngine:
    """One connector's scheduler + simulated worker, stepping in simulated time."""

    def __init__(self, kind: str, settings: EngineSettings, clock: SimClock) -> None:
        if kind not in CONNECTORS:
            raise ValueError(f"unknown connector {kind!r}; choose from {', '.join(CONNECTORS)}")
        kt = None
        if kind in ("offload", "offload-vllm-reservation"):
            kt = connector_config("exact" if kind == "offload" else "vllm", settings.cpu_bytes,
                                  **dict(settings.offload_extra))
        elif kind in VLLM_OFFLOADING:
            from offload_bench.sim.vllm_offloading import offloading_config
            kt = offloading_config(settings.cpu_bytes)
        vc = self._build(kind, settings, clock, kt)
        if kind == "vllm-offloading-patched":
            # Before any request exists, on this scheduler's managers only: the other columns stay unpatched vLLM.
            from offload_bench.sim.vllm_patched import apply_admission_fix
            self.patched_groups = apply_admission_fix(self.sched)
        if kind in VLLM_OFFLOADING:
            from offload_bench.sim.vllm_offloading import VllmOffloadingDriver, VllmOffloadingWorkerSim
            worker = VllmOffloadingWorkerSim(vc, self.sim.worker_kv_cache_config, latency_steps=1)
            fake = TimedFakeOffloadingWorker(clock, spec_bytes(self.block_bytes))
            worker.engine = fake
            worker.connector.connector_worker.worker = fake
            self.tally = fake.tally
            self.driver: Any = VllmOffloadingDriver(self.sched, worker)
        elif self.side is not None:
            timing = ClockTiming(clock, self.block_bytes)
            self.tally = timing.tally
            self.driver = SchedulerDriver(self.sched, TagCopier(timing=timing, log_jobs=False),
                                          check_loads=settings.check_loads)
        else:
            self.driver = SchedulerDriver(self.sched, None)
        self._instrument()

    def _build(self, kind: str, settings: EngineSettings, clock: SimClock, kv_transfer_config: Any) -> Any:
        """vLLM config, simulated model and real scheduler for one connector, plus what the recorder needs."""
        self.kind = kind
        self.clock = clock
        self.patched_groups: list[int] = []  # groups whose admission count sim/vllm_patched.py fixed
        vc = build_vllm_config(settings.model, max_model_len=settings.max_model_len,
                               max_num_batched_tokens=settings.max_num_batched_tokens,
                               max_num_seqs=settings.max_num_seqs, num_gpu_blocks=settings.num_gpu_blocks,
                               kv_transfer_config=kv_transfer_config,
                               pipeline_parallel_size=settings.pipeline_parallel_size,
                               num_speculative_tokens=settings.num_speculative_tokens,
                               lookahead_block_hashes=settings.lookahead_block_hashes)
        if settings.max_num_inflight_kv_loads is not None:
            vc.scheduler_config.max_num_inflight_kv_loads = settings.max_num_inflight_kv_loads
        self.vllm_config = vc
        self.sim = build_sim_model(settings.model, vllm_config=vc, num_blocks=settings.num_gpu_blocks)
        self.sched = build_scheduler(self.sim, vc)
        groups = self.sim.kv_cache_config.kv_cache_groups
        self.group_names = [f"g{i}:{type(g.kv_cache_spec).__name__}/{g.kv_cache_spec.block_size}"
                            for i, g in enumerate(groups)]
        self._recycling = [getattr(g.kv_cache_spec, "sliding_window", None) is not None
                           or getattr(g.kv_cache_spec, "attention_chunk_size", None) is not None for g in groups]
        self.recorder = Recorder(self.sim.hash_block_size, self.group_names, self.sim.kv_cache_config.num_blocks - 1)
        self.tally = TransferTally()
        # Transfer time uses the real bytes of a block id per group, the same figure for every connector.
        self.block_bytes = block_id_bytes(self.sim.worker_kv_cache_config)
        self.conn = self.sched.get_kv_connector()
        self.side = getattr(self.conn, "scheduler_side", None)
        return vc

    # ---------------------------------------------------------- instrumentation
    def _instrument(self) -> None:
        sched, rec, clock = self.sched, self.recorder, self.clock
        schedule, update = sched.schedule, sched.update_from_output

        def timed_schedule(*a: Any, **kw: Any) -> Any:
            out = schedule(*a, **kw)
            prefill, decode = rec.on_schedule(out, sched.requests)
            clock.begin_batch(prefill, decode)
            return out

        def observed_update(scheduler_output: Any, model_runner_output: Any) -> Any:
            t = clock.pop_applied_batch_end()
            res = update(scheduler_output, model_runner_output)
            rec.on_applied(res, t)
            return res

        sched.schedule = timed_schedule
        sched.update_from_output = observed_update
        if self.conn is None:
            return
        lookup, alloc = self.conn.get_num_new_matched_tokens, self.conn.update_state_after_alloc
        cpu_prefix = self._cpu_prefix_fn()

        resident = self._resident_prefix_fn()

        def observed_lookup(request: Any, num_computed_tokens: int, *a: Any, **kw: Any) -> Any:
            res = lookup(request, num_computed_tokens, *a, **kw)
            if res[0] is None:
                rec.deferrals += 1
            if rec.wants_lookup(request.request_id):
                rec.on_lookup(request, cpu_prefix(request, num_computed_tokens, res[0]), resident(request))
            return res

        def observed_alloc(request: Any, blocks: Any, num_external_tokens: int) -> Any:
            rec.on_loaded(request.request_id, num_external_tokens)
            return alloc(request, blocks, num_external_tokens)

        self.conn.get_num_new_matched_tokens = observed_lookup
        self.conn.update_state_after_alloc = observed_alloc

    def _cpu_prefix_fn(self) -> Callable[[Any, int, int | None], int | None]:
        side = self.side
        if side is not None:
            # Ours decides admission after the lookup; ask the tier directly for what it could restore.
            return lambda req, local, n: side.admission.hit(req, req.num_tokens - 1)
        # vLLM's connector answers with its tier hit (None: a store still pending; keep the previous answer).
        return lambda req, local, n: None if n is None else local + n

    def _resident_prefix_fn(self) -> Callable[[Any], int | None]:
        """Longest prefix whose full-attention KV the CPU tier holds, whether or not the windows that sliding
        groups need at that point are there too (so it may not be restorable)."""
        side = self.side
        if side is not None:
            from offload_connector.scheduler.lookup import longest_hit

            full = [g for g in side.groups if not g.recycling]
            return lambda req: longest_hit(full, side.layout.keys(req), side.tier.is_ready, req.num_tokens - 1, 1)
        if self.kind not in VLLM_OFFLOADING:
            return lambda req: None
        cs = self.conn.connector_scheduler
        from vllm.v1.kv_offload.base import LookupResult

        def resident(req: Any) -> int | None:
            st = cs._req_status.get(req.request_id)  # read-only: lookup() on the CPU manager does not touch LRU
            if st is None:
                return None
            best = None
            for idx in cs._full_attention_groups:
                gc, gs = cs.config.kv_group_configs[idx], st.group_states[idx]
                n = 0
                for key in gs.offload_keys:
                    if cs.manager.lookup(key, st.req_context) is not LookupResult.HIT:
                        break
                    n += 1
                best = n * gc.tokens_per_chunk if best is None else min(best, n * gc.tokens_per_chunk)
            return None if best is None else min(best, req.num_tokens - 1)

        return resident

    # ------------------------------------------------------------------ stepping
    def add(self, request: Any, phase: str = "") -> None:
        self.recorder.on_arrival(request, self.clock.now, phase)
        self.driver.add([request])

    def busy(self) -> bool:
        return self.driver.busy()

    def waiting_count(self) -> int:
        return waiting_count(self.sched)

    def step(self) -> StepRecord:
        rec = self.driver.step()
        if isinstance(self.driver, SchedulerDriver):
            obs = rec
        else:
            landed = getattr(self.sched, "finished_recving_kv_req_ids", set())
            in_flight = self.driver.worker.pending() or self.conn.has_pending_push_work() or any(
                r.status.name == "WAITING_FOR_REMOTE_KVS" and r.request_id not in landed
                for r in self.sched.requests.values())
            obs = StepRecord(self.step_no, rec.total_num_scheduled_tokens, len(self.sched.running),
                             self.waiting_count(), self.driver.pool.get_num_free_blocks(), bool(in_flight))
        self.recorder.on_step(self.clock.now, obs.free_blocks, obs.running, obs.waiting, self.group_live())
        return obs

    def loads_content_checked(self) -> int | None:
        """Loads whose landed blocks the driver compared with the stored tags (ours only; a mismatch raises)."""
        eng = getattr(self.driver, "engine", None)
        if not isinstance(eng, TagCopier) or not self.driver.check_loads:
            return None
        return eng.loads_done

    def recorder_completed(self) -> int:
        return self.recorder.completed

    @property
    def step_no(self) -> int:
        return self.driver.step_no

    def group_live(self) -> list[int]:
        """Distinct real blocks each KV cache group holds across requests."""
        out = []
        for mgr, recycling in zip(self.sched.kv_cache_manager.coordinator.single_type_managers, self._recycling):
            ids: set[int] = set()
            for blocks in mgr.req_to_blocks.values():
                if recycling:  # windows replace the blocks they leave with null blocks, from the front
                    for b in reversed(blocks):
                        if b.is_null:
                            break
                        ids.add(b.block_id)
                else:
                    ids.update(b.block_id for b in blocks if not b.is_null)
            out.append(len(ids))
        return out

    # ------------------------------------------------------------------ CPU tier
    def tier_usage(self) -> tuple[int | None, int | None]:
        """(host bytes the CPU tier occupies, prompt tokens whose full-attention KV it holds)."""
        if self.side is not None:
            side = self.side
            full = {g.index: g.block_size for g in side.groups if not g.recycling}
            keys = list(side.tier.keys())
            tokens = sum(full[g] for g, _ in keys if g in full)
            return len(keys) * side.slot_bytes, tokens
        if self.kind in VLLM_OFFLOADING:
            cs = self.conn.connector_scheduler
            mgr = cs.manager
            chunks = getattr(getattr(mgr, "_policy", None), "chunks", None)
            if chunks is None:
                return None, None
            used = mgr._num_allocated_chunks - len(mgr._free_list)
            full = {cs.config.kv_group_configs[i].group_idx: cs.config.kv_group_configs[i].tokens_per_chunk
                    for i in cs._full_attention_groups}
            tokens = sum(full.get(int.from_bytes(bytes(k)[-4:], "big"), 0) for k in chunks)
            return used * self.vllm_chunk_bytes(), tokens
        return None, None

    def vllm_chunk_bytes(self) -> int:
        kt = self.vllm_config.kv_transfer_config.kv_connector_extra_config
        mgr = self.conn.connector_scheduler.manager
        return int(kt["cpu_bytes_to_use"]) // max(1, mgr._num_chunks)
