"""What verification costs: leak-index throughput, and the gateway's requests/s with verification
sampled at 100% against 0%, in one run on this machine.

1. Leak index, in process and in Redis (``$KVGATE_BENCH_REDIS_URL``, default
   ``redis://127.0.0.1:6379/0``; skipped when it does not answer), side by side:
   - ``tokenize``: cl100k encoding alone (the floor every step pays);
   - ``ingest``: a prompt -> tokens -> keyed winnowed fingerprints -> store (k = 16, w = 35);
   - ``check``: a response -> every shingle's fingerprint -> one lookup round trip -> verdict.
   Throughput in MB/s of UTF-8 text and tokens/s; the ``x tokenize`` column is the ratio to
   tokenizing alone.
2. Strict latency under an ingest flood: one strict tenant's request (admission-time ingest of
   its prompt, then the strict check of its whole response) idle, and while another tenant keeps
   ``--flood-concurrency`` (12) prompts of ``--flood-chars`` (900,000) characters in admission at
   once, repeated; median and p90 of each, and the ratio (it must stay within 2x: the flood's
   ingest runs on its own time, one of its prompts at a time, never ahead of another tenant's).
3. Gateway: ``bench/gateway.py --only gateway,verify-0,verify-100,verify-strict`` (a separate
   process; wrk or a Python load generator against a mock engine), whose table it prints.

Run: ``.venv/bin/python bench/verifier.py [--prompts 300] [--duration 5] [--rounds 3] [--skip-gateway]
[--skip-flood]``.
"""

import os
import sys

if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)  # bench/tokenize.py must not shadow the stdlib module

import argparse
import asyncio
import dataclasses
import random
import statistics
import subprocess
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from verifier.leak_index import LeakIndex, MemoryLeakStore, RedisLeakStore  # noqa: E402
from verifier.shingles import ShingleHasher, encode  # noqa: E402

SEEDS = ROOT.parent / "shared" / "seeds"


def corpus() -> str:
    """Real text: the runbook's translations when present, the gateway's demo texts, and words."""
    parts = [p.read_text() for p in sorted(SEEDS.glob("*.txt")) if p.name != "README.md"] if SEEDS.exists() else []
    parts += [p.read_text() for p in sorted((ROOT / "gateway" / "stack" / "demo_texts").glob("*.txt"))]
    rng = random.Random(0)
    words = "river stone garden window market silver morning letter bridge paper orange winter".split()
    parts.append(" ".join(rng.choice(words) for _ in range(20000)))
    return "\n\n".join(parts)


def slices(text: str, n: int, chars: int, rng: random.Random) -> list[str]:
    return [text[s : s + chars] for s in (rng.randrange(0, len(text) - chars) for _ in range(n))]


def timed(fn, items: list[str]) -> float:
    t0 = time.perf_counter()
    for x in items:
        fn(x)
    return time.perf_counter() - t0


def row(name: str, store: str, items: list[str], secs: float, tok_secs: float | None) -> str:
    mb = sum(len(x.encode()) for x in items) / 1e6
    toks = sum(len(encode(x)) for x in items)
    ratio = f"{secs / tok_secs:6.2f}" if tok_secs else "     -"
    return (
        f"{name:<10} {store:<7} {len(items):>6} {toks / len(items):>9.0f} {mb / secs:>9.2f} "
        f"{toks / secs:>12,.0f} {secs / len(items) * 1e3:>9.3f} {ratio}"
    )


def bench_index(n_prompts: int) -> None:
    text = corpus()
    rng = random.Random(1)
    prompts = slices(text, n_prompts, 8000, rng)  # ~2,000-4,000 tokens each
    responses = slices(text, n_prompts * 2, 800, rng)  # ~200-400 tokens each
    hasher = ShingleHasher(b"bench-leak-index-key", 16)
    stores: list[tuple[str, object]] = [("memory", MemoryLeakStore(3600))]
    url = os.environ.get("KVGATE_BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
    client = prefix = None
    try:
        import redis

        client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=1)
        client.ping()
        prefix = f"kvgate-bench-{uuid.uuid4().hex[:8]}:"
        stores.append(("redis", RedisLeakStore(client, 600, prefix)))
    except Exception as e:  # noqa: BLE001
        print(f"(Redis at {url} does not answer: {type(e).__name__}; in-process store only)")
        client = None
    timed(encode, prompts[:50])  # warm up the tokenizer's caches
    tok_p = timed(encode, prompts)
    tok_r = timed(encode, responses)
    print(f"leak index: k=16, w=35; {n_prompts} prompts of 8,000 characters, {len(responses)} responses of 800")
    print(
        f"{'step':<10} {'store':<7} {'items':>6} {'tok/item':>9} {'MB/s':>9} {'tokens/s':>12} {'ms/item':>9} x tokenize"
    )
    print("-" * 80)
    print(row("tokenize", "-", prompts, tok_p, None))
    try:
        for name, store in stores:
            idx = LeakIndex(store, hasher, 35)
            tenants = [f"tenant-{i}" for i in range(8)]
            i = iter(range(10**9))
            secs = timed(lambda p: idx.ingest(tenants[next(i) % 8], p), prompts)
            print(row("ingest", name, prompts, secs, tok_p))
        print(row("tokenize", "-", responses, tok_r, None))
        for name, store in stores:
            idx = LeakIndex(store, hasher, 35)
            secs = timed(lambda r: idx.check_text("tenant-x", r), responses)
            print(row("check", name, responses, secs, tok_r))
    finally:
        if client is not None and prefix:
            keys = list(client.scan_iter(match=prefix + "*", count=10000))
            for j in range(0, len(keys), 5000):
                client.delete(*keys[j : j + 5000])


def bench_flood(concurrency: int, chars: int, samples: int) -> tuple[float, float]:
    """Strict request latency (ms, median) idle and under another tenant's ingest flood."""
    import tempfile

    from config.models import ModelConfig, Settings, TenantConfig, UpstreamConfig, VerifierSettings
    from verifier.build import build_verifier
    from verifier.service import VerifierService
    from verifier.stage import Exchange, ExchangeRequest

    text = corpus()
    rng = random.Random(5)
    tmp = tempfile.mkdtemp(prefix="kvgate-bench-flood-")
    settings = Settings(
        state_dir=tmp,
        verifier=VerifierSettings(),
        models=[ModelConfig(id="m", context_length=1 << 20)],
        upstreams=[
            UpstreamConfig(
                name="up",
                api_url="http://127.0.0.1:1/v1",
                pool_source="static",
                static_pool_tokens=1 << 20,
                models=["m"],
            )
        ],
    )
    secrets = {"leak_index_key": b"bench-flood-key", "cache_salt_key": b"x", "admin_key": b"y"}
    strict = TenantConfig(id="strict", strict_verify=True)
    flooder = TenantConfig(id="flooder", verify_sample_rate=0.0)

    def exchange(t: TenantConfig, prompt: str) -> Exchange:
        request = ExchangeRequest(uuid.uuid4().hex, t, "up", "m", len(prompt) // 4, False, 0.0)
        return Exchange(request, prompt)

    async def one_strict(svc: VerifierService) -> float:
        prompt, answer = slices(text, 1, 8000, rng)[0], slices(text, 1, 1500, rng)[0]
        t0 = time.perf_counter()
        e = exchange(strict, prompt)
        e.request = dataclasses.replace(e.request, started_monotonic=time.monotonic())
        await svc.admit(e)
        await svc.begin(e).check_body(answer, usage=None, finish_reason="stop", ttft_seconds=None)
        return (time.perf_counter() - t0) * 1000

    async def run() -> tuple[list[float], list[float], int, float]:
        svc = build_verifier(settings, secrets=secrets)
        big = " " * chars
        flood_done = 0
        flood_seconds = 0.0
        idle: list[float] = []
        loaded: list[float] = []
        try:
            for _ in range(5):  # warm up
                await one_strict(svc)
            # idle and flooded phases alternate, so a change in the machine's load hits both alike
            for _phase in range(3):
                for _ in range(samples // 3 + 1):
                    idle.append(await one_strict(svc))
                    await asyncio.sleep(0.05)
                stop = asyncio.Event()

                async def flood(stop: asyncio.Event = stop) -> None:
                    nonlocal flood_done
                    while not stop.is_set():
                        await svc.admit(exchange(flooder, big))
                        flood_done += 1

                t_flood = time.perf_counter()
                tasks = [asyncio.create_task(flood()) for _ in range(concurrency)]
                await asyncio.sleep(0.3)  # the flood is in full swing
                for _ in range(samples // 3 + 1):
                    loaded.append(await one_strict(svc))
                    await asyncio.sleep(0.05)
                stop.set()
                await asyncio.gather(*tasks)
                flood_seconds += time.perf_counter() - t_flood
            return idle, loaded, flood_done, flood_done / flood_seconds
        finally:
            await svc.aclose()

    idle, loaded, n_flood, rate = asyncio.run(run())

    def q(v: list[float], p: float) -> float:
        return sorted(v)[min(len(v) - 1, int(p * len(v)))]

    print(
        f"\nstrict request under another tenant's ingest flood ({concurrency} concurrent prompts of {chars:,} "
        f"characters, repeated; {n_flood} flood prompts ingested meanwhile, {rate:.0f}/s = {rate * chars / 1e6:.0f} MB/s); "
        f"{len(loaded)} strict requests under the flood and {len(idle)} idle, in alternating phases"
    )
    print(f"{'case':<22} {'median ms':>10} {'p90 ms':>10}")
    print("-" * 44)
    print(f"{'strict, idle':<22} {statistics.median(idle):>10.2f} {q(idle, 0.9):>10.2f}")
    print(f"{'strict, ingest flood':<22} {statistics.median(loaded):>10.2f} {q(loaded, 0.9):>10.2f}")
    ratio = statistics.median(loaded) / statistics.median(idle)
    print(f"flood / idle (median): {ratio:.2f} (must stay within 2x)")
    return statistics.median(idle), statistics.median(loaded)


def bench_gateway(duration: float, rounds: int) -> None:
    print("\ngateway requests/s with verification (bench/gateway.py, a separate process):")
    cmd = [
        sys.executable,
        str(ROOT / "bench" / "gateway.py"),
        "--only",
        "gateway,verify-0,verify-100,verify-strict",
        "--duration",
        str(duration),
        "--rounds",
        str(rounds),
    ]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    out = r.stdout.strip().splitlines()
    table = [ln for ln in out if not ln.lstrip().startswith("round ")]
    print("\n".join(table))
    if r.returncode:
        print(r.stderr[-2000:])
    rps = {}
    for ln in table:
        parts = ln.split()
        if parts and parts[0] in ("gateway", "verify-0", "verify-100", "verify-strict"):
            nums = [p for p in parts[1:] if p.replace(".", "", 1).replace("-", "", 1).isdigit()]
            if len(nums) >= 3:
                rps[parts[0]] = float(nums[2])
    if "verify-0" in rps and "verify-100" in rps and rps["verify-0"]:
        print(
            f"\nverify-100 / verify-0 requests/s: {rps['verify-100'] / rps['verify-0']:.2f}"
            + (
                f"; verify-0 / gateway (verifier off): {rps['verify-0'] / rps['gateway']:.2f}"
                if rps.get("gateway")
                else ""
            )
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=300)
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip-gateway", action="store_true")
    ap.add_argument("--skip-flood", action="store_true")
    ap.add_argument("--skip-index", action="store_true")
    ap.add_argument("--flood-concurrency", type=int, default=12)
    ap.add_argument("--flood-chars", type=int, default=900_000)
    ap.add_argument("--flood-samples", type=int, default=40)
    args = ap.parse_args()
    print(f"{os.cpu_count()} CPUs")
    if not args.skip_index:
        bench_index(args.prompts)
    if not args.skip_flood:
        bench_flood(args.flood_concurrency, args.flood_chars, args.flood_samples)
    if not args.skip_gateway:
        bench_gateway(args.duration, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
