"""What a replay measures, per connector, and the result record it ends in.

Everything is observed at vLLM's own interfaces, the same way for every connector: the scheduler's outputs
(scheduled tokens per request), the outputs applied back (first tokens, finishes), the connector calls the
scheduler makes (`get_num_new_matched_tokens`, `update_state_after_alloc`) and the block pool.

Recompute accounting, per request (prompt length P):
- `reusable` = the longest prefix of the prompt that some earlier request had already computed (prompt or answer)
  when this one arrived, at vLLM's hash-block granularity, capped at P - 1 (the last prompt token is always
  computed);
- `recomputed` = prompt tokens the model computed for it beyond the P - reusable it had to compute (preemptions
  included);
- `recomputed_in_cpu` = of the reusable prefix, the part whose full-attention KV the CPU tier held at the last
  lookup before the request was first scheduled, minus what was loaded or hit locally: reuse that was offloaded
  but not delivered. It counts a prefix even when the tier lacks the sliding windows needed to resume there;
- `recomputed_restorable` = the same with the connector's own restorable hit (windows included) instead: what it
  could have loaded but recomputed (deferral fallbacks, loads vLLM refused).

The same figures per phase of the workload (`per_phase`: the built-in workloads tag every request with one, e.g.
`rag` and `rag-followup`; a trace file's string field `phase`, else its `session`/`turn` fields): a connector that
wins overall can lose on one kind of request (a follow-up whose previous turn it evicted), and the totals hide that.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

_PCTL = (50, 95)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


@dataclass
class _Req:
    arrival: float
    prompt: int
    reusable: int
    cpu_prefix: int = 0  # restorable by the connector
    resident: int = 0  # full-attention KV in the tier
    first_hit: int | None = None  # tokens already computed (local hit + loaded) when first scheduled
    prefill_computed: int = 0
    first_token: float | None = None
    finished: float | None = None
    outputs: int = 0
    hashed: int = 0  # leading block hashes of this request already in Recorder.ever
    phase: str = ""
    loaded: int = 0  # tokens the connector loaded for it


@dataclass(frozen=True)
class ConnectorResult:
    connector: str
    stalled: bool
    first_stall_step: int | None
    requests_total: int
    requests_completed: int
    simulated_seconds: float
    steps: int
    output_tokens: int
    output_tokens_per_s: float
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    tokens_loaded_from_cpu: int
    tokens_recomputed: int
    recomputed_tokens_in_cpu: int
    recomputed_restorable: int
    prompt_tokens_computed: int
    gpu_pool_util_mean: float
    gpu_pool_util_p95: float
    gpu_pool_util_per_group: dict[str, dict[str, float]]
    admission_deferrals: int
    cpu_tier_bytes: int | None
    cpu_tier_cached_tokens: int | None
    cpu_tier_bytes_per_cached_token: float | None
    transfer_bytes_loaded: int
    transfer_bytes_stored: int
    stopped_reason: str
    wall_seconds: float  # the replay loop on this machine (scheduler build excluded)
    stall_dump: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # phase -> requests, prompt_tokens, reusable_tokens, loaded_tokens, recomputed_tokens, ttft_p50_s, ttft_p95_s
    per_phase: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


MAX_PHASES = 32  # distinct phase labels kept; later ones are counted under OTHER_PHASE (a trace can hold a million)
OTHER_PHASE = "(other)"
MAX_PHASE_CHARS = 40


class Recorder:
    """Collects one connector's run. Cheap per step: counters and a few numbers per step for the plots."""

    def __init__(self, hash_block_size: int, group_names: list[str], usable_blocks: int) -> None:
        self.hbs = hash_block_size
        self.group_names = group_names
        self.usable = max(1, usable_blocks)
        self.reqs: dict[str, _Req] = {}
        self.phases: set[str] = set()
        self.ever: set[Any] = set()  # hash-block hashes some request has computed
        self.deferrals = 0
        self.loaded_tokens = 0
        self.output_tokens = 0
        self.completed = 0
        # Per step: pool use (the utilisation figures).
        self.used: list[float] = []
        self.group_used: list[list[float]] = [[] for _ in group_names]
        # The plots also show idle stretches (the engine jumps to the next arrival without stepping).
        self.plot: dict[str, list[float]] = {"t": [], "used": [], "running": [], "waiting": []}

    # ---------------------------------------------------------------- requests
    def on_arrival(self, request: Any, t: float, phase: str = "") -> None:
        n = 0
        for h in request.block_hashes:
            if h not in self.ever:
                break
            n += 1
        reusable = min(n * self.hbs, request.num_prompt_tokens - 1)
        self.reqs[request.request_id] = _Req(t, request.num_prompt_tokens, reusable, phase=self._phase_label(phase))

    def _phase_label(self, phase: str) -> str:
        # A trace file's label goes to the terminal: no control characters, no line breaks.
        phase = "".join(c if c.isprintable() else "?" for c in phase[:MAX_PHASE_CHARS])
        if not phase or phase in self.phases:
            return phase
        if len(self.phases) >= MAX_PHASES:
            return OTHER_PHASE
        self.phases.add(phase)
        return phase

    def on_loaded(self, request_id: str, tokens: int) -> None:
        self.loaded_tokens += tokens
        r = self.reqs.get(request_id)
        if r is not None:
            r.loaded += tokens

    def wants_lookup(self, request_id: str) -> bool:
        r = self.reqs.get(request_id)
        return r is not None and r.first_hit is None

    def on_lookup(self, request: Any, cpu_prefix: int | None, resident: int | None) -> None:
        r = self.reqs.get(request.request_id)
        if r is None or r.first_hit is not None:
            return
        if cpu_prefix is not None:
            r.cpu_prefix = cpu_prefix
        if resident is not None:
            r.resident = resident

    def on_schedule(self, out: Any, requests: dict[str, Any]) -> tuple[int, int]:
        """Account one scheduled batch; returns (prompt tokens, decoding requests) for the step-time model."""
        prefill = decode = 0
        for rid, n in out.num_scheduled_tokens.items():
            req = requests[rid]
            after = req.num_computed_tokens  # schedule() has advanced it already
            before = after - n
            prompt = req.num_prompt_tokens
            part = max(0, min(after, prompt) - before)
            r = self.reqs.get(rid)
            if r is not None:
                if r.first_hit is None:
                    r.first_hit = before
                r.prefill_computed += part
                # Everything before this batch has been computed (or is in the batch ahead of it), answers
                # included: a next turn that resumes after the answer can reuse all of it.
                upto = min(before // self.hbs, len(req.block_hashes))
                if upto > r.hashed:
                    self.ever.update(req.block_hashes[r.hashed:upto])
                    r.hashed = upto
            if part:
                prefill += part
            else:
                decode += 1
        return prefill, decode

    def on_applied(self, engine_outputs: Any, t: float) -> None:
        for eco in (engine_outputs or {}).values():
            for o in eco.outputs:
                r = self.reqs.get(o.request_id)
                k = len(o.new_token_ids or ())
                self.output_tokens += k
                if r is None:
                    continue
                r.outputs += k
                if k and r.first_token is None:
                    r.first_token = t
                if o.finish_reason is not None and r.finished is None:
                    r.finished = t
                    self.completed += 1

    # ------------------------------------------------------------------- steps
    def on_step(self, t: float, free_blocks: int, running: int, waiting: int, group_live: list[int]) -> None:
        self.used.append((self.usable - free_blocks) / self.usable)
        for g, n in enumerate(group_live):
            self.group_used[g].append(n / self.usable)
        self._plot_point(t, self.used[-1], running, waiting)

    def on_idle(self, t_from: float, t_to: float, free_blocks: int) -> None:
        used = (self.usable - free_blocks) / self.usable
        self._plot_point(t_from, used, 0, 0)
        self._plot_point(t_to, used, 0, 0)

    def _plot_point(self, t: float, used: float, running: int, waiting: int) -> None:
        p = self.plot
        p["t"].append(t)
        p["used"].append(used)
        p["running"].append(running)
        p["waiting"].append(waiting)

    # ------------------------------------------------------------------ result
    def summary(self) -> dict[str, Any]:
        done = [r for r in self.reqs.values() if r.finished is not None]
        ttft = [r.first_token - r.arrival for r in self.reqs.values() if r.first_token is not None]
        recomputed = in_cpu = restorable = computed = 0
        for r in self.reqs.values():
            computed += r.prefill_computed
            if r.first_hit is None:
                continue
            recomputed += _recomputed(r)
            in_cpu += max(0, min(max(r.resident, r.cpu_prefix), r.reusable) - r.first_hit)
            restorable += max(0, min(r.cpu_prefix, r.reusable) - r.first_hit)
        per_group = {name: {"mean": _mean(v), "p95": percentile(v, 95) or 0.0}
                     for name, v in zip(self.group_names, self.group_used)}
        return dict(
            requests_completed=len(done),
            # When the last request got its last token: the run's clock can go on after it while a connector
            # finishes its stores, which delays no request.
            last_token_s=max((r.finished for r in done), default=None),
            output_tokens=self.output_tokens,
            ttft_p50_s=percentile(ttft, 50), ttft_p95_s=percentile(ttft, 95),
            tokens_loaded_from_cpu=self.loaded_tokens, tokens_recomputed=recomputed,
            recomputed_tokens_in_cpu=in_cpu, recomputed_restorable=restorable, prompt_tokens_computed=computed,
            gpu_pool_util_mean=_mean(self.used), gpu_pool_util_p95=percentile(self.used, 95) or 0.0,
            gpu_pool_util_per_group=per_group, admission_deferrals=self.deferrals, per_phase=self.per_phase())

    def per_phase(self) -> dict[str, dict[str, Any]]:
        """The request figures per phase; empty when no request has one."""
        groups: dict[str, list[_Req]] = {}
        for r in self.reqs.values():
            groups.setdefault(r.phase, []).append(r)
        if set(groups) <= {""}:
            return {}
        out = {}
        for phase in sorted(groups):
            rs = groups[phase]
            ttft = [r.first_token - r.arrival for r in rs if r.first_token is not None]
            out[phase or "(none)"] = dict(
                requests=len(rs), prompt_tokens=sum(r.prompt for r in rs),
                reusable_tokens=sum(r.reusable for r in rs), loaded_tokens=sum(r.loaded for r in rs),
                recomputed_tokens=sum(_recomputed(r) for r in rs if r.first_hit is not None),
                ttft_p50_s=percentile(ttft, 50), ttft_p95_s=percentile(ttft, 95))
        return out

    def series(self) -> dict[str, list[float]]:
        """The pool-use trace, plus every request's time to first token (seconds, arrival order) for the TTFT CDF."""
        ttft = [r.first_token - r.arrival for r in sorted(self.reqs.values(), key=lambda r: r.arrival)
                if r.first_token is not None]
        return {**self.plot, "ttft": ttft}


def _recomputed(r: _Req) -> int:
    return max(0, r.prefill_computed - (r.prompt - r.reusable))


def _mean(v: list[float]) -> float:
    return sum(v) / len(v) if v else 0.0
