"""Fault, abort and preemption injection for the simulated engine, and the lifecycle invariants they must keep.

Faults in the copies are the simulated copy backend's knobs (`sim.tagcopy.TagCopier`, under the real worker):
separate load and store latencies, jobs held in flight until released (so a test can act at an exact stage), and
store / load jobs that fail (a failed store writes nothing to its host slots and the worker reports it in
`stores_failed`; a failed load writes nothing and is reported in `failed_recving`). `abort` and `preempt` do to a
request what the API server's abort and vLLM's pool-pressure preemption do. `step_invariants` (cheap, every step) and
`drained_invariants` (after a run) list what is wrong with the connector's state: leaked GPU blocks, reference counts, host slots, tier pins that no in-flight job explains, and tier
entries readable although no store filled them with their own tokens. `run_lifecycle` runs one random case
(`LifecycleCase`: layout, pool, a tiny tier, latencies, arrival mix, abort / preemption / failure rates) with both
checks; `tests/sim/test_lifecycle_property.py` draws them.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

from offload_connector.metadata import TransferJob
from offload_bench.sim.driver import SchedulerDriver
from offload_bench.sim.tagcopy import TagCopier


# ---------------------------------------------------------------------- actions
def abort(drv: SchedulerDriver, request_id: str) -> bool:
    """What the API server does when a client disconnects. Returns whether vLLM still had the request."""
    from vllm.v1.request import RequestStatus

    return bool(drv.sched.finish_requests(request_id, RequestStatus.FINISHED_ABORTED))


def preempt(drv: SchedulerDriver, request_id: str) -> bool:
    """Preempt a running request the way vLLM's scheduler does under pool pressure (and as
    `reset_prefix_cache(reset_running_requests=True)` does): out of `running`, blocks freed, back to `waiting`."""
    sched = drv.sched
    req = sched.requests.get(request_id)
    if req is None or req not in sched.running:
        return False
    sched.running.remove(req)
    sched._preempt_request(req, time.monotonic())
    return True


def settle(drv: SchedulerDriver) -> None:
    """Apply every batch still in flight (what the driver does on an empty step), so that vLLM returns the blocks it
    defers freeing while a batch may still write them."""
    while drv._queue:
        drv._apply_oldest()


def hold_inflight(drv: SchedulerDriver, kind: str, request_id: str | None = None) -> list[TransferJob]:
    """Hold the jobs of `kind` now in flight (and those submitted later) until `release`."""
    engine = drv.engine
    assert isinstance(engine, TagCopier)
    jobs = engine.inflight_jobs(kind, request_id)
    engine.hold({j.job_id for j in jobs})
    if kind == "store":
        engine.hold_stores = True
    else:
        engine.hold_loads = True
    return jobs


def step_until(drv: SchedulerDriver, pred: Callable[[SchedulerDriver], bool], max_steps: int = 500,
               check: bool = True) -> int:
    """Step until `pred` holds (checked before each step); the step invariants after every step. Returns steps."""
    for n in range(max_steps):
        if pred(drv):
            return n
        drv.step()
        if check:
            assert_ok(step_invariants(drv))
    if pred(drv):
        return max_steps
    raise AssertionError(f"condition not reached in {max_steps} steps (step {drv.step_no})")


def drain(drv: SchedulerDriver, max_steps: int = 3000, check: bool = True) -> None:
    """Step until nothing is left to do, checking the step invariants, then the drained invariants."""
    start = drv.step_no
    while drv.busy():
        if drv.step_no - start >= max_steps:
            raise AssertionError(f"not drained after {max_steps} steps: {describe(drv)}")
        drv.step()
        if check:
            assert_ok(step_invariants(drv))
    assert_ok(drained_invariants(drv))


# ------------------------------------------------------------------- invariants
def assert_ok(problems: list[str]) -> None:
    if problems:
        raise AssertionError("lifecycle invariant broken:\n  " + "\n  ".join(problems))


def step_invariants(drv: SchedulerDriver) -> list[str]:
    """Cheap checks that hold at every step boundary.

    * every tier pin is explained: a not-yet-readable entry by exactly one in-flight store job that reserved it, and
      each further pin by one in-flight load (admitted, or orphaned by an abort) that reads it;
    * every store job the scheduler side tracks is in flight in the engine or reported done this step (no job the
      engine dropped, none tracked forever), and every tracked load is in flight;
    * host slots: no slot held by two entries, none both used and free, used + free = slots handed out;
    * every readable entry's host slot holds its own key's tag: nothing half-written or failed was published.
    """
    side = drv.side
    tier = side.tier
    view, tv = side.view(), tier.view()
    problems: list[str] = []
    try:
        side.check()  # the job book's own invariants (every reader a live store job, pending sets consistent)
    except AssertionError as err:
        problems.append(f"scheduler side job book: {err}")
    engine = drv.engine
    expected = Counter()
    store_keys: Counter = Counter()
    # Jobs issued before a reset_cache() use retired slots (TierIndex.clear): each holds one use of each of its slots.
    retired_users: Counter = Counter()
    for job_id, store in view.store_jobs.items():
        if job_id in view.retired_store_slots:
            retired_users.update(view.retired_store_slots[job_id])
            continue
        for key in store.keys:
            store_keys[key] += 1
    for load in view.load_jobs():
        if load.job.job_id in view.retired_loads:
            retired_users.update(load.job.host_slots)
            continue
        for key in load.keys:
            expected[key] += 1
    if dict(retired_users) != dict(tv.retired):
        problems.append(f"retired slots {dict(tv.retired)} != uses by jobs issued before the reset "
                        f"{dict(retired_users)}")
    if set(view.retired_store_slots) - set(view.store_jobs):
        problems.append(f"retired store jobs {set(view.retired_store_slots) - set(view.store_jobs)} not tracked")
    for key, entry in tv.entries.items():
        want = expected.get(key, 0) + (0 if entry.ready else 1)
        if entry.pins != want:
            problems.append(f"tier entry {key!r}: {entry.pins} pins, in-flight jobs explain {want}"
                            f" (ready={entry.ready}, loads={expected.get(key, 0)}, stores={store_keys.get(key, 0)})")
        if not entry.ready and store_keys.get(key, 0) != 1:
            problems.append(f"tier entry {key!r} is being stored by {store_keys.get(key, 0)} tracked jobs")
        if entry.ready and entry.pins == 0 and not tier.is_evictable(key):
            problems.append(f"idle ready tier entry {key!r} is not evictable (leaked)")
        if entry.ready and isinstance(engine, TagCopier) and engine.host.get(entry.slot) != key:
            problems.append(f"readable tier entry {key!r} (slot {entry.slot}) holds {engine.host.get(entry.slot)!r}")
    for key in store_keys:
        if key not in tv.entries:
            problems.append(f"store job tracks {key!r}, which the tier no longer has")
    # Read through the tier's eviction policy (lru / slru / arc / out-of-tree): it may order only ready, unpinned
    # entries, each once.
    evictable = tier.evictable_keys()
    if len(set(evictable)) != len(evictable):
        problems.append(f"the eviction policy lists an entry twice ({type(tier.policy).__name__})")
    for key in evictable:
        entry = tv.entries.get(key)
        if entry is None or not entry.ready or entry.pins:
            problems.append(f"evictable list holds {key!r} ({entry})")
    slots = [e.slot for e in tv.entries.values()]
    free = tv.free_slots
    if len(set(slots)) != len(slots):
        problems.append("two tier entries share a host slot")
    if set(slots) & set(free) or len(set(free)) != len(free):
        problems.append("a host slot is both used and free (or free twice)")
    if set(tv.retired) & (set(slots) | set(free)):
        problems.append("a retired host slot is also used or free")
    if len(slots) + len(free) + len(tv.retired) != tv.next_slot or tv.next_slot > tv.capacity_slots:
        problems.append(f"host slots: {len(slots)} used + {len(free)} free + {len(tv.retired)} retired "
                        f"!= {tv.next_slot} handed out")
    if sum(e.nbytes for e in tv.entries.values()) != tv.used_bytes:
        problems.append("tier used_bytes does not match its entries")
    if isinstance(engine, TagCopier):
        in_flight = {i.job.job_id for i in engine.inflight}
        for job_id in view.store_jobs:
            if job_id not in in_flight and job_id not in {j.job_id for j in view.pending_stores}:
                problems.append(f"store job {job_id} is tracked but not in flight")
        for load in view.load_jobs():
            if load.job.job_id not in in_flight and load.job not in view.pending_loads:
                problems.append(f"load job {load.job.job_id} ({load.job.request_id}) is tracked but not in flight")
    # Readers of GPU blocks are exactly the tracked store jobs' blocks.
    readers: dict[int, set[int]] = {}
    for job_id in view.store_jobs:
        for bid in view.job_blocks.get(job_id, ()):
            readers.setdefault(bid, set()).add(job_id)
    if readers != dict(view.block_readers):
        problems.append("block readers do not match the tracked store jobs")
    if set(view.job_blocks) != set(view.store_jobs):
        problems.append(f"job blocks for {set(view.job_blocks) ^ set(view.store_jobs)} without a store job")
    return problems


def drained_invariants(drv: SchedulerDriver) -> list[str]:
    """What must hold once nothing is left to do: every block, slot pin and bookkeeping entry is back."""
    side, sched = drv.side, drv.sched
    problems = list(step_invariants(drv))
    num_blocks = sched.kv_cache_config.num_blocks
    pool = drv.pool
    if pool.get_num_free_blocks() != num_blocks - 1:
        problems.append(f"GPU pool: {pool.get_num_free_blocks()} free, expected {num_blocks - 1}")
    held = [b.block_id for b in pool.blocks if b.ref_cnt != 0 and not b.is_null]
    if held:
        problems.append(f"GPU blocks with ref_cnt != 0: {held[:10]}")
    for mgr in drv.managers():
        if mgr.req_to_blocks:
            problems.append(f"group manager still maps {sorted(mgr.req_to_blocks)[:5]}")
    if sched.requests:
        problems.append(f"vLLM still tracks {sorted(sched.requests)[:5]}")
    if getattr(sched, "finished_recving_kv_req_ids", None):
        problems.append(f"finished_recving_kv_req_ids: {sched.finished_recving_kv_req_ids}")
    for name, left in side.view().leftovers().items():
        problems.append(f"scheduler side {name} not empty: {left}")
    stats = side.tier.stats()
    if stats.pinned_entries:
        problems.append(f"tier: {stats.pinned_entries} pinned entries")
    if stats.ready_entries != stats.used_slots:
        problems.append(f"tier: {stats.used_slots - stats.ready_entries} entries never published")
    if stats.retired_slots:
        problems.append(f"tier: {stats.retired_slots} retired slots never released")
    engine = drv.engine
    if isinstance(engine, TagCopier):
        if engine.inflight:
            problems.append(f"engine: {len(engine.inflight)} jobs still in flight")
        if drv.delayed_free:
            problems.append(f"worker: delayed frees never reported: {drv.delayed_free}")
    return problems


def describe(drv: SchedulerDriver) -> str:
    view, sched = drv.side.view(), drv.sched
    running = [r.request_id for r in sched.running]
    return (f"step {drv.step_no}: vLLM requests {sorted(sched.requests)} running {running}"
            f" side requests {sorted(view.requests)} loads {sorted(view.loads)} orphans {sorted(view.orphan_loads)}"
            f" stores {sorted(view.store_jobs)} awaiting {sorted(view.awaiting_free)}"
            f" engine {[(i.job.job_id, i.is_load, i.due) for i in getattr(drv.engine, 'inflight', ())]}")


def status(drv: SchedulerDriver, request_id: str) -> str | None:
    req = drv.sched.requests.get(request_id)
    return None if req is None else req.status.name


def readable_keys(side: Any) -> set:
    return {k for k, e in side.tier.view().entries.items() if e.ready}


# ------------------------------------------------------------------ random lifecycles
LAYOUTS: dict[str, tuple[tuple[str, int, int], ...]] = {
    "full": (("full", 16, 0),),
    "full+sliding": (("full", 16, 0), ("sliding", 16, 64)),
    "full32+sliding16": (("full", 32, 0), ("sliding", 16, 48)),
    "mla+chunked": (("mla", 16, 0), ("chunked", 16, 64)),
}


@dataclass(frozen=True)
class LifecycleCase:
    layout: str
    pool_factor: float  # GPU pool = factor x the largest request's cold need (small: vLLM preempts)
    prefix_caching: bool  # vLLM's GPU prefix cache (off: every hit comes from the CPU tier)
    cpu_slots: int  # CPU-tier capacity in host blocks
    max_num_batched_tokens: int
    batch_depth: int  # 1: synchronous engine; 2: EngineCore's async batch queue
    load_latency: int
    store_latency: int
    requests: tuple[tuple[int, int, int, int], ...]  # (shared base, kept prefix, new tokens, max_tokens)
    arrival_gaps: tuple[int, ...]  # steps before each arrival
    p_abort: float  # per step: abort a random live request
    p_preempt: float  # per step: preempt a random running request
    p_reset: float  # per step: try to reset the GPU prefix cache (succeeds only when no block is held)
    p_store_fail: float  # per store job
    p_load_fail: float  # per load job (kv_load_failure_policy "recompute")
    seed: int


@dataclass
class LifecycleOutcome:
    steps: int = 0
    aborted: int = 0
    preempted: int = 0  # forced here
    preempted_by_vllm: int = 0
    loads: int = 0
    loaded_tokens: int = 0
    stores_failed: int = 0
    loads_failed: int = 0
    orphaned_loads: int = 0
    evictions: int = 0
    store_rejections: int = 0
    fenced: int = 0
    finished: int = 0


def build_case_driver(case: LifecycleCase) -> tuple[SchedulerDriver, int]:
    """`sim.custom.build_custom`, with vLLM's GPU prefix cache optional."""
    import copy
    import math
    import random

    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from offload_bench.sim.custom import cold_need, make_spec
    from offload_bench.sim.layouts import build_vllm_config
    from offload_bench.sim.scenarios import connector_config

    groups = LAYOUTS[case.layout]
    longest = max(keep + new + max_tokens for _b, keep, new, max_tokens in case.requests)
    num_blocks = int(cold_need(groups, longest, 2 * case.max_num_batched_tokens) * case.pool_factor) + 2
    slot_bytes = 2 * max(bs for _, bs, _ in groups) * 64 * 2
    kvt = connector_config("exact", case.cpu_slots * slot_bytes)
    kvt.kv_load_failure_policy = "recompute"
    vc = build_vllm_config("tiny-llama", max_model_len=4096, max_num_batched_tokens=case.max_num_batched_tokens,
                           num_gpu_blocks=num_blocks, kv_transfer_config=kvt,
                           max_num_seqs=min(64, case.max_num_batched_tokens), async_scheduling=True,
                           enable_prefix_caching=case.prefix_caching)
    specs = [KVCacheGroupSpec([f"layers.{i}.attn"], make_spec(*g)) for i, g in enumerate(groups)]
    sizes = [g[1] for g in groups]
    kc = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=specs)
    if hasattr(kc, "hash_block_size"):
        kc.hash_block_size = math.gcd(*sizes)
    vc.cache_config.num_gpu_blocks = num_blocks
    sched = Scheduler(vllm_config=vc, kv_cache_config=copy.deepcopy(kc),
                      structured_output_manager=StructuredOutputManager(vc), block_size=math.lcm(*sizes),
                      hash_block_size=math.gcd(*sizes))
    rng = random.Random(case.seed ^ 0x5EED)
    engine = TagCopier(case.load_latency, case.store_latency,
                       fail_store=lambda job: rng.random() < case.p_store_fail,
                       fail_load=lambda job: rng.random() < case.p_load_fail)
    drv = SchedulerDriver(sched, engine, batch_depth=case.batch_depth)
    assert drv.side.tier.capacity_slots == case.cpu_slots
    assert sched.kv_cache_manager.enable_caching == case.prefix_caching
    return drv, math.gcd(*sizes)


def run_lifecycle(case: LifecycleCase, max_steps: int = 4000, check_every_step: bool = True) -> LifecycleOutcome:
    """Random arrivals sharing prefixes, random aborts and preemptions, failing jobs and a tiny tier; checks the step
    invariants after every step and the drained invariants at the end (raises AssertionError / LoadContentError)."""
    import random

    from offload_bench.sim.requests import make_request, tokens

    drv, hbs = build_case_driver(case)
    rng = random.Random(case.seed)
    out = LifecycleOutcome()
    bases = [tokens(case.seed * 7 + b, 1200) for b in range(3)]
    pending = []
    for i, ((base, keep, new, max_tokens), gap) in enumerate(zip(case.requests, case.arrival_gaps)):
        prompt = bases[base][:keep] + tokens(case.seed * 13 + 100 + i, new)
        pending.append([gap, make_request(f"q{i}", prompt, max_tokens, hbs)])
    seen_preempt: set[tuple[str, int]] = set()
    aborted: set[str] = set()
    while pending or drv.busy():
        if drv.step_no >= max_steps:
            raise AssertionError(f"not drained in {max_steps} steps: {describe(drv)}")
        while pending and pending[0][0] <= 0:
            drv.add([pending.pop(0)[1]])
        if pending:
            pending[0][0] -= 1
        live = [r for r in drv.sched.requests.values() if not r.is_finished()]
        if live and rng.random() < case.p_abort:
            # Half the aborts go to a request whose load is in flight, if any: the rarest and most delicate stage.
            loads = drv.side.view().loads
            loading = [r for r in live if r.request_id in loads]
            victim = rng.choice(loading if loading and rng.random() < 0.5 else live)
            if victim.request_id in loads:
                out.orphaned_loads += 1
            out.aborted += abort(drv, victim.request_id)
            aborted.add(victim.request_id)
        running = list(drv.sched.running)
        if running and rng.random() < case.p_preempt:
            out.preempted += preempt(drv, rng.choice(running).request_id)
        if rng.random() < case.p_reset and not drv._queue:
            drv.sched.reset_prefix_cache()
        drv.step()
        for req in drv.sched.requests.values():
            if req.num_preemptions and (req.request_id, req.num_preemptions) not in seen_preempt:
                seen_preempt.add((req.request_id, req.num_preemptions))
        if check_every_step:
            assert_ok(step_invariants(drv))
    assert_ok(drained_invariants(drv))
    side, engine = drv.side, drv.engine
    assert isinstance(engine, TagCopier)
    out.steps = drv.step_no
    out.preempted_by_vllm = max(0, len(seen_preempt) - out.preempted)
    out.loads = side.counters.loads_admitted
    out.loaded_tokens = side.counters.loaded_tokens
    out.stores_failed = engine.stores_failed
    out.loads_failed = engine.loads_failed
    out.evictions = side.tier.evictions
    out.store_rejections = side.tier.store_rejections
    out.fenced = engine.fenced
    out.finished = len(drv.finished)
    # Every request that was not aborted finished.
    missing = {f"q{i}" for i in range(len(case.requests))} - drv.finished - aborted
    if missing:
        raise AssertionError(f"requests neither finished nor aborted: {sorted(missing)}")
    return out


def random_case(rng: Any) -> LifecycleCase:
    """A random case from `rng` (random.Random), drawn like the property test's strategy."""
    req = tuple((rng.randint(0, 2), rng.randint(0, 500), rng.randint(1, 150), rng.randint(1, 200))
                for _ in range(rng.randint(2, 7)))
    return LifecycleCase(
        layout=rng.choice(sorted(LAYOUTS)), pool_factor=rng.uniform(1.05, 3.0), prefix_caching=rng.random() < 0.5,
        cpu_slots=rng.choice([3, 6, 12, 24, 60, 400, 400]), max_num_batched_tokens=rng.choice([32, 64, 128]),
        batch_depth=rng.choice([1, 2]), load_latency=rng.randint(1, 4), store_latency=rng.choice([1, 2, 3, 5, 12]),
        requests=req, arrival_gaps=tuple(rng.choice([0, 0, 1, 3, 8, 20]) for _ in req),
        p_abort=rng.choice([0.0, 0.02, 0.08]), p_preempt=rng.choice([0.0, 0.02, 0.08]),
        p_reset=rng.choice([0.0, 0.05, 0.3]), p_store_fail=rng.choice([0.0, 0.0, 0.1, 0.4]),
        p_load_fail=rng.choice([0.0, 0.0, 0.2]), seed=rng.randrange(1 << 20))
