"""The mock engine of :mod:`tests.mock_engine`, plus the rest of the API vLLM serves, on the wire
formats kvgate relays:

- ``POST /v1/responses``: a whole ``response`` object, or (``stream: true``) the Responses event
  stream as OpenAI and vLLM send it: ``event: <type>`` + ``data: <json>`` per event,
  ``response.created``, ``response.in_progress``, ``response.output_item.added``,
  ``response.content_part.added``, one ``response.output_text.delta`` per word,
  ``response.output_text.done``, ``response.content_part.done``, ``response.output_item.done``,
  ``response.completed`` with ``usage`` ``{input_tokens, output_tokens, total_tokens}``, and no
  ``[DONE]``. ``state.responses_events`` replaces the stream with raw chunks (an ``error`` event,
  reasoning or function-call deltas).
- ``POST /v1/embeddings``: vLLM/OpenAI shape; ``encoding_format`` ``float`` or ``base64``
  (little-endian float32, what the ``openai`` SDK asks for by default); ``dimensions`` cuts the
  vector; usage counts each input with the bundled tokenizer (exactly the gateway's count).
- ``POST /tokenize``, ``/detokenize`` (vLLM) and ``/v1/tokenize``, ``/v1/detokenize``: the bundled
  tokenizer's answers (``count``, ``max_model_len``, ``tokens``; ``prompt``).

Usage ``input_tokens`` of a response is ``state.prompt_tokens`` unless ``state.count_prompts``,
then the bundled tokenizer's count of the converted input (what the gateway counts).
"""

from __future__ import annotations

import asyncio
import base64
import json
import struct
import time
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.mock_engine import MockEngine, MockState, ServerThread, build_app
from tokenizer import bundled_counter
from tokenizer.responses import count_responses, responses_to_chat

COUNTER = bundled_counter()


@dataclass
class ApiMockState(MockState):
    """:class:`MockState` plus: ``responses_events`` (raw chunks of a Responses stream, replacing
    the default one), ``count_prompts`` (report the bundled tokenizer's counts as usage),
    ``embedding_dim`` (length of each vector before ``dimensions``), ``max_model_len``
    (what ``/tokenize`` reports)."""

    responses_events: list[bytes] | None = None
    count_prompts: bool = True
    embedding_dim: int = 8
    max_model_len: int = 8192


def sse(event: dict[str, Any]) -> bytes:
    """One Responses stream event: ``event: <type>`` then ``data: <json>``, a blank line."""
    return f"event: {event['type']}\ndata: ".encode() + json.dumps(event, ensure_ascii=False).encode() + b"\n\n"


def _response_obj(rid: str, body: dict, status: str, output: list, usage: dict | None) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "response",
        "created_at": 1,
        "model": body.get("model", "m"),
        "status": status,
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "usage": usage,
    }


def _usage(state: ApiMockState, body: dict, output_tokens: int) -> dict[str, Any]:
    if state.count_prompts:
        prompt = responses_to_chat(body.get("input"), body.get("instructions"), body.get("tools"))
        input_tokens = count_responses(COUNTER, prompt)
    else:
        input_tokens = state.prompt_tokens
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + output_tokens,
    }


def _message_item(text: str, status: str) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []
    return {"id": "msg_1", "type": "message", "role": "assistant", "status": status, "content": content}


def response_stream(state: ApiMockState, body: dict) -> list[bytes]:
    """The default Responses event stream for ``state.text`` (see the module docstring)."""
    words = state.text.split(" ")
    pieces = [w if i == 0 else " " + w for i, w in enumerate(words)]
    seq = iter(range(1 << 30))
    ev: list[dict[str, Any]] = [
        {"type": "response.created", "response": _response_obj("resp_1", body, "in_progress", [], None)},
        {"type": "response.in_progress", "response": _response_obj("resp_1", body, "in_progress", [], None)},
        {"type": "response.output_item.added", "output_index": 0, "item": _message_item("", "in_progress")},
        {
            "type": "response.content_part.added",
            "item_id": "msg_1",
            "output_index": 0,
            "content_index": 0,
            "part": {"type": "output_text", "text": "", "annotations": []},
        },
    ]
    for p in pieces:
        ev.append(
            {
                "type": "response.output_text.delta",
                "item_id": "msg_1",
                "output_index": 0,
                "content_index": 0,
                "delta": p,
                "logprobs": [],
            }
        )
    item = _message_item(state.text, "completed")
    ev += [
        {
            "type": "response.output_text.done",
            "item_id": "msg_1",
            "output_index": 0,
            "content_index": 0,
            "text": state.text,
            "logprobs": [],
        },
        {
            "type": "response.content_part.done",
            "item_id": "msg_1",
            "output_index": 0,
            "content_index": 0,
            "part": item["content"][0],
        },
        {"type": "response.output_item.done", "output_index": 0, "item": item},
        {
            "type": "response.completed",
            "response": _response_obj("resp_1", body, "completed", [item], _usage(state, body, len(pieces))),
        },
    ]
    return [sse({**e, "sequence_number": next(seq)}) for e in ev]


def response_body(state: ApiMockState, body: dict) -> dict[str, Any]:
    """A whole ``response`` object with ``state.text``."""
    n = len(state.text.split(" "))
    return _response_obj("resp_1", body, "completed", [_message_item(state.text, "completed")], _usage(state, body, n))


def _vector(i: int, dim: int) -> list[float]:
    return [float((i + 1) * (k + 1)) / 8.0 for k in range(dim)]  # exact in float32


def embeddings_body(state: ApiMockState, body: dict) -> dict[str, Any]:
    """An embeddings answer: one vector per input, usage from the bundled tokenizer."""
    from tokenizer.embeddings import split_embedding_input

    inputs = split_embedding_input(body["input"])
    counts = [COUNTER.count_prompt_text(p) if isinstance(p, str) else len(p) for p in inputs]
    dim = body.get("dimensions") or state.embedding_dim
    data = []
    for i in range(len(inputs)):
        vec = _vector(i, dim)
        if body.get("encoding_format") == "base64":
            emb: Any = base64.b64encode(struct.pack(f"<{dim}f", *vec)).decode()
        else:
            emb = vec
        data.append({"object": "embedding", "index": i, "embedding": emb})
    total = sum(counts) if state.count_prompts else state.prompt_tokens
    return {
        "id": "embd-1",
        "object": "list",
        "created": 1,
        "model": body.get("model", "m"),
        "data": data,
        "usage": {"prompt_tokens": total, "total_tokens": total},
    }


def api_routes(state: ApiMockState) -> list[Route]:
    """The routes this module adds to the mock engine."""

    async def record(request: Request) -> tuple[dict, str]:
        raw = await request.body()
        body = json.loads(raw)
        state.requests.append({"path": request.url.path, "headers": dict(request.headers), "body": body, "raw": raw})
        return body, request.headers.get("x-request-id", "")

    async def steer(request: Request, rid: str) -> Response | None:
        if state.mode == "delay":
            await asyncio.sleep(state.delay_seconds)
        if state.mode == "hang":
            while not await request.is_disconnected():
                await asyncio.sleep(0.02)
            state.cancelled.append((rid, time.monotonic()))
            return Response(status_code=499)
        if state.mode == "error":
            return Response(state.error_body, status_code=state.error_status, media_type="application/json")
        return None

    async def responses(request: Request) -> Response:
        body, rid = await record(request)
        early = await steer(request, rid)
        if early is not None:
            return early
        if not body.get("stream"):
            return JSONResponse(response_body(state, body), headers=state.headers)
        chunks = state.responses_events if state.responses_events is not None else response_stream(state, body)
        interval = state.chunk_interval_seconds

        async def gen():
            try:
                for c in chunks:
                    yield c
                    if interval:
                        await asyncio.sleep(interval)
                if state.mode == "reset":
                    raise RuntimeError("mock reset mid-stream")
            except asyncio.CancelledError:
                state.cancelled.append((rid, time.monotonic()))
                raise

        return StreamingResponse(gen(), media_type="text/event-stream")

    async def embeddings(request: Request) -> Response:
        body, rid = await record(request)
        early = await steer(request, rid)
        if early is not None:
            return early
        return JSONResponse(embeddings_body(state, body), headers=state.headers)

    async def tokenize(request: Request) -> Response:
        body, rid = await record(request)
        early = await steer(request, rid)
        if early is not None:
            return early
        if body.get("messages") is not None:
            ids = COUNTER.encode_chat(body["messages"], body.get("tools"))
        else:
            ids = COUNTER.encode_text(body["prompt"])
        return JSONResponse({"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids})

    async def detokenize(request: Request) -> Response:
        body, rid = await record(request)
        early = await steer(request, rid)
        if early is not None:
            return early
        text = COUNTER.decode(body["tokens"])
        return JSONResponse({"prompt": text} if not request.url.path.startswith("/v1/") else {"text": text})

    return [
        Route("/v1/responses", responses, methods=["POST"]),
        Route("/v1/embeddings", embeddings, methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/v1/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/v1/detokenize", detokenize, methods=["POST"]),
    ]


class ApiMockEngine(MockEngine):
    """:class:`~tests.mock_engine.MockEngine` with the routes of this module; ``state`` is an
    :class:`ApiMockState`."""

    def __init__(self) -> None:
        self.state = ApiMockState()
        app = build_app(self.state)
        app.router.routes.extend(api_routes(self.state))
        ServerThread.__init__(self, app)
