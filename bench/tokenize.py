"""Exact prompt counting throughput: kvgate's counter next to raw single-thread tiktoken.

Usage::

    .venv/bin/python bench/tokenize.py [--sizes 1000,100000,1000000] [--seconds 2]

For each prompt size it builds a prompt from real text (the incident runbook's Chinese and Polish
translations in ../shared/seeds, docs/design.md, and Python standard-library source as English prose
and code), interleaved paragraph by paragraph, and times in the same process:

- ``tiktoken``: ``len(Encoding.encode_ordinary(text))`` on one thread (cl100k_base);
- ``kvgate 1 thread``: kvgate's cutting at provably safe pre-token boundaries
  (tokenizer/parallel.py), every piece counted on the calling thread;
- ``kvgate N threads``: ``bundled_counter().count_prompt(text)`` (validation included; the
  pieces are counted on every usable core);
- ``kvgate async``: ``await acount_prompt(text)`` (the gateway's path: a worker thread, then the
  same multi-core count).

Every count is checked to be identical to tiktoken's. Prints a table of tokens/s (wall clock) and
the ratio (kvgate / tiktoken; above 1 means faster), and the CPU time each count costs (all
threads), medians over interleaved runs. On a machine whose cores are busy with other work the
wall-clock gain of several threads shrinks to nothing; the CPU columns still show the work.
"""

from __future__ import annotations

import os
import sys

# This file is named like the standard library's ``tokenize``; run as a script, its folder comes
# first on sys.path and would shadow it. Drop that entry before anything imports ``tokenize``.
if sys.path and os.path.abspath(sys.path[0] or os.curdir) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

import argparse
import asyncio
import statistics
import sysconfig
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tokenizer import (  # noqa: E402
    bundled_counter,
    get_encoding,
    parallel,  # noqa: E402
)


def corpus_paragraphs() -> list[str]:
    """Paragraphs of real text in several scripts, interleaved so every prompt mixes them."""
    sources: list[list[str]] = []
    shared = ROOT.parent / "shared"
    for path in sorted((shared / "seeds").glob("0*.txt")) + [ROOT / "docs" / "design.md"]:
        if path.is_file():
            sources.append([p for p in path.read_text(encoding="utf-8").split("\n\n") if p.strip()])
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("argparse.py", "asyncio/base_events.py", "json/decoder.py", "textwrap.py", "statistics.py"):
        path = stdlib / name
        if path.is_file():
            sources.append([p for p in path.read_text(encoding="utf-8").split("\n\n") if p.strip()])
    if not sources:
        raise SystemExit("bench/tokenize.py: no input text found (seeds, docs/design.md, stdlib sources)")
    out = []
    for i in range(max(len(s) for s in sources)):
        out.extend(s[i] for s in sources if i < len(s))
    return out


def build_prompt(tokens: int, paragraphs: list[str], count: Callable[[str], int]) -> str:
    """Whole paragraphs (cycled) until the text has at least ``tokens`` tokens."""
    parts: list[str] = []
    have = 0
    i = 0
    while have < tokens:
        p = paragraphs[i % len(paragraphs)]
        parts.append(p)
        have += count(p + "\n\n")  # an upper-bound estimate; the exact count is taken below
        i += 1
    text = "\n\n".join(parts)
    while count(text) > tokens * 1.02 and len(parts) > 1:  # trim back towards the target
        parts.pop()
        text = "\n\n".join(parts)
    return text


def interleaved(
    fns: dict[str, Callable[[], int]], seconds: float, min_rounds: int = 3
) -> dict[str, tuple[float, float, int]]:
    """``{name: (median wall seconds, median CPU seconds of the process, result)}`` per call. The
    functions run in turns, one call each per round (in rotating order), so a change in machine
    load hits them alike.
    CPU time (all threads) shows the work done, which other processes' load does not inflate."""
    results = {name: fn() for name, fn in fns.items()}  # warm-up (thread pool start, caches)
    wall: dict[str, list[float]] = {name: [] for name in fns}
    cpu: dict[str, list[float]] = {name: [] for name in fns}
    start = time.perf_counter()
    rounds = 0
    order = list(fns.items())
    while rounds < min_rounds or time.perf_counter() - start < seconds:
        order = order[1:] + order[:1]  # rotate, so no function always runs first
        for name, fn in order:
            c0, t0 = time.process_time(), time.perf_counter()
            r = fn()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
            if r != results[name]:
                raise SystemExit(f"bench/tokenize.py: unstable result for {name}: {r} != {results[name]}")
        rounds += 1
    return {name: (statistics.median(wall[name]), statistics.median(cpu[name]), results[name]) for name in fns}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1000,100000,1000000", help="prompt sizes in tokens, comma-separated")
    ap.add_argument("--seconds", type=float, default=2.0, help="time budget per measurement (x3 for >= 500k tokens)")
    args = ap.parse_args(argv)

    enc = get_encoding("cl100k_base")
    counter = bundled_counter()
    paragraphs = corpus_paragraphs()
    cores = parallel.usable_cores()

    def raw(text: str) -> int:
        return len(enc.encode_ordinary(text))

    def one_thread(text: str) -> int:  # kvgate's cutting, all pieces on the calling thread
        return parallel.parallel_count(text, raw, workers=1)

    loop = asyncio.new_event_loop()
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        text = build_prompt(size, paragraphs, raw)
        m = interleaved(
            {
                "raw": lambda: raw(text),
                "one": lambda: one_thread(text),
                "kvgate": lambda: counter.count_prompt(text).per_prompt[0],
                "async": lambda: loop.run_until_complete(counter.acount_prompt(text)).per_prompt[0],
            },
            args.seconds * (3 if size >= 500_000 else 1),
        )
        n = m["raw"][2]
        exact = all(r == n for _, _, r in m.values())
        rows.append(
            (n, len(text), {k: n / t for k, (t, _, _) in m.items()}, {k: c for k, (_, c, _) in m.items()}, exact)
        )
    loop.close()

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"exact prompt counting, cl100k_base; {cores} usable core(s), 1-minute load average {load:.2f} "
        f"at the end; kvgate cuts texts of {parallel.PARALLEL_MIN_CHARS:,}+ characters into "
        f"~{parallel.PIECE_CHARS // 1024}k-character pieces; medians of interleaved runs"
    )
    header = (
        "prompt tokens",
        "chars",
        "tiktoken 1 thread tok/s",
        "kvgate 1 thread tok/s",
        "ratio",
        f"kvgate {cores} threads tok/s",
        "ratio",
        "kvgate async tok/s",
        "ratio",
        "CPU ms tiktoken",
        "CPU ms kvgate 1 thread",
        f"CPU ms kvgate {cores} threads",
        "exact",
    )
    table = [header]
    for n, chars, tps, cpu, exact in rows:
        table.append(
            (
                f"{n:,}",
                f"{chars:,}",
                f"{tps['raw']:,.0f}",
                f"{tps['one']:,.0f}",
                f"{tps['one'] / tps['raw']:.2f}x",
                f"{tps['kvgate']:,.0f}",
                f"{tps['kvgate'] / tps['raw']:.2f}x",
                f"{tps['async']:,.0f}",
                f"{tps['async'] / tps['raw']:.2f}x",
                f"{cpu['raw'] * 1000:.1f}",
                f"{cpu['one'] * 1000:.1f}",
                f"{cpu['kvgate'] * 1000:.1f}",
                "yes" if exact else "NO",
            )
        )
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    for j, r in enumerate(table):
        print("| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |")
        if j == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return 0 if all(r[-1] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
