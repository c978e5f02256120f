"""Merge the local cluster's context into the user's kubeconfig, as kind does."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml


def user_kubeconfig() -> Path:
    """The first file of ``$KUBECONFIG``, else ``~/.kube/config``: where kubectl looks."""
    env = os.environ.get("KUBECONFIG", "")
    first = env.split(os.pathsep)[0] if env else ""
    return Path(first) if first else Path.home() / ".kube" / "config"


def merged(existing: dict[str, Any] | None, ours: dict[str, Any], *, make_current: bool) -> dict[str, Any]:
    """``existing`` with every cluster, user and context of ``ours`` added or replaced by name."""
    result: dict[str, Any] = dict(existing or {"apiVersion": "v1", "kind": "Config", "preferences": {}})
    for section in ("clusters", "users", "contexts"):
        names = {item["name"] for item in ours.get(section, [])}
        kept = [item for item in result.get(section) or [] if item.get("name") not in names]
        result[section] = kept + list(ours.get(section, []))
    if make_current or not result.get("current-context"):
        result["current-context"] = ours["current-context"]
    return result


def merge_into_user_config(ours_path: Path) -> Path:
    """Add the cluster at ``ours_path`` to the user's kubeconfig and make it the current context."""
    target = user_kubeconfig()
    ours = yaml.safe_load(ours_path.read_text())
    existing = yaml.safe_load(target.read_text()) if target.exists() else None
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".kvfabric.tmp")
    tmp.write_text(yaml.safe_dump(merged(existing, ours, make_current=True)))
    tmp.chmod(0o600)
    tmp.replace(target)
    return target
