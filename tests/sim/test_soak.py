"""Short soak runs (the CI version of `offload-connector soak`): our connector on vLLM's real scheduler with random
aborts (queued, mid-load, running), forced preemptions, injected load and store failures and a tiny CPU tier; the
lifecycle invariants and the ledger-vs-allocation check after every step, no leak once drained, no stall."""

import json

import pytest

from offload_bench.replay.timemodel import time_model_for
from offload_bench.soak.command import SOAK_DEFAULTS
from offload_bench.soak.runner import SoakConfig, render_summary, run_soak
from offload_bench.soak.workload import soak_records


def _config(model: str, sim_seconds: float, **kw) -> SoakConfig:
    d = SOAK_DEFAULTS[model]
    # Fault rates well above the full soak's, so that a minute of simulated time injects each kind.
    rates = dict(abort_rate=0.15, abort_window_s=30.0, abort_loading_rate=0.25, load_failure_rate=0.3,
                 store_failure_rate=0.05, preempt_rate=0.01)
    rates.update(kw)
    return SoakConfig(model=model, sim_seconds=sim_seconds, num_gpu_blocks=d.num_gpu_blocks, cpu_bytes=d.cpu_bytes,
                      max_num_batched_tokens=1024, max_model_len=d.max_model_len, max_num_seqs=64,
                      time_model=time_model_for(model), **rates)


def _check(res):
    summary = render_summary([res])
    assert res.stopped_reason == "drained", summary + "\n" + "\n".join(res.problems)
    assert res.invariant_violations == 0 and res.leaks == 0 and res.stalls == 0, "\n".join(res.problems)
    assert res.ok
    assert res.invariant_checks == res.steps  # every step was checked
    # Faults were actually injected, and loads were admitted and checked against vLLM's allocation.
    assert res.aborted > 0 and res.preemptions_forced > 0, summary
    assert res.load_failures_injected > 0 and res.store_failures_injected > 0, summary
    assert res.loads > 0 and res.admissions_checked > 0 and res.loads_content_checked > 0, summary
    assert res.evictions > 0, summary  # the tier is small enough to evict
    assert res.completed + res.aborted == res.requests, summary
    json.dumps(res.to_json(), default=str)


@pytest.mark.parametrize("model,sim_seconds,seed", [("gemma-4-31b", 90.0, 1), ("deepseek-v4-flash", 90.0, 0)])
def test_short_soak(model, sim_seconds, seed):
    cfg = _config(model, sim_seconds)
    cfg = SoakConfig(**{**cfg.__dict__, "seed": seed})
    _check(run_soak(cfg))


def test_workload_fills_the_simulated_time_and_is_deterministic():
    a = soak_records("gemma-4-31b", 600, seed=3)
    assert a == soak_records("gemma-4-31b", 600, seed=3)
    assert a != soak_records("gemma-4-31b", 600, seed=4)
    t = [r.timestamp_ms for r in a]
    assert t == sorted(t) and t[-1] < 600_000 and t[-1] > 500_000
    assert any(r.turn for r in a)  # multi-turn sessions


def test_config_rejects_bad_rates():
    with pytest.raises(ValueError):
        _config("gemma-4-31b", 10, load_failure_rate=1.5)


def test_cli_parses_soak(capsys):
    import argparse

    from offload_bench.soak.command import add_parser

    ap = argparse.ArgumentParser()
    add_parser(ap.add_subparsers(dest="cmd"))
    args = ap.parse_args(["soak", "--model", "deepseek-v4-flash", "--sim-seconds", "5", "--cpu-bytes", "1GiB"])
    assert args.cpu_bytes == 2**30 and args.sim_seconds == 5.0 and args.load_failure_rate == 0.1
