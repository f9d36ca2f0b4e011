"""The gateway's metric families are one declarative table (gateway.ops.metrics.FAMILIES): every
entry becomes the attribute the class declares for it, of the declared kind, under its own name."""

from __future__ import annotations

import typing

from prometheus_client import Counter, Gauge, Histogram

from gateway.ops.metrics import FAMILIES, GatewayMetrics


def test_every_family_is_the_declared_attribute_of_its_kind():
    declared = {k: v for k, v in typing.get_type_hints(GatewayMetrics).items() if v in (Counter, Gauge, Histogram)}
    assert {f.attr: f.kind for f in FAMILIES} == declared
    metrics = GatewayMetrics()
    for f in FAMILIES:
        metric = getattr(metrics, f.attr)
        assert type(metric) is f.kind
        assert metric._name == f.name and metric._documentation == f.help
        assert metric._labelnames == f.labels


def test_names_are_unique_and_prefixed():
    names = [f.name for f in FAMILIES]
    assert len(set(names)) == len(names) and all(n.startswith("kvgate_") for n in names)
