"""The starved-load scene: a load that fits waits behind long decoders while newer requests keep arriving.

A gpt-oss-like layout (sliding window 128 + full attention, blocks of 16, 512-token steps, async scheduling), a
600-block pool mostly held by four long decoders, a request ("ret") returning with a 4,000-token prefix in the CPU
tier, and optionally a stream of small requests arriving behind it. On vLLM's real scheduler, tag-checked copies.

What it measures is the step of "ret"'s first token: with the stream, a connector that lets every newer request take
the blocks that free up starves the load until the decoders finish; one that holds every newer request back as soon
as the load waits slows the whole queue down whenever the load is waiting for something else (the decoders).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from offload_bench.sim.custom import build_custom
from offload_bench.sim.driver import SchedulerDriver
from offload_bench.sim.requests import make_request, tokens
from offload_bench.sim.tagcopy import TagCopier

GROUPS = (("full", 16, 0), ("sliding", 16, 128))
PREFIX = 4000


@dataclass(frozen=True)
class Scene:
    decoder_prompt: int = 1500
    decode_tokens: int = 600  # the first decoder's output; each next one 40 more
    stream_tokens: int = 100  # prompt of each small request behind "ret" (0: no stream)
    stream_every: int = 3  # steps between two small requests
    stream_count: int = 600
    stream_first: bool = False  # the stream starts with the decoders, before "ret" arrives
    stream_output: int = 8
    max_steps: int = 6000
    # Tokens of a prefix every small request shares (kept in vLLM's GPU prefix cache by the stream itself), and
    # vLLM 0.34's `--cache-aware-admission-window`: with both, vLLM moves the small requests ahead of "ret" in its
    # waiting queue (they have GPU-cached tokens, "ret" has none), which is not their arrival order.
    stream_shared: int = 0
    cache_aware_window: int = 0


@dataclass
class SceneOutcome:
    first_token_step: int | None  # steps after "ret" arrived
    ret_loaded: bool
    small_ttft_p50: float | None  # steps from arrival to first token, over the stream
    small_ttft_p95: float | None
    steps: int  # until everything finished
    drained: bool


def build(kv_transfer_config: Any, cache_aware_window: int = 0) -> tuple[Any, int]:
    return build_custom(GROUPS, num_blocks=600, max_num_batched_tokens=512, max_model_len=8192,
                        kv_transfer_config=kv_transfer_config, cache_aware_admission_window=cache_aware_window)


def run(kv_transfer_config: Any, scene: Scene = Scene()) -> tuple[SchedulerDriver, SceneOutcome]:
    """Runs the scene to the end (`kv_transfer_config` None: no connector, the prefix is recomputed)."""
    sched, hbs = build(kv_transfer_config, scene.cache_aware_window)
    drv = SchedulerDriver(sched, TagCopier(1) if kv_transfer_config is not None else None)
    prefix = tokens(1, PREFIX)
    drv.add([make_request("warm", prefix, 1, hbs)])
    assert not drv.run().stalled
    sched.reset_prefix_cache()
    drv.add([make_request(f"dec{i}", tokens(10 + i, scene.decoder_prompt), scene.decode_tokens + 40 * i, hbs) for i in range(4)])
    small_arrival: dict[str, int] = {}
    small_first: dict[str, int] = {}

    def stream() -> None:
        n = len(small_arrival)
        if scene.stream_tokens and drv.step_no % scene.stream_every == 0 and n < scene.stream_count:
            rid = f"small{n}"
            prompt = tokens(7, scene.stream_shared) + tokens(100 + n, scene.stream_tokens - scene.stream_shared)
            drv.add([make_request(rid, prompt, scene.stream_output, hbs)])
            small_arrival[rid] = drv.step_no

    for _ in range(20):
        if scene.stream_first:
            stream()
        drv.step()
    drv.add([make_request("ret", prefix + tokens(2, 60), 4, hbs)])
    arrived = drv.step_no
    first_token = None
    while drv.busy() and drv.step_no < scene.max_steps:
        stream()
        rec = drv.step()
        assert not (rec.idle_while_waiting and not drv.busy())
        if first_token is None and _has_output(drv, "ret"):
            first_token = drv.step_no - arrived
        for rid in small_arrival:
            if rid not in small_first and _has_output(drv, rid):
                small_first[rid] = drv.step_no - small_arrival[rid]
    ttfts = sorted(small_first.values())
    side = drv.side
    loaded = side is not None and any(a.request_id == "ret" and a.free_after is not None for a in side.admissions)
    return drv, SceneOutcome(first_token, loaded, _pct(ttfts, 0.5), _pct(ttfts, 0.95), drv.step_no,
                             drv.idle_invariant())


def _has_output(drv: SchedulerDriver, rid: str) -> bool:
    req = drv.sched.requests.get(rid)
    return req is None or req.num_output_tokens > 0


def _pct(xs: list[int], q: float) -> float | None:
    if not xs:
        return None
    return float(xs[min(len(xs) - 1, int(q * len(xs)))])
