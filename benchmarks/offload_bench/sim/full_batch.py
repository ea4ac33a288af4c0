"""The scene of vLLM 0.34's `may_load_async`: the running batch is full and requests return with prefixes in the
CPU tier.

A small layout (full attention + a 128-token window, blocks of 16), `max_num_seqs` 2, two long decoders holding both
running slots, then `returning` requests whose 2,000-token prefix is in the CPU tier (the GPU prefix cache reset).
Without a way to load while the batch is full, the loads wait for a decoder to finish; with
`--max-num-inflight-kv-loads` and the connector's `may_load_async`, they load behind the decoders. vLLM's real
scheduler, tag-checked copies with a fixed latency in steps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from offload_bench.sim.custom import build_custom
from offload_bench.sim.driver import SchedulerDriver
from offload_bench.sim.requests import make_request, tokens
from offload_bench.sim.scenarios import connector_config
from offload_bench.sim.tagcopy import TagCopier

GROUPS = (("full", 16, 0), ("sliding", 16, 128))
PREFIX = 2000


@dataclass(frozen=True)
class FullBatchResult:
    override: bool  # the connector answered may_load_async (False: vLLM's default answer, False)
    inflight: int | None  # --max-num-inflight-kv-loads
    first_load_step: int | None  # steps after the returning requests arrived until the first load was issued
    first_token_steps: tuple[int | None, ...]  # per returning request, steps until its first output token
    loaded_tokens: int
    not_started: int  # lookups of a load the ledger admitted and vLLM did not start
    aged_out: int
    steps: int
    drained: bool  # nothing pinned, reserved or in flight at the end


def warm(num_blocks: int = 600, **build: Any) -> tuple[SchedulerDriver, int, list[int]]:
    """A driver whose CPU tier holds PREFIX tokens of `prefix` (the GPU prefix cache reset)."""
    sched, hbs = build_custom(GROUPS, num_blocks=num_blocks, max_num_batched_tokens=512, max_model_len=8192,
                              kv_transfer_config=connector_config("exact", 1 << 32), **build)
    drv = SchedulerDriver(sched, TagCopier(1))
    prefix = tokens(1, PREFIX)
    drv.add([make_request("warm", prefix, 1, hbs)])
    if drv.run().stalled:
        raise RuntimeError("warm-up stalled")
    sched.reset_prefix_cache()
    return drv, hbs, prefix


def run(override: bool, inflight: int | None, returning: int = 2) -> FullBatchResult:
    """The returning requests share one prefix: the first load puts it in the GPU prefix cache for the others."""
    drv, hbs, prefix = warm(num_blocks=800, max_num_seqs=2, max_num_inflight_kv_loads=inflight)
    if not override:
        drv.sched.get_kv_connector().may_load_async = lambda request: False
    drv.add([make_request(f"dec{i}", tokens(10 + i, 300), 150 + 20 * i, hbs) for i in range(2)])
    for _ in range(5):
        drv.step()
    start = drv.step_no
    ids = [f"ret{i}" for i in range(returning)]
    drv.add([make_request(rid, prefix + tokens(20 + i, 40), 2, hbs) for i, rid in enumerate(ids)])
    first_load: int | None = None
    first_token: dict[str, int] = {}
    while drv.busy() and drv.step_no < start + 3000:
        drv.step()
        if first_load is None and drv.side.counters.loads_admitted > 0:
            first_load = drv.step_no - start
        for rid in ids:
            req = drv.sched.requests.get(rid)
            if rid not in first_token and (req is None or req.num_output_tokens > 0):
                first_token[rid] = drv.step_no - start
    c = drv.side.counters
    return FullBatchResult(override, inflight, first_load, tuple(first_token.get(r) for r in ids), c.loaded_tokens,
                           c.not_started, c.deferral_timeouts, drv.step_no - start, drv.idle_invariant())
