"""Real benchmark clients, unmodified, against the embedded stack serving the real model: each
client against kvgate (the gateway, demo key ``sk-demo-a``) and against the engine directly (the
bundled backend's own OpenAI API), in one run, printed as one table.

    .venv/bin/python bench/clients.py [--requests 4] [--prompt-tokens 32] [--output-tokens 8]

Clients (docs/demo.md, "Real benchmark clients"): ``guidellm`` (PyPI ``guidellm``), chat and
Responses modes (``request_format``), synthetic data with the model folder as its tokenizer, one
request at a time. vLLM's ``vllm bench serve`` and SGLang's ``sglang.bench_serving`` are not run:
neither installs without nvidia-* wheels (the evidence is in docs/demo.md).

Each client installs once into its own venv under ``<state_dir>/bench-venvs/NAME``: the CPU torch
first (``scripts/torch_choice.sh``, as the bootstrap chooses it), then a dry run (``pip install
--dry-run --report``) that aborts when the install would pull any ``nvidia-*``/``cuda-*`` wheel
or replace the CPU torch, then the install. Per run: requests ok and errored, TTFT and ITL means,
output tokens/s, and the token check: through kvgate, the client's (prompt, output) tokens of each
request must equal the gateway's usage for it (its access log, compared as multisets), and the
engine-direct run's. The machine is shared: runs are short (a few requests); the numbers show what
the clients see, not the gateway's capacity. Not a test.
"""

from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import argparse  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import httpx  # noqa: E402

from gateway.stack.embedded import EmbeddedStack, StackOptions  # noqa: E402

ROOT = Path(_HERE).parent
KEY = "sk-demo-a"
MODEL = "smollm2-135m-instruct"
#: what each client installs after the CPU torch: (requirements, requirements installed --no-deps)
PACKAGES: dict[str, tuple[list[str], list[str]]] = {"guidellm": (["guidellm==0.8.1"], [])}


class InstallRefused(Exception):
    """The install would pull CUDA wheels or replace the CPU torch."""


@dataclass
class Run:
    client: str
    mode: str
    target: str
    ok: int = 0
    errored: int = 0
    ttft_ms: float | None = None
    itl_ms: float | None = None
    output_tps: float | None = None
    counts: list[tuple[int, int]] = field(default_factory=list)  # (prompt, output) per ok request
    check: str = ""
    note: str = ""


def _pip(py: Path, *args: str, log: Path) -> None:
    with open(log, "ab") as out:
        r = subprocess.run([str(py), "-m", "pip", "--disable-pip-version-check", *args], stdout=out, stderr=out)
    if r.returncode != 0:
        raise RuntimeError(f"pip {' '.join(args[:3])} ... failed; see {log}")


def _refuse_cuda(py: Path, reqs: list[str], no_deps: bool, log: Path) -> None:
    """Dry-run the install; raise :class:`InstallRefused` naming what it would pull."""
    with tempfile.NamedTemporaryFile(suffix=".json") as report:
        _pip(py, "install", "--dry-run", "--report", report.name, *(["--no-deps"] if no_deps else []), *reqs, log=log)
        plan = json.load(open(report.name))["install"]
    bad = [
        f"{i['metadata']['name']}=={i['metadata']['version']}"
        for i in plan
        if i["metadata"]["name"].lower().startswith(("nvidia", "cuda"))
        or i["metadata"]["name"].lower() in ("torch", "triton", "torchvision")
    ]
    if bad:
        raise InstallRefused(f"{' '.join(reqs)} would install {len(bad)} CUDA wheels or another torch: {bad[:6]}")


def install(name: str, venvs: Path) -> Path:
    """The venv of client ``name`` (made once): CPU torch, then the client (module docstring)."""
    venv = venvs / name
    py = venv / "bin" / "python"
    stamp = venv / ".installed"
    if stamp.exists():
        return py
    venv.parent.mkdir(parents=True, exist_ok=True)
    log = venvs / f"{name}-install.log"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    script = f'. "{ROOT}/scripts/torch_choice.sh" && choose_torch "{py}"'
    script += f' && "{py}" -m pip install -q "${{TORCH_PIP_ARGS[@]}}" >>"{log}" 2>&1'
    subprocess.run(["bash", "-c", script], check=True)
    deps, no_deps = PACKAGES[name]
    for reqs, nd in ((deps, False), (no_deps, True)):
        if reqs:
            _refuse_cuda(py, reqs, nd, log)
            _pip(py, "install", "-q", *(["--no-deps"] if nd else []), *reqs, log=log)
    stamp.touch()
    return py


def access_lines(log: Path, offset: int) -> list[dict[str, Any]]:
    """The gateway's access-log lines written after ``offset`` (bytes)."""
    with open(log, "rb") as f:
        f.seek(offset)
        out = []
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("logger") == "kvgate.access":
                out.append(rec)
        return out


def _mean(stats: dict[str, Any], key: str) -> float | None:
    v = stats.get(key, {}).get("successful", {}).get("mean")
    return float(v) if v is not None else None


def run_guidellm(py: Path, url: str, mode: str, folder: Path, args: argparse.Namespace, out: Path) -> Run:
    target = f"kind=openai_http,target={url},model={MODEL},api_key={KEY}"
    if mode == "responses":
        target += ",request_format=/v1/responses"
    cmd = [str(py.parent / "guidellm"), "run", "--backend", target, "--profile", "kind=synchronous"]
    cmd += ["--constraint", f"kind=max_requests,count={args.requests}"]
    cmd += ["--tokenizer", f"kind=huggingface_auto,model={folder}", "--disable-console"]
    cmd += ["--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}"]
    cmd += ["--output", f"kind=json,path={out}"]
    run = Run("guidellm", mode, "")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if r.returncode != 0 or not out.exists():
        run.note = f"exit {r.returncode}: {(r.stderr or r.stdout).strip()[-200:]}"
        return run
    b = json.load(open(out))["benchmarks"][0]
    m = b["metrics"]
    run.ok, run.errored = m["request_totals"]["successful"], m["request_totals"]["errored"]
    run.ttft_ms, run.itl_ms = _mean(m, "time_to_first_token_ms"), _mean(m, "inter_token_latency_ms")
    run.output_tps = _mean(m, "output_tokens_per_second")
    run.counts = [(q["prompt_tokens"], q["output_tokens"]) for q in b["requests"]["successful"]]
    if b["requests"]["errored"]:
        run.note = str(b["requests"]["errored"][0].get("info", {}).get("error"))[:200]
    return run


RUNNERS: dict[str, tuple[tuple[str, ...], Callable[..., Run]]] = {
    "guidellm": (("chat", "responses"), run_guidellm),
}


def check_counts(via: Run, direct: Run | None, gateway: list[dict[str, Any]]) -> str:
    """``via``'s per-request counts against the gateway's usage (its access lines with a count:
    200s, and 499s of a client that closed once it had the whole answer) and the direct run's;
    also the gateway's median ``overhead_ms``."""
    lines = [g for g in gateway if g.get("status") in (200, 499) and g.get("completion_tokens") is not None]
    seen = sorted((g["prompt_tokens"], g["completion_tokens"]) for g in lines)
    mine = sorted(via.counts)
    parts = [f"{'=' if mine == seen else '!='} gateway's usage"]
    late = sum(g["status"] == 499 for g in lines)
    if late:
        parts[0] += f" ({late} logged 499: closed after the last event)"
    if direct is not None and direct.counts:
        parts.append(f"{'=' if mine == sorted(direct.counts) else '!='} engine direct")
    overheads = sorted(g["overhead_ms"] for g in lines if isinstance(g.get("overhead_ms"), (int, float)))
    if overheads:
        parts.append(f"gateway overhead median {overheads[len(overheads) // 2]:.1f} ms")
    return "; ".join(parts)


def gateway_lines(log: Path, offset: int, want: int, wait_seconds: float = 10.0) -> list[dict[str, Any]]:
    """The access lines after ``offset``, waiting up to ``wait_seconds`` for ``want`` of them (a
    line is written when the gateway has finished the request, after the client has its answer)."""
    deadline = time.monotonic() + wait_seconds
    while True:
        lines = access_lines(log, offset)
        if len(lines) >= want or time.monotonic() > deadline:
            return lines
        time.sleep(0.2)


def warm_up(*urls: str) -> None:
    """One short chat and one Responses request to each of ``urls``, so that no client's first
    request pays a process's first use (the gateway's first chat cost about 1.2 s more)."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    resp = {"model": MODEL, "input": "Hi", "max_output_tokens": 2}
    with httpx.Client(timeout=120, headers={"authorization": f"Bearer {KEY}"}, trust_env=False) as c:
        for url in urls:
            c.post(url + "/v1/chat/completions", json=chat).raise_for_status()
            c.post(url + "/v1/responses", json=resp).raise_for_status()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", default="guidellm")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=8)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per client run")
    p.add_argument("--venvs", default=".kvgate/bench-venvs", help="where each client's venv is made (once)")
    args = p.parse_args(argv)
    venvs = Path(args.venvs)
    pythons: dict[str, Path] = {}
    for name in args.clients.split(","):
        try:
            pythons[name] = install(name, venvs)
        except (InstallRefused, RuntimeError, subprocess.CalledProcessError) as e:
            print(f"{name}: not run: {e}")
    rows: list[Run] = []
    run_dir = Path(tempfile.mkdtemp(prefix="kvgate-clients-"))
    with EmbeddedStack(StackOptions(model=MODEL, gateway_port=0, backend_port=0, run_dir=run_dir)) as stack:
        assert stack.served is not None and stack.served.folder is not None
        folder, glog = stack.served.folder, run_dir / "gateway.log"
        warm_up(stack.backend_url, stack.gateway_url)
        for name, py in pythons.items():
            modes, runner = RUNNERS[name]
            for mode in modes:
                pair: dict[str, Run] = {}
                for target, url in (("engine direct", stack.backend_url), ("kvgate", stack.gateway_url)):
                    offset = glog.stat().st_size
                    t0 = time.perf_counter()
                    run = runner(py, url, mode, folder, args, run_dir / f"{name}-{mode}-{target[0]}.json")
                    run.target, run.note = target, run.note or f"{time.perf_counter() - t0:.0f} s"
                    if target == "kvgate":
                        lines = gateway_lines(glog, offset, run.ok + run.errored)
                        run.check = check_counts(run, pair.get("engine direct"), lines)
                    pair[target] = run
                    rows.append(run)
    print_table(rows, args)
    return 0 if all(r.ok == args.requests and r.errored == 0 for r in rows) and rows else 1


def _f(v: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if v is None else fmt.format(v)


def print_table(rows: list[Run], args: argparse.Namespace) -> None:
    print(
        f"\n{args.requests} requests per run, one at a time; {args.prompt_tokens} synthetic prompt tokens, "
        f"{args.output_tokens} output tokens (ignore_eos); model {MODEL} on CPU\n"
    )
    head = f"{'client':9} {'mode':10} {'target':14} {'ok':>3} {'err':>3} {'TTFT ms':>8} {'ITL ms':>7} {'out tok/s':>9}"
    print(head + "  tokens (prompt, output)   check / note")
    print("-" * (len(head) + 40))
    for r in rows:
        counts = f"{r.counts[0]}x{len(r.counts)}" if r.counts and len(set(r.counts)) == 1 else str(r.counts[:2])
        print(
            f"{r.client:9} {r.mode:10} {r.target:14} {r.ok:>3} {r.errored:>3} {_f(r.ttft_ms):>8} "
            f"{_f(r.itl_ms):>7} {_f(r.output_tps, '{:.2f}'):>9}  {counts:24} {r.check or r.note}"
        )


if __name__ == "__main__":
    raise SystemExit(main())
