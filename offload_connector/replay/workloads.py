"""Built-in workloads (seeded, deterministic) and resolution of `--trace`.

The two generated workloads follow models-and-traces.md §5, scaled down so that four connectors replay in minutes
on a small CPU machine (shorter outputs, fewer sessions; what is scaled is listed in each generator). They are
Mooncake-format records with the optional `session`/`turn` fields (see trace.py): later turns resume at the end of
the previous answer, as a chat does. Each ends in a phase made to exercise admission of simultaneous loads.
"""

from __future__ import annotations

import gzip
import math
import random
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Callable

from offload_connector.replay.trace import MOONCAKE_BLOCK_TOKENS, TraceRecord, load_trace, parse_lines

B = MOONCAKE_BLOCK_TOKENS


@dataclass(frozen=True)
class Workload:
    name: str
    records: tuple[TraceRecord, ...]
    description: str
    default_model: str | None = None


class _Gen:
    """Hash-id allocation and record building; ids are fresh unless a prefix is shared on purpose."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.next_id = 1_000_000  # clear of the Mooncake file's ids, so mixing never aliases by accident
        self.records: list[TraceRecord] = []
        self.last: dict[str, TraceRecord] = {}

    def fresh(self, n: int) -> list[int]:
        ids = list(range(self.next_id, self.next_id + n))
        self.next_id += n
        return ids

    def add(self, t_ms: float, n_in: int, n_out: int, ids: list[int], phase: str,
            session: str | None = None, turn: int | None = None) -> TraceRecord:
        rec = TraceRecord(round(t_ms, 3), n_in, n_out, tuple(ids), 0, session, turn, (("phase", phase),))
        self.records.append(rec)
        if session is not None:
            self.last[session] = rec
        return rec

    def one_shot(self, t_ms: float, n_in: int, n_out: int, phase: str, prefix: list[int] = ()) -> TraceRecord:
        ids = list(prefix) + self.fresh(math.ceil(n_in / B) - len(prefix))
        return self.add(t_ms, n_in, n_out, ids, phase)

    def turn(self, session: str, t_ms: float, new_tokens: int, n_out: int, phase: str,
             first_input: int = 0, prefix: list[int] = ()) -> TraceRecord:
        prev = self.last.get(session)
        if prev is None:
            n_in = first_input
            ids = list(prefix) + self.fresh(math.ceil(n_in / B) - len(prefix))
            return self.add(t_ms, n_in, n_out, ids, phase, session, 0)
        ctx = prev.input_length + prev.output_length
        n_in = ctx + new_tokens
        keep = list(prev.hash_ids[: ctx // B])  # blocks wholly inside the previous context keep their ids
        ids = keep + self.fresh(math.ceil(n_in / B) - len(keep))
        return self.add(t_ms, n_in, n_out, ids, phase, session, (prev.turn or 0) + 1)

    def lognormal(self, median: float, sigma: float, lo: int, hi: int) -> int:
        return int(min(hi, max(lo, self.rng.lognormvariate(math.log(median), sigma))))

    def done(self) -> tuple[TraceRecord, ...]:
        return tuple(sorted(self.records, key=lambda r: r.timestamp_ms))


def gemma4_31b_returning(seed: int = 0) -> Workload:
    """§5.1 scaled: 12 sessions x 3 turns (not 48 x 5), outputs median 64 (not mean 343), one burst cell per k.

    1. steady: turn-1 prompts lognormal (median 6k, 1.5k-14k) behind a shared 1,024-token system prefix; each next
       turn adds the previous answer and 300-1,500 new tokens after 8-20 s; sessions start 1.5 s apart on average.
    2. burst: for (k, H) in (2, 20k), (3, 10.5k), (4, 5k) (inside the stall region §5.1 predicts for vLLM's
       reservation on this pool): k sessions compute H-token contexts, 80k tokens of one-shot filler evict them
       from the GPU prefix cache, then all k return in the same step with 1-2k new tokens each.
    3. edge: one session returns with a ~30k context while 8 short requests decode.
    """
    g = _Gen(seed)
    system = g.fresh(2)
    t = 0.0
    for s in range(12):
        t += g.rng.expovariate(1 / 1500)
        name = f"steady-{s}"
        first = g.lognormal(6000, 0.6, 1500, 14000)
        tt = t
        g.turn(name, tt, 0, g.lognormal(64, 0.5, 16, 200), "steady", first_input=first, prefix=system)
        for _ in range(2):
            tt += g.rng.uniform(8000, 20000)
            g.turn(name, tt, g.rng.randint(300, 1500), g.lognormal(64, 0.5, 16, 200), "steady")
    t = max(r.timestamp_ms for r in g.records) + 15000
    for k, hit in ((2, 40 * B), (3, 21 * B), (4, 10 * B)):
        names = [f"burst-k{k}-{i}" for i in range(k)]
        for i, name in enumerate(names):
            g.turn(name, t + 300 * i, 0, 8, "burst-warm", first_input=hit + 200)
        for i in range(10):
            g.one_shot(t + 3000 + 400 * i, 8000, 8, "burst-filler")
        ret = t + 12000
        for name in names:
            g.turn(name, ret, g.rng.randint(1000, 2000), 32, f"burst-k{k}")
        t = ret + 13000
    g.turn("edge", t, 0, 8, "edge-warm", first_input=30000)
    for i in range(10):
        g.one_shot(t + 2000 + 400 * i, 8000, 8, "edge-filler")
    ret = t + 12000
    for i in range(8):
        g.one_shot(ret - 1000 + 50 * i, 256, 128, "edge-background")
    g.turn("edge", ret, 1000, 32, "edge")
    return Workload("gemma4-31b-returning", g.done(), gemma4_31b_returning.__doc__ or "", "gemma-4-31b")


def deepseek_v4_flash_1m(seed: int = 0) -> Workload:
    """§5.2 cell A scaled: one agent session (not two) grows 128k -> 256k -> 512k -> 737k, a burst sweep of 2, 3 and 4
    sessions returning in the same step, then one ~1M context returning over 16 mixed requests (not 64).

    1. grow: session A at 128k, 256k, 512k, then 737k context (2-8k new tokens on the first turns, 200-token
       answers), interleaved with 6 one-shot 8-32k requests.
    2. burst: for (k, H) in (2, 737k), (3, 490k), (4, 366k), each inside the stall region of vLLM's reservation on
       the 6,144-block pool (k loaded footprints of H/256 + 22 blocks leave under the ~420 blocks one 1,024-token
       chunk needs, while the last returner still passes vLLM's gate of about H/256 blocks): fresh sessions compute
       H-token contexts one after another (A is one of the k = 2 pair), 128k tokens of one-shot filler evict
       their windows from the GPU, then all k return in the same step with 1-2k new tokens each.
    3. edge: A grows to a ~1M context (of max_model_len 1,048,576; one such request fits the pool, two do not)
       right after its k = 2 return, is evicted by the later cells, and returns last while 16 one-shot requests
       (lognormal median 7k, 1k-64k) arrive and decode around it.
    """
    g = _Gen(seed)
    k = 1024
    step_ms = 0.03  # > simulated cost of one prompt token at 1,024-token steps, for spacing long prefills

    def grow(session: str, t_ms: float, ctx: int, n_out: int, phase: str) -> TraceRecord:
        """A turn whose prompt plus answer reach `ctx` tokens."""
        prev = g.last[session]
        return g.turn(session, t_ms, ctx - n_out - prev.input_length - prev.output_length, n_out, phase)

    g.turn("agent-A", 0, 0, 200, "grow", first_input=128 * k)
    t = 0.0
    for target in (256 * k, 512 * k):
        t += 25000 if target == 256 * k else 30000
        prev = g.last["agent-A"]
        g.turn("agent-A", t, target - prev.input_length - prev.output_length, 200, "grow")
    for i in range(6):
        g.one_shot(2000 + 9000 * i, g.rng.randint(8 * k, 32 * k), 32, "grow-filler")
    t += 30000
    grow("agent-A", t, 737 * k, 200, "grow")
    t += 737 * k * step_ms * 1.3
    for kk, ctx in ((2, 737 * k), (3, 490 * k + 116), (4, 366 * k)):
        names = [f"burst-k{kk}-{i}" for i in range(kk)]
        if kk == 2:
            names[0] = "agent-A"
        for name in names:
            if name in g.last:
                continue
            g.turn(name, t, 0, 16, "burst-warm", first_input=ctx - 16)
            t += ctx * step_ms * 1.3
        for i in range(4):
            g.one_shot(t + 500 * i, 32 * k, 8, "burst-filler")
        t += 8000
        for name in names:
            g.turn(name, t, g.rng.randint(1000, 2000), 64, f"burst-k{kk}")
        # Room for recompute (connector off: k contexts again, with preemptions) before the next phase.
        t += kk * ctx * step_ms * 1.5 + 20000
        if kk == 2:
            grow("agent-A", t, 1_000_000, 16, "edge-warm")
            t += 1_000_000 * step_ms * 1.3
    for i in range(4):
        g.one_shot(t + 500 * i, 32 * k, 8, "edge-filler")
    ret = t + 8000
    tb = ret - 3000
    for i in range(16):
        g.one_shot(tb, g.lognormal(7000, 1.0, 1000, 64 * k), g.lognormal(200, 0.5, 16, 512), "edge-background")
        tb += g.rng.expovariate(1 / 500)
    g.turn("agent-A", ret, 1000, 32, "edge")
    return Workload("deepseek-v4-flash-1m", g.done(), deepseek_v4_flash_1m.__doc__ or "", "deepseek-v4-flash")


MOONCAKE_FILE = "mooncake-synthetic.jsonl.gz"


def mooncake_synthetic(seed: int = 0) -> Workload:
    """Mooncake's synthetic trace (ShareGPT + L-Eval + LooGLE, Poisson arrivals; 3,993 requests; Apache-2.0),
    carried gzipped in the package. The seed only changes the token ids each hash block expands to."""
    ref = resources.files("offload_connector.replay") / "data" / MOONCAKE_FILE
    with resources.as_file(ref) as path, gzip.open(path, "rt", encoding="utf-8") as fh:
        records = parse_lines(fh, f"{MOONCAKE_FILE}")
    return Workload("mooncake-synthetic", tuple(records), mooncake_synthetic.__doc__ or "")


BUILTIN: dict[str, Callable[[int], Workload]] = {
    "gemma4-31b-returning": gemma4_31b_returning,
    "deepseek-v4-flash-1m": deepseek_v4_flash_1m,
    "mooncake-synthetic": mooncake_synthetic,
}


def resolve_trace(name_or_path: str, seed: int) -> Workload:
    """A built-in workload name, or a Mooncake-format JSONL file (optionally .gz)."""
    if name_or_path in BUILTIN:
        return BUILTIN[name_or_path](seed)
    p = Path(name_or_path)
    if not p.exists():
        raise FileNotFoundError(f"--trace {name_or_path!r} is neither a built-in workload "
                                f"({', '.join(BUILTIN)}) nor an existing file")
    return Workload(p.name, tuple(load_trace(p)), f"Mooncake-format trace {p}")
