"""The one relay loop for an engine's event stream, whatever its protocol
(:mod:`gateway.relay.stream_protocol`), and the result it ends with.

:func:`relay_stream` relays a stream event by event, byte-exact (:mod:`gateway.relay.sse`). Events
before the response starts (its first text or finish reason) are held back, so that an engine error
before any content is answered with the engine's status; it yields an empty chunk once the response
starts. It feeds every event to the verifier's guard, ends with the protocol's end marker, and
raises what ended a stream early: the engine's :class:`~config.errors.OpenAIError`, an
:class:`~gateway.relay.upstream_client.UpstreamError` (the events held are yielded first), a
:class:`~verifier.stage.ResponseWithheld`, an :class:`~gateway.relay.sse.SSEEventTooLarge`.

What the stream produced is counted in a :class:`Tally`, which only the relay writes;
:meth:`Tally.result` freezes it into the :class:`Produced` record the settle and the logs read.

Refused as outside the protocol (the stream ends with 502 ``upstream_unavailable``, an error event
once it started): bytes a client reads as several events, JSON only a client's laxer reader reads,
data that is text no JSON reader takes (a client receives it; the verifier reads nothing in it),
and an index clients group apart from the verifier: a chat/completions choice's
(:func:`odd_choice_index`), a streamed tool call's (:func:`odd_tool_call_index`), a ``/v1/responses``
text event's ``output_index`` / ``content_index`` / ``summary_index`` (:func:`odd_output_index`),
and an ``event:`` field other than the data's ``type`` (:func:`odd_event_type_event`). A comment with
text, and ``id:``, ``retry:`` and other fields' lines, reach the client as bare ``:`` comments
(:func:`gateway.relay.sse.relayed_fields`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncGenerator, Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeAlias

import orjson

from config.errors import ErrorCode, OpenAIError
from gateway.edge.body_budget import FREE_BODY_BYTES, BodyBudget
from gateway.relay.sse import (
    SeveralEvents,
    SSEEventTooLarge,
    SSESplitter,
    inspect,
    relayed_fields,
    strip_usage_null,
)
from gateway.relay.stream_protocol import CHAT_SSE, RESPONSES_SSE, StreamProtocol, read_response_event
from gateway.relay.upstream_client import RemoteProtocolError, UpstreamError, UpstreamResponse
from verifier.drift import reported_count
from verifier.engine_response import META_MAX_CHARS, EngineOutput, StreamEvent, StreamMeta, engine_error, strict_view
from verifier.stage import MAX_PROMPT_TOKENS_REPORTED, ResponseGuard, StreamUsage

log = logging.getLogger("kvgate.proxy")

#: what the relay yields: ``(body, more_body)``, as in an ASGI ``http.response.body`` message
Chunk: TypeAlias = tuple[bytes, bool]


@dataclass(frozen=True, slots=True)
class Produced:
    """What the engine produced, as far as it was relayed. ``texts``: choice (or output) index ->
    the text it produced (what a settle without usage counts); ``usage``: the engine's usage
    object (chat names; of several, each count the largest reported: :func:`merge_usage`);
    ``finish_reason``: the last one seen; ``ttft_seconds``: from forwarding
    to the first text (streams) or the engine's ``x-prefill-seconds`` (whole answers);
    ``error_code``: the code of an engine error relayed inside the stream; ``sequence_number``:
    the last one of a ``/v1/responses`` stream (the gateway's own error event follows it);
    ``pieces``: choice (or output) index -> how many events (a whole answer: 1) carried non-empty
    text of it, each of which took at least one generated token (the settle's lower bound on
    ``usage.completion_tokens``: :func:`gateway.relay.finish.least_completion_tokens`)."""

    texts: Mapping[int, str]
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None
    ttft_seconds: float | None = None
    error_code: str | None = None
    sequence_number: int | None = None
    pieces: Mapping[int, int] = field(default_factory=dict)


#: what a relay that never read an answer produced
NOTHING = Produced({})


class Tally:
    """What one relay has seen so far (written only by the relay; :meth:`result` freezes it).
    ``t_forward``: ``perf_counter()`` when the request was sent (TTFT is measured from it).
    ``first_usage``: the stream's first usage report (``first_prompt``: its ``prompt_tokens``);
    ``prompt_reports``: ``None`` while every report's ``prompt_tokens`` equals the first's, else
    their distinct values (:func:`verifier.drift.reported_count`, at most
    :data:`~verifier.stage.MAX_PROMPT_TOKENS_REPORTED`) in the order first sent."""

    __slots__ = (
        "error_code",
        "finish_reason",
        "finished",
        "first_prompt",
        "first_usage",
        "prompt_reports",
        "sequence_number",
        "t_forward",
        "texts",
        "ttft_seconds",
        "usage",
    )

    def __init__(self, t_forward: float) -> None:
        self.t_forward = t_forward
        self.texts: dict[int, list[str]] = {}
        self.usage: dict[str, Any] | None = None
        self.finish_reason: str | None = None
        self.finished: set[int] = set()  # the choices a finish reason ended
        self.ttft_seconds: float | None = None
        self.error_code: str | None = None
        self.sequence_number: int | None = None
        self.first_usage: dict[str, Any] = {}
        self.first_prompt: Any = None
        self.prompt_reports: list[int | str] | None = None

    def add(self, ev: StreamEvent) -> None:
        """Count one stream event: its sequence number, usage (several: :func:`merge_usage`, and
        a ``prompt_tokens`` that differs from the first report's noted: :meth:`_disagreed`),
        finish reasons, texts (the first text sets the TTFT)."""
        if ev.sequence_number is not None:
            self.sequence_number = ev.sequence_number
        u = ev.usage
        if u is not None:
            usage = self.usage
            if usage is None:
                self.usage = self.first_usage = u
                self.first_prompt = u.get("prompt_tokens")
            else:
                p, p0 = u.get("prompt_tokens"), self.first_prompt
                if p.__class__ is not p0.__class__ or p != p0:  # all an honest report costs beyond the merge
                    self._disagreed(u)
                self.usage = merge_usage(usage, u)
        if ev.finish_reason is not None:
            self.finish_reason = ev.finish_reason
            self.finished.update(ev.finished)
        if ev.texts:
            for i, t in ev.texts.items():
                self.texts.setdefault(i, []).append(t)
            if self.ttft_seconds is None:
                self.ttft_seconds = time.perf_counter() - self.t_forward

    def _disagreed(self, u: dict[str, Any]) -> None:
        """Note the ``prompt_tokens`` of ``u``, a report that disagrees with the first."""
        reports = self.prompt_reports
        if reports is None:
            reports = self.prompt_reports = [reported_count(self.first_usage)]
        v = reported_count(u)
        if v not in reports and len(reports) < MAX_PROMPT_TOKENS_REPORTED:
            reports.append(v)

    def usage_to_check(self) -> dict[str, Any] | None:
        """The usage the verifier checks: :attr:`usage`, or, when the reports disagreed on
        ``prompt_tokens``, the same as a :class:`~verifier.stage.StreamUsage` naming their values
        (the drift check's ``prompt_tokens:disagree``)."""
        if self.prompt_reports is None or self.usage is None:
            return self.usage
        return StreamUsage(self.usage, self.prompt_reports)

    def take_body(self, out: EngineOutput, prefill_seconds: str | None) -> None:
        """A whole answer's texts, usage and finish reason; its TTFT is the engine's
        ``x-prefill-seconds`` header when it is a finite number of seconds, at least 0 (an engine
        sending ``inf``, ``nan`` or ``-1`` reports no TTFT)."""
        self.usage, self.finish_reason = out.usage, out.finish_reason
        self.texts = {i: [t] for i, t in out.texts.items()}
        if prefill_seconds:
            try:
                seconds = float(prefill_seconds)
            except ValueError:
                return
            if math.isfinite(seconds) and seconds >= 0:
                self.ttft_seconds = seconds

    def result(self) -> Produced:
        """The frozen record of what was produced so far."""
        return Produced(
            {i: "".join(parts) for i, parts in self.texts.items()},
            self.usage,
            self.finish_reason,
            self.ttft_seconds,
            self.error_code,
            self.sequence_number,
            {i: sum(map(bool, parts)) for i, parts in self.texts.items()},
        )


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def merge_usage(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """Two usage reports of one stream as one: per field, the larger count (an int, not a bool;
    an int wins over any other value); any other field as the later report has it. vLLM's
    continuous usage stats grow chunk by chunk and an engine's final report holds the most, so
    an honest stream is charged its last report; kept last-wins, an engine sending (11, 5) then
    (11, 1) was charged 12. ``new`` itself when no count of ``old`` is larger (the honest case,
    no copy), else a new dict: neither report is changed."""
    for k, v in old.items():
        if _is_count(v):
            n = new.get(k)
            if not _is_count(n) or v > n:
                break
    else:
        return new
    merged = {**old, **new}
    for k, v in old.items():
        if _is_count(v):
            n = new.get(k)
            if not _is_count(n) or v > n:
                merged[k] = v
    return merged


#: events of one upstream read relayed in one event-loop turn (:func:`_relay_read`)
EVENTS_PER_TURN = 256


@dataclass(frozen=True, slots=True)
class StreamOptions:
    """One stream's settings: ``max_event_bytes`` (``gateway.max_sse_event_bytes``, also the
    hold-back bound); ``strip_usage`` (the request's ``forward.strip_usage``); the large-body
    ``budget`` spent for ``tenant_id`` while huge events are read (``None``: none);
    ``request_id`` for the log; ``strict``: the tenant's verification is strict (an engine's error
    event is replaced by the gateway's, without the engine's text:
    :func:`verifier.engine_response.strict_view`); ``choices``: the choices the request asked
    for (prompts x ``n``), each of which must finish in a protocol whose choices finish one by one
    (and whose ``index`` must name one of them: :func:`odd_choice_index`); ``prompts``: the
    request's prompts (with several, usage reports that disagree on ``prompt_tokens`` are not
    handed on as disagreeing: vLLM's continuous usage stats give each prompt's own count, then
    their sum, ``vllm/entrypoints/openai/serving_completion.py``, ``completion_stream_generator``);
    ``model``: the model name forwarded (what an engine echoes: metadata whatever its spelling,
    :class:`verifier.engine_response.StreamMeta`); ``engine``: the upstream's ``engine`` (for
    one of :data:`NAMES_ONLY_PROTOCOL_FIELDS`, key names of the first event that name no field
    of the protocol are text, as a later event's are)."""

    max_event_bytes: int
    strip_usage: bool
    budget: BodyBudget | None
    tenant_id: str
    request_id: str
    strict: bool = False
    choices: int = 1
    prompts: int = 1
    model: str = ""
    engine: str = "openai"


#: the upstream ``engine`` kinds whose stream events name only fields of the protocol, the first
#: event's included (:data:`verifier.engine_response.KEY_NAMES`, ``RESPONSE_KEY_NAMES``): vLLM's
#: ``ChatCompletionStreamResponse`` (``vllm/entrypoints/openai/chat_completion/protocol.py``; its
#: first chunk's ``prompt_text`` needs ``return_prompt_text``, which the gateway does not
#: forward), SGLang's (``python/sglang/srt/entrypoints/openai/protocol.py``) and the bundled
#: backend's (``gpu_backend/openai_api.py``, ``chunk``). An OpenAI-compatible server (``openai``)
#: may name fields of its own in its first event: those names are metadata up to
#: :data:`verifier.engine_response.META_MAX_CHARS` characters (as text they would hold its
#: honest strict streams to their end).
NAMES_ONLY_PROTOCOL_FIELDS = frozenset({"vllm", "sglang", "kvgate"})


class HoldBack:
    """The events of a stream held back until its response starts (so that an engine error
    before any content is answered with the engine's own status), at most ``limit`` bytes: an
    engine that sends only events without content cannot make the gateway hold them without
    bound, and past the limit the response starts anyway. ``started``: the response has started
    (the relay yields its ``(b"", True)`` marker when it starts it); ``held``: the events held."""

    __slots__ = ("held", "limit", "size", "started")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held: list[bytes] = []
        self.size = 0
        self.started = False

    def offer(self, out: list[bytes]) -> list[Chunk]:
        """What to yield for the events ``out`` of one read: nothing while they are held, the
        start marker and everything held once the limit is passed, or the held events and
        ``out`` together once started."""
        if not out:
            return []
        if not self.started:
            self.held.extend(out)
            self.size += sum(map(len, out))
            if self.size <= self.limit:
                return []
            self.started = True
            held, self.held = self.held, []
            return [(b"", True), (b"".join(held), True)]
        held, self.held = self.held, []
        return [(b"".join(held + out) if held else b"".join(out), True)]


class _Events:
    """One stream's per-event steps: read, count, strip (:meth:`_take`), then relay the reads'
    events without a guard (:meth:`take`, no await per event) or through it (:meth:`feed`)."""

    __slots__ = (
        "choices",
        "done",
        "errored",
        "etype",
        "guard",
        "hold",
        "meta",
        "one_prompt",
        "protocol",
        "raw",
        "read",
        "streamed",
        "strict",
        "strip",
        "tally",
        "too_large",
    )

    def __init__(self, protocol: StreamProtocol, guard: ResponseGuard | None, tally: Tally, opts: StreamOptions):
        self.protocol = protocol
        self.guard = guard
        self.tally = tally
        self.hold = HoldBack(opts.max_event_bytes)
        self.strip = protocol.strips_usage and opts.strip_usage
        self.strict = opts.strict
        self.choices = opts.choices if protocol.finishes_per_choice else 0  # each must finish
        self.one_prompt = opts.prompts == 1
        self.read: Callable[[bytes], StreamEvent] = protocol.read
        if protocol is CHAT_SSE:  # a chunk with a choice or tool-call index clients group apart is refused
            self.read = partial(inspect, odd=lambda obj: odd_chunk_index(obj.get("choices"), self.choices))
        elif protocol is RESPONSES_SSE:  # a text event whose indexes clients group apart is refused
            self.read = partial(read_response_event, odd=self._odd_response)
        self.streamed: dict[str, list[str]] = {}  # text stream key -> its deltas (what a snapshot must repeat)
        first_key_chars = 0 if opts.engine in NAMES_ONLY_PROTOCOL_FIELDS else META_MAX_CHARS
        self.meta = StreamMeta(opts.model, first_key_chars)  # the events' metadata as first sent (a change: text)
        self.done = False  # the protocol's end marker came
        self.errored = False  # an engine error event came (after the response started)
        self.raw = b""  # the bytes to relay of the event :meth:`_take` returned
        self.etype: bytes | None = None  # the ``type`` of the event's data (Responses), read by :meth:`_take`
        self.too_large: SSEEventTooLarge | None = None  # what ends the stream after this read

    def _take(self, raw: bytes, out: list[bytes]) -> StreamEvent | None:
        """Read and count one event; the event to relay (its bytes in :attr:`raw`), or ``None``
        when nothing more is to be done with it (the end marker, a replaced error event, a
        stripped usage chunk). Raises :func:`unsplittable_event` for bytes a client would read
        as several events (:func:`gateway.relay.sse.is_one_event`), :func:`lenient_json_event`
        for JSON only a client's laxer reader reads (:func:`gateway.relay.sse.lenient_reads`),
        :func:`not_json_event` for data no JSON reader takes (:func:`gateway.relay.sse.unparsed`),
        :func:`odd_index_event`, :func:`odd_tool_index_event` or :func:`odd_output_index_event` for
        an index clients group apart from the verifier (:data:`REFUSED_EVENTS`), and
        :func:`odd_event_type_event` for an ``event:`` field other than the data's ``type``. A
        comment's text and ``id:`` / ``retry:`` / other fields' lines are relayed as bare comments
        (:func:`gateway.relay.sse.relayed_fields`)."""
        try:
            raw, names = relayed_fields(raw)
        except SeveralEvents:
            raise unsplittable_event() from None
        if names:
            self.etype = None  # set by the read when the data is an object with a string ``type``
        ev = self.read(raw)
        kind = ev.kind
        if kind == "done":
            self.done = True
            return None
        refused = REFUSED_EVENTS.get(kind)
        if refused is not None:
            raise refused()
        if names and (len(names) > 1 or names[0] != self.etype):
            self._check_types(names)
        self.tally.add(ev)
        if kind == "error":
            raw = self._engine_error(ev, raw)
        elif self.strip and kind == "chunk":
            if ev.usage_only:
                return None
            raw = strip_usage_null(raw)
        self.raw = raw
        return ev

    def _check_types(self, names: tuple[bytes, ...]) -> None:
        """Raise :func:`odd_event_type_event` when one of an event's ``event:`` values ``names``
        is neither empty nor its data's ``type`` (:attr:`etype`; ``None`` in chat/completions)."""
        etype = self.etype
        for name in names:
            if name and name != etype:
                raise odd_event_type_event()

    def _odd_response(self, obj: dict[str, Any]) -> str | None:
        """The ``odd`` check of a ``/v1/responses`` event object (:func:`odd_output_index`); notes
        its ``type`` (UTF-8, when a string) in :attr:`etype`, which its ``event:`` field must equal."""
        t = obj.get("type")
        self.etype = t.encode() if type(t) is str else None
        return "odd_output_index" if odd_output_index(obj) else None

    def take(self, events: list[bytes], out: list[bytes]) -> bool:
        """Relay one read's ``events`` into ``out`` without a guard; true when one of them
        started the response (the start marker may follow the read: a later event of the read
        that raises, an unsplittable one, ends the request before the response started)."""
        hold = self.hold
        started = False
        for raw in events:
            ev = self._take(raw, out)
            if ev is None:
                if self.done:
                    break
                continue
            out.append(self.raw)
            if not hold.started and ev.starts:
                hold.started = started = True
        return started

    async def feed(self, events: list[bytes], out: list[bytes]) -> AsyncGenerator[Chunk, None]:
        """Relay one read's ``events`` through the guard into ``out``, yielding the start
        marker as soon as an event starts the response (the guard may refuse a later one)."""
        guard = self.guard
        assert guard is not None
        for raw in events:
            ev = self._take(raw, out)
            if ev is None:
                if self.done:
                    break
                continue
            out.extend(await guard.feed(ev.text, self.raw, self._pieces(ev)))
            if not self.hold.started and ev.starts:
                self.hold.started = True
                yield b"", True  # the response starts now, even when the guard holds every event back

    def _engine_error(self, ev: StreamEvent, raw: bytes) -> bytes:
        """An engine error event: raised before the response started; after it, counted, and the
        bytes to relay in its place, in order with the events around it (through the guard's
        hold-back when there is one): the gateway's error event where the protocol replaces the
        engine's, or under strict verification (without the engine's text); else ``raw``."""
        err = engine_error(200, {"error": ev.error or {}})
        if not self.hold.started:
            raise err
        if self.strict:
            err = strict_view(err)
        self.errored = True
        self.tally.error_code = err.code
        if self.protocol.replaces_error_events or self.strict:
            return self.protocol.error_in_place(err, ev.sequence_number)
        return raw

    def _pieces(self, ev: StreamEvent) -> list[tuple[str, str]]:
        """What the guard checks of ``ev``: its text streams, its metadata where it differs from
        the stream's first (or holds a canary), a chat chunk's key name no earlier chunk sent, a
        Responses ``item_id`` that names no item the stream introduced
        (:class:`~verifier.engine_response.StreamMeta`), and (protocols with snapshots) the text it
        repeats where that differs from the deltas streamed under the same key."""
        pieces = list(ev.fields.items())
        if ev.meta:
            self.meta.check(ev.meta, pieces)
        if not self.protocol.checks_snapshots:
            return pieces
        streamed = self.streamed
        for k, t in ev.fields.items():  # every new string, counted text or not
            streamed.setdefault(k, []).append(t)
        for k, t in ev.snapshots.items():
            if t != "".join(streamed.get(k, ())):
                pieces.append((k + ":snapshot", t))
        return pieces


async def _split(opts: StreamOptions, splitter: SSESplitter, step: _Events, chunk: bytes) -> list[bytes]:
    """One upstream read through ``splitter``: the complete events; an
    :class:`gateway.relay.sse.SSEEventTooLarge` that ends the stream is left on ``step`` (the
    events before the too-large one are still relayed). While an unfinished event holds more than
    :data:`gateway.edge.body_budget.FREE_BODY_BYTES`, the read's bytes past them are spent from the
    large-body budget for the request's tenant (the upstream is not read meanwhile): a stream of
    huge events costs the event loop what a large request body does."""
    try:
        events = splitter.feed(chunk)
    except SSEEventTooLarge as e:
        events, step.too_large = e.before, e
    pending, budget = splitter.pending_bytes, opts.budget
    if budget is not None and pending > FREE_BODY_BYTES:
        await budget.take(opts.tenant_id, min(len(chunk), pending - FREE_BODY_BYTES))
    return events


async def relay_stream(
    resp: UpstreamResponse, protocol: StreamProtocol, guard: ResponseGuard | None, tally: Tally, opts: StreamOptions
) -> AsyncGenerator[Chunk, None]:
    """Relay an event stream (module docstring) as :data:`Chunk` items, the last with
    ``more_body`` false; what it produced is counted in ``tally``."""
    splitter = SSESplitter(opts.max_event_bytes)
    step = _Events(protocol, guard, tally, opts)
    hold = step.hold
    try:
        async for chunk in resp.aiter_raw():
            events = await _split(opts, splitter, step, chunk)
            async for piece in _relay_read(step, events):
                yield piece
            if step.done:
                break
            if step.too_large is not None:
                raise step.too_large
        if _ended_early(step, splitter):
            raise RemoteProtocolError("RemoteProtocolError: the engine ended its event stream before its end")
    except UpstreamError:
        if hold.started and hold.held:
            yield b"".join(hold.held), True
        raise
    tail = await _stream_tail(step, b"" if step.done else splitter.tail(), opts.request_id)
    yield b"".join(tail) + protocol.end_marker, False


async def _relay_read(step: _Events, events: list[bytes]) -> AsyncGenerator[Chunk, None]:
    """One read's ``events`` through ``step`` (and its guard), as :data:`Chunk` items, in slices
    of :data:`EVENTS_PER_TURN` with a loop turn between them: a read of many small events (an
    engine's burst, or one sending empty comments) lets other requests run meanwhile. Unsliced,
    one engine's 22 MB of comment events held every other request of the gateway about 0.4 s."""
    for start in range(0, len(events), EVENTS_PER_TURN):
        if start:
            await asyncio.sleep(0)
        out: list[bytes] = []
        part = events[start : start + EVENTS_PER_TURN] if len(events) > EVENTS_PER_TURN else events
        if step.guard is None:
            if step.take(part, out):
                yield b"", True  # the response starts now
        else:
            async for marker in step.feed(part, out):
                yield marker
        for piece in step.hold.offer(out):
            yield piece
        if step.done:
            return


def _ended_early(step: _Events, splitter: SSESplitter) -> bool:
    """The body ended (a clean end of its framing, or the close of a connection that frames it)
    before the stream did: no end marker (``[DONE]``) and no engine error came, and no finish
    reason (a terminal Responses event's), or, in chat and completions, not one for every
    choice asked for (with ``n`` > 1, some choices had finished and others not). A close-framed
    answer whose engine died looks just so; relayed with the gateway's ``[DONE]``, the cut
    answer read as a whole one. A stream that started nothing and left unfinished bytes is
    :func:`unreadable_stream`'s instead."""
    if step.done or step.errored:
        return False
    t = step.tally
    if t.finish_reason is not None and len(t.finished) >= step.choices:
        return False
    return step.hold.started or not splitter.tail().strip()


def unsplittable_event() -> OpenAIError:
    """The 502 ``upstream_unavailable`` that ends a stream holding bytes a client reads as
    several events where the gateway's splitter sees one (:func:`gateway.relay.sse.is_one_event`:
    a blank line made with a bare CR). Relayed, the events inside would reach the client unread by
    the verifier's guard and uncounted by the settle."""
    return OpenAIError(
        502,
        "The upstream engine sent an event stream with bare CR line endings, which the gateway does not relay.",
        code=ErrorCode.UPSTREAM_UNAVAILABLE,
    )


def odd_choice_index(choices: Any, asked: int) -> bool:
    """Whether a chat/completions answer's (or chunk's) ``choices`` hold a choice object whose
    ``index`` is not one of the ``asked`` choices: an integer (an integral float is the same
    number to every client's JSON reader, and to the verifier,
    :func:`verifier.engine_response._index`) from 0 to ``asked - 1``. Not: a string, a bool,
    ``null``, a fraction, absent, negative or past the choices asked for.

    vLLM and SGLang always send it, an int (``index: int``, required, in their
    ``ChatCompletionResponseStreamChoice`` and ``CompletionResponseStreamChoice``:
    ``vllm/entrypoints/openai/protocol.py``, ``python/sglang/srt/entrypoints/openai/protocol.py``;
    vLLM numbers a completions batch's choices ``prompt x n + j``), so only a broken or hostile
    engine sends anything else, and clients group such a choice apart: the openai SDK keeps the
    value unvalidated (``construct``: a missing index reads as ``None``) and its stream helper
    indexes a list with it (``src/openai/lib/streaming/chat/_completions.py``,
    ``_accumulate_chunk``: ``completion_snapshot.choices[choice.index]``: ``True`` is choice 1,
    ``-1`` the last choice; a string, ``None``, ``1.0`` or an index past the choices raises),
    JavaScript's ``choices[true]`` is a property named ``"true"``, not choice 1, and the verifier
    read a non-number at its position and ``-1`` as a choice of its own. An engine could so split
    a text across two streams the verifier reads apart and a client joins (one choice sent as
    ``1`` and ``true``, or ``1`` and ``-1``, by turns). Refused like JSON only a lax reader reads."""
    if type(choices) is not list:
        return False
    return any(type(c) is dict and _odd_choice(c.get("index"), asked) for c in choices)


def _odd_choice(i: Any, asked: int) -> bool:
    """Whether a choice's ``index`` ``i`` is not one of the ``asked`` choices (:func:`odd_choice_index`)."""
    if type(i) is int:
        return not 0 <= i < asked
    return type(i) is not float or not i.is_integer() or not 0 <= i < asked


def odd_chunk_index(choices: Any, asked: int) -> str | None:
    """What a chat/completions chunk's ``choices`` call for: ``odd_index`` when a choice's
    ``index`` is not one of the ``asked`` choices (:func:`odd_choice_index`), ``odd_tool_index``
    when a choice's ``delta.tool_calls`` hold a call whose ``index`` clients group apart
    (:func:`odd_tool_call_index`), else ``None``. An honest chunk costs a type check and a
    comparison per choice, and two lookups."""
    if type(choices) is not list:
        return None
    for c in choices:
        if type(c) is dict:
            i = c.get("index")
            if (type(i) is not int or not 0 <= i < asked) and _odd_choice(i, asked):
                return "odd_index"
            d = c.get("delta")
            if type(d) is dict:
                calls = d.get("tool_calls")
                if type(calls) is list and odd_tool_call_index(calls):
                    return "odd_tool_index"
    return None


#: indexes every JSON reader reads exactly: past them a double (JavaScript's ``JSON.parse``)
#: rounds, so ``2**53`` and ``2**53 + 1`` are one index there and two to the verifier
JSON_SAFE_INDEXES = 2**53


def odd_tool_call_index(calls: list[Any]) -> bool:
    """Whether a streamed chat chunk's ``delta.tool_calls`` hold a call object whose ``index`` is
    not a whole number from 0 to ``2**53 - 1`` (:data:`JSON_SAFE_INDEXES`; an integral float is
    the number it names to every reader and to the verifier,
    :func:`verifier.engine_response._index`): a bool, a string, ``null``, absent, a fraction,
    negative or larger. (A whole answer's calls arrive whole, each its own text to a client, and
    vLLM and OpenAI send them without ``index``: not read there.)

    vLLM and SGLang always stream an int from 0, the call's ordinal (vLLM ``DeltaToolCall``,
    ``index: int``, required: ``vllm/entrypoints/generate/base/protocol.py``, its parsers
    ``index=self.current_tool_id``; SGLang ``ToolCall(index=call_item.tool_index)``:
    ``python/sglang/srt/entrypoints/openai/serving_chat.py``, ``ToolCallItem.tool_index: int``
    from the detector's ``current_tool_id``, ``python/sglang/srt/function_call/``), so only a
    broken or hostile engine sends anything else, and clients group such a call apart from the
    verifier (which read a non-number at the call's position, ``-1`` as a call of its own): the
    openai SDK (3.60) reads an ``Optional`` field in pydantic's lax mode (``src/openai/_models.py``,
    ``construct_type``: ``true`` is 1, ``false`` 0, ``"1"`` 1) and its stream helper accumulates
    the fragments in a list indexed by it (``src/openai/lib/streaming/_deltas.py``,
    ``accumulate_delta``: ``-1`` is the last call; ``null``, absent, a fraction or an index past
    the calls raises), and the JavaScript helper indexes an array with it
    (``src/lib/ChatCompletionStream.ts``: ``tool_calls[index]``, ``"1"`` the same element as
    ``1``). An engine could so split a text across two calls the verifier reads apart and a client
    joins (one call's arguments sent as ``1`` and ``true``, ``"1"`` or ``-1``, by turns)."""
    for tc in calls:
        if type(tc) is dict:
            i = tc.get("index")
            if (type(i) is not int or not 0 <= i < JSON_SAFE_INDEXES) and (
                type(i) is not float or not i.is_integer() or not 0 <= i < JSON_SAFE_INDEXES
            ):
                return True
    return False


_TEXT_INDEXES = (("output_index", "content_index"), ())
_SUMMARY_INDEXES = (("output_index", "summary_index"), ("content_index",))
_ITEM_INDEXES = (("output_index",), ("content_index", "summary_index"))
#: the text delta events of ``/v1/responses`` (:data:`verifier.engine_response.TEXT_DELTA_EVENTS`)
#: -> the index members the event's type has (the openai SDK's types: ``ResponseTextDeltaEvent``
#: ``output_index`` and ``content_index``, ``ResponseReasoningSummaryTextDeltaEvent``
#: ``output_index`` and ``summary_index``, an arguments, input or code delta ``output_index``
#: alone, ``ResponseAudioTranscriptDeltaEvent`` none), and the members the verifier keys the text
#: by that the type does not have (``output_index``; ``content_index``, else ``summary_index``)
RESPONSE_DELTA_INDEXES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "response.output_text.delta": _TEXT_INDEXES,
    "response.refusal.delta": _TEXT_INDEXES,
    "response.reasoning_text.delta": _TEXT_INDEXES,
    "response.reasoning_summary_text.delta": _SUMMARY_INDEXES,
    "response.function_call_arguments.delta": _ITEM_INDEXES,
    "response.custom_tool_call_input.delta": _ITEM_INDEXES,
    "response.mcp_call_arguments.delta": _ITEM_INDEXES,
    "response.code_interpreter_call_code.delta": _ITEM_INDEXES,
    "response.audio.transcript.delta": ((), ("output_index", "content_index", "summary_index")),
}


def odd_output_index(event: dict[str, Any]) -> bool:
    """Whether a ``/v1/responses`` stream event is a text delta (:data:`RESPONSE_DELTA_INDEXES`)
    with an index member of its type that is not an int from 0 to ``2**53 - 1`` (a float, a bool,
    a string, negative, larger: :data:`JSON_SAFE_INDEXES`), or with a member its type does not
    have. One absent or ``null`` is not refused: the verifier reads it as 0 and no client groups
    it with a number (the openai SDK's helper keys an item under ``None`` and cannot index a part
    with it; JavaScript's finds no item or part under it and raises), so the verifier joins more
    than a client there, never less. Any other event is not read here (an event that repeats text is
    checked where its text differs from the deltas under its key, whatever its indexes).

    vLLM and SGLang send each text delta with the int indexes of its type, from 0, and no other
    (vLLM builds the openai types, ``vllm/entrypoints/openai/responses/streaming_events.py``:
    ``ResponseTextDeltaEvent(content_index=state.current_content_index,
    output_index=state.current_output_index, ...)``, an arguments delta with ``output_index`` and
    ``item_id`` alone; SGLang ``python/sglang/srt/entrypoints/openai/serving_responses.py``:
    ``output_index`` with ``content_index``, or ``summary_index`` for a summary, ``output_index``
    alone for arguments and code), so only a broken or hostile engine sends anything else, and
    clients group such a text apart from the verifier, which keyed a text by
    ``output_index`` and ``content_index`` (else ``summary_index``) read as 0 unless an int
    (:func:`verifier.engine_response.parse_response_event`): the openai SDK (3.60) reads the event
    in pydantic's lax mode (``1.0``, ``true`` and ``"1"`` are 1) and its stream helper keys output
    items by ``output_index`` in a dict and content parts by ``content_index`` in a list
    (``src/openai/lib/streaming/responses/_responses.py``, ``accumulate_event``: ``-1`` is the
    last part), JavaScript's indexes arrays with them (``src/lib/responses/ResponseStream.ts``:
    ``"1"`` and ``1.0`` are 1), and no client reads a member the type does not have (a
    ``content_index`` on an arguments delta), which the verifier made part of the key. An engine
    could so split a text across streams the verifier reads apart and a client joins (one part's
    text under ``content_index`` ``1`` and ``true``, or one item's under ``output_index`` ``1``
    and ``1.0``, by turns)."""
    etype = event.get("type")
    if type(etype) is not str:
        return False
    members = RESPONSE_DELTA_INDEXES.get(etype)
    if members is None:
        return False
    has, has_not = members
    for m in has:
        v = event.get(m)
        if v is not None and (type(v) is not int or not 0 <= v < JSON_SAFE_INDEXES):
            return True
    for m in has_not:  # a loop, not any(): no generator per event
        if m in event:
            return True
    return False


def odd_index_event() -> OpenAIError:
    """The 502 ``upstream_unavailable`` that ends a stream (or answers a whole answer) holding a
    choice whose ``index`` clients group apart (:func:`odd_choice_index`)."""
    return OpenAIError(
        502,
        "The upstream engine sent a choice whose index is not one of the choices asked for "
        "(not an integer, absent, negative or too large), which the gateway does not relay.",
        code=ErrorCode.UPSTREAM_UNAVAILABLE,
    )


def odd_tool_index_event() -> OpenAIError:
    """The 502 ``upstream_unavailable`` that ends a chat stream holding a tool call whose
    ``index`` clients group apart (:func:`odd_tool_call_index`)."""
    return OpenAIError(
        502,
        "The upstream engine sent a tool call whose index is not a whole number from 0 to 2**53 - 1, "
        "which the gateway does not relay.",
        code=ErrorCode.UPSTREAM_UNAVAILABLE,
    )


def odd_output_index_event() -> OpenAIError:
    """The 502 ``upstream_unavailable`` that ends a ``/v1/responses`` stream holding a text event
    whose indexes clients group apart (:func:`odd_output_index`)."""
    return OpenAIError(
        502,
        "The upstream engine sent a Responses text event with an output_index, content_index or "
        "summary_index that is not an integer from 0 to 2**53 - 1, or one its type does not have, "
        "which the gateway does not relay.",
        code=ErrorCode.UPSTREAM_UNAVAILABLE,
    )


def lenient_json_event() -> OpenAIError:
    """The 502 ``upstream_unavailable`` that ends a stream holding an event whose JSON orjson
    refuses and a client reads (:func:`gateway.relay.sse.lenient_reads`: a lone surrogate escape,
    ``NaN``, ``1e999``, an invalid UTF-8 byte, ...). Relayed, its text reached the client unread by
    the verifier's guard and uncounted by the settle; no honest engine writes such JSON."""
    return OpenAIError(
        502,
        "The upstream engine sent a stream event whose JSON the gateway does not read (a lone surrogate, "
        "NaN or Infinity, a number out of range, invalid UTF-8 or nesting too deep), which it does not relay.",
        code=ErrorCode.UPSTREAM_UNAVAILABLE,
    )


def not_json_event() -> OpenAIError:
    """The 502 ``upstream_unavailable`` that ends a stream holding an event whose data no JSON
    reader takes and is not blank (:func:`gateway.relay.sse.unparsed`: plain text, a cut object,
    an object followed by text). A client still receives it (a browser's ``EventSource`` hands it
    to the page, the openai SDK's ``json.JSONDecodeError`` holds it as its ``doc``, the JavaScript
    SDK logs it), while the verifier's guard read nothing in it; no honest engine sends it."""
    return OpenAIError(
        502,
        "The upstream engine sent a stream event whose data is not JSON (plain text, a cut object "
        "or an object followed by text), which the gateway does not relay.",
        code=ErrorCode.UPSTREAM_UNAVAILABLE,
    )


def odd_event_type_event() -> OpenAIError:
    """The 502 ``upstream_unavailable`` that ends a stream holding an event whose ``event:`` field
    (its type to a client: a browser's ``EventSource`` dispatches it under that name, the openai
    SDK reads ``thread.*`` and ``error`` apart) is not empty and not its data's ``type``: any in a
    chat/completions stream, whose data has none. The verifier reads the data, not the field.
    vLLM and SGLang name a ``/v1/responses`` event by its data's ``type``
    (``vllm/entrypoints/openai/responses/api_router.py``, ``_convert_stream_to_sse_events``;
    ``python/sglang/srt/entrypoints/openai/serving_responses.py``, ``_send_event``) and send none
    in chat (SGLang's ``event: sglext_ids`` only when the request carries ``x-sglext-ids-framed:
    1``, a header the gateway never sends upstream), as OpenAI does."""
    return OpenAIError(
        502,
        "The upstream engine sent a stream event whose event field is not the type of its data, "
        "which the gateway does not relay.",
        code=ErrorCode.UPSTREAM_UNAVAILABLE,
    )


#: the kinds of stream events (:attr:`~verifier.engine_response.StreamEvent.kind`) that end a
#: stream as outside the protocol -> the error that ends it
REFUSED_EVENTS: dict[str, Callable[[], OpenAIError]] = {
    "lenient": lenient_json_event,
    "not_json": not_json_event,
    "odd_index": odd_index_event,
    "odd_tool_index": odd_tool_index_event,
    "odd_output_index": odd_output_index_event,
}


def unreadable_stream(unfinished: bytes) -> OpenAIError:
    """The error for a stream that ended before any event could start the response, with bytes
    no terminator ended (``unfinished``): an error object sent as the whole stream is that
    error; anything else (a gzip-encoded stream, CR-only line endings, plain text) is 502
    ``upstream_unavailable``. Relayed as a 200 holding only ``[DONE]``, the engine's error or
    text was lost and the request charged as if answered."""
    try:
        data = orjson.loads(unfinished)
    except orjson.JSONDecodeError:
        data = None
    if isinstance(data, dict) and ("error" in data or data.get("object") == "error"):
        return engine_error(200, data)
    return OpenAIError(
        502,
        "The upstream engine's event stream ended before any event could be read.",
        code=ErrorCode.UPSTREAM_UNAVAILABLE,
    )


async def _stream_tail(step: _Events, unfinished: bytes, request_id: str) -> list[bytes]:
    """The events that end a relayed stream: those still held, then what the guard held back
    (its final checks run: a strict refusal raises :class:`~verifier.stage.ResponseWithheld`); an
    ``unfinished`` event (bytes after the last terminator, once the response has started: before,
    :func:`unreadable_stream` is raised) is logged and dropped."""
    if not step.hold.started and unfinished.strip():
        raise unreadable_stream(unfinished)
    tail = step.hold.held
    if step.guard is not None:
        t = step.tally
        tail += await step.guard.finish_stream(
            usage=t.usage_to_check() if step.one_prompt else t.usage,
            finish_reason=t.finish_reason,
            ttft_seconds=t.ttft_seconds,
        )
    if unfinished.strip():
        log.warning("upstream stream ended inside an event", extra={"fields": {"request_id": request_id}})
    return tail
