"""constraints.txt, the lock every install of this repository uses (scripts/bootstrap.sh, docker/*),
against pyproject.toml: every direct dependency of the package and its extras is pinned, to a
version its range admits (a range raised without a new lock would make pip fail with
ResolutionImpossible on a fresh machine); torch is never pinned (scripts/torch_choice.sh picks its
build) and neither is kvgate itself."""

from __future__ import annotations

import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent


def _pins() -> dict[str, Version]:
    pins: dict[str, Version] = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, version = line.partition("==")
        assert sep, f"not an exact pin: {line!r}"
        pins[canonicalize_name(name)] = Version(version)
    return pins


def _requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    return [Requirement(r) for r in [*project["dependencies"], *(r for group in extras.values() for r in group)]]


def test_every_direct_dependency_is_pinned_within_its_range():
    pins = _pins()
    outside = []
    for req in _requirements():
        name = canonicalize_name(req.name)
        if name == "torch":
            continue
        assert name in pins, f"{req} has no pin in constraints.txt: run scripts/lock.sh"
        if not req.specifier.contains(pins[name], prereleases=True):
            outside.append(f"{req} but constraints.txt pins {pins[name]}")
    assert outside == [], "run scripts/lock.sh: " + "; ".join(outside)


def test_neither_torch_nor_kvgate_is_pinned():
    pins = _pins()
    assert "torch" not in pins
    assert "kvgate" not in pins
    assert len(pins) >= len({canonicalize_name(r.name) for r in _requirements()}) - 1
