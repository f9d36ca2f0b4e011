"""The gateway's CPU per request, read from its workers' ``/proc/<pid>/stat`` (user + system
time), next to wrk's latency and requests/s: what a change costs when the machine is too noisy for
latency alone to show it.

Two modes, both against ``bench/gateway.py``'s nginx mock engine and its scenarios:

- ``cpu``: for each of ``--scenarios``, one c=1 and one c=64 run; prints requests/s, p50 and
  the CPU per request split into user and system time.
- ``pairs``: kvgate from two checkouts (``--a``, ``--b``; e.g. a ``git worktree`` of the commit
  before a change) served side by side, measured in ``--pairs`` interleaved pairs of short runs
  (the order flips every pair) at c=1 and at c=64; prints each side's median and the median and
  quartiles of the within-pair ratios A/B, for p50 (c=1), requests/s (c=64) and CPU per request.
  ``--kind`` picks what both serve: ``bare``, ``quotas`` (Redis quotas, no verifier), ``full``
  or ``verify100`` (``full`` with the verifier checking every response).

``--stream`` (either mode): the mock streams its chat completion (16 token chunks, a usage chunk,
``[DONE]``) and the load asks ``"stream": true``, so the relay's per-event path is measured; each
served target first answers one probe request, which must be an event stream ending with
``[DONE]`` and holding no error event. Any run with a non-2xx answer or no request fails loudly.

Run: ``.venv/bin/python bench/cpu_pairs.py cpu --scenarios kvgate-bare,kvgate-full`` or
``.venv/bin/python bench/cpu_pairs.py pairs --a . --b /tmp/base --kind bare --pairs 10``. Needs
wrk and nginx (``apt-get install -y wrk nginx``), Redis on 127.0.0.1:6379 for quotas, Linux.
"""

from __future__ import annotations

import os
import sys

if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import contextlib
import dataclasses
import statistics
import tempfile
from collections.abc import Iterator
from pathlib import Path

from bench import gateway as G

TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: list[int]) -> tuple[float, float]:
    """``(user, system)`` CPU seconds the processes ``pids`` used so far."""
    user = system = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        user += int(fields[11])
        system += int(fields[12])
    return user / TICKS_PER_SECOND, system / TICKS_PER_SECOND


def measured(target: G.Target, connections: int, seconds: float, tmp: Path) -> tuple[G.Load, float, float]:
    """One wrk run: its :class:`bench.gateway.Load` and the gateway's user and system CPU per
    request (microseconds). Raises ``RuntimeError`` when wrk counted no request or a non-2xx answer."""
    pids = G.worker_pids(target)
    u0, s0 = cpu_seconds(pids)
    load = G.run_wrk(target, connections, seconds, tmp)
    u1, s1 = cpu_seconds(pids)
    if load.requests == 0 or load.non2xx:
        raise RuntimeError(
            f"{target.url} at c={connections}: wrk counted {load.requests} requests, {load.non2xx} non-2xx answers"
        )
    n = load.requests
    return load, (u1 - u0) / n * 1e6, (s1 - s0) / n * 1e6


def ready(name: str, target: G.Target, stream: bool) -> G.Target:
    """``target`` as measured (streamed with ``stream``) once one probe request through it passed
    (:func:`bench.gateway.probe`: 200, and for a stream ``[DONE]`` with no error event)."""
    if stream:
        target = dataclasses.replace(target, stream=True)
    G.probe(name, target)
    return target


@contextlib.contextmanager
def mock_env(stream: bool = False) -> Iterator[G.Env]:
    """:class:`bench.gateway.Env` with the mock engine running (``stream``: answering chat
    completions as an event stream); everything stopped afterwards."""
    tmp = Path(tempfile.mkdtemp(prefix="kvgate-cpu-"))
    os.chmod(tmp, 0o755)
    port = G.free_port()
    env = G.Env(f"http://127.0.0.1:{port}", tmp)
    mock, note = G.start_mock(env, port, stream=stream)
    print(f"mock engine: {note}", flush=True)
    try:
        G.wait_http(env.mock_url + "/health", mock)
        yield env
    finally:
        for p in env.procs:
            G.stop(p)
        G.stop(mock)


def run_cpu(scenarios: list[str], seconds: float, stream: bool = False) -> None:
    with mock_env(stream) as env:
        for name in scenarios:
            with G.SCENARIOS[name][0](env) as served_target:
                target = ready(name, served_target, stream)
                G.run_wrk(target, 1, 1.0, env.tmp)  # warm
                for c in (1, 64):
                    load, user, system = measured(target, c, seconds, env.tmp)
                    print(
                        f"{name:<18} c={c:<3} {load.requests / seconds:7.0f} req/s  p50 {load.p50_ms:7.3f} ms  "
                        f"CPU per request: user {user:6.1f} us, system {system:5.1f} us  errors {load.errors}",
                        flush=True,
                    )


def served(env: G.Env, name: str, root: Path, kind: str):
    """kvgate of checkout ``root`` as ``kind`` (``bare``, ``quotas``, ``full``, ``verify100``)."""
    if kind in ("full", "verify100"):
        return G.full_features(env, name, 1.0 if kind == "verify100" else 0.05, root=root)
    if kind == "quotas":
        return G.full_features(env, name, 0.05, root=root, verifier={"enabled": False})
    return G.gateway_target(env, name=name, workers=G.usable_cores(), root=root)


def quartiles(xs: list[float]) -> str:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return f"{statistics.median(xs):.3f} (q1 {q[0]:.3f}, q3 {q[2]:.3f})"


def run_pairs(a: Path, b: Path, kind: str, pairs: int, seconds: float, stream: bool = False) -> None:
    with mock_env(stream) as env, served(env, "A", a, kind) as served_a, served(env, "B", b, kind) as served_b:
        ta, tb = ready("A", served_a, stream), ready("B", served_b, stream)
        for t in (ta, tb):
            G.run_wrk(t, 1, 1.0, env.tmp)  # warm
        got: dict[tuple[str, int], list[tuple[float, float]]] = {(k, c): [] for k in "AB" for c in (1, 64)}
        errors = {"A": 0, "B": 0}
        for i in range(pairs):
            for c in (1, 64):
                order = [("A", ta), ("B", tb)] if i % 2 == 0 else [("B", tb), ("A", ta)]
                for key, t in order:
                    load, user, system = measured(t, c, seconds, env.tmp)
                    got[(key, c)].append((load.p50_ms if c == 1 else load.rps, user + system))
                    errors[key] += load.errors
        label = f"{kind} stream" if stream else kind
        for c in (1, 64):
            what = "c=1 p50 ms" if c == 1 else "c=64 req/s"
            va, vb = got[("A", c)], got[("B", c)]
            value_a, value_b = statistics.median(x for x, _ in va), statistics.median(x for x, _ in vb)
            cpu_a, cpu_b = statistics.median(u for _, u in va), statistics.median(u for _, u in vb)
            print(
                f"{label} {what}: A {value_a:.3f}, B {value_b:.3f}, "
                f"A/B {quartiles([x / y for (x, _), (y, _) in zip(va, vb, strict=True)])}; "
                f"CPU us per request: A {cpu_a:.0f}, B {cpu_b:.0f}, "
                f"A/B {quartiles([x / y for (_, x), (_, y) in zip(va, vb, strict=True)])}"
            )
        print(f"{label}: wrk socket errors A {errors['A']}, B {errors['B']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    cpu = sub.add_parser("cpu", help="CPU per request of each scenario at c=1 and c=64")
    cpu.add_argument("--scenarios", default="kvgate-bare,kvgate-quotas,kvgate-verifier,kvgate-full")
    cpu.add_argument("--seconds", type=float, default=3.0)
    cpu.add_argument("--stream", action="store_true", help="streamed chat completions (the relay's per-event path)")
    pairs = sub.add_parser("pairs", help="two checkouts side by side, in interleaved pairs of runs")
    pairs.add_argument("--a", type=Path, required=True, help="checkout A (e.g. .)")
    pairs.add_argument("--b", type=Path, required=True, help="checkout B (e.g. a worktree of the base)")
    pairs.add_argument("--kind", choices=["bare", "quotas", "full", "verify100"], default="full")
    pairs.add_argument("--pairs", type=int, default=10)
    pairs.add_argument("--seconds", type=float, default=2.0)
    pairs.add_argument("--stream", action="store_true", help="streamed chat completions (the relay's per-event path)")
    args = ap.parse_args()
    if args.mode == "cpu":
        run_cpu([s for s in args.scenarios.split(",") if s], args.seconds, args.stream)
    else:
        run_pairs(args.a.resolve(), args.b.resolve(), args.kind, args.pairs, args.seconds, args.stream)
    return 0


if __name__ == "__main__":
    sys.exit(main())
