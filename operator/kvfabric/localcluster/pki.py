"""Certificates and keys for a loopback control plane, generated with ``cryptography``.

One self-signed CA signs the API server's serving certificate and the admin client certificate
(``O=system:masters``). A separate RSA key pair signs and verifies service-account tokens. Pure
functions return PEM bytes; :func:`write_pki` is the only one that touches the filesystem.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_VALIDITY = dt.timedelta(days=365)


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


def _key() -> ec.EllipticCurvePrivateKey:
    # P-256 keys are generated in microseconds; RSA-2048 would dominate cluster start-up time.
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _name(common_name: str, organization: str | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if organization:
        attrs.insert(0, x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
    return x509.Name(attrs)


def make_ca(common_name: str = "kvfabric-local-ca") -> tuple[bytes, bytes]:
    """Return ``(cert_pem, key_pem)`` of a new self-signed CA."""
    key = _key()
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(_name(common_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + _VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)


def make_leaf(
    ca_cert_pem: bytes,
    ca_key_pem: bytes,
    *,
    common_name: str,
    organization: str | None = None,
    dns_names: tuple[str, ...] = (),
    ip_addresses: tuple[str, ...] = (),
    server: bool = False,
    client: bool = False,
) -> tuple[bytes, bytes]:
    """Return ``(cert_pem, key_pem)`` of a certificate signed by the given CA."""
    ca_cert = x509.load_pem_x509_certificate(ca_cert_pem)
    ca_key = serialization.load_pem_private_key(ca_key_pem, password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = _key()
    now = dt.datetime.now(dt.UTC)
    usages = [ExtendedKeyUsageOID.SERVER_AUTH] * server + [ExtendedKeyUsageOID.CLIENT_AUTH] * client
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name, organization))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + _VALIDITY)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    )
    sans: list[x509.GeneralName] = [x509.DNSName(n) for n in dns_names]
    sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ip_addresses]
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)


def make_service_account_keys() -> tuple[bytes, bytes]:
    """Return ``(private_pem, public_pem)`` for signing service-account tokens."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    public = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return _key_pem(key), public


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
    ca_crt, ca_key = make_ca()
    api_crt, api_key = make_leaf(
        ca_crt,
        ca_key,
        common_name="kube-apiserver",
        dns_names=API_SERVER_DNS,
        ip_addresses=("127.0.0.1", service_ip),
        server=True,
    )
    admin_crt, admin_key = make_leaf(
        ca_crt, ca_key, common_name="kvfabric-admin", organization="system:masters", client=True
    )
    sa_key, sa_pub = make_service_account_keys()
    pki = Pki(
        *(
            directory / n
            for n in (
                "ca.crt",
                "ca.key",
                "apiserver.crt",
                "apiserver.key",
                "admin.crt",
                "admin.key",
                "sa.key",
                "sa.pub",
            )
        )
    )
    for path, data in zip(
        (
            pki.ca_crt,
            pki.ca_key,
            pki.apiserver_crt,
            pki.apiserver_key,
            pki.admin_crt,
            pki.admin_key,
            pki.sa_key,
            pki.sa_pub,
        ),
        (ca_crt, ca_key, api_crt, api_key, admin_crt, admin_key, sa_key, sa_pub),
        strict=True,
    ):
        path.write_bytes(data)
        path.chmod(0o600)
    return pki
