"""The engine's torch work runs on threads that are gone when it is done: building an engine (weights,
pool, sampling bias) starts no OpenMP team on the caller's thread. libgomp keeps a thread's team for
as long as the thread lives, and while more OpenMP threads exist than CPUs it stops spinning between
parallel regions (GOMP_SPINCOUNT's documented fallback to 100 spins), which made every region of the
worker's decode step slower (docs/performance.md, "Issue 28, fifth pass"). Each check runs in a fresh
interpreter: the test process's own thread has long had a team of its own."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PROBE = textwrap.dedent(
    """
    import os, torch
    torch.set_num_threads(2)
    from gpu_backend.engine import Engine, EngineConfig

    import time

    def threads():
        return len(os.listdir("/proc/self/task"))

    def settled(want, seconds=2.0):  # a joined thread, and the team it ends, leave the OS a moment later
        deadline = time.monotonic() + seconds
        while threads() != want and time.monotonic() < deadline:
            time.sleep(0.01)
        return threads()

    before = threads()
    {build}
    after = settled(before)
    torch.add(torch.ones(100_000), 1)  # a parallel region on this thread starts its team now
    print(before, after, threads())
    """
)


def _probe(build: str) -> tuple[int, int, int]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "2"}
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(build=build)], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    before, after, last = map(int, out.stdout.split())
    return before, after, last


def test_building_an_engine_leaves_no_openmp_team_on_the_callers_thread():
    before, after, last = _probe(
        'Engine(EngineConfig(model="tiny-random", device="cpu", max_total_tokens=65536, context_length=1024))'
    )
    assert after == before  # the build's team ended with the thread that built (within 2 s)
    assert last == before + 1  # the probe itself can tell: the caller's own first region adds one thread


def test_a_build_that_fails_raises_in_the_caller_and_leaves_nothing():
    before, after, _ = _probe(
        textwrap.dedent(
            """
            try:
                Engine(EngineConfig(model="/nonexistent/model", device="cpu", max_total_tokens=1024, context_length=1024))
            except ValueError as e:
                assert str(e) == "unknown model '/nonexistent/model': use tiny-random, copy-probe or a local checkpoint folder", e
            else:
                raise SystemExit("no ValueError")
            """
        )
    )
    assert after == before
