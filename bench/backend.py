"""Backend benchmark: prefill and decode tokens/s, paged KV cache vs a contiguous-KV run of the same
model and batch, on CPU (and CUDA when present), printed as one side-by-side table with ratios.

    .venv/bin/python bench/backend.py [--batch 8] [--prompt-tokens 512] [--decode-tokens 64] [--device cpu,cuda]
    .venv/bin/python bench/backend.py --real-model .kvgate/models/smollm2-135m-instruct --decode-tokens 32

Structure: one function per scenario, each returning :class:`Row` s (a name, a device and a dict of
columns); :func:`print_table` prints any rows with the union of their columns, plus ratio columns
against the baseline row of the same device. New scenarios (e.g. the disaggregated runs) append
functions to :data:`SCENARIOS`; they may fill other columns (``req/s``, ``s/request``).
Not a test: numbers vary with the machine; nothing here asserts speed.
"""

from __future__ import annotations

import os
import sys

# Run as ``python bench/backend.py``: bench/ must not shadow stdlib modules (bench/tokenize.py would
# replace ``tokenize``), so drop the script folder from the path and put the repository root first.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import argparse
import asyncio
import concurrent.futures
import time
from dataclasses import dataclass, field
from typing import Callable

import torch  # noqa: E402

from gpu_backend.attention import ContiguousAttention, ContiguousKVCache, PagedAttention, SeqSpan  # noqa: E402
from gpu_backend.kv_pool import KVPool  # noqa: E402
from gpu_backend.weights import build_model  # noqa: E402


@dataclass
class Row:
    """One benchmark result: ``columns`` maps a column name to a number (tokens/s, seconds...)."""

    scenario: str
    device: str
    columns: dict[str, float] = field(default_factory=dict)


@dataclass
class Setup:
    """Workload shared by every scenario of one run."""

    batch: int = 8
    prompt_tokens: int = 512
    decode_tokens: int = 64
    page_size: int = 16
    model: str = "tiny-random"
    context_length: int = 8192
    repeats: int = 3  # interleaved rounds; each scenario call = one warm-up + one timed run


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _prompts(s: Setup) -> list[list[int]]:
    return [[1000 + (b * 7919 + i * 31) % 50_000 for i in range(s.prompt_tokens)] for b in range(s.batch)]


def _run_model(s: Setup, device: torch.device, make_attn: Callable[[list[SeqSpan]], object]) -> dict[str, float]:
    """Greedy prefill of the whole batch in one pass, then ``decode_tokens`` batched decode steps;
    one warm-up, then one timed run."""
    model = build_model(s.model, s.context_length, 0, torch.float32, device)
    prompts = _prompts(s)
    pages_per_seq = -(-(s.prompt_tokens + s.decode_tokens) // s.page_size)
    best_prefill = best_decode = float("inf")
    with torch.inference_mode():
        for rep in range(2):
            spans = [
                SeqSpan(list(range(b * pages_per_seq, (b + 1) * pages_per_seq)), 0, s.prompt_tokens, s.prompt_tokens)
                for b in range(s.batch)
            ]
            ids = torch.tensor([t for p in prompts for t in p], device=device)
            _sync(device)
            t0 = time.perf_counter()
            attn = make_attn(spans)
            h = model(ids, attn)
            last = torch.arange(1, s.batch + 1, device=device) * s.prompt_tokens - 1
            nxt = model.compute_logits(h[last]).argmax(-1)
            _sync(device)
            t_prefill = time.perf_counter() - t0
            steps = 3 if rep == 0 else s.decode_tokens
            t0 = time.perf_counter()
            for j in range(steps):
                spans = [SeqSpan(sp.pages, s.prompt_tokens + j, 1, s.prompt_tokens) for sp in spans]
                attn = make_attn(spans)
                nxt = model.compute_logits(model(nxt, attn)).argmax(-1)
            _sync(device)
            t_decode = time.perf_counter() - t0
            if rep:
                best_prefill, best_decode = min(best_prefill, t_prefill), min(best_decode, t_decode)
    return {
        "prefill tok/s": s.batch * s.prompt_tokens / best_prefill,
        "decode tok/s": s.batch * s.decode_tokens / best_decode,
    }


def scenario_core_paged(s: Setup, device: torch.device) -> list[Row]:
    """The engine's path: K/V written to and gathered from a paged pool through page tables."""
    pages = s.batch * -(-(s.prompt_tokens + s.decode_tokens) // s.page_size)
    model = build_model(s.model, s.context_length, 0, torch.float32, device)
    layers, kv_heads, head_dim = model.kv_geometry
    pool = KVPool(pages, s.page_size, layers, kv_heads, head_dim, torch.float32, device)
    cols = _run_model(s, device, lambda spans: PagedAttention(pool, spans))
    return [Row("core: paged KV", str(device), cols)]


def scenario_core_contiguous(s: Setup, device: torch.device) -> list[Row]:
    """Baseline: the same model and batch over one contiguous [B, max_len] cache per layer."""
    model = build_model(s.model, s.context_length, 0, torch.float32, device)
    layers, kv_heads, head_dim = model.kv_geometry
    cache = ContiguousKVCache(
        layers, s.batch, s.prompt_tokens + s.decode_tokens, kv_heads, head_dim, torch.float32, device
    )
    cols = _run_model(s, device, lambda spans: ContiguousAttention(cache, spans))
    return [Row("core: contiguous KV (baseline)", str(device), cols)]


def scenario_core_engine(s: Setup, device: torch.device) -> list[Row]:
    """The full single engine (scheduler, sampling, detokenization, asyncio bridge): ``generate``
    for the whole batch at once; decode tok/s counts the tokens after the first."""
    from gpu_backend.engine import Engine, EngineConfig
    from gpu_backend.sampling import SamplingParams

    async def run() -> dict[str, float]:
        eng = Engine(
            EngineConfig(
                model=s.model,
                device=str(device),
                context_length=s.context_length,
                max_total_tokens=s.batch * (s.prompt_tokens + s.decode_tokens + s.page_size),
                max_batch_tokens=s.batch * s.prompt_tokens,
            )
        )
        await eng.start()
        try:
            firsts: list[float] = []

            async def one(i: int, prompt: list[int]) -> None:
                n = 0
                async for _ in eng.generate(
                    f"b{i}", prompt, SamplingParams(max_new_tokens=s.decode_tokens + 1, ignore_eos=True)
                ):
                    n += 1
                    if n == 1:
                        firsts.append(time.perf_counter())

            await asyncio.gather(*(one(i, p) for i, p in enumerate(_prompts(s)[:2])))  # warm-up
            best: dict[str, float] = {}
            for _ in range(1):
                firsts.clear()
                t0 = time.perf_counter()
                await asyncio.gather(*(one(i, p) for i, p in enumerate(_prompts(s))))
                t1 = time.perf_counter()
                t_first = max(firsts)
                got = {
                    "prefill tok/s": s.batch * s.prompt_tokens / (t_first - t0),
                    "decode tok/s": s.batch * s.decode_tokens / (t1 - t_first),
                    "s/request": t1 - t0,
                }
                best = {k: (max if "tok/s" in k else min)(v, best.get(k, v)) for k, v in got.items()}
        finally:
            await eng.stop()
        return best

    return [Row("core: Engine.generate (paged)", str(device), asyncio.run(run()))]


# ---- disaggregated runs (issue 4): the same batch through the router's HTTP API -----------------
_BACKENDS: dict[tuple[str, str], "_Backend"] = {}


class _Backend:
    """``python -m gpu_backend`` processes on free loopback ports (``all``: one process; ``three``:
    decode, prefill, router), started once per run and stopped at exit."""

    def __init__(self, kind: str, s: Setup, device: torch.device) -> None:
        import atexit
        import socket
        import subprocess

        def port() -> int:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                return sock.getsockname()[1]

        root = os.path.dirname(_HERE)
        env = {**os.environ, "PYTHONPATH": root}
        env.pop("KVGATE_FAULTS", None)
        prefill_pool = s.batch * (s.prompt_tokens + s.page_size)
        decode_pool = s.batch * (s.prompt_tokens + s.decode_tokens + 2 * s.page_size)
        common = [
            "--model",
            s.model,
            "--device",
            str(device),
            "--context-length",
            str(s.context_length),
            "--page-size",
            str(s.page_size),
            "--log-level",
            "error",
        ]
        self.procs: list[subprocess.Popen] = []

        def spawn(*args: str) -> None:
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "gpu_backend", *args, *common],
                    cwd=root,
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )

        if kind == "all":
            p = port()
            spawn(
                "--role",
                "all",
                "--port",
                str(p),
                "--prefill-max-total-tokens",
                str(prefill_pool),
                "--decode-max-total-tokens",
                str(decode_pool),
            )
            self.urls = [f"http://127.0.0.1:{p}"]
        else:
            pp, dp, rp = port(), port(), port()
            spawn("--role", "decode", "--port", str(dp), "--max-total-tokens", str(decode_pool))
            spawn(
                "--role",
                "prefill",
                "--port",
                str(pp),
                "--max-total-tokens",
                str(prefill_pool),
                "--decode-url",
                f"http://127.0.0.1:{dp}",
            )
            spawn(
                "--role",
                "router",
                "--port",
                str(rp),
                "--prefill-url",
                f"http://127.0.0.1:{pp}",
                "--decode-url",
                f"http://127.0.0.1:{dp}",
            )
            self.urls = [f"http://127.0.0.1:{x}" for x in (rp, pp, dp)]
        self.url = self.urls[0]
        atexit.register(self.stop)
        self._wait()

    def _wait(self) -> None:
        import httpx

        deadline = time.monotonic() + 120
        for u in self.urls:
            while True:
                if any(p.poll() is not None for p in self.procs):
                    raise RuntimeError("a backend process exited at start-up")
                try:
                    if httpx.get(u + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{u} never became healthy")
                time.sleep(0.2)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except Exception:  # noqa: BLE001
                p.kill()


def _disagg(kind: str, label: str, s: Setup, device: torch.device) -> list[Row]:
    """The whole batch at once through ``/generate`` (streamed, greedy, ``ignore_eos``): prefill
    tok/s up to the last request's first token, decode tok/s after it, s/request (arrival to last
    token, all requests concurrent), and total tokens/s."""
    import httpx
    import orjson

    key = (kind, str(device))
    if key not in _BACKENDS:
        _BACKENDS[key] = _Backend(kind, s, device)
    url = _BACKENDS[key].url

    async def run() -> dict[str, float]:
        firsts: list[float] = []
        async with httpx.AsyncClient(base_url=url, timeout=600) as c:

            async def one(prompt: list[int], n: int) -> None:
                body = {
                    "input_ids": prompt,
                    "stream": True,
                    "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
                }
                async with c.stream("POST", "/generate", content=orjson.dumps(body)) as r:
                    r.raise_for_status()
                    seen = False
                    async for chunk in r.aiter_bytes():
                        if not seen and chunk:
                            seen = True
                            firsts.append(time.perf_counter())

            await asyncio.gather(*(one(p, 3) for p in _prompts(s)[:2]))  # warm-up
            firsts.clear()
            t0 = time.perf_counter()
            await asyncio.gather(*(one(p, s.decode_tokens + 1) for p in _prompts(s)))
            t1 = time.perf_counter()
        t_first = max(firsts)
        return {
            "prefill tok/s": s.batch * s.prompt_tokens / (t_first - t0),
            "decode tok/s": s.batch * s.decode_tokens / (t1 - t_first),
            "s/request": t1 - t0,
            "tokens/s": s.batch * (s.prompt_tokens + s.decode_tokens + 1) / (t1 - t0),
        }

    return [Row(label, str(device), asyncio.run(run()))]


def scenario_disagg_all(s: Setup, device: torch.device) -> list[Row]:
    """``--role all``: prefill and decode engines in one process, in-process transfer, HTTP API."""
    return _disagg("all", "disagg: --role all (1 process)", s, device)


def scenario_disagg_three(s: Setup, device: torch.device) -> list[Row]:
    """Three processes: router, prefill node, decode node; KV over HTTP (safetensors + manifest)."""
    return _disagg("three", "disagg: router + prefill + decode (3 processes)", s, device)


#: (function, is_baseline). Disaggregated scenarios are appended after these.
SCENARIOS: list[tuple[Callable[[Setup, torch.device], list[Row]], bool]] = [
    (scenario_core_contiguous, True),
    (scenario_core_paged, False),
    (scenario_core_engine, False),
    (scenario_disagg_all, False),
    (scenario_disagg_three, False),
]


def print_table(
    rows: list[Row], baselines: dict[str, Row], ratio_of: tuple[str, ...] = ("prefill tok/s", "decode tok/s")
) -> str:
    """Print (and return) a Markdown table: every column of every row, then ``x baseline`` ratios
    of ``ratio_of`` columns against the baseline row of the same device."""
    cols: list[str] = []
    for r in rows:
        cols += [c for c in r.columns if c not in cols]
    ratio_cols = [c for c in ratio_of if c in cols]
    head = ["scenario", "device"] + cols + [f"{c.split()[0]} x baseline" for c in ratio_cols]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        cells = [r.scenario, r.device] + [_fmt(r.columns.get(c)) for c in cols]
        base = baselines.get(r.device)
        for c in ratio_cols:
            b = base.columns.get(c) if base else None
            v = r.columns.get(c)
            cells.append(f"{v / b:.2f}" if v and b else "")
        lines.append("| " + " | ".join(cells) + " |")
    out = "\n".join(lines)
    print(out)
    return out


def _keep_best(into: Row, new: Row) -> None:
    """Merge a repeated run into ``into``: the highest rate (``.../s``), the lowest time otherwise."""
    for k, v in new.columns.items():
        old = into.columns.get(k)
        into.columns[k] = v if old is None else (max(old, v) if "/s" in k else min(old, v))


def _fmt(v: float | None) -> str:
    if v is None:
        return ""
    return f"{v:,.0f}" if v >= 100 else f"{v:.3f}"


# ---- a real model: kvgate's engine against transformers' generate (issue 14) -----------------------
def _hf_rates(folder: str, prompt: list[int], lengths: tuple[int, ...], decode_tokens: int) -> dict[str, float]:
    """transformers ``LlamaForCausalLM`` (fp32, greedy ``generate``, its dynamic KV cache):
    prefill tok/s of one forward over ``n`` prompt tokens (each n of ``lengths``; best of 2) and
    batch-1 decode tok/s = ``decode_tokens`` / the time ``generate`` takes from its first to its last
    new token (stamped by a logits processor), after the first ``lengths[0]`` prompt tokens."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out: dict[str, float] = {}
    with torch.inference_mode():
        model(input_ids=torch.tensor([prompt[:64]]), use_cache=True)  # warm-up
        for n in lengths:
            ids = torch.tensor([prompt[:n]])
            best = float("inf")
            for _ in range(2):
                t0 = time.perf_counter()
                model(input_ids=ids, use_cache=True)
                best = min(best, time.perf_counter() - t0)
            out[f"prefill {n} tok/s"] = n / best
        ids = torch.tensor([prompt[: lengths[0]]])
        stamps: list[float] = []

        class Clock(transformers.LogitsProcessor):  # called once per generated token, before its sampling
            def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
                stamps.append(time.perf_counter())
                return scores

        kw = {"do_sample": False, "pad_token_id": 0, "logits_processor": transformers.LogitsProcessorList([Clock()])}
        model.generate(ids, max_new_tokens=2, min_new_tokens=2, **kw)  # warm-up
        stamps.clear()
        model.generate(ids, max_new_tokens=decode_tokens + 1, min_new_tokens=decode_tokens + 1, **kw)
        out["decode b1 tok/s"] = decode_tokens / (stamps[-1] - stamps[0])
    return out


def _engine_rates(
    folder: str, prompt: list[int], lengths: tuple[int, ...], decode_tokens: int, batch: int
) -> dict[str, float]:
    """kvgate's :class:`~gpu_backend.engine.Engine` on the same folder (fp32, greedy, paged KV,
    continuous batching): prefill tok/s = n / time to the first token of a 1-token generation;
    batch-1 decode tok/s = tokens after the first / time after the first; batch-``batch``
    aggregate = all sequences' tokens after their first / time from the last first token to the end."""
    from gpu_backend.engine import Engine, EngineConfig
    from gpu_backend.sampling import SamplingParams

    longest = max(lengths)

    async def run() -> dict[str, float]:
        eng = Engine(
            EngineConfig(
                model=folder,
                device="cpu",
                context_length=max(4096, longest + decode_tokens + 64),
                max_total_tokens=max(longest, batch * lengths[0]) + batch * (decode_tokens + 64),
                max_batch_tokens=max(longest, batch * lengths[0]),
            )
        )
        await eng.start()
        out: dict[str, float] = {}
        try:

            async def one(rid: str, ids: list[int], new: int, firsts: list[float]) -> int:
                n = 0
                async for _ in eng.generate(
                    rid, ids, SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
                ):
                    n += 1
                    if n == 1:
                        firsts.append(time.perf_counter())
                return n

            await one("warm", prompt[:64], 4, [])
            for n in lengths:
                best = float("inf")
                for r in range(2):
                    t0, firsts = time.perf_counter(), []
                    await one(f"p{n}-{r}", prompt[:n], 1, firsts)
                    best = min(best, firsts[0] - t0)
                out[f"prefill {n} tok/s"] = n / best
            for b in (1, batch):
                firsts: list[float] = []
                ids = [prompt[i * 7 : i * 7 + lengths[0]] for i in range(b)]
                got = await asyncio.gather(*(one(f"d{b}-{i}", ids[i], decode_tokens + 1, firsts) for i in range(b)))
                t_end = time.perf_counter()
                key = "decode b1 tok/s" if b == 1 else f"decode b{b} aggregate tok/s"
                out[key] = sum(g - 1 for g in got) / (t_end - max(firsts))
        finally:
            await eng.stop()
        return out

    return asyncio.run(run())


def real_model_main(folder: str, batch: int, decode_tokens: int, lengths: tuple[int, ...] = (512, 2048)) -> int:
    """kvgate's engine vs transformers on ``folder`` (CPU, fp32, greedy), one run, side by side,
    with the ratios the issue sets goals for (batch-1 decode >= 1.0x transformers; batch-8
    aggregate >= 4x transformers' batch-1)."""
    from gateway.stack.demo_corpus import prose
    from gpu_backend.engine import in_passing_thread
    from tokenizer.hf_counter import HFCounter

    prompt = HFCounter(folder).encode_text(prose() * 4)
    need = max(max(lengths), lengths[0] + 7 * batch)
    if len(prompt) < need:
        raise SystemExit(f"the prompt text gives {len(prompt)} tokens, {need} needed")
    print(
        f"model {folder}, CPU fp32 greedy, torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"decode {decode_tokens} tokens after a {lengths[0]}-token prompt, batch {batch} for the aggregate\n",
        flush=True,
    )
    # A B B A (transformers, engine, engine, transformers), the best of each side's two runs kept: both
    # sides get the same number of samples, and a load that drifts linearly on a shared host favours neither.
    # Each run in a thread of its own that ends with it: a thread's OpenMP team lives as long as the
    # thread, and one left on this thread would slow every parallel region of the next run (the
    # engine keeps its own torch work off its caller's thread for the same reason).
    hf_args, eng_args = (folder, prompt, lengths, decode_tokens), (folder, prompt, lengths, decode_tokens, batch)
    hf = in_passing_thread(_hf_rates, *hf_args)
    eng = in_passing_thread(_engine_rates, *eng_args)
    eng = {k: max(v, eng[k]) for k, v in in_passing_thread(_engine_rates, *eng_args).items()}
    hf = {k: max(v, hf[k]) for k, v in in_passing_thread(_hf_rates, *hf_args).items()}
    keys = [*(f"prefill {n} tok/s" for n in lengths), "decode b1 tok/s", f"decode b{batch} aggregate tok/s"]
    print("| measure | kvgate engine | transformers | ratio |\n|---|---|---|---|")
    for k in keys:
        base = hf.get(k) or hf["decode b1 tok/s"]  # the aggregate is compared with transformers' batch 1
        label = k if k in hf else f"{k} (vs transformers b1)"
        print(f"| {label} | {_fmt(eng[k])} | {_fmt(hf.get(k, base))} | {eng[k] / base:.2f}x |")
    return 0


def _profile_table(prof, title: str, steps: int, top: int = 10) -> str:
    """Markdown: the ``top`` ops by self CPU time, per step, with their share of the total."""
    ev = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in ev) or 1
    lines = [f"{title}: {total / 1000 / steps:.1f} ms self CPU per step", "", "| op | self CPU ms | share |"]
    lines.append("|---|---|---|")
    for e in ev[:top]:
        lines.append(f"| {e.key} | {e.self_cpu_time_total / 1000 / steps:.2f} | {e.self_cpu_time_total / total:.1%} |")
    return "\n".join(lines) + "\n"


def profile_main(folder: str, batch: int, context: int = 512, long_prompt: int = 2048, steps: int = 16) -> int:
    """torch profiler over the engine's own step (scheduler, runner, sampling; no worker thread, no
    asyncio): decode steps at batch 1 and ``batch`` after a ``context``-token prompt, and one
    prefill of ``long_prompt`` tokens. Prints one table of the top ops each."""
    from torch.profiler import ProfilerActivity, profile

    from gateway.stack.demo_corpus import prose
    from gpu_backend.engine import Engine, EngineConfig
    from gpu_backend.messages import AddRequest
    from gpu_backend.sampling import SamplingParams
    from tokenizer.hf_counter import HFCounter

    prompt = HFCounter(folder).encode_text(prose() * 4)
    total = long_prompt + batch * (context + steps + 64)
    budget = max(long_prompt, batch * context)
    cfg = EngineConfig(model=folder, device="cpu", context_length=4096, max_total_tokens=total, max_batch_tokens=budget)
    eng = Engine(cfg)
    eng._ready = True  # stepped by hand on this thread: no worker

    def add(rid: str, ids: list[int], new: int) -> None:
        seq = eng.admit(rid, ids, SamplingParams(max_new_tokens=new, ignore_eos=True), lambda r: None)
        eng.submit(AddRequest(seq))

    def drain() -> None:
        while eng.step():
            pass

    print(f"{torch.get_num_threads()} threads, {folder}\n")
    add("warm", prompt[:64], 4)
    drain()
    for b in (1, batch):
        for i in range(b):
            add(f"d{b}-{i}", prompt[i * 7 : i * 7 + context], steps + 8)
        for _ in range(4):  # prefill, then warm decode steps
            eng.step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                eng.step()
        print(_profile_table(prof, f"decode step, batch {b}, {context}-token context", steps))
        drain()
    add("long", prompt[:long_prompt], 1)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        eng.step()
    print(_profile_table(prof, f"prefill of {long_prompt} tokens (one step)", 1))
    drain()
    return 0


def _real_model_dispatch(args: argparse.Namespace) -> int:
    """``--real-model``: the profile, the per-step CPU times, or the side-by-side run."""
    if args.profile:
        return profile_main(args.real_model, args.batch)
    if args.step_cpu:
        from bench.step_cpu import step_cpu_main

        return step_cpu_main(args.real_model, args.batch, args.step_cpu)
    lengths = tuple(int(x) for x in args.prefill_lengths.split(","))
    return real_model_main(args.real_model, args.batch, args.decode_tokens, lengths)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds (the best is reported)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--device", default=None, help="comma-separated (default: cpu, plus cuda when available)")
    ap.add_argument(
        "--real-model",
        metavar="FOLDER",
        default=None,
        help="instead: kvgate's engine vs transformers generate on this HF folder (e.g. a pulled SmolLM2)",
    )
    ap.add_argument("--prefill-lengths", default="512,2048", help="--real-model: prompt lengths of the prefill rows")
    ap.add_argument("--profile", action="store_true", help="--real-model: torch profiler tables of the engine's steps")
    ap.add_argument(
        "--step-cpu",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="--real-model: CPU time per decode step vs transformers",
    )
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.real_model:
        return _real_model_dispatch(args)
    s = Setup(
        batch=args.batch, prompt_tokens=args.prompt_tokens, decode_tokens=args.decode_tokens, repeats=args.repeats
    )
    devices = args.device.split(",") if args.device else ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    rows: list[Row] = []
    baselines: dict[str, Row] = {}
    print(
        f"model {s.model}, batch {s.batch}, prompt {s.prompt_tokens} tokens, decode {s.decode_tokens} tokens, "
        f"page {s.page_size}, torch {torch.__version__}, {torch.get_num_threads()} CPU threads, "
        f"best of {s.repeats} interleaved rounds\n",
        flush=True,
    )
    # Rounds interleave the scenarios (load on a shared machine drifts alike for all of them); every
    # scenario runs in the same kind of thread as the engine's step loop; the best round is kept.
    best: dict[tuple[str, str], Row] = {}
    order: list[tuple[str, str]] = []
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        for _ in range(s.repeats):
            for dev in devices:
                device = torch.device(dev)
                for fn, is_base in SCENARIOS:
                    for row in pool.submit(fn, s, device).result():
                        key = (row.scenario, row.device)
                        if key not in best:
                            best[key] = row
                            order.append(key)
                            if is_base:
                                baselines.setdefault(row.device, row)
                        else:
                            _keep_best(best[key], row)
    rows = [best[k] for k in order]
    print_table(rows, baselines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
