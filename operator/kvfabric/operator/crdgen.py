"""Generate the KVCachePool CustomResourceDefinition from the pydantic models.

``python -m kvfabric.operator.crdgen`` writes ``crds/kvfabric.io_kvcachepools.yaml``;
``python -m kvfabric.operator.crdgen --check`` exits 1 when the committed file is stale.

pydantic emits JSON Schema 2020-12; Kubernetes wants a *structural* OpenAPI v3 schema. The rewrite
(cf. kube-rs' StructuralSchemaRewriter) inlines ``$ref``, drops ``title``, turns ``anyOf [X, null]`` into
``X`` (optional fields are simply omitted, never null), drops ``additionalProperties: false`` (the API
server rejects it next to ``properties``; pruning already closes objects) Nested objects default to
``{}`` (declared on the field) so the API server fills in each field's own default.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any, Final

import yaml

from kvfabric.operator.api import v1alpha1

CRD_FILE: Final = Path("crds") / f"{v1alpha1.GROUP}_{v1alpha1.PLURAL}.yaml"
_DROP_KEYS: Final = {"title"}


def _resolve(node: Any, defs: dict[str, Any]) -> Any:
    """Inline ``$ref``s and rewrite one JSON-schema node into its structural form."""
    if isinstance(node, list):
        return [_resolve(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    node = dict(node)
    if "$ref" in node:
        target = defs[node.pop("$ref").split("/")[-1]]
        merged = copy.deepcopy(target)
        merged.update(node)  # sibling keys (description, default) win over the referenced model's
        node = merged
    if "anyOf" in node:
        if node.get("x-kubernetes-int-or-string"):
            # int | str: the marker alone is the canonical structural form.
            del node["anyOf"]
        else:
            variants = [v for v in node["anyOf"] if v != {"type": "null"}]
            if len(variants) == 1:
                del node["anyOf"]
                inner = variants[0]
                if "$ref" in inner:
                    inner = defs[inner["$ref"].split("/")[-1]]
                merged = copy.deepcopy(inner)
                # The optional wrapper's own keys (description, validations) apply to the value.
                for key, value in node.items():
                    if key == "x-kubernetes-validations" and key in merged:
                        merged[key] = merged[key] + value
                    else:
                        merged[key] = value
                node = merged
    for key in _DROP_KEYS:
        node.pop(key, None)
    if node.get("default", 0) is None:
        del node["default"]
    if node.get("additionalProperties") is False:
        del node["additionalProperties"]
    if "const" in node:
        node["enum"] = [node.pop("const")]
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "properties":
            out[key] = {name: _resolve(sub, defs) for name, sub in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            out[key] = _resolve(value, defs)
        else:
            out[key] = value
    return out


def spec_schema() -> dict[str, Any]:
    """Return the structural OpenAPI v3 schema of ``spec``."""
    raw = v1alpha1.KVCachePoolSpec.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    return dict(_resolve(raw, defs))


def status_schema() -> dict[str, Any]:
    """Return the structural OpenAPI v3 schema of ``status``."""
    raw = v1alpha1.KVCachePoolStatus.model_json_schema(by_alias=True, mode="serialization")
    defs = raw.pop("$defs", {})
    return dict(_resolve(raw, defs))


def build_crd() -> dict[str, Any]:
    """Return the complete CustomResourceDefinition object."""
    spec = spec_schema()
    spec["description"] = "Desired state of the pool."
    status = status_schema()
    status["description"] = "Observed state of the pool, written by the operator."
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{v1alpha1.PLURAL}.{v1alpha1.GROUP}",
            "labels": {"app.kubernetes.io/part-of": "kvfabric"},
        },
        "spec": {
            "group": v1alpha1.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": v1alpha1.KIND,
                "listKind": f"{v1alpha1.KIND}List",
                "plural": v1alpha1.PLURAL,
                "singular": v1alpha1.SINGULAR,
                "shortNames": list(v1alpha1.SHORT_NAMES),
                "categories": ["kvfabric"],
            },
            "versions": [
                {
                    "name": v1alpha1.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": copy.deepcopy(v1alpha1.PRINTER_COLUMNS),
                    "schema": {
                        "openAPIV3Schema": {
                            "description": v1alpha1.KVCachePool.__doc__,
                            "type": "object",
                            "required": ["spec"],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec,
                                "status": status,
                            },
                            "x-kubernetes-validations": copy.deepcopy(v1alpha1.ROOT_VALIDATIONS),
                        }
                    },
                }
            ],
        },
    }


def render_yaml() -> str:
    """Return the CRD as the YAML text committed under ``crds/``."""
    header = (
        "# GENERATED by `python -m kvfabric.operator.crdgen` from kvfabric.operator.api.v1alpha1. "
        "DO NOT EDIT.\n"
    )
    return header + yaml.safe_dump(build_crd(), sort_keys=False, width=100)


def main(argv: list[str] | None = None) -> int:
    """Write (or with ``--check`` verify) the generated CRD file."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--output", type=Path, default=CRD_FILE, help="where to write the CRD")
    parser.add_argument("--check", action="store_true", help="exit 1 if the file differs")
    args = parser.parse_args(argv)
    text = render_yaml()
    path: Path = args.output
    if args.check:
        current = path.read_text() if path.exists() else ""
        if current != text:
            print(f"{path} is stale: run python -m kvfabric.operator.crdgen", file=sys.stderr)
            return 1
        return 0
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
