"""Strict mode reads every text-bearing field, through the real gateway app against an engine that
leaks (docs/design.md, "Strict mode reads every text-bearing field").

A victim tenant's passage (300-odd tokens, a canary inside) is indexed at its admission; the
engine then puts it into one field of one choice of a strict tenant's answer: ``content``,
``reasoning_content``, ``reasoning``, ``refusal``, ``tool_calls[].function.name`` and
``.arguments`` (streamed as fragments), legacy ``function_call``, completions ``text``, logprob
token strings, and a field kvgate does not know by name; whole and streamed; n=1, and n=2 with the leak in the second choice, one word per
event, interleaved with the first. Every victim word carries the marker ``zq``, which nothing
else the gateway or engine sends contains, so "0 victim bytes received" is checked on the exact
bytes the client received. The same answers with a clean passage arrive whole (so the test can
fail). Then the cases an attacker would plant: a self-planted canary sent back as token ids with
``echo``, a token-id prompt cut inside a UTF-8 character echoed with its canary, and an abandoned
stream followed by a turn whose usage says 1 prompt token against kvgate's 624.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import time

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from config.models import TenantConfig, TenantsFile
from tests.fixtures.leak_stack import leak_stack
from tokenizer import bundled_counter
from verifier.probe import filler_words
from verifier.service import VerifierService

SECRETS = {"leak_index_key": b"fields-leak-key", "cache_salt_key": b"fields-salt", "admin_key": b"fields-admin"}
COUNTER = bundled_counter()
MARK = "zq"
SELF_CANARY = "KVGATE-CANARY-00112233deadbeef"
FIELDS_CHAT = [
    "content",
    "reasoning_content",
    "reasoning",
    "refusal",
    "tool_arguments",
    "tool_name",
    "function_call",
    "logprobs",
    "unknown",
]
FIELDS_COMPLETIONS = ["text", "text_logprobs"]


def key_of(tid: str) -> str:
    return f"sk-fields-{tid}"


def tenant_file() -> TenantsFile:
    out = []
    for tid, strict, rate in (("victim", False, 0.0), ("s", True, 1.0), ("a", False, 1.0), ("b", True, 1.0)):
        out.append(
            TenantConfig(
                id=tid,
                api_key_sha256=[hashlib.sha256(key_of(tid).encode()).hexdigest()],
                strict_verify=strict,
                verify_sample_rate=rate,
                max_tokens_cap=512,
            )
        )
    out.append(
        TenantConfig(id="c", api_key_sha256=[hashlib.sha256(key_of("c").encode()).hexdigest()], max_tokens_cap=512)
    )
    return TenantsFile(tenants=out)


def victim_passage(seed: int = 1) -> tuple[str, list[str]]:
    """About 330 tokens of marked words (``zq<word>``), the self-planted-looking canary inside."""
    rng = random.Random(seed)
    words = [MARK + rng.choice(filler_words()) for _ in range(160)]
    words.insert(80, "KVGATE-CANARY-0f1e2d3c4b5a6978")
    return " ".join(words), words


def clean_passage() -> list[str]:
    rng = random.Random(99)
    return [rng.choice(filler_words()) for _ in range(160)]


class LeakState:
    """What the engine answers: ``words`` (the passage) in ``field`` of choice ``leak_choice`` of
    ``n`` choices; other choices say ``other`` words. ``echo``: answers to ``echo: true`` start
    with ``echo_text`` (or the prompt). ``usage_prompt_tokens``: what usage reports (else the
    bundled count of the prompt)."""

    def __init__(self) -> None:
        self.field = "content"
        self.words: list[str] = ["ok"]
        self.n = 1
        self.leak_choice = 0
        self.echo_text: str | None = None
        self.usage_prompt_tokens: int | None = None
        self.slow_seconds = 0.0
        self.prefill_seconds: float | None = None
        self.cached_tokens: int | None = 0
        #: answer with an error whose message is ``error_text``: ``http`` (a 400), ``in_200`` (an
        #: error object under 200), ``stream_first`` (a stream's first event), ``stream_after``
        #: (after the words' events); ``None``: no error
        self.error_mode: str | None = None
        self.error_text = ""
        self.requests: list[dict] = []


def _prompt_text(body: dict) -> tuple[str, int]:
    if "messages" in body:
        text = "\n".join(m["content"] for m in body["messages"] if isinstance(m.get("content"), str))
        return text, COUNTER.count_chat(body["messages"])
    p = body["prompt"]
    if isinstance(p, list):
        return COUNTER.decode(p), len(p)
    return p, len(COUNTER.encode_text(p))


def _message(field: str, text: str, pieces: list[str] | None = None) -> tuple[dict, dict | None]:
    """A message/delta carrying ``text`` in ``field``, and the choice's logprobs."""
    if field == "content":
        return {"content": text}, None
    if field in ("reasoning_content", "reasoning"):
        return {"content": "", field: text}, None
    if field == "refusal":
        return {"content": None, "refusal": text}, None
    if field == "tool_arguments":
        return {"content": None, "tool_calls": [{"index": 0, "function": {"arguments": text}}]}, None
    if field == "tool_name":
        return {"content": None, "tool_calls": [{"index": 0, "function": {"name": text}}]}, None
    if field == "function_call":
        return {"content": None, "function_call": {"arguments": text}}, None
    if field == "logprobs":
        return {"content": ""}, {
            "content": [{"token": t, "logprob": -0.5, "top_logprobs": []} for t in pieces or [text]]
        }
    if field == "unknown":  # a field kvgate does not know by name: still text, still checked
        return {"content": "", "x_note": text}, None
    raise ValueError(field)


def _pieces(words: list[str]) -> list[str]:
    return [w if i == 0 else " " + w for i, w in enumerate(words)]


def build_engine(st: LeakState) -> Starlette:
    async def completion(request: Request) -> Response:
        body = await request.json()
        st.requests.append(body)
        chat = request.url.path.endswith("/chat/completions")
        prompt, n_prompt = _prompt_text(body)
        if st.slow_seconds:
            await asyncio.sleep(st.slow_seconds)
        n = int(body.get("n") or 1)
        usage = {
            "prompt_tokens": st.usage_prompt_tokens if st.usage_prompt_tokens is not None else n_prompt,
            "completion_tokens": 5,
            "total_tokens": n_prompt + 5,
        }
        if st.cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": st.cached_tokens}
        echo = st.echo_text if st.echo_text is not None else prompt
        error = {"error": {"message": st.error_text, "type": "BadRequestError", "param": st.error_text, "code": 400}}
        if st.error_mode in ("http", "in_200"):
            return JSONResponse(error, status_code=400 if st.error_mode == "http" else 200)
        # the other choices say as many words as the leaking one: interleaved one word per event
        choice_words = [st.words if i == st.leak_choice else clean_passage()[: len(st.words)] for i in range(n)]
        field = st.field
        if not body.get("stream"):
            choices = []
            for i, words in enumerate(choice_words):
                text = " ".join(words)
                f = field if i == st.leak_choice else ("content" if chat else "text")
                if chat:
                    msg, lp = _message(f, text, _pieces(words))
                    c = {"index": i, "message": {"role": "assistant", **msg}, "finish_reason": "stop"}
                    if lp:
                        c["logprobs"] = lp
                else:
                    c = {"index": i, "text": (echo if body.get("echo") else "") + text, "finish_reason": "stop"}
                    if f == "text_logprobs":
                        c["text"] = "ok"
                        c["logprobs"] = {"tokens": _pieces(words), "token_logprobs": [-0.1] * len(words)}
                choices.append(c)
            obj = {"id": "x1", "object": "chat.completion" if chat else "text_completion", "choices": choices}
            obj["usage"] = usage
            headers = {"x-prefill-seconds": f"{st.prefill_seconds:.6f}"} if st.prefill_seconds is not None else None
            return JSONResponse(obj, headers=headers)

        def event(i: int, piece: str, f: str, first: bool) -> bytes:
            if chat:
                if f == "tool_name" or f == "tool_arguments":
                    msg, lp = _message(f, piece)
                    if first:
                        tc = msg["tool_calls"][0]
                        tc.update({"id": f"call_{i}", "type": "function"})
                        tc["function"].setdefault("arguments" if f == "tool_name" else "name", "")
                else:
                    msg, lp = _message(f, piece, [piece])
                c = {"index": i, "delta": msg, "finish_reason": None}
                if lp:
                    c["logprobs"] = lp
            else:
                c = {"index": i, "text": piece, "finish_reason": None}
                if f == "text_logprobs":
                    c["text"] = ""
                    c["logprobs"] = {"tokens": [piece], "token_logprobs": [-0.1]}
            obj = {"id": "x1", "object": "chat.completion.chunk" if chat else "text_completion", "choices": [c]}
            return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"

        async def gen():
            if st.error_mode == "stream_first":
                yield b"data: " + json.dumps(error).encode() + b"\n\n"
            if body.get("echo") and not chat:
                yield event(0, echo, "text", True)
            per = [_pieces(w) for w in choice_words]
            for k in range(max(len(p) for p in per)):
                for i, p in enumerate(per):
                    if k < len(p):
                        f = field if i == st.leak_choice else ("content" if chat else "text")
                        yield event(i, p[k], f, k == 0)
            if st.error_mode == "stream_after":
                yield b"data: " + json.dumps(error).encode() + b"\n\n"
            fin = {"id": "x1", "choices": [{"index": i, "delta": {}, "finish_reason": "stop"} for i in range(n)]}
            if not chat:
                fin["choices"] = [{"index": i, "text": "", "finish_reason": "stop"} for i in range(n)]
            yield b"data: " + json.dumps(fin).encode() + b"\n\n"
            if (body.get("stream_options") or {}).get("include_usage"):
                yield b"data: " + json.dumps({"id": "x1", "choices": [], "usage": usage}).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    async def server_info(request: Request) -> Response:
        return JSONResponse({"max_total_num_tokens": 16384, "context_length": 8192, "status": "ok"})

    return Starlette(
        routes=[
            Route("/server_info", server_info),
            Route("/v1/chat/completions", completion, methods=["POST"]),
            Route("/v1/completions", completion, methods=["POST"]),
        ]
    )


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fields")
    st = LeakState()
    # the victim's passage is indexed at its admission (the engine answers it harmlessly)
    passage, _ = victim_passage()
    st.words = ["ok"]
    victim = (key_of("victim"), "Please keep this: " + passage)
    verifier = {"strict_holdback_tokens": 64, "quarantine_min_prompt_tokens": 1024}
    with leak_stack(tmp, build_engine(st), tenant_file(), SECRETS, victim, **verifier) as (svc, client):
        yield st, svc, client


def _send(client: httpx.Client, tid: str, body: dict, *, chat: bool) -> tuple[int, bytes]:
    """Status and the exact bytes the client received."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    h = {"authorization": f"Bearer {key_of(tid)}"}
    if body.get("stream"):
        with client.stream("POST", path, json=body, headers=h) as r:
            return r.status_code, b"".join(r.iter_raw())
    r = client.post(path, json=body, headers=h)
    return r.status_code, r.content


def _body(chat: bool, stream: bool, n: int) -> dict:
    b: dict = {"model": "m", "max_tokens": 400, "stream": stream, "n": n}
    if chat:
        b["messages"] = [{"role": "user", "content": "Tell me about the weather."}]
    else:
        b["prompt"] = "Tell me about the weather."
    return b


def _field_text(raw: bytes, stream: bool, choice: int) -> str:
    """Every text-bearing field of ``choice`` the client received, in order (the parser under
    test is not used to read it: plain JSON walking)."""
    objs = []
    if stream:
        for line in raw.split(b"\n"):
            if line.startswith(b"data: {"):
                objs.append(json.loads(line[6:]))
    else:
        objs.append(json.loads(raw))
    out = []
    for o in objs:
        for c in o.get("choices") or ():
            if c.get("index") != choice:
                continue
            m = c.get("message") or c.get("delta") or {}
            for k in ("content", "reasoning_content", "reasoning", "refusal", "x_note"):
                if isinstance(m.get(k), str):
                    out.append(m[k])
            for tc in m.get("tool_calls") or ():
                out += [v for v in (tc.get("function") or {}).values() if isinstance(v, str)]
            if isinstance(m.get("function_call"), dict):
                out += [v for v in m["function_call"].values() if isinstance(v, str)]
            if isinstance(c.get("text"), str):
                out.append(c["text"])
            lp = c.get("logprobs") or {}
            out += [t["token"] for t in lp.get("content") or () if isinstance(t, dict)]
            out += [t for t in lp.get("tokens") or () if isinstance(t, str)]
    return "".join(out)


CASES = [(f, True) for f in FIELDS_CHAT] + [(f, False) for f in FIELDS_COMPLETIONS]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("field,chat", CASES, ids=[c[0] for c in CASES])
def test_strict_tenant_receives_no_victim_byte_in_any_field(stack, field, chat, stream, n):
    st, svc, client = stack
    _, words = victim_passage()
    st.field, st.n, st.leak_choice = field, n, n - 1
    # the clean control: the same shape with a clean passage arrives, every word of it
    st.words = clean_passage()
    status, raw = _send(client, "s", _body(chat, stream, n), chat=chat)
    assert status == 200
    assert _field_text(raw, stream, n - 1).endswith(" ".join(clean_passage()))
    # the leak: 0 victim bytes received, the response withheld
    st.words = words
    before = svc.stats["withheld"]
    status, raw = _send(client, "s", _body(chat, stream, n), chat=chat)
    assert MARK.encode() not in raw and b"KVGATE-CANARY" not in raw
    if stream and status == 200:  # cut after the response started: an error event ends it
        assert raw.endswith(b"data: [DONE]\n\n") and b'"code":"response_withheld"' in raw
    elif stream:  # withheld before any event left (events with only logprob or unknown text start none)
        assert status == 502 and json.loads(raw)["error"]["code"] == "response_withheld"
        assert field in ("logprobs", "text_logprobs", "unknown")
    else:
        assert status == 502 and json.loads(raw)["error"]["code"] == "response_withheld"
    assert svc.stats["withheld"] == before + 1
    # evidence from one source tenant: incidents, never a quarantine
    assert not svc.quarantine.records()


def _wait_idle(svc: VerifierService) -> None:
    deadline = time.monotonic() + 20
    while svc.queued_jobs or svc.stats["in_flight"]:
        assert time.monotonic() < deadline
        time.sleep(0.01)


@pytest.mark.timeout(60)
def test_self_planted_canary_and_echoed_shingles_quarantine_nothing(stack):
    """Tenant a sends the canary as text; strict tenant b sends the same as token ids with
    echo, and a long text of a's as token ids with echo: no incident, nothing withheld, nothing
    quarantined; a third tenant's long prompt is served."""
    st, svc, client = stack
    n_inc = len(svc.incidents.recent)
    text = f"note {SELF_CANARY}"
    long_text = " ".join(random.Random(5).choice(filler_words()) for _ in range(400))
    st.field, st.n, st.leak_choice, st.words = "text", 1, 0, ["fine"]
    for prompt in (text, long_text):
        assert _send(client, "a", {"model": "m", "prompt": prompt, "max_tokens": 8}, chat=False)[0] == 200
        for stream in (False, True):
            body = {"model": "m", "prompt": COUNTER.encode_text(prompt), "echo": True, "max_tokens": 8}
            body["stream"] = stream
            status, raw = _send(client, "b", body, chat=False)
            assert status == 200 and _field_text(raw, stream, 0) == prompt + "fine"
    _wait_idle(svc)
    assert svc.incidents.recent[n_inc:] == []
    assert not svc.quarantine.records()
    long_prompt = " ".join(random.Random(6).choice(filler_words()) for _ in range(1500))
    assert _send(client, "c", {"model": "m", "prompt": long_prompt, "max_tokens": 8}, chat=False)[0] == 200


@pytest.mark.timeout(60)
def test_token_id_prompt_cut_inside_a_character_echoed_with_a_canary(stack):
    """A token-id prompt whose last id ends inside a UTF-8 character; the first streamed delta
    echoes the whole prompt (the character completed) with a canary another tenant registered:
    the strict tenant receives every byte, nothing is recorded."""
    st, svc, client = stack
    n_inc = len(svc.incidents.recent)
    full = f"note {SELF_CANARY} " + " ".join(random.Random(7).choice(filler_words()) for _ in range(90)) + " 日本語"
    ids = COUNTER.encode_text(full)
    cut = next(i for i in range(len(ids) - 1, 0, -1) if COUNTER.decode(ids[:i]).endswith("\ufffd"))
    assert _send(client, "a", {"model": "m", "prompt": full, "max_tokens": 8}, chat=False)[0] == 200
    st.field, st.n, st.leak_choice, st.words, st.echo_text = "text", 1, 0, ["and", "more"], full
    try:
        body = {"model": "m", "prompt": ids[:cut], "echo": True, "stream": True, "max_tokens": 8}
        status, raw = _send(client, "b", body, chat=False)
    finally:
        st.echo_text = None
    assert status == 200 and _field_text(raw, True, 0) == full + "and more"
    assert b"response_withheld" not in raw
    _wait_idle(svc)
    assert svc.incidents.recent[n_inc:] == []


@pytest.mark.timeout(60)
def test_abandoned_stream_then_next_turn_with_wrong_usage(stack):
    """A strict streamed turn abandoned after its first bytes, the next turn at once, whose usage
    says 1 prompt token against kvgate's 624: a usage_drift incident (reported, never withheld:
    the strict tenant gets its whole answer) that names the second turn; the abandoned turn left
    no incident."""
    st, svc, client = stack
    n_inc = len(svc.incidents.recent)
    ids = COUNTER.encode_text(" ".join(random.Random(8).choice(filler_words()) for _ in range(700)))[:624]
    st.field, st.n, st.leak_choice = "text", 1, 0
    st.words = [f"w{i}" for i in range(120)]
    st.slow_seconds = 0.0
    h = {"authorization": f"Bearer {key_of('b')}", "x-request-id": "turn-1"}
    with client.stream(
        "POST", "/v1/completions", json={"model": "m", "prompt": ids, "stream": True, "max_tokens": 200}, headers=h
    ) as r:
        assert r.status_code == 200
        next(r.iter_raw())  # the first bytes, then the client leaves
    st.usage_prompt_tokens = 1
    try:
        body = {
            "model": "m",
            "prompt": ids,
            "stream": True,
            "max_tokens": 200,
            "stream_options": {"include_usage": True},
        }
        h2 = {"authorization": f"Bearer {key_of('b')}", "x-request-id": "turn-1"}  # the same id, as a client may
        with client.stream("POST", "/v1/completions", json=body, headers=h2) as r:
            status, raw = r.status_code, b"".join(r.iter_raw())
    finally:
        st.usage_prompt_tokens = None
    assert status == 200 and _field_text(raw, True, 0) == " ".join(st.words)
    assert b'"prompt_tokens": 1,' in raw and b"response_withheld" not in raw
    _wait_idle(svc)
    new = svc.incidents.recent[n_inc:]
    assert [(i.detector, i.withheld) for i in new] == [("usage_drift", False)]
    ev = new[0].evidence
    assert (ev["gateway_prompt_tokens"], ev["engine_prompt_tokens"], ev["difference_tokens"]) == (624, 1, -623)


@pytest.mark.timeout(90)
def test_poisoned_calibration_still_flags_a_leak_and_an_honest_cache_hit_passes(stack):
    """Whole answers, TTFT from the engine's x-prefill-seconds: 3,000-token prompts calibrated
    honestly at about 0.8 s by three tenants (a, and the strict s and b), then tenant a sends 49 prefix-cache hits (4 ms, the
    usage saying 2,990 tokens cached) and one honest answer. A strict answer in 20 ms with
    nothing cached is withheld (latency); a strict cache hit in 4 ms is served. With the cached
    count left out, a's hits poison nothing either (one tenant of three: upper median), and the same
    20 ms answer is an alert, served."""
    st, svc, client = stack
    rng = random.Random(11)
    text = " ".join(rng.choice(filler_words()) for _ in range(3200))
    ids = COUNTER.encode_text(text)[:3000]
    assert len(ids) == 3000
    body = {"model": "m", "prompt": ids, "max_tokens": 8}
    st.field, st.n, st.leak_choice, st.words = "text", 1, 0, ["fine"]
    try:
        st.cached_tokens = 0
        for i in range(50):  # honest calibration: three tenants (latency_min_tenants), 0.80-0.85 s
            st.prefill_seconds = 0.80 + rng.random() * 0.05
            assert _send(client, ("a", "s", "b")[i % 3], body, chat=False)[0] == 200
        for i in range(50):  # a's poisoning: 49 cache hits, one honest
            st.cached_tokens, st.prefill_seconds = (0, 0.81) if i == 25 else (2990, 0.004)
            assert _send(client, "a", body, chat=False)[0] == 200
        _wait_idle(svc)
        n_inc = len(svc.incidents.recent)
        bound = svc.latency.bound("leak", 3000, "whole", "m")
        assert bound == pytest.approx(0.40, rel=0.05)  # 0.5 x the honest ~0.80 s
        st.cached_tokens, st.prefill_seconds = 0, 0.020  # the leak
        status, raw = _send(client, "b", body, chat=False)
        assert status == 502 and json.loads(raw)["error"]["code"] == "response_withheld"
        st.cached_tokens, st.prefill_seconds = 2990, 0.004  # an honest cache hit
        status, raw = _send(client, "b", body, chat=False)
        assert status == 200 and _field_text(raw, False, 0) == "fine"
        # the engine says nothing about its cache: a's 49 fast answers land in the 3,000 bucket
        st.cached_tokens = None
        for _ in range(49):
            st.prefill_seconds = 0.004
            _send(client, "a", body, chat=False)
        _wait_idle(svc)
        assert svc.latency.bound("leak", 3000, "whole", "m") == pytest.approx(0.40, rel=0.05)
        st.prefill_seconds = 0.020
        status, raw = _send(client, "b", body, chat=False)
        assert status == 200  # unknown cached count: alert, not withheld
        _wait_idle(svc)
        lat = [
            (i.tenant, i.withheld, i.evidence["cached_tokens"])
            for i in svc.incidents.recent[n_inc:]
            if i.detector == "latency"
        ]
        assert lat[:1] == [("b", True, 0)] and ("b", False, None) in lat
        assert not [
            i
            for i in svc.incidents.recent[n_inc:]
            if i.detector == "latency" and i.tenant == "b" and i.evidence["cached_tokens"] == 2990
        ]
    finally:
        st.cached_tokens, st.prefill_seconds = 0, None


STRICT_ENGINE_ERROR = {
    "message": "The upstream engine answered an error (400); its message is not shown under strict verification.",
    "type": "invalid_request_error",
    "param": None,
    "code": None,
}


@pytest.mark.parametrize("mode", ["http", "in_200", "stream_first", "stream_after"])
def test_an_engine_error_carries_no_unchecked_text_to_a_strict_tenant(stack, mode):
    """The engine puts the victim's passage into its error message and param: as a 400, as an
    error object under 200, as a stream's first event and after the stream's text. The strict
    tenant gets the status and the gateway's own message, 0 victim bytes; after the text, the
    error event comes after the text's events, as the engine sent them (a strict stream's
    hold-back once let it overtake them). A tenant without strict verification gets the engine's
    message (so the test can fail). Before, each of the four relayed the passage to the strict
    tenant."""
    st, svc, client = stack
    passage, _ = victim_passage()
    st.error_mode, st.error_text = mode, "The secret plan: " + passage
    st.field, st.n, st.leak_choice, st.words = "content", 1, 0, clean_passage()[:40]
    stream = mode.startswith("stream")
    try:
        status, raw = _send(client, "s", _body(True, stream, 1), chat=True)
        c_status, c_raw = _send(client, "c", _body(True, stream, 1), chat=True)
    finally:
        st.error_mode = None
    assert MARK.encode() not in raw
    assert MARK.encode() in c_raw and c_status == status
    if mode == "stream_after":
        cut = raw.index(b'data: {"error"')
        assert status == 200 and raw.endswith(b"data: [DONE]\n\n") and raw.count(b'data: {"error"') == 1
        assert _field_text(raw[:cut], True, 0) == " ".join(clean_passage()[:40])  # every word came first
        assert json.loads(raw[cut + 6 : raw.index(b"\n", cut)]) == {"error": STRICT_ENGINE_ERROR}
    else:
        assert (status, json.loads(raw)) == (400, {"error": STRICT_ENGINE_ERROR})
