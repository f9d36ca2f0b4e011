"""The workload the store-mode tests (tests/test_redis_cluster.py, tests/test_redis_sentinel.py)
run against 3 gateway replicas x 2 workers sharing one Redis deployment: exact RPM, TPM and
concurrency, the verifier's cross-tenant detection, and a master failover.
"""

from __future__ import annotations

import secrets
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis_servers import Gateway, gateway_settings, start_gateways, tenant_entry

from tests.fixtures.engines import reset_state as reset
from tests.fixtures.replicas import incidents, post, prompt_of, wait_until
from tests.mock_engine import MockEngine
from tokenizer import bundled_counter

MODEL = "kvgate-tiny"
UPSTREAM = "mock"
LEASE_TTL_SECONDS = 1.5
COUNTER = bundled_counter()
#: a text long enough for shingles (well over 50 tokens), unique to this run
SECRET_TEXT = (
    f"run {uuid.uuid4().hex}: the quarterly forecast for the northern warehouse lists seventeen pallets "
    "of copper wire, nine crates of ceramic insulators, and a standing order of four hundred brass "
    "fittings to be shipped every second Tuesday, invoiced to the harbour office under contract number "
    f"{uuid.uuid4().hex} with a penalty clause of two percent per day of delay beyond the agreed date."
)
#: tenant name -> limits (the failover tenants are added by each module: their slot matters)
TENANTS: dict[str, dict[str, Any]] = {
    "rpm5": {"rpm": 5},
    "tpm1000": {"tpm": 1000},
    "conc2": {"max_concurrent": 2},
    "a": {"rpm": 10**6, "verify_sample_rate": 1.0},
    "b": {"rpm": 10**6, "verify_sample_rate": 1.0},
}
UNAVAILABLE = {
    "message": "The quota store is unavailable, so the request cannot be admitted. Please try again shortly.",
    "type": "server_error",
    "param": None,
    "code": "quota_backend_unavailable",
}


@dataclass
class Deployment:
    """The gateways, the engine, the tenants' keys and the shared state dir of one module."""

    gateways: list[Gateway]
    engine: MockEngine
    workdir: Path
    keys: dict[str, str] = field(default_factory=dict)

    @property
    def state_dir(self) -> Path:
        return self.workdir / "state"


def deploy(
    workdir: Path,
    redis_url: str,
    extra_tenants: dict[str, dict[str, Any]],
    while_starting: Callable[[], None] | None = None,
    **quotas: Any,
) -> Iterator[Deployment]:
    """Start the mock engine and 3 gateways x 2 workers on ``redis_url`` (``while_starting``: see
    :func:`redis_servers.start_gateways`); stop them at the end."""
    engine = MockEngine().start()
    tenants = {**TENANTS, **extra_tenants}
    keys = {name: "sk-test-" + secrets.token_hex(16) for name in tenants}
    entries = [tenant_entry(name, keys[name], MODEL, **limits) for name, limits in tenants.items()]
    # 0.4 s, not 0.25: on 2 shared cores a first connection can take longer (the deadline,
    # 2 x 0.4 + 0.05 = 0.85 s, still decides within 1 s)
    settings = gateway_settings(
        engine,
        workdir / "state",
        redis_url,
        MODEL,
        UPSTREAM,
        lease_ttl_seconds=LEASE_TTL_SECONDS,
        redis_timeout_seconds=0.4,
        **quotas,
    )
    try:
        gws = start_gateways(workdir, settings, entries, while_starting=while_starting)
    except BaseException:
        engine.stop()
        raise
    try:
        yield Deployment(gws, engine, workdir, keys)
    finally:
        for g in gws:  # all at once: each drains on its own
            if g.proc.poll() is None:
                g.proc.send_signal(signal.SIGTERM)
        for g in gws:
            g.stop()
        engine.stop()


# ---------------------------------------------------------------------- the exact limits
def check_rpm(d: Deployment) -> None:
    """RPM 5, 12 concurrent requests over the 3 replicas: exactly 5 admitted."""
    engine = reset(d.engine)
    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(lambda i: post(d.gateways[i % 3], d.keys["rpm5"]), range(12)))
    ok = [a for a in answers if a.status_code == 200]
    refused = [a for a in answers if a.status_code == 429]
    assert (len(ok), len(refused)) == (5, 7), [(a.status_code, a.text[:200]) for a in answers]
    assert sorted(a.headers["x-ratelimit-remaining-requests"] for a in ok) == ["0", "1", "2", "3", "4"]
    for a in refused:
        assert a.json()["error"]["message"].startswith(
            "Rate limit reached for tenant 'rpm5' on requests per 60s window (RPM): Limit 5, Used 5, Requested 1."
        )
    assert len(engine.requests) == 5


def check_tpm(d: Deployment) -> None:
    """TPM 1000, requests of exactly 300 tokens on alternating replicas: 3 admitted, then 429."""
    engine = reset(d.engine)
    content, prompt_tokens = prompt_of(280)
    max_tokens = 300 - prompt_tokens
    engine.prompt_tokens, engine.text = prompt_tokens, " ".join(["w"] * max_tokens)
    remaining = []
    for i in range(3):
        a = post(d.gateways[i], d.keys["tpm1000"], content, max_tokens=max_tokens)
        assert a.status_code == 200, a.text
        assert a.json()["usage"]["total_tokens"] == 300
        remaining.append(a.headers["x-ratelimit-remaining-tokens"])
    assert remaining == ["700", "400", "100"]
    for gw in d.gateways:
        a = post(gw, d.keys["tpm1000"], content, max_tokens=max_tokens)
        assert a.status_code == 429, a.text
        assert a.json()["error"]["message"].startswith(
            "Rate limit reached for tenant 'tpm1000' on tokens per 60s window (TPM): Limit 1000, Used 900, "
            "Requested 300. Please try again in "
        )
    assert len(engine.requests) == 3


def check_concurrency(d: Deployment) -> None:
    """max_concurrent 2: two in flight on replicas 0 and 1, the third (replica 2) refused."""
    engine = reset(d.engine)
    engine.mode, engine.delay_seconds = "delay", 1.0
    key = d.keys["conc2"]
    with ThreadPoolExecutor(2) as pool:
        first = [pool.submit(post, d.gateways[i], key) for i in range(2)]
        assert wait_until(lambda: len(engine.requests) == 2, 10)
        third = post(d.gateways[2], key)
        assert (third.status_code, third.headers["retry-after"]) == (429, "1")
        assert third.json()["error"]["message"] == (
            "Rate limit reached for tenant 'conc2' on concurrent requests: Limit 2. Please try again in 1s."
        )
        assert [f.result().status_code for f in first] == [200, 200]
    engine.mode = "ok"
    assert post(d.gateways[2], key).status_code == 200  # both leases were released


def check_leak(d: Deployment, config: Path) -> None:
    """Tenant a's prompt (replica 0) handed by the engine to tenant b (replica 2): a leak-index
    incident naming a as the source."""
    from gateway.cli import main as cli_main

    engine = reset(d.engine)
    assert post(d.gateways[0], d.keys["a"], SECRET_TEXT).status_code == 200  # indexed before forwarding
    engine.text = "Sure. " + SECRET_TEXT
    assert post(d.gateways[2], d.keys["b"], "What is on the schedule today?").status_code == 200
    found = lambda: [i for i in incidents(d.state_dir) if i["detector"] == "leak_index"]  # noqa: E731
    assert wait_until(found, 15), [g.log() for g in d.gateways]
    (inc,) = found()
    assert (inc["tenant"], inc["upstream"], inc["evidence"]["source_tenant"]) == ("b", UPSTREAM, "a")
    # whether one source quarantines is the verifier's policy: start the next test from a clean view
    assert cli_main(["upstream", "--config", str(config), "clear", UPSTREAM]) in (0, 1)


# ---------------------------------------------------------------------- failover
@dataclass
class Probe:
    """One answer during a failover: seconds since the kill, status, decision seconds, the
    RPM limit header (``local_fallback`` divides it) and the error code."""

    at: float
    status: int
    seconds: float
    limit: str | None
    code: str | None


def probe(gw: Gateway, key: str, t0: float) -> Probe:
    start = time.monotonic()
    try:
        a = post(gw, key, timeout=5)
    except httpx.HTTPError as e:  # never expected: recorded so that the assertion shows it
        return Probe(start - t0, 0, time.monotonic() - start, None, type(e).__name__)
    code = a.json()["error"]["code"] if a.status_code != 200 else None
    if a.status_code == 503:
        assert a.json()["error"] == UNAVAILABLE
        assert a.headers["retry-after"] == "1"
    return Probe(start - t0, a.status_code, time.monotonic() - start, a.headers.get("x-ratelimit-limit-requests"), code)


def probe_until_recovered(
    d: Deployment,
    key: str,
    t0: float,
    healthy,
    *,
    side_key: str | None = None,
    timeout: float = 30.0,
    settle_seconds: float = 1.5,
) -> tuple[list[Probe], float, list[Probe]]:
    """Probe ``key`` round-robin over the replicas until ``healthy(probe)`` has held for
    ``settle_seconds`` (every worker's back-off has passed since). ``side_key``: a tenant probed
    on the same replica each round. Returns the probes, the recovery time (seconds from ``t0``
    to the first probe of that healthy run) and the side probes."""
    probes: list[Probe] = []
    side: list[Probe] = []
    run_start: float | None = None
    i = 0
    while time.monotonic() - t0 < timeout:
        gw = d.gateways[i % 3]
        p = probe(gw, key, t0)
        if side_key is not None:
            side.append(probe(gw, side_key, t0))
        i += 1
        probes.append(p)
        if not healthy(p):
            run_start = None
        elif run_start is None:
            run_start = p.at
        elif p.at - run_start >= settle_seconds:
            return probes, run_start, side
        time.sleep(0.02)
    pytest.fail(f"not recovered in {timeout}s: {probes[-10:]}")


def hold_two(d: Deployment, key: str, seconds: float) -> tuple[ThreadPoolExecutor, list[Any]]:
    """Two requests of ``key`` in flight (replicas 0 and 1) for ``seconds`` in the engine."""
    engine = reset(d.engine)
    engine.mode, engine.delay_seconds = "delay", seconds
    pool = ThreadPoolExecutor(2)
    held = [pool.submit(post, d.gateways[i], key) for i in range(2)]
    assert wait_until(lambda: len(engine.requests) == 2, 10)
    engine.mode = "ok"  # the probes are answered at once
    return pool, held


def check_no_lease_stranded(d: Deployment, key: str, recovered_at: float, t0: float) -> tuple[float, int]:
    """Once the store answers again, no lease of a ``max_concurrent: 2`` tenant outlives its TTL:
    within one TTL (+1 s) of ``recovered_at`` both slots are free, and then exactly two are
    handed out. Returns when the try that found them free began (seconds from ``t0``) and how
    many tries it took."""
    engine = reset(d.engine)
    tries = 0

    def two_fit() -> bool:
        nonlocal tries
        tries += 1
        engine.mode, engine.delay_seconds = "delay", 0.5
        engine.requests.clear()
        with ThreadPoolExecutor(2) as pool:
            held = [pool.submit(post, d.gateways[i], key) for i in range(2)]
            if not wait_until(lambda: len(engine.requests) == 2, 1.0):
                return False
            third = post(d.gateways[2], key)
            assert third.status_code == 429, third.text
            return [f.result().status_code for f in held] == [200, 200]

    started = time.monotonic() - t0
    while not two_fit():
        assert time.monotonic() - t0 - recovered_at <= LEASE_TTL_SECONDS + 1, (
            f"a lease outlived its TTL ({tries} tries)"
        )
        started = time.monotonic() - t0
    engine.mode = "ok"
    return started, tries
