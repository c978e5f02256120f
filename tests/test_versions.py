"""Every place that names kvfabric's version names the same one.

A chart or manifest whose default image tag differs from the code's version starts an operator of
another release (flags the chart passes may not exist there), and images built by the harness are
tagged with the code's version.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from kvfabric.cli.version import __version__
from kvfabric.operator.render.names import DEFAULT_OPERATOR_IMAGE

ROOT = Path(__file__).resolve().parents[1]


def test_the_chart_installs_this_release() -> None:
    chart = yaml.safe_load((ROOT / "charts/kvfabric/Chart.yaml").read_text())
    assert chart["version"] == __version__
    assert chart["appVersion"] == f"v{__version__}"


def test_the_manifests_and_the_operator_default_name_this_releases_images() -> None:
    assert DEFAULT_OPERATOR_IMAGE.endswith(f":v{__version__}")
    for path in ("manifests/operator/deployment.yaml", "manifests/csi/daemonset.yaml"):
        tags = set(re.findall(r"ghcr\.io/kvfabric/[a-z]+:(v[0-9][^\s\"']*)", (ROOT / path).read_text()))
        assert tags == {f"v{__version__}"}, path


def test_the_dockerfiles_default_to_this_release() -> None:
    for dockerfile in sorted((ROOT / "images").glob("*/Dockerfile")):
        assert f"ARG KVFABRIC_VERSION={__version__}" in dockerfile.read_text(), dockerfile
