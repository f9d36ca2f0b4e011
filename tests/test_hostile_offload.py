"""Offload decisions by real cost: a request's counting cost counts every element (prompt,
message, token id), not just its characters, so ``[""] * 2_000_000``, 400k messages and two million
token ids are counted in a worker thread (or refused before counting, when the tenant's
``max_sequences_per_request`` caps the batch), never on the event loop's thread."""

from __future__ import annotations

import json
import threading

import pytest

from config.errors import OpenAIError
from config.models import Settings, TenantConfig
from gateway.admission import ModelIndex, count_prompt, decide, request_cost
from tokenizer.base import OFFLOAD_CHARS, PROMPT_ELEMENT_CHARS, TOKEN_ID_CHARS, prompt_cost
from tokenizer.chat import CHAT_ELEMENT_CHARS, chat_cost

pytestmark = pytest.mark.timeout(120)


def test_prompt_cost_counts_elements_and_stops_early():
    assert (PROMPT_ELEMENT_CHARS, TOKEN_ID_CHARS, CHAT_ELEMENT_CHARS, OFFLOAD_CHARS) == (32, 4, 16, 32768)
    assert prompt_cost("hello") == 5 + 32
    assert prompt_cost(["", "ab"]) == 32 + 34
    assert prompt_cost([1, 2, 3]) == 12
    assert prompt_cost([[1, 2], [3]]) == (8 + 32) + (4 + 32)
    assert prompt_cost([""] * 2_000_000, limit=OFFLOAD_CHARS) == 8_000_000  # judged by length alone
    assert prompt_cost([""] * 2000, limit=OFFLOAD_CHARS) == 32 * 1025  # stops once past the limit
    assert prompt_cost([""] * 1000, limit=OFFLOAD_CHARS) == 32_000  # under it: counted on the loop
    assert prompt_cost(None) == 32


def test_chat_cost_counts_elements_and_stops_early():
    one = [{"role": "user", "content": "a"}]
    # nodes: [messages, None] stack -> None, the list, the dict, 2 keys, 2 values = 7 x 16, plus 4 + 4 + 7 + 1 chars
    assert chat_cost(one) == 7 * 16 + 16
    assert chat_cost([{"role": "user", "content": ""}] * 400_000, limit=OFFLOAD_CHARS) == 6_400_000
    assert chat_cost([{}] * 2000, limit=OFFLOAD_CHARS) == 32 + 2000 * 16  # empty dicts are not free
    assert chat_cost([{}] * 2100, limit=OFFLOAD_CHARS) == 33_600
    many_keys = [{f"k{i}": "" for i in range(5000)}]
    assert chat_cost(many_keys, limit=OFFLOAD_CHARS) > OFFLOAD_CHARS


SETTINGS = Settings.model_validate(
    {
        "models": [{"id": "m", "context_length": 8192}],
        "upstreams": [{"name": "u", "api_url": "http://x/v1", "pool_urls": ["x"], "models": ["m"]}],
    }
)


class _Recorder:
    """Wraps a counter's sync methods to record the thread each ran on."""

    def __init__(self, counter) -> None:
        self.threads: list[int] = []
        for name in ("count_prompt", "count_chat"):
            orig = getattr(counter, name)

            def wrapped(*a, _orig=orig, **kw):
                self.threads.append(threading.get_ident())
                return _orig(*a, **kw)

            setattr(counter, name, wrapped)


@pytest.fixture
def entry():
    e = ModelIndex(SETTINGS).by_name["m"]
    e.rec = _Recorder(e.counter)
    return e


async def test_two_million_empty_prompts_are_refused_before_counting(entry):
    body = {"model": "m", "prompt": [""] * 2_000_000}
    with pytest.raises(OpenAIError) as ei:
        await count_prompt(entry, body, "completions", max_sequences=16)
    assert (ei.value.status, ei.value.param, ei.value.message) == (
        400,
        "prompt",
        "This request asks for 2000000 prompt(s) x 1 sequence(s) each = 2000000 sequences; "
        "this key allows at most 16 per request.",
    )
    assert entry.rec.threads == []  # nothing was counted
    body = {"model": "m", "prompt": ["a"] * 8, "n": 3}
    with pytest.raises(OpenAIError) as ei:
        await count_prompt(entry, body, "completions", max_sequences=16)
    assert (ei.value.param, ei.value.message) == (
        "n",
        "This request asks for 8 prompt(s) x 3 sequence(s) each = 24 sequences; this key allows at most 16 per request.",
    )
    ok = await count_prompt(entry, {"model": "m", "prompt": ["a"] * 16}, "completions", max_sequences=16)
    assert tuple(ok) == (1, 16, 16) and entry.rec.threads == [threading.get_ident()]  # small: on the loop


async def test_element_heavy_requests_are_counted_in_a_worker_thread(entry):
    loop_thread = threading.get_ident()
    ids = await count_prompt(entry, {"model": "m", "prompt": [1] * 2_000_000}, "completions", max_sequences=16)
    assert tuple(ids) == (2_000_000, 2_000_000, 1) and ids.text == ""
    empties = await count_prompt(entry, {"model": "m", "prompt": [""] * 2000}, "completions")
    assert tuple(empties) == (0, 0, 2000) and empties.text == "\n" * 1999
    chat = {"model": "m", "messages": [{"role": "user", "content": "a"}] * 400_000}
    counted = await count_prompt(entry, chat, "chat")
    # per message <|im_start|> user \n a <|im_end|> \n = 6 tokens, then <|im_start|> assistant \n
    assert tuple(counted) == (2_400_003, 2_400_003, 1)
    assert len(counted.text) == 799_999  # gathered off the loop with the count
    assert len(entry.rec.threads) == 3 and loop_thread not in entry.rec.threads
    # decide takes the text gathered with the count
    t = TenantConfig(id="t")
    with pytest.raises(OpenAIError) as ei:
        decide(entry, t, chat, "chat", counted, 1 << 40)
    assert ei.value.code == "context_length_exceeded"
    small = await count_prompt(entry, {"model": "m", "messages": [{"role": "user", "content": "hi"}]}, "chat")
    assert small.text is None and entry.rec.threads[-1] == loop_thread
    adm = decide(entry, t, {"model": "m", "messages": [{"role": "user", "content": "hi"}]}, "chat", small, 4096)
    assert adm.prompt_text == "hi"


def test_request_cost_by_route():
    assert request_cost({"prompt": [""] * 10}, "completions", 10**9) == 320
    assert request_cost({"messages": [{"role": "user", "content": "a"}]}, "chat", 10**9) == 128


def test_values_over_counts_commas_outside_strings_only():
    from gateway.density import values_over

    def over(obj, limit=1000):
        return values_over(json.dumps(obj).encode(), limit)

    assert over({"prompt": [""] * 2000}) == 1999
    assert over({"prompt": [1] * 1001, "n": 1}) == 1001  # 1000 in the list, 1 between the members
    assert over({"prompt": [1] * 1000}) is None  # 999 commas: not over
    assert over({"prompt": "a," * 100_000}) is None  # commas inside a string are text
    assert over({"prompt": ['a\\",b'] * 2000}) == 1999  # escaped backslash and quote inside strings
    assert over({"prompt": "x\\" * 10 + "," * 5000}) is None
    assert over({"messages": [{"role": "user", "content": "a"}] * 1000}) == 1999
    # many slices: strings cut by a slice boundary are rejoined
    assert over({"p": ["a,b" * 50_000] * 40, "q": [0] * 300_000}, 100_000) == 300_039


def _gateway_with(engine):
    from tests.gateway_harness import Gateway, settings_for, tenants, upstream

    return Gateway(settings_for([upstream("u1", engine)], gateway={"max_body_bytes": 8 << 20}), tenants()).start()


def test_element_dense_bodies_over_http_are_refused_before_parsing_and_nothing_is_forwarded():
    from tests.mock_engine import MockEngine

    engine = MockEngine().start()
    g = _gateway_with(engine)
    try:
        with g.client() as c:
            for body, n in (
                ({"model": "kvgate-tiny", "prompt": [""] * 2_000_000}, 2_000_001),
                ({"model": "kvgate-tiny", "prompt": [1] * 2_000_000}, 2_000_001),
                ({"model": "kvgate-tiny", "messages": [{"role": "user", "content": "a"}] * 200_000}, 400_001),
            ):
                r = c.post("/v1/chat/completions" if "messages" in body else "/v1/completions", json=body)
                assert (r.status_code, r.json()["error"]) == (
                    413,
                    {
                        "message": f"The request body holds more than 131072 JSON values ({n} or more); "
                        "send fewer prompts, messages or token ids per request.",
                        "type": "invalid_request_error",
                        "param": None,
                        "code": "request_too_large",
                    },
                )
            # under the value limit but over the sequence cap: refused before counting
            r = c.post("/v1/completions", json={"model": "kvgate-tiny", "prompt": [""] * 100_000})
            assert (r.status_code, r.json()["error"]["message"]) == (
                400,
                "This request asks for 100000 prompt(s) x 1 sequence(s) each = 100000 sequences; "
                "this key allows at most 16 per request.",
            )
            # text full of commas is text: counted and gated as usual
            r = c.post("/v1/completions", json={"model": "kvgate-tiny", "prompt": "a," * 1_000_000})
            assert (r.status_code, r.json()["error"]["code"]) == (400, "context_length_exceeded")
        assert engine.state.requests == []
    finally:
        g.stop()
        engine.stop()
