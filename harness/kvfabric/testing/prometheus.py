"""A real Prometheus for tests: scrapes targets named in a file, evaluates rule files, answers queries.

>>> with prometheus_server(rule_files=[alerts]) as prom:          # doctest: +SKIP
...     prom.set_targets([Target("127.0.0.1:9090", {"node": "n1"})])
...     prom.query('up{job="kvfabric-cache"}')

Debian's ``prometheus`` binary (:func:`kvfabric.testing.opstools.prometheus_binaries`) on a free loopback
port, with its TSDB in a temporary directory, scraping and evaluating every second. Targets come from
a file-based service discovery file that :meth:`PrometheusServer.set_targets` rewrites, as a pod watch
would: a server that goes away (or a successor that appears) is a change of that file, not a restart.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvfabric.testing.opstools import prometheus_binaries
from kvfabric.testing.serverproc import free_port, wait_http_ok, wait_until

__all__ = [
    "GRAFANA_VARS",
    "PrometheusServer",
    "Target",
    "dashboard_queries",
    "grafana_expr",
    "has_data",
    "prometheus_server",
    "rules_without_delay",
]

GRAFANA_VARS = {"$namespace": ".*", "$pool": ".*", "$node": ".*", "$__rate_interval": "1m", "$__range": "5m"}
"""What Grafana substitutes in the dashboard's queries: every namespace, pool and node; a rate window of
a few scrapes."""


@dataclass(frozen=True)
class Target:
    """One scrape target: ``host:port`` and the labels service discovery would give it."""

    address: str
    labels: Mapping[str, str] = field(default_factory=dict)


class PrometheusServer:
    """One Prometheus process; see the module docstring."""

    def __init__(
        self, workdir: Path, *, job: str, rule_files: Sequence[Path] = (), interval: str = "1s"
    ) -> None:
        self.workdir = workdir
        self.job = job
        self.port = free_port()
        self.targets_file = workdir / "targets.json"
        self.log_path = workdir / "prometheus.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.set_targets([])
        config = {
            "global": {
                "scrape_interval": interval,
                "evaluation_interval": interval,
                "scrape_timeout": interval,
            },
            "rule_files": [str(p) for p in rule_files],
            "scrape_configs": [
                {
                    "job_name": job,
                    "file_sd_configs": [{"files": [str(self.targets_file)], "refresh_interval": interval}],
                }
            ],
        }
        self.config_path = workdir / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(config))

    @property
    def url(self) -> str:
        """The HTTP API's base URL."""
        return f"http://127.0.0.1:{self.port}"

    def set_targets(self, targets: Sequence[Target]) -> None:
        """Replace the scraped targets (atomically: Prometheus never reads a half-written file)."""
        groups = [{"targets": [t.address], "labels": dict(t.labels)} for t in targets]
        tmp = self.targets_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(groups))
        os.replace(tmp, self.targets_file)

    def start(self, timeout: float = 60.0) -> None:
        """Start Prometheus; returns once it answers ``/-/ready``."""
        prometheus, _ = prometheus_binaries()
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [
                    str(prometheus),
                    f"--config.file={self.config_path}",
                    f"--storage.tsdb.path={self.workdir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--storage.tsdb.retention.time=1h",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )

        wait_http_ok(f"{self.url}/-/ready", self.proc, self.logs, timeout, "prometheus")

    def logs(self) -> str:
        """Prometheus' own log."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def _get(self, path: str, params: Mapping[str, str]) -> Any:
        url = f"{self.url}{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as r:  # noqa: S310
                body = json.load(r)
        except urllib.error.HTTPError as exc:
            body = json.load(exc)
        if body.get("status") != "success":
            raise ValueError(f"{path} {dict(params)}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result (a list of series with their value); raises on a PromQL error."""
        data = self._get("/api/v1/query", {"query": expr})
        result: Any = data["result"]
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": result}]
        return list(result)

    def value(self, expr: str) -> float | None:
        """The single value of a query that returns one series (None when it returns none)."""
        got = self.query(expr)
        if not got:
            return None
        assert len(got) == 1, got
        return float(got[0]["value"][1])

    def firing(self) -> dict[str, list[dict[str, str]]]:
        """Alert name -> the label sets of its firing alerts."""
        out: dict[str, list[dict[str, str]]] = {}
        for alert in self._get("/api/v1/alerts", {})["alerts"]:
            if alert["state"] == "firing":
                out.setdefault(alert["labels"]["alertname"], []).append(alert["labels"])
        return out

    def is_firing(self, alert: str, **labels: str) -> bool:
        """Whether ``alert`` fires with (at least) ``labels``."""
        return any(all(got.get(k) == v for k, v in labels.items()) for got in self.firing().get(alert, []))

    def wait_firing(self, alert: str, timeout: float = 60.0, **labels: str) -> None:
        """Wait until ``alert`` fires with ``labels``."""
        wait_until(
            lambda: self.is_firing(alert, **labels), timeout, interval=0.5, what=f"{alert} {labels} to fire"
        )

    def targets_up(self) -> dict[str, str]:
        """Scrape address -> health ("up", "down", "unknown") of every active target."""
        data = self._get("/api/v1/targets", {"state": "active"})
        return {t["labels"]["instance"]: t["health"] for t in data["activeTargets"]}

    def stop(self) -> None:
        """Stop Prometheus (SIGTERM, then SIGKILL)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


@contextlib.contextmanager
def prometheus_server(
    *, job: str = "kvfabric-cache", rule_files: Sequence[Path] = (), interval: str = "1s"
) -> Iterator[PrometheusServer]:
    """A started :class:`PrometheusServer` in a temporary directory, stopped and removed on exit."""
    with tempfile.TemporaryDirectory(prefix="kvf-prom-") as tmp:
        prom = PrometheusServer(Path(tmp), job=job, rule_files=rule_files, interval=interval)
        try:
            prom.start()
            yield prom
        finally:
            prom.stop()


def rules_without_delay(rules: Path, dest: Path) -> Path:
    """``rules`` with every alert's ``for`` cut to 1 s, written to ``dest``.

    A test against a live Prometheus cannot wait the real durations; promtool unit tests check those.
    """
    doc = yaml.safe_load(rules.read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            if "for" in rule:
                rule["for"] = "1s"
    dest.write_text(yaml.safe_dump(doc))
    return dest


def dashboard_queries(dashboard: Path) -> list[tuple[str, str]]:
    """(panel title, query) of every query of every panel of a Grafana dashboard (JSON)."""
    dash = json.loads(dashboard.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] if p["type"] != "row" for t in p["targets"]]


def grafana_expr(expr: str) -> str:
    """A dashboard query as Grafana sends it (:data:`GRAFANA_VARS` substituted)."""
    for var, value in GRAFANA_VARS.items():
        expr = expr.replace(var, value)
    if "$" in expr:
        raise ValueError(f"a Grafana variable the tests do not know: {expr}")
    return expr


def has_data(series: list[dict[str, Any]]) -> bool:
    """Whether a query's result holds a number (NaN, from a ratio of empty rates, is none)."""
    return any(not math.isnan(float(s["value"][1])) for s in series)
