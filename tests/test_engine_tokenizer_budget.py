"""The bytes an ``engine`` tokenizer reads of its engine's answers are bounded per request, not per
call (:class:`tokenizer.engine_counter.ByteBudget`): the strings of one batch prompt, each asked of
the engine's ``/tokenize`` in a call of its own, share one :data:`MAX_ENGINE_BODY_BYTES` (lowered
to :data:`BUDGET` here).

The finding this file holds fixed: each call had the whole cap of its own, so a batch of N strings
let a broken or hostile engine make one request hold N times 64 MiB of answers at once (8 calls
in flight), and read them all."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import orjson
import pytest

import tokenizer.engine_counter as engine_counter
from config.models import Settings, TenantsFile
from gateway.ops.tenants import TenantRegistry, hash_key
from tests.gateway_harness import KEY_A, Gateway, closed_port_url
from tokenizer import bundled_counter
from tokenizer.engine_counter import EngineCounter
from tokenizer.errors import EngineTokenizeError

pytestmark = pytest.mark.timeout(60)

MODEL = "eng"
ENGINE = "http://engine.test"
#: the budget the tests read under (the real one is 64 MiB)
BUDGET = 1 << 20
#: the bytes of each piece an answer is streamed in (BUDGET is 16 of them)
CHUNK = 64 << 10
#: eight strings: as many calls as are in flight at once (``MAX_CONCURRENT_REQUESTS``)
PROMPTS = [f"prompt number {i} says hello" for i in range(8)]
COUNTER = bundled_counter()
#: the detail of a batch of :data:`PROMPTS` over the budget (the log's; the client reads a fixed sentence)
OVER = f"engine tokenize at {ENGINE}/tokenize answered more than {BUDGET} bytes in all to 8 calls"


def sized(n: int, count: int = 5) -> bytes:
    """A well-formed vLLM tokenize answer of exactly ``n`` bytes (``count``, padded)."""
    head, tail = b'{"count": %d, "tokens": [1], "max_model_len": 8192, "pad": "' % count, b'"}'
    return head + b"a" * (n - len(head) - len(tail)) + tail


#: a 20 MiB answer, well-formed JSON: 20 times the budget
LARGE = sized(20 << 20)


class Engine:
    """vLLM's ``POST /tokenize`` behind an ``httpx.MockTransport``: ``answer(prompt)`` is streamed
    in :data:`CHUNK`-byte pieces, each a read of its own (the other calls' reads run between
    them, as they would on the network); ``read`` counts the bytes the client actually pulled,
    ``prompts`` the prompts it was asked."""

    def __init__(self, answer: Callable[[str], bytes]) -> None:
        self.answer = answer
        self.read = 0
        self.prompts: list[str] = []

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.MockTransport(self.handle))

    async def handle(self, request: httpx.Request) -> httpx.Response:
        assert request.url == f"{ENGINE}/tokenize"
        prompt = orjson.loads(request.content)["prompt"]
        self.prompts.append(prompt)
        return httpx.Response(200, headers={"content-type": "application/json"}, content=self._pieces(prompt))

    async def _pieces(self, prompt: str) -> AsyncIterator[bytes]:
        body = self.answer(prompt)
        for at in range(0, len(body), CHUNK):
            await asyncio.sleep(0)
            piece = body[at : at + CHUNK]
            self.read += len(piece)
            yield piece


@pytest.fixture(autouse=True)
def small_budget(monkeypatch):
    monkeypatch.setattr(engine_counter, "MAX_ENGINE_BODY_BYTES", BUDGET)


@pytest.fixture(scope="module")
def gw():
    s = Settings.model_validate(
        {
            "models": [
                {
                    "id": MODEL,
                    "context_length": 8192,
                    "tokenizer": {"kind": "engine", "url": ENGINE, "engine_api": "vllm"},
                }
            ],
            "upstreams": [
                {
                    "name": "u1",
                    "api_url": f"{closed_port_url()}/v1",
                    "pool_source": "static",
                    "static_pool_tokens": 100_000,
                    "pool_urls": [],
                    "models": [MODEL],
                }
            ],
            "verifier": {"enabled": False},
        }
    )
    tenant = {"id": "tenant-a", "api_key_sha256": [hash_key(KEY_A)], "allowed_models": [MODEL]}
    g = Gateway(s, TenantRegistry(TenantsFile.model_validate({"tenants": [tenant]})), edge=True).start()
    yield g
    g.stop()


def test_a_batch_of_large_answers_reads_one_budget_in_all(gw, monkeypatch, caplog):
    """Eight strings, each answered with 20 MiB of valid JSON: the request is the client's 502
    ``upstream_unavailable``, its detail logged, once the eight calls have read the one budget
    in all. Each call in flight pulls at most one piece past it, refused before it is kept, so
    the gateway never held more than :data:`BUDGET` of answers. Before, each call read a budget
    of its own and more (eight times ``BUDGET`` and a piece each)."""
    engine = Engine(lambda prompt: LARGE)
    monkeypatch.setattr(gw.gw.models.by_name[MODEL].counter, "_client", engine.client())
    with gw.client() as c:
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": PROMPTS, "max_tokens": 5})
    assert (r.status_code, r.json()) == (
        502,
        {
            "error": {
                "message": EngineTokenizeError.CLIENT_MESSAGE,
                "type": "server_error",
                "param": None,
                "code": "upstream_unavailable",
            }
        },
    )
    assert BUDGET < engine.read <= BUDGET + len(PROMPTS) * CHUNK
    assert sorted(engine.prompts) == sorted(PROMPTS)
    logged = [rec.getMessage() for rec in caplog.records if rec.name == "kvgate.tokenizer"]
    assert logged == [f"engine tokenizer failed: {OVER!r}"]


async def test_a_batch_counts_up_to_the_budget_exactly_and_one_byte_more_is_the_engines_fault():
    """Eight answers of an eighth of the budget each fill it exactly: counted, each its own count.
    One byte more in one answer is over it: the engine's fault, though every answer is far below
    the budget alone (before, each was read against a budget of its own, and counted)."""
    counts = {p: i + 1 for i, p in enumerate(PROMPTS)}
    extra: dict[str, int] = {}
    engine = Engine(lambda p: sized(BUDGET // len(PROMPTS) + extra.get(p, 0), counts[p]))
    counter = EngineCounter(ENGINE, MODEL, api="vllm", client=engine.client())
    try:
        assert (await counter.acount_prompt(PROMPTS)).per_prompt == (1, 2, 3, 4, 5, 6, 7, 8)
        assert engine.read == BUDGET
        extra[PROMPTS[3]] = 1
        with pytest.raises(EngineTokenizeError) as ei:
            await counter.acount_prompt(PROMPTS)
        assert ei.value.detail == OVER
    finally:
        await counter.aclose()


async def test_a_batch_of_honest_small_answers_counts_exactly():
    """The honest case: eight short strings, each asked once, each count the engine's (the
    bundled tokenizer's ids here), in the batch's order."""
    engine = Engine(lambda p: orjson.dumps(_honest(p)))
    counter = EngineCounter(ENGINE, MODEL, api="vllm", client=engine.client())
    try:
        got = await counter.acount_prompt(PROMPTS)
        assert got.per_prompt == tuple(len(COUNTER.encode_text(p)) for p in PROMPTS)
        assert got.per_prompt == (6, 6, 6, 6, 6, 6, 6, 6)
        assert sorted(engine.prompts) == sorted(PROMPTS)
    finally:
        await counter.aclose()


def _honest(prompt: str) -> dict[str, Any]:
    ids = COUNTER.encode_text(prompt)
    return {"count": len(ids), "max_model_len": 8192, "tokens": ids}
