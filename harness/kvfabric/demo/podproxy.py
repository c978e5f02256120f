"""Pods' HTTP endpoints on the host's loopback, for a Prometheus that runs on the host.

A Prometheus in a cluster scrapes each pod at its IP. The pod runner's pods listen inside network
namespaces of their own, which a process on the host cannot reach; :class:`PodProxy` answers
``GET /<pod uid>/<port><path>`` on 127.0.0.1 by asking the pod (:meth:`Fabric.request`, as
``kubectl port-forward`` would). A scrape target is then the proxy's address with the pod in its
``__metrics_path__`` (:meth:`PodProxy.target`), labelled as a PodMonitor would label it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kvfabric.demo.fabric import Fabric
from kvfabric.testing.prometheus import Target

# What prometheus_client serves: Prometheus refuses a scrape without a content type it knows.
_TEXT_FORMAT = "text/plain; version=0.0.4; charset=utf-8"


class PodProxy:
    """An HTTP server on 127.0.0.1 that forwards ``GET /<pod uid>/<port><path>`` to that pod."""

    def __init__(self, fabric: Fabric) -> None:
        self.fabric = fabric
        self._pods: dict[str, dict[str, Any]] = {}
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                _, uid, port, *rest = self.path.split("/", 3)
                pod = proxy._pods.get(uid)
                if pod is None or not port.isdigit():
                    self.send_error(404, f"no pod {uid} registered with the proxy")
                    return
                status, body = proxy.fabric.request(pod, int(port), "/" + "".join(rest), timeout=10)
                data = body.encode()
                self.send_response(status if status else 502)
                self.send_header("Content-Type", _TEXT_FORMAT)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # one line per scrape is noise

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="pod-proxy", daemon=True)
        self._thread.start()

    def target(
        self, pod: dict[str, Any], port: int, labels: Mapping[str, str], path: str = "/metrics"
    ) -> Target:
        """A scrape target for ``pod``'s ``port`` with ``labels`` (``job``, ``namespace``, ``pod``...)."""
        uid = pod["metadata"]["uid"]
        self._pods[uid] = pod
        # Every target has the proxy's address: name each by its pod, as its own address would.
        instance = f"{pod['metadata']['name']}:{port}"
        return Target(
            self.address, {"instance": instance, **labels, "__metrics_path__": f"/{uid}/{port}{path}"}
        )

    def close(self) -> None:
        """Stop serving."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)


@contextlib.contextmanager
def pod_proxy(fabric: Fabric) -> Iterator[PodProxy]:
    """A :class:`PodProxy` for ``fabric``'s pods, closed on exit."""
    proxy = PodProxy(fabric)
    try:
        yield proxy
    finally:
        proxy.close()
