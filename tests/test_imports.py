"""Import hygiene (docs/design.md, Layout): dependencies point ``gateway -> verifier -> tokenizer ->
config``; ``gpu_backend`` imports only ``config`` and ``tokenizer``; the gateway never imports
``gpu_backend``; importing gateway, tokenizer or verifier never imports torch; nothing imports
``tests/`` or ``bench/``; and what the gateway's packages import is installed by the core
dependencies of pyproject.toml (the ``hf`` extra too for ``tokenizer``), so a gateway install
without the ``backend`` extra runs."""

from __future__ import annotations

import ast
import importlib.metadata as md
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from conftest import ROOT

PACKAGES = ("config", "tokenizer", "verifier", "gateway", "gpu_backend")
#: which top-level kvgate packages each package may import (itself included)
ALLOWED = {
    "config": {"config"},
    "tokenizer": {"tokenizer", "config"},
    "verifier": {"verifier", "tokenizer", "config"},
    "gateway": {"gateway", "verifier", "tokenizer", "config"},
    "gpu_backend": {"gpu_backend", "tokenizer", "config"},
}
#: never in the gateway's process, whatever pyproject.toml says
NEVER_IN_GATEWAY = {"torch", "triton", "transformers"}
NEVER_IMPORTED = {"tests", "bench", "conftest"}
#: extras (besides the core dependencies) a package may import from
EXTRAS_ALLOWED = {"tokenizer": ("hf",)}


def _dist(req: str) -> tuple[str, set[str]]:
    m = re.match(r"\s*([A-Za-z0-9._-]+)\s*(?:\[([^\]]*)\])?", req)
    assert m, req
    return m.group(1).lower().replace("_", "-"), {e.strip() for e in (m.group(2) or "").split(",") if e.strip()}


def installed_by(requirements: list[str]) -> set[str]:
    """Distribution names (normalised) that installing ``requirements`` brings, transitively
    (requirements behind an extra count only when that extra is asked for)."""
    seen: set[str] = set()
    stack = [_dist(r) for r in requirements]
    while stack:
        name, extras = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            reqs = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        for r in reqs:
            marker = r.split(";", 1)[1] if ";" in r else ""
            wanted = re.findall(r"extra\s*==\s*['\"]([^'\"]+)['\"]", marker)
            if not wanted or set(wanted) & extras:
                stack.append(_dist(r.split(";", 1)[0]))
    return seen


def allowed_distributions(package: str) -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    reqs = list(project["dependencies"])
    for extra in EXTRAS_ALLOWED.get(package, ()):
        reqs += project["optional-dependencies"][extra]
    return installed_by(reqs)


def _optional(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """Whether an import sits in a ``try`` that catches ImportError (an optional dependency)."""
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.Try):
            for h in node.handlers:
                names = (
                    {n.id for n in ast.walk(h.type) if isinstance(n, ast.Name)}
                    if h.type is not None
                    else {"ImportError"}
                )
                if names & {"ImportError", "ModuleNotFoundError", "Exception"}:
                    return True
    return False


def modules_of(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def imported_top_levels(path: Path, package: str, include_optional: bool = True) -> set[tuple[str, int]]:
    """``(top-level module name, line)`` of every import in ``path`` (function-level included);
    relative imports resolve inside ``package``. ``include_optional=False`` leaves out imports
    guarded by ``try: ... except ImportError``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    out = set()
    for node in ast.walk(tree):
        if not include_optional and isinstance(node, (ast.Import, ast.ImportFrom)) and _optional(node, parents):
            continue
        if isinstance(node, ast.Import):
            out |= {(a.name.split(".")[0], node.lineno) for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: stays inside the package it is written in
                out.add((package, node.lineno))
            elif node.module:
                out.add((node.module.split(".")[0], node.lineno))
    return out


def test_every_package_exists():
    for package in PACKAGES:
        assert (ROOT / package / "__init__.py").is_file(), package


def test_dependency_direction_and_declared_dependencies():
    kvgate = set(PACKAGES)
    dists_of = md.packages_distributions()
    violations = []
    edges: dict[str, set[str]] = {p: set() for p in PACKAGES}
    for package in PACKAGES:
        allowed = allowed_distributions(package)
        for path in modules_of(package):
            rel = path.relative_to(ROOT)
            for name, line in imported_top_levels(path, package):
                if name in kvgate:
                    edges[package].add(name)
                    if name not in ALLOWED[package]:
                        violations.append(f"{rel}:{line}: {package} must not import {name}")
                if name in NEVER_IMPORTED:
                    violations.append(f"{rel}:{line}: imports {name} (nothing imports tests/ or bench/)")
                if package != "gpu_backend" and name in NEVER_IN_GATEWAY:
                    violations.append(f"{rel}:{line}: {package} imports {name} (never in the gateway's process)")
            if package == "gpu_backend":
                continue  # the backend extra installs what it needs
            for name, line in imported_top_levels(path, package, include_optional=False):
                if name in kvgate or name in sys.stdlib_module_names or name in NEVER_IN_GATEWAY:
                    continue
                dists = {d.lower().replace("_", "-") for d in dists_of.get(name, [])}
                if not dists & allowed:
                    violations.append(
                        f"{rel}:{line}: {package} imports {name}, which the core dependencies "
                        f"{'and the hf extra ' if package in EXTRAS_ALLOWED else ''}do not install"
                    )
    assert violations == []
    # the package graph is acyclic (a cycle would need an edge against the direction above)
    state: dict[str, int] = {}

    def visit(p: str, trail: tuple[str, ...]) -> None:
        assert state.get(p) != 1, f"import cycle: {' -> '.join((*trail, p))}"
        if state.get(p) == 2:
            return
        state[p] = 1
        for q in sorted(edges[p] - {p}):
            visit(q, (*trail, p))
        state[p] = 2

    for p in PACKAGES:
        visit(p, ())


def test_checker_sees_violations(tmp_path):
    """Control: the AST walk finds plain, from-, relative and function-level imports."""
    src = tmp_path / "m.py"
    src.write_text(
        "import torch.nn\nfrom gpu_backend.engine import X\nfrom . import sibling\n"
        "def f():\n    import numpy as np\n"
        "try:\n    import uvloop\nexcept ImportError:\n    uvloop = None\n",
        encoding="utf-8",
    )
    assert imported_top_levels(src, "gateway") == {
        ("torch", 1),
        ("gpu_backend", 2),
        ("gateway", 3),
        ("numpy", 5),
        ("uvloop", 7),
    }
    assert ("uvloop", 7) not in imported_top_levels(src, "gateway", include_optional=False)
    core = allowed_distributions("gateway")
    assert {"fastapi", "starlette", "httpx", "tiktoken", "pyyaml", "redis"} <= core
    assert not {"torch", "safetensors", "transformers", "tokenizers", "pytest"} & core
    assert {"tokenizers", "jinja2"} <= allowed_distributions("tokenizer")


@pytest.mark.timeout(120)
def test_importing_gateway_tokenizer_verifier_does_not_import_torch():
    code = """
import json, sys
import config, tokenizer, verifier, gateway, gateway.cli
import tokenizer.tiktoken_counter, tokenizer.parallel, tokenizer.chat, tokenizer.hf_counter, tokenizer.engine_counter
import config.loader, config.secrets, config.errors, verifier.stage, gateway.quotas.stage
from tokenizer import bundled_counter
n = bundled_counter().count_text("hello world")
heavy = sorted(m for m in sys.modules if m.split(".")[0] in {"torch", "numpy", "safetensors", "transformers"})
print(json.dumps({"count": n, "heavy": heavy, "gpu_backend": "gpu_backend" in sys.modules}))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"count": 2, "heavy": [], "gpu_backend": False}


@pytest.mark.timeout(120)
def test_kvgate_help_runs_without_torch():
    code = (
        "import sys, runpy; sys.argv = ['kvgate', '--help']\n"
        "from gateway.cli import main\n"
        "rc = main(['--help'])\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "sys.exit(rc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: kvgate <command> [options]")
    assert "deploy-gate" in out.stdout


# ---------------------------------------------------------------- no import cycle between modules
def module_name(path: Path, root: Path = ROOT) -> str:
    """The dotted module name of a file under ``root`` (``pkg/__init__.py`` is ``pkg``)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path, known: set[str], root: Path = ROOT) -> set[str]:
    """The modules of ``known`` that ``path`` imports: every import statement counts, wherever it
    is (module level, inside a function, under ``if TYPE_CHECKING:``, in a ``try``), since a
    type-only or deferred import is still a dependency. ``from a import b`` names the module
    ``a.b`` when that is a module, else ``a``; relative imports resolve against ``path``."""
    name = module_name(path, root)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for a in node.names:
                if f"{mod}.{a.name}" in known:
                    out.add(f"{mod}.{a.name}")
                elif mod in known:
                    out.add(mod)
    out.discard(name)
    return out


def import_cycles(root: Path, packages: tuple[str, ...]) -> list[list[str]]:
    """Every cycle a depth-first walk of the module import graph of ``packages`` meets, each as
    ``[m1, m2, ..., m1]``."""
    files = {module_name(p, root): p for pkg in packages for p in sorted((root / pkg).rglob("*.py"))}
    known = set(files)
    graph = {m: sorted(imported_modules(p, known, root)) for m, p in files.items()}
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(m: str, trail: list[str]) -> None:
        if state.get(m) == 1:
            cycles.append(trail[trail.index(m) :] + [m])
            return
        if state.get(m) == 2:
            return
        state[m] = 1
        for q in graph[m]:
            visit(q, trail + [m])
        state[m] = 2

    for m in sorted(graph):
        visit(m, [])
    return cycles


def test_no_import_cycle_between_modules():
    assert [" -> ".join(c) for c in import_cycles(ROOT, PACKAGES)] == []


def test_cycle_checker_counts_type_only_and_deferred_imports(tmp_path):
    """Control: a cycle closed only by an ``if TYPE_CHECKING:`` import, or only by an import
    inside a function, is found; relative imports resolve; a one-way graph has none."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "app.py").write_text("from pkg.handlers import handle\n")
    (pkg / "handlers.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.app import Gateway\n"
    )
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .a import x\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    assert sorted(import_cycles(tmp_path, ("pkg",))) == [
        ["pkg.a", "pkg.b", "pkg.a"],
        ["pkg.app", "pkg.handlers", "pkg.app"],
    ]
    (pkg / "handlers.py").write_text("def handle():\n    pass\n")
    (pkg / "b.py").write_text("x = 1\n")
    assert import_cycles(tmp_path, ("pkg",)) == []


def test_needs_seeds_lists_every_test_file_that_reads_the_seeds_and_only_those():
    """A clone without the shared seeds folder skips exactly the test files that read them
    (conftest.NEEDS_SEEDS): those that name ``SEEDS`` (imported from conftest), and those that
    import a module of tests/ that needs them (as test_verifier_backend.py imports
    test_verifier_e2e.py). One not listed would fail at collection there; one listed that needs no
    seeds would never run there."""
    from conftest import NEEDS_SEEDS

    tests = ROOT / "tests"
    files = {p.stem: p for p in tests.glob("*.py") if p.name not in ("conftest.py", "test_imports.py")}
    imports: dict[str, set[str]] = {}
    needs = set()
    for stem, p in files.items():
        text = p.read_text(encoding="utf-8")
        if re.search(r"\bSEEDS\b|shared.{0,8}seeds", text):
            needs.add(stem)
        found = set()
        for node in ast.walk(ast.parse(text)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            found |= {n.removeprefix("tests.") for n in names} & files.keys()
        imports[stem] = found
    while True:  # what imports a module that needs the seeds needs them too
        more = {s for s, deps in imports.items() if deps & needs} - needs
        if not more:
            break
        needs |= more
    helpers = sorted(s for s in needs if not s.startswith("test_"))
    assert helpers == []  # a helper needing the seeds would make every file importing it need them
    assert sorted(NEEDS_SEEDS) == sorted(f"{s}.py" for s in needs)
