"""Certificates and keys for a loopback control plane, generated with ``cryptography``.

The certificate builders are :mod:`kvfabric.operator.certs`' (the webhook uses them too). One
self-signed CA signs the API server's serving certificate and the admin client certificate
(``O=system:masters``). A separate RSA key pair signs and verifies service-account tokens. Pure
functions return PEM bytes; :func:`write_pki` is the only one that touches the filesystem.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from kvfabric.operator.certs import key_pem, make_ca, make_leaf


@dataclass(frozen=True)
class Pki:
    """Paths of the PEM files a cluster needs."""

    ca_crt: Path
    ca_key: Path
    apiserver_crt: Path
    apiserver_key: Path
    admin_crt: Path
    admin_key: Path
    sa_key: Path
    sa_pub: Path

    @classmethod
    def in_dir(cls, directory: Path) -> Pki:
        """The file names a cluster's ``pki`` directory holds."""
        names = (
            "ca.crt",
            "ca.key",
            "apiserver.crt",
            "apiserver.key",
            "admin.crt",
            "admin.key",
            "sa.key",
            "sa.pub",
        )
        return cls(*(directory / n for n in names))


def make_service_account_keys() -> tuple[bytes, bytes]:
    """Return ``(private_pem, public_pem)`` for signing service-account tokens."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    public = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return key_pem(key), public


API_SERVER_DNS = (
    "localhost",
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
)


def write_pki(directory: Path, *, service_ip: str) -> Pki:
    """Generate every certificate and key of a cluster into ``directory`` (mode 0700)."""
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o700)
    ca_crt, ca_key = make_ca("kvfabric-local-ca", days=365)
    api_crt, api_key = make_leaf(
        ca_crt,
        ca_key,
        common_name="kube-apiserver",
        dns_names=API_SERVER_DNS,
        ip_addresses=("127.0.0.1", service_ip),
        server=True,
        days=365,
    )
    admin_crt, admin_key = make_leaf(
        ca_crt, ca_key, common_name="kvfabric-admin", organization="system:masters", client=True, days=365
    )
    sa_key, sa_pub = make_service_account_keys()
    pki = Pki.in_dir(directory)
    contents = (ca_crt, ca_key, api_crt, api_key, admin_crt, admin_key, sa_key, sa_pub)
    for path, data in zip(dataclasses.astuple(pki), contents, strict=True):
        path.write_bytes(data)
        path.chmod(0o600)
    return pki
