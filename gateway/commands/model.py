"""``kvgate model pull NAME`` / ``kvgate model list``: hands its arguments to ``python -m gpu_backend
model ...`` in a process of its own (the converter needs torch and numpy, which never load in the
gateway's process). See :mod:`gpu_backend.model_store` for what a pull does."""

from __future__ import annotations

import os
import sys


def run_argv(argv: list[str]) -> int:
    """Replace this process with ``python -m gpu_backend model <argv>``."""
    os.execv(sys.executable, [sys.executable, "-m", "gpu_backend", "model", *argv])
    return 0  # not reached
