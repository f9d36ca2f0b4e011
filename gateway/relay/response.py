"""The ASGI response of an admitted request: a thin shell around the relay's byte iterator, in
the manner of Starlette's ``StreamingResponse`` (it only handles the transport).

:class:`RelayResponse` sends what :func:`gateway.relay.proxy.relay` yields, ``(body, more_body)`` items as
in ASGI: a stream as it comes (the response starts at the first item; an empty one only starts
it), a whole answer in one message with its ``content-length``. An :class:`~config.errors.OpenAIError`
raised before the response started is answered as an OpenAI-shaped JSON error with its status; raised after, it ends the
stream with an error event and ``data: [DONE]`` (``/v1/responses``: the Responses ``error``
event, :func:`gateway.relay.proxy.stream_error_tail`). Any other exception is a 500 in the same shape
(it names no internals). A client disconnect before the end cancels the relay (status 499),
which closes the upstream request. A request the drain's end cuts (:data:`SHUTDOWN_CUT`,
:meth:`gateway.app.Gateway.cut_in_flight`) is ended the same way, then answered as an
:class:`OpenAIError` ``server_shutting_down`` (an error event when the stream has started, else
a 503). However it ends, the iterator is closed and ``on_close``
(:func:`gateway.relay.finish.finish`) runs exactly once: also when the request's task is
cancelled while the iterator closes (the relay's ``finally`` awaits the upstream response's
close), as the server does when it stops; the cancellation is raised once ``on_close`` is done.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from starlette.responses import Response

from config.errors import ErrorCode, OpenAIError
from gateway.relay.proxy import RelayOutcome, response_headers, stream_error_tail
from gateway.relay.stream import Chunk
from verifier.engine_response import strict_view

log = logging.getLogger("kvgate.proxy")

#: the ASGI scope key :meth:`gateway.app.Gateway.cut_in_flight` sets (``True``) on a request it
#: cuts when the drain times out; a relay that is already finishing sets it ``False`` (not cut)
SHUTDOWN_CUT = "kvgate.shutdown_cut"

_SSE = b"text/event-stream; charset=utf-8"
_JSON = b"application/json"


class RelayResponse(Response):
    """``body``: the relay's iterator; ``outcome``: the relay's record, on which the shell sets
    ``status`` (once, when it is done), ``error_code`` and ``disconnected``; ``on_close``: awaited
    once at the end."""

    def __init__(
        self, body: AsyncGenerator[Chunk, None], outcome: RelayOutcome, on_close: Callable[[], Awaitable[None]]
    ) -> None:
        # Response.__init__ is not called: this response sends its own start and body.
        self.body_iterator = body
        self.outcome = outcome
        self.on_close = on_close
        self.status_code = 200
        self.background = None
        self.raw_headers = []
        self._started = False
        self._status = 0  # the status sent (0: none yet)
        self._finished = False  # the last body message was written: a disconnect now is the normal end

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        task = asyncio.current_task()
        watcher = asyncio.ensure_future(self._watch(receive, task))
        o = self.outcome
        left = False  # the client went away before the end
        try:
            try:
                if o.admitted.forward.stream:
                    await self._send_stream(send)
                else:
                    await self._send_whole(send)
            except OpenAIError as e:
                await self._send_error(send, e)
            except (Exception, ExceptionGroup) as e:  # a bug (ours or a stage's): still an OpenAI body
                if isinstance(e, OSError) and self._started:
                    raise  # the client's socket is gone mid-response: nothing left to tell it
                log.error("request %s failed: %s", o.admitted.arrival.request_id, type(e).__name__, exc_info=e)
                err = OpenAIError(
                    500, "The server had an error while processing your request.", code=ErrorCode.INTERNAL_ERROR
                )
                await self._send_error(send, err)
        except asyncio.CancelledError:
            cut = not o.disconnected and scope.get(SHUTDOWN_CUT) is True
            if task is None or not (o.disconnected or cut):
                raise
            task.uncancel()
            left = not cut
            if cut:
                await self._send_cut(send)
        finally:
            scope.setdefault(SHUTDOWN_CUT, False)  # finishing: the drain's end leaves it to settle
            o.status = 499 if left else self._status
            self._finished = True
            watcher.cancel()
            try:
                await self._close_relay()
            finally:  # also when cancelled while the relay closes (the server stopping): settle it
                await self.on_close()

    async def _close_relay(self) -> None:
        """Close the relay's iterator (the upstream response with it); a failure is logged."""
        try:
            await self.body_iterator.aclose()
        except Exception:
            log.exception("closing the relay failed")

    async def _send_cut(self, send: Any) -> None:
        """End a request the drain's end cut (:data:`SHUTDOWN_CUT`): close the relay (the upstream
        request is cancelled, ``outcome.produced`` set), then a ``server_shutting_down`` error event
        and the stream's end, or the 503 answer when nothing was sent yet."""
        await self._close_relay()
        log.info(
            "request %s ended: the gateway is shutting down (drain timed out)",
            self.outcome.admitted.arrival.request_id,
        )
        if self._finished:
            return  # its last bytes were written: nothing left to tell
        err = OpenAIError(
            503,
            "The gateway is shutting down; the request was ended. Retry on another replica.",
            code=ErrorCode.SERVER_SHUTTING_DOWN,
        )
        await self._send_error(send, err)

    async def _watch(self, receive: Any, task: asyncio.Task | None) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                if not self._finished and task is not None:
                    self.outcome.disconnected = True
                    task.cancel()
                return

    async def _start(self, send: Any, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self._started = True
        self._status = status
        await send({"type": "http.response.start", "status": status, "headers": headers})

    async def _body(self, send: Any, body: bytes, more: bool) -> None:
        await send({"type": "http.response.body", "body": body, "more_body": more})
        if not more:
            self._finished = True  # written: a disconnect while it waited to be is the client's

    async def _send_stream(self, send: Any) -> None:
        sse_headers = [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
        more = True
        async for chunk, more in self.body_iterator:
            if not self._started:
                await self._start(send, 200, response_headers(self.outcome, _SSE) + sse_headers)
            if chunk or not more:
                await self._body(send, chunk, more)
            if not more:
                return  # closing the iterator (below, in __call__) releases the upstream
        if not self._started:
            await self._start(send, 200, response_headers(self.outcome, _SSE) + sse_headers)
        await self._body(send, b"", False)

    async def _send_whole(self, send: Any) -> None:
        parts = []
        async for chunk, more in self.body_iterator:
            parts.append(chunk)
            if not more:
                break
        body = b"".join(parts)
        h = response_headers(self.outcome, _JSON)
        h.append((b"content-length", str(len(body)).encode()))
        await self._start(send, 200, h)
        await self._body(send, body, False)

    async def _send_error(self, send: Any, err: OpenAIError) -> None:
        o = self.outcome
        if err.from_engine and o.admitted.tenant.strict_verify:
            err = strict_view(err)
        o.error_code = err.code
        if self._started:  # mid-stream: an error event, then the end of the stream
            await self._body(send, stream_error_tail(o, err), False)
            return
        if o.overhead_seconds == 0.0:
            o.overhead_seconds = time.perf_counter() - o.admitted.arrival.t_perf
        h = response_headers(o, _JSON)
        for k, v in (err.headers or {}).items():
            h.append((k.lower().encode(), str(v).encode()))
        body = err.body_bytes()
        h.append((b"content-length", str(len(body)).encode()))
        await self._start(send, err.status, h)
        await self._body(send, body, False)
