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
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response, StreamingResponse

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


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """JSON via orjson."""
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json", headers=headers)


def error_response(err: OpenAIError) -> Response:
    """The OpenAI error body with the error's status and headers."""
    return Response(err.body_bytes(), status_code=err.status, media_type="application/json", headers=err.headers)


def install_error_handlers(app: FastAPI) -> None:
    """OpenAI-shaped errors for everything: typed errors keep status/code/param, unknown routes
    404 ``not_found``, wrong methods 405, anything unexpected 500 ``internal_error`` (logged)."""

    @app.exception_handler(OpenAIError)
    async def _openai(_: Request, exc: OpenAIError) -> Response:
        return error_response(exc)

    @app.exception_handler(ClientDisconnected)
    @app.exception_handler(ClientDisconnect)
    async def _gone(_: Request, exc: Exception) -> Response:
        return Response(status_code=499)

    @app.exception_handler(EngineError)
    async def _engine(_: Request, exc: EngineError) -> Response:
        return error_response(exc.to_openai())

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 404:
            return error_response(
                OpenAIError(
                    status=404, code=ErrorCode.NOT_FOUND, message=f"Unknown route: {request.method} {request.url.path}"
                )
            )
        return error_response(
            OpenAIError(
                status=exc.status_code,
                message=str(exc.detail),
                code=ErrorCode.METHOD_NOT_ALLOWED if exc.status_code == 405 else None,
            )
        )

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> Response:
        return error_response(api.bad_request(str(exc)))

    @app.exception_handler(Exception)
    async def _any(_: Request, exc: Exception) -> Response:
        err = backend_error(exc)
        if err.status >= 500:
            log.exception("unhandled error", exc_info=exc)
        return error_response(err)


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


class ClientDisconnected(Exception):
    """The client went away before the answer; the work was cancelled (answered 499, unread)."""


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


def add_common_routes(
    app: FastAPI, server_info: Callable[[], Awaitable[dict[str, Any]]], debug_pools: Callable[[], dict[str, Any]] | None
) -> None:
    """``/health``, ``/server_info``, ``/get_server_info``, ``/v1/loads`` and (when given) ``/debug/pool``."""

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def info() -> Response:
        return json_response(await server_info())

    @app.get("/v1/loads")
    async def v1_loads(request: Request) -> Response:
        try:
            body = loads_body(
                await server_info(), request.query_params.get("include"), request.query_params.get("dp_rank")
            )
        except ValueError as e:
            return json_response({"detail": str(e)}, status=400)
        return json_response(body)

    if debug_pools is not None:

        @app.get("/debug/pool")
        async def debug_pool() -> Response:
            return json_response(await asyncio.to_thread(debug_pools))


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


async def _collect(stream: RouterStream) -> tuple[str, list[int], str | None, int, int, int]:
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
    return "".join(text), ids, reason, prompt, completion, last


def build_router_app(
    router: Router,
    cfg: RouterConfig,
    *,
    server_info: Callable[[], Awaitable[dict[str, Any]]],
    debug_pools: Callable[[], dict[str, Any]] | None = None,
    lifespan: Callable[[FastAPI], Any] | None = None,
) -> FastAPI:
    """The router's app (also ``--role all``'s, with the prefill pool's ``server_info``)."""
    app = FastAPI(title="kvgate backend router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    add_common_routes(app, server_info, debug_pools)
    created = int(time.time())

    async def parse(request: Request, fn: Callable[..., api.GenRequest], **kw: Any) -> api.GenRequest:
        body = await read_json(request)
        declared = request.headers.get("content-length") or "0"
        if declared.isdigit() and int(declared) > _OFFLOAD_BODY_BYTES:  # long prompt: tokenize off the loop
            return await asyncio.to_thread(fn, body, cfg.counter, context_length=cfg.context_length, **kw)
        return fn(body, cfg.counter, context_length=cfg.context_length, **kw)

    async def run(request: Request, req: api.GenRequest) -> Response:
        responses = req.kind == "responses"
        rid = req.rid or (responses_api.new_response_id() if responses else api.new_id(req.kind))
        t0 = time.monotonic()
        param = "messages" if req.is_chat else "input" if responses else "prompt"
        stream = await cancel_on_disconnect(request, router.open(rid, req.prompt_ids, req.params, param=param))
        outcome = stream.outcome
        headers = {"x-prefill-seconds": f"{outcome.prefill_seconds:.6f}" if outcome else "0"}
        if req.stream:
            if responses:
                gen = _sse_responses(stream, req, rid)
            elif req.kind == "generate":
                gen = _sse_generate(stream, rid, t0)
            else:
                gen = _sse_openai(stream, req, rid)
            return StreamingResponse(gen, media_type="text/event-stream", headers=headers)
        text, ids, reason, prompt, completion, last = await cancel_on_disconnect(request, _collect(stream))
        if req.kind == "generate":
            return json_response(
                api.generate_body(rid, text, ids, reason, prompt, completion, time.monotonic() - t0, last),
                headers=headers,
            )
        if responses:
            body = responses_api.response_object(req, rid, text, reason, prompt, completion)
            return json_response(body, headers=headers)
        return json_response(api.completion_body(req, rid, text, reason, prompt, completion), headers=headers)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = await parse(
            request, api.parse_completion, model_names=cfg.names(), served_model_name=cfg.served_model_name
        )
        return await run(request, req)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        req = await parse(request, api.parse_chat, model_names=cfg.names(), served_model_name=cfg.served_model_name)
        return await run(request, req)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        req = await parse(
            request, responses_api.parse_responses, model_names=cfg.names(), served_model_name=cfg.served_model_name
        )
        return await run(request, req)

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        req = await parse(request, api.parse_generate, served_model_name=cfg.served_model_name)
        return await run(request, req)

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        body = await read_json(request)
        rid = body.get("rid")
        if not isinstance(rid, str):
            raise api.bad_request("'rid' must be a string.", "rid")
        return json_response({"rid": rid, "aborted": router.abort(rid)})

    @app.get("/v1/models")
    async def models() -> Response:
        return json_response(api.models_body(cfg.names(), cfg.context_length, created))

    @app.get("/get_model_info")
    async def model_info() -> Response:
        return json_response(
            {
                "model_path": cfg.served_model_name,
                "tokenizer_path": str(getattr(cfg.counter, "path", "cl100k_base+chatml")),
                "is_generation": True,
            }
        )

    @app.post("/v1/tokenize")
    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        body = await read_json(request)
        return json_response(await asyncio.to_thread(api.tokenize_body, body, cfg.counter, cfg.context_length))

    @app.post("/v1/detokenize")
    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        body = await read_json(request)
        return json_response(api.detokenize_body(body, cfg.counter))

    return app


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


def build_prefill_app(
    node: Any,
    *,
    debug_pools: Callable[[], dict[str, Any]] | None = None,
    lifespan: Callable[[FastAPI], Any] | None = None,
) -> FastAPI:
    """The prefill node's app (``--role prefill``)."""
    app = FastAPI(title="kvgate prefill node", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)

    async def info() -> dict[str, Any]:
        return node.server_info()

    add_common_routes(app, info, debug_pools)

    @app.post("/disagg/prefill")
    async def prefill(request: Request) -> Response:
        body = await read_json(request)
        room, rid, ids, param = body.get("room"), body.get("request_id"), body.get("prompt_ids"), body.get("param")
        if (
            not isinstance(room, int)
            or not isinstance(rid, str)
            or not isinstance(ids, list)
            or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
        ):
            raise api.bad_request("body needs integer 'room', string 'request_id', integer list 'prompt_ids'.")
        out = await node.prefill(room, rid, ids, param=param if param in ("prompt", "messages") else "prompt")
        return json_response(out.to_json())

    @app.post("/disagg/abort")
    async def abort(request: Request) -> Response:
        body = await read_json(request)
        if not isinstance(body.get("request_id"), str):
            raise api.bad_request("'request_id' must be a string.", "request_id")
        node.abort(body["request_id"])
        return json_response({"aborted": True})

    return app


def build_decode_app(
    node: Any,
    *,
    debug_pools: Callable[[], dict[str, Any]] | None = None,
    lifespan: Callable[[FastAPI], Any] | None = None,
) -> FastAPI:
    """The decode node's app (``--role decode``)."""
    from gpu_backend.transfer import CONTENT_TYPE, TransferFormatError, decode_transfer

    app = FastAPI(title="kvgate decode node", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)

    async def info() -> dict[str, Any]:
        return node.server_info()

    add_common_routes(app, info, debug_pools)

    from gpu_backend.decode_node import DecodeStreams

    streams = DecodeStreams(node)

    @app.post("/disagg/generate")
    async def generate(request: Request) -> Response:
        """Start (or re-attach to) a room's generation: NDJSON token lines from line ``from``."""
        body = await read_json(request)
        room, rid, ids, params = body.get("room"), body.get("request_id"), body.get("prompt_ids"), body.get("params")
        start = body.get("from", 0)
        if (
            not isinstance(room, int)
            or not isinstance(rid, str)
            or not isinstance(ids, list)
            or not isinstance(params, dict)
            or not isinstance(start, int)
            or start < 0
        ):
            raise api.bad_request("body needs 'room', 'request_id', 'prompt_ids', 'params' (and optional 'from').")
        return StreamingResponse(streams.open(room, rid, ids, params, start), media_type="application/x-ndjson")

    @app.post("/disagg/transfer")
    async def transfer(request: Request) -> Response:
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
        context = await node.accept_transfer(manifest, kv, verified=True)
        return json_response({"accepted": True, "room": manifest.room, "context_tokens": context})

    @app.post("/disagg/release")
    async def release(request: Request) -> Response:
        body = await read_json(request)
        if not isinstance(body.get("room"), int):
            raise api.bad_request("'room' must be an integer.", "room")
        return json_response({"released": node.release(body["room"])})

    return app
