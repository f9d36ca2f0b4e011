"""A controllable mock inference engine for gateway tests: a Starlette app run by uvicorn on a
free loopback port in a thread of the test process.

It speaks the shapes kvgate reads: SGLang ``/server_info`` (and ``/get_server_info``), vLLM
``/v1/models``, and OpenAI ``/v1/chat/completions`` / ``/v1/completions`` (JSON or SSE). Tests
steer it through :class:`MockState` (``engine.state``) and read back what it received
(``engine.state.requests``) and which requests it saw cancelled (``engine.state.cancelled``), by
the ``x-request-id`` the gateway sent: its own id for the request (:func:`gateway_id`), never the
client's.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route


@dataclass
class MockState:
    """What the engine does. ``info_mode``: ``ok`` | ``missing`` (no max_total_num_tokens) |
    ``404`` (only ``/get_server_info`` answers) | ``500`` | ``hang``. ``mode``: ``ok`` | ``error``
    (answer ``error_status`` with ``error_body``) | ``hang`` (never answer) | ``delay`` (sleep
    ``delay_seconds`` first) | ``reset`` (stream ``stream_chunks`` then break the connection) |
    ``trickle`` (a whole answer sent a byte every ``chunk_interval_seconds``).
    ``stream_chunks``: raw byte chunks of a stream (default: built from ``text``)."""

    pool_tokens: int = 4096
    max_req_input_len: int | None = None
    context_length: int | None = 8192
    info_mode: str = "ok"
    info_hits: int = 0
    vllm_max_model_len: int | None = None
    mode: str = "ok"
    delay_seconds: float = 0.0
    error_status: int = 400
    error_body: bytes = b""
    text: str = "Hello from the mock."
    stream_chunks: list[bytes] | None = None
    chunk_interval_seconds: float = 0.0
    prompt_tokens: int = 7
    finish_reason: str = "stop"
    headers: dict[str, str] = field(default_factory=dict)
    requests: list[dict[str, Any]] = field(default_factory=list)
    cancelled: list[tuple[str, float]] = field(default_factory=list)
    #: when set, ``/server_info`` and ``/v1/models`` answer 401 unless ``Authorization: Bearer <it>``
    #: (as vLLM and SGLang started with ``--api-key`` do)
    api_key: str | None = None
    info_auth: list[str | None] = field(default_factory=list)

    def request_ids(self) -> list[str]:
        """The ``x-request-id`` of each completion request received, in order ("" when none)."""
        return [r["headers"].get("x-request-id", "") for r in self.requests]

    def cancelled_ids(self) -> list[str]:
        """The ``x-request-id`` of each request seen abandoned, in order."""
        return [rid for rid, _ in self.cancelled]


def gateway_id(value: Any, client_id: str | None = None) -> str:
    """``value``, asserted to be an id the gateway made for the engine (the ``x-request-id`` it
    forwards, the access line's ``upstream_request_id``): 32 lowercase hex digits, and not the
    client's ``client_id``."""
    assert isinstance(value, str) and re.fullmatch(r"[0-9a-f]{32}", value), value
    assert value != client_id
    return value


def _chat_chunk(rid: str, delta: dict, finish: str | None, usage_null: bool) -> bytes:
    obj: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }
    if usage_null:
        obj["usage"] = None
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def default_stream(state: MockState, body: dict, chat: bool) -> list[bytes]:
    """The events an engine sends for ``state.text``: (chat: a role chunk,) one chunk per word,
    a finish chunk, the usage chunk when asked, ``[DONE]``. Like OpenAI and vLLM, every chunk has
    ``"usage": null`` while ``include_usage`` is on."""
    include = bool((body.get("stream_options") or {}).get("include_usage"))
    words = state.text.split(" ")
    pieces = [w if i == 0 else " " + w for i, w in enumerate(words)]
    out = []
    if chat:
        out.append(_chat_chunk("c1", {"role": "assistant", "content": ""}, None, include))
        for p in pieces:
            out.append(_chat_chunk("c1", {"content": p}, None, include))
        out.append(_chat_chunk("c1", {}, state.finish_reason, include))
    else:
        for p in pieces:
            obj = {
                "id": "c1",
                "object": "text_completion",
                "created": 1,
                "model": "m",
                "choices": [{"index": 0, "text": p, "logprobs": None, "finish_reason": None}],
            }
            if include:
                obj["usage"] = None
            out.append(b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n")
        obj = {
            "id": "c1",
            "object": "text_completion",
            "created": 1,
            "model": "m",
            "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": state.finish_reason}],
        }
        if include:
            obj["usage"] = None
        out.append(b"data: " + json.dumps(obj).encode() + b"\n\n")
    if include:
        usage = {
            "prompt_tokens": state.prompt_tokens,
            "completion_tokens": len(pieces),
            "total_tokens": state.prompt_tokens + len(pieces),
        }
        obj = {
            "id": "c1",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": 1,
            "model": "m",
            "choices": [],
            "usage": usage,
        }
        out.append(b"data: " + json.dumps(obj).encode() + b"\n\n")
    out.append(b"data: [DONE]\n\n")
    return out


def whole_body(state: MockState, chat: bool) -> dict:
    """A non-streamed OpenAI answer with ``state.text``."""
    n = len(state.text.split(" "))
    usage = {"prompt_tokens": state.prompt_tokens, "completion_tokens": n, "total_tokens": state.prompt_tokens + n}
    if chat:
        return {
            "id": "c1",
            "object": "chat.completion",
            "created": 1,
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": state.text},
                    "finish_reason": state.finish_reason,
                }
            ],
            "usage": usage,
        }
    return {
        "id": "c1",
        "object": "text_completion",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "text": state.text, "finish_reason": state.finish_reason}],
        "usage": usage,
    }


class _Reset(Exception):
    pass


async def _trickled(state: MockState, answer: dict[str, Any], rid: str) -> AsyncIterator[bytes]:
    """``answer``'s JSON a byte every ``state.chunk_interval_seconds`` (an engine trickling its
    answer); a request abandoned meanwhile is recorded in ``state.cancelled``."""
    whole = json.dumps(answer).encode()
    try:
        for i in range(len(whole)):
            yield whole[i : i + 1]
            await asyncio.sleep(state.chunk_interval_seconds)
    except asyncio.CancelledError:
        state.cancelled.append((rid, time.monotonic()))
        raise


def build_app(state: MockState) -> Starlette:
    """The mock engine's ASGI app, steered by ``state``."""

    def unauthorized(request: Request) -> Response | None:
        state.info_auth.append(request.headers.get("authorization"))
        if state.api_key is not None and request.headers.get("authorization") != f"Bearer {state.api_key}":
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
        return None

    async def server_info(request: Request) -> Response:
        state.info_hits += 1
        if (denied := unauthorized(request)) is not None:
            return denied
        if state.info_mode == "404" and request.url.path == "/server_info":
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        if state.info_mode == "500":
            return JSONResponse({"error": "boom"}, status_code=500)
        if state.info_mode == "hang":
            await asyncio.sleep(3600)
        info: dict[str, Any] = {"page_size": 16, "disaggregation_mode": "prefill", "status": "ok", "version": "mock"}
        if state.info_mode != "missing":
            info["max_total_num_tokens"] = state.pool_tokens
        if state.max_req_input_len is not None:
            info["max_req_input_len"] = state.max_req_input_len
        if state.context_length is not None:
            info["context_length"] = state.context_length
        return JSONResponse(info)

    async def models(request: Request) -> Response:
        if (denied := unauthorized(request)) is not None:
            return denied
        entry: dict[str, Any] = {"id": "m", "object": "model"}
        if state.vllm_max_model_len is not None:
            entry["max_model_len"] = state.vllm_max_model_len
        return JSONResponse({"object": "list", "data": [entry]})

    async def completion(request: Request) -> Response:
        chat = request.url.path.endswith("/chat/completions")
        raw = await request.body()
        body = json.loads(raw)
        rid = request.headers.get("x-request-id", "")
        state.requests.append({"path": request.url.path, "headers": dict(request.headers), "body": body, "raw": raw})
        if state.mode == "delay":
            await asyncio.sleep(state.delay_seconds)
        if state.mode == "hang":
            while not await request.is_disconnected():
                await asyncio.sleep(0.02)
            state.cancelled.append((rid, time.monotonic()))
            return Response(status_code=499)
        if state.mode == "error":
            return Response(state.error_body, status_code=state.error_status, media_type="application/json")
        if not body.get("stream"):
            if state.mode == "trickle":
                return StreamingResponse(_trickled(state, whole_body(state, chat), rid), media_type="application/json")
            return JSONResponse(whole_body(state, chat), headers=state.headers)
        chunks = state.stream_chunks if state.stream_chunks is not None else default_stream(state, body, chat)
        reset = state.mode == "reset"
        interval = state.chunk_interval_seconds

        async def gen():
            try:
                for c in chunks:
                    yield c
                    if interval:
                        await asyncio.sleep(interval)
                if reset:
                    raise _Reset("mock reset mid-stream")
            except asyncio.CancelledError:
                state.cancelled.append((rid, time.monotonic()))
                raise

        return StreamingResponse(gen(), media_type="text/event-stream")

    routes = [
        Route("/server_info", server_info),
        Route("/get_server_info", server_info),
        Route("/v1/models", models),
        Route("/v1/chat/completions", completion, methods=["POST"]),
        Route("/v1/completions", completion, methods=["POST"]),
    ]
    return Starlette(routes=routes)


def free_socket() -> socket.socket:
    """A listening-ready loopback socket on a free port."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    return s


class ServerThread:
    """Runs an ASGI app under uvicorn in a daemon thread on a free loopback port."""

    def __init__(self, app: Any, configure: Any = None) -> None:
        """``configure``: applied to the ``uvicorn.Config`` before the server is built (e.g.
        ``gateway.edge.protocol.configure``: the gateway's own server layer)."""
        self.sock = free_socket()
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", lifespan="auto", timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(configure(config) if configure is not None else config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 15
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(5)
        self.sock.close()


class MockEngine(ServerThread):
    """The mock engine on a free port: ``state`` steers it, ``url`` is its base."""

    def __init__(self) -> None:
        self.state = MockState()
        super().__init__(build_app(self.state))

    @property
    def api_url(self) -> str:
        return self.url + "/v1"

    @property
    def info_url(self) -> str:
        return self.url + "/server_info"
