"""Where one request's wall time goes at c=1: the gateway's stages, timed in the process.

Serves a ``bench/gateway.py`` scenario (default ``kvgate-full-1w``: every feature on, one
worker, so every request meets the same event loop) in front of its nginx mock, with
``bench/timeline_site`` first on its ``PYTHONPATH``: its ``sitecustomize`` marks each stage (client bytes
in, admission and its parts: the body read, the count, the forward body, the verifier's admission,
the quota call; each Redis round trip, the forward, engine bytes in, the answer's writes, the
finish) with ``perf_counter_ns``. After one wrk run at 1 connection, the requests are split at
each arrival; for those of the most common stage sequence (the first quarter skipped as warm-up)
it prints the median time between consecutive marks. The marks cost a little time themselves:
compare runs of this tool, not its sums with ``bench/gateway.py``'s latencies.

Run: ``.venv/bin/python bench/timeline.py [--seconds 10] [--scenario kvgate-full-1w]``.
Needs wrk and nginx (``apt-get install -y wrk nginx``) and Redis on 127.0.0.1:6379.
"""

from __future__ import annotations

import os
import sys

if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import statistics
import tempfile
from collections import Counter
from pathlib import Path

from bench import gateway as G

SITE = Path(__file__).resolve().parent / "timeline_site"


def requests_of(marks: list[tuple[int, str]]) -> list[list[tuple[int, str]]]:
    """``marks`` split into requests, each starting at a client read (``rx``)."""
    out: list[list[tuple[int, str]]] = []
    for t, name in marks:
        if name == "rx":
            out.append([])
        if out:
            out[-1].append((t, name))
    return out


def step_table(reqs: list[list[tuple[int, str]]]) -> tuple[str, int, list[tuple[str, float]]]:
    """The most common stage sequence, how many requests had it, and the median microseconds
    between its consecutive marks."""
    seqs = Counter(" ".join(n for _, n in r) for r in reqs)
    top, count = seqs.most_common(1)[0]
    names = top.split()
    steps: list[list[float]] = [[] for _ in names[1:]]
    for r in reqs:
        if [n for _, n in r] == names:
            for i in range(1, len(r)):
                steps[i - 1].append((r[i][0] - r[i - 1][0]) / 1000)
    return top, count, [(f"{names[i]} -> {names[i + 1]}", statistics.median(s)) for i, s in enumerate(steps)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=10.0, help="the wrk run at c=1 (default 10)")
    ap.add_argument("--scenario", default="kvgate-full-1w", help="a bench/gateway.py kvgate scenario")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvgate-timeline-"))
    out = tmp / "marks.txt"
    os.environ["TIMELINE_MARKS_OUT"] = str(out)
    env = G.Env(mock_url="", tmp=tmp, site=[SITE])
    port = G.free_port()
    try:
        G.start_mock(env, port)
        env.mock_url = f"http://127.0.0.1:{port}"
        G.wait_http(env.mock_url + "/server_info")
        with G.SCENARIOS[args.scenario][0](env) as target:
            load = G.run_wrk(target, 1, args.seconds, tmp)
    finally:
        for p in env.procs:
            G.stop(p)
    marks = [(int(t), n) for t, n in (line.split() for line in out.read_text().splitlines())]
    reqs = requests_of(marks)
    reqs = reqs[len(reqs) // 4 :]
    top, count, steps = step_table(reqs)
    print(f"{args.scenario}, c=1: {load.rps:.0f} req/s, p50 {load.p50_ms:.3f} ms (marks on)")
    print(f"{count} of {len(reqs)} requests had the stages: {top}")
    for name, us in steps:
        print(f"  {name:28s} {us:7.1f} us")
    print(f"  {'sum':28s} {sum(us for _, us in steps):7.1f} us")
    other = Counter(" ".join(n for _, n in r).count("redis_tx") for r in reqs)
    print("Redis round trips per request: " + ", ".join(f"{k}: {v}" for k, v in sorted(other.items())))


if __name__ == "__main__":
    main()
