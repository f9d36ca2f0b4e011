"""FastAPI apps per role: the router API (OpenAI + SGLang native), the prefill node, the decode node.

Router (``--role router``, and ``--role all`` which also serves the prefill pool's
``/server_info``): ``/v1/completions``, ``/v1/chat/completions`` (stream or not),
``/v1/models``, ``/v1/tokenize``, ``/v1/detokenize``, ``/generate``, ``/abort_request``,
``/health``, ``/server_info`` + ``/get_server_info``, ``/v1/loads`` (one rank). Non-streamed (and
streamed) responses carry ``x-prefill-seconds``.

Nodes: ``/server_info`` + ``/get_server_info`` + ``/v1/loads`` (SGLang field names read from the live pool),
``/health``, and the internal disaggregation API under ``/disagg/``: prefill ``POST
/disagg/prefill`` and ``/disagg/abort`` (JSON); decode ``POST /disagg/generate`` (NDJSON token
stream), ``/disagg/transfer`` (safetensors + manifest, never pickle) and ``/disagg/release``.

``/debug/pool`` (test use only; only with ``debug=True``, i.e. ``--enable-debug-endpoints``)
reports each pool's free/used pages and whether every free page is zeroed.

Every error is the OpenAI shape (``config.errors``); unknown routes are an OpenAI-shaped 404.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeGuard

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response, StreamingResponse
from starlette.routing import BaseRoute

from config.errors import ErrorCode, OpenAIError
from gpu_backend import openai_api as api
from gpu_backend import responses_api
from gpu_backend.errors import EngineError
from gpu_backend.node_errors import backend_error
from gpu_backend.router import Router, RouterStream
from tokenizer import TiktokenCounter
from tokenizer.hf_counter import HFCounter

log = logging.getLogger("gpu_backend.servers")

#: Bodies above this many bytes are parsed/tokenized in a worker thread.
_OFFLOAD_BODY_BYTES = 32 * 1024
#: Largest JSON body the router accepts (a 2x-context prompt of token ids is far below it).
MAX_JSON_BODY_BYTES = 8 * 1024 * 1024
#: Largest transfer body the decode node accepts.
MAX_TRANSFER_BYTES = 1 << 30
VERSION = "kvgate-0.1.0"

Endpoint = Callable[..., Awaitable[Response]]
ServerInfo = Callable[[], Awaitable[dict[str, Any]]]
DebugPools = Callable[[], dict[str, Any]]
Lifespan = Callable[[FastAPI], Any]


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """JSON via orjson."""
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json", headers=headers)


def error_response(err: OpenAIError) -> Response:
    """The OpenAI error body with the error's status and headers."""
    return Response(err.body_bytes(), status_code=err.status, media_type="application/json", headers=err.headers)


class ClientDisconnected(Exception):
    """The client went away before the answer; the work was cancelled (answered 499, unread)."""


async def _openai_error(_: Request, exc: OpenAIError) -> Response:
    return error_response(exc)


async def _client_gone(_: Request, exc: Exception) -> Response:
    return Response(status_code=499)


async def _engine_error(_: Request, exc: EngineError) -> Response:
    return error_response(exc.to_openai())


async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    if exc.status_code == 404:
        message = f"Unknown route: {request.method} {request.url.path}"
        return error_response(OpenAIError(status=404, code=ErrorCode.NOT_FOUND, message=message))
    code = ErrorCode.METHOD_NOT_ALLOWED if exc.status_code == 405 else None
    return error_response(OpenAIError(status=exc.status_code, message=str(exc.detail), code=code))


async def _validation_error(_: Request, exc: RequestValidationError) -> Response:
    return error_response(api.bad_request(str(exc)))


async def _unexpected_error(_: Request, exc: Exception) -> Response:
    err = backend_error(exc)
    if err.status >= 500:
        log.exception("unhandled error", exc_info=exc)
    return error_response(err)


#: OpenAI-shaped errors for everything: typed errors keep status/code/param, a client gone is 499,
#: unknown routes 404 ``not_found``, wrong methods 405, anything unexpected 500 ``internal_error`` (logged).
EXCEPTION_HANDLERS: dict[int | type[Exception], Callable[[Request, Any], Coroutine[Any, Any, Response]]] = {
    OpenAIError: _openai_error,
    ClientDisconnected: _client_gone,
    ClientDisconnect: _client_gone,
    EngineError: _engine_error,
    StarletteHTTPException: _http_error,
    RequestValidationError: _validation_error,
    Exception: _unexpected_error,
}


def get(path: str, endpoint: Endpoint) -> APIRoute:
    """A ``GET`` route value."""
    return APIRoute(path, endpoint, methods=["GET"])


def post(path: str, endpoint: Endpoint) -> APIRoute:
    """A ``POST`` route value."""
    return APIRoute(path, endpoint, methods=["POST"])


def make_app(title: str, routes: list[BaseRoute], lifespan: Lifespan | None) -> FastAPI:
    """One role's app: ``routes`` in order, :data:`EXCEPTION_HANDLERS`, no docs or OpenAPI routes."""
    return FastAPI(
        title=title,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        routes=routes,
        exception_handlers=EXCEPTION_HANDLERS,
    )


async def read_json(request: Request, limit: int = MAX_JSON_BODY_BYTES) -> dict[str, Any]:
    """The body as a JSON object; 413 over ``limit`` bytes, 400 when not a JSON object."""
    raw = await read_body(request, limit)
    if len(raw) > _OFFLOAD_BODY_BYTES:
        return await asyncio.to_thread(api.parse_json_body, raw)
    return api.parse_json_body(raw)


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, refusing more than ``limit`` bytes (413 ``request_too_large``)."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise OpenAIError(status=413, code=ErrorCode.REQUEST_TOO_LARGE, message=f"Body over {limit} bytes.")
    chunks, size = [], 0
    async for c in request.stream():
        size += len(c)
        if size > limit:
            raise OpenAIError(status=413, code=ErrorCode.REQUEST_TOO_LARGE, message=f"Body over {limit} bytes.")
        chunks.append(c)
    return b"".join(chunks)


async def until_disconnect(request: Request) -> None:
    """Return when the client disconnects (the body must already be read)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


async def cancel_on_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Run ``work``; if the client disconnects first, cancel it (its cleanup frees the pages) and
    raise :class:`ClientDisconnected`. vLLM's ``with_cancellation`` does the same."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(until_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        raise ClientDisconnected()
    return task.result()


def pool_report(engine: Any) -> dict[str, Any]:
    """Test-only view of an engine's pool: ``total_pages``, ``free_pages``, ``used_pages``,
    ``page_size``, ``all_free`` (every page free) and ``all_zero`` (every byte of the KV storage
    is zero, i.e. every released page was scrubbed). Reads the whole pool: not for production."""
    st = dict(engine.pool_stats())
    st["all_free"] = st["free_pages"] == st["total_pages"] and st["used_pages"] == 0
    st["all_zero"] = not bool(engine.pool.kv.any())
    nonzero = engine.pool.kv.flatten(0, 1).transpose(0, 1).reshape(engine.pool.num_pages, -1).any(dim=1)
    st["nonzero_pages"] = int(nonzero.sum())
    return st


#: SGLang's ``GetLoadsReqInput.VALID_SECTIONS`` (python/sglang/srt/managers/io_struct.py)
LOADS_SECTIONS = frozenset({"core", "memory", "spec", "lora", "disagg", "queues", "all"})


def loads_body(info: dict[str, Any], include: str | None, dp_rank: str | None) -> dict[str, Any]:
    """SGLang's ``GET /v1/loads`` answer for this node's one data-parallel rank (SGLang
    python/sglang/srt/entrypoints/v1_loads.py ``get_loads``, ``GetLoadsReqOutput.to_dict``): the
    core section always, ``memory.token_capacity`` unless ``include`` leaves it out. Raises
    ``ValueError`` (400) for an unknown section or a ``dp_rank`` other than 0."""
    sections = {s.strip() for s in include.split(",")} if include else {"all"}
    if not sections <= LOADS_SECTIONS:
        raise ValueError(f"Invalid include sections: {sorted(sections - LOADS_SECTIONS)}")
    if dp_rank not in (None, "0"):
        raise ValueError(f"dp_rank {dp_rank} does not exist: this node has one rank (0)")
    total, used = int(info["max_total_num_tokens"]), int(info.get("used_tokens", 0))
    load: dict[str, Any] = {
        "dp_rank": 0,
        "num_used_tokens": used,
        "max_total_num_tokens": total,
        "token_usage": used / total if total else 0.0,
    }
    if sections & {"memory", "all"}:
        load["memory"] = {"token_capacity": total}
    return {"timestamp": time.time(), "version": info.get("version"), "num_accelerators": 1, "loads": [load]}


async def health() -> Response:
    """``GET /health``: 200, empty."""
    return Response(status_code=200)


class InfoRoutes:
    """What every role serves: ``/health``, ``/server_info`` (+ ``/get_server_info``), ``/v1/loads``
    from ``server_info``, and ``/debug/pool`` from ``debug_pools`` when given."""

    def __init__(self, server_info: ServerInfo, debug_pools: DebugPools | None) -> None:
        self.server_info = server_info
        self.debug_pools = debug_pools

    def routes(self) -> list[BaseRoute]:
        routes: list[BaseRoute] = [
            get("/health", health),
            get("/server_info", self.info),
            get("/get_server_info", self.info),
            get("/v1/loads", self.loads),
        ]
        if self.debug_pools is not None:
            routes.append(get("/debug/pool", self.debug_pool))
        return routes

    async def info(self) -> Response:
        return json_response(await self.server_info())

    async def loads(self, request: Request) -> Response:
        """SGLang's ``/v1/loads`` (:func:`loads_body`); 400 ``{"detail": ...}`` for a bad query."""
        query = request.query_params
        try:
            body = loads_body(await self.server_info(), query.get("include"), query.get("dp_rank"))
        except ValueError as e:
            return json_response({"detail": str(e)}, status=400)
        return json_response(body)

    async def debug_pool(self) -> Response:
        assert self.debug_pools is not None
        return json_response(await asyncio.to_thread(self.debug_pools))


def add_common_routes(app: FastAPI, server_info: ServerInfo, debug_pools: DebugPools | None) -> None:
    """Add :class:`InfoRoutes` to an existing ``app``."""
    app.router.routes.extend(InfoRoutes(server_info, debug_pools).routes())


@dataclass
class RouterConfig:
    """What the router API needs besides the router: tokenizer, context length (``max_model_len``),
    the served model name and the names accepted in ``model``."""

    counter: TiktokenCounter | HFCounter
    context_length: int
    served_model_name: str
    model_names: list[str] = field(default_factory=list)

    def names(self) -> list[str]:
        return [self.served_model_name, *[n for n in self.model_names if n != self.served_model_name]]


class Collected(NamedTuple):
    """A whole non-streamed generation: text, token ids, finish reason, token counts, last id."""

    text: str
    ids: list[int]
    reason: str | None
    prompt: int
    completion: int
    last: int


async def _collect(stream: RouterStream) -> Collected:
    text, ids, reason, prompt, completion, last = [], [], None, stream.prompt_tokens, 0, -1
    try:
        async for tok in stream:
            text.append(tok.text)
            if tok.token_id >= 0:
                ids.append(tok.token_id)
                last = tok.token_id
            prompt, completion = tok.prompt_tokens, tok.completion_tokens
            if tok.finished:
                reason = tok.finish_reason
    finally:
        stream.close_now()
    return Collected("".join(text), ids, reason, prompt, completion, last)


def _new_request_id(req: api.GenRequest) -> str:
    return responses_api.new_response_id() if req.kind == "responses" else api.new_id(req.kind)


def _prompt_param(req: api.GenRequest) -> str:
    """The request field a prompt error names."""
    return "messages" if req.is_chat else "input" if req.kind == "responses" else "prompt"


def _event_stream(stream: RouterStream, req: api.GenRequest, rid: str, t0: float) -> AsyncIterator[bytes]:
    """The SSE body for a streamed request, in the shape of its API."""
    if req.kind == "responses":
        return _sse_responses(stream, req, rid)
    if req.kind == "generate":
        return _sse_generate(stream, rid, t0)
    return _sse_openai(stream, req, rid)


def _final_body(req: api.GenRequest, rid: str, c: Collected, seconds: float) -> dict[str, Any]:
    """The JSON body for a non-streamed request, in the shape of its API."""
    if req.kind == "generate":
        return api.generate_body(rid, c.text, c.ids, c.reason, c.prompt, c.completion, seconds, c.last)
    if req.kind == "responses":
        return responses_api.response_object(req, rid, c.text, c.reason, c.prompt, c.completion)
    return api.completion_body(req, rid, c.text, c.reason, c.prompt, c.completion)


class RouterRoutes:
    """The router's API (OpenAI + SGLang native) over one :class:`Router` and its config."""

    def __init__(self, router: Router, cfg: RouterConfig) -> None:
        self.router = router
        self.cfg = cfg
        self.created = int(time.time())

    def routes(self) -> list[BaseRoute]:
        return [
            post("/v1/completions", self.completions),
            post("/v1/chat/completions", self.chat),
            post("/v1/responses", self.responses),
            post("/generate", self.generate),
            post("/abort_request", self.abort_request),
            get("/v1/models", self.models),
            get("/get_model_info", self.model_info),
            post("/tokenize", self.tokenize),
            post("/v1/tokenize", self.tokenize),
            post("/detokenize", self.detokenize),
            post("/v1/detokenize", self.detokenize),
        ]

    async def completions(self, request: Request) -> Response:
        return await self._run(request, await self._parse(request, api.parse_completion, **self._names()))

    async def chat(self, request: Request) -> Response:
        return await self._run(request, await self._parse(request, api.parse_chat, **self._names()))

    async def responses(self, request: Request) -> Response:
        return await self._run(request, await self._parse(request, responses_api.parse_responses, **self._names()))

    async def generate(self, request: Request) -> Response:
        req = await self._parse(request, api.parse_generate, served_model_name=self.cfg.served_model_name)
        return await self._run(request, req)

    async def abort_request(self, request: Request) -> Response:
        rid = (await read_json(request)).get("rid")
        if not isinstance(rid, str):
            raise api.bad_request("'rid' must be a string.", "rid")
        return json_response({"rid": rid, "aborted": self.router.abort(rid)})

    async def models(self) -> Response:
        return json_response(api.models_body(self.cfg.names(), self.cfg.context_length, self.created))

    async def model_info(self) -> Response:
        tokenizer_path = str(getattr(self.cfg.counter, "path", "cl100k_base+chatml"))
        return json_response(
            {"model_path": self.cfg.served_model_name, "tokenizer_path": tokenizer_path, "is_generation": True}
        )

    async def tokenize(self, request: Request) -> Response:
        body = await read_json(request)
        return json_response(
            await asyncio.to_thread(api.tokenize_body, body, self.cfg.counter, self.cfg.context_length)
        )

    async def detokenize(self, request: Request) -> Response:
        return json_response(api.detokenize_body(await read_json(request), self.cfg.counter))

    def _names(self) -> dict[str, Any]:
        return {"model_names": self.cfg.names(), "served_model_name": self.cfg.served_model_name}

    async def _parse(self, request: Request, fn: Callable[..., api.GenRequest], **kw: Any) -> api.GenRequest:
        """The body parsed by ``fn``; a long prompt is tokenized off the event loop."""
        body = await read_json(request)
        kw["context_length"] = self.cfg.context_length
        declared = request.headers.get("content-length") or "0"
        if declared.isdigit() and int(declared) > _OFFLOAD_BODY_BYTES:
            return await asyncio.to_thread(fn, body, self.cfg.counter, **kw)
        return fn(body, self.cfg.counter, **kw)

    async def _run(self, request: Request, req: api.GenRequest) -> Response:
        """Generate ``req``: an SSE stream or one JSON body, with ``x-prefill-seconds``."""
        rid = req.rid or _new_request_id(req)
        t0 = time.monotonic()
        opened = self.router.open(rid, req.prompt_ids, req.params, param=_prompt_param(req))
        stream = await cancel_on_disconnect(request, opened)
        outcome = stream.outcome
        headers = {"x-prefill-seconds": f"{outcome.prefill_seconds:.6f}" if outcome else "0"}
        if req.stream:
            events = _event_stream(stream, req, rid, t0)
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        collected = await cancel_on_disconnect(request, _collect(stream))
        return json_response(_final_body(req, rid, collected, time.monotonic() - t0), headers=headers)


def build_router_app(
    router: Router,
    cfg: RouterConfig,
    *,
    server_info: ServerInfo,
    debug_pools: DebugPools | None = None,
    lifespan: Lifespan | None = None,
) -> FastAPI:
    """The router's app (also ``--role all``'s, with the prefill pool's ``server_info``)."""
    routes = [*InfoRoutes(server_info, debug_pools).routes(), *RouterRoutes(router, cfg).routes()]
    return make_app("kvgate backend router", routes, lifespan)


async def _sse_openai(stream: RouterStream, req: api.GenRequest, rid: str) -> AsyncIterator[bytes]:
    prompt, completion = stream.prompt_tokens, 0
    try:
        if req.is_chat:
            yield api.chunk(req, rid, role=True)
        async for tok in stream:
            prompt, completion = tok.prompt_tokens, tok.completion_tokens
            if tok.text:
                yield api.chunk(req, rid, text=tok.text)
            if tok.finished:
                yield api.chunk(req, rid, text=None if req.is_chat else "", finish_reason=tok.finish_reason)
        if req.include_usage:
            yield api.usage_chunk(req, rid, prompt, completion)
        yield api.SSE_DONE
    except Exception as e:  # after the 200, errors travel in band
        yield api.error_event(backend_error(e))
        yield api.SSE_DONE
    finally:
        stream.close_now()


async def _sse_responses(stream: RouterStream, req: api.GenRequest, rid: str) -> AsyncIterator[bytes]:
    events = responses_api.ResponseEvents(req, rid)
    prompt, completion, text, reason = stream.prompt_tokens, 0, [], None
    try:
        yield events.start()
        async for tok in stream:
            prompt, completion = tok.prompt_tokens, tok.completion_tokens
            if tok.text:
                text.append(tok.text)
                yield events.delta(tok.text)
            if tok.finished:
                reason = tok.finish_reason
        yield events.finish("".join(text), reason, prompt, completion)
    except Exception as e:  # after the 200, errors travel in band
        yield events.error(backend_error(e))
    finally:
        stream.close_now()


async def _sse_generate(stream: RouterStream, rid: str, t0: float) -> AsyncIterator[bytes]:
    text, ids, last = "", [], -1
    try:
        async for tok in stream:
            text += tok.text
            if tok.token_id >= 0:
                ids.append(tok.token_id)
                last = tok.token_id
            yield api.sse(
                api.generate_body(
                    rid,
                    text,
                    ids,
                    tok.finish_reason if tok.finished else None,
                    tok.prompt_tokens,
                    tok.completion_tokens,
                    time.monotonic() - t0,
                    last,
                )
            )
        yield api.SSE_DONE
    except Exception as e:
        yield api.error_event(backend_error(e))
        yield api.SSE_DONE
    finally:
        stream.close_now()


def _is_int_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _is_room(value: Any) -> TypeGuard[int]:
    """A bootstrap room: an integer >= 0 (a manifest refuses any other, so no transfer could
    ever fill it)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class PrefillRoutes:
    """The prefill node's internal API: ``POST /disagg/prefill`` and ``/disagg/abort`` (JSON)."""

    def __init__(self, node: Any) -> None:
        self.node = node

    def routes(self) -> list[BaseRoute]:
        return [post("/disagg/prefill", self.prefill), post("/disagg/abort", self.abort)]

    async def info(self) -> dict[str, Any]:
        return self.node.server_info()

    async def prefill(self, request: Request) -> Response:
        """Prefill a prompt into room ``room`` (its first token sampled with the optional sampling
        ``params``, else greedy); the answer is the prefill outcome."""
        body = await read_json(request)
        room, rid, ids, param = body.get("room"), body.get("request_id"), body.get("prompt_ids"), body.get("param")
        params = body.get("params")
        if not _is_room(room) or not isinstance(rid, str) or not _is_int_list(ids):
            raise api.bad_request("body needs integer 'room' >= 0, string 'request_id', integer list 'prompt_ids'.")
        if params is not None and not isinstance(params, dict):
            raise api.bad_request("'params' must be an object of sampling parameters.", "params")
        param = param if param in ("prompt", "messages") else "prompt"
        out = await self.node.prefill(room, rid, ids, param=param, params=params)
        return json_response(out.to_json())

    async def abort(self, request: Request) -> Response:
        body = await read_json(request)
        if not isinstance(body.get("request_id"), str):
            raise api.bad_request("'request_id' must be a string.", "request_id")
        self.node.abort(body["request_id"])
        return json_response({"aborted": True})


def build_prefill_app(node: Any, *, debug_pools: DebugPools | None = None, lifespan: Lifespan | None = None) -> FastAPI:
    """The prefill node's app (``--role prefill``)."""
    prefill = PrefillRoutes(node)
    routes = [*InfoRoutes(prefill.info, debug_pools).routes(), *prefill.routes()]
    return make_app("kvgate prefill node", routes, lifespan)


def _generate_args(body: dict[str, Any]) -> tuple[int, str, list[int], dict[str, Any], int]:
    """``room`` (>= 0), ``request_id``, ``prompt_ids``, ``params`` and ``from`` (default 0) of a
    decode generate call; 400 when one is missing, of the wrong type or out of range."""
    room, rid, ids, params = body.get("room"), body.get("request_id"), body.get("prompt_ids"), body.get("params")
    start = body.get("from", 0)
    if not (
        _is_room(room)
        and isinstance(rid, str)
        and isinstance(ids, list)
        and isinstance(params, dict)
        and isinstance(start, int)
        and start >= 0
    ):
        raise api.bad_request(
            "body needs 'room' (an integer >= 0), 'request_id', 'prompt_ids', 'params' (and optional 'from')."
        )
    return room, rid, ids, params, start


class DecodeRoutes:
    """The decode node's internal API: ``POST /disagg/generate`` (NDJSON token stream),
    ``/disagg/transfer`` (safetensors + manifest, never pickle) and ``/disagg/release``."""

    def __init__(self, node: Any) -> None:
        from gpu_backend.decode_node import DecodeStreams

        self.node = node
        self.streams = DecodeStreams(node)

    def routes(self) -> list[BaseRoute]:
        return [
            post("/disagg/generate", self.generate),
            post("/disagg/transfer", self.transfer),
            post("/disagg/release", self.release),
        ]

    async def info(self) -> dict[str, Any]:
        return self.node.server_info()

    async def generate(self, request: Request) -> Response:
        """Start (or re-attach to) a room's generation: NDJSON token lines from line ``from``."""
        room, rid, ids, params, start = _generate_args(await read_json(request))
        return StreamingResponse(self.streams.open(room, rid, ids, params, start), media_type="application/x-ndjson")

    async def transfer(self, request: Request) -> Response:
        """Accept prefill's pages: 415 for any other content type, 400 for a malformed payload."""
        from gpu_backend.transfer import CONTENT_TYPE, TransferFormatError, decode_transfer

        ctype = request.headers.get("content-type", "")
        if ctype.split(";")[0].strip() != CONTENT_TYPE:
            raise OpenAIError(
                status=415,
                code=ErrorCode.UNSUPPORTED_MEDIA_TYPE,
                message=f"A transfer must be '{CONTENT_TYPE}' (safetensors + manifest); got '{ctype}'.",
            )
        raw = await read_body(request, MAX_TRANSFER_BYTES)
        try:
            manifest, kv = await asyncio.to_thread(decode_transfer, raw)
        except TransferFormatError as e:
            raise OpenAIError(status=400, code=e.code, message=str(e)) from None
        context = await self.node.accept_transfer(manifest, kv, verified=True)
        return json_response({"accepted": True, "room": manifest.room, "context_tokens": context})

    async def release(self, request: Request) -> Response:
        body = await read_json(request)
        if not isinstance(body.get("room"), int):
            raise api.bad_request("'room' must be an integer.", "room")
        return json_response({"released": self.node.release(body["room"])})


def build_decode_app(node: Any, *, debug_pools: DebugPools | None = None, lifespan: Lifespan | None = None) -> FastAPI:
    """The decode node's app (``--role decode``)."""
    decode = DecodeRoutes(node)
    routes = [*InfoRoutes(decode.info, debug_pools).routes(), *decode.routes()]
    return make_app("kvgate decode node", routes, lifespan)
