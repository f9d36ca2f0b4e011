"""What the relay hands the verifier, and what it refuses to relay, against a hostile engine
(gateway/relay/stream.py, gateway/relay/proxy.py, verifier/drift.py, verifier/latency.py):

- **usage reports that disagree within one stream**: the relay keeps each count's largest for the
  quota (gateway/relay/stream.py ``merge_usage``) and, before, handed the verifier that merged
  report alone, so ``prompt_tokens: 1`` in one chunk and the right count in another was never
  drift. Now the drift check names the disagreement (``prompt_tokens:disagree``) and the values
  reported; a stream of several prompts (vLLM reports each prompt's count, then their sum) is not
  flagged for it;
- **a choice index clients group apart** (a string, a bool, ``null``, absent, a fraction,
  negative, past the choices asked for): relayed before, read by the verifier at its position
  while the openai SDK indexes a list with it; now the stream ends with the relay's 502 for an
  answer outside the protocol (an error event once started), and a whole answer gets the 502;
- **an impossible cached count** (``cached_tokens`` negative, not an integer, above the prompt):
  the latency detector read it as "not said", so a strict answer too fast for its prompt was
  released with an alert; now it counts as nothing cached, and the answer is withheld.

Engines: the scripted engine of tests/test_verifier_hostile_engine.py behind the real gateway and
verifier, the in-process engine of tests/test_hostile_engine_round4.py (exact bytes and the quota
ledger), and the verifier service of tests/test_verifier_adversary.py for whole answers' latency.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai._models import construct_type
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from gateway.relay.stream import Tally
from tests import test_verifier_hostile_engine
from tests.gateway_harness import MODEL, chat
from tests.test_gateway_relay import error_of
from tests.test_hostile_engine_round4 import DONE, HELLO, HELLO_TOKENS, STREAM_BODY, error_event, through_gateway_as
from tests.test_verifier_adversary import SECRETS as ADVERSARY_SECRETS
from tests.test_verifier_adversary import STRICT, A, C, D, ex, settings
from tests.test_verifier_hostile_engine import (
    ABSENT,
    COUNTER,
    MARK,
    PROMPT,
    PROMPT_TOKENS,
    VICTIM,
    _drift_incidents,
    _two_choice_events,
    _withheld,
    completion_script,
    filler,
    key_of,
    pieces,
    send,
    usage,
    wait_idle,
)
from verifier.build import build_verifier
from verifier.engine_response import StreamEvent
from verifier.latency import LatencyModel, cached_tokens_of
from verifier.stage import ResponseWithheld

pytestmark = pytest.mark.timeout(60)
#: the scripted engine behind the real gateway and verifier (module-scoped: this module's own)
stack = test_verifier_hostile_engine.stack

#: the drift incident's evidence, less the request id
Evidence = dict[str, Any]


def sse(obj: Any) -> bytes:
    """An event as the scripted engine writes it (``json.dumps``' separators)."""
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def drift_evidence(svc, since: int) -> list[Evidence]:
    return [{k: v for k, v in i.evidence.items() if k != "request_id"} for i in _drift_incidents(svc, since)]


def agreed(engine: Any = PROMPT_TOKENS) -> Evidence:
    """The evidence of a stream whose reports disagreed and whose largest count is ``engine``."""
    return {
        "prompt_tokens": PROMPT_TOKENS,
        "gateway_prompt_tokens": PROMPT_TOKENS,
        "engine_prompt_tokens": engine,
        "difference_tokens": engine - PROMPT_TOKENS,
        "tolerance_tokens": 0,
        "malformed_usage": ["prompt_tokens:disagree"],
    }


# ------------------------------------------------------------------ 1. usage reports that disagree
CHUNK = {"id": "c1", "object": "text_completion", "model": "m"}


def text_chunk(text: str, finish: str | None = None, index: Any = 0, **more: Any) -> dict:
    return {**CHUNK, "choices": [{"index": index, "text": text, "finish_reason": finish}], **more}


def usage_chunk(u: dict) -> dict:
    return {**CHUNK, "choices": [], "usage": u}


@pytest.mark.parametrize("tenant", ["s", "a"], ids=["strict", "sampled"])
@pytest.mark.parametrize(
    ("reports", "reported", "largest"),
    [
        ([1, PROMPT_TOKENS], [1, PROMPT_TOKENS], PROMPT_TOKENS),  # the placeholder's count first
        ([PROMPT_TOKENS, 1], [PROMPT_TOKENS, 1], PROMPT_TOKENS),  # and last
        ([1, 3, 1, 2], [1, 3, 2], 3),  # no report right: the largest is compared, and named
        ([str(PROMPT_TOKENS), ABSENT, None, PROMPT_TOKENS], ["str", "missing", "null", PROMPT_TOKENS], PROMPT_TOKENS),
        ([True, PROMPT_TOKENS], ["bool", PROMPT_TOKENS], PROMPT_TOKENS),  # True == 1 to Python, not to a client
        ([*range(-1, -12, -1), PROMPT_TOKENS], list(range(-1, -9, -1)), PROMPT_TOKENS),  # at most 8 values kept
    ],
    ids=["placeholder-first", "placeholder-last", "none-right", "kinds", "bool", "many"],
)
def test_usage_reports_that_disagree_within_a_stream_are_named(stack, tenant, reports, reported, largest):
    """Each report but the last rides a text chunk (the client receives those, byte for byte:
    only the usage-only chunk the gateway asked for is dropped), the last is the usage chunk.
    Before: one incident only where the largest count was wrong, none naming the disagreement.
    Now one ``usage_drift`` incident naming ``prompt_tokens:disagree`` and the values reported
    (a count, or the kind of what was not one), in the order first sent."""
    sc, svc, client = stack
    *early, last = reports
    texts = [f"w{i} " for i in range(len(early))]
    sc.events = [text_chunk(t, usage=usage(p)) for t, p in zip(texts, early, strict=True)]
    sc.events += [text_chunk("", "stop"), usage_chunk(usage(last))]
    sc.done = True
    n = len(svc.incidents.recent)
    status, raw = send(client, tenant, "completions", True)
    assert (status, raw) == (200, b"".join(map(sse, sc.events[:-1])) + DONE)
    wait_idle(svc)
    assert drift_evidence(svc, n) == [{**agreed(largest), "engine_prompt_tokens_reported": reported}]
    assert [(i.tenant, i.withheld) for i in _drift_incidents(svc, n)] == [(tenant, False)]


def test_a_report_that_disagrees_beside_a_malformed_one_names_both(stack):
    """Reports of ``"9"`` then ``"12"`` (both strings: no count to merge): the malformed report
    and the disagreement, each named once, in ``usage_problems``' order."""
    sc, svc, client = stack
    sc.events = [text_chunk("Sunny", usage=usage("9")), text_chunk("", "stop"), usage_chunk(usage("12"))]
    n = len(svc.incidents.recent)
    assert send(client, "s", "completions", True)[0] == 200
    (ev,) = drift_evidence(svc, n)
    assert (ev["engine_prompt_tokens"], ev["malformed_usage"], ev["engine_prompt_tokens_reported"]) == (
        None,
        ["prompt_tokens:str", "prompt_tokens:disagree"],
        ["str"],
    )


def test_honest_continuous_usage_stats_are_no_incident(stack):
    """vLLM's ``continuous_usage_stats``: the same prompt count in every chunk, the completion
    count growing, then the usage chunk: no incident (and the same bytes relayed)."""
    sc, svc, client = stack
    sc.events = [text_chunk(t, usage=usage(completion_tokens=k + 1)) for k, t in enumerate(("Sunny", " today."))]
    sc.events += [text_chunk("", "stop", usage=usage(completion_tokens=2)), usage_chunk(usage())]
    n = len(svc.incidents.recent)
    status, raw = send(client, "s", "completions", True)
    assert (status, raw) == (200, b"".join(map(sse, sc.events[:-1])) + DONE)
    assert _drift_incidents(svc, n) == []


def test_several_prompts_reporting_their_own_counts_are_not_a_disagreement(stack):
    """``/v1/completions`` with two prompts and vLLM's continuous usage stats: each chunk reports
    its own prompt's count and the last the sum (vLLM ``serving_completion.py``,
    ``completion_stream_generator``): honest, not ``prompt_tokens:disagree``, and no drift either:
    the sum is compared with the gateway's count of both prompts (it was compared with the longest
    prompt's alone, so every honest batch was a ``usage_drift`` incident)."""
    sc, svc, client = stack
    prompts = [PROMPT, "Hi"]
    counts = [len(COUNTER.encode_text(p)) for p in prompts]
    sc.events = [text_chunk("x", index=i, usage=usage(c)) for i, c in enumerate(counts)]
    sc.events += [text_chunk("", "stop", index=i, usage=usage(c)) for i, c in enumerate(counts)]
    sc.events.append(usage_chunk(usage(sum(counts))))
    n = len(svc.incidents.recent)
    body = {"model": "m", "stream": True, "prompt": prompts, "max_tokens": 8}
    with client.stream("POST", "/v1/completions", json=body, headers={"authorization": f"Bearer {key_of('s')}"}) as r:
        assert (r.status_code, b"".join(r.iter_raw())) == (200, b"".join(map(sse, sc.events[:-1])) + DONE)
    assert drift_evidence(svc, n) == []
    sc.events[-1] = usage_chunk(usage(sum(counts) - 1))  # one token short of the batch: drift
    n = len(svc.incidents.recent)
    with client.stream("POST", "/v1/completions", json=body, headers={"authorization": f"Bearer {key_of('s')}"}) as r:
        assert r.status_code == 200 and r.read()
    assert [(e["gateway_prompt_tokens"], e["engine_prompt_tokens"]) for e in drift_evidence(svc, n)] == [
        (sum(counts), sum(counts) - 1)
    ]


def test_one_report_or_agreeing_reports_are_handed_on_as_they_are():
    """The relay's hand-off itself: no usage, one report, agreeing reports: the merged dict, not
    a disagreement (the verifier sees what it saw before)."""
    t = Tally(0.0)
    assert t.usage_to_check() is None
    one = {"prompt_tokens": 5, "completion_tokens": 1}
    t.add(StreamEvent(kind="chunk", usage=one))
    assert t.usage_to_check() is one
    t.add(StreamEvent(kind="chunk", usage={"prompt_tokens": 5, "completion_tokens": 2}))
    assert type(t.usage_to_check()) is dict and t.usage_to_check() == {"prompt_tokens": 5, "completion_tokens": 2}
    t.add(StreamEvent(kind="chunk", usage={"prompt_tokens": 5.0, "completion_tokens": 3}))  # 5.0 == 5, not a count
    checked = t.usage_to_check()
    assert (checked, checked.prompt_tokens_reported) == ({"prompt_tokens": 5, "completion_tokens": 3}, (5, "float"))


# ------------------------------------------------------------------ 2. choice indexes clients group apart
#: the 502 that ends a stream (or answers a whole answer) with a choice index outside the protocol
ODD = {
    "message": (
        "The upstream engine sent a choice whose index is not one of the choices asked for "
        "(not an integer, absent, negative or too large), which the gateway does not relay."
    ),
    "type": "server_error",
    "param": None,
    "code": "upstream_unavailable",
}
#: ``choices[0].index`` as a hostile engine sends it (request: one choice)
ODD_INDEXES: dict[str, Any] = {
    "string": "0",
    "true": True,
    "false": False,
    "null": None,
    "absent": ABSENT,
    "fraction": 0.5,
    "negative": -1,
    "past-the-choices": 1,
    "past-the-choices-float": 1.0,
    "huge-float": 1e300,
}


def chat_chunk(content: str, index: Any = 0, finish: str | None = None) -> bytes:
    choice: dict[str, Any] = {"index": index, "delta": {"content": content}, "finish_reason": finish}
    if index is ABSENT:
        del choice["index"]
    return (
        b"data: " + json.dumps({"id": "c1", "object": "chat.completion.chunk", "choices": [choice]}).encode() + b"\n\n"
    )


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "not-strict"])
@pytest.mark.parametrize("form", list(ODD_INDEXES), ids=list(ODD_INDEXES))
def test_a_stream_chunk_with_an_odd_choice_index_ends_the_stream(form, strict):
    """A chunk carrying "the secret" under an index clients group apart: relayed before (the
    verifier read it at its position, the openai SDK indexes a list with it). Now the stream
    ends there, for every tenant, as for JSON only a lax reader reads: an error event once the
    response started (the settle counts the prompt and the text relayed), a 502 before."""
    odd = chat_chunk("the secret", ODD_INDEXES[form])
    r, q, in_flight = through_gateway_as([HELLO, odd, chat_chunk("", 0, "stop"), DONE], STREAM_BODY, strict=False)
    assert (r.status_code, r.content) == (200, HELLO + error_event(ODD) + DONE)
    assert (q.settled, in_flight) == ({"r4": [11 + HELLO_TOKENS]}, [0])
    r, q, in_flight = through_gateway_as([odd, DONE], STREAM_BODY, strict=strict)
    assert (r.status_code, error_of(r)) == (502, ODD)
    assert (q.settled, in_flight) == ({"r4": [11]}, [0])


def test_integral_indexes_of_the_choices_asked_for_are_relayed_as_sent():
    """The control: ``0`` and ``0.0`` (the same number to every JSON reader) with one choice and
    the usage chunk the client asked for (``choices: []``), ``0`` and ``1`` with ``n: 2``:
    relayed byte for byte. With ``n: 2``, an index 2 ends the stream there."""
    usage_only = b'data: {"id": "c1", "choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 2}}\n\n'
    stream = HELLO + chat_chunk("there", 0.0) + chat_chunk("", 0, "stop") + usage_only + DONE
    body = chat(max_tokens=5, stream=True, stream_options={"include_usage": True})
    r, q, _ = through_gateway_as([stream], body, strict=True)
    assert (r.status_code, r.content, q.settled) == (200, stream, {"r4": [13]})
    two = [chat_chunk(t, i) for t in ("Hello", " there") for i in (0, 1)]
    two += [chat_chunk("", 0, "stop"), chat_chunk("", 1, "stop"), DONE]
    r, _, _ = through_gateway_as(two, chat(max_tokens=5, stream=True, n=2), strict=True)
    assert (r.status_code, r.content) == (200, b"".join(two))
    r, _, _ = through_gateway_as(
        [two[0], chat_chunk(" there", 2), *two[2:]], chat(max_tokens=5, stream=True, n=2), strict=True
    )
    assert (r.status_code, r.content) == (200, two[0] + error_event(ODD) + DONE)


def test_a_completions_batch_numbers_its_choices_prompt_by_prompt():
    """Two prompts, one choice each: indexes 0 and 1 are the choices asked for (vLLM numbers
    them ``prompt x n + j``); 2 is not."""
    body = {"model": MODEL, "prompt": ["Say hello.", "Say bye."], "max_tokens": 5, "stream": True}

    def chunk(i: int, text: str, finish: str | None = None) -> bytes:
        obj = {
            "id": "c1",
            "object": "text_completion",
            "choices": [{"index": i, "text": text, "finish_reason": finish}],
        }
        return b"data: " + json.dumps(obj).encode() + b"\n\n"

    stream = chunk(0, "Hi") + chunk(1, "Bye") + chunk(0, "", "stop") + chunk(1, "", "stop") + DONE
    r, _, _ = through_gateway_as([stream], body, strict=False, path="/v1/completions")
    assert (r.status_code, r.content) == (200, stream)
    r, _, _ = through_gateway_as([chunk(0, "Hi"), chunk(2, "Bye"), DONE], body, strict=False, path="/v1/completions")
    assert (r.status_code, r.content) == (200, chunk(0, "Hi") + error_event(ODD) + DONE)


def answer(index: Any) -> bytes:
    choice: dict[str, Any] = {"index": index, "message": {"role": "assistant", "content": "the secret"}}
    if index is ABSENT:
        del choice["index"]
    body = {"id": "c1", "object": "chat.completion", "choices": [{**choice, "finish_reason": "stop"}]}
    return json.dumps({**body, "usage": {"prompt_tokens": 11, "completion_tokens": 2}}).encode()


@pytest.mark.parametrize("form", list(ODD_INDEXES), ids=list(ODD_INDEXES))
def test_a_whole_answer_with_an_odd_choice_index_is_a_502(form):
    """The same refusal for a whole answer (not relayed; the settle counts the prompt)."""
    r, q, in_flight = through_gateway_as(
        [answer(ODD_INDEXES[form])], chat(max_tokens=5), strict=False, ctype="application/json"
    )
    assert (r.status_code, error_of(r)) == (502, ODD)
    assert (q.settled, in_flight) == ({"r4": [11]}, [0])


def test_a_whole_answer_with_an_integral_index_is_relayed_as_sent():
    for index in (0, 0.0):
        r, q, _ = through_gateway_as([answer(index)], chat(max_tokens=5), strict=False, ctype="application/json")
        assert (r.status_code, r.content, q.settled) == (200, answer(index), {"r4": [13]})


def sdk_choices(chunks: list[dict]) -> list[str] | str:
    """What the openai SDK's stream helper makes of ``chunks``: each choice's content, or the
    exception it raises."""
    state = ChatCompletionStreamState()
    try:
        for c in chunks:
            state.handle_chunk(construct_type(type_=ChatCompletionChunk, value={"created": 0, "model": "m", **c}))
    except Exception as e:
        return type(e).__name__
    return [c.message.content or "" for c in state.current_completion_snapshot.choices]


def test_the_openai_sdk_joins_what_the_verifier_read_apart():
    """Why the relay refuses them: choice 1's text sent under ``1`` and, by turns, ``true`` or
    ``-1``: the openai SDK's stream helper joins them into choice 1 (a list indexed by the
    value), while the verifier read ``true`` at its position (0) and ``-1`` as a choice of its
    own; a string, ``null`` or ``1.0`` makes the helper raise (its user gets no answer)."""
    for odd, joined in ((True, ["AC", "BDE"]), (-1, ["AC", "BDE"]), ("1", "TypeError"), (None, "TypeError")):
        chunks = [
            {"id": "x", "object": "chat.completion.chunk", "choices": [{"index": i, "delta": {"content": t}}]}
            for i, t in ((0, "A"), (1, "B"), (0, "C"), (odd, "D"), (1, "E"))
        ]
        assert sdk_choices(chunks) == joined, odd


def test_a_passage_split_between_index_1_and_true_is_withheld(stack):
    """Through the real verifier: choice 1's chunks say index ``1`` and ``true`` by turns. The
    verifier read ``true`` at its position, 0, so neither of its streams held the passage
    contiguously and it was released, while the openai SDK's helper joins both into choice 1.
    Now the stream ends at the first ``true``: nothing of the passage reaches the client."""
    sc, svc, client = stack
    sc.events, sc.done = _two_choice_events(pieces(VICTIM), lambda k: 1 if k % 2 else True), True
    status, raw = send(client, "s", "chat", True, n=2)
    assert (status, raw) == (
        200,
        b"data: " + json.dumps({"error": ODD}, separators=(",", ":")).encode() + b"\n\n" + DONE,
    )
    assert MARK.encode() not in raw


# ------------------------------------------------------------------ 3. an impossible cached count
#: ``prompt_tokens_details`` that says nothing can be a cache hit: -> what the latency check reads
IMPOSSIBLE_CACHED: dict[str, Any] = {
    "negative": {"cached_tokens": -1},
    "above-the-prompt": {"cached_tokens": 10**6},
    "string": {"cached_tokens": "900"},
    "float": {"cached_tokens": 900.0},
    "bool": {"cached_tokens": True},
    "details-a-string": "900",
    "details-a-list": [900],
}


def test_cached_tokens_of_reads_an_impossible_count_as_nothing_cached():
    """``None`` only where the engine said nothing; 0 where what it said cannot be true; and a
    count above the gateway's prompt is judged as the whole prompt, known."""
    for details in IMPOSSIBLE_CACHED.values():
        assert cached_tokens_of({"prompt_tokens": 3000, "prompt_tokens_details": details}) == 0, details
    for said_nothing in (
        None,
        {},
        {"prompt_tokens": 3000},
        {"prompt_tokens_details": None},
        {"prompt_tokens_details": {}},
    ):
        assert cached_tokens_of(said_nothing) is None
    assert cached_tokens_of({"prompt_tokens_details": {"cached_tokens": None}}) is None
    assert cached_tokens_of({"prompt_tokens": 3000, "prompt_tokens_details": {"cached_tokens": 2990}}) == 2990
    assert cached_tokens_of({"prompt_tokens": "x", "prompt_tokens_details": {"cached_tokens": 2990}}) == 2990
    v = LatencyModel(min_samples=1, min_prompt_tokens=512).judge("u", 3000, 0.01, cached_tokens=4000)
    assert (v.bucket, v.cached_known) == (11, True)


async def calibrated_verifier(tmp_path):
    """test_verifier_adversary's verifier, its 3,000-token ``whole`` bucket calibrated at about
    0.40 s (three tenants, nothing cached): the bound is 0.20 s."""
    svc = build_verifier(settings(tmp_path, latency_min_samples=4), secrets=ADVERSARY_SECRETS)
    for i in range(12):
        u = {"prompt_tokens": 3000, "prompt_tokens_details": {"cached_tokens": 0}}
        await svc.begin(ex((A, C, D)[i % 3], n=3000)).check_body(
            "ok", usage=u, finish_reason="stop", ttft_seconds=0.40 + i * 0.001
        )
    await svc.drain()
    assert svc.latency.bound("up", 3000, "whole", "m") == pytest.approx(0.20, rel=0.03)
    return svc


@pytest.mark.parametrize("form", list(IMPOSSIBLE_CACHED), ids=list(IMPOSSIBLE_CACHED))
async def test_a_strict_answer_too_fast_with_an_impossible_cached_count_is_withheld(tmp_path, form):
    """20 ms for a 3,000-token prompt whose engine claims an impossible cache hit: before, read
    as "not said", only an alert and the strict answer released; now nothing cached, withheld
    like an answer that says 0 (the incident names 0 cached, 3,000 prefilled)."""
    svc = await calibrated_verifier(tmp_path)
    try:
        u = {"prompt_tokens": 3000, "prompt_tokens_details": IMPOSSIBLE_CACHED[form]}
        with pytest.raises(ResponseWithheld) as ei:
            await svc.begin(ex(STRICT, n=3000)).check_body("ok", usage=u, finish_reason="stop", ttft_seconds=0.020)
        assert ei.value.detector == "latency"
        (inc,) = [i for i in svc.incidents.recent if i.detector == "latency"]
        assert (inc.evidence["cached_tokens"], inc.evidence["prefilled_tokens"], inc.withheld) == (0, 3000, True)
    finally:
        await svc.aclose()


async def test_a_cached_count_not_said_is_still_only_an_alert(tmp_path):
    """The control: no ``cached_tokens`` (absent, ``null``) is still "not said": released, alerted."""
    svc = await calibrated_verifier(tmp_path)
    try:
        for u in ({"prompt_tokens": 3000}, {"prompt_tokens": 3000, "prompt_tokens_details": {"cached_tokens": None}}):
            assert (
                await svc.begin(ex(STRICT, n=3000)).check_body("ok", usage=u, finish_reason="stop", ttft_seconds=0.020)
                is None
            )
        await svc.drain()
        assert [(i.detector, i.withheld, i.evidence["cached_tokens"]) for i in svc.incidents.recent] == [
            ("latency", False, None)
        ] * 2
    finally:
        await svc.aclose()


def long_prompt() -> tuple[str, int]:
    """A completions prompt of the judged length (at least 512 tokens) and its count."""
    text = " ".join(filler(5, 700))
    return text, len(COUNTER.encode_text(text))


@pytest.mark.parametrize("form", ["negative", "above-the-prompt", "string", "not-said"])
def test_a_strict_stream_too_fast_with_an_impossible_cached_count_is_withheld(stack, form):
    """Through the real gateway: the strict tenant's stream of a long prompt answered at once
    (the gateway's own TTFT: milliseconds) against a 0.40 s calibration. The stream is held back
    from its first token; at its end the usage decides: an impossible cached count was "not
    said" (released whole, an alert), now nothing cached: withheld. The control, not said, is
    still released."""
    sc, svc, client = stack
    text, n = long_prompt()
    with svc.latency_keeper.lock:
        for t in ("t1", "t2", "t3"):
            for i in range(25):
                svc.latency.record("leak", n, 0.40 + i * 0.001, "stream", "m", t)
    details = {
        "not-said": None,
        "negative": {"cached_tokens": -1},
        "above-the-prompt": {"cached_tokens": n + 1},
        "string": {"cached_tokens": "5"},
    }[form]
    u = {"prompt_tokens": n, "completion_tokens": 2, "total_tokens": n + 2, "prompt_tokens_details": details}
    completion_script(sc, True, u)
    before, count = svc.stats["withheld"], len(svc.incidents.recent)
    body = {"model": "m", "stream": True, "prompt": text, "max_tokens": 8}
    with client.stream("POST", "/v1/completions", json=body, headers={"authorization": f"Bearer {key_of('s')}"}) as r:
        status, raw = r.status_code, b"".join(r.iter_raw())
    (inc,) = [i for i in svc.incidents.recent[count:] if i.detector == "latency"]
    if form == "not-said":
        assert (status, raw) == (200, b"".join(map(sse, sc.events[:-1])) + DONE)
        assert (inc.withheld, inc.evidence["cached_tokens"], svc.stats["withheld"]) == (False, None, before)
        return
    withheld = {
        "message": f"The response was withheld by verification (incident {inc.id}).",
        "type": "server_error",
        "param": None,
        "code": "response_withheld",
    }
    assert (status, raw) == (
        200,
        b"data: " + json.dumps({"error": withheld}, separators=(",", ":")).encode() + b"\n\n" + DONE,
    )
    _withheld(svc, before, status, raw, True)
    assert (inc.withheld, inc.evidence["cached_tokens"], inc.evidence["prefilled_tokens"]) == (True, 0, n)
