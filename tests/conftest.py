"""Shared fixtures. Tests start real processes on loopback; Redis is the real server that
scripts/test.sh (or .ci/run, which runs it) makes sure answers on 127.0.0.1:6379.

Some tests use the incident runbook (two translations, real multilingual text) from the project's
shared design folder, ``../shared/seeds`` beside the checkout. In a clone without that folder those
test files are not collected, and the run says so at the end.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"
SEEDS = SHARED / "seeds"
sys.path.insert(0, str(ROOT))

#: test files that read the runbook texts in SEEDS (tests/test_imports.py checks that every test file
#: naming SEEDS is listed, and only those)
NEEDS_SEEDS = [
    "test_backend_core_copy_probe.py",
    "test_gateway_http.py",
    "test_tokenizer.py",
    "test_tokenizer_hf.py",
    "test_tokenizer_parallel.py",
    "test_verifier_backend.py",
    "test_verifier_e2e.py",
    "test_verifier_service.py",
    "test_verifier_units.py",
]
HAVE_SEEDS = (SEEDS / "000_cd7ee3cfd92e9ff1.txt").is_file() and (SEEDS / "001_85707760a0179a93.txt").is_file()
collect_ignore = [] if HAVE_SEEDS else NEEDS_SEEDS


def pytest_terminal_summary(terminalreporter) -> None:
    if not HAVE_SEEDS:
        terminalreporter.write_line(
            f"kvgate: {len(NEEDS_SEEDS)} test files were not run: they read the runbook texts of the shared "
            "design folder (../shared/seeds beside the checkout), which this checkout lacks.",
            yellow=True,
        )
