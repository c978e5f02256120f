"""What a consumer pod needs to reach its pool, and the hash that says whether it is current."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfabric.contract.consumer_env import ConsumerEnvironment
from kvfabric.operator.api.v1alpha1 import KVCachePool
from kvfabric.operator.render import names


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
    shm_dir: str
    remote: str
    chunk_tokens: int
    tenant: str | None = None
    deadlines: dict[str, int] = field(default_factory=dict)
    # Not part of the environment (nor of the hash): the payload image only matters at pod creation.
    connector_image: str = ""

    @property
    def environment(self) -> ConsumerEnvironment:
        """The typed consumer environment (the contract ``ConnectorSettings`` reads)."""
        return ConsumerEnvironment(
            pool=f"{self.namespace}/{self.pool}",
            socket=self.socket,
            shm_dir=self.shm_dir,
            remote=self.remote,
            chunk_tokens=self.chunk_tokens,
            tenant=self.tenant,
            lookup_deadline_ms=self.deadlines.get("lookup"),
            load_deadline_ms=self.deadlines.get("load"),
            store_deadline_ms=self.deadlines.get("store"),
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
    return ConnectionSettings(
        pool=name,
        namespace=namespace,
        host_dir=base,
        socket=f"{base}/{names.SOCKET_NAME}",
        shm_dir=f"{base}/{names.SHM_NAME}",
        remote=f"{names.service_name(name)}.{namespace}.svc:{pool.spec.server.port}",
        chunk_tokens=pool.spec.chunk_tokens,
        tenant=pool.spec.consumers.tenant,
        deadlines=deadlines,
        connector_image=pool.spec.consumers.connector_image or default_connector_image(pool),
    )


def default_connector_image(pool: KVCachePool) -> str:
    """The payload image that matches the pool's cache-server image: ``<registry/org>/connector:<tag>``."""
    repository = pool.spec.image.repository
    prefix = repository.rsplit("/", 1)[0] + "/" if "/" in repository else ""
    return f"{prefix}connector:{pool.spec.image.tag}"
