"""The TCP listener against real server processes: mutual TLS plus a bearer token on every RPC.

Every method the server registers is called with each kind of wrong credentials; none may reach a
handler. Certificates and the token rotate on disk (as a Secret volume does) without a restart.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from pydantic import ValidationError

from kvfabric.cacheserver.config import ServerConfig
from kvfabric.client import CacheClient
from kvfabric.client.errors import CacheUnavailable, PermissionDenied
from kvfabric.operator.certs import make_ca, make_leaf
from kvfabric.rpc.v1 import cache_pb2 as pb
from kvfabric.testing.serverproc import MiB, ServerProcess, cache_server, digest, wait_until

pytestmark = pytest.mark.process  # real processes (test level, see kvfabric.testing.levels)

NS = digest("security-ns")
TOKEN = "pool-token-0123456789abcdef"

# Every method of the cache service, plus the health service the listener also carries.
METHODS = [
    (f"/kvfabric.rpc.v1.Cache/{m.name}", m.client_streaming, m.server_streaming)
    for m in pb.DESCRIPTOR.services_by_name["Cache"].methods
] + [("/grpc.health.v1.Health/Check", False, False), ("/grpc.health.v1.Health/Watch", False, True)]


@dataclass
class Pki:
    """A pool's CA, the server's certificate and a consumer's, plus a foreign CA's client."""

    dir: Path

    def write(self, name: str, data: bytes) -> Path:
        path = self.dir / name
        path.write_bytes(data)
        return path

    def leaf(self, ca: tuple[bytes, bytes], name: str, **kwargs: object) -> tuple[Path, Path]:
        cert, key = make_leaf(ca[0], ca[1], common_name=name, days=1, **kwargs)  # type: ignore[arg-type]
        return self.write(f"{name}.crt", cert), self.write(f"{name}.key", key)


def _secret_volume(base: Path, files: dict[str, bytes]) -> None:
    """Write ``files`` the way the kubelet updates a Secret volume: a new directory, one symlink swap."""
    generation = base / f"..gen-{os.urandom(4).hex()}"
    generation.mkdir(parents=True)
    for name, data in files.items():
        (generation / name).write_bytes(data)
    tmp = base / "..data_tmp"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(generation.name)
    tmp.replace(base / "..data")
    for name in files:
        link = base / name
        if not link.is_symlink():
            link.symlink_to(f"..data/{name}")


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> tuple[Pki, dict[str, Path]]:
    p = Pki(tmp_path_factory.mktemp("pki"))
    ca = make_ca("pool-ca", days=1)
    foreign = make_ca("other-pool-ca", days=1)
    server_cert, server_key = make_leaf(
        *ca, common_name="server", days=1, dns_names=("localhost",), ip_addresses=("127.0.0.1",), server=True
    )
    secret = p.dir / "server-secret"
    _secret_volume(secret, {"tls.crt": server_cert, "tls.key": server_key, "ca.crt": ca[0], "token": b"x"})
    token_dir = p.dir / "token-secret"
    _secret_volume(token_dir, {"token": TOKEN.encode() + b"\n"})
    client_cert, client_key = p.leaf(ca, "consumer", client=True)
    foreign_cert, foreign_key = p.leaf(foreign, "intruder", client=True)
    return (
        p,
        {
            "ca": p.write("ca.crt", ca[0]),
            "ca_key": p.write("ca.key", ca[1]),
            "secret": secret,
            "token_dir": token_dir,
            "client_cert": client_cert,
            "client_key": client_key,
            "foreign_cert": foreign_cert,
            "foreign_key": foreign_key,
        },
    )


def _overrides(files: dict[str, Path]) -> dict[str, object]:
    secret = files["secret"]
    return {
        "listen.token_file": str(files["token_dir"] / "token"),
        "listen.tls": {
            "cert_file": str(secret / "tls.crt"),
            "key_file": str(secret / "tls.key"),
            "client_ca_file": str(secret / "ca.crt"),
        },
    }


@pytest.fixture(scope="module")
def srv(pki: tuple[Pki, dict[str, Path]]) -> Iterator[ServerProcess]:
    with cache_server(dram_bytes=16 * MiB, overrides=_overrides(pki[1])) as s:
        yield s


def _channel(port: int, files: dict[str, Path], *, cert: str | None, key: str | None) -> grpc.Channel:
    creds = grpc.ssl_channel_credentials(
        root_certificates=files["ca"].read_bytes(),
        private_key=files[key].read_bytes() if key else None,
        certificate_chain=files[cert].read_bytes() if cert else None,
    )
    return grpc.secure_channel(f"localhost:{port}", creds)


def _call(
    channel: grpc.Channel,
    method: str,
    req_stream: bool,
    resp_stream: bool,
    md: tuple[tuple[str, str], ...] | None,
) -> None:
    def ident(b: bytes) -> bytes:  # raw bytes in and out: no handler may ever decode them
        return b

    if not req_stream and not resp_stream:
        channel.unary_unary(method, ident, ident)(b"", timeout=10, metadata=md)
    elif not req_stream:
        for _ in channel.unary_stream(method, ident, ident)(b"", timeout=10, metadata=md):
            pass
    elif not resp_stream:
        channel.stream_unary(method, ident, ident)(iter([b""]), timeout=10, metadata=md)
    else:
        for _ in channel.stream_stream(method, ident, ident)(iter([b""]), timeout=10, metadata=md):
            pass


@pytest.mark.parametrize(("method", "req_stream", "resp_stream"), METHODS, ids=[m[0] for m in METHODS])
def test_every_rpc_refuses_wrong_credentials(
    srv: ServerProcess, pki: tuple[Pki, dict[str, Path]], method: str, req_stream: bool, resp_stream: bool
) -> None:
    files = pki[1]
    port = srv.config.listen.tcp_port
    assert port is not None
    good_md = (("authorization", f"Bearer {TOKEN}"),)
    cases = [
        # (client cert, key, metadata, expected code)
        ("client_cert", "client_key", None, grpc.StatusCode.UNAUTHENTICATED),
        ("client_cert", "client_key", (("authorization", "Bearer wrong"),), grpc.StatusCode.UNAUTHENTICATED),
        ("client_cert", "client_key", (("authorization", TOKEN),), grpc.StatusCode.UNAUTHENTICATED),
        # Without a client certificate of the pool's CA the handshake itself fails: no RPC is parsed.
        (None, None, good_md, grpc.StatusCode.UNAVAILABLE),
        ("foreign_cert", "foreign_key", good_md, grpc.StatusCode.UNAVAILABLE),
    ]
    for cert, key, md, code in cases:
        with _channel(port, files, cert=cert, key=key) as ch, pytest.raises(grpc.RpcError) as err:
            _call(ch, method, req_stream, resp_stream, md)
        assert err.value.code() == code, (cert, md, err.value.details())
    # Plaintext is not served at all.
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch, pytest.raises(grpc.RpcError) as err:
        _call(ch, method, req_stream, resp_stream, good_md)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    # With both the certificate and the token the same call reaches the server: a bad request, not a
    # refusal (health answers; Watch streams until the deadline).
    code = grpc.StatusCode.OK
    with _channel(port, files, cert="client_cert", key="client_key") as ch:
        try:
            _call(ch, method, req_stream, resp_stream, good_md)
        except grpc.RpcError as exc:
            code = exc.code()
    refused = (
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAVAILABLE,
    )
    assert code not in refused


def test_client_with_certificate_and_token_round_trips(
    srv: ServerProcess, pki: tuple[Pki, dict[str, Path]]
) -> None:
    files = pki[1]
    target = f"localhost:{srv.config.listen.tcp_port}"
    k = digest("mtls")
    with CacheClient(
        target, token=TOKEN, tls_ca=files["ca"], tls_cert=files["client_cert"], tls_key=files["client_key"]
    ) as ok:
        assert ok.store(NS, [k], [b"payload"], timeout=10).accepted == 1
        assert ok.load(NS, [k], timeout=10) == [b"payload"]
    no_token = CacheClient(
        target, tls_ca=files["ca"], tls_cert=files["client_cert"], tls_key=files["client_key"]
    )
    with no_token, pytest.raises(PermissionDenied):
        no_token.lookup(NS, [k], timeout=10)
    with CacheClient(target, token=TOKEN, tls_ca=files["ca"]) as no_cert, pytest.raises(CacheUnavailable):
        no_cert.lookup(NS, [k], timeout=10)


def test_rotated_certificates_and_token_apply_without_restart(pki: tuple[Pki, dict[str, Path]]) -> None:
    p, files = pki
    work = p.dir / "rotation"
    work.mkdir()
    rot = {**files, "secret": work / "server", "token_dir": work / "token"}
    old_ca = (files["ca"].read_bytes(), files["ca_key"].read_bytes())
    new_ca = make_ca("pool-ca-2", days=1)
    leaf = {"dns_names": ("localhost",), "ip_addresses": ("127.0.0.1",), "server": True}
    cert, key = make_leaf(*old_ca, common_name="server", days=1, **leaf)  # type: ignore[arg-type]
    _secret_volume(rot["secret"], {"tls.crt": cert, "tls.key": key, "ca.crt": old_ca[0]})
    _secret_volume(rot["token_dir"], {"token": b"first-token"})
    new_client = p.leaf(new_ca, "consumer-2", client=True)
    ns = digest("rotation")

    def lookup(ca: Path, cert_key: tuple[Path, Path], token: str) -> int:
        with CacheClient(target, token=token, tls_ca=ca, tls_cert=cert_key[0], tls_key=cert_key[1]) as c:
            return c.lookup(ns, [digest(1)], timeout=10).matched

    old_client = (files["client_cert"], files["client_key"])
    with cache_server(dram_bytes=16 * MiB, overrides=_overrides(rot)) as s:
        target = f"localhost:{s.config.listen.tcp_port}"
        assert lookup(files["ca"], old_client, "first-token") == 0
        # Rotate everything: a new CA signs the server and the consumers, and a new token.
        cert, key = make_leaf(*new_ca, common_name="server", days=1, **leaf)  # type: ignore[arg-type]
        _secret_volume(rot["secret"], {"tls.crt": cert, "tls.key": key, "ca.crt": new_ca[0]})
        _secret_volume(rot["token_dir"], {"token": b"second-token"})
        new_ca_file = p.write("ca-2.crt", new_ca[0])
        assert lookup(new_ca_file, new_client, "second-token") == 0
        with pytest.raises(PermissionDenied):
            lookup(new_ca_file, new_client, "first-token")
        with pytest.raises(CacheUnavailable):
            lookup(files["ca"], old_client, "second-token")
        assert s.proc is not None
        assert s.proc.poll() is None
        assert s.starts == 1


def test_a_consumer_follows_rotated_certificates_and_token_without_a_restart(
    pki: tuple[Pki, dict[str, Path]],
) -> None:
    """One long-lived client, its credentials in a Secret volume the "kubelet" rotates under it.

    The webhook injects the token and the client certificate as files of one projected Secret
    volume; the connector keeps one client per process for its whole life. After the operator
    rotates the CA, the certificates and the token, the same client object must keep working: it
    notices the changed files and builds a new channel. A client that read its credentials once
    (what the connector did with the token in an environment variable) is refused from then on.
    """
    p, files = pki
    work = p.dir / "consumer-rotation"
    server = {**files, "secret": work / "server", "token_dir": work / "server-token"}
    consumer = work / "consumer"
    ca1 = make_ca("rot-ca-1", days=1)
    ca2 = make_ca("rot-ca-2", days=1)
    leaf = {"dns_names": ("localhost",), "ip_addresses": ("127.0.0.1",), "server": True}

    def rotate(ca: tuple[bytes, bytes], token: bytes) -> None:
        cert, key = make_leaf(*ca, common_name="server", days=1, **leaf)  # type: ignore[arg-type]
        _secret_volume(server["secret"], {"tls.crt": cert, "tls.key": key, "ca.crt": ca[0]})
        _secret_volume(server["token_dir"], {"token": token})
        c_cert, c_key = make_leaf(*ca, common_name="consumer", days=1, client=True)
        _secret_volume(
            consumer, {"tls.crt": c_cert, "tls.key": c_key, "ca.crt": ca[0], "token": token + b"\n"}
        )

    rotate(ca1, b"token-one")
    ns = digest("consumer-rotation")
    with cache_server(dram_bytes=16 * MiB, overrides=_overrides(server)) as s:
        target = f"localhost:{s.config.listen.tcp_port}"
        ca, cert, key = consumer / "ca.crt", consumer / "tls.crt", consumer / "tls.key"
        with (
            CacheClient(
                target, token_file=consumer / "token", tls_ca=ca, tls_cert=cert, tls_key=key
            ) as watching,
            # The token read once, as from an environment variable (its TLS files are watched too).
            CacheClient(target, token="token-one", tls_ca=ca, tls_cert=cert, tls_key=key) as read_once,
        ):
            assert watching.lookup(ns, [digest(1)], timeout=10).matched == 0
            assert read_once.lookup(ns, [digest(1)], timeout=10).matched == 0
            rotate(ca2, b"token-two")

            def works() -> bool:
                try:
                    return watching.lookup(ns, [digest(1)], timeout=10).matched == 0
                except (CacheUnavailable, PermissionDenied):
                    return False

            wait_until(works, timeout=30, interval=0.2, what="the same client to use the rotated credentials")
            with pytest.raises(PermissionDenied):  # its token is the old one
                read_once.lookup(ns, [digest(1)], timeout=10)


@pytest.mark.parametrize(
    "listen",
    [
        {"tcp_host": "0.0.0.0", "tcp_port": 7070},
        {"tcp_host": "0.0.0.0", "tcp_port": 7070, "token_file": "/t"},
        {
            "tcp_host": "10.0.0.1",
            "tcp_port": 7070,
            "tls": {"cert_file": "/c", "key_file": "/k"},
            "token_file": "/t",
        },
    ],
)
def test_a_listener_beyond_loopback_requires_mutual_tls_and_a_token(listen: dict[str, object]) -> None:
    base = {
        "listen": {"unix_socket": "/run/kvfabric/cache.sock", **listen},
        "tiers": {"dram": {"capacity_bytes": 1 << 30}},
    }
    with pytest.raises(ValidationError, match=r"requires listen\.tls with client_ca_file"):
        ServerConfig.model_validate(base)
    ok = {"tcp_host": "0.0.0.0", "tcp_port": 7070, "token_file": "/t"}
    ok["tls"] = {"cert_file": "/c", "key_file": "/k", "client_ca_file": "/ca"}
    ServerConfig.model_validate({**base, "listen": {**base["listen"], **ok}})  # type: ignore[dict-item]
