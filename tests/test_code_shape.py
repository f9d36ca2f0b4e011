"""Code shape: ruff's C901 (complexity over 10) and functions over 60 lines, each held to a named list.

pyproject.toml ignores C901 per file; the comment after each entry names the functions over 10.
These tests hold that debt, and the long functions, to exactly the listed ones: a new one fails,
and one split below the limit must be taken off its list. (They replace the per-class method and
field counts, which were met by moving complexity into longer functions.)"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from conftest import ROOT

PACKAGES = ("config", "tokenizer", "gateway", "verifier", "gpu_backend")
MAX_LINES = 60

#: ``path:function`` over MAX_LINES lines -> why, for now (argparse builders are allowed outright)
LONG_FUNCTIONS: dict[str, str] = {}


def _is_argparse_builder(fn: ast.AST) -> bool:
    return any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "add_argument"
        for n in ast.walk(fn)
    )


def long_functions(root: Path) -> set[str]:
    """``path:function`` of every function over MAX_LINES lines that is not an argparse builder."""
    found = set()
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=rel)):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    lines = (node.end_lineno or node.lineno) - node.lineno + 1
                    if lines > MAX_LINES and not _is_argparse_builder(node):
                        found.add(f"{rel}:{node.name}")
    return found


def listed_complexity_debt() -> set[str]:
    """``path:function`` named in pyproject.toml's C901 per-file ignores."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    ignores = tomllib.loads(text)["tool"]["ruff"]["lint"]["per-file-ignores"]
    out = set()
    for path in ignores:
        m = re.search(rf'^"{re.escape(path)}" = \["C901"\]  # (.+)$', text, re.M)
        assert m, f"{path}: its C901 entry must name its functions in a comment"
        out |= {f"{path}:{name}" for name in re.findall(r"(\w+) \(\d+\)", m.group(1))}
    return out


def complexity_findings() -> set[str]:
    """``path:function`` of every C901 finding with no file ignored."""
    ruff = Path(sys.executable).parent / "ruff"
    cmd = [str(ruff), "check", "--isolated", "--select", "C901", "--config", "lint.mccabe.max-complexity=10"]
    out = subprocess.run([*cmd, "--output-format", "concise", *PACKAGES], cwd=ROOT, capture_output=True, text=True)
    return {f"{m[0]}:{m[1]}" for m in re.findall(r"^(\S+?):\d+:\d+: C901 `(\w+)`", out.stdout, re.M)}


def test_complexity_debt_is_exactly_the_listed_functions():
    assert complexity_findings() == listed_complexity_debt()


def test_long_functions_are_exactly_the_listed_ones():
    assert long_functions(ROOT) == set(LONG_FUNCTIONS)


def test_the_checks_see_what_they_measure(tmp_path):
    """Control: a 61-line function is long, a 60-line one and an argparse builder are not."""
    pkg = tmp_path / "config"
    pkg.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(60))
    parser = "\n".join("    p.add_argument('--x')" for _ in range(70))
    (pkg / "m.py").write_text(f"def long():\n{body}\n\ndef short():\n{body[:-12]}\n\ndef add(p):\n{parser}\n")
    for other in PACKAGES[1:]:
        (tmp_path / other).mkdir()
    assert long_functions(tmp_path) == {"config/m.py:long"}
