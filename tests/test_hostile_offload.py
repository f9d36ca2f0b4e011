"""Offload decisions by real cost: a request's counting cost counts every element (prompt,
message, token id), not just its characters, so ``[""] * 2_000_000``, 400k messages and two million
token ids are counted in a worker thread (or refused before counting, when the tenant's
``max_sequences_per_request`` caps the batch), never on the event loop's thread."""

from __future__ import annotations

import json
import re
import threading

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from config.errors import OpenAIError
from config.models import Settings, TenantConfig
from gateway.admission.gate import count_prompt, decide
from gateway.admission.registry import ModelIndex
from gateway.routes import CHAT, COMPLETIONS
from tokenizer.base import OFFLOAD_CHARS, PROMPT_ELEMENT_CHARS, TOKEN_ID_CHARS, prompt_cost
from tokenizer.chat import CHAT_ELEMENT_CHARS, chat_cost

pytestmark = pytest.mark.timeout(120)


def test_prompt_cost_counts_elements_and_stops_early():
    assert (PROMPT_ELEMENT_CHARS, TOKEN_ID_CHARS, CHAT_ELEMENT_CHARS, OFFLOAD_CHARS) == (32, 4, 16, 16384)
    assert prompt_cost("hello") == 5 + 32
    assert prompt_cost(["", "ab"]) == 32 + 34
    assert prompt_cost([1, 2, 3]) == 12
    assert prompt_cost([[1, 2], [3]]) == (8 + 32) + (4 + 32)
    assert prompt_cost([""] * 2_000_000, limit=OFFLOAD_CHARS) == 8_000_000  # judged by length alone
    assert prompt_cost([""] * 2000, limit=OFFLOAD_CHARS) == 32 * 513  # stops once past the limit
    assert prompt_cost([""] * 500, limit=OFFLOAD_CHARS) == 16_000  # under it: counted on the loop
    assert prompt_cost(None) == 32


def test_chat_cost_counts_elements_and_stops_early():
    one = [{"role": "user", "content": "a"}]
    # nodes: [messages, None] stack -> None, the list, the dict, 2 keys, 2 values = 7 x 16, plus 4 + 4 + 7 + 1 chars
    assert chat_cost(one) == 7 * 16 + 16
    assert chat_cost([{"role": "user", "content": ""}] * 400_000, limit=OFFLOAD_CHARS) == 6_400_000
    assert chat_cost([{}] * 1000, limit=OFFLOAD_CHARS) == 32 + 1000 * 16  # empty dicts are not free
    assert chat_cost([{}] * 2100, limit=OFFLOAD_CHARS) == 33_600
    many_keys = [{f"k{i}": "" for i in range(5000)}]
    assert chat_cost(many_keys, limit=OFFLOAD_CHARS) > OFFLOAD_CHARS


SETTINGS = Settings.model_validate(
    {
        "models": [{"id": "m", "context_length": 8192}],
        "upstreams": [{"name": "u", "api_url": "http://x/v1", "pool_urls": ["x"], "models": ["m"], "engine": "sglang"}],
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
        await count_prompt(entry, body, COMPLETIONS, max_sequences=16)
    assert (ei.value.status, ei.value.param, ei.value.message) == (
        400,
        "prompt",
        "This request asks for 2000000 prompt(s) x 1 sequence(s) each = 2000000 sequences; "
        "this key allows at most 16 per request.",
    )
    assert entry.rec.threads == []  # nothing was counted
    body = {"model": "m", "prompt": ["a"] * 8, "n": 3}
    with pytest.raises(OpenAIError) as ei:
        await count_prompt(entry, body, COMPLETIONS, max_sequences=16)
    assert (ei.value.param, ei.value.message) == (
        "n",
        "This request asks for 8 prompt(s) x 3 sequence(s) each = 24 sequences; this key allows at most 16 per request.",
    )
    ok = await count_prompt(entry, {"model": "m", "prompt": ["a"] * 16}, COMPLETIONS, max_sequences=16)
    assert (ok.largest, ok.total, ok.num_prompts) == (1, 16, 16) and entry.rec.threads == [
        threading.get_ident()
    ]  # small: on the loop


async def test_element_heavy_requests_are_counted_in_a_worker_thread(entry):
    loop_thread = threading.get_ident()
    ids = await count_prompt(entry, {"model": "m", "prompt": [1] * 2_000_000}, COMPLETIONS, max_sequences=16)
    assert (ids.largest, ids.total, ids.num_prompts) == (2_000_000, 2_000_000, 1) and ids.text == ""
    empties = await count_prompt(entry, {"model": "m", "prompt": [""] * 2000}, COMPLETIONS)
    assert (empties.largest, empties.total, empties.num_prompts) == (0, 0, 2000) and empties.text == "\n" * 1999
    chat = {"model": "m", "messages": [{"role": "user", "content": "a"}] * 400_000}
    counted = await count_prompt(entry, chat, CHAT)
    # per message <|im_start|> user \n a <|im_end|> \n = 6 tokens, then <|im_start|> assistant \n
    assert (counted.largest, counted.total, counted.num_prompts) == (2_400_003, 2_400_003, 1)
    assert len(counted.text) == 799_999  # gathered off the loop with the count
    assert len(entry.rec.threads) == 3 and loop_thread not in entry.rec.threads
    # decide takes the text gathered with the count
    t = TenantConfig(id="t")
    with pytest.raises(OpenAIError) as ei:
        decide(entry, t, chat, CHAT, counted, 1 << 40)
    assert ei.value.code == "context_length_exceeded"
    small = await count_prompt(entry, {"model": "m", "messages": [{"role": "user", "content": "hi"}]}, CHAT)
    assert small.text is None and entry.rec.threads[-1] == loop_thread
    adm = decide(entry, t, {"model": "m", "messages": [{"role": "user", "content": "hi"}]}, CHAT, small, 4096)
    assert adm.prompt_text == "hi"


def test_request_cost_by_route():
    assert COMPLETIONS.cost({"prompt": [""] * 10}, 10**9) == 320
    assert CHAT.cost({"messages": [{"role": "user", "content": "a"}]}, 10**9) == 128


def test_values_over_counts_commas_outside_strings_only():
    from gateway.admission.density import values_over

    def over(obj, limit=1000):
        return values_over(json.dumps(obj).encode(), limit)

    assert over({"prompt": [""] * 2000}) == 1999
    assert over({"prompt": [1] * 1001, "n": 1}) == 1001  # 1000 in the list, 1 between the members
    assert over({"prompt": [1] * 1000}) is None  # 999 commas: not over
    assert over({"prompt": "a," * 100_000}) is None  # commas inside a string are text
    assert over({"prompt": ['a\\",b'] * 2000}) == 1999  # escaped backslash and quote inside strings
    assert over({"prompt": "x\\" * 10 + "," * 5000}) is None
    assert over({"messages": [{"role": "user", "content": "a"}] * 1000}) == 1999
    # many slices: strings cut by a slice boundary are rejoined; the count stops at the first
    # slice past the limit (a lower bound of the 300,039 commas, above the limit)
    assert over({"p": ["a,b" * 50_000] * 40, "q": [0] * 300_000}, 300_038) == 300_039
    assert 1000 < over({"prompt": [""] * 2_000_000}) < 200_000  # stopped early, not 1,999,999


def _gateway_with(engine):
    from tests.gateway_harness import Gateway, settings_for, tenants, upstream

    return Gateway(settings_for([upstream("u1", engine)], gateway={"max_body_bytes": 8 << 20}), tenants()).start()


def test_element_dense_bodies_over_http_are_refused_before_parsing_and_nothing_is_forwarded(monkeypatch):
    import gateway.admission.admit as admit_module
    import gateway.admission.density as density
    from tests.mock_engine import MockEngine

    parsed: list[int] = []
    real_parse = admit_module._parse_large

    def recording(raw, *args):
        parsed.append(len(raw))
        return real_parse(raw, *args)

    monkeypatch.setattr(admit_module, "_parse_large", recording)
    engine = MockEngine().start()
    g = _gateway_with(engine)
    try:
        with g.client() as c:
            for body, values, streamed in (
                # strings prove the values as the body arrives: refused before it is all read
                ({"model": "kvgate-tiny", "prompt": [""] * 2_000_000}, 2_000_001, True),
                ({"model": "kvgate-tiny", "messages": [{"role": "user", "content": "a"}] * 200_000}, 400_001, True),
                # token-id arrays shorter than MIN_ID_ARRAY are values like any other (no strings:
                # counted after the read, exactly, as the body holds fewer than a slice of them)
                ({"model": "kvgate-tiny", "prompt": [[1] * 1023] * 200}, 200 * 1022 + 199 + 1 + 1, False),
            ):
                r = c.post("/v1/chat/completions" if "messages" in body else "/v1/completions", json=body)
                err = r.json()["error"]
                assert (r.status_code, err["type"], err["param"], err["code"]) == (
                    413,
                    "invalid_request_error",
                    None,
                    "request_too_large",
                )
                # the count is a lower bound (it stops once past the limit, hence "or more")
                m = re.fullmatch(
                    r"The request body holds more than 131072 JSON values besides its token-id arrays "
                    r"\((\d+) or more\); send fewer prompts or messages per request\.",
                    err["message"],
                )
                assert m is not None, err["message"]
                n = int(m.group(1))
                assert (131_072 < n < values) if streamed else n == values
                assert len(parsed) == (0 if streamed else 1)  # a streamed refusal parses nothing
                parsed.clear()
            # two million token ids, more than the effective limit (the pool's 4,096 / 1.25 = 3,276):
            # refused from the array's commas, before one id is parsed
            real_parse_ids = density.parse_ids
            parsed_ids: list[int] = []
            monkeypatch.setattr(density, "parse_ids", lambda content: parsed_ids.append(1) or real_parse_ids(content))
            r = c.post("/v1/completions", json={"model": "kvgate-tiny", "prompt": [1] * 2_000_000, "max_tokens": 1})
            assert (
                r.status_code,
                r.json()["error"]["code"],
                r.json()["error"]["param"],
                r.json()["error"]["message"],
            ) == (
                400,
                "context_length_exceeded",
                "prompt",
                "This model's maximum context length is 3276 tokens. However, you requested at least 2000000 "
                "tokens in the prompt alone (counting stopped there). Please reduce the length of the prompt.",
            )
            assert parsed_ids == []
            # 3,276 ids are not over the limit by themselves: parsed in slices and gated with the
            # completion (a long `user` makes the body large enough for the worker-thread parse)
            big = {"model": "kvgate-tiny", "prompt": [1] * 3276, "max_tokens": 1, "user": "u" * 70_000}
            r = c.post("/v1/completions", json=big)
            assert (r.status_code, r.json()["error"]["code"], r.json()["error"]["message"]) == (
                400,
                "context_length_exceeded",
                "This model's maximum context length is 3276 tokens. However, you requested 3277 tokens "
                "(3276 in the prompt, 1 in the completion). Please reduce the length of the prompt or completion.",
            )
            assert parsed_ids == [1]
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


def _long_context_gateway(engine):
    """A 300,000-token model behind a static pool that allows all of it (375,000 / 1.25)."""
    from tests.gateway_harness import Gateway, settings_for, tenants, upstream

    up = upstream("u1", engine, pool_source="static", static_pool_tokens=375_000, pool_urls=[])
    settings = settings_for([up], gateway={"max_body_bytes": 8 << 20}, context_length=300_000)
    return Gateway(settings, tenants(max_tokens_cap=4096)).start()


def test_a_token_id_prompt_as_long_as_the_context_is_counted_and_gated_not_refused_as_too_many_values():
    from tests.mock_engine import MockEngine

    engine = MockEngine().start()
    g = _long_context_gateway(engine)
    try:
        with g.client() as c:
            ids = [(i * 7919) % 50_000 + 1 for i in range(300_000)]  # 300,000 ids of 1-5 digits
            r = c.post("/v1/completions", json={"model": "kvgate-tiny", "prompt": ids, "max_tokens": 1})
            assert (r.status_code, r.json()["error"]) == (
                400,
                {
                    "message": "This model's maximum context length is 300000 tokens. However, you requested "
                    "300001 tokens (300000 in the prompt, 1 in the completion). Please reduce the length of the "
                    "prompt or completion.",
                    "type": "invalid_request_error",
                    "param": "prompt",
                    "code": "context_length_exceeded",
                },
            )
            assert engine.state.requests == []
            # one token fewer: exactly the limit with the completion, admitted and forwarded whole
            r = c.post("/v1/completions", json={"model": "kvgate-tiny", "prompt": ids[1:], "max_tokens": 1})
            assert r.status_code == 200, r.text
            (sent,) = engine.state.requests
            assert sent["body"]["prompt"] == ids[1:] and sent["body"]["max_tokens"] == 1
            # pretty-printed (spaces and newlines between ids), in a list of prompts: the same
            body = json.dumps({"model": "kvgate-tiny", "prompt": [ids[2:]], "max_tokens": 2}, indent=1)
            r = c.post("/v1/completions", content=body, headers={"content-type": "application/json"})
            assert r.status_code == 200, r.text
            assert engine.state.requests[-1]["body"]["prompt"] == [ids[2:]]
            # the element-dense body is still refused before it is parsed
            r = c.post("/v1/completions", json={"model": "kvgate-tiny", "prompt": [""] * 2_000_000})
            assert (r.status_code, r.json()["error"]["code"]) == (413, "request_too_large")
            # a token-id array that is not JSON is refused as the whole body would be (a 400, not a 500)
            bad = b'{"model": "kvgate-tiny", "prompt": [' + b"1," * 40_000 + b"]}"
            r = c.post("/v1/completions", content=bad, headers={"content-type": "application/json"})
            assert (r.status_code, r.json()["error"]["code"], r.json()["error"]["message"]) == (
                400,
                "invalid_request",
                "We could not parse the JSON body of your request (trailing comma is not allowed: "
                "line 1 column 14463 (char 14462)).",  # the position is within the slice parsed last
            )
            assert len(engine.state.requests) == 2
    finally:
        g.stop()
        engine.stop()


def test_split_ids_cuts_only_integer_arrays_outside_strings_and_restores_them_exactly():
    import orjson

    from gateway.admission.density import ID_SLICE_BYTES, MIN_ID_ARRAY, BadIds, parse_ids, restore_ids, split_ids

    def roundtrip(raw: bytes) -> tuple[int, object]:
        skeleton, arrays = split_ids(raw)
        body = orjson.loads(skeleton)
        restore_ids(body, arrays)
        return len(arrays), body

    ids = list(range(-5, MIN_ID_ARRAY * 3))
    obj = {
        "prompt": [ids, [1] * MIN_ID_ARRAY, [2] * (MIN_ID_ARRAY - 1)],  # the last is too short: parsed as usual
        "s": "[" + ",".join(["1"] * 5000) + "]",  # text that looks like ids
        "e": 'x\\"[' + "1," * 3000 + '1]\\\\"',  # ... after an escaped quote, then a string ending in a backslash
        "f": [1.5] + [1] * 3000,  # a float: not a token-id array
        "g": [1] * 3000 + [[2]],  # a nested array after the ids: not a token-id array
        "n": 7027324451624700000,  # a client's integer that looks like a marker stays an integer
    }
    raw = orjson.dumps(obj)
    assert roundtrip(raw) == (2, obj)
    assert roundtrip(json.dumps(obj, indent=2).encode()) == (2, obj)  # whitespace and newlines between ids
    skeleton, arrays = split_ids(raw)
    assert len(skeleton) < len(raw) - 8000 and list(arrays.values())[1] == b",".join([b"1"] * MIN_ID_ARRAY)
    # a long array is parsed in several slices, and comes back whole
    long = list(range(200_000))
    assert roundtrip(orjson.dumps({"p": long})) == (1, {"p": long})
    # what orjson refuses in the whole array, the slices refuse too
    for bad, why in (
        (b"1,2,", "trailing comma"),
        (b"1,,2", "expected a JSON value"),
        (b"1,02", "leading zero"),
        (b"1, ,2", "expected a JSON value"),
        (b"1,2" + b"9" * 400, "infinity"),
    ):
        with pytest.raises(BadIds, match=why):
            parse_ids(b"3," * 40_000 + bad)  # past the first slice
        with pytest.raises(orjson.JSONDecodeError):
            orjson.loads(b"[" + b"3," * 40_000 + bad + b"]")
    with pytest.raises(BadIds, match="a comma without a value"):  # the last comma ends a slice
        parse_ids(b"1," * (ID_SLICE_BYTES // 2 + 1))
    assert parse_ids(b" 1 ,\n-2 ") == [1, -2]
    # beyond 64 bits orjson gives a float, in slices as whole (validation then refuses it)
    assert parse_ids(b"3," * 40_000 + b"99999999999999999999")[-1] == orjson.loads(b"[99999999999999999999]")[0]


def _commas_outside_strings(raw: bytes) -> int:
    """The reference: a byte-by-byte JSON string state machine."""
    n, in_str, esc = 0, False, False
    for b in raw:
        if in_str:
            if esc:
                esc = False
            elif b == 0x5C:
                esc = True
            elif b == 0x22:
                in_str = False
        elif b == 0x22:
            in_str = True
        elif b == 0x2C:
            n += 1
    return n


_json_text = st.text(alphabet=st.sampled_from(list(',"\\ab\n\u00e9[]{}:')), max_size=12)
_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | _json_text,
    lambda kids: st.lists(kids, max_size=6) | st.dictionaries(_json_text, kids, max_size=4),
    max_leaves=40,
)


@settings(max_examples=400, deadline=None)
@given(doc=_json_values, slice_bytes=st.integers(1, 16), compact=st.booleans(), slack=st.integers(-3, 3))
def test_values_over_agrees_with_a_json_state_machine(doc, slice_bytes, compact, slack):
    """Whatever the slicing (escapes and strings cut at every place): None exactly when the
    commas outside strings are at most the limit, else a lower bound of them above the limit."""
    import gateway.admission.density as density

    raw = json.dumps(doc, separators=(",", ":") if compact else None, ensure_ascii=False).encode()
    ref = _commas_outside_strings(raw)
    limit = max(0, ref + slack)
    old = density.SLICE_BYTES
    density.SLICE_BYTES = slice_bytes
    try:
        got = density.values_over(raw, limit)
    finally:
        density.SLICE_BYTES = old
    if ref <= limit:
        assert got is None
    else:
        assert got is not None and limit < got <= ref


_dense_docs = st.one_of(
    _json_values,
    st.lists(_json_text, max_size=300),
    st.lists(st.dictionaries(_json_text, _json_text | st.integers(0, 9), max_size=3), max_size=100),
)


@settings(max_examples=300, deadline=None)
@given(doc=_dense_docs, cuts=st.lists(st.integers(0, 4000), max_size=8))
@example(doc={"a": {"b": {"c": {"d": "e"}}}}, cuts=[])  # containers without commas: the - C term
@example(doc=['""""""'] * 20, cuts=[])  # escaped quotes are no string boundaries
@example(doc=['a"b'] * 20, cuts=[2, 3, 4, 5, 6, 7, 8, 9, 10])  # an escape cut between two reads
def test_string_density_never_claims_more_values_than_there_are(doc, cuts):
    """The streaming bound of StringDensity, fed the body in reads cut anywhere (escapes and
    strings split between reads), never exceeds the commas outside strings that values_over
    counts: it can only refuse what values_over would refuse."""
    from gateway.admission.density import StringDensity

    raw = json.dumps(doc, ensure_ascii=False).encode()
    ref = _commas_outside_strings(raw)
    density = StringDensity(-(10**9))  # every read reports its bound
    points = sorted({0, len(raw), *(c for c in cuts if c < len(raw))})
    for a, b in zip(points, points[1:], strict=False):
        assert density.feed(raw[a:b]) <= ref


def test_string_density_refuses_a_list_of_empty_strings_after_a_fraction_of_it():
    from gateway.admission.density import StringDensity

    raw = json.dumps({"prompt": [""] * 2_000_000}).encode()  # 8 MB
    density = StringDensity(131_072)
    read = 0
    for i in range(0, len(raw), 65_536):
        read += 65_536
        if density.feed(raw[i : i + 65_536]) is not None:
            break
    assert read <= 1_200_000  # refused within the first 1.2 MB of 8


def test_string_density_counts_escapes_cut_between_reads():
    """Every escaped quote of an object cut between its backslash and its quote: the one-per-read
    allowance keeps the bound at or below the true count (10 members: 9 commas)."""
    from gateway.admission.density import StringDensity

    raw = json.dumps({f"k{i}": 'x"' for i in range(10)}).encode()
    cuts = [i + 1 for i, b in enumerate(raw) if b == 0x5C]  # right after each backslash
    density = StringDensity(-(10**9))
    bounds = [density.feed(raw[a:b]) for a, b in zip([0, *cuts], [*cuts, len(raw)], strict=True)]
    assert max(bounds) <= _commas_outside_strings(raw) == 9


def test_a_prompt_too_long_for_any_context_is_refused_without_counting(monkeypatch):
    """Effective limit 3,276 tokens (the pool's 4,096 / 1.25), bundled tokenizer (no token covers
    more than max_token_chars = 128 characters): a 2 MB message is at least 15,625 tokens, refused
    at once with the limit the gate quotes (nothing counted, nothing forwarded); at exactly
    3,276 x 128 characters the bound is not over and the prompt is counted, and refused with its
    exact count."""
    from tests.mock_engine import MockEngine
    from tokenizer.tiktoken_counter import TiktokenCounter

    counted: list[str] = []
    real = TiktokenCounter.count_chat

    def recording(self, messages, tools=None, options=None):
        counted.append("chat")
        return real(self, messages, tools) if options is None else real(self, messages, tools, options)

    monkeypatch.setattr(TiktokenCounter, "count_chat", recording)
    engine = MockEngine().start()
    g = _gateway_with(engine)
    counted.clear()  # the start's warm-up counted one short chat
    try:
        with g.client() as c:
            r = c.post(
                "/v1/chat/completions",
                json={"model": "kvgate-tiny", "messages": [{"role": "user", "content": "ab" * 1_000_000}]},
            )
            assert (r.status_code, r.json()["error"]) == (
                400,
                {
                    "message": "This model's maximum context length is 3276 tokens. However, you requested at "
                    "least 15625 tokens in the messages alone (counting stopped there). Please reduce the "
                    "length of the messages.",
                    "type": "invalid_request_error",
                    "param": "messages",
                    "code": "context_length_exceeded",
                },
            )
            assert counted == []
            r = c.post("/v1/completions", json={"model": "kvgate-tiny", "prompt": ["hi", "x " * 600_000]})
            assert (r.status_code, r.json()["error"]["param"], r.json()["error"]["code"]) == (
                400,
                "prompt",
                "context_length_exceeded",
            )
            assert "at least 9375 tokens in the prompt alone" in r.json()["error"]["message"]
            # at the bound: counted, and refused with the exact count
            r = c.post(
                "/v1/chat/completions",
                json={"model": "kvgate-tiny", "messages": [{"role": "user", "content": "z" * (3276 * 128)}]},
            )
            assert r.status_code == 400 and counted == ["chat"]
            assert "However, you requested " in r.json()["error"]["message"]
            assert "at least" not in r.json()["error"]["message"]
        assert engine.state.requests == []
    finally:
        g.stop()
        engine.stop()


@settings(max_examples=300, deadline=None)
@given(doc=_dense_docs, cuts=st.lists(st.integers(0, 4000), max_size=8), slack=st.integers(-40, 3))
@example(doc=[""] * 300, cuts=[100, 200, 300, 400], slack=-40)  # turns to full counting mid-body
def test_string_density_answers_as_if_every_read_were_counted_in_full(doc, cuts, slack):
    """StringDensity counts only quotes until they alone could take the bound over its limit,
    then the escapes and brackets of the reads it held: at every read it answers exactly what
    counting every read in full would (the bound when above the limit, else None)."""
    from gateway.admission.density import StringDensity

    raw = json.dumps(doc, ensure_ascii=False).encode()
    points = sorted({0, len(raw), *(c for c in cuts if c < len(raw))})
    reads = [raw[a:b] for a, b in zip(points, points[1:], strict=False)]
    quotes = escaped = brackets = 0
    bounds = []
    for n, chunk in enumerate(reads, 1):
        quotes += chunk.count(b'"')
        escaped += chunk.count(b'\\"')
        brackets += chunk.count(b"[") + chunk.count(b"{")
        bounds.append(((quotes - escaped - (n - 1)) // 2 - 1) // 2 - brackets)
    limit = max(0, max(bounds, default=0) + slack)
    density = StringDensity(limit)
    got = [density.feed(chunk) for chunk in reads]
    assert got == [b if b > limit else None for b in bounds]
