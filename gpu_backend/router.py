"""The router: one request's way through prefill and decode (no torch here).

Per request (docs/design.md, "The bundled backend"; SGLang's PD router):

1. draw a bootstrap room (:func:`gpu_backend.bootstrap.new_room`);
2. at once, ask decode to **generate** in that room (decode reserves pages for prompt +
   max_new_tokens, waits for the transfer, then streams tokens) and ask prefill to **prefill** it
   (admit or reject, forward pass, the first token sampled with the request's sampling
   parameters, send pages + manifest to decode); both calls carry the same prompt ids, so decode
   can check that the transfer's prompt digest is the one of the prompt sent to prefill;
3. prefill rejected (400 ``context_length_exceeded``) or failed: decode is told to release the
   room and its reservation is freed; decode failed (pool exhausted 503, transfer mismatch 500,
   timeout): prefill is told to abort;
4. otherwise stream decode's tokens. Client disconnect, ``/abort_request`` and timeouts release
   the room on decode and abort the request on prefill.

The client's request id (``rid``, or the OpenAI id) is a label, not an identity: two requests may
share it. Everything that frees or aborts is keyed by the room (decode) or by
:func:`gpu_backend.wire.engine_request_id` (prefill), so one request's failure, abort or
disconnect never touches another request with the same client id.

Nodes are reached through :class:`PrefillClient` / :class:`DecodeClient`: in process for
``--role all`` (:class:`LocalPrefillClient`, :class:`LocalDecodeClient`) or over HTTP between
processes (:class:`HttpPrefillClient`, :class:`HttpDecodeClient`). Errors become OpenAI errors in
:mod:`gpu_backend.node_errors`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

import httpx
import orjson

from config.errors import ErrorCode, OpenAIError
from gpu_backend.bootstrap import new_room
from gpu_backend.node_errors import backend_error, remote_error
from gpu_backend.wire import PrefillOutcome, Token, engine_request_id

log = logging.getLogger("gpu_backend.router")


class PrefillClient(Protocol):
    """How the router reaches a prefill node."""

    async def prefill(
        self, room: int, request_id: str, prompt_ids: list[int], param: str, params: dict[str, Any] | None = None
    ) -> PrefillOutcome:
        """Admit + prefill (the first token sampled with ``params``, the request's sampling dict;
        default greedy) + send pages to decode. Raises the node's error (e.g. 400
        context_length_exceeded)."""

    async def abort(self, engine_id: str) -> None:
        """Abort the request whose engine-side id is ``engine_id`` (:func:`engine_request_id` of
        its client id and room) on prefill, frees its pages; idempotent."""


class DecodeClient(Protocol):
    """How the router reaches a decode node."""

    def generate(
        self, room: int, request_id: str, prompt_ids: list[int], params: dict[str, Any]
    ) -> AsyncIterator[Token]:
        """Reserve, wait for the transfer, stream tokens. Closing the iterator frees the room."""

    async def release(self, room: int) -> None:
        """Release the room: frees a reservation, aborts a running decode; idempotent."""


class LocalPrefillClient:
    """In-process prefill (``--role all``): calls :class:`gpu_backend.prefill_node.PrefillNode`."""

    def __init__(self, node: Any) -> None:
        self.node = node

    async def prefill(
        self, room: int, request_id: str, prompt_ids: list[int], param: str, params: dict[str, Any] | None = None
    ) -> PrefillOutcome:
        return await self.node.prefill(room, request_id, prompt_ids, param=param, params=params)

    async def abort(self, engine_id: str) -> None:
        self.node.abort(engine_id)


class LocalDecodeClient:
    """In-process decode (``--role all``): calls :class:`gpu_backend.decode_node.DecodeNode`."""

    def __init__(self, node: Any) -> None:
        self.node = node

    async def generate(
        self, room: int, request_id: str, prompt_ids: list[int], params: dict[str, Any]
    ) -> AsyncIterator[Token]:
        async with contextlib.aclosing(self.node.generate(room, request_id, prompt_ids, params)) as tokens:
            async for tok in tokens:
                yield tok

    async def release(self, room: int) -> None:
        self.node.release(room)


class HttpPrefillClient:
    """Prefill node over HTTP: ``POST /disagg/prefill`` (``room``, client ``request_id``,
    ``prompt_ids``, ``param``, sampling ``params``) and
    ``/disagg/abort`` (``{"request_id": engine_id}``: the engine-side id, never the client's)."""

    def __init__(self, base_url: str, client: httpx.AsyncClient, timeout_seconds: float) -> None:
        self.base_url = base_url.rstrip("/")
        self.client = client
        self.timeout = timeout_seconds

    async def prefill(
        self, room: int, request_id: str, prompt_ids: list[int], param: str, params: dict[str, Any] | None = None
    ) -> PrefillOutcome:
        call = {"room": room, "request_id": request_id, "prompt_ids": prompt_ids, "param": param, "params": params}
        r = await post_retrying(
            self.client,
            f"{self.base_url}/disagg/prefill",
            timeout=self.timeout,
            content=orjson.dumps(call),
            headers={"content-type": "application/json"},
        )
        body = _json_or_none(r.content)
        if r.status_code != 200:
            raise remote_error(r.status_code, body)
        try:
            return PrefillOutcome.from_json(body)
        except ValueError as e:
            raise off_protocol("prefill", e) from None

    async def abort(self, engine_id: str) -> None:
        await post_retrying(self.client, f"{self.base_url}/disagg/abort", json={"request_id": engine_id}, timeout=10.0)


class HttpDecodeClient:
    """Decode node over HTTP: ``POST /disagg/generate`` (NDJSON stream of tokens, an in-band
    ``{"error": ..., "status": n}`` line on failure; after a lost connection the same call with
    ``from`` = lines received re-attaches to the room's stream) and ``POST /disagg/release``."""

    def __init__(self, base_url: str, client: httpx.AsyncClient, timeout_seconds: float) -> None:
        self.base_url = base_url.rstrip("/")
        self.client = client
        self.timeout = timeout_seconds

    async def generate(
        self, room: int, request_id: str, prompt_ids: list[int], params: dict[str, Any]
    ) -> AsyncIterator[Token]:
        received, lost = 0, 0
        while True:
            payload = orjson.dumps(
                {"room": room, "request_id": request_id, "prompt_ids": prompt_ids, "params": params, "from": received}
            )
            try:
                async with self.client.stream(
                    "POST",
                    f"{self.base_url}/disagg/generate",
                    content=payload,
                    headers={"content-type": "application/json"},
                    timeout=self.timeout,
                ) as r:
                    if r.status_code != 200:
                        raise remote_error(r.status_code, _json_or_none(await r.aread()))
                    async for line in r.aiter_lines():
                        if not line:
                            continue
                        tok = _token_of(line)
                        received += 1
                        yield tok
                        if tok.finished:
                            return
            except RETRYABLE as e:  # lost connection: re-attach to the room's stream where we were
                lost += 1
                if lost > 2:
                    raise
                log.info("decode stream of room %d lost (%r); re-attaching at line %d", room, e, received)
                continue
            raise OpenAIError(
                status=502, message="Decode node closed the stream early.", code=ErrorCode.UPSTREAM_UNAVAILABLE
            )

    async def release(self, room: int) -> None:
        await post_retrying(self.client, f"{self.base_url}/disagg/release", json={"room": room}, timeout=10.0)


def _token_of(line: str) -> Token:
    """One line of a decode stream: its token; the node's in-band error (``{"error": ...,
    "status": n}``) raised as :func:`remote_error`; any other line :func:`off_protocol`."""
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError:
        obj = None
    if isinstance(obj, dict) and "error" in obj:
        status = obj.get("status")
        raise remote_error(status if isinstance(status, int) and not isinstance(status, bool) else 500, obj)
    try:
        return Token.from_json(obj)
    except ValueError as e:
        raise off_protocol("decode", e) from None


def off_protocol(node: str, e: ValueError) -> OpenAIError:
    """The 502 ``upstream_unavailable`` for an answer of a peer ``node`` that is not its protocol's
    (a faulty or foreign peer): ``e`` says what was wrong with it."""
    return OpenAIError(
        status=502, message=f"The {node} node answered outside its protocol: {e}.", code=ErrorCode.UPSTREAM_UNAVAILABLE
    )


#: Transport failures after which an idempotent internal call is sent once more.
RETRYABLE = (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError, httpx.ConnectError)


async def post_retrying(client: httpx.AsyncClient, url: str, **kw: Any) -> httpx.Response:
    """POST an idempotent internal call; on a lost connection (:data:`RETRYABLE`) send it once more
    on a fresh connection. Only for calls the nodes make idempotent (prefill per room, release,
    abort)."""
    try:
        return await client.post(url, **kw)
    except RETRYABLE as e:
        log.info("retrying %s after %r", url, e)
        return await client.post(url, **kw)


def _json_or_none(raw: bytes) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None


class RouterStream:
    """An admitted request: ``outcome`` (prefill's report), then async iteration over decode's
    :class:`Token` s (the last has ``finished``). ``abort()`` ends it with ``finish_reason``
    ``"abort"``; ``aclose()`` (or leaving early) releases the room on decode and aborts prefill.
    ``request_id`` is the client's id (not unique); ``room`` and ``engine_id`` identify the request."""

    def __init__(
        self, router: Router, room: int, request_id: str, tokens: AsyncIterator[Token], prompt_tokens: int
    ) -> None:
        self.router = router
        self.room = room
        self.request_id = request_id
        self.engine_id = engine_request_id(request_id, room)
        self.prompt_tokens = prompt_tokens
        self.outcome: PrefillOutcome | None = None
        self.aborted = False
        self.finished = False
        self._tokens = tokens
        self._first: asyncio.Future[Token] | None = None
        self._pending_first: Token | None = None
        self._closed = False
        self.completion_tokens = 0

    def __aiter__(self) -> RouterStream:
        return self

    def awaiting_first(self, first: asyncio.Future[Token]) -> None:
        """The task reading decode's first token while the stream opens (cancelled by :meth:`close_now`)."""
        self._first = first

    def opened(self, outcome: PrefillOutcome, first: Token) -> None:
        """Prefill's report and decode's first token are in: iteration starts with ``first``."""
        self.outcome, self._first, self._pending_first = outcome, None, first

    def opened_aborted(self) -> None:
        """Aborted while opening: iteration yields one ``"abort"`` token and ends."""
        self.outcome, self._pending_first = None, self._abort_event()
        self.finished = False

    def _abort_event(self) -> Token:
        self.finished = True
        return Token(-1, "", True, "abort", self.prompt_tokens, self.completion_tokens)

    async def __anext__(self) -> Token:
        if self.finished:
            raise StopAsyncIteration
        try:
            if self._pending_first is not None:
                tok, self._pending_first = self._pending_first, None
            else:
                tok = await asyncio.wait_for(self._tokens.__anext__(), self.router.token_timeout)
        except StopAsyncIteration:
            self.finished = True
            self.router._forget(self)
            if self.aborted:
                return self._abort_event()
            raise OpenAIError(
                status=502, message="Decode ended without a final token.", code=ErrorCode.UPSTREAM_UNAVAILABLE
            ) from None
        except BaseException as e:
            if self.aborted and not isinstance(e, asyncio.CancelledError):
                self.close_now()
                return self._abort_event()
            self.close_now()
            raise
        self.completion_tokens = tok.completion_tokens
        if tok.finished:
            self.finished = True
            self.router._forget(self)
        return tok

    def abort(self) -> None:
        """Abort (``/abort_request``): decode ends the request with ``finish_reason`` ``"abort"``."""
        if self.finished or self.aborted:
            return
        self.aborted = True
        self.router._spawn(self.router.decode.release(self.room))
        self.router._spawn(self.router.prefill.abort(self.engine_id))

    def close_now(self) -> None:
        """Release both sides without awaiting (safe inside a cancelled task): the network calls
        run as detached tasks."""
        if self._closed:
            return
        self._closed = True
        self.router._forget(self)
        if self._first is not None and not self._first.done():
            self._first.cancel()
        if not self.finished:
            self.router._spawn(self.router.decode.release(self.room))
            self.router._spawn(self.router.prefill.abort(self.engine_id))
        self.router._spawn(_close_iter(self._tokens, self._first))

    async def aclose(self) -> None:
        """Same as :meth:`close_now` (awaitable for ``async with``-style use)."""
        self.close_now()


async def _close_iter(it: AsyncIterator[Token], first: asyncio.Future | None) -> None:
    if first is not None:
        try:
            await first
        except BaseException:  # only waiting for it to stop running
            pass
    aclose = getattr(it, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except BaseException:
            pass


class Router:
    """Routes requests through a prefill and a decode node (see the module docstring).

    ``open_timeout``: seconds from arrival to the first token (prefill + transfer + pool waits);
    ``token_timeout``: seconds between two tokens. Both end in 504 ``upstream_timeout`` with both
    sides released.
    """

    def __init__(
        self, prefill: PrefillClient, decode: DecodeClient, *, open_timeout: float = 120.0, token_timeout: float = 60.0
    ) -> None:
        self.prefill = prefill
        self.decode = decode
        self.open_timeout = open_timeout
        self.token_timeout = token_timeout
        #: client id -> room -> stream, for ``/abort_request`` (several requests may share a client id)
        self.inflight: dict[str, dict[int, RouterStream]] = {}
        self._bg: set[asyncio.Task] = set()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(_quiet(coro))
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    def _forget(self, stream: RouterStream) -> None:
        rooms = self.inflight.get(stream.request_id)
        if rooms is not None and rooms.get(stream.room) is stream:
            del rooms[stream.room]
            if not rooms:
                del self.inflight[stream.request_id]

    def abort(self, request_id: str) -> bool:
        """Abort every request with client id ``request_id`` that is in flight in this router now
        (SGLang ``/abort_request``); True if there was one, False otherwise.

        Nothing is remembered: a request that arrives later with the same id runs normally. The
        client id is not an identity, so this also aborts another client's request that happens to
        use the same id (as SGLang, whose abort matches ``rid`` too); the ids the server draws when a
        request names none (``cmpl-``/``chatcmpl-``/``resp_`` + a random uuid4) cannot be guessed."""
        rooms = self.inflight.get(request_id)
        if not rooms:
            return False
        for s in list(rooms.values()):
            s.abort()
        return True

    async def drain(self) -> None:
        """Wait for the detached release/abort calls (shutdown, tests)."""
        while self._bg:
            await asyncio.gather(*list(self._bg), return_exceptions=True)

    async def open(
        self, request_id: str, prompt_ids: list[int], params: dict[str, Any], *, param: str = "prompt"
    ) -> RouterStream:
        """Run prefill and decode's reservation concurrently; return once prefill has sent the pages
        and decode produced the first token. Raises :class:`OpenAIError`: prefill's rejection
        (400 ``context_length_exceeded``, ``param`` as given), decode's 503 ``pool_exhausted`` or
        500 ``transfer_mismatch``, 504 on timeout, 499 when aborted meanwhile. ``request_id`` is
        the client's id and need not be unique: the request is identified by its fresh room."""
        room = new_room()
        tokens = self.decode.generate(room, request_id, prompt_ids, params)
        stream = RouterStream(self, room, request_id, tokens, len(prompt_ids))
        self.inflight.setdefault(request_id, {})[room] = stream
        first = asyncio.ensure_future(tokens.__anext__())
        stream.awaiting_first(first)
        pre = asyncio.ensure_future(self.prefill.prefill(room, request_id, prompt_ids, param, params))
        try:
            outcome, tok = await self._both(pre, first)
        except BaseException as e:
            if not pre.done():
                pre.cancel()
            pre.add_done_callback(_consume)
            first.add_done_callback(_consume)
            stream.close_now()
            if stream.aborted and not isinstance(e, asyncio.CancelledError):
                stream.opened_aborted()
                return stream
            if isinstance(e, asyncio.CancelledError):
                raise
            err = backend_error(e)
            if err.status >= 500:
                log.warning("request %s failed: %s (%r)", request_id, err.message, e, exc_info=e)
            raise err from e
        stream.opened(outcome, tok)
        return stream

    async def _both(self, pre: asyncio.Future, first: asyncio.Future) -> tuple[PrefillOutcome, Token]:
        deadline = time.monotonic() + self.open_timeout
        pending = {pre, first}
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError()
            done, pending = await asyncio.wait(pending, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                raise TimeoutError()
            pre_error = pre.exception() if pre in done else None
            if pre_error is not None:
                err = backend_error(pre_error)
                if err.status >= 500 and not first.done():
                    # prefill failed because decode did (e.g. a refused transfer): prefer decode's reason
                    await asyncio.wait({first}, timeout=2.0)
                first_error = first.exception() if first.done() and not first.cancelled() else None
                if first_error is not None and err.status >= 500:
                    raise first_error
                raise pre_error
            first_error = first.exception() if first in done else None
            if first_error is not None:
                raise first_error
        return pre.result(), first.result()


def _consume(fut: asyncio.Future) -> None:
    """Mark a loser's outcome as retrieved (its error was superseded by the one raised)."""
    if not fut.cancelled():
        fut.exception()


async def _quiet(coro: Any) -> None:
    try:
        await coro
    except Exception as e:  # best-effort cleanup call; the node has its own timeouts
        log.debug("cleanup call failed: %r", e)
