"""Shared fixtures. Tests start real processes on loopback; Redis is the real server that
scripts/test.sh (or .ci/run) makes sure answers on 127.0.0.1:6379."""
from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"
SEEDS = SHARED / "seeds"
sys.path.insert(0, str(ROOT))
os.environ.setdefault("KVGATE_STATE_DIR_FOR_TESTS", "1")
