"""The server layer's own limits (docs/gateway.md, "Client connections"): what a
client may cost the gateway before its request reaches the app.

uvicorn's httptools protocol (what ``uvicorn[standard]`` runs) bounds neither the bytes nor the
number of request headers, nor how long a request head or body may take to arrive; h11 bounds
header bytes (``h11_max_incomplete_event_size``) but parses slower (``bench/edge.py``).
:class:`BoundedHttpToolsProtocol` is uvicorn's httptools protocol with those bounds added:

- ``max_header_bytes`` (request line + headers) and ``max_header_count``: above either, 431
  ``request_header_fields_too_large``; the connection is closed and the app never sees the request.
  Bytes are counted as they arrive, so a head that never ends is refused as soon as it is too long.
- ``header_timeout_seconds``: a request head (first byte to the end of the headers) that takes
  longer gets 408 ``request_timeout`` and the connection is closed (slow headers).
- ``body_timeout_seconds``: a body that is not complete this long after its head gets 408 (when
  no response has started) and the connection is closed (slow bodies: the app's ``receive()``
  then reports a disconnect, the refusal first put in the request's scope,
  :func:`gateway.edge.extensions.mark_refused`, so that the app records the 408, not a client gone).
- ``max_inbound_connections``: a client connection beyond this many open ones (in this process,
  lingering ones included) gets 503 ``server_busy`` and is closed at once;
  ``max_connections_per_client`` (default an eighth of it): one beyond this many from one client
  address gets 429 ``too_many_connections``.
- chunked bodies: their bytes as sent (chunk framing included) count against ``max_body_bytes``,
  at most ``max_body_chunks`` chunks, and after the first :data:`FREE_CHUNKS` chunks must
  average ``min_chunk_bytes``; else 413 ``request_too_large`` (uvicorn's ``on_body`` costs about
  1 us a chunk: 1-byte chunks made a 1 MiB body cost 0.99 s of event loop).
- a request with a body, or to an API path, without a tenant's key: answered by the app (401)
  with ``connection: close``, and nothing after its head is parsed (dropped, paced).
- ``max_pipelined_requests``: a request head beyond this many queued behind the one being
  answered is not queued; the connection closes after the last queued one.
- ``keepalive_timeout_seconds``: an idle keep-alive connection is closed after this long
  (uvicorn's ``timeout_keep_alive``).
- ``send_timeout_seconds``: while answer bytes wait in the gateway for a client (its connection's
  write buffer is above the high-water mark, or the connection is closing with bytes unsent),
  the client must take some of them within this long, each time; else the connection is aborted
  (nginx's ``send_timeout``). The app then sees a disconnect: the relay cancels its upstream
  stream and the request ends as one whose client went away (499). The bytes waiting for one
  client are bounded too: the app's ``send`` waits while the connection is above its high-water
  mark (uvicorn's flow control), and a ``Content-Length`` body is written in pieces of
  :data:`SEND_PIECE_BYTES`, each once the connection is writable, so at most the high-water mark
  plus one piece (or one stream chunk) is buffered for it.
- ``refusal_delay_seconds``: a 431 is answered this long after the head was refused, the
  connection not read meanwhile (``gateway.refusal_delay_seconds``, which delays a 401 as long:
  :func:`gateway.routes.handlers.refusal`): a client refused for its head waits before it can
  send the next one, so a client that sends oversized heads back to back costs the gateway two
  refusals a second, not hundreds.

- framing: an HTTP/1.1 request without a Host header, or with several, gets 400 (RFC 9112
  section 3.2); a chunked body's trailer fields are dropped, never merged into the request's
  headers (RFC 9110 section 6.5.1); ``Expect: 100-continue`` from HTTP/1.0 is ignored (section
  10.1.1); a response that starts before its request's body has arrived (a route that does not
  read one) closes the connection, lingering, instead of reading the body on to keep it.
  ``Transfer-Encoding`` from HTTP/1.0 gets 400 (RFC 9112 section 6.1), a transfer coding besides
  chunked (``gzip, chunked``) 501, a ``Host`` that is not a host 400 (section 3.2); an upgrade
  request (the gateway upgrades to nothing) with a body gets 400 (httptools skips its body, and
  its bytes were parsed as the next request), one without is answered, then the connection
  closes. A chunked body's bytes are counted against ``max_body_bytes`` as they arrive, not only
  when a chunk-size line ends (an endless chunk extension was read until the body timeout).
- pipelined requests: a refusal of a request queued behind one still being answered (its body
  too slow or too large, its head too large or too slow, bytes that are not HTTP) is written after
  that answer, never before it or inside it, then the connection closes; a queued request's body
  deadline starts when the request does.

Every refusal is an OpenAI-shaped JSON body with ``connection: close``. A connection closed while
its request is still arriving (a refused head, or a body the app refused before reading it all)
lingers (:class:`_LingeringTransport`): the answer, a FIN, then the client's further bytes
dropped, read at :data:`LINGER_BYTES_PER_SECOND`, for up to :data:`LINGER_SECONDS` or
:data:`LINGER_MAX_BYTES` (:data:`LINGER_MAX_HEAD_BYTES` after a refused head), so that the client
reads the answer instead of a reset. :func:`configure` puts the
protocol and the limits on a ``uvicorn.Config``; the limits travel on the config object, so every
process that builds its own config (a worker) applies them.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from config.errors import ErrorCode, openai_error_bytes
from gateway.edge.extensions import mark_complete_when, mark_refused

log = logging.getLogger("kvgate.edge")

#: reason phrases where RFC 9110 renamed Python's ``HTTPStatus`` phrase; every other status takes its
_REASONS = {413: b"Content Too Large", 414: b"URI Too Long"}


@dataclass(frozen=True)
class EdgeLimits:
    """The server layer's limits; see the module docstring. Bytes, counts and seconds."""

    max_header_bytes: int = 64 * 1024
    max_header_count: int = 100
    header_timeout_seconds: float = 10.0
    body_timeout_seconds: float = 30.0
    max_inbound_connections: int = 1024
    keepalive_timeout_seconds: float = 5.0
    send_timeout_seconds: float = 30.0
    refusal_delay_seconds: float = 0.5
    #: ``None``: :func:`per_client_default` of ``max_inbound_connections``
    max_connections_per_client: int | None = None
    max_pipelined_requests: int = 8
    max_body_bytes: int = 8 * 1024 * 1024
    max_body_chunks: int = 16_384
    min_chunk_bytes: int = 256

    @classmethod
    def from_settings(cls, g: Any) -> EdgeLimits:
        """From a :class:`config.models.GatewaySettings`."""
        return cls(
            max_header_bytes=g.max_header_bytes,
            max_header_count=g.max_header_count,
            header_timeout_seconds=g.header_timeout_seconds,
            body_timeout_seconds=g.body_timeout_seconds,
            max_inbound_connections=g.max_inbound_connections,
            keepalive_timeout_seconds=g.keepalive_timeout_seconds,
            send_timeout_seconds=g.send_timeout_seconds,
            refusal_delay_seconds=g.refusal_delay_seconds,
            max_connections_per_client=g.max_connections_per_client,
            max_pipelined_requests=g.max_pipelined_requests,
            max_body_bytes=g.max_body_bytes,
            max_body_chunks=g.max_body_chunks,
            min_chunk_bytes=g.min_chunk_bytes,
        )

    @property
    def per_client(self) -> int:
        """Client connections one address may hold (``max_connections_per_client`` or its default)."""
        if self.max_connections_per_client is not None:
            return self.max_connections_per_client
        return per_client_default(self.max_inbound_connections)


def per_client_default(max_inbound_connections: int) -> int:
    """The default per-address share: an eighth of ``max_inbound_connections`` (rounded up), so
    that one address alone cannot hold every slot: 128 of the default 1,024."""
    return max(1, -(-max_inbound_connections // 8))


#: chunks of a chunked body that are never held to ``min_chunk_bytes`` (a client's first
#: writes may be small: a JSON prefix, a flushed header line)
FREE_CHUNKS = 64
#: paths whose requests need a tenant's key: without one, the connection is not kept alive
#: (one 401 per connection) and a body is never read
_API_PREFIXES = ("/v1/", "/tokenize", "/detokenize")


#: a ``Host`` field value (RFC 9110 section 7.2: uri-host [ ":" port ]): an IP literal or a
#: reg-name (unreserved, sub-delims, percent-encoded octets; empty too), then an optional port
_HOST = re.compile(rb"(?:\[[0-9A-Za-z:.%_~-]+\]|[A-Za-z0-9\-._~!$&'()*+,;=%]*)(?::[0-9]*)?")

#: the longest request-target read (bytes; at most ``max_header_bytes``): RFC 9110 section 4.1
#: recommends URIs of at least 8000 octets, nginx's request line fits one 8 KiB buffer
#: (``large_client_header_buffers``); no kvgate route reads a query
MAX_TARGET_BYTES = 8 * 1024
#: origin-form's path (RFC 9112 section 3.2.1; RFC 9110 section 4.1: absolute-path, 1*( "/" segment ),
#: a segment's characters RFC 3986's pchar, a "%" only as "%" HEXDIG HEXDIG); the query after "?"
#: is read by no route, so not checked
_PATH = re.compile(rb"(?:/(?:[A-Za-z0-9\-._~!$&'()*+,;=:@]|%[0-9A-Fa-f]{2})*)+")
#: absolute-form (RFC 9112 section 3.2.2) of an http or https URI: its authority, then its path
#: and query (none: the path is "/", RFC 9110 section 4.2.3)
_ABSOLUTE_FORM = re.compile(rb"(?i:https?)://([^/?#]*)([/?].*)?", re.DOTALL)
#: the paths that end in a path parameter: the bytes after the prefix are data (a model id with a
#: "/" arrives as "%2F": the openai SDKs percent-encode path parameters), decoded for the app; the
#: prefix itself is matched as sent (gateway/app.py, ``gateway_routes``: ``/v1/models/{model_id:path}``)
PARAMETER_PREFIXES = (b"/v1/models/",)
#: the methods some route serves, the ``allow`` of an ``OPTIONS *`` (HEAD: Starlette's, with GET)
SERVER_METHODS = b"GET, HEAD, POST, OPTIONS"

#: the 400 for bytes httptools will not parse as HTTP/1.1 (:meth:`BoundedHttpToolsProtocol.send_400_response`)
NOT_HTTP_MESSAGE = "The request is not valid HTTP/1.1."


def origin_form(method: bytes, target: bytes) -> bytes | str:
    """The request-target ``target`` of a ``method`` request as the origin-form the app routes
    (RFC 9112 section 3.2), ``b"*"`` for a server-wide ``OPTIONS``; or, as a ``str``, why it is
    refused (400). Refused: a fragment (section 3.2: no "#" in a request-target; uvicorn and nginx
    drop it, Envoy refuses it: a rule in front may have read the path up to it differently), ``*``
    with another method (section 3.2.4), an http(s) URI whose authority is not a host (empty, or
    with userinfo: RFC 9110 sections 4.2.1, 4.2.4), and a path that is not an absolute path (a
    character a URI cannot hold, a "%" not followed by two hex digits: nginx answers 400 too).
    Absolute-form (section 3.2.2: a server MUST accept it) becomes its path and query; the Host
    header, which section 3.2.2 has ignored then, is read by nothing in the gateway."""
    if method == b"CONNECT":
        # authority-form (section 3.2.3, CONNECT's only): the gateway opens no tunnel; nginx answers
        # 405, this stays the 400 that uvicorn's URL parser failing on ``host:port`` gave
        return NOT_HTTP_MESSAGE
    if b"#" in target:
        return "A request target cannot carry a fragment ('#'); send the path and query alone."
    if target == b"*":
        return target if method == b"OPTIONS" else "The request target * is for OPTIONS only; send a path."
    absolute = _ABSOLUTE_FORM.fullmatch(target)
    if absolute is not None:
        authority, rest = absolute.groups()
        if authority[:1] in (b"", b":") or not _HOST.fullmatch(authority):
            return "The request target's authority is not a host."
        if rest is None and method == b"OPTIONS":
            return b"*"  # RFC 9112 section 3.2.4: OPTIONS of an http URI with an empty path
        target = rest if rest is not None and rest[:1] == b"/" else b"/" + (rest or b"")
    if not _PATH.fullmatch(target.partition(b"?")[0]):
        return "The request target is not a valid absolute path."
    return target


async def _server_options(scope: Any, receive: Any, send: Any) -> None:
    """``OPTIONS *`` (RFC 9110 section 9.3.7): 200, the server's methods in ``allow``, no content
    (``content-length: 0``, which the section asks for). uvicorn gave it to the app, whose 404
    said ``Unknown request URL: OPTIONS /*``."""
    headers = [(b"allow", SERVER_METHODS), (b"content-length", b"0")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": b""})


#: the most bytes of one ``Content-Length`` response body written to a connection at once; a
#: larger body is written in pieces, each once the connection is below its high-water mark
SEND_PIECE_BYTES = 64 * 1024


class EdgeState:
    """What the connections of one server (one process) share: the lingering connections, which
    still count against ``max_inbound_connections``, and the connections per client address; and
    counts of how writing to clients went: ``write_pauses`` (a connection's write buffer went above
    its high-water mark), ``send_timeouts`` (connections aborted by ``send_timeout_seconds``) and
    ``peak_unsent`` (the most bytes one connection held unsent, after any write)."""

    __slots__ = ("lingering", "peak_unsent", "per_client", "send_timeouts", "write_pauses")

    def __init__(self) -> None:
        self.lingering: set[Any] = set()
        self.per_client: dict[str, int] = {}
        self.write_pauses = 0
        self.send_timeouts = 0
        self.peak_unsent = 0


def refusal_bytes(status: int, message: str, *, code: str, headers: Iterable[tuple[bytes, bytes]] = ()) -> bytes:
    """A whole HTTP/1.1 response: ``status``, ``headers`` (the server's own, e.g. ``date``, which
    RFC 9110 section 6.6.1 asks of a server with a clock), an OpenAI-shaped JSON body,
    ``connection: close``."""
    body = openai_error_bytes(message, status=status, code=code)
    return b"".join(
        [
            b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status) or HTTPStatus(status).phrase.encode()),
            *(b"%s: %s\r\n" % (name, value) for name, value in headers),
            b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body),
            b"connection: close\r\n\r\n",
            body,
        ]
    )


class _StopParsing(Exception):
    """Raised by a parser callback once the request is refused: httptools stops at once."""


class _StoppableParser:
    """The connection's ``httptools.HttpRequestParser``, whose :meth:`feed_data` ends quietly when
    a callback stopped it after a refusal (:class:`_StopParsing`): without the stop, httptools
    went on calling ``on_header`` for each of 20,000 headers after the 101st was refused (about
    10 ms of event loop a request); without the quiet end, uvicorn logged and answered a 400
    after the 431. Everything else is the wrapped parser's."""

    __slots__ = ("_parser",)

    def __init__(self, parser: Any) -> None:
        self._parser = parser

    def feed_data(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError as e:
            if not isinstance(e.__context__, _StopParsing):
                raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._parser, name)


#: how long a connection closed while its request still arrives lingers (seconds), and how many
#: more bytes of it are read and dropped meanwhile (see :class:`_LingeringTransport`)
LINGER_SECONDS = 5.0
LINGER_MAX_BYTES = 10 * 1024 * 1024  # a body refused before it was read (above max_body_bytes' 8 MiB)
LINGER_MAX_HEAD_BYTES = 1024 * 1024  # a refused head (16 times max_header_bytes' 64 KiB)
#: how fast one lingering connection is read (bytes a second): it is paused, after each read,
#: for as long as that read takes at this rate. An 8 MiB body refused at its head drains in 4 s.
LINGER_BYTES_PER_SECOND = 2 * 1024 * 1024


def _request_unfinished(p: BoundedHttpToolsProtocol) -> bool:
    """Whether bytes of ``p``'s current request may still arrive: inside a head that has begun,
    before the end of a body, or while its bytes are being dropped unread (a body without a
    tenant's key, pipelined requests past the limit)."""
    if p._discarding:
        return True
    if p._in_head:
        return p._head_bytes > 0
    cycle = p.cycle
    return cycle is not None and cycle.more_body


def _stop_counting(p: BoundedHttpToolsProtocol) -> None:
    """``p``'s connection lingers: no timer or limit of a request applies any more, it leaves
    uvicorn's connections (a graceful shutdown does not wait for it) but still counts against
    ``max_inbound_connections`` and its address's share until it is closed, and (as
    ``connection_lost`` does) its request's cycle is marked disconnected, so the app's
    ``receive()`` reports a disconnect."""
    p._refused = True
    p._cancel_timers()
    p.connections.discard(p)
    p.edge.lingering.add(p)
    # every unanswered request sees the disconnect: the one being answered too, not only the newest
    # parsed (a pipelined one), else its answer was written after the FIN (RuntimeError, logged)
    p._disconnect_all()
    cycle = p.cycle
    if cycle is not None:
        cycle.message_event.set()


class _LingeringTransport:
    """The connection's transport, whose :meth:`close` lingers when the request is still arriving
    (a refused head, a body refused or never read): the answer is sent, then a FIN, and the
    client's further bytes are read and dropped for up to :data:`LINGER_SECONDS` or
    :data:`LINGER_MAX_BYTES` (:data:`LINGER_MAX_HEAD_BYTES` after a refused head: a legitimate
    head is never that long), then the socket is closed. Closed at once, with bytes unread, the
    kernel answered the client's next bytes with a reset, and a client still sending its body
    (most do not read before they have sent it) lost the 413 or 431 already on its way: a third of
    ``bench/hostile.py``'s 8 MiB headers got no answer. nginx does the same (``lingering_close``).
    Everything else is the wrapped transport's."""

    __slots__ = ("_held", "_pace", "_protocol", "_timer", "_transport", "dropped", "lingering", "max_drop", "written")

    def __init__(self, transport: asyncio.Transport, protocol: BoundedHttpToolsProtocol) -> None:
        self._transport = transport
        self._protocol = protocol
        self._timer: asyncio.TimerHandle | None = None
        self._pace: asyncio.TimerHandle | None = None
        self.lingering = False
        self.dropped = 0
        self.max_drop = LINGER_MAX_BYTES
        self.written = 0  # bytes handed to write(): less the buffer's, what the client's TCP took
        self._held: list[bytes] | None = None  # writes held back by :meth:`hold`

    def hold(self) -> None:
        """Hold back what is written until :meth:`flush`, at the latest one loop turn later: a
        response's head then leaves in one send with its body's first bytes, one system call
        (and one wake-up of the client) fewer per response."""
        if self._held is None and self._protocol is not None:  # not after the connection was lost
            self._held = []
            self._protocol.loop.call_soon(self.flush)

    def flush(self) -> None:
        """Write what :meth:`hold` held back, as one write."""
        held, self._held = self._held, None
        if held:
            self.write(b"".join(held))

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """The wrapped transport's ``write`` (held back after :meth:`hold`); counts the bytes and
        the peak left unsent."""
        if self._held is not None:
            self._held.append(bytes(data))
            return
        if self.lingering:  # the answer and the FIN are out: nothing more can follow them
            return
        self.written += len(data)
        t = self._transport
        t.write(data)
        p = self._protocol
        if p is not None:
            unsent = t.get_write_buffer_size()
            if unsent > p.edge.peak_unsent:
                p.edge.peak_unsent = unsent

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def close(self) -> None:
        if self.lingering:
            return
        self.flush()
        t = self._transport
        if t.is_closing():
            t.close()
            return
        p = self._protocol
        p._watch_send()  # bytes still unsent: the client must keep taking them
        if not _request_unfinished(p):
            t.close()
            return
        self.lingering = True
        if not p._discarding:
            self.max_drop = LINGER_MAX_HEAD_BYTES if p._in_head else LINGER_MAX_BYTES
        if t.can_write_eof():
            t.write_eof()  # after the answer: the client reads it, then sees the end
        if self._pace is None:
            t.resume_reading()  # reading may be paused (a delayed refusal, the app's flow control)
        _stop_counting(p)
        self._timer = self._protocol.loop.call_later(LINGER_SECONDS, t.close)

    def drop(self, n: int) -> None:
        """Bytes that arrived while lingering or discarding: dropped; past ``max_drop``
        (:data:`LINGER_MAX_HEAD_BYTES` after a refused head, else :data:`LINGER_MAX_BYTES`), closed.
        Reading pauses for ``n`` / :data:`LINGER_BYTES_PER_SECOND` seconds (paced)."""
        self.dropped += n
        if self.dropped > self.max_drop:
            self.abort_linger()
            return
        if self._pace is None and not self._transport.is_closing():
            self._transport.pause_reading()
            self._pace = self._protocol.loop.call_later(n / LINGER_BYTES_PER_SECOND, self._resume)

    def _resume(self) -> None:
        self._pace = None
        if not self._transport.is_closing():
            self._transport.resume_reading()

    def abort_linger(self) -> None:
        """Close now (the client ended, dropped too much, or the connection is lost)."""
        for t in (self._timer, self._pace):
            if t is not None:
                t.cancel()
        self._timer = self._pace = None
        self._transport.close()

    def is_closing(self) -> bool:
        return self.lingering or self._transport.is_closing()

    def release(self) -> None:
        """The connection is lost: drop the reference back to the protocol (the protocol holds
        this transport), so that both are freed when the last reference goes, not by the cyclic
        garbage collector: with hundreds of connections a second, collecting them made its full
        collections hold the event loop 20-28 ms under ``bench/hostile.py``. :meth:`close` only
        needs the protocol while the transport is open."""
        self._protocol = None  # type: ignore[assignment]  # closed: close() no longer reads it

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's ``HttpToolsProtocol`` with :class:`EdgeLimits` (from ``config.kvgate_edge_limits``,
    set by :func:`configure`; the defaults when absent). Parsing stops at the first refusal: a
    refused head costs the callbacks up to its limit, not its size."""

    #: class-level defaults of what ``__init__`` sets per connection (read by the refusal path)
    _running: Any = None
    _after_earlier: bytes | None = None

    def __init__(self, config: Any, server_state: Any, app_state: dict[str, Any], _loop: Any = None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.parser = _StoppableParser(self.parser)  # type: ignore[assignment]  # a proxy with the same methods
        self.limits: EdgeLimits = getattr(config, "kvgate_edge_limits", None) or EdgeLimits()
        self.edge: EdgeState = getattr(config, "kvgate_edge_state", None) or EdgeState()
        self._key_check: Callable[[str | None], bool] | None = getattr(config, "kvgate_key_check", None)
        self._client: str | None = None  # the address counted in edge.per_client
        self._in_head = True  # between requests or inside a request head
        self._head_read = True  # the read being parsed began inside a head
        self._head_bytes = 0
        self._header_count = 0
        self._body_wire_bytes = 0  # the body's bytes as sent, chunk framing included
        self._body_bytes = 0  # the body's bytes as decoded
        self._chunks = 0
        self._chunked = False  # the request being parsed has a chunked body
        self._refused = False
        self._discarding = False  # the rest of what the client sends is dropped unread
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._send_timer: asyncio.TimerHandle | None = None
        self._sent_seen = 0  # bytes the client's TCP had taken when the send timer was armed
        self._running: Any = None  # the cycle whose app runs (uvicorn's ``cycle`` is the newest parsed)
        self._after_earlier: bytes | None = None  # a refusal due once the answers before it are out

    # ------------------------------------------------------------ refusals
    def _refuse(self, status: int, message: str, *, code: str, delay_seconds: float = 0.0) -> None:
        """Answer ``status`` (unless a response has begun) and close, lingering. With
        ``delay_seconds`` (a 431: ``limits.refusal_delay_seconds``), the connection is not read
        meanwhile and the answer goes out that much later: a client refused for its head waits
        before it can send the next one."""
        if self._refused:
            return
        self._refused = True
        self._cancel_timers()
        if self.transport is None or self.transport.is_closing():
            return
        if delay_seconds > 0:
            self.transport.pause_reading()
            due = time.monotonic() + delay_seconds
            self._head_timer = self.loop.call_later(delay_seconds, self._answer_when_due, due, (status, message, code))
            return
        self._answer(status, message, code=code)

    def send_400_response(self, msg: str) -> None:
        """httptools refused the bytes as HTTP/1.1 (duplicate or negative ``Content-Length``, both
        it and chunked, a bad chunk size, a folded header, bare LF, an HTTP/2 preface): answered
        in the OpenAI shape with ``connection: close``, like every other refusal (uvicorn's own
        answer is ``text/plain``)."""
        self._refuse(400, NOT_HTTP_MESSAGE, code=ErrorCode.INVALID_REQUEST)

    def _answer_when_due(self, due: float, refusal: tuple[int, str, str]) -> None:
        """:meth:`_answer` of ``refusal`` (status, message, code) once ``time.monotonic()`` has
        reached ``due``: the loop's timer can fire early by that clock (uvloop reads its clock once
        per loop turn and counts whole milliseconds: a CI run answered after 0.39988 of 0.4 s), so
        it is armed again for the rest."""
        left = due - time.monotonic()
        if left > 0:
            self._head_timer = self.loop.call_later(left, self._answer_when_due, due, refusal)
            return
        status, message, code = refusal
        self._answer(status, message, code=code)

    def _answer(self, status: int, message: str, *, code: str) -> None:
        self._head_timer = None
        if self.transport is None or self.transport.is_closing():
            return
        if self._earlier_unanswered():
            self._answer_after_earlier(
                refusal_bytes(status, message, code=code, headers=self.server_state.default_headers)
            )
            log.info("refused a pipelined request: %d %s (answered after the requests before it)", status, code)
            return
        cycle = self.cycle  # on a kept-alive connection, the previous request's until a new head ends
        if cycle is None or not cycle.response_started or (self._in_head and cycle.response_complete):
            self.transport.write(refusal_bytes(status, message, code=code, headers=self.server_state.default_headers))
            if not self._in_head and cycle is not None:  # the refusal answers the request whose body arrives
                scope: Any = cycle.scope  # (uvicorn's HTTPScope names only ASGI's keys)
                mark_refused(scope, status, code=code)  # its app records what the client got, not a 499
        # the close lingers (the request is unfinished): the request's cycle is marked
        # disconnected at once, so the app's receive() reports a disconnect and whatever it sends
        # is dropped
        self.transport.close()
        log.info("refused a client connection: %d %s", status, code)

    def _refused_cycle(self) -> Any:
        """The request a refusal is for: ``None`` for a head that has not ended (no request yet),
        else the newest parsed (whose body is arriving)."""
        return None if self._in_head else self.cycle

    def _earlier_unanswered(self) -> bool:
        """Whether a request before the refused one (pipelined behind it) is still being answered:
        its answer is on the wire or still to come, so a refusal written now would be read by the
        client as that request's answer, or land inside it (a 408 in the middle of a chunked stream)."""
        running = self._running
        return running is not None and running is not self._refused_cycle() and not running.response_complete

    def _answer_after_earlier(self, data: bytes) -> None:
        """Keep ``data`` (a refusal) until the requests before the refused one are answered
        (:meth:`on_response_complete` writes it, then closes); the refused request, if queued, is
        never started, and what the client sends meanwhile is dropped, paced (as after a close)."""
        refused = self._refused_cycle()
        if refused is not None:
            for entry in list(self.pipeline):
                if entry[0] is refused:
                    self.pipeline.remove(entry)
            refused.disconnected = True
            refused.message_event.set()
        self._after_earlier = data
        self._discarding = True
        t = self.transport
        if isinstance(t, _LingeringTransport):
            t.max_drop = LINGER_MAX_HEAD_BYTES if refused is None else LINGER_MAX_BYTES
            t.resume_reading()  # paused by a delayed refusal: the dropped bytes are paced instead

    def on_response_complete(self) -> None:
        """A response is complete: the next queued request starts (uvicorn), and its body's
        deadline with it (a queued request's body may wait on this connection's flow control,
        not on its client); or, when none is left, a refusal kept by
        :meth:`_answer_after_earlier` is written and the connection closed."""
        queued = bool(self.pipeline)
        super().on_response_complete()
        t = self.transport
        if t is None or t.is_closing():
            return
        running = self._running
        if running is not None and not running.response_complete:
            if queued and running.more_body and self._body_timer is None and not self._refused and not self._discarding:
                self._body_timer = self.loop.call_later(self.limits.body_timeout_seconds, self._body_too_slow)
            return
        if self._after_earlier is not None:
            data, self._after_earlier = self._after_earlier, None
            self._unset_keepalive_if_required()
            t.write(data)
            t.close()

    def _cancel_timers(self) -> None:
        for t in (self._head_timer, self._body_timer):
            if t is not None:
                t.cancel()
        self._head_timer = self._body_timer = None

    def _head_too_slow(self) -> None:
        self._refuse(
            408,
            f"The request head did not arrive within {self.limits.header_timeout_seconds:g} seconds.",
            code=ErrorCode.REQUEST_TIMEOUT,
        )

    def _body_too_slow(self) -> None:
        self._body_timer = None
        self._refuse(
            408,
            f"The request body did not arrive within {self.limits.body_timeout_seconds:g} seconds.",
            code=ErrorCode.REQUEST_TIMEOUT,
        )

    def _head_too_large(self, what: str) -> None:
        self._refuse(
            431,
            f"The request's headers are too large: {what}.",
            code=ErrorCode.REQUEST_HEADER_FIELDS_TOO_LARGE,
            delay_seconds=self.limits.refusal_delay_seconds,
        )

    # ------------------------------------------------------------ writing to the client
    def _unsent_and_sent(self) -> tuple[int, int]:
        """(bytes waiting in the transport's buffer, bytes the client's TCP has taken so far)."""
        t = self.transport
        unsent = t.get_write_buffer_size()
        return unsent, getattr(t, "written", 0) - unsent

    def _watch_send(self) -> None:
        """While bytes wait to be sent, check every ``send_timeout_seconds`` that the client took
        some since the last check (:meth:`_check_send`)."""
        if self._send_timer is not None or self.transport is None:
            return
        unsent, self._sent_seen = self._unsent_and_sent()
        if unsent > 0:
            self._send_timer = self.loop.call_later(self.limits.send_timeout_seconds, self._check_send)

    def _check_send(self) -> None:
        self._send_timer = None
        if self.transport is None:
            return
        unsent, sent = self._unsent_and_sent()
        if unsent == 0:
            return
        if sent > self._sent_seen:
            self._watch_send()
            return
        self.edge.send_timeouts += 1
        log.info(
            "aborted a client connection: none of its %d unsent bytes taken in %g seconds",
            unsent,
            self.limits.send_timeout_seconds,
        )
        self.transport.abort()  # connection_lost follows: the request sees a disconnect

    def pause_writing(self) -> None:
        """The transport's buffer is above its high-water mark: the app's ``send`` waits
        (uvicorn's flow control) and the send timeout watches the client."""
        super().pause_writing()
        self.edge.write_pauses += 1
        self._watch_send()

    def _unsupported_upgrade_warning(self) -> None:
        """uvicorn's two warnings for each upgrade request (one says to install a WebSocket library),
        which a client could have logged at will: the gateway serves no upgrade by design."""
        log.info("answered an upgrade request as HTTP/1.1, then closing the connection")

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        self._running = cycle
        if cycle.scope["path"] == "*":  # OPTIONS * (another method with "*" was refused): the server's
            app = _server_options
        super()._start_asgi_task(cycle, _paced_app(app, cycle))

    def _disconnect_all(self) -> None:
        """The connection is gone: every unanswered request on it sees the disconnect, the one
        being answered and those pipelined behind it alike (uvicorn marks only its ``cycle``,
        the newest request parsed, which is a queued one while pipelined requests wait)."""
        for cycle in (self._running, self.cycle, *(c for c, _ in self.pipeline)):
            if cycle is not None and not cycle.response_complete:
                cycle.disconnected = True
                cycle.message_event.set()

    # ------------------------------------------------------------ asyncio.Protocol
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        transport = _LingeringTransport(transport, self)  # type: ignore[assignment]  # same methods
        super().connection_made(transport)
        if len(self.connections) + len(self.edge.lingering) > self.limits.max_inbound_connections:
            self._refuse(
                503,
                f"The gateway holds its maximum of {self.limits.max_inbound_connections} client connections; "
                "retry shortly.",
                code=ErrorCode.SERVER_BUSY,
            )
            return
        peer = transport.get_extra_info("peername")
        client = str(peer[0]) if isinstance(peer, (tuple, list)) and peer else "-"
        held = self.edge.per_client.get(client, 0)
        if held >= self.limits.per_client:
            self._refuse(
                429,
                f"Your address holds its maximum of {self.limits.per_client} connections to the gateway; "
                "reuse them or close some.",
                code=ErrorCode.TOO_MANY_CONNECTIONS,
            )
            return
        self.edge.per_client[client] = held + 1
        self._client = client
        self._head_timer = self.loop.call_later(self.limits.header_timeout_seconds, self._head_too_slow)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None
        self.edge.lingering.discard(self)
        if self._client is not None:
            left = self.edge.per_client.get(self._client, 1) - 1
            if left > 0:
                self.edge.per_client[self._client] = left
            else:
                self.edge.per_client.pop(self._client, None)
            self._client = None
        t = self.transport
        if isinstance(t, _LingeringTransport) and t.lingering:
            t.abort_linger()  # cancels the linger timer
        self._disconnect_all()
        super().connection_lost(exc)
        if isinstance(t, _LingeringTransport):
            t.release()
        # uvicorn keeps the last request's cycle, which holds a bound method of this protocol:
        # a reference cycle per connection, freed only by a full collection. The app's task,
        # if still running, keeps the cycle it uses; nothing here reads it after the loss.
        self.cycle = None  # type: ignore[assignment]

    def eof_received(self) -> None:
        t = self.transport
        if isinstance(t, _LingeringTransport) and t.lingering:
            t.abort_linger()  # the client has sent everything: nothing left to wait for
            return
        super().eof_received()

    def data_received(self, data: bytes) -> None:
        if self._refused or self._discarding:
            t = self.transport
            if isinstance(t, _LingeringTransport) and (t.lingering or self._discarding):
                t.drop(len(data))
            return
        self._head_read = self._in_head
        if not self._in_head:
            self._body_wire_bytes += len(data)
        if self._in_head:
            if self._head_timer is None:  # a new request on a kept-alive connection
                self._head_timer = self.loop.call_later(self.limits.header_timeout_seconds, self._head_too_slow)
            self._head_bytes += len(data)
        super().data_received(data)
        if self._in_head and not self._refused and self._head_bytes > self.limits.max_header_bytes:
            # still inside the head (the headers did not end in what arrived) and already too long
            self._head_too_large(f"more than {self.limits.max_header_bytes} bytes")
        elif (
            self._chunked
            and not self._in_head
            and not (self._refused or self._discarding)
            and self._body_wire_bytes > self.limits.max_body_bytes
        ):
            # counted as they arrive, not only when a chunk-size line ends: an endless chunk
            # extension, size line or trailer field was read until the body timeout (RFC 9112, 7.1.1)
            self._refuse(413, self._body_too_large_message(), code=ErrorCode.REQUEST_TOO_LARGE)

    # ------------------------------------------------------------ parser callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > self.limits.max_header_count:
            self._head_too_large(f"more than {self.limits.max_header_count} header fields")
            raise _StopParsing
        if not self._in_head:
            # a trailer field (after a chunked body): never merged into the request's header fields
            # (RFC 9110 section 6.5.1): the app read them as the head's, after any check on the head
            return
        super().on_header(name, value)

    def on_url(self, url: bytes) -> None:
        """A piece of the request-target (httptools hands it over as it arrives): one longer than
        :data:`MAX_TARGET_BYTES` (or ``max_header_bytes``) gets 414 ``uri_too_long`` after the
        refusal delay, as soon as it is (RFC 9112 section 3: a server MUST answer 414 to a target
        longer than it will parse; it was a 431 about headers, nginx answers 414)."""
        super().on_url(url)
        limit = min(MAX_TARGET_BYTES, self.limits.max_header_bytes)
        if len(self.url) > limit and not self._refused:
            self._refuse(
                414,
                f"The request target is longer than {limit} bytes.",
                code=ErrorCode.URI_TOO_LONG,
                delay_seconds=self.limits.refusal_delay_seconds,
            )
            raise _StopParsing

    def on_headers_complete(self) -> None:
        if self._refused:
            return
        head = len(self.url) + sum(len(n) + len(v) + 4 for n, v in self.headers)
        if head > self.limits.max_header_bytes:
            self._head_too_large(f"more than {self.limits.max_header_bytes} bytes")
            return
        if self._pipeline_full():
            raise _StopParsing
        version = self.parser.get_http_version()
        if self._version_refused(version) or self._framing_refused(version) or self._target_refused():
            raise _StopParsing
        if version != "1.1":
            self.expect_100_continue = False  # RFC 9110 section 10.1.1: ignored from an HTTP/1.0 client
        self._in_head = False
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().on_headers_complete()
        self._route_as_sent()
        if self.pipeline and self.flow.read_paused:
            # uvicorn stops reading while a pipelined request waits, so a client that leaves is
            # not seen until its answer is written, and the request being answered held its
            # engine request and its tenant's lease meanwhile. Reading on sees the EOF at once;
            # what it takes in stays bounded: max_pipelined_requests heads, and uvicorn pauses
            # again when a queued request's body passes its high-water mark (64 KiB)
            self.flow.resume_reading()
        if self.cycle is not None and self._without_key():
            raise _StopParsing
        self._close_after_upgrade_request()
        if self.cycle is not None and self.cycle.more_body and self._running is self.cycle:
            # a queued (pipelined) request's deadline starts when it does (on_response_complete)
            self._body_timer = self.loop.call_later(self.limits.body_timeout_seconds, self._body_too_slow)

    def _version_refused(self, version: str) -> bool:
        """Whether the head is refused for its HTTP version (answered; parsing stops): 505 for a
        request line that is not HTTP/1.x (RFC 9110 section 15.6.6; HTTP/0.9, no version or
        HTTP/2.0 were answered as HTTP/1.1), 400 for HTTP/1.1 without one Host field (RFC 9112
        section 3.2: none, or several that a proxy in front and the gateway may read apart)."""
        if version not in ("1.0", "1.1"):
            self._refuse(
                505, f"HTTP/{version} is not supported; send HTTP/1.1.", code=ErrorCode.HTTP_VERSION_NOT_SUPPORTED
            )
            return True
        if version == "1.1" and (hosts := sum(1 for n, _ in self.headers if n == b"host")) != 1:
            self._refuse(
                400, f"An HTTP/1.1 request needs one Host header; this one has {hosts}.", code=ErrorCode.INVALID_REQUEST
            )
            return True
        return False

    def _framing_refused(self, version: str) -> bool:
        """Whether the head is refused for how its body is framed (answered; parsing stops), where
        httptools parses on: ``Transfer-Encoding`` from HTTP/1.0 (400: RFC 9112 section 6.1 has it
        treated as faulty framing; an HTTP/1.0 proxy in front reads the body to the close), a
        transfer coding besides chunked (501, RFC 9112 section 6.1: ``gzip, chunked`` was read as
        plain chunked), an upgrade request with a body (400: httptools skips the body of a request
        it takes for an upgrade, and its bytes were parsed as the next request), a ``Host`` that is
        not a host (400, RFC 9112 section 3.2)."""
        codings = [c.strip(b" \t").lower() for n, v in self.headers if n == b"transfer-encoding" for c in v.split(b",")]
        codings = [c for c in codings if c]
        te = any(n == b"transfer-encoding" for n, _ in self.headers)
        if te and version == "1.0":
            msg = "An HTTP/1.0 request cannot use Transfer-Encoding; send a Content-Length."
            self._refuse(400, msg, code=ErrorCode.INVALID_REQUEST)
            return True
        if te and codings[-1:] != [b"chunked"]:
            # chunked not last: the body's length is unknown (RFC 9112 section 6.3), httptools' 400 (it
            # would find it only after this, and not at all for an upgrade request, whose body it skips)
            self.send_400_response("")
            return True
        if te and codings != [b"chunked"]:
            listed = ", ".join(c.decode("latin-1") for c in codings)
            msg = f"Transfer-Encoding {listed} is not supported; send the body chunked alone or with a Content-Length."
            self._refuse(501, msg, code=ErrorCode.NOT_IMPLEMENTED)
            return True
        body = te or any(n == b"content-length" and v.strip(b" \t").lstrip(b"0") for n, v in self.headers)
        if body and self.parser.should_upgrade():
            msg = (
                "The gateway upgrades to no other protocol, and a request with an Upgrade header cannot have a "
                "body; send it without Upgrade."
            )
            self._refuse(400, msg, code=ErrorCode.INVALID_REQUEST)
            return True
        if any(n == b"host" and not _HOST.fullmatch(v) for n, v in self.headers):
            self._refuse(400, "The Host header is not a valid host.", code=ErrorCode.INVALID_REQUEST)
            return True
        self._chunked = te
        return False

    def _target_refused(self) -> bool:
        """Whether the head is refused for its request-target (400, :func:`origin_form`; answered,
        parsing stops); else the target is made origin-form for uvicorn to parse (it took only the
        path of an absolute-form target, and one without a path was a 400 "not valid HTTP/1.1")."""
        target = origin_form(self.parser.get_method(), self.url)
        if isinstance(target, str):
            self._refuse(400, target, code=ErrorCode.INVALID_REQUEST)
            return True
        self.url = target
        return False

    def _route_as_sent(self) -> None:
        """The app routes on the path as sent: uvicorn percent-decodes the scope's ``path``, so
        ``/v1%2Fchat%2Fcompletions`` and ``/%6Detrics`` reached their routes, past a rule in front
        that matched the bytes sent (Envoy, by default, neither decodes ``%2F`` nor normalizes a
        path before its route and authorization match). A path with a "%" keeps it there, and
        names no route (404, as ``//v1/models`` and ``/v1/../v1/models`` do: no dot segments
        removed, no slashes merged); RFC 3986 section 2.2: an encoded "/" is data, not a
        separator. Only the bytes after a :data:`PARAMETER_PREFIXES` prefix are decoded: a path
        parameter's (a model id), which the route's own prefix, matched as sent, leads to."""
        raw = self.scope["raw_path"][len(self.root_path) :]
        if b"%" in raw and not raw.startswith(PARAMETER_PREFIXES):
            self.scope["path"] = self.root_path + raw.decode("ascii")

    def _close_after_upgrade_request(self) -> None:
        """After an upgrade request's head: httptools stops there (bytes after it in the same read
        were dropped, a later read parsed as the next request), and the gateway upgrades to nothing
        (RFC 9110 section 7.8: it may go on with HTTP/1.1). The request is answered, the connection
        closed after it, and nothing more is read (one with a body was refused: :meth:`_framing_refused`)."""
        if self.cycle is None or not self.parser.should_upgrade():
            return
        self.cycle.keep_alive = False
        self._discarding = True

    def _pipeline_full(self) -> bool:
        """A request head arrived while ``max_pipelined_requests`` wait behind the one being
        answered: it is not queued, the last queued one is answered with ``connection: close``
        and what the client sends next is dropped (the client resends the unanswered requests
        on a new connection, RFC 9112 section 9.3.2)."""
        cycle = self.cycle
        if cycle is None or cycle.response_complete or len(self.pipeline) < self.limits.max_pipelined_requests:
            return False
        last = self.pipeline[0][0] if self.pipeline else cycle  # appendleft: the newest is first
        last.keep_alive = False
        self._discarding = True
        self._cancel_timers()
        log.info("closing a client connection after %d pipelined requests", len(self.pipeline) + 1)
        return True

    def _without_key(self) -> bool:
        """After a request head: a request with a body, or to an API path, without a tenant's key
        is answered (401, by the app) with ``connection: close``, and nothing it sends after its
        head is parsed (its body, pipelined requests): it is dropped, paced, until the close has
        lingered. True when that is so (parsing stops)."""
        if self._key_check is None:
            return False
        path = self.scope.get("path", "")
        body = any(
            n in (b"content-length", b"transfer-encoding") and v.strip() not in (b"", b"0") for n, v in self.headers
        )
        if not (body or path.startswith(_API_PREFIXES)):
            return False
        auths = [v for n, v in self.headers if n == b"authorization"]
        if len(auths) == 1 and self._key_check(auths[0].decode("latin-1")):
            return False
        self.cycle.keep_alive = False
        self._discarding = True
        return True

    def _body_too_large_message(self) -> str:
        return f"The request body is larger than {self.limits.max_body_bytes} bytes (chunk framing included)."

    def _refuse_body(self, message: str) -> None:
        self._refuse(413, message, code=ErrorCode.REQUEST_TOO_LARGE)
        raise _StopParsing

    def on_chunk_header(self) -> None:
        """A chunk's size line was parsed (the body's last, zero-length chunk included)."""
        if self._refused:
            return
        self._chunks += 1
        done = self._chunks - 1
        lim = self.limits
        if self._body_wire_bytes > lim.max_body_bytes:
            self._refuse_body(self._body_too_large_message())
        if done > lim.max_body_chunks:
            self._refuse_body(f"The request body has more than {lim.max_body_chunks} chunks.")
        if done > FREE_CHUNKS and self._body_bytes < lim.min_chunk_bytes * done:
            self._refuse_body(
                f"The request body's chunks average under {lim.min_chunk_bytes} bytes; send larger chunks "
                "or a Content-Length body."
            )

    def on_body(self, body: bytes) -> None:
        if self._refused:
            return
        self._body_bytes += len(body)
        if self._head_read:  # the head ended in this read: only its body part is the body's
            self._body_wire_bytes += len(body)
        super().on_body(body)

    def on_message_complete(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        if self._refused:
            return
        super().on_message_complete()
        self._in_head = True
        self._head_bytes = 0
        self._header_count = 0
        self._body_wire_bytes = self._body_bytes = self._chunks = 0
        self._chunked = False


def _paced_app(app: Any, cycle: Any) -> Any:
    """``app`` (an ASGI app) whose ``send`` is :func:`_send_paced` on the request's uvicorn
    ``RequestResponseCycle`` ``cycle``, and whose scope says when ``cycle`` holds the whole
    request (:data:`gateway.edge.extensions.REQUEST_COMPLETE`: its last body byte parsed)."""

    async def paced(scope: Any, receive: Any, send: Any) -> None:
        mark_complete_when(scope, lambda: not cycle.more_body)
        await app(scope, receive, functools.partial(_send_paced, send, cycle))

    return paced


async def _send_paced(send: Any, cycle: Any, message: Any) -> None:
    """``send(message)``, but a ``Content-Length`` body larger than :data:`SEND_PIECE_BYTES` is
    sent in pieces of that size: uvicorn's ``send`` waits while the connection is above its
    high-water mark before each one, so no more than a piece is added to a buffer the client is
    not reading. A response's head is held back (:meth:`_LingeringTransport.hold`) and written
    with the first body message, when that comes in the same loop turn. The bytes on the wire are
    the same; once the client is gone, the rest is dropped."""
    t = cycle.transport
    lingering = isinstance(t, _LingeringTransport)
    if message["type"] == "http.response.start":
        if cycle.more_body:
            # answered before its body has arrived (a route that does not read one): the body is not
            # read on to keep the connection (it was, unbounded by max_body_bytes and unpaced); the
            # close lingers over what the client still sends
            cycle.keep_alive = False
        if lingering:
            t.hold()
        await send(message)
        return
    body = message.get("body", b"")
    if len(body) <= SEND_PIECE_BYTES or cycle.chunked_encoding is not False or cycle.scope["method"] == "HEAD":
        await send(message)
        if lingering:
            t.flush()
        return
    view, more = memoryview(body), message.get("more_body", False)
    for start in range(0, len(view), SEND_PIECE_BYTES):
        stop = start + SEND_PIECE_BYTES
        await send({"type": "http.response.body", "body": view[start:stop], "more_body": more or stop < len(view)})
        if lingering:
            t.flush()
        if cycle.disconnected:
            return


#: GIL switch interval of a serving process (seconds; Python's default is 0.005). Counting, parsing
#: and scanning run in worker threads; while one holds the GIL, the event loop's thread waits for
#: it up to this long each time it wakes, so a shorter interval bounds the loop's lag.
SWITCH_INTERVAL_SECONDS = 0.001


def tenant_key_check(registry: Any) -> Callable[[str | None], bool]:
    """Whether an ``Authorization`` header value carries a key of ``registry``'s tenants (a
    :class:`gateway.ops.tenants.TenantRegistry`, read at each call: tenant edits apply)."""
    from gateway.admission.auth import bearer_key

    def check(authorization: str | None) -> bool:
        key = bearer_key(authorization)
        return key is not None and registry.lookup(key) is not None

    return check


def configure(config: Any, limits: EdgeLimits, key_check: Callable[[str | None], bool] | None = None) -> Any:
    """Make ``config`` (a ``uvicorn.Config``, before it is loaded) serve with
    :class:`BoundedHttpToolsProtocol` under ``limits`` and without WebSockets, and set this
    process's GIL switch interval to :data:`SWITCH_INTERVAL_SECONDS`; returns ``config``.
    ``key_check`` (default: the tenant registry of the gateway app ``config.app``,
    :func:`tenant_key_check`) tells a tenant's key from a request's ``Authorization`` header;
    without one, bodies of requests without a key are read (and refused by the app) as any other."""
    sys.setswitchinterval(SWITCH_INTERVAL_SECONDS)
    if key_check is None:
        gw = getattr(getattr(getattr(config, "app", None), "state", None), "gateway", None)
        registry = getattr(gw, "tenants", None)
        key_check = tenant_key_check(registry) if registry is not None else None
    config.http = BoundedHttpToolsProtocol
    config.ws = "none"  # no WebSocket route: an upgrade is answered as the HTTP request it came with
    config.kvgate_edge_limits = limits
    config.kvgate_edge_state = EdgeState()
    config.kvgate_key_check = key_check
    config.timeout_keep_alive = limits.keepalive_timeout_seconds
    config.h11_max_incomplete_event_size = limits.max_header_bytes  # if h11 is ever chosen instead
    return config
