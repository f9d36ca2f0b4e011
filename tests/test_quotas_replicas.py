"""Quotas across gateway replicas: two real ``kvgate serve`` processes sharing the real Redis on
127.0.0.1:6379, in front of the mock engine (tests/mock_engine.py) that this test process runs.

Every tenant id carries a random suffix, so the keys (``kvgate:q:{tenant}:...``) are this run's
own; they are deleted at the end. The Redis-fault tests run a second pair of replicas against a
redis-server of their own, which they stop, pause and restart.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
import redis
import yaml
from quota_fixtures import SpareRedis, free_port

from gateway.cli import main as cli_main
from tests.conftest import ROOT
from tests.fixtures.engines import reset_state
from tests.fixtures.replicas import post, prompt_of, wait_until
from tests.mock_engine import MockEngine, MockState
from tokenizer import bundled_counter

pytestmark = pytest.mark.timeout(90)

MODEL = "kvgate-tiny"
REDIS_URL = "redis://127.0.0.1:6379/0"
LEASE_TTL_SECONDS = 1.5
RUN = uuid.uuid4().hex[:8]
# tenant name -> limits; ids get the run's suffix
TENANTS: dict[str, dict[str, Any]] = {
    "rpm5": {"rpm": 5},
    "tpm1000": {"tpm": 1000},
    "debit": {"tpm": 1_000_000},
    "conc2": {"max_concurrent": 2},
    "killed": {"max_concurrent": 2},
    "reload": {"rpm": 100},
    "fault1": {"rpm": 3},
    "fault2": {"rpm": 3},
    "fault3": {"rpm": 3},
}
COUNTER = bundled_counter()
KEYS = {name: "sk-test-" + secrets.token_hex(16) for name in TENANTS}


def tid(name: str) -> str:
    return f"{name}-{RUN}"


class Replica:
    """One ``kvgate serve`` process on a free port."""

    def __init__(self, config: Path, tenants: Path, workdir: Path, name: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / f"{name}.log"
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "gateway.cli",
                    "serve",
                    "--config",
                    str(config),
                    "--tenants",
                    str(tenants),
                    "--port",
                    str(self.port),
                    # one process per replica: these tests pin replica semantics (which process saw
                    # what, when); several workers per process are tests/test_gateway_workers.py's
                    "--workers",
                    "1",
                    "--log-level",
                    "warning",
                ],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def wait_ready(self, timeout: float = 45.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvgate serve exited {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/readyz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"kvgate serve not ready in {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


class Stack:
    """The mock engine, the tenants file, the keys, the config writer and the replicas."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.engine = MockEngine().start()
        self.tenants_path = workdir / "tenants.yaml"
        entries = [
            {
                "id": tid(name),
                "api_key_sha256": [hashlib.sha256(KEYS[name].encode()).hexdigest()],
                "max_tokens_cap": 512,
                "default_max_tokens": 4,
                "allowed_models": [MODEL],
                **limits,
            }
            for name, limits in TENANTS.items()
        ]
        self.tenants_path.write_text(yaml.safe_dump({"tenants": entries}, sort_keys=False))
        self.replicas: list[Replica] = []

    def config(self, name: str, redis_url: str, **quotas: Any) -> Path:
        path = self.workdir / f"{name}.yaml"
        path.write_text(
            yaml.safe_dump(
                {
                    "gateway": {"host": "127.0.0.1", "read_timeout_seconds": 30, "drain_timeout_seconds": 1},
                    "pool": {"poll_interval_seconds": 1, "max_staleness_seconds": 30},
                    "quotas": {"window_seconds": 60, "lease_ttl_seconds": LEASE_TTL_SECONDS, **quotas},
                    "redis_url": redis_url,
                    "models": [{"id": MODEL, "context_length": 8192, "tokenizer": {"kind": "bundled"}}],
                    "upstreams": [
                        {
                            "name": "mock",
                            "api_url": self.engine.api_url,
                            "pool_source": "sglang",
                            "pool_urls": [self.engine.info_url],
                            "models": [MODEL],
                        }
                    ],
                    "verifier": {"enabled": False},
                    "state_dir": str(self.workdir / "state"),
                }
            )
        )
        return path

    def start(self, config: Path, n: int) -> list[Replica]:
        new = [
            Replica(config, self.tenants_path, self.workdir, f"{config.stem}-{len(self.replicas) + i}")
            for i in range(n)
        ]
        self.replicas += new
        for r in new:
            r.wait_ready()
        return new

    def close(self) -> None:
        for r in self.replicas:  # all at once: each drains on its own
            if r.proc.poll() is None:
                r.proc.send_signal(signal.SIGTERM)
        for r in self.replicas:
            r.stop()
        self.engine.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("quota-replicas"))
    try:
        yield s
    finally:
        s.close()
        r = redis.Redis.from_url(REDIS_URL)
        for name in TENANTS:
            keys = r.keys(f"kvgate:q:{{{tid(name)}}}:*")
            if keys:
                r.delete(*keys)
        r.close()


@pytest.fixture(scope="module")
def pair(stack: Stack) -> list[Replica]:
    """Two replicas sharing the real Redis."""
    return stack.start(stack.config("shared", REDIS_URL), 2)


@pytest.fixture()
def mock(stack: Stack) -> MockState:
    """The mock engine's state, reset for each test."""
    return reset_state(stack.engine)


def tpm_used(name: str) -> int:
    r = redis.Redis.from_url(REDIS_URL)
    try:
        return int(r.get(f"kvgate:q:{{{tid(name)}}}:tpm:sum") or 0)
    finally:
        r.close()


# ---------------------------------------------------------------- limits shared by replicas
def test_rpm_5_with_10_concurrent_requests_across_two_replicas(pair, mock) -> None:
    key = KEYS["rpm5"]
    with ThreadPoolExecutor(10) as pool:
        answers = list(pool.map(lambda i: post(pair[i % 2], key), range(10)))
    ok = [a for a in answers if a.status_code == 200]
    refused = [a for a in answers if a.status_code == 429]
    assert (len(ok), len(refused)) == (5, 5), [a.status_code for a in answers]
    # each admitted request's remaining requests; a round trip resent under load (its reply lost)
    # answers as of the resend, never more than its first answer said (test_quotas_races.py)
    remaining = sorted(int(a.headers["x-ratelimit-remaining-requests"]) for a in ok)
    assert remaining[0] == 0 and all(r <= i for i, r in enumerate(remaining)), remaining
    assert {a.headers["x-ratelimit-limit-requests"] for a in answers} == {"5"}
    for a in refused:
        err = a.json()["error"]
        assert (err["type"], err["code"], err["param"]) == ("rate_limit_error", "rate_limit_exceeded", None)
        assert err["message"].startswith(
            f"Rate limit reached for tenant '{tid('rpm5')}' on requests per 60s "
            "window (RPM): Limit 5, Used 5, Requested 1. Please try again in "
        )
        assert 55 <= int(a.headers["retry-after"]) <= 60
        assert a.headers["x-ratelimit-remaining-requests"] == "0"
        assert "x-ratelimit-remaining-tokens" not in a.headers  # no TPM limit: no token headers
    assert len(mock.requests) == 5  # refused requests never reached the engine


def test_tpm_1000_with_300_token_requests_alternating_replicas(pair, mock) -> None:
    content, prompt_tokens = prompt_of(280)
    max_tokens = 300 - prompt_tokens
    mock.prompt_tokens = prompt_tokens  # the engine reports exactly what it was asked for
    mock.text = " ".join(["w"] * max_tokens)  # the mock reports one completion token per word
    key = KEYS["tpm1000"]
    remaining = []
    for i in range(3):
        a = post(pair[i % 2], key, content=content, max_tokens=max_tokens)
        assert a.status_code == 200, a.text
        assert a.json()["usage"] == {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": max_tokens,
            "total_tokens": 300,
        }
        remaining.append(a.headers["x-ratelimit-remaining-tokens"])
    assert remaining == ["700", "400", "100"]
    assert wait_until(lambda: tpm_used("tpm1000") == 900, 5)
    for replica in (pair[1], pair[0]):  # the 4th would pass 1000, whichever replica receives it
        a = post(replica, key, content=content, max_tokens=max_tokens)
        assert a.status_code == 429
        assert a.json()["error"]["message"].startswith(
            f"Rate limit reached for tenant '{tid('tpm1000')}' on tokens per 60s window (TPM): Limit 1000, "
            "Used 900, Requested 300. Please try again in "
        )
        assert (a.headers["x-ratelimit-limit-tokens"], a.headers["x-ratelimit-remaining-tokens"]) == ("1000", "100")
    # a request that fits the 100 left is still admitted: the refusals took nothing
    small, small_tokens = prompt_of(20)
    mock.prompt_tokens, mock.text = small_tokens, "a b"
    a = post(pair[1], key, content=small, max_tokens=2)
    assert (a.status_code, a.headers["x-ratelimit-remaining-tokens"]) == (200, str(100 - small_tokens - 2))
    assert len(mock.requests) == 4


def test_streamed_and_whole_responses_with_the_same_usage_debit_the_same(pair, mock) -> None:
    content, prompt_tokens = prompt_of(40)
    mock.prompt_tokens, mock.text = prompt_tokens, "one two three four five six"
    key = KEYS["debit"]
    before = tpm_used("debit")
    a = post(pair[0], key, content=content, max_tokens=50)
    assert a.status_code == 200 and a.json()["usage"]["completion_tokens"] == 6
    assert wait_until(lambda: tpm_used("debit") == before + prompt_tokens + 6, 5), tpm_used("debit")
    b = post(pair[1], key, content=content, max_tokens=50, stream=True)
    assert b.status_code == 200
    assert b'"usage"' not in b.content  # the gateway asked for usage; the client did not, so it was removed
    assert b.content.endswith(b"data: [DONE]\n\n")
    assert wait_until(lambda: tpm_used("debit") == before + 2 * (prompt_tokens + 6), 5), tpm_used("debit")
    # an engine that reports no usage: the gateway counts the completion text it relayed
    text = "Tokens are counted by the gateway when the engine says nothing."
    chunk = {
        "id": "x",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": "stop"}],
    }
    mock.stream_chunks = [b"data: " + json.dumps(chunk).encode() + b"\n\n", b"data: [DONE]\n\n"]
    mid = tpm_used("debit")
    c = post(pair[0], key, content=content, max_tokens=50, stream=True)
    assert c.status_code == 200 and text.encode() in c.content
    expected = prompt_tokens + COUNTER.count_text(text)
    assert expected < prompt_tokens + 50
    assert wait_until(lambda: tpm_used("debit") == mid + expected, 5), (tpm_used("debit") - mid, expected)


def test_a_cancelled_stream_is_charged_what_was_produced(pair, mock) -> None:
    content, prompt_tokens = prompt_of(30)
    words = [f" w{i}" for i in range(40)]
    mock.prompt_tokens = prompt_tokens
    mock.chunk_interval_seconds = 0.1
    mock.stream_chunks = [
        b'data: {"id":"x","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"'
        + w.encode()
        + b'"},"finish_reason":null}]}\n\n'
        for w in words
    ] + [b"data: [DONE]\n\n"]
    key = KEYS["debit"]
    before = tpm_used("debit")
    seen = 0
    with httpx.stream(
        "POST",
        pair[1].url + "/v1/chat/completions",
        timeout=15,
        headers={"authorization": f"Bearer {key}"},
        json={"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 100, "stream": True},
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen += 1
                if seen == 5:
                    break  # the client goes away after 5 words
    reserved = prompt_tokens + 100
    # the reservation is debited at admission; the settle after the disconnect replaces it
    assert wait_until(lambda: tpm_used("debit") - before not in (0, reserved), 10)
    charged = tpm_used("debit") - before
    produced = charged - prompt_tokens
    # what was produced: some prefix of the words, at least the 5 the client saw, far less than reserved
    prefixes = {COUNTER.count_text("".join(words[:k])): k for k in range(5, 41)}
    assert produced in prefixes, (produced, sorted(prefixes))
    assert max(prefixes) < 100  # so a charge of the whole reservation could not pass as "produced"


def test_max_concurrent_2_refuses_a_third_simultaneous_request(pair, mock) -> None:
    mock.mode, mock.delay_seconds = "delay", 1.5
    key = KEYS["conc2"]
    with ThreadPoolExecutor(2) as pool:
        first = [pool.submit(post, pair[i], key) for i in range(2)]
        assert wait_until(lambda: len(mock.requests) == 2, 10)
        third = post(pair[0], key)
        assert third.status_code == 429
        assert third.headers["retry-after"] == "1"
        assert third.json()["error"]["message"] == (
            f"Rate limit reached for tenant '{tid('conc2')}' on concurrent requests: Limit 2. Please try again in 1s."
        )
        assert [f.result().status_code for f in first] == [200, 200]
    mock.mode = "ok"
    assert post(pair[1], key).status_code == 200  # the two leases were released at the end


def test_a_killed_replicas_leases_expire_and_free_the_slots(stack, pair, mock) -> None:
    (doomed,) = stack.start(stack.config("doomed", REDIS_URL), 1)
    mock.mode = "hang"
    key = KEYS["killed"]
    with ThreadPoolExecutor(2) as pool:
        held = [pool.submit(post, doomed, key, timeout=30) for _ in range(2)]
        assert wait_until(lambda: len(mock.requests) == 2, 10)
        time.sleep(LEASE_TTL_SECONDS)  # longer than a TTL: the live replica renewed its leases
        assert post(pair[0], key).status_code == 429
        doomed.kill()
        killed_at = time.monotonic()
        for f in held:
            with pytest.raises(httpx.HTTPError):
                f.result()
    mock.mode = "ok"
    assert wait_until(lambda: post(pair[1], key).status_code == 200, LEASE_TTL_SECONDS + 2, 0.2)
    assert time.monotonic() - killed_at <= LEASE_TTL_SECONDS + 2
    with ThreadPoolExecutor(2) as pool:  # both slots are free again
        mock.mode, mock.delay_seconds = "delay", 0.5
        assert [f.result().status_code for f in [pool.submit(post, pair[i], key) for i in range(2)]] == [200, 200]


def test_tenant_edits_apply_without_restart(stack, pair, mock) -> None:
    key = KEYS["reload"]
    tenants = str(stack.tenants_path)
    a = post(pair[0], key)
    assert (a.status_code, a.headers["x-ratelimit-limit-requests"]) == (200, "100")
    assert cli_main(["tenant", "set", tid("reload"), "--rpm", "2", "--tenants", tenants]) == 0
    # both replicas pick the change up (the file is polled every second); answers then carry the
    # new limit, and once 2 requests are in the window both replicas refuse
    assert wait_until(lambda: all(post(r, key).headers.get("x-ratelimit-limit-requests") == "2" for r in pair), 5, 0.2)
    assert [post(r, key).status_code for r in pair] == [429, 429]
    # key rotation: the new key works, the revoked one gets 401, on both replicas
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert cli_main(["tenant", "add-key", tid("reload"), "--tenants", tenants]) == 0
    new_key = buf.getvalue().strip()
    assert cli_main(["tenant", "revoke-key", tid("reload"), key, "--tenants", tenants]) == 0
    for r in pair:
        assert wait_until(lambda r=r: post(r, key).status_code == 401, 5, 0.2)
        a = post(r, new_key)  # same tenant, same window: still refused, now by RPM, not by auth
        assert (a.status_code, a.json()["error"]["code"]) == (429, "rate_limit_exceeded")
    KEYS["reload"] = new_key


# ---------------------------------------------------------------- Redis faults, two replicas
def _assert_503_fast(replica: Replica, key: str) -> None:
    t0 = time.monotonic()
    a = post(replica, key)
    elapsed = time.monotonic() - t0
    assert a.status_code == 503, (a.status_code, a.text)
    assert a.json()["error"] == {
        "message": "The quota store is unavailable, so the request cannot be admitted. Please try again shortly.",
        "type": "server_error",
        "param": None,
        "code": "quota_backend_unavailable",
    }
    assert a.headers["retry-after"] == "1"
    assert elapsed < 1.0, f"decided in {elapsed:.2f}s"


def _assert_rpm_3_holds(pair: list[Replica], key: str) -> None:
    codes = [post(pair[i % 2], key).status_code for i in range(5)]
    assert codes == [200, 200, 200, 429, 429]


def _recovered(pair: list[Replica], key: str) -> bool:
    """True once each replica answers 200. That proves one worker of each has seen Redis again; a
    worker whose last call failed still decides by the policy for up to 0.5 s (docs/quotas.md,
    "Redis back: Redis decides again within 0.5 s"), so callers then wait out that window."""
    if not all(post(r, key).status_code == 200 for r in pair):
        return False
    time.sleep(0.6)  # every worker's fail-fast window (PROBE_INTERVAL_SECONDS = 0.5 s) has passed
    return True


def test_redis_stopped_then_paused_fails_closed_within_1s_and_limits_resume(stack, mock, tmp_path) -> None:
    spare = SpareRedis(tmp_path)
    spare.start()
    try:
        fpair = stack.start(stack.config("faulty", spare.url), 2)
        _assert_rpm_3_holds(fpair, KEYS["fault1"])
        probe = KEYS["debit"]  # unlimited RPM: used only to see when Redis answers again
        # stopped: connection refused
        spare.kill()
        for i in range(6):
            _assert_503_fast(fpair[i % 2], KEYS["fault2"])
            time.sleep(0.3)
        spare.start()
        assert wait_until(lambda: _recovered(fpair, probe), 10, 0.2)
        _assert_rpm_3_holds(fpair, KEYS["fault2"])
        # paused: the kernel accepts, Redis never answers
        spare.pause()
        try:
            for i in range(6):
                _assert_503_fast(fpair[i % 2], KEYS["fault3"])
                time.sleep(0.3)
        finally:
            spare.resume()
        assert wait_until(lambda: _recovered(fpair, probe), 10, 0.2)
        _assert_rpm_3_holds(fpair, KEYS["fault3"])  # the refused requests were not counted
        for r in fpair:
            assert "quota store redis unavailable" in r.log()
            assert "answers again" in r.log()
    finally:
        spare.close()
