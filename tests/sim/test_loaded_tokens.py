"""What vLLM's `vllm:external_prefix_cache_hits` counts, against our `vllm:offload_connector_loaded_tokens`, through
vLLM's real scheduler (both vLLM versions) and our real worker over the tag-copying backend of sim/tagcopy.py.

vLLM records a connector hit in `Scheduler.schedule()` the step it admits the request (right after
`update_state_after_alloc`): `num_external_computed_tokens`, the tokens the connector granted, before any byte moves
and never corrected afterwards. A load that then fails (`failed_recving`) is still counted, and with
`kv_load_failure_policy: "recompute"` the retry is looked up and counted again (its queries a second time, its hits
as whatever the tier offers then). Our counter adds a load's granted tokens only when it lands and verifies.
"""

from __future__ import annotations

from vllm.config import KVTransferConfig
from vllm.v1.metrics.stats import PrefixCacheStats

from offload_bench.sim.custom import build_custom
from offload_bench.sim.driver import SchedulerDriver
from offload_bench.sim.faults import drain
from offload_bench.sim.requests import make_request, tokens
from offload_bench.sim.tagcopy import TagCopier

GROUPS = (("full", 16, 0), ("sliding", 16, 64))
SLOT_BYTES = 4096
PREFIX = 320


def rig(**engine):
    kvt = KVTransferConfig(kv_connector="OffloadConnector", kv_connector_module_path="offload_connector",
                           kv_role="kv_both", kv_load_failure_policy="recompute",
                           kv_connector_extra_config={"cpu_bytes": 4096 * SLOT_BYTES})
    sched, hbs = build_custom(GROUPS, num_blocks=160, max_num_batched_tokens=64, max_model_len=2048,
                              kv_transfer_config=kvt)
    # What `log_stats` turns on in vLLM (the frontend's external_prefix_cache_* counters come from this object).
    sched.connector_prefix_cache_stats = PrefixCacheStats()
    drv = SchedulerDriver(sched, TagCopier(**engine))
    # vLLM drains the scheduler side's stats every step (update_from_output); keep what we record on the way.
    drv.loaded_tokens = 0
    record = drv.side.stats.record_loaded_tokens

    def record_loaded_tokens(n: int) -> None:
        drv.loaded_tokens += n
        record(n)
    drv.side.stats.record_loaded_tokens = record_loaded_tokens
    return drv, hbs


def counts(drv) -> tuple[int, int, int]:
    """(vLLM's external hits, vLLM's external queries, our loaded tokens) since the last call."""
    vllm_stats = drv.sched.connector_prefix_cache_stats
    drv.sched.connector_prefix_cache_stats = PrefixCacheStats()
    loaded, drv.loaded_tokens = drv.loaded_tokens, 0
    return vllm_stats.hits, vllm_stats.queries, loaded


def reload(drv, hbs, prefix, rid):
    assert drv.sched.reset_prefix_cache()
    counts(drv)
    prompt = list(prefix) + tokens(77, 24)
    drv.add([make_request(rid, prompt, 2, hbs)])
    drain(drv)
    assert rid in drv.finished
    return counts(drv), len(prompt)


def warm(drv, hbs, prefix):
    drv.add([make_request("warm", list(prefix), 1, hbs)])
    drain(drv)


def test_a_landed_load_is_counted_by_both():
    drv, hbs = rig()
    prefix = tokens(1, PREFIX)
    warm(drv, hbs, prefix)
    (hits, queries, loaded), n = reload(drv, hbs, prefix, "again")
    assert hits == loaded == PREFIX
    assert queries == n


def test_a_failed_load_is_a_vllm_hit_but_not_a_loaded_token():
    drv, hbs = rig(fail_load=lambda job: job.request_id == "again")
    prefix = tokens(1, PREFIX)
    warm(drv, hbs, prefix)
    (hits, queries, loaded), n = reload(drv, hbs, prefix, "again")
    assert drv.engine.loads_failed == 1 and drv.side.counters.load_failures == 1
    # vLLM counted the granted tokens at admission and the retry's lookup once more (the failed entries were
    # dropped from the tier, so the retry hits nothing): queries twice, hits once. We count nothing.
    assert (hits, queries, loaded) == (PREFIX, 2 * n, 0)
