"""A long randomized multi-turn workload, generated until a simulated time is reached.

Chat sessions arrive as a Poisson process; each has a few turns (the next turn resumes after the previous answer,
as replay's built-in workloads do), a share of them behind a common system prefix; one-shot requests in between
push the sessions' blocks out of the GPU prefix cache, so returning turns hit the CPU tier (or, with a tiny tier,
miss it because it evicted them). Sizes per model are scaled so that one simulated hour replays in minutes here.
"""

from __future__ import annotations

from dataclasses import dataclass

from offload_bench.replay.trace import MOONCAKE_BLOCK_TOKENS as B
from offload_bench.replay.trace import TraceRecord
from offload_bench.replay.workloads import _Gen


@dataclass(frozen=True)
class SoakShape:
    session_gap_s: float  # mean gap between new sessions
    first_median: int  # first-turn prompt, lognormal median (tokens)
    first_range: tuple[int, int]
    turns: tuple[int, int]  # turns per session (inclusive)
    think_s: tuple[float, float]  # gap between turns
    new_tokens: tuple[int, int]  # tokens a later turn adds
    output_median: int
    output_range: tuple[int, int]
    max_context: int  # a session ends once its context would pass this
    one_shot_gap_s: float  # mean gap between one-shot requests
    one_shot_range: tuple[int, int]
    system_share: float = 0.5  # sessions behind the shared system prefix


SHAPES = {
    "gemma-4-31b": SoakShape(session_gap_s=5.0, first_median=3000, first_range=(600, 10000), turns=(2, 6),
                             think_s=(4.0, 40.0), new_tokens=(100, 1500), output_median=96, output_range=(16, 400),
                             max_context=12500, one_shot_gap_s=8.0, one_shot_range=(500, 8000)),
    "deepseek-v4-flash": SoakShape(session_gap_s=6.0, first_median=20000, first_range=(4000, 64000), turns=(2, 5),
                                   think_s=(5.0, 60.0), new_tokens=(500, 4000), output_median=48,
                                   output_range=(8, 160), max_context=120000, one_shot_gap_s=6.0,
                                   one_shot_range=(2000, 32000)),
}


def soak_records(model: str, sim_seconds: float, seed: int = 0) -> list[TraceRecord]:
    """Records (Mooncake format with session/turn) whose arrivals fill [0, sim_seconds), in arrival order."""
    shape = SHAPES[model]
    g = _Gen(seed)
    rng = g.rng
    system = g.fresh(2)
    horizon = sim_seconds * 1000.0
    t = 0.0
    n = 0
    while True:
        t += rng.expovariate(1.0 / (shape.session_gap_s * 1000.0))
        if t >= horizon:
            break
        name = f"s{n}"
        n += 1
        lo, hi = shape.first_range
        first = g.lognormal(shape.first_median, 0.7, lo, hi)
        prefix = system if rng.random() < shape.system_share and first > 2 * B else []
        out = g.lognormal(shape.output_median, 0.6, *shape.output_range)
        rec = g.turn(name, t, 0, out, "session", first_input=first, prefix=prefix)
        tt = t
        for _ in range(rng.randint(*shape.turns) - 1):
            tt += rng.uniform(*shape.think_s) * 1000.0
            new = rng.randint(*shape.new_tokens)
            if tt >= horizon or rec.input_length + rec.output_length + new > shape.max_context:
                break
            rec = g.turn(name, tt, new, g.lognormal(shape.output_median, 0.6, *shape.output_range), "session")
    t = 0.0
    while True:
        t += rng.expovariate(1.0 / (shape.one_shot_gap_s * 1000.0))
        if t >= horizon:
            break
        g.one_shot(t, rng.randint(*shape.one_shot_range), g.lognormal(16, 0.5, 4, 64), "one-shot")
    return list(g.done())
