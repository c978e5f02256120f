"""Kubernetes label-selector semantics on the API's own JSON form: one definition for every side.

The operator's webhook decides which namespaces may consume a pool by the pool's
``spec.consumers.namespaceSelector``; the CSI node plugin checks the same selector again before it
publishes a pool's socket into a pod of another namespace (the pod's author chooses the volume's
attributes, so the plugin cannot trust the webhook to have looked). Both call this function, so
they cannot disagree. Import-linter keeps this module free of every other kvfabric module.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def label_selector_matches(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """Return whether ``labels`` satisfy ``selector`` (``matchLabels`` and ``matchExpressions``).

    An empty selector matches everything, as in Kubernetes; an operator this function does not know
    matches nothing (fail closed).
    """
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for req in selector.get("matchExpressions") or []:
        key = req.get("key")
        op = req.get("operator")
        values = req.get("values") or []
        present = key in labels
        if op == "In":
            ok = present and labels[key] in values
        elif op == "NotIn":
            ok = not present or labels[key] not in values
        elif op == "Exists":
            ok = present
        elif op == "DoesNotExist":
            ok = not present
        else:
            ok = False
        if not ok:
            return False
    return True
