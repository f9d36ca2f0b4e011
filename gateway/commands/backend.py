"""``kvgate backend ...``: hands its arguments to ``python -m gpu_backend`` in a process of its own
(torch never loads in the gateway's process)."""

from __future__ import annotations

import os
import sys


def run_argv(argv: list[str]) -> int:
    """Replace this process with ``python -m gpu_backend <argv>`` (flags: docs/design.md, Contracts)."""
    os.execv(sys.executable, [sys.executable, "-m", "gpu_backend", *argv])
    return 0  # not reached
