"""Cross-namespace access: the pool's namespaceSelector, read from the API server at publish time.

Only a pod of another namespace than the pool's needs this; the plugin's ServiceAccount may get
KVCachePools and Namespaces, and the one Secret of consumer keys in its own namespace, and nothing
else (``manifests/csi/rbac.yaml``). A decision holds for the pod's lifetime: a selector changed
later stops new pods, not running ones.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, cast

from kvfabric.contract.consumer_env import CONSUMER_KEYS_SECRET
from kvfabric.csi.publish import (
    Code,
    ConsumerKey,
    Publication,
    Refused,
    consumer_root_from_secret,
    cross_namespace_refusal,
    pool_shares_keys,
)

GROUP = "kvfabric.io"
VERSION = "v1alpha1"
PLURAL = "kvcachepools"


@dataclass
class ApiAuthorizer:
    """Asks the API server whether a cross-namespace publication is allowed."""

    api_client: Any
    namespace: str = "kvfabric-system"
    """The plugin's own namespace, where the operator keeps the consumer-keys Secret."""
    timeout: float = 5.0

    @classmethod
    def from_environment(cls, kubeconfig: str | None = None, namespace: str | None = None) -> ApiAuthorizer:
        """In-cluster credentials (the plugin's ServiceAccount token), or a kubeconfig for tests.

        ``namespace`` defaults to ``$POD_NAMESPACE`` (the downward API), then ``kvfabric-system``.
        """
        from kubernetes import client, config

        ns = namespace or os.environ.get("POD_NAMESPACE") or "kvfabric-system"
        if kubeconfig:
            return cls(config.new_client_from_config(config_file=kubeconfig), ns)  # type: ignore[no-untyped-call]
        config.load_incluster_config()  # type: ignore[no-untyped-call]
        return cls(client.ApiClient(), ns)

    def consumer_key(self, namespace: str, pool: str) -> ConsumerKey:
        """The pool's consumer root (from the consumer-keys Secret) and its ``keySpace``.

        :class:`Refused`: ``FAILED_PRECONDITION`` when the pool does not exist, ``UNAVAILABLE`` when
        the Secret, its entry for the pool or the API cannot give the root (the kubelet retries).
        """
        from kubernetes.client import CoreV1Api
        from kubernetes.client.exceptions import ApiException

        body = self._pool(namespace, pool)
        if body is None:
            raise Refused(
                Code.FAILED_PRECONDITION, f"no KVCachePool {namespace}/{pool} (volumeAttributes.pool)"
            )
        try:
            secret = CoreV1Api(self.api_client).read_namespaced_secret(
                CONSUMER_KEYS_SECRET, self.namespace, _request_timeout=self.timeout
            )
        except ApiException as exc:
            if exc.status != 404:
                raise Refused(
                    Code.UNAVAILABLE, f"cannot read Secret {self.namespace}/{CONSUMER_KEYS_SECRET}: {exc}"
                ) from exc
            data = None
        except Exception as exc:
            raise Refused(
                Code.UNAVAILABLE, f"cannot read Secret {self.namespace}/{CONSUMER_KEYS_SECRET}: {exc}"
            ) from exc
        else:
            data = {str(k): str(v) for k, v in (secret.data or {}).items()}
        return ConsumerKey(consumer_root_from_secret(data, namespace, pool), pool_shares_keys(body))

    def pool_exists(self, namespace: str, pool: str) -> bool:
        """Whether the KVCachePool exists (the plugin then may create its run directory)."""
        return self._pool(namespace, pool) is not None

    def _pool(self, namespace: str, pool: str) -> dict[str, Any] | None:
        from kubernetes.client import CustomObjectsApi
        from kubernetes.client.exceptions import ApiException

        try:
            found = CustomObjectsApi(self.api_client).get_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, pool, _request_timeout=self.timeout
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise Refused(Code.UNAVAILABLE, f"cannot read KVCachePool {namespace}/{pool}: {exc}") from exc
        except Exception as exc:  # the kubelet retries NodePublishVolume: say so, do not guess
            raise Refused(Code.UNAVAILABLE, f"cannot read KVCachePool {namespace}/{pool}: {exc}") from exc
        return cast(dict[str, Any], found)

    def __call__(self, p: Publication) -> str | None:
        """Why the pod's namespace may not consume the pool, or None when it may."""
        from kubernetes.client import CoreV1Api

        pool = self._pool(p.namespace, p.pool)
        try:
            ns = CoreV1Api(self.api_client).read_namespace(p.pod_namespace, _request_timeout=self.timeout)
        except Exception as exc:
            raise Refused(Code.UNAVAILABLE, f"cannot read namespace {p.pod_namespace}: {exc}") from exc
        labels = dict((ns.metadata.labels if ns.metadata else None) or {})
        return cross_namespace_refusal(pool, p.pod_namespace, labels)
