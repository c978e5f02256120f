"""Command lines of the control-plane processes: pure functions of paths and ports."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvfabric.localcluster.pki import Pki

SERVICE_CIDR = "10.96.0.0/16"
SERVICE_IP = "10.96.0.1"  # first address of SERVICE_CIDR; in the API server's certificate
POD_CIDR = "10.244.0.0/16"


@dataclass(frozen=True)
class Ports:
    """Loopback ports of one cluster, chosen free at ``up`` time and kept in its state file."""

    etcd_client: int
    etcd_peer: int
    apiserver: int
    controller_manager: int
    scheduler: int
    kwok: int


@dataclass(frozen=True)
class Component:
    """One process: its name (also its log file's name) and full argv."""

    name: str
    argv: list[str]


def commands(
    bin_dir: Path,
    state_dir: Path,
    ports: Ports,
    pki: Pki,
    kubeconfig: Path,
    *,
    endpoint_routing: bool = False,
    service_account_tokens: bool = False,
) -> list[Component]:
    """The control plane's processes in start order.

    ``endpoint_routing`` (real kubelets): webhooks and aggregated APIs behind a Service are reached
    at the Service's endpoints (``--enable-aggregator-routing``): there is no kube-proxy, so a
    ClusterIP leads nowhere, while a node's address is routed to its network namespace
    (:mod:`kvfabric.localcluster.realnodes`).

    ``service_account_tokens`` (real kubelets and no fake node): the ``ServiceAccount`` admission
    plugin adds the projected token volume to pods, so ``automountServiceAccountToken: false``
    means something. Off otherwise: kwok's pods have no consumer for a token, and the pod runner
    that executes them has no projected volumes.
    """
    etcd_url = f"http://127.0.0.1:{ports.etcd_client}"
    peer_url = f"http://127.0.0.1:{ports.etcd_peer}"
    probe_paths = "--authorization-always-allow-paths=/healthz,/readyz,/livez,/metrics"
    return [
        Component(
            "etcd",
            [
                str(bin_dir / "etcd"),
                "--name=node0",
                f"--data-dir={state_dir / 'etcd'}",
                "--unsafe-no-fsync=true",  # a throw-away test store: durability buys nothing here
                f"--listen-client-urls={etcd_url}",
                f"--advertise-client-urls={etcd_url}",
                f"--listen-peer-urls={peer_url}",
                f"--initial-advertise-peer-urls={peer_url}",
                f"--initial-cluster=node0={peer_url}",
                "--listen-metrics-urls=",
                "--quota-backend-bytes=4294967296",
                "--auto-compaction-retention=1",
            ],
        ),
        Component(
            "kube-apiserver",
            [
                str(bin_dir / "kube-apiserver"),
                f"--etcd-servers={etcd_url}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={ports.apiserver}",
                f"--tls-cert-file={pki.apiserver_crt}",
                f"--tls-private-key-file={pki.apiserver_key}",
                f"--client-ca-file={pki.ca_crt}",
                "--authorization-mode=Node,RBAC",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={pki.sa_pub}",
                f"--service-account-signing-key-file={pki.sa_key}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--allow-privileged=true",
                # No kube-proxy: the endpoint reconciler has no consumer; without a kubelet, token
                # volumes have none either.
                "--endpoint-reconciler-type=none",
                *(["--enable-aggregator-routing=true"] if endpoint_routing else []),
                *([] if service_account_tokens else ["--disable-admission-plugins=ServiceAccount"]),
                # One developer's cluster: rate limits only slow the tests down.
                "--max-requests-inflight=0",
                "--max-mutating-requests-inflight=0",
                "--enable-priority-and-fairness=false",
                "--profiling=false",
            ],
        ),
        Component(
            "kube-controller-manager",
            [
                str(bin_dir / "kube-controller-manager"),
                f"--kubeconfig={kubeconfig}",
                f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}",
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
                f"--secure-port={ports.controller_manager}",
                probe_paths,
                f"--root-ca-file={pki.ca_crt}",
                f"--service-account-private-key-file={pki.sa_key}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--controllers=*",
                "--kube-api-qps=500",
                "--kube-api-burst=1000",
                "--concurrent-gc-syncs=20",
                "--profiling=false",
            ],
        ),
        Component(
            "kube-scheduler",
            [
                str(bin_dir / "kube-scheduler"),
                f"--kubeconfig={kubeconfig}",
                f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}",
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
                f"--secure-port={ports.scheduler}",
                probe_paths,
                "--kube-api-qps=500",
                "--kube-api-burst=1000",
                "--profiling=false",
            ],
        ),
        Component(
            "kwok",
            [
                str(bin_dir / "kwok"),
                f"--kubeconfig={kubeconfig}",
                f"--config={state_dir / 'kwok.yaml'}",
                "--manage-all-nodes=false",
                "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
                f"--cidr={POD_CIDR.replace('/16', '/24')}",
                "--node-ip=10.244.0.1",
                "--node-lease-duration-seconds=40",
                f"--server-address=127.0.0.1:{ports.kwok}",
            ],
        ),
    ]


KWOK_CONFIG = """\
apiVersion: config.kwok.x-k8s.io/v1alpha1
kind: KwokConfiguration
options:
  podPlayStageParallelism: 8
  nodePlayStageParallelism: 4
  nodeLeaseParallelism: 4
  nodeLeaseDurationSeconds: 40
  podsOnNodeSyncParallelism: 4
"""
