"""The verifier's prompt text of a request holds every string the engine renders, not only the
messages' content: tool-call names and arguments, tool definitions, a message's ``name``,
reasoning, the Responses API's function-call items and the completions ``suffix``
(docs/verifier.md, "The leak index").

Through the real gateway app against a scripted engine (tests/fixtures/leak_stack.py):

- text a tenant sends only in a tool call's ``arguments`` is indexed at its admission, so the
  engine echoing it into another (strict) tenant's answer is a ``leak_index`` incident naming
  the sender, and the answer is withheld;
- a strict tenant's honest answer quoting its own tool-call arguments is its own text, released
  whole, even when another tenant sent the same text.

Both with text on one line and with text of several lines (the arguments then carry JSON ``\\n``
escapes; the answer quotes the lines themselves). Then the prompt text itself, exact, for a chat,
a Responses input and a completions request.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from config.models import TenantConfig, TenantsFile
from gateway.routes.chat import CHAT
from gateway.routes.completions import COMPLETIONS
from tests.fixtures.leak_stack import leak_stack
from tokenizer.responses import responses_text, responses_to_chat
from verifier.probe import filler_words

SECRETS = {"leak_index_key": b"prompt-text-key", "cache_salt_key": b"prompt-text-salt", "admin_key": b"pt-admin"}


def key_of(tid: str) -> str:
    return f"sk-prompt-text-{tid}"


def tenants() -> TenantsFile:
    rows = []
    for tid, strict in (("owner", False), ("other", False), ("strict", True)):
        rows.append(
            TenantConfig(
                id=tid,
                api_key_sha256=[hashlib.sha256(key_of(tid).encode()).hexdigest()],
                strict_verify=strict,
                allowed_models=["m"],
            )
        )
    return TenantsFile(tenants=rows)


def notes(seed: int, lines: bool) -> str:
    """About 200 words; ``lines``: 4 words a line (a file's lines, each shorter than a shingle)."""
    rng = random.Random(seed)
    words = [rng.choice(filler_words()) + str(rng.randrange(1000)) for _ in range(200)]
    if not lines:
        return " ".join(words)
    return "\n".join(" ".join(words[i : i + 4]) for i in range(0, len(words), 4))


class Engine:
    """Answers every chat with ``answer`` (and records the bodies), every completion ``ok``."""

    def __init__(self) -> None:
        self.answer = "ok"
        self.chats: list[dict[str, Any]] = []

    async def chat(self, request: Request) -> JSONResponse:
        self.chats.append(await request.json())
        return JSONResponse(answer_json(self.answer))

    async def completions(self, request: Request) -> JSONResponse:
        return JSONResponse(
            {
                "id": "x1",
                "object": "text_completion",
                "created": 1,
                "model": "m",
                "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 0, "completion_tokens": 1, "total_tokens": 1},
            }
        )

    async def responses(self, request: Request) -> JSONResponse:
        part = {"type": "output_text", "text": "ok", "annotations": []}
        item = {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant", "content": [part]}
        return JSONResponse(
            {
                "id": "resp_1",
                "object": "response",
                "status": "completed",
                "model": "m",
                "error": None,
                "output": [item],
                "usage": {"input_tokens": 0, "output_tokens": 1, "total_tokens": 1},
            }
        )

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/responses", self.responses, methods=["POST"]),
            ]
        )


def answer_json(text: str) -> dict[str, Any]:
    return {
        "id": "c1",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 0, "completion_tokens": 10, "total_tokens": 10},
    }


def agent_chat(text: str) -> dict[str, Any]:
    """A turn of an agent: ``text`` is only in an earlier tool call's ``arguments``."""
    return {
        "model": "m",
        "max_tokens": 64,
        "messages": [
            {"role": "user", "content": "Save my notes."},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "write_file", "arguments": json.dumps({"path": "n.txt", "content": text})},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "saved"},
            {"role": "user", "content": "Read my notes back to me."},
        ],
        "tools": [{"type": "function", "function": {"name": "write_file", "parameters": {"type": "object"}}}],
    }


def auth(tid: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key_of(tid)}"}


@pytest.mark.parametrize("lines", [False, True], ids=["one_line", "lines"])
def test_text_sent_only_in_tool_call_arguments_is_indexed_and_its_leak_names_the_sender(
    tmp_path: Path, lines: bool
) -> None:
    secret = notes(11, lines)
    engine = Engine()
    with leak_stack(tmp_path, engine.app(), tenants(), SECRETS, (key_of("other"), "Hello there.")) as (svc, client):
        r = client.post("/v1/chat/completions", json=agent_chat(secret), headers=auth("owner"))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == "ok"
        assert [i.detector for i in svc.incidents.recent if i.detector == "leak_index"] == []

        engine.answer = "Here is something I remember: " + secret
        body = {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "Tell me a story."}]}
        r = client.post("/v1/chat/completions", json=body, headers=auth("strict"))
        assert r.status_code == 502, r.text
        assert r.json()["error"]["code"] == "response_withheld"
        assert secret.split()[0] not in r.text
        leaks = [i for i in svc.incidents.recent if i.detector == "leak_index"]
        assert [(i.tenant, i.evidence["source_tenant"], i.withheld) for i in leaks] == [("strict", "owner", True)]
        assert leaks[0].evidence["shingles_own"] == 0
        assert leaks[0].evidence["shingles_foreign"] > 0
        assert leaks[0].id in r.json()["error"]["message"]


@pytest.mark.parametrize("lines", [False, True], ids=["one_line", "lines"])
def test_strict_answer_quoting_its_own_tool_call_arguments_is_released(tmp_path: Path, lines: bool) -> None:
    text = notes(12, lines)
    engine = Engine()
    engine.answer = "Your notes:\n" + text
    # tenant 'other' sends the same text first (a completions prompt, indexed at its admission)
    with leak_stack(tmp_path, engine.app(), tenants(), SECRETS, (key_of("other"), text)) as (svc, client):
        r = client.post("/v1/chat/completions", json=agent_chat(text), headers=auth("strict"))
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["choices"] == answer_json("Your notes:\n" + text)["choices"]
        assert (got["id"], got["object"], got["model"]) == ("c1", "chat.completion", "m")
        assert [i for i in svc.incidents.recent if i.detector == "leak_index"] == []
        assert len(engine.chats) == 1


def test_text_sent_only_in_a_responses_function_call_is_indexed_and_its_leak_names_the_sender(tmp_path: Path) -> None:
    secret = notes(13, False)
    engine = Engine()
    body = {
        "model": "m",
        "max_output_tokens": 64,
        "input": [
            {"role": "user", "content": "Save my notes."},
            {
                "type": "function_call",
                "call_id": "c1",
                "name": "write_file",
                "arguments": json.dumps({"content": secret}),
            },
            {"type": "function_call_output", "call_id": "c1", "output": "saved"},
            {"role": "user", "content": "Thanks."},
        ],
    }
    with leak_stack(tmp_path, engine.app(), tenants(), SECRETS, (key_of("other"), "Hello there.")) as (svc, client):
        r = client.post("/v1/responses", json=body, headers=auth("owner"))
        assert r.status_code == 200, r.text
        assert r.json()["output"][0]["content"][0]["text"] == "ok"

        engine.answer = "Here is something I remember: " + secret
        chat = {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "Tell me a story."}]}
        r = client.post("/v1/chat/completions", json=chat, headers=auth("strict"))
        assert r.status_code == 502, r.text
        assert r.json()["error"]["code"] == "response_withheld"
        leaks = [i for i in svc.incidents.recent if i.detector == "leak_index"]
        assert [(i.tenant, i.evidence["source_tenant"], i.withheld) for i in leaks] == [("strict", "owner", True)]


def test_chat_prompt_text_holds_every_rendered_string() -> None:
    args = json.dumps({"path": "a.txt", "content": "line one\nline \u00e9two"})
    body = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "name": "alice", "content": [{"type": "text", "text": "Hi"}, {"type": "image_url"}]},
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "Think first.",
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "write_file", "arguments": args}},
                    {"id": "c2", "type": "function", "function": {"name": "ls", "arguments": '{"dir": "/tmp"}'}},
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
            {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]},
        ],
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "write_file",
                    "description": "Write a file.",
                    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
                },
            }
        ],
    }
    assert CHAT.prompt_text(body) == "\n".join(
        [
            '{"type": "function", "function": {"name": "write_file", "description": "Write a file.", '
            '"parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}',
            "Be brief.",
            "alice",
            "Hi",
            "Think first.",
            "write_file",
            '{"path": "a.txt", "content": "line one\\nline \\u00e9two"}',
            "a.txt",
            "line one\nline \u00e9two",
            "ls",
            '{"dir": "/tmp"}',
            "ok",
            "No.",
        ]
    )


def test_responses_prompt_text_holds_function_calls_reasoning_and_tools() -> None:
    prompt = responses_to_chat(
        [
            {"role": "user", "content": [{"type": "input_text", "text": "Save it."}]},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "The user wants a file."}]},
            {"type": "function_call", "call_id": "c1", "name": "write_file", "arguments": '{"content": "the data"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "written"},
            {"role": "user", "content": "Thanks."},
        ],
        instructions="You are an agent.",
        tools=[{"type": "function", "name": "write_file", "description": "Write.", "parameters": {"type": "object"}}],
    )
    assert responses_text(prompt) == "\n".join(
        [
            '{"type": "function", "function": {"name": "write_file", "description": "Write.", '
            '"parameters": {"type": "object"}}}',
            "You are an agent.",
            "Save it.",
            "The user wants a file.",
            "write_file",
            '{"content": "the data"}',
            "written",
            "Thanks.",
        ]
    )


def test_completions_prompt_text_holds_the_suffix() -> None:
    assert COMPLETIONS.prompt_text({"prompt": "def f():", "suffix": "    return 1"}) == "def f():\n    return 1"
    assert COMPLETIONS.prompt_text({"prompt": ["a b", "c d"], "suffix": "end"}) == "a b\nc d\nend"
    assert COMPLETIONS.prompt_text({"prompt": [[1, 2, 3]], "suffix": "tail"}) == "tail"
    assert COMPLETIONS.prompt_text({"prompt": "x", "suffix": ""}) == "x"
