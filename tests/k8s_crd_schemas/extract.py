"""Turn a CustomResourceDefinition into the JSON schema tests/test_helm.py validates its objects with.

Usage: ``python extract.py CRD.yaml VERSION OUT.json``. Keeps ``spec.versions[VERSION].schema.
openAPIV3Schema`` without descriptions or ``status``, and marks every object schema that lists
``properties`` (and does not preserve unknown fields) ``additionalProperties: false``, as the API
server's strict field validation refuses unknown fields. CEL rules (``x-kubernetes-validations``)
are kept but not evaluated offline.

Sources of the two files here (both Apache-2.0):
- servicemonitor-monitoring-v1.json: prometheus-operator v0.93.0,
  example/prometheus-operator-crd/monitoring.coreos.com_servicemonitors.yaml, version v1;
- httproute-gateway-v1.json: kubernetes-sigs/gateway-api v1.6.1 (standard channel),
  config/crd/standard/gateway.networking.k8s.io_httproutes.yaml, version v1.
"""

import json
import sys

import yaml


def _strict(node):
    if isinstance(node, dict):
        node.pop("description", None)
        for v in node.values():
            _strict(v)
        if (
            "properties" in node
            and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")
        ):
            node["additionalProperties"] = False
    elif isinstance(node, list):
        for v in node:
            _strict(v)
    return node


def main(src: str, version: str, out: str) -> None:
    with open(src, encoding="utf-8") as f:
        crd = yaml.safe_load(f)
    (entry,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema = entry["schema"]["openAPIV3Schema"]
    schema["properties"].pop("status", None)
    schema["properties"]["metadata"] = {"type": "object"}
    _strict(schema)
    with open(out, "w", encoding="utf-8") as f:
        json.dump(schema, f, sort_keys=True, separators=(",", ":"))
        f.write("\n")


if __name__ == "__main__":
    main(*sys.argv[1:4])
