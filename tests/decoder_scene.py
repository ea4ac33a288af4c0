"""The scene of the fair-admission issue, shared by the tests that replay it: a gpt-oss-like layout (sliding window
128 + full attention, blocks of 16, 512-token steps), a 600-block pool mostly held by four long decoders, a request
("ret") returning with a 4,000-token prefix in the CPU tier, and a stream of small requests arriving behind it, on
vLLM's real scheduler with tag-checked copies."""

from __future__ import annotations

from typing import Any

from offload_bench.sim.custom import build_custom
from offload_bench.sim.driver import SchedulerDriver
from offload_bench.sim.requests import make_request, tokens
from offload_bench.sim.tagcopy import TagCopier

GROUPS = (("full", 16, 0), ("sliding", 16, 128))
PREFIX = 4000


def build(kv_transfer_config: Any) -> tuple[Any, int]:
    return build_custom(GROUPS, num_blocks=600, max_num_batched_tokens=512, max_model_len=8192,
                        kv_transfer_config=kv_transfer_config)


def run(kv_transfer_config: Any) -> tuple[SchedulerDriver, int | None]:
    """Runs the scene to the end; returns the driver and the step of "ret"'s first token."""
    sched, hbs = build(kv_transfer_config)
    drv = SchedulerDriver(sched, TagCopier(1))
    prefix = tokens(1, PREFIX)
    drv.add([make_request("warm", prefix, 1, hbs)])
    assert not drv.run().stalled
    sched.reset_prefix_cache()
    # Four decoders hold most of the pool for a few hundred steps.
    drv.add([make_request(f"dec{i}", tokens(10 + i, 1500), 600 + 40 * i, hbs) for i in range(4)])
    for _ in range(20):
        drv.step()
    drv.add([make_request("ret", prefix + tokens(2, 60), 4, hbs)])
    first_token = None
    n = 0
    while drv.busy() and drv.step_no < 6000:
        if drv.step_no % 3 == 0 and n < 600:  # small requests keep arriving behind the returning one
            drv.add([make_request(f"small{n}", tokens(100 + n, 100), 8, hbs)])
            n += 1
        rec = drv.step()
        assert not (rec.idle_while_waiting and not drv.busy())
        req = drv.sched.requests.get("ret")
        if first_token is None and (req is None or req.num_output_tokens > 0):
            first_token = drv.step_no
    return drv, first_token
