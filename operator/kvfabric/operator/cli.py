"""``kvfabric operator``: run the KVCachePool operator (reconciler + injection webhook) as a process.

Imports only the standard library at import time (see :mod:`kvfabric.cli.main`); kopf and the
Kubernetes client load when the command runs.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
from pathlib import Path
from typing import Any


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the operator's options to ``parser``."""
    parser.add_argument("--kubeconfig", default=os.environ.get("KUBECONFIG"), help="kubeconfig file")
    parser.add_argument("--context", default=None, help="kubeconfig context")
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument(
        "-n",
        "--namespace",
        action="append",
        default=[],
        help="watch only this namespace (repeatable)",
    )
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace (default)")
    parser.add_argument(
        "--peering",
        default=None,
        metavar="NAME",
        help="join kopf peering NAME instead of running standalone (needs kopf's peering CRD)",
    )
    parser.add_argument("--resync-seconds", type=float, default=30.0, help="periodic full resync interval")
    ha = parser.add_argument_group("high availability")
    ha.add_argument(
        "--leader-election",
        action="store_true",
        help="run as one of several replicas: only the holder of a coordination.k8s.io Lease reconciles, "
        "every replica serves the webhook",
    )
    ha.add_argument(
        "--leader-election-namespace",
        default=os.environ.get("POD_NAMESPACE", "kvfabric-system"),
        help="namespace of the Lease (default: $POD_NAMESPACE or kvfabric-system)",
    )
    ha.add_argument("--leader-election-id", default="kvfabric-operator", help="name of the Lease")
    ha.add_argument(
        "--identity",
        default=None,
        help="this replica's name in the Lease and its kopf peering identity, unique per replica "
        "(default: $POD_NAME or the hostname, the process id and a random suffix)",
    )
    parser.add_argument(
        "--liveness",
        default=None,
        metavar="URL",
        help="serve liveness/readiness, e.g. http://0.0.0.0:8080/healthz",
    )
    hook = parser.add_argument_group("injection webhook")
    hook.add_argument("--no-webhook", action="store_true", help="do not serve the injection webhook")
    hook.add_argument("--webhook-addr", default="127.0.0.1", help="address the webhook server listens on")
    hook.add_argument("--webhook-port", type=int, default=9443, help="webhook port")
    hook.add_argument("--webhook-cert", type=Path, default=None, help="serving certificate (PEM)")
    hook.add_argument("--webhook-key", type=Path, default=None, help="serving key (PEM)")
    hook.add_argument("--webhook-ca", type=Path, default=None, help="CA of the serving certificate (PEM)")
    hook.add_argument(
        "--webhook-cert-validity-seconds",
        type=float,
        default=30 * 86400,
        help="validity of the self-generated serving certificate; it is re-issued and reloaded in place "
        "when a third is left (default 30 days)",
    )
    hook.add_argument(
        "--webhook-cert-dir",
        type=Path,
        default=None,
        help="where to write a self-signed CA + certificate when --webhook-cert is not given",
    )
    hook.add_argument(
        "--register-webhook",
        action="store_true",
        help="apply a MutatingWebhookConfiguration pointing at https://<webhook-host>:<port>/mutate-pods "
        "(for local clusters without kube-proxy)",
    )
    hook.add_argument(
        "--webhook-service",
        default=None,
        metavar="NAMESPACE/NAME",
        help="with --register-webhook: point the configuration at this Service (port 443) instead of a URL",
    )
    hook.add_argument(
        "--webhook-host", default=None, help="host in the registered URL (default: --webhook-addr)"
    )
    hook.add_argument(
        "--webhook-config-name", default="kvfabric-pod-injector", help="name of the configuration"
    )
    hook.add_argument(
        "--csi-driver",
        default=os.environ.get("KVFABRIC_CSI_DRIVER") or None,
        metavar="NAME",
        help="the CSI node plugin is installed under this driver name (manifests/csi: csi.kvfabric.io): "
        "consumers in a pool's namespace get the node socket as a CSI inline volume, which Pod Security "
        "baseline and restricted admit, instead of a hostPath (default: $KVFABRIC_CSI_DRIVER)",
    )
    parser.add_argument(
        "--metrics-addr",
        default=None,
        metavar="HOST:PORT",
        help="serve the operator's Prometheus metrics (what the injection webhook did with each pod) at "
        "http://HOST:PORT/metrics, e.g. 0.0.0.0:8081 (default: not served)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def run(args: argparse.Namespace) -> int:
    """Run the operator until interrupted; return the exit code."""
    import sys

    import kopf

    from kvfabric.operator import handlers, webhookconfig
    from kvfabric.operator.admission import PodWebhookServer
    from kvfabric.operator.kube import KubeClient
    from kvfabric.operator.servingcert import ServingCertificate

    # The webhook's thread asks for the GIL whenever a review arrives; while the controller thread
    # runs Python code it gets it only after this interval (5 ms by default, per hand-over). With a
    # thread busy beside it, 1 ms cut an event loop's median wake-up lag from 7-11 ms to 1-4 ms.
    sys.setswitchinterval(0.001)
    kopf.configure(verbose=args.verbose, log_format=kopf.LogFormat.PLAIN)
    if not args.verbose:
        # kopf logs every handler invocation at INFO; at hundreds of child events per second that is
        # noise that costs CPU the reconciler needs. Failures are still logged (WARNING and up).
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
        logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    namespaces: list[str] = list(args.namespace)
    client = KubeClient.from_environment(args.kubeconfig, args.context)
    server = None
    serving = None
    registration = None
    if not args.no_webhook:
        cert, key, ca = args.webhook_cert, args.webhook_key, args.webhook_ca
        host = args.webhook_host or args.webhook_addr
        directory = args.webhook_cert_dir or Path(tempfile.mkdtemp(prefix="kvfabric-webhook-"))
        # Rotated (self-managed) or re-read (cert-manager files) in place: see servingcert.
        if cert is None or key is None:
            serving = ServingCertificate(
                directory,
                hosts=sorted({host, "localhost", "127.0.0.1"}),
                validity_seconds=args.webhook_cert_validity_seconds,
            )
            ca = serving.ca_file
        else:
            serving = ServingCertificate(directory, cert_file=cert, key_file=key, ca_file=ca)
        server = PodWebhookServer(
            webhook_id=handlers.WEBHOOK_ID,
            addr=args.webhook_addr,
            port=args.webhook_port,
            host=host,
            context=serving.context,
            certfile=str(serving.kopf_cert),
            pkeyfile=str(serving.kopf_key),
            cafile=str(ca) if ca else None,
        )
        if args.register_webhook:
            if ca is None:
                raise SystemExit("--register-webhook needs --webhook-ca (or a generated certificate)")
            ca_bundle = Path(ca).read_bytes()
            if args.webhook_service:
                svc_ns, _, svc_name = str(args.webhook_service).partition("/")
                target: dict[str, Any] = {
                    "service": {
                        "namespace": svc_ns,
                        "name": svc_name,
                        "path": f"/{handlers.WEBHOOK_ID}",
                        "port": 443,
                    },
                    "excluded_namespaces": [svc_ns],
                }
            else:
                target = {"url": f"https://{host}:{args.webhook_port}/{handlers.WEBHOOK_ID}"}

            def render(required: list[str]) -> dict[str, Any]:
                return webhookconfig.render_webhook_configuration(
                    name=args.webhook_config_name, ca_bundle=ca_bundle, required_pools=required, **target
                )

            registration = handlers.WebhookRegistration(render=render, namespaces=namespaces or None)
    import socket
    import uuid

    # Ours, for the Lease and for kopf: left to itself kopf derives one from getpass.getuser(),
    # which raises KeyError in a container whose uid has no /etc/passwd entry.
    identity = args.identity or (
        f"{os.environ.get('POD_NAME') or socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"
    )
    election = None
    if args.leader_election:
        from kvfabric.operator.controller import Election

        election = Election(
            namespace=args.leader_election_namespace, name=args.leader_election_id, identity=identity
        )
    app = handlers.OperatorApp(
        client=client,
        namespaces=namespaces or None,
        election=election,
        injection_enabled=server is not None,
        kubeconfig=args.kubeconfig,
        context=args.context,
        resync_seconds=args.resync_seconds,
        registration=registration,
        serving=serving,
        csi_driver=args.csi_driver,
        freeze_gc=True,
    )
    if server is not None:
        server.admit = app.admit
    # `kvfabric bench operator` asks for the heap walk; a production probe never pays for it.
    app.gc_pauses.count_tracked = os.environ.get("KVFABRIC_OPERATOR_COUNT_GC_OBJECTS") == "1"
    if args.metrics_addr:
        from kvfabric.operator import opmetrics

        try:
            opmetrics.serve(app.webhook_pods, args.metrics_addr)
        except (ValueError, OSError) as exc:
            raise SystemExit(f"kvfabric operator: {exc}") from None
    registry = handlers.build_registry(app, webhook_server=server, namespaces=namespaces or None)
    kopf.run(
        registry=registry,
        standalone=args.peering is None,
        peering_name=args.peering,
        clusterwide=not namespaces,
        namespaces=namespaces,
        liveness_endpoint=args.liveness,
        # kopf types it as its own NewType of str, which it does not export.
        identity=identity,  # type: ignore[arg-type]
    )
    return 0
