"""The prompt side decodes a tool call's ``arguments`` as the response side does: a victim whose
own prompt carries its text in arguments escaped twice, as a JSON string literal (of a document),
or cut off mid-JSON has that text indexed decoded too, so another tenant's answer leaking it in
plain form (or in any escaped form the response side decodes) is a ``leak_index`` incident naming
the victim.

Before, the prompt side parsed arguments one level and only when they were valid JSON
(``tokenizer.prompt_text._arguments_texts``), while the response side decodes up to 3 levels and
cut-off JSON leniently (``unescaped_values``): the victim's text was indexed only escaped
(``\\n`` where the leak has a line break), the shingles never met, and the leak was released.
Now both sides use one decoder (``tokenizer/json_values.py``).

Through the verifier (the harness of tests/test_verifier_round4.py, the victim's prompt text as
the gateway builds it for a chat, ``CHAT.prompt_text``), then once end to end through the gateway
(the harness of tests/test_verifier_prompt_text.py)."""

from __future__ import annotations

import json
import uuid
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from config.models import TenantConfig
from gateway.routes.chat import CHAT
from tests.fixtures.leak_stack import leak_stack
from tests.fixtures.settings import verifier_settings
from tests.test_verifier_prompt_text import Engine, auth, key_of, notes, tenants
from tokenizer.prompt_text import chat_text
from verifier.build import build_verifier
from verifier.shingles import encode
from verifier.stage import Exchange, ExchangeRequest, ResponseWithheld

SECRETS = {"leak_index_key": b"prompt-args-key", "cache_salt_key": b"x", "admin_key": b"y"}
settings = partial(verifier_settings, latency_min_samples=5, latency_min_prompt_tokens=100)


def tenant(tid: str, **kw: Any) -> TenantConfig:
    return TenantConfig(id=tid, verify_sample_rate=1.0, **kw)


A, STRICT = tenant("a"), tenant("s", strict_verify=True)

#: tenant a's code: every line shorter than a shingle (16 tokens), so no shingle of the escaped
#: form (``\n`` written out) is one of the plain text's
CODE = "\n".join(f"    t{i} = part({i}, w={i * 7 % 13})" for i in range(60))
#: what the other tenant's answer leaks: lines 5 to 44 (inside every victim form, the cut ones too)
SLICE = "\n".join(CODE.split("\n")[5:45])
DOC = json.dumps({"path": "a.py", "content": CODE})

# tenant a's own tool-call arguments, in the forms the one-level prompt side indexed escaped only
VICTIM_ARGS = {
    # a JSON document escaped once more inside a value (a tool whose parameter is JSON text)
    "escaped_twice": json.dumps({"call": DOC}),
    # a JSON string literal of the code (parsed before too: a control)
    "string_literal": json.dumps("Popraw:\n" + CODE),
    # a JSON string literal holding a JSON document
    "string_literal_of_document": json.dumps(DOC),
    # cut off mid-string (the model's call was cut at max_tokens, and the client sends it back)
    "cut_off": DOC[:-40],
    # escaped twice and cut off: both documents unfinished
    "cut_off_escaped_twice": json.dumps({"call": DOC})[:-40],
}

# the other tenant's answer text (content, or a tool call's arguments) leaking SLICE
LEAKS = {
    "plain": SLICE,
    "arguments": json.dumps({"content": SLICE}),
    "escaped_twice": json.dumps({"call": json.dumps({"content": SLICE})}),
    "string_literal": json.dumps(SLICE),
    "cut_off": json.dumps({"content": SLICE})[:-20],
}


def victim_chat(arguments: str) -> dict[str, Any]:
    """Tenant a's agent turn: its code only in an earlier tool call's ``arguments``."""
    return {
        "model": "m",
        "max_tokens": 64,
        "messages": [
            {"role": "user", "content": "Popraw ten kod."},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "write_file", "arguments": arguments}}
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "saved"},
            {"role": "user", "content": "Dzięki."},
        ],
    }


def ex(t: TenantConfig, prompt: str) -> Exchange:
    request = ExchangeRequest(f"req-{uuid.uuid4().hex[:8]}", t, "up", "m", len(encode(prompt)), False, 0.0)
    return Exchange(request, prompt)


def test_victim_forms_hold_the_leaked_slice_only_escaped():
    """Control: each victim form's arguments hold SLICE only JSON-escaped (not as plain text), and
    the prompt text now also holds it plain, as the response side decodes a leak of it."""
    for form, args in VICTIM_ARGS.items():
        assert SLICE not in args, form
        assert SLICE in CHAT.prompt_text(victim_chat(args)), form


def test_prompt_text_decodes_arguments_as_the_response_side_does():
    """Exact prompt text of a call whose arguments are a document escaped twice and cut off: the
    arguments as sent, the outer document's values so far (the inner document's text), then the
    inner document's values so far, each value ending with a line break (the lenient decoder's)."""
    inner = json.dumps({"path": "a.py", "content": "x = 1\ny = 2"})
    args = json.dumps({"call": inner})[:-9]
    assert args == '{"call": "{\\"path\\": \\"a.py\\", \\"content\\": \\"x = 1\\\\ny'
    got = chat_text([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": args}}]}])
    assert got == "\n".join(["f", args, '{"path": "a.py", "content": "x = 1\\ny', "a.py\nx = 1\ny"])


@pytest.mark.parametrize("leak", sorted(LEAKS))
@pytest.mark.parametrize("victim", sorted(VICTIM_ARGS))
async def test_leak_of_text_from_decoded_prompt_arguments_is_withheld(tmp_path, victim, leak):
    """Tenant a's prompt (its chat's prompt text) holds its code only in tool-call arguments in
    ``victim`` form; a strict tenant's whole answer leaks lines of it in ``leak`` form (as content,
    or as a tool call's arguments). Withheld: one ``leak_index`` incident on tenant s, confirmed,
    naming tenant a. Before, every pair whose decoded texts met only on the plain code was
    released (the prompt side indexed the victim's code escaped only)."""
    svc = build_verifier(settings(tmp_path), secrets=SECRETS)
    try:
        await svc.admit(ex(A, CHAT.prompt_text(victim_chat(VICTIM_ARGS[victim]))))
        e_s = ex(STRICT, "Zapisz plik.")
        await svc.admit(e_s)
        g = svc.begin(e_s)
        texts = [LEAKS[leak]] if leak == "plain" else ["", LEAKS[leak]]
        with pytest.raises(ResponseWithheld) as e:
            await g.check_body(texts, usage=None, finish_reason="stop", ttft_seconds=None)
        assert e.value.detector == "leak_index"
        leaks = [i for i in svc.incidents.recent if i.detector == "leak_index"]
        assert [(i.tenant, i.withheld, i.confirmed, i.evidence["source_tenant"]) for i in leaks] == [
            ("s", True, True, "a")
        ]
    finally:
        await svc.aclose()


@pytest.mark.parametrize("victim", ["escaped_twice", "cut_off"])
def test_gateway_indexes_decoded_arguments_and_the_leak_names_the_sender(tmp_path: Path, victim: str) -> None:
    """End to end: tenant owner's chat carries its notes (lines shorter than a shingle) only in a
    tool call's arguments, escaped twice or cut off; the engine then answers a strict tenant with
    the notes in plain text: 502 ``response_withheld``, one ``leak_index`` incident naming owner."""
    secret = notes(21, True)
    doc = json.dumps({"path": "n.txt", "content": secret})
    args = json.dumps({"call": doc}) if victim == "escaped_twice" else doc[:-30]
    engine = Engine()
    with leak_stack(tmp_path, engine.app(), tenants(), SECRETS, (key_of("other"), "Hello there.")) as (svc, client):
        body = victim_chat(args)
        r = client.post("/v1/chat/completions", json=body, headers=auth("owner"))
        assert r.status_code == 200, r.text
        assert [i for i in svc.incidents.recent if i.detector == "leak_index"] == []

        engine.answer = "Here is something I remember:\n" + "\n".join(secret.split("\n")[:40])
        chat = {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "Tell me a story."}]}
        r = client.post("/v1/chat/completions", json=chat, headers=auth("strict"))
        assert r.status_code == 502, r.text
        assert r.json()["error"]["code"] == "response_withheld"
        leaks = [i for i in svc.incidents.recent if i.detector == "leak_index"]
        assert [(i.tenant, i.evidence["source_tenant"], i.withheld) for i in leaks] == [("strict", "owner", True)]
