"""Self-signed webhook certificates for local clusters (production uses cert-manager).

The API server verifies the webhook's serving certificate against the ``caBundle`` of the webhook
configuration; for a webhook on ``https://127.0.0.1:<port>`` the certificate needs that IP as a SAN.
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


@dataclass(frozen=True)
class WebhookCerts:
    """Paths of the generated PEM files."""

    ca_file: Path
    cert_file: Path
    key_file: Path

    def ca_bundle(self) -> bytes:
        """Return the CA certificate (PEM) for ``clientConfig.caBundle``."""
        return self.ca_file.read_bytes()


def key_pem(key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> bytes:
    """Return ``key`` as unencrypted PKCS#8 PEM."""
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _name(common_name: str, organization: str | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if organization:
        attrs.insert(0, x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
    return x509.Name(attrs)


def make_ca(common_name: str, *, days: float) -> tuple[bytes, bytes]:
    """Return ``(cert_pem, key_pem)`` of a new self-signed CA (P-256: generated in microseconds)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(_name(common_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
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
    return cert.public_bytes(serialization.Encoding.PEM), key_pem(key)


def make_leaf(
    ca_cert_pem: bytes,
    ca_key_pem: bytes,
    *,
    common_name: str,
    days: float,
    organization: str | None = None,
    dns_names: tuple[str, ...] = (),
    ip_addresses: tuple[str, ...] = (),
    server: bool = False,
    client: bool = False,
) -> tuple[bytes, bytes]:
    """Return ``(cert_pem, key_pem)`` of a certificate signed by the given CA."""
    ca_cert = x509.load_pem_x509_certificate(ca_cert_pem)
    ca_key = serialization.load_pem_private_key(ca_key_pem, password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise TypeError("the CA key must be an EC key")
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    usages = [ExtendedKeyUsageOID.SERVER_AUTH] * server + [ExtendedKeyUsageOID.CLIENT_AUTH] * client
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name, organization))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    )
    sans: list[x509.GeneralName] = [x509.DNSName(n) for n in dns_names]
    sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ip_addresses]
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM), key_pem(key)


def split_hosts(hosts: list[str]) -> tuple[list[str], list[str]]:
    """Split ``hosts`` into (IP addresses, DNS names)."""
    ips, dns = [], []
    for host in hosts:
        try:
            ipaddress.ip_address(host)
            ips.append(host)
        except ValueError:
            dns.append(host)
    return ips, dns


def generate(directory: Path, hosts: list[str], *, days: int = 30) -> WebhookCerts:
    """Write a CA and a serving certificate for ``hosts`` (IPs or DNS names) into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_crt, ca_key = make_ca("kvfabric-webhook-ca", days=days)
    ips, dns = [], []
    for host in hosts:
        try:
            ipaddress.ip_address(host)
            ips.append(host)
        except ValueError:
            dns.append(host)
    crt, key = make_leaf(
        ca_crt,
        ca_key,
        common_name=hosts[0] if hosts else "kvfabric-webhook",
        days=days,
        dns_names=tuple(dns),
        ip_addresses=tuple(ips),
        server=True,
    )
    out = WebhookCerts(directory / "ca.crt", directory / "tls.crt", directory / "tls.key")
    out.ca_file.write_bytes(ca_crt)
    out.cert_file.write_bytes(crt)
    out.key_file.write_bytes(key)
    out.key_file.chmod(0o600)
    return out
