"""The pydantic API is the single source of truth: the committed CRD matches it and is structural."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from kvfabric.operator import crdgen
from kvfabric.operator.api.v1alpha1 import KVCachePool

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "manifests" / "samples" / "kvfabric.io_v1alpha1_kvcachepool.yaml"


def test_committed_crd_matches_the_models() -> None:
    committed = (ROOT / crdgen.CRD_FILE).read_text()
    assert committed == crdgen.render_yaml(), "crds/ drifted: run `uv run python -m kvfabric.operator.crdgen`"


def test_crdgen_check_mode(tmp_path: Path) -> None:
    out = tmp_path / "crd.yaml"
    assert crdgen.main(["--output", str(out)]) == 0
    assert crdgen.main(["--output", str(out), "--check"]) == 0
    out.write_text(out.read_text() + "# edited\n")
    assert crdgen.main(["--output", str(out), "--check"]) == 1


def _walk(node: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = []
    if isinstance(node, dict):
        out.append((path, node))
        for key, value in node.get("properties", {}).items():
            out += _walk(value, f"{path}.{key}")
        if isinstance(node.get("items"), dict):
            out += _walk(node["items"], f"{path}[]")
        if isinstance(node.get("additionalProperties"), dict):
            out += _walk(node["additionalProperties"], f"{path}{{}}")
    return out


def test_schema_is_structural_and_cel_costable() -> None:
    schema = crdgen.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in _walk(schema["properties"]["spec"], "spec"):
        for banned in ("$ref", "$defs", "title", "anyOf", "oneOf", "allOf", "const", "exclusiveMinimum"):
            assert banned not in node, f"{path} has {banned}"
        assert node.get("additionalProperties") is not False, path
        assert "type" in node or node.get("x-kubernetes-int-or-string"), f"{path} has no type"
        # Unbounded strings/lists make the API server's CEL cost estimate reject the CRD.
        if node.get("type") == "string" and "enum" not in node:
            assert "maxLength" in node, f"{path} needs maxLength"
        if node.get("type") == "array":
            assert "maxItems" in node, f"{path} needs maxItems"


def test_crd_names_columns_and_status_subresource() -> None:
    crd = crdgen.build_crd()
    assert crd["spec"]["names"]["shortNames"] == ["kvp"]
    version = crd["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    for name in ("Ready", "Nodes", "Consumers", "Age"):
        assert name in columns
    conditions = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map"
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]


def test_defaults_select_gpu_nodes() -> None:
    spec = crdgen.spec_schema()
    placement = spec["properties"]["placement"]
    assert placement["default"] == {}
    assert placement["properties"]["nodeSelector"]["default"] == {"nvidia.com/gpu.present": "true"}
    assert placement["properties"]["tolerations"]["default"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]


def test_every_sample_parses() -> None:
    for path in sorted((ROOT / "manifests" / "samples").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "KVCachePool":
                pool = KVCachePool.model_validate(doc)
                assert pool.spec.image.tag != "latest"


def test_model_rejects_unknown_fields_and_bad_quantities() -> None:
    doc = yaml.safe_load(SAMPLE.read_text())
    doc["spec"]["tiers"]["memory"]["sizee"] = "1Gi"
    with pytest.raises(ValidationError):
        KVCachePool.model_validate(doc)
    doc = yaml.safe_load(SAMPLE.read_text())
    doc["spec"]["tiers"]["memory"]["size"] = "lots"
    with pytest.raises(ValidationError):
        KVCachePool.model_validate(doc)
