"""LiteLLM's SDK in front of kvgate, as platform teams deploy it: LiteLLM the app-facing router,
kvgate its OpenAI-compatible upstream (``model="openai/<model id>"``, ``api_base=<kvgate>/v1``,
``api_key=<tenant key>``), the engine behind kvgate.

LiteLLM (``litellm==1.108.7``, the version bench/gateway.py runs) cannot join kvgate's own
environment: it requires ``huggingface-hub<2.0`` while constraints.txt pins
``huggingface_hub==2.4.0`` (transformers 5.25.0 requires ``>=2.4.0``). scripts/ensure_tools.sh
(run by scripts/test.sh) installs it into ``.venv-litellm`` (the bench's LiteLLM virtualenv), and
the tests drive it through tests/litellm_worker.py, started there once per module.

Against the embedded stack of tests/test_sdk_openai.py (the bundled engine, real counts): a chat's
``usage.prompt_tokens`` is kvgate's ``/tokenize`` count and its text the engine's; a stream joined is
the whole answer and ends with that usage. Against the mock engine of tests/mock_api_engine.py
(what it received is countable) behind an in-process gateway: an over-length prompt, a 429, a
wrong key, embeddings, and LiteLLM's own retries, counted at the engine, in kvgate's
``kvgate_requests_total`` and in its quota store.

How LiteLLM names kvgate's errors: ``litellm/litellm_core_utils/exception_mapping_utils.py``,
``exception_type`` -> ``_map_openai_exception`` (every ``openai/`` model), which tests the error's
text before its status: ``ExceptionCheckers.is_error_str_rate_limit`` (a 429, or "rate limit" in
the text) -> ``RateLimitError``; ``ExceptionCheckers.is_error_str_context_window_exceeded`` ("this
model's maximum context length is", kvgate's ``context_length_exceeded`` wording) ->
``ContextWindowExceededError`` (a ``BadRequestError``); then by status, 401 ->
``AuthenticationError``. The upstream's headers (``Retry-After``) are kept on the exception as
``litellm_response_headers`` (``exception_type``'s last lines).

Who retries, by default: ``litellm.completion`` / ``acompletion`` hand ``max_retries`` (default 2,
``litellm/llms/openai/openai.py`` ``OpenAIChatCompletion.completion``) to the ``openai`` client,
which retries 408, 409, 429 and 5xx, sleeping the ``Retry-After`` when it is at most
``MAX_RETRY_AFTER_DELAY`` (120 s in openai 3.63; ``openai/_base_client.py`` ``_should_retry``,
``_calculate_retry_timeout``), never a 400 or 401.
``litellm.Router`` (what LiteLLM's proxy routes with) retries ``num_retries`` times (default 2,
``litellm/router.py`` ``Router.__init__``), sleeping ``Retry-After`` when it is at most 60 s
(``litellm/utils.py`` ``calculate_retry_after``). docs/gateway.md, "Behind LiteLLM", says what to set.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from config.errors import context_length_message
from config.models import QuotaSettings
from gateway.quotas.stores import LocalQuotaStore
from gateway.quotas.tenant_quotas import TenantQuotas
from gateway.stack.demo_corpus import fit_chat, prose
from gateway.stack.embedded import EmbeddedStack
from tests.gateway_harness import KEY_A, MODEL, Gateway, settings_for, tenants, upstream
from tests.mock_api_engine import COUNTER, ApiMockEngine
from tests.test_sdk_openai import demo_stack

pytestmark = [pytest.mark.timeout(120), pytest.mark.engine("api")]

ROOT = Path(__file__).resolve().parent.parent

LITELLM_VENV = ROOT / ".venv-litellm"
#: the version scripts/ensure_tools.sh installs (read from it: one place to change)
LITELLM_VERSION = re.search(r"^LITELLM_VERSION=(\S+)$", (ROOT / "scripts/ensure_tools.sh").read_text(), re.M)[1]
EMB = "embed-tiny"
LIMIT = 200  # tenant-a's max_context_tokens behind the mock engine: its effective limit
MAX_TOKENS = 8
#: LiteLLM's message prefix for errors of an ``openai/`` model (``_map_openai_exception``)
PREFIX = "OpenAIException - "


class LiteLLMError(Exception):
    """A LiteLLM call raised: ``info`` is the worker's account of the exception."""

    def __init__(self, info: dict[str, Any]) -> None:
        super().__init__(info["class"] + ": " + info["message"])
        self.info = info


class LiteLLM:
    """tests/litellm_worker.py running in the LiteLLM virtualenv; ``ok(call, **kwargs)`` returns
    the answer, ``error(call, **kwargs)`` the exception's account (each fails otherwise)."""

    def __init__(self, run_dir: Path) -> None:
        python = LITELLM_VENV / "bin" / "python"
        assert python.exists(), "LiteLLM's virtualenv is missing: scripts/ensure_tools.sh creates .venv-litellm"
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        env.update(LITELLM_LOCAL_MODEL_COST_MAP="True", NO_PROXY="127.0.0.1,localhost")
        self.log = run_dir / "litellm-worker.log"
        self._stderr = self.log.open("w")
        self.proc = subprocess.Popen(
            [str(python), str(ROOT / "tests" / "litellm_worker.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            cwd=run_dir,
            env=env,
        )
        self.ready: dict[str, Any] | None = None  # read at the first call: the import overlaps the stack's start

    @property
    def tenacity(self) -> bool:
        return bool(self._ready()["tenacity"])

    def _ready(self) -> dict[str, Any]:
        if self.ready is None:
            self.ready = self._read()
            assert (self.ready["ready"], self.ready["version"]) == ("litellm", LITELLM_VERSION), (
                f"{self.ready}: scripts/ensure_tools.sh installs litellm {LITELLM_VERSION} into .venv-litellm"
            )
        return self.ready

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError("the LiteLLM worker exited:\n" + self.log.read_text()[-4000:])
        return json.loads(line)

    def ok(self, name: str, **kwargs: Any) -> Any:
        self._ready()
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"call": name, "kwargs": kwargs}) + "\n")
        self.proc.stdin.flush()
        answer = self._read()
        if "error" in answer:
            raise LiteLLMError(answer["error"])
        return answer["ok"]

    def error(self, name: str, **kwargs: Any) -> dict[str, Any]:
        with pytest.raises(LiteLLMError) as e:
            self.ok(name, **kwargs)
        return e.value.info

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self._stderr.close()


@pytest.fixture(scope="module")
def lite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiteLLM]:
    client = LiteLLM(tmp_path_factory.mktemp("litellm"))
    yield client
    client.close()


# ------------------------------------------------------------------ the bundled engine
@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedStack]:
    """The embedded stack of tests/test_sdk_openai.py (bundled backend + ``kvgate serve``)."""
    with demo_stack(tmp_path_factory.mktemp("litellm-stack")) as s:
        yield s


DEMO_KEY = "sk-demo-a"
CHAT = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "Summarise:\n\n" + prose()[:600]},
]


def _via(stack: EmbeddedStack, **kw: Any) -> dict[str, Any]:
    """LiteLLM's arguments for the stack's model through kvgate."""
    return {"model": "openai/" + stack.model, "api_base": stack.gateway_url + "/v1", "api_key": DEMO_KEY, **kw}


def _direct(stack: EmbeddedStack, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """kvgate's own answer to ``body`` on ``path`` (no LiteLLM), as JSON."""
    r = httpx.post(stack.gateway_url + path, json=body, headers={"authorization": f"Bearer {DEMO_KEY}"}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("call", ["completion", "acompletion"])
def test_chat_usage_is_kvgates_exact_count_and_the_text_the_engines(lite, stack, call) -> None:
    count = _direct(stack, "/tokenize", {"model": stack.model, "messages": CHAT})["count"]
    body = {"model": stack.model, "messages": CHAT, "max_tokens": MAX_TOKENS, "temperature": 0}
    direct = _direct(stack, "/v1/chat/completions", body)
    r = lite.ok(call, **_via(stack, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0, max_retries=0))
    assert r["usage"]["prompt_tokens"] == count == direct["usage"]["prompt_tokens"]
    assert r["usage"]["completion_tokens"] == direct["usage"]["completion_tokens"]
    assert r["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]
    assert r["choices"][0]["message"]["content"]  # the engine produced text
    assert r["choices"][0]["finish_reason"] == direct["choices"][0]["finish_reason"]


@pytest.mark.parametrize("call", ["stream", "astream"])
def test_stream_joined_is_the_whole_answer_and_ends_with_kvgates_usage(lite, stack, call) -> None:
    count = _direct(stack, "/tokenize", {"model": stack.model, "messages": CHAT})["count"]
    args = _via(stack, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0, max_retries=0)
    whole = lite.ok("completion", **args)
    chunks = lite.ok(call, stream_options={"include_usage": True}, **args)
    text = "".join(c["choices"][0]["delta"]["content"] or "" for c in chunks if c["choices"])
    assert text == whole["choices"][0]["message"]["content"] and text
    assert [i for i, c in enumerate(chunks) if c.get("usage")] == [len(chunks) - 1]  # LiteLLM's last chunk
    usage = chunks[-1]["usage"]
    n = whole["usage"]["completion_tokens"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (count, n, count + n)
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finish == [whole["choices"][0]["finish_reason"]]


# ------------------------------------------------------------------ the mock engine
class ChargeLog(LocalQuotaStore):
    """kvgate's in-process quota store, also remembering what its window forgets: ``arrivals``
    (``time.monotonic()`` of each request's RPM/concurrency step, one per request past the key
    check), ``rpm_charges`` (requests counted against RPM) and ``tpm_charges`` (tokens reserved)."""

    def __init__(self) -> None:
        super().__init__()
        self.arrivals: list[float] = []
        self.rpm_charges = 0
        self.tpm_charges: list[int] = []

    def begin_now(self, tenant_id, limits, lease_id, window_ms, lease_ttl_ms):
        self.arrivals.append(time.monotonic())
        return super().begin_now(tenant_id, limits, lease_id, window_ms, lease_ttl_ms)

    def _admit(self, log, limits, lease_id, tokens, now, lease_ttl_ms) -> None:
        self.rpm_charges += limits.rpm is not None
        if limits.tpm is not None:
            self.tpm_charges.append(int(tokens))
        LocalQuotaStore._admit(log, limits, lease_id, tokens, now, lease_ttl_ms)


def start(engine: ApiMockEngine, window_seconds: float = 60.0, **limits: Any) -> tuple[Gateway, ChargeLog]:
    """A gateway with :data:`MODEL` and the embedding model :data:`EMB` on ``engine``, quotas in
    process over a :class:`ChargeLog` (tenant-a's ``limits``, limit :data:`LIMIT`)."""
    settings = settings_for(
        [{**upstream("u1", engine), "models": [MODEL, EMB]}],
        gateway={"max_body_bytes": 1 << 16},
        models=[{"id": EMB, "context_length": 8192, "task": "embedding"}],
        quotas={"enabled": True, "window_seconds": window_seconds},
    )
    store = ChargeLog()
    stage = TenantQuotas(QuotaSettings(window_seconds=window_seconds), store, fallback=store)
    registry = tenants(max_context_tokens=LIMIT, allowed_models=[MODEL, EMB], **limits)
    return Gateway(settings, registry, quotas=stage).start(), store


@pytest.fixture
def gateways() -> Iterator[Any]:
    """``gateways(engine, window_seconds=60, **limits)``: :func:`start`, all stopped after the test."""
    started: list[Gateway] = []

    def make(engine: ApiMockEngine, window_seconds: float = 60.0, **limits: Any) -> tuple[Gateway, ChargeLog]:
        g, store = start(engine, window_seconds, **limits)
        started.append(g)
        return g, store

    yield make
    for g in started:
        g.stop()


def to(g: Gateway, model: str = MODEL, key: str = KEY_A, **kw: Any) -> dict[str, Any]:
    return {"model": "openai/" + model, "api_base": g.url + "/v1", "api_key": key, **kw}


def answered(g: Gateway, status: int, route: str = "chat") -> int:
    """How many requests of tenant-a kvgate answered with ``status`` (``kvgate_requests_total``)."""
    labels = {"tenant": "tenant-a", "route": route, "status": str(status)}
    return int(g.gw.metrics.registry.get_sample_value("kvgate_requests_total", labels) or 0)


def rejected(g: Gateway, code: str) -> int:
    return int(g.gw.metrics.registry.get_sample_value("kvgate_rejections_total", {"reason": code}) or 0)


HELLO = [{"role": "user", "content": "Say hello."}]  # 11 tokens with the bundled tokenizer's chat template


def test_over_length_prompt_is_context_window_exceeded_with_kvgates_message_sent_once(lite, gateways, engine):
    """LiteLLM's defaults (no retry argument): the 400 reaches kvgate once, spends one RPM (kvgate
    counts a request that began), and the engine receives nothing."""
    g, store = gateways(engine, rpm=100)
    over = fit_chat(prose(), LIMIT - MAX_TOKENS + 1, COUNTER)
    e = lite.error("completion", **to(g, messages=over, max_tokens=MAX_TOKENS))
    message = context_length_message(LIMIT, LIMIT - MAX_TOKENS + 1, MAX_TOKENS, messages=True)
    assert e["class"] == "ContextWindowExceededError" and e["status_code"] == 400
    assert "litellm.exceptions.BadRequestError" in e["bases"] and "openai.BadRequestError" in e["bases"]
    assert e["message"] == (
        "litellm.ContextWindowExceededError: litellm.BadRequestError: ContextWindowExceededError: " + PREFIX + message
    )
    assert (answered(g, 400), rejected(g, "context_length_exceeded"), store.rpm_charges) == (1, 1, 1)
    assert engine.state.requests == []


def test_rpm_429_is_rate_limit_error_with_kvgates_retry_after(lite, gateways, engine):
    """``max_retries=0``: kvgate's 429 (window 60 s, Retry-After 59-60) reaches the caller at once
    instead of after LiteLLM's sleeps (below)."""
    g, store = gateways(engine, rpm=1)
    assert lite.ok("completion", **to(g, messages=HELLO, max_retries=0))["choices"][0]["message"]["content"]
    e = lite.error("acompletion", **to(g, messages=HELLO, max_retries=0))
    retry = e["headers"]["retry-after"]
    assert retry in ("59", "60")
    message = (
        "Rate limit reached for tenant 'tenant-a' on requests per 60s window (RPM): Limit 1, Used 1, "
        f"Requested 1. Please try again in {retry}s."
    )
    assert (e["class"], e["status_code"]) == ("RateLimitError", 429)
    assert "openai.RateLimitError" in e["bases"]
    assert e["message"] == "litellm.RateLimitError: RateLimitError: " + PREFIX + message
    assert e["body"] == {"message": message, "type": "rate_limit_error", "param": None, "code": "rate_limit_exceeded"}
    assert (e["headers"]["x-ratelimit-limit-requests"], e["headers"]["x-ratelimit-remaining-requests"]) == ("1", "0")
    assert (answered(g, 200), answered(g, 429), store.rpm_charges, len(engine.state.requests)) == (1, 1, 1, 1)


def test_wrong_key_is_authentication_error_sent_once(lite, gateways, engine):
    g, store = gateways(engine, rpm=100)
    e = lite.error("completion", **to(g, key="sk-not-a-kvgate-key", messages=HELLO))
    assert (e["class"], e["status_code"]) == ("AuthenticationError", 401)
    assert e["message"] == "litellm.AuthenticationError: AuthenticationError: " + PREFIX + "Incorrect API key provided."
    assert "sk-not-a-kvgate-key" not in json.dumps(e)
    assert (rejected(g, "invalid_api_key"), store.arrivals, engine.state.requests) == (1, [], [])


def test_embeddings_exact_usage_and_vectors(lite, gateways, engine):
    g, _ = gateways(engine)
    r = lite.ok("embedding", **to(g, EMB, input=["Say hello.", "hello world"], max_retries=0))
    assert r["usage"]["prompt_tokens"] == 3 + 2 == r["usage"]["total_tokens"]
    assert [d["embedding"] for d in r["data"]] == [[(i + 1) * (k + 1) / 8 for k in range(8)] for i in range(2)]
    assert [q["body"] for q in engine.state.requests] == [{"model": EMB, "input": ["Say hello.", "hello world"]}]


# ------------------------------------------------------------------ LiteLLM's own retries
def _gaps(store: ChargeLog) -> list[float]:
    return [b - a for a, b in zip(store.arrivals, store.arrivals[1:], strict=False)]


def test_default_sdk_sends_a_429_that_no_wait_cures_once(lite, gateways, engine):
    """A request above the whole TPM is a 429 without Retry-After and with ``x-should-retry:
    false``, which the openai client under LiteLLM's SDK obeys (``BaseClient._should_retry``):
    sent once, 1 RPM spent, no tokens, the engine untouched."""
    g, store = gateways(engine, window_seconds=1.0, rpm=100, tpm=50)
    e = lite.error("completion", **to(g, messages=HELLO, max_tokens=60))
    message = (
        "Request too large for tenant 'tenant-a' on tokens per 1s window (TPM): Limit 50, Requested 71 "
        "(prompt + max_tokens). Reduce the prompt or max_tokens."
    )
    assert (e["class"], e["message"], e["headers"].get("retry-after"), e["headers"]["x-should-retry"]) == (
        "RateLimitError",
        "litellm.RateLimitError: RateLimitError: " + PREFIX + message,
        None,
        "false",
    )
    assert (answered(g, 429), store.rpm_charges, store.tpm_charges, engine.state.requests) == (1, 1, [], [])


def test_default_sdk_waits_out_an_rpm_429_and_its_retry_is_served(lite, gateways, engine):
    """An RPM refusal costs no quota (refused before the body is read); LiteLLM sleeps its
    Retry-After (1-2 s: a 2 s window) and the retry is served: the caller sees a success, late."""
    g, store = gateways(engine, window_seconds=2.0, rpm=1)
    args = to(g, messages=HELLO, max_tokens=4)
    lite.ok("completion", **args)
    r = lite.ok("completion", **args)
    assert r["choices"][0]["message"]["content"] == engine.state.text
    assert (answered(g, 200), answered(g, 429), store.rpm_charges, len(engine.state.requests)) == (2, 1, 2, 2)
    gaps = _gaps(store)  # the first answer, the refusal, the retry
    assert len(gaps) == 2 and gaps[1] >= 1.0, gaps


def test_router_retries_a_429_twice_and_a_400_never(lite, gateways, engine):
    """``litellm.Router`` (LiteLLM's proxy) with its defaults retries a 429 twice, even one with
    ``x-should-retry: false`` (its own retry loop does not read the header), and a 400 never."""
    g, store = gateways(engine, window_seconds=1.0, rpm=100, tpm=50)
    router = {"model_list": [{"model_name": "kvgate", "litellm_params": to(g)}]}
    e = lite.error("router", router=router, model="kvgate", messages=HELLO, max_tokens=60)
    assert (e["class"], answered(g, 429), store.rpm_charges) == ("RateLimitError", 3, 3)
    over = fit_chat(prose(), LIMIT - MAX_TOKENS + 1, COUNTER)
    e = lite.error("router", router=router, model="kvgate", messages=over, max_tokens=MAX_TOKENS)
    assert (e["class"], answered(g, 400), store.rpm_charges) == ("ContextWindowExceededError", 1, 4)
    e = lite.error("router", router={**router, "num_retries": 0}, model="kvgate", messages=HELLO, max_tokens=60)
    assert (e["class"], answered(g, 429), store.rpm_charges, engine.state.requests) == ("RateLimitError", 4, 5, [])


def test_sdk_num_retries_resends_a_400_or_fails_without_tenacity(lite, gateways, engine):
    """A per-call ``num_retries`` goes to LiteLLM's own retry wrapper (``litellm/utils.py``
    ``client``), which retries every ``openai.APIError``, 400s included, through
    ``completion_with_retries`` (``litellm/main.py``), which imports ``tenacity``: LiteLLM does not
    install it (scripts/ensure_tools.sh installs LiteLLM alone). With it, the over-length request
    is sent 3 times and spends 3 RPM; without it, the caller gets a bare ``Exception`` instead of
    the ``ContextWindowExceededError``."""
    g, store = gateways(engine, rpm=100)
    over = fit_chat(prose(), LIMIT - MAX_TOKENS + 1, COUNTER)
    e = lite.error("completion", **to(g, messages=over, max_tokens=MAX_TOKENS, num_retries=2))
    if lite.tenacity:
        assert (e["class"], answered(g, 400), store.rpm_charges) == ("ContextWindowExceededError", 3, 3)
    else:
        assert (e["class"], e["message"]) == (
            "Exception",
            "tenacity import failed please run `pip install tenacity`. ErrorNo module named 'tenacity'",
        )
        assert (answered(g, 400), store.rpm_charges) == (1, 1)
    assert engine.state.requests == []
