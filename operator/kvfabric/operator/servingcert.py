"""The webhook's serving certificate, rotated and reloaded in place: no listener restart, no gap.

kopf restarts its HTTPS listener when the certificate files it was given change, which refuses the
API server's admission calls for a moment (a `Fail` pool's pods are then rejected). Instead kopf is
given one :class:`ssl.SSLContext` and a snapshot of the files that never changes; this module loads
new certificates into that same context, which every later handshake uses, while established
connections keep theirs.

Two sources: self-managed (the operator's own CA signs a leaf and re-issues it when less than a third
of its validity is left; the CA, in the webhook configuration's caBundle, lives ten times longer)
or external files (cert-manager's Secret volume), re-read whenever their content changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import hashlib
import logging
import os
import ssl
from pathlib import Path

from cryptography import x509

from kvfabric.operator.certs import make_ca, make_leaf, split_hosts

__all__ = ["ServingCertificate"]

log = logging.getLogger("kvfabric.operator.servingcert")


def _write(path: Path, data: bytes, mode: int = 0o644) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    tmp.chmod(mode)
    os.replace(tmp, path)  # readers see the old file or the new one, never half


class ServingCertificate:
    """A serving certificate behind one SSL context; :meth:`refresh` rotates or reloads it."""

    def __init__(
        self,
        directory: Path,
        *,
        hosts: list[str] | None = None,
        validity_seconds: float = 30 * 86400,
        cert_file: Path | None = None,
        key_file: Path | None = None,
        ca_file: Path | None = None,
    ) -> None:
        """Self-managed for ``hosts`` (files in ``directory``), or external ``cert_file``/``key_file``."""
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.validity = dt.timedelta(seconds=validity_seconds)
        self.self_managed = cert_file is None
        self.ca_file: Path | None
        if cert_file is None:
            ca_crt, ca_key = make_ca(
                "kvfabric-webhook-ca", days=max(365.0, 10 * self.validity.total_seconds() / 86400)
            )
            self._ca = (ca_crt, ca_key)
            self.hosts = list(hosts or ["localhost"])
            self.ca_file = directory / "ca.crt"
            self.cert_file, self.key_file = directory / "tls.crt", directory / "tls.key"
            _write(directory / "ca.crt", ca_crt)
            self._issue()
        else:
            assert key_file is not None
            self.cert_file, self.key_file = cert_file, key_file
            self.ca_file = ca_file
        self.context = ssl.create_default_context(purpose=ssl.Purpose.CLIENT_AUTH)
        self._digest = ""
        self.not_after = dt.datetime.min.replace(tzinfo=dt.UTC)
        self._load()
        # What kopf is told: a copy that never changes, so kopf never restarts its listener.
        self.kopf_cert, self.kopf_key = directory / "kopf-tls.crt", directory / "kopf-tls.key"
        _write(self.kopf_cert, self.cert_file.read_bytes())
        _write(self.kopf_key, self.key_file.read_bytes(), 0o600)

    def _issue(self) -> None:
        ips, dns = split_hosts(self.hosts)
        crt, key = make_leaf(
            *self._ca,
            common_name=self.hosts[0],
            days=self.validity.total_seconds() / 86400,
            dns_names=tuple(dns),
            ip_addresses=tuple(ips),
            server=True,
        )
        _write(self.key_file, key, 0o600)
        _write(self.cert_file, crt)

    def _load(self) -> bool:
        """Load the files into the context if their content changed; True when it did."""
        cert, key = self.cert_file.read_bytes(), self.key_file.read_bytes()
        digest = hashlib.sha256(cert + b"\0" + key).hexdigest()
        if digest == self._digest:
            return False
        try:
            self.context.load_cert_chain(self.cert_file, self.key_file)
        except (ssl.SSLError, OSError) as exc:  # a half-rotated pair: keep serving the previous one
            log.warning("could not load the webhook certificate: %s", exc)
            return False
        self._digest = digest
        self.not_after = x509.load_pem_x509_certificate(cert).not_valid_after_utc
        log.info("serving webhook certificate valid until %s", self.not_after.isoformat())
        return True

    def refresh(self, now: dt.datetime | None = None) -> bool:
        """Re-issue a self-managed certificate that is due, or pick up changed files; True if reloaded."""
        now = now or dt.datetime.now(dt.UTC)
        if self.self_managed and self.not_after - now < self.validity / 3:
            self._issue()
        return self._load()

    async def run(self, interval: float | None = None) -> None:
        """Refresh forever (on the event loop that serves the context, so no handshake races it)."""
        period = interval or max(0.5, min(30.0, self.validity.total_seconds() / 20))
        while True:
            await asyncio.sleep(period)
            with contextlib.suppress(OSError):
                self.refresh()
