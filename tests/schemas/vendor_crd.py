"""Vendor a CRD's ``openAPIV3Schema`` as a strict JSON schema for offline validation.

    python tests/schemas/vendor_crd.py CRD.yaml OUT.json --source URL --commit SHA

What changes from the CRD: every object schema that lists ``properties`` gets
``additionalProperties: false`` (unless it preserves unknown fields), so a
misspelt or misplaced key fails like the API server's strict field validation
would reject it; descriptions are dropped (they are most of the size). The
source URL and commit go into ``$comment``. CEL rules
(``x-kubernetes-validations``) stay in the file but jsonschema does not run them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import yaml


def strict(node: Any) -> Any:
    """``node`` without descriptions, with closed objects."""
    if isinstance(node, list):
        return [strict(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: strict(value) for key, value in node.items() if key != "description"}
    if "properties" in node:
        # "properties" of a schema maps field names to schemas: keep names named "description".
        out["properties"] = {k: strict(v) for k, v in node["properties"].items()}
        if not node.get("x-kubernetes-preserve-unknown-fields"):
            out.setdefault("additionalProperties", False)
    return out


def vendor(crd: dict[str, Any], *, version: str, source: str, commit: str) -> dict[str, Any]:
    (entry,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema = strict(entry["schema"]["openAPIV3Schema"])
    kind = crd["spec"]["names"]["kind"]
    return {
        "$comment": f"{crd['spec']['group']}/{version} {kind}: the openAPIV3Schema of {source} "
        f"at commit {commit}, made strict by tests/schemas/vendor_crd.py",
        **schema,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("crd", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--version", default="v1alpha1")
    parser.add_argument("--source", required=True, help="the CRD file's URL")
    parser.add_argument("--commit", required=True)
    args = parser.parse_args()
    crd = yaml.safe_load(args.crd.read_text())
    schema = vendor(crd, version=args.version, source=args.source, commit=args.commit)
    args.out.write_text(json.dumps(schema, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
