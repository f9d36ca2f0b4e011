"""Hostile engines against the verifier, round 4: another tenant's text hidden from the checks
while a client still shows it, in a strict stream's tool-call arguments (JSON-escaped, so no
shingle matches across the escapes), in arguments escaped twice or cut off mid-string, and in a
logprob's ``bytes`` (what a client rebuilds a token's text from)."""

from __future__ import annotations

import json
import random
import uuid
from functools import partial

import pytest

from config.models import TenantConfig
from tests.fixtures.settings import verifier_settings
from tokenizer.json_values import JsonStrings
from verifier.build import build_verifier
from verifier.engine_response import parse_body, parse_chunk_event
from verifier.findings import unescaped_values
from verifier.shingles import encode
from verifier.stage import Exchange, ExchangeRequest, ResponseWithheld

SECRETS = {"leak_index_key": b"round4-test-key", "cache_salt_key": b"x", "admin_key": b"y"}
settings = partial(verifier_settings, latency_min_samples=5, latency_min_prompt_tokens=100)


def tenant(tid: str, **kw) -> TenantConfig:
    return TenantConfig(id=tid, verify_sample_rate=1.0, **kw)


A, STRICT = tenant("a"), tenant("s", strict_verify=True)

#: tenant a's prompt: code, every line shorter than a shingle (16 tokens), 60 lines
CODE = "\n".join(f"    t{i} = part({i}, w={i * 7 % 13})" for i in range(60))
_VI = (
    "Tiếng Việt là ngôn ngữ của người Việt và là ngôn ngữ chính thức tại Việt Nam. Những người dân ở đây"
    " thường nói rằng họ yêu quê hương đất nước mình hơn tất cả mọi điều khác trên đời"
).split()
#: Vietnamese, a diacritic in nearly every word: escaped with ``ensure_ascii``, hardly a letter run is left
VICTIM_VI = " ".join(random.Random(4).choice(_VI) for _ in range(400))


def ex(t: TenantConfig, prompt: str, *, stream: bool = False) -> Exchange:
    request = ExchangeRequest(f"req-{uuid.uuid4().hex[:8]}", t, "up", "m", len(encode(prompt)), stream, 0.0)
    return Exchange(request, prompt)


async def _admitted(svc, e: Exchange) -> Exchange:
    await svc.admit(e)
    return e


def _tool_chunk(fragment: str) -> bytes:
    delta = {"tool_calls": [{"index": 0, "function": {"arguments": fragment}}]}
    return b"data: " + json.dumps({"choices": [{"index": 0, "delta": delta}]}).encode() + b"\n\n"


# (tenant a's prompt, the arguments the engine streams to the strict tenant, where the leak starts there)
STREAMED = {
    "code_newlines": ("Popraw ten kod:\n" + CODE, json.dumps({"path": "a.py", "content": CODE}), "    t0"),
    "ensure_ascii": (VICTIM_VI, json.dumps({"note": VICTIM_VI}, ensure_ascii=True), '"note": "'),
    "escaped_twice": (
        "Popraw ten kod:\n" + CODE,
        json.dumps({"call": json.dumps({"path": "a.py", "content": CODE})}),
        "    t0",
    ),
}


@pytest.mark.parametrize("form", sorted(STREAMED))
@pytest.mark.parametrize("step", [1, 7])
async def test_strict_stream_of_escaped_tool_call_arguments_is_cut(tmp_path, form, step):
    """Tenant a's text streamed to a strict tenant as a tool call's ``arguments`` (the JSON string
    an engine's tool parser writes: line breaks as ``\\n``, non-ASCII as ``\\uXXXX``, or a JSON
    document escaped once more inside it), ``step`` characters per chunk. Before, a strict stream
    was shingled escapes and all: no shingle matched, and every chunk was released (the client's
    SDK parses the arguments back into tenant a's text). Now each arguments stream is also
    decoded as it arrives and the decoded string values are checked: cut (``leak_index``, naming
    tenant a) before any chunk with a character of the leak leaves (withheld at the first foreign
    shingle; confirmed or not depends on how many one chunk completed)."""
    prompt, arguments, marker = STREAMED[form]
    svc = build_verifier(settings(tmp_path), secrets=SECRETS)
    try:
        await svc.admit(ex(A, prompt))
        g = svc.begin(await _admitted(svc, ex(STRICT, "Zapisz plik.", stream=True)))
        released: list[bytes] = []
        with pytest.raises(ResponseWithheld) as e:
            for i in range(0, len(arguments), step):
                raw = _tool_chunk(arguments[i : i + step])
                ev = parse_chunk_event(json.loads(raw[6:]))
                released += await g.feed(ev.text, raw, list(ev.fields.items()))
            await g.finish_stream(usage=None, finish_reason="tool_calls", ttft_seconds=None)
        assert e.value.detector == "leak_index"
        (inc,) = [i for i in svc.incidents.recent if i.detector == "leak_index"]
        assert (inc.tenant, inc.withheld, inc.evidence["source_tenant"]) == ("s", True, "a")
        deltas = [json.loads(r[6:])["choices"][0]["delta"] for r in released]
        out = "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas)
        leak_at = arguments.index(marker) + (len(marker) if marker.endswith('"') else 0)
        assert arguments.startswith(out) and len(out) <= leak_at  # no character of the leak left
    finally:
        await svc.aclose()


# the arguments of a whole (non-streamed) strict answer, in the forms the parse-once check missed
BODIES = {
    # a JSON document escaped once more inside the arguments (a tool whose parameter is JSON text)
    "escaped_twice": json.dumps({"call": json.dumps({"path": "a.py", "content": CODE})}),
    # a JSON string literal, not an object
    "string_literal": json.dumps("Popraw:\n" + CODE),
    # cut off mid-string (``finish_reason: length``): not valid JSON, the client still shows it
    "cut_off": json.dumps({"path": "a.py", "content": CODE})[:-40],
}


@pytest.mark.parametrize("form", sorted(BODIES))
async def test_strict_body_with_tool_call_arguments_escaped_twice_or_cut_off_is_withheld(tmp_path, form):
    """A whole strict answer whose tool-call arguments hold tenant a's code JSON-escaped twice, as
    a string literal, or cut off before the JSON ends: before, ``unescaped_values`` parsed one
    level of a complete object or array only, found nothing, and the answer was released; now a
    ``leak_index`` incident (confirmed, naming a) withholds it."""
    svc = build_verifier(settings(tmp_path), secrets=SECRETS)
    try:
        await svc.admit(ex(A, "Popraw ten kod:\n" + CODE))
        g = svc.begin(await _admitted(svc, ex(STRICT, "Zapisz plik.")))
        with pytest.raises(ResponseWithheld) as e:
            await g.check_body(["", BODIES[form]], usage=None, finish_reason="length", ttft_seconds=None)
        assert e.value.detector == "leak_index"
        (inc,) = [i for i in svc.incidents.recent if i.detector == "leak_index"]
        assert (inc.tenant, inc.withheld, inc.confirmed, inc.evidence["source_tenant"]) == ("s", True, True, "a")
    finally:
        await svc.aclose()


async def test_strict_body_with_a_leak_in_logprob_bytes_is_withheld(tmp_path):
    """An answer whose ``content`` is harmless while its logprobs' ``bytes`` (the UTF-8 bytes a
    client rebuilds each token's text from, OpenAI's way to show emoji) spell tenant a's text:
    before, ``bytes`` was metadata and never read, and the answer was released; now the bytes
    that differ from their token are checked as text (``leak_index``, withheld)."""
    svc = build_verifier(settings(tmp_path), secrets=SECRETS)
    try:
        await svc.admit(ex(A, VICTIM_VI))
        g = svc.begin(await _admitted(svc, ex(STRICT, "Nói gì đó đi.")))
        leak = VICTIM_VI[200:1400].encode()
        words = ["Xin", " chào", "."]
        items = [{"token": w, "logprob": -0.1, "bytes": list(w.encode())} for w in words]
        items[1]["bytes"] = list(leak)
        body = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(words)}}]}
        body["choices"][0]["logprobs"] = {"content": items}
        out = parse_body(body)
        with pytest.raises(ResponseWithheld) as e:
            await g.check_body(list(out.fields.values()), usage=None, finish_reason="stop", ttft_seconds=None)
        assert e.value.detector == "leak_index"
    finally:
        await svc.aclose()


def test_honest_logprob_bytes_add_no_text_stream():
    """Bytes equal to their token's UTF-8 (every honest engine's) are not read twice."""
    items = [{"token": t, "logprob": -0.1, "bytes": list(t.encode())} for t in ("Hé", "llo")]
    out = parse_body({"choices": [{"index": 0, "message": {"content": "Héllo"}, "logprobs": {"content": items}}]})
    assert out.fields == {"0:content": "Héllo", "0:logprobs": "Héllo"}


@pytest.mark.parametrize("step", [1, 2, 3, 5, 13])
def test_json_strings_decodes_string_values_in_pieces_like_a_parser(step):
    """The incremental decoder gives the string values a JSON parser gives (keys left out, each
    value followed by a line break), whatever the pieces: escapes and surrogate pairs split
    across pieces, a lone surrogate as U+FFFD, and text cut off inside a string."""
    doc = {"k\\ey": 'a\nb "q" \\ / é 😀', "list": ["x", {"in": "y\tz"}, 1, None, "ą"], "": "last"}
    text = json.dumps(doc, ensure_ascii=True)
    d = JsonStrings()
    got = "".join(d.push(text[i : i + step]) for i in range(0, len(text), step))
    assert got == 'a\nb "q" \\ / é 😀\nx\ny\tz\ną\nlast\n'
    cut = JsonStrings()
    assert cut.push('{"a": "one\\ud83d\\u0041 tw') == "one\ufffdA tw"
    assert unescaped_values('["x\\n", "{\\"y\\": \\"1\\\\n2\\"}"]') == ["x\n", '{"y": "1\\n2"}', "1\n2"]
