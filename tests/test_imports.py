"""Import hygiene (DESIGN.md, Layout): dependencies point ``gateway -> verifier -> tokenizer ->
config``; ``gpu_backend`` imports only ``config`` and ``tokenizer``; the gateway never imports
``gpu_backend``; importing gateway, tokenizer or verifier never imports torch; nothing imports
``tests/`` or ``bench/``."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
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
#: third-party modules only the `backend` extra (or the dev extra) installs: never in the gateway's process
BACKEND_ONLY = {"torch", "safetensors", "numpy", "transformers", "triton"}
NEVER_IMPORTED = {"tests", "bench", "conftest"}


def modules_of(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def imported_top_levels(path: Path, package: str) -> set[tuple[str, int]]:
    """``(top-level module name, line)`` of every import in ``path`` (function-level included);
    relative imports resolve inside ``package``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    out = set()
    for node in ast.walk(tree):
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


def test_dependency_direction_and_no_backend_only_imports():
    kvgate = set(PACKAGES)
    violations = []
    edges: dict[str, set[str]] = {p: set() for p in PACKAGES}
    for package in PACKAGES:
        for path in modules_of(package):
            rel = path.relative_to(ROOT)
            for name, line in imported_top_levels(path, package):
                if name in kvgate:
                    edges[package].add(name)
                    if name not in ALLOWED[package]:
                        violations.append(f"{rel}:{line}: {package} must not import {name}")
                if name in NEVER_IMPORTED:
                    violations.append(f"{rel}:{line}: imports {name} (nothing imports tests/ or bench/)")
                if package != "gpu_backend" and name in BACKEND_ONLY:
                    violations.append(f"{rel}:{line}: {package} imports {name} (backend extra only)")
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
    src.write_text("import torch.nn\nfrom gpu_backend.engine import X\nfrom . import sibling\n"
                   "def f():\n    import numpy as np\n", encoding="utf-8")
    assert imported_top_levels(src, "gateway") == {("torch", 1), ("gpu_backend", 2), ("gateway", 3), ("numpy", 5)}


@pytest.mark.timeout(120)
def test_importing_gateway_tokenizer_verifier_does_not_import_torch():
    code = """
import json, sys
import config, tokenizer, verifier, gateway, gateway.cli
import tokenizer.tiktoken_counter, tokenizer.parallel, tokenizer.chat, tokenizer.hf_counter, tokenizer.engine_counter
import config.loader, config.secrets, config.errors, verifier.stage, gateway.stages
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
    code = ("import sys, runpy; sys.argv = ['kvgate', '--help']\n"
            "from gateway.cli import main\n"
            "rc = main(['--help'])\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n"
            "sys.exit(rc)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: kvgate <command> [options]")
    assert "deploy-gate" in out.stdout
