"""Per-pool credentials: a token, the payload MAC secret and, with TCP, a CA and its certificates.

:func:`plan_secrets` is pure: given the pool, the Secrets that exist now and the time, it returns the
Secrets to write. Existing material is kept as long as it is valid; a certificate with less than a
third of its validity left is re-issued, and so is the CA (its successor's certificate is bundled
with the old one until the old one expires, so no handshake fails during the hand-over).

Each pool has its own CA: a client certificate of one pool is worthless against another pool.

The Secrets' names are fixed (``<pool>-credentials``, ``<pool>-ca``, ``<pool>-server-tls``,
``<pool>-client-tls``), so one may already exist that is not the pool's: a user's own (say the
pool's S3 keys). The pool's are those with an owner reference to its uid (the operator writes one on
every Secret it creates); any other is a conflict, never read, written or owned
(:attr:`SecretPlan.conflicts`).
"""

from __future__ import annotations

import base64
import datetime as dt
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from cryptography import x509
from cryptography.exceptions import InvalidSignature

from kvfabric.operator.api.v1alpha1 import KVCachePool
from kvfabric.operator.certs import make_ca, make_leaf
from kvfabric.operator.render import names

__all__ = ["CA_LIFETIME_FACTOR", "SecretPlan", "owned_by", "plan_secrets", "server_dns_names"]

CA_LIFETIME_FACTOR: Final = 10


@dataclass(frozen=True)
class SecretPlan:
    """Secrets the pool should have (names), those to write now (bodies), and those it may not write.

    ``conflicts``: wanted names held by a Secret that is not the pool's (sorted). Nothing is written
    to them; the pool reports them (condition ``Degraded``, reason ``SecretConflict``).
    """

    wanted: frozenset[str]
    writes: list[dict[str, Any]]
    conflicts: tuple[str, ...] = ()


def owned_by(secret: Mapping[str, Any], uid: str) -> bool:
    """Whether ``secret`` is the pool's with ``uid``: one of its owner references names that uid.

    Not labels: anyone who can write a Secret can copy the operator's labels onto it by accident (a
    copied manifest). An owner reference to the pool's uid, which is new for every incarnation of
    a pool, is only ever written by the operator for that pool (or by someone who means exactly that).
    """
    refs = (secret.get("metadata") or {}).get("ownerReferences") or []
    return bool(uid) and any(str(ref.get("uid", "")) == uid for ref in refs)


def server_dns_names(pool: KVCachePool) -> tuple[str, ...]:
    """DNS names the servers' certificate covers: the node-local Service in all its spellings."""
    svc, ns = names.service_name(pool.name), pool.namespace
    return (svc, f"{svc}.{ns}", f"{svc}.{ns}.svc", f"{svc}.{ns}.svc.cluster.local")


def _decode(secret: Mapping[str, Any] | None) -> dict[str, bytes]:
    if not secret:
        return {}
    return {k: base64.b64decode(v) for k, v in (secret.get("data") or {}).items()}


def _body(pool: KVCachePool, name: str, data: Mapping[str, bytes], owner: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": name,
            "namespace": pool.namespace,
            "labels": names.child_labels(pool.name, "credentials"),
            "ownerReferences": [owner],
        },
        "type": "Opaque",
        "data": {k: base64.b64encode(v).decode() for k, v in sorted(data.items())},
    }


def _load_cert(pem: bytes) -> x509.Certificate | None:
    try:
        return x509.load_pem_x509_certificate(pem)
    except ValueError:
        return None


def _fresh(cert: x509.Certificate | None, lifetime: dt.timedelta, now: dt.datetime) -> bool:
    """Whether ``cert`` still has more than a third of ``lifetime`` left."""
    return cert is not None and cert.not_valid_after_utc - now > lifetime / 3


def _issued_by(cert: x509.Certificate | None, ca: x509.Certificate) -> bool:
    if cert is None:
        return False
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def _sans(cert: x509.Certificate) -> set[str]:
    try:
        ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except x509.ExtensionNotFound:
        return set()
    return set(ext.value.get_values_for_type(x509.DNSName))


def _bundle(current: bytes, previous: bytes | None, now: dt.datetime) -> bytes:
    """The trust bundle: the current CA, plus the previous one while it is still valid."""
    out = current
    old = _load_cert(previous) if previous else None
    if old is not None and old.not_valid_after_utc > now and previous != current:
        out += previous  # type: ignore[operator]
    return out


def plan_secrets(
    pool: KVCachePool,
    existing: Mapping[str, Mapping[str, Any] | None],
    now: dt.datetime,
    owner: dict[str, Any],
    *,
    token: Callable[[], str] = lambda: secrets.token_urlsafe(32),
) -> SecretPlan:
    """Return the Secrets ``pool`` needs given the ``existing`` ones (by name; None when absent).

    An existing Secret that is not the pool's (:func:`owned_by` the uid in ``owner``) is never read
    or written. If the pool wants its name, it is listed in ``conflicts`` and nothing at all is
    written: the pool's credentials hang together (leaves signed by its CA, the token the servers
    and consumers share), so none is issued while one of them cannot be.
    """
    uid = str(owner.get("uid", ""))
    foreign = {name for name, secret in existing.items() if secret is not None and not owned_by(secret, uid)}
    plan = _plan(pool, {n: None if n in foreign else s for n, s in existing.items()}, now, owner, token)
    conflicts = tuple(sorted(foreign & plan.wanted))
    return SecretPlan(plan.wanted, [] if conflicts else plan.writes, conflicts)


def _plan(
    pool: KVCachePool,
    existing: Mapping[str, Mapping[str, Any] | None],
    now: dt.datetime,
    owner: dict[str, Any],
    token: Callable[[], str],
) -> SecretPlan:
    writes: list[dict[str, Any]] = []
    cred_name = names.credentials_secret_name(pool.name)
    wanted = {cred_name}
    cred = _decode(existing.get(cred_name))
    want_cred = dict(cred)
    for item in (names.TOKEN_KEY, names.PAYLOAD_KEY):
        if not want_cred.get(item):
            want_cred[item] = token().encode()
    if want_cred != cred:
        writes.append(_body(pool, cred_name, want_cred, owner))

    tcp = pool.spec.server.tcp
    if not tcp.enabled:
        return SecretPlan(frozenset(wanted), writes)

    leaf_life = dt.timedelta(seconds=tcp.certificate_validity_seconds)
    ca_life = leaf_life * CA_LIFETIME_FACTOR
    ca_name = names.ca_secret_name(pool.name)
    server_name = names.server_tls_secret_name(pool.name)
    client_name = names.client_tls_secret_name(pool.name)
    wanted |= {ca_name, server_name, client_name}

    ca = _decode(existing.get(ca_name))
    ca_cert = _load_cert(ca.get("tls.crt", b""))
    if not (_fresh(ca_cert, ca_life, now) and ca.get("tls.key")):
        days = ca_life / dt.timedelta(days=1)
        crt, key = make_ca(f"kvfabric {pool.namespace}/{pool.name} CA", days=days)
        new_ca = {"tls.crt": crt, "tls.key": key, names.CA_KEY: _bundle(crt, ca.get("tls.crt"), now)}
        writes.append(_body(pool, ca_name, new_ca, owner))
        ca = new_ca
        ca_cert = _load_cert(crt)
    else:
        # Drop a predecessor from the bundle once it has expired.
        bundle = _bundle(ca["tls.crt"], _previous(ca), now)
        if bundle != ca.get(names.CA_KEY):
            ca = {**ca, names.CA_KEY: bundle}
            writes.append(_body(pool, ca_name, ca, owner))
    assert ca_cert is not None

    dns = server_dns_names(pool)
    for name, kwargs in (
        (server_name, {"common_name": dns[2], "dns_names": dns, "server": True}),
        (client_name, {"common_name": f"{pool.namespace}/{pool.name} consumer", "client": True}),
    ):
        have = _decode(existing.get(name))
        cert = _load_cert(have.get("tls.crt", b""))
        current = (
            _fresh(cert, leaf_life, now)
            and _issued_by(cert, ca_cert)
            and (not kwargs.get("server") or _sans(cert) == set(dns))  # type: ignore[arg-type]
            and bool(have.get("tls.key"))
        )
        if current:
            if have.get(names.CA_KEY) != ca[names.CA_KEY]:
                writes.append(_body(pool, name, {**have, names.CA_KEY: ca[names.CA_KEY]}, owner))
            continue
        crt, key = make_leaf(
            ca["tls.crt"],
            ca["tls.key"],
            days=leaf_life / dt.timedelta(days=1),
            **kwargs,  # type: ignore[arg-type]
        )
        writes.append(
            _body(pool, name, {"tls.crt": crt, "tls.key": key, names.CA_KEY: ca[names.CA_KEY]}, owner)
        )
    return SecretPlan(frozenset(wanted), writes)


def _previous(ca: Mapping[str, bytes]) -> bytes | None:
    """The CA certificate(s) in the bundle other than the current one."""
    bundle, current = ca.get(names.CA_KEY, b""), ca.get("tls.crt", b"")
    rest = bundle.replace(current, b"", 1).strip()
    return rest + b"\n" if rest else None
