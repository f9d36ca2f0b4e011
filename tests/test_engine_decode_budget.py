"""The verifier's decodes of a completions batch's token-id prompts through an ``engine``
tokenizer's ``/detokenize`` share one byte budget per request
(:class:`tokenizer.engine_counter.ByteBudget`, :meth:`tokenizer.engine_counter.EngineCounter.prompt_decoder`), as
the ``/tokenize`` calls of one batch prompt do (tests/test_engine_tokenizer_budget.py, whose
budget, piece size and engine URL this file reads under).

The finding this file holds fixed: each decode read up to the whole cap of its own, and the
decoded texts are kept for the request's life, so a batch of N token-id prompts let a broken or
hostile engine make one request hold N times 64 MiB of its text. A decode that fails is what it
was: not the client's fault, the request is served unchanged, the prompt's own text is known
incomplete (``own_text_complete``) and each undecoded prompt is counted as ``decode_failed``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import orjson
import pytest

from tests.gateway_harness import MODEL, SECRETS, Gateway, settings_for, tenants, upstream
from tests.test_engine_tokenizer_budget import BUDGET, CHUNK, ENGINE, small_budget  # noqa: F401  (autouse)
from verifier.build import build_verifier
from verifier.service import VerifierService

pytestmark = pytest.mark.timeout(60)

ENG = "eng"
#: eight token-id prompts (the batch), each its own ids
BATCH = [[10 + i, 20 + i, 30 + i] for i in range(8)]


def answer(text: str) -> bytes:
    """vLLM's ``/detokenize`` answer for ``text``."""
    return orjson.dumps({"prompt": text})


def sized(n: int, head: str = "") -> bytes:
    """A well-formed vLLM detokenize answer of exactly ``n`` bytes: its text ``head``, padded
    with ``x``."""
    return answer(head + "x" * (n - len(answer(head))))


def text_of(ids: list[int]) -> str:
    """The text the honest engine answers for ``ids``."""
    return " ".join(str(i) for i in ids)


#: a 20 MiB answer, well-formed JSON: 20 times the budget
LARGE = sized(20 << 20)


class Detokenizer:
    """vLLM's ``POST /detokenize`` behind an ``httpx.MockTransport``: ``reply(ids)`` is streamed in
    :data:`CHUNK`-byte pieces, each a read of its own; ``read`` counts the bytes the gateway
    actually pulled, ``asked`` the id lists it was asked, in order."""

    def __init__(self, reply: Callable[[list[int]], bytes]) -> None:
        self.reply = reply
        self.read = 0
        self.asked: list[list[int]] = []

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.MockTransport(self.handle))

    async def handle(self, request: httpx.Request) -> httpx.Response:
        assert request.url == f"{ENGINE}/detokenize"
        ids = orjson.loads(request.content)["tokens"]
        self.asked.append(ids)
        return httpx.Response(200, headers={"content-type": "application/json"}, content=self._pieces(ids))

    async def _pieces(self, ids: list[int]) -> AsyncIterator[bytes]:
        body = self.reply(ids)
        for at in range(0, len(body), CHUNK):
            await asyncio.sleep(0)
            piece = body[at : at + CHUNK]
            self.read += len(piece)
            yield piece


@pytest.fixture(scope="module")
def gw(module_engine, tmp_path_factory) -> Iterator[Gateway]:
    """A gateway on the mock engine (a static pool) whose model :data:`ENG` counts with an
    ``engine`` tokenizer at :data:`ENGINE` (vLLM paths), the verifier on (in-process stores),
    bodies of up to 128 KiB and a 32k context (a batch of thousands of ids fits both)."""
    s = settings_for(
        [
            upstream(
                "u1",
                module_engine,
                pool_source="static",
                static_pool_tokens=100_000,
                pool_urls=[],
                models=[MODEL, ENG],
            )
        ],
        models=[
            {
                "id": ENG,
                "context_length": 32768,
                "tokenizer": {"kind": "engine", "url": ENGINE, "engine_api": "vllm"},
            }
        ],
        verifier={"enabled": True},
    )
    s.gateway.max_body_bytes = 128 << 10
    s.state_dir = str(tmp_path_factory.mktemp("state"))
    registry = tenants(allowed_models=[MODEL, ENG])
    g = Gateway(s, registry, verifier=build_verifier(s, secrets=SECRETS)).start()
    yield g
    g.stop()


@pytest.fixture
def seen(gw, monkeypatch) -> list[tuple[str, bool]]:
    """``(prompt text, own text complete)`` of each exchange the verifier indexes, as its decodes
    left them."""
    svc = gw.gw.verifier
    assert isinstance(svc, VerifierService)
    got: list[tuple[str, bool]] = []
    index = svc._index_prompt

    async def spy(exchange: Any, defer_write: bool) -> Any:
        got.append((exchange.prompt_text, exchange.state.own_text_complete))
        return await index(exchange, defer_write)

    monkeypatch.setattr(svc, "_index_prompt", spy)
    return got


def ask(gw: Gateway, monkeypatch, engine: Detokenizer, prompt: Any) -> tuple[httpx.Response, int]:
    """One completions request for ``prompt`` with the model's engine calls answered by
    ``engine``: the answer, and how many decodes the verifier counted as failed for it."""
    svc = gw.gw.verifier
    assert isinstance(svc, VerifierService)
    monkeypatch.setattr(gw.gw.models.by_name[ENG].counter, "_client", engine.client())
    before = svc.stats["decode_failed"]
    with gw.client() as c:
        r = c.post("/v1/completions", json={"model": ENG, "prompt": prompt, "max_tokens": 5})
    return r, svc.stats["decode_failed"] - before


def test_a_batch_of_large_decodes_reads_one_budget_and_answers_as_one_prompt_does(gw, monkeypatch, seen):
    """One token-id prompt answered with 20 MiB: the decode stops one piece past the budget, the
    request is served as ever (200, the engine's answer), its own text unknown, one decode
    failed. Eight of them in one batch: exactly the same answer and the same bytes read, one
    budget and one piece in all: once the first answer spent it, the other seven are never
    asked, and each counts as failed, as before. Before, each decode read a budget of its own and
    a piece (eight times as much)."""
    single = Detokenizer(lambda ids: LARGE)
    r1, failed1 = ask(gw, monkeypatch, single, BATCH[0])
    batch = Detokenizer(lambda ids: LARGE)
    r8, failed8 = ask(gw, monkeypatch, batch, BATCH)
    assert (r1.status_code, failed1, single.read, single.asked) == (200, 1, BUDGET + CHUNK, [BATCH[0]])
    assert r1.json()["choices"] == [{"index": 0, "text": "Hello from the mock.", "finish_reason": "stop"}]
    assert (r8.status_code, r8.json(), failed8) == (r1.status_code, r1.json(), 8)
    assert (batch.read, batch.asked) == (BUDGET + CHUNK, [BATCH[0]])
    assert seen == [("", False), ("", False)]


def test_a_batch_decodes_up_to_the_budget_exactly_and_the_byte_over_it_is_not_kept(gw, monkeypatch, seen):
    """Eight answers of an eighth of the budget each fill it exactly: every text decoded and
    indexed, the request served. One byte more in the first answer: the eighth is over the
    budget in all (though each answer is far below it alone), its text is not kept, one decode
    failed, and the request is served as ever, its own text known incomplete. Before, each was
    read against a budget of its own and all eight were kept."""
    extra: dict[int, int] = {}

    def reply(ids: list[int]) -> bytes:
        i = BATCH.index(ids)
        return sized(BUDGET // len(BATCH) + extra.get(i, 0), head=chr(ord("a") + i) * 10)

    exact = Detokenizer(reply)
    r, failed = ask(gw, monkeypatch, exact, BATCH)
    assert (r.status_code, failed, exact.read, exact.asked) == (200, 0, BUDGET, BATCH)
    decoded = [orjson.loads(reply(ids))["prompt"] for ids in BATCH]
    extra[0] = 1
    over = Detokenizer(reply)
    r_over, failed_over = ask(gw, monkeypatch, over, BATCH)
    assert (r_over.status_code, r_over.json(), failed_over) == (200, r.json(), 1)
    assert (over.read, over.asked) == (BUDGET + 1, BATCH)
    first = orjson.loads(reply(BATCH[0]))["prompt"]
    assert len(first) == len(decoded[0]) + 1
    assert seen == [("\n".join(decoded), True), ("\n".join([first, *decoded[1:7]]), False)]


def test_an_honest_batch_of_token_id_prompts_is_decoded_and_served(gw, monkeypatch, seen):
    """The honest case: eight short token-id prompts, each decoded once, in order, and their text
    is the prompt's own; the request is served."""
    engine = Detokenizer(lambda ids: answer(text_of(ids)))
    r, failed = ask(gw, monkeypatch, engine, BATCH)
    assert (r.status_code, failed, engine.asked) == (200, 0, BATCH)
    assert r.json()["choices"] == [{"index": 0, "text": "Hello from the mock.", "finish_reason": "stop"}]
    assert seen == [("\n".join(text_of(ids) for ids in BATCH), True)]
    assert [text_of(ids) for ids in BATCH[:2]] == ["10 20 30", "11 21 31"]


#: cl100k_base's longest token: its text is 128 spaces, 128 bytes of answer for 6 bytes of body
SPACES_ID = 58040
#: eight prompts of 1,152 such ids (9,216 in all): their honest text, 1,179,648 bytes, and its
#: answers' framing are more than :data:`BUDGET`, though the ids take a fraction of one body
SPACES_BATCH = [[SPACES_ID] * 1152 for _ in range(8)]


def spaces(ids: list[int]) -> bytes:
    """The honest answer for ``ids`` of :data:`SPACES_ID`."""
    assert set(ids) == {SPACES_ID}
    return answer(" " * 128 * len(ids))


def test_an_honest_batch_whose_text_outgrows_one_cap_is_decoded_whole(gw, monkeypatch, seen):
    """The review's honest batch, at the tests' scale: each id's text is 128 spaces, so the eight
    answers hold 1,179,752 bytes, more than :data:`BUDGET`, though each prompt is well within the
    model's context. The budget is sized by the ids (9,216 of them, 768 bytes each at most:
    7,077,888 bytes), so all eight are decoded, none counted as failed, and the prompt's own
    text is whole. Before, the batch read one :data:`BUDGET`: the eighth answer went over it, its
    text was lost, one decode failed and the request's own text was marked incomplete."""
    engine = Detokenizer(spaces)
    r, failed = ask(gw, monkeypatch, engine, SPACES_BATCH)
    answers = [spaces(ids) for ids in SPACES_BATCH]
    assert sum(map(len, answers)) == 1_179_752 > BUDGET
    assert (r.status_code, failed, engine.read, engine.asked) == (200, 0, 1_179_752, SPACES_BATCH)
    assert r.json()["choices"] == [{"index": 0, "text": "Hello from the mock.", "finish_reason": "stop"}]
    assert seen == [("\n".join([" " * 128 * 1152] * 8), True)]


@pytest.mark.parametrize(
    ("batch", "limit"),
    [
        ([[SPACES_ID]] * 8, BUDGET),  # 8 ids: 6,144 bytes is less than one cap; the cap it is
        ([[SPACES_ID] * 4096] * 2, 2 * BUDGET),  # 8,192 ids: 6,291,456 bytes; at most a cap a prompt
        (SPACES_BATCH, 9216 * 768),  # 9,216 ids: 7,077,888 bytes, less than eight caps
    ],
    ids=["eight-single-ids", "a-cap-a-prompt", "by-the-ids"],
)
def test_a_hostile_batch_reads_no_more_than_its_ids_can_honestly_answer(gw, monkeypatch, seen, batch, limit):
    """Each prompt answered with 20 MiB: each answer stops one piece past its own cap
    (:data:`BUDGET`, the test's ``MAX_ENGINE_BODY_BYTES``), its bytes charged to the batch's
    budget, ``max(BUDGET, min(prompts x BUDGET, ids x 768))``; once that is spent (one piece past
    it in all) the prompts left are never asked, and each prompt counts as failed; the request is
    served as ever. Eight prompts of one id each read one :data:`BUDGET` in all, not eight."""
    engine = Detokenizer(lambda ids: LARGE)
    r, failed = ask(gw, monkeypatch, engine, batch)
    asked = -(-(limit + CHUNK) // (BUDGET + CHUNK))  # prompts of BUDGET + CHUNK each, the last cut short
    assert (r.status_code, failed, engine.read, engine.asked) == (200, len(batch), limit + CHUNK, batch[:asked])
    assert asked == {BUDGET: 1, 2 * BUDGET: 2, 9216 * 768: 7}[limit]
    assert r.json()["choices"] == [{"index": 0, "text": "Hello from the mock.", "finish_reason": "stop"}]
    assert seen == [("", False)]
