"""A client's request id (``rid`` on ``/generate``) is a label, not an identity: a request that
failed, was aborted or whose client went away poisons nothing for a later or concurrent request with
the same id, and two requests may share an id. Over the real HTTP API (``--role all``, copy-probe)
and in process with the prefill node's real internal HTTP API (``/disagg/prefill``,
``/disagg/abort``) between router and prefill."""

from __future__ import annotations

import time

import httpx
import orjson
import pytest

from config.errors import OpenAIError, context_length_message
from gpu_backend.errors import RequestAbortedError
from gpu_backend.router import HttpPrefillClient, LocalDecodeClient, Router
from gpu_backend.servers import build_prefill_app
from gpu_backend.wire import engine_request_id
from tests.test_backend_disagg_api import COUNTER, IDS, backend, client  # noqa: F401, F811  (module fixtures)
from tests.test_backend_disagg_nodes import greedy, make_stack, prompt, wait_idle

pytestmark = pytest.mark.timeout(120)
TOO_LONG = [1000 + i for i in range(4091)]  # max_req_input_len is 4090


def _generate(client: httpx.Client, rid: str, ids: list[int], n: int) -> httpx.Response:
    body = {"input_ids": ids, "rid": rid, "sampling_params": {"max_new_tokens": n, "temperature": 0}}
    return client.post("/generate", json=body)


def _assert_served(r: httpx.Response, rid: str, ids: list[int], n: int) -> None:
    """200 with the copy-probe's answer: the prompt's first ``n`` ids, finished by length."""
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["text"], body["output_ids"]) == (COUNTER.decode(ids[:n]), ids[:n])
    mi = body["meta_info"]
    assert {k: mi[k] for k in ("id", "finish_reason", "prompt_tokens", "completion_tokens")} == {
        "id": rid,
        "finish_reason": {"type": "length", "length": n},
        "prompt_tokens": len(ids),
        "completion_tokens": n,
    }


class Stream:
    """A streamed ``/generate`` of ``n`` tokens, opened and read up to its first chunk."""

    def __init__(self, client: httpx.Client, rid: str, n: int) -> None:
        params = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
        body = {"input_ids": IDS, "rid": rid, "stream": True, "sampling_params": params}
        self.r = client.send(client.build_request("POST", "/generate", json=body), stream=True)
        assert self.r.status_code == 200
        self.lines = self.r.iter_lines()
        self.chunks = [orjson.loads(next(line for line in self.lines if line)[6:])]

    def rest(self) -> list[dict]:
        """Every chunk, the rest read to the end (``[DONE]`` left out)."""
        for line in self.lines:
            if line and line != "data: [DONE]":
                self.chunks.append(orjson.loads(line[6:]))
        self.r.close()
        return self.chunks


def test_a_rid_that_failed_is_served_right_after(backend, client):
    r = _generate(client, "job-42", TOO_LONG, 4)
    assert (r.status_code, r.json()) == (
        400,
        {
            "error": {
                "message": context_length_message(4090, 4091, 0, messages=False),
                "type": "invalid_request_error",
                "param": "prompt",
                "code": "context_length_exceeded",
            }
        },
    )
    time.sleep(0.3)  # the router's cleanup calls for the failed request have run
    for _ in range(2):
        _assert_served(_generate(client, "job-42", IDS, 4), "job-42", IDS, 4)
    backend.wait_idle()


def test_after_a_streaming_client_disconnects_the_same_rid_is_served(backend, client):
    s = Stream(client, "drop-7", 8000)
    assert s.chunks[0]["meta_info"]["finish_reason"] is None
    s.r.close()  # the client goes away mid-decode
    pools = backend.wait_idle()  # the server noticed: both sides freed the request's pages
    assert pools["prefill"]["all_free"] and pools["decode"]["all_free"], pools
    _assert_served(_generate(client, "drop-7", IDS, 5), "drop-7", IDS, 5)


def test_two_concurrent_requests_with_the_same_rid_both_complete(backend, client):
    s = Stream(client, "twin", 300)  # in flight while the second one runs
    _assert_served(_generate(client, "twin", IDS, 6), "twin", IDS, 6)
    chunks = s.rest()
    assert len(chunks) == 300 and {c["meta_info"]["id"] for c in chunks} == {"twin"}
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 300}
    assert chunks[-1]["output_ids"] == [IDS[j % len(IDS)] for j in range(300)]
    backend.wait_idle()


def test_abort_request_ends_the_live_request_and_is_not_remembered(backend, client):
    s = Stream(client, "ab-1", 8000)
    assert client.post("/abort_request", json={"rid": "ab-1"}).json() == {"rid": "ab-1", "aborted": True}
    chunks = s.rest()
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "abort", "message": "request aborted"}
    assert len(chunks) < 8000
    assert client.post("/abort_request", json={"rid": "ab-1"}).json() == {"rid": "ab-1", "aborted": False}
    _assert_served(_generate(client, "ab-1", IDS, 3), "ab-1", IDS, 3)
    pools = backend.wait_idle()
    assert all(p["all_free"] and p["all_zero"] for p in pools.values()), pools


@pytest.fixture
async def http_stack():
    """The copy-probe stack of test_backend_disagg_nodes, its router reaching prefill through the
    prefill node's real internal app (``/disagg/prefill``, ``/disagg/abort``) in process."""
    s = await make_stack()
    sent: list[dict] = []

    async def record(request: httpx.Request) -> None:
        if request.url.path == "/disagg/abort":
            sent.append(orjson.loads(request.content))

    transport = httpx.ASGITransport(app=build_prefill_app(s.pnode))
    async with httpx.AsyncClient(transport=transport, event_hooks={"request": [record]}) as c:
        s.router = Router(HttpPrefillClient("http://prefill", c, 30.0), LocalDecodeClient(s.dnode), open_timeout=30)
        yield s, sent
        await s.router.drain()
    await s.pe.stop()
    await s.de.stop()


async def test_a_failed_request_aborts_prefill_by_its_engine_id_not_the_client_id(http_stack):
    s, sent = http_stack
    with pytest.raises(OpenAIError) as e:
        await s.router.open("job-42", prompt(251), greedy(4))
    assert (e.value.status, e.value.code) == (400, "context_length_exceeded")
    await s.router.drain()
    assert len(sent) == 1 and sent[0]["request_id"] != "job-42"
    rid, _, room = sent[0]["request_id"].rpartition("@")
    assert rid == "job-42" and sent[0]["request_id"] == engine_request_id("job-42", int(room, 16))
    ok = await s.router.open("job-42", prompt(20), greedy(4))
    assert [t.token_id async for t in ok] == prompt(20)[:4]
    await wait_idle(s.pe, s.de)


async def test_a_disconnect_leaves_the_twin_with_the_same_rid_running(http_stack):
    s, sent = http_stack
    a = await s.router.open("twin", prompt(30), greedy(400))
    b = await s.router.open("twin", prompt(30, 2000), greedy(50))
    await a.__anext__()
    a.close_now()  # a's client goes away: only a's room and engine id are released
    await s.router.drain()
    toks = [t async for t in b]
    assert [t.token_id for t in toks] == prompt(30, 2000)[:30] + prompt(30, 2000)[:20]
    assert toks[-1].finish_reason == "length"
    assert [m["request_id"] for m in sent] == [engine_request_id("twin", a.room)]
    again = await s.router.open("twin", prompt(10), greedy(2))
    assert [t.token_id async for t in again] == prompt(10)[:2]
    await s.router.drain()
    await wait_idle(s.pe, s.de)
    assert s.router.inflight == {}


async def test_prefill_refuses_only_the_aborted_room(http_stack):
    """An abort that arrives before its prefill call refuses that room only (499), not the rid."""
    s, _ = http_stack
    s.pnode.abort(engine_request_id("r-pre", 7))
    with pytest.raises(RequestAbortedError) as e:
        await s.pnode.prefill(7, "r-pre", prompt(10))
    assert (e.value.status, e.value.code, e.value.message) == (499, "aborted", "request r-pre was aborted")
    ok = await s.router.open("r-pre", prompt(10), greedy(2))
    assert [t.token_id async for t in ok] == prompt(10)[:2]
    await s.router.drain()
    await wait_idle(s.pe, s.de)
