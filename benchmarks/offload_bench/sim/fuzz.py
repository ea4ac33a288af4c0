"""Random scenarios over random layouts, checked step by step (shared by the property tests and the benchmark)."""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass, field
from typing import Any

from offload_bench.sim.custom import GroupDesc, build_custom, cold_need
from offload_bench.sim.driver import LoadContentError, SchedulerDriver
from offload_bench.sim.peaks import PeakChecker
from offload_bench.sim.requests import hash_lookahead, make_request, tokens
from offload_bench.sim.scenarios import connector_config
from offload_bench.sim.tagcopy import TagCopier
from offload_bench.sim.vllm_compat import startable_waiting_ids


@dataclass(frozen=True)
class FuzzCase:
    groups: tuple[GroupDesc, ...]
    max_num_batched_tokens: int
    pool_factor: float  # pool = factor x the largest single request's cold need
    sessions: tuple[tuple[int, int, int, int], ...]  # (first prompt, max_tokens, kept prefix, new tokens)
    reset_prefix_cache: bool
    return_gaps: tuple[int, ...]  # steps between returning arrivals
    latency_steps: int
    seed: int
    num_spec_tokens: int = 0  # speculative decoding: drafts per step (0: off)
    spec_method: str = "ngram"  # see custom.SPEC_METHODS: ngram (sync engine), ngram_gpu, draft_model, eagle (async)
    pipeline_parallel_size: int = 1  # vLLM keeps this many batches in flight (more with async scheduling)
    # Per session: the return is the kept prefix alone, cut to a boundary of every group (a prompt sent again, which
    # may be loaded whole: `lookup.hit_upper`), instead of the kept prefix and new tokens.
    resends: tuple[bool, ...] = ()


@dataclass
class FuzzOutcome:
    mismatches: list[str] = field(default_factory=list)
    peak_violations: list[str] = field(default_factory=list)  # a request held more blocks than reserved
    loads_peak_checked: int = 0
    stalls: int = 0
    idle_zero_steps: int = 0  # no token scheduled, requests waiting, nothing in flight, and the connector held one
    # back, or its reservations could have let a waiting request run.
    # The same, with the connector holding nothing back (it answered every lookup, its reservations kept no waiting
    # request out): vLLM's own. 0.34
    # leaves small pools idle a step or two under PP with speculative decoding (e.g. 2 free blocks, a request
    # waiting for its drafts, the next one for 3 blocks), with or without a connector's verdict in it.
    vllm_idle_steps: int = 0
    # Idle steps whose only verdict deferred a load whose own exact need did not fit the free pool (see `run_case`).
    idle_exact_holds: int = 0
    undrained: int = 0
    admissions: int = 0
    whole_prompt_loads: int = 0  # admitted loads of a whole prompt (vLLM computes its last token again)
    loaded_tokens: int = 0
    drafts_scheduled: int = 0
    drafts_accepted: int = 0
    deferrals: int = 0
    too_big: int = 0  # hits that could not fit even in an idle pool (recomputed)
    # Deferred loads that fit an idle pool and were given up (aged out), or admitted later than the bound of
    # `WAIT_BOUND`: twice the longest any request of the case lived from arrival to finish, plus 50 steps. A load
    # waits for the requests holding blocks when it was deferred, and for newer ones only while they hold what it
    # needs; each of those finishes within one lifetime.
    starved: list[str] = field(default_factory=list)
    deferred_loads: int = 0
    longest_deferral: int = 0

    @property
    def ok(self) -> bool:
        return not (self.mismatches or self.peak_violations or self.stalls or self.idle_zero_steps
                    or self.undrained or self.starved)


MAX_MODEL_LEN = 8192
SPEC_TOKENS = (0, 1, 2, 4, 7)
SPEC_METHODS = ("ngram", "ngram_gpu", "draft_model", "eagle")
# Pipeline-parallel sizes, drawn from the case's own seed (not the case stream), so every case drawn before PP was
# simulated keeps its layout, sessions and spec setting; half the cases now run with 2 or 4 batches in flight.
PP_SIZES = (1, 1, 2, 4)


class _Waits:
    """Arrival, finish and first deferral of every request, for the bound on how long a deferred load waits."""

    def __init__(self) -> None:
        self.arrived: dict[str, int] = {}
        self.finished: dict[str, int] = {}
        self.deferred: dict[str, int] = {}

    def observe(self, drv: SchedulerDriver) -> None:
        step = drv.step_no
        for rid in drv.sched.requests:
            self.arrived.setdefault(rid, step)
        for rid in self.arrived:
            if rid not in self.finished and rid not in drv.sched.requests:
                self.finished[rid] = step
        for rid, state in drv.side._requests.items():
            if state.deferred_since is not None:
                self.deferred.setdefault(rid, state.deferred_since)

    def judge(self, side: Any, outcome: FuzzOutcome) -> None:
        lifetimes = [self.finished[r] - a for r, a in self.arrived.items() if r in self.finished]
        bound = 2 * max(lifetimes, default=0) + 50
        if side.counters.deferral_timeouts:
            outcome.starved.append(f"{side.counters.deferral_timeouts} loads aged out")
        for rid, since in self.deferred.items():
            outcome.deferred_loads += 1
            admitted = [a.step for a in side.admissions if a.request_id == rid and a.step >= since]
            if not admitted:  # its hit shrank or it no longer fit an idle pool: recomputed, not starved
                continue
            wait = admitted[0] - since
            outcome.longest_deferral = max(outcome.longest_deferral, wait)
            if wait > bound:
                outcome.starved.append(f"{rid}: deferred at step {since}, admitted {wait} steps later (bound {bound})")


def spec_methods_for(groups) -> tuple[str, ...]:
    """vLLM refuses EAGLE with chunked local attention in a hybrid layout."""
    if any(kind == "chunked" for kind, _, _ in groups):
        return tuple(m for m in SPEC_METHODS if m != "eagle")
    return SPEC_METHODS


def lookahead_tokens(case: FuzzCase) -> int:
    """KV slots vLLM reserves past the scheduled tokens (`VllmConfig.num_lookahead_tokens`): k for a drafter with its
    own forward pass (draft model, EAGLE), none for n-gram."""
    return case.num_spec_tokens if case.spec_method in ("draft_model", "eagle") else 0


def random_case(rng: random.Random) -> FuzzCase:
    kinds = ["full", "mla", "sliding", "sliding_mla", "chunked"]
    n_groups = rng.randint(1, 4)
    groups = []
    for _ in range(n_groups):
        kind = rng.choice(kinds)
        bs = rng.choice([16, 32, 64])
        extent = 0
        if kind in ("sliding", "sliding_mla"):
            extent = rng.choice([16, 48, 64, 128, 257, 512])
        elif kind == "chunked":
            extent = bs * rng.choice([2, 4, 8])
        groups.append((kind, bs, extent))
    if any(k == "chunked" for k, _, _ in groups):
        # vLLM supports chunked local attention only when every group has the same block size. Chunks that are not
        # a multiple of the block (100 tokens over blocks of 24) put the chunk start inside a block.
        bs = rng.choice([groups[0][1], 24])
        groups = [(k, bs, _chunk(rng, bs) if k == "chunked" else e) for k, _, e in groups]
    # vLLM's hybrid coordinator wants at least one full-attention-like group to anchor prefix hits.
    if not any(k in ("full", "mla") for k, _, _ in groups) and rng.random() < 0.7:
        groups[0] = ("full", groups[0][1], 0)
    sessions = []
    for _ in range(rng.randint(1, 5)):
        first = rng.randint(40, 3000)
        sessions.append((first, rng.randint(1, 6), rng.randint(0, first + 6), rng.randint(1, 1200)))
    case = FuzzCase(
        groups=tuple(groups), max_num_batched_tokens=rng.choice([64, 128, 256, 512]),
        pool_factor=rng.uniform(1.05, 3.0), sessions=tuple(sessions), reset_prefix_cache=rng.random() < 0.7,
        return_gaps=tuple(rng.choice([0, 0, 1, 3, 10]) for _ in sessions), latency_steps=rng.randint(1, 4),
        seed=(seed := rng.randrange(1 << 30)), num_spec_tokens=rng.choice(SPEC_TOKENS),
        spec_method=rng.choice(spec_methods_for(groups)),
        pipeline_parallel_size=random.Random(seed ^ 0x9E3779B9).choice(PP_SIZES))
    case = with_resends(case, random.Random(seed ^ 0x72657365))
    return with_mamba(case, random.Random(seed ^ 0x6D616D62))


def with_resends(case: FuzzCase, rng: random.Random) -> FuzzCase:
    """A quarter of the sessions return as their kept prefix alone, ending on a block boundary of every group, drawn
    from the case's own seed so that every case keeps the layout, sessions and settings it had before."""
    return dataclasses.replace(case, resends=tuple(rng.random() < 0.25 for _ in case.sessions))


def returning_prompt(case: FuzzCase, session: int, history: list[int]) -> list[int]:
    """The prompt session `session` returns with: its kept prefix and new tokens, or for a resend the kept prefix
    cut to a boundary of every group (the new tokens if that leaves nothing)."""
    _, _, keep, new = case.sessions[session]
    if session < len(case.resends) and case.resends[session]:
        align = math.lcm(*(bs for _, bs, _ in case.groups))
        cut = min(keep, len(history)) // align * align
        if cut:
            return history[:cut]
    return history[:keep] + tokens(case.seed + 1000 + session, new)


def with_mamba(case: FuzzCase, rng: random.Random) -> FuzzCase:
    """A third of the cases become Mamba hybrids, drawn from the case's own seed so that every other case keeps the
    layout, sessions and settings it had before Mamba groups were simulated. vLLM's align mode gives attention and
    Mamba groups one block size; chunked local attention needs one block size too, so those cases stay as they are.
    Drafts stay as drawn (speculative state blocks, `num_speculative_blocks`, one per draft token), with a token
    budget of at least 128: vLLM 0.34 schedules nothing at all for a hybrid under a draft model with a 64-token
    budget (checked without any connector: 0 tokens in 3 steps at Mamba blocks of 16 and 64, 1 or 4 drafts; 192
    with 128; EAGLE and n-gram run at 64)."""
    if rng.random() >= 1 / 3 or any(kind == "chunked" for kind, _, _ in case.groups):
        return case
    bs = rng.choice([16, 32, 64])
    groups = [(kind, bs, extent) for kind, _, extent in case.groups]
    for _ in range(rng.randint(1, 3)):
        groups.insert(rng.randint(0, len(groups)), ("mamba", bs, rng.choice([0, 1])))
    if not any(kind in ("full", "mla") for kind, _, _ in groups):
        groups.insert(0, ("full", bs, 0))
    budget = max(case.max_num_batched_tokens, 128) if case.num_spec_tokens else case.max_num_batched_tokens
    return dataclasses.replace(case, groups=tuple(groups), max_num_batched_tokens=budget)


def _chunk(rng: random.Random, block_size: int) -> int:
    if rng.random() < 0.3:
        return rng.choice([40, 72, 100, 3 * block_size // 2 + 4])
    return block_size * rng.choice([2, 4, 8])


def _cold_need(case: FuzzCase, length: int, in_flight: int) -> int:
    # The first decode step takes 1 + k slots (+ lookahead) past the prompt.
    return cold_need(case.groups, length + case.num_spec_tokens + lookahead_tokens(case), in_flight,
                     case.num_spec_tokens)


def run_case(case: FuzzCase, max_steps: int = 20_000) -> FuzzOutcome:
    outcome = FuzzOutcome()
    longest = max(max(first + mt, keep + new + mt) for first, mt, keep, new in case.sessions)

    def build(batches: int) -> tuple[Any, int]:
        # A pool that can hold the longest request cold next to `batches` batches in flight: vLLM reserves room for
        # every batch it keeps in flight (`max_concurrent_batches`: 2 under async scheduling, PP batches up to 0.33,
        # PP + 1 from 0.34) and schedules nothing in a smaller pool, connector or not.
        num_blocks = int(_cold_need(case, longest, batches * case.max_num_batched_tokens) * case.pool_factor) + 2
        return build_custom(case.groups, num_blocks=num_blocks, max_num_batched_tokens=case.max_num_batched_tokens,
                            max_model_len=MAX_MODEL_LEN, kv_transfer_config=connector_config("exact", 1 << 40),
                            num_speculative_tokens=case.num_spec_tokens, spec_method=case.spec_method,
                            pipeline_parallel_size=case.pipeline_parallel_size)

    assumed = max(2, case.pipeline_parallel_size)
    sched, hash_bs = build(assumed)
    batches = int(getattr(sched.vllm_config, "max_concurrent_batches", assumed) or assumed)
    if batches > assumed:
        sched, hash_bs = build(batches)
    lookahead = hash_lookahead(sched)
    peaks = PeakChecker()
    drv = SchedulerDriver(sched, TagCopier(case.latency_steps), spec_seed=case.seed, peaks=peaks)
    base = [tokens(case.seed + s, first) for s, (first, _, _, _) in enumerate(case.sessions)]
    drv.add([make_request(f"w{s}", base[s], mt, hash_bs, hash_lookahead_tokens=lookahead)
             for s, (_, mt, _, _) in enumerate(case.sessions)])
    idle_run = [0]
    waits = _Waits()

    def step() -> None:
        c = drv.side.counters
        held_before = c.deferrals + c.held_for_older + c.held_behind_load + c.not_started
        waited_before = c.held_for_older + c.held_behind_load + c.not_started
        rec = drv.step()
        waits.observe(drv)
        if not rec.idle_while_waiting:
            idle_run[0] = 0
            return
        idle_run[0] += 1
        # The connector's doing only if a waiting request vLLM could have run this step was kept out by one of its
        # verdicts this step (deferred, held for an older load, not started). Its reservations keep nothing out by
        # themselves: vLLM does not see them, they only shape verdicts (an in-flight load's blocks vLLM does see,
        # and a request they crowd out fails first_chunk_fits). A request vLLM would not give its next chunk's
        # blocks (the chunk, or under `scheduler_reserve_full_isl` its whole sequence, does not fit the free pool)
        # could not have run with or without a verdict, nor could any request behind it in vLLM's scan (an
        # allocation failure ends it): vLLM 0.34 under PP with drafts idles small pools so, its running requests
        # waiting for their batches while the waiting prompts do not fit, and a newer request fair admission holds
        # back behind such a deferred load would have waited behind it in vLLM's own first-come, first-served scan.
        # With no request waiting, the running requests were not scheduled for another reason (one short of blocks
        # is preempted into a waiting queue).
        # One exception, counted apart: the only verdict was a load deferred while no other request reserved
        # anything, so because its own exact need through its prompt did not fit the free pool. That is vLLM's own
        # full-sequence gate, counted exactly: vLLM let the request through on its arithmetic, which undercounts
        # Mamba state under PP (a state block per batch in flight); started, it would have had to be preempted.
        held = c.deferrals + c.held_for_older + c.held_behind_load + c.not_started > held_before
        runnable = startable_waiting_ids(sched)
        if runnable and held:
            own_need = (c.held_for_older + c.held_behind_load + c.not_started == waited_before
                        and drv.side.snapshot().reserved_blocks == 0)
            if own_need:
                outcome.idle_exact_holds += 1
            else:
                outcome.idle_zero_steps += 1
        else:
            outcome.vllm_idle_steps += 1

    returning: list[Any] = []
    try:
        while drv.busy() and drv.step_no < max_steps:
            step()
            if idle_run[0] >= 20:  # a stall, whoever holds back
                outcome.stalls += 1
                break
        if case.reset_prefix_cache:
            sched.reset_prefix_cache()
        for s, (first, mt, keep, new) in enumerate(case.sessions):
            warm = sched.requests.get(f"w{s}")
            history = base[s] + [7] * mt  # the simulated model samples token 7
            prompt = returning_prompt(case, s, history)
            returning.append(make_request(f"r{s}", prompt, mt, hash_bs, hash_lookahead_tokens=lookahead))
            del warm
        pending = list(zip(case.return_gaps, returning))
        while pending or drv.busy():
            if drv.step_no >= max_steps:
                break
            if pending and pending[0][0] <= 0:
                drv.add([pending.pop(0)[1]])
                continue
            if pending:
                pending[0] = (pending[0][0] - 1, pending[0][1])
            step()
            if idle_run[0] >= 20:
                outcome.stalls += 1
                break
    except LoadContentError as err:
        outcome.mismatches.append(f"content: {err}")
    side = drv.side
    prompt_tokens = {r.request_id: r.num_prompt_tokens for r in returning}
    for adm in side.admissions:
        outcome.admissions += 1
        outcome.whole_prompt_loads += adm.plan.hit_tokens == prompt_tokens.get(adm.request_id)
        if adm.free_after is None:
            continue  # vLLM itself refused the allocation after our verdict; nothing was taken
        if adm.free_before - adm.free_after != sum(adm.plan.now):
            outcome.mismatches.append(f"{adm.request_id}: took {adm.free_before - adm.free_after} blocks, "
                                      f"predicted {sum(adm.plan.now)} {adm.plan.now}")
        if adm.entries_after != adm.plan.entries or adm.live_after != adm.plan.live:
            outcome.mismatches.append(f"{adm.request_id}: per-group entries/live {adm.entries_after}/"
                                      f"{adm.live_after}, predicted {adm.plan.entries}/{adm.plan.live}")
    peaks.close()
    outcome.peak_violations = peaks.violations
    outcome.loads_peak_checked = peaks.loads_checked
    outcome.loaded_tokens = side.counters.loaded_tokens
    outcome.deferrals = side.counters.deferrals
    outcome.too_big = side.counters.too_big
    waits.judge(side, outcome)
    outcome.drafts_scheduled = drv.drafts_scheduled
    outcome.drafts_accepted = drv.drafts_accepted
    if not drv.idle_invariant():
        outcome.undrained += 1
    return outcome
