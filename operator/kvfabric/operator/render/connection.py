"""What a consumer pod needs to reach its pool, and the hash that says whether it is current."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfabric.contract.consumer_env import ConsumerEnvironment, ConsumerVar
from kvfabric.operator.api.v1alpha1 import KeySpace, KVCachePool, LoadMode
from kvfabric.operator.render import names
from kvfabric.operator.routingevents import RoutingEventsSettings


@dataclass(frozen=True)
class ConnectionSettings:
    """The connector settings injected into consumer pods (as ``KVFABRIC_*`` environment variables).

    ``config_hash`` covers exactly these settings: a pool change that consumers must pick up (socket
    path, chunk size, tenant, deadlines) changes it; resizing a tier does not, so it does not mark
    every consumer stale.
    """

    pool: str
    namespace: str
    host_dir: str
    socket: str
    remote: str
    chunk_tokens: int
    tenant: str | None = None
    deadlines: dict[str, int] = field(default_factory=dict)
    load_async: bool | None = None
    local_index: bool | None = None
    cost_model: bool | None = None
    # Not part of the environment (nor of the hash): the payload image only matters at pod creation.
    connector_image: str = ""
    tcp: bool = False
    """Whether the TCP listener is on (then consumers in the pool's namespace get its credentials)."""
    shared_key_space: bool = False
    """``spec.consumers.keySpace: Shared``: every consumer namespace uses the one shared key scope."""
    routing_events: RoutingEventsSettings | None = None
    """``spec.consumers.routingEvents``: vLLM's KV-event publisher, added at pod creation (not hashed)."""

    @property
    def credential_env(self) -> list[dict[str, object]]:
        """Environment entries wiring the pool's credentials into a consumer in the pool's namespace.

        Secrets never appear in the pod spec. The payload key (the MAC that makes forged chunks fail)
        always, through ``secretKeyRef``; when TCP is on, the token and the client certificate as
        files of one projected Secret volume, which the kubelet updates in place when the operator
        rotates them and the connector re-reads (no restart).
        """
        secret = names.credentials_secret_name(self.pool)
        # optional: a pod created before its pool's Secret exists still starts (the cache must never
        # stop inference); it then runs without the key, in a key space of its own.
        mac_ref: dict[str, object] = {"name": secret, "key": names.PAYLOAD_KEY, "optional": True}
        mac: dict[str, object] = {
            "name": ConsumerVar.PAYLOAD_KEY.value,
            "valueFrom": {"secretKeyRef": mac_ref},
        }
        if not self.tcp:
            return [mac]
        tls = names.CLIENT_TLS_MOUNT
        return [
            mac,
            {"name": ConsumerVar.TOKEN_FILE.value, "value": f"{tls}/{names.TOKEN_KEY}"},
            {"name": ConsumerVar.TLS_CA.value, "value": f"{tls}/{names.CA_KEY}"},
            {"name": ConsumerVar.TLS_CERT.value, "value": f"{tls}/tls.crt"},
            {"name": ConsumerVar.TLS_KEY.value, "value": f"{tls}/tls.key"},
        ]

    @property
    def environment(self) -> ConsumerEnvironment:
        """The typed consumer environment (the contract ``ConnectorSettings`` reads)."""
        return ConsumerEnvironment(
            pool=f"{self.namespace}/{self.pool}",
            socket=self.socket,
            remote=self.remote or None,
            chunk_tokens=self.chunk_tokens,
            tenant=self.tenant,
            lookup_deadline_ms=self.deadlines.get("lookup"),
            load_deadline_ms=self.deadlines.get("load"),
            store_deadline_ms=self.deadlines.get("store"),
            load_async=self.load_async,
            local_index=self.local_index,
            cost_model=self.cost_model,
            shared_key_space=self.shared_key_space,
        )

    @property
    def env(self) -> dict[str, str]:
        """Return the environment variables, without the hash (ordered, deterministic)."""
        return self.environment.to_env()

    @property
    def config_hash(self) -> str:
        """Return a short stable digest of :attr:`env`."""
        return self.environment.config_hash

    @property
    def env_with_hash(self) -> dict[str, str]:
        """Return :attr:`env` plus ``KVFABRIC_CONFIG_HASH``."""
        return self.environment.to_env_with_hash()


def connection_settings(pool: KVCachePool) -> ConnectionSettings:
    """Return the connection settings of ``pool``."""
    name, namespace = pool.name, pool.namespace
    base = names.host_dir(namespace, name)
    deadlines: dict[str, int] = {}
    if pool.spec.consumers.deadlines is not None:
        d = pool.spec.consumers.deadlines
        for op, value in (("lookup", d.lookup_ms), ("load", d.load_ms), ("store", d.store_ms)):
            if value is not None:
                deadlines[op] = value
    mode = pool.spec.consumers.load_mode
    events = pool.spec.consumers.routing_events
    return ConnectionSettings(
        pool=name,
        namespace=namespace,
        host_dir=base,
        socket=f"{base}/{names.SOCKET_NAME}",
        remote=f"{names.service_name(name)}.{namespace}.svc:{pool.spec.server.port}"
        if pool.spec.server.tcp.enabled
        else "",
        chunk_tokens=pool.spec.chunk_tokens,
        tenant=pool.spec.consumers.tenant,
        deadlines=deadlines,
        load_async=None if mode is None else mode is LoadMode.ASYNCHRONOUS,
        local_index=pool.spec.consumers.local_index,
        cost_model=pool.spec.consumers.cost_model,
        connector_image=pool.spec.consumers.connector_image or default_connector_image(pool),
        tcp=pool.spec.server.tcp.enabled,
        shared_key_space=pool.spec.consumers.key_space is KeySpace.SHARED,
        routing_events=None
        if events is None
        else RoutingEventsSettings(
            port=events.port,
            replay_port=events.replay_port,
            model_name=events.model_name,
            llmd_label=events.llmd_label,
        ),
    )


def default_connector_image(pool: KVCachePool) -> str:
    """The payload image that matches the pool's cache-server image: ``<registry/org>/connector:<tag>``."""
    repository = pool.spec.image.repository
    prefix = repository.rsplit("/", 1)[0] + "/" if "/" in repository else ""
    return f"{prefix}connector:{pool.spec.image.tag}"
