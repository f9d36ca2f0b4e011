"""The decode node: reserves pages per bootstrap room, accepts a transfer only when it matches the
reservation (docs/design.md invariant 2), then generates over the received KV.

A room's life (see :mod:`gpu_backend.bootstrap`): the router's generate call reserves
``prompt_tokens + max_new_tokens``, ``max_new_tokens`` first clamped to what the engine can produce
(:meth:`Engine.max_new_tokens_for`, the clamp decode applies too), waiting while the pool is
momentarily full (503 ``pool_exhausted`` after the engine's timeout, at once when the whole pool is
too small; never a 400), and waits up to ``transfer_timeout_seconds`` for prefill's pages. A
transfer whose ``first_token_id`` is outside the vocabulary, or whose pages have another geometry
than this pool's (layers, page size, KV heads, head dim), is refused (400 ``invalid_transfer``,
:class:`InvalidTransferError`) before its room is touched. A transfer that was not prefilled for
this room's request over this room's prompt fails the room with :class:`TransferMismatchError`
(500 ``transfer_mismatch``, counted in ``transfer_mismatches``): the reservation is freed and
nothing is generated. Its manifest names another request id; or its ``prompt_ids_sha256`` (the
digest of the ids prefill ran over) differs from the digest of the prompt the router's generate
call sent, for a transfer of the reserved length: both whatever the faults; or its ``num_tokens``
differs from the reserved prompt length, which the test-only fault ``skip_transfer_check`` accepts:
decode then attends over every reserved prompt position, as in the incident. Every exit path
(finish, abort, release, timeout, client gone) frees the reservation.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import orjson
import torch

from config.errors import ErrorCode
from gpu_backend.bootstrap import Reservation, Room, RoomClosedError, RoomState, RoomTable, RoomTransfer
from gpu_backend.bridge import emitter, future_setter, one_reply, queue_tokens
from gpu_backend.engine import Engine
from gpu_backend.errors import EngineError, InvalidRequestError, RequestAbortedError, TransferMismatchError
from gpu_backend.faults import NO_FAULTS, Faults
from gpu_backend.kv_pool import PageHandle
from gpu_backend.messages import LoadPages, Reserve, StartDecode
from gpu_backend.node_errors import backend_error
from gpu_backend.replies import Failed, Loaded, PagesGranted, Reply
from gpu_backend.sampling import SamplingParams, sampling_params
from gpu_backend.sequence import PageReservation
from gpu_backend.transfer import Manifest, prompt_ids_sha256, verify_pages
from gpu_backend.wire import Token, engine_request_id

log = logging.getLogger("gpu_backend.decode")


class TransferTimeoutError(EngineError):
    """504 ``upstream_timeout``: prefill's pages did not arrive within ``transfer_timeout_seconds``
    (or no reservation appeared for a transfer); the room is released."""

    status = 504
    code = ErrorCode.UPSTREAM_TIMEOUT


class RoomGoneError(EngineError):
    """410 ``room_closed``: a transfer or generate call for a room that was already released,
    finished or failed (e.g. the router released it after a client disconnect)."""

    status = 410
    code = ErrorCode.ROOM_CLOSED


class InvalidTransferError(EngineError):
    """400 ``invalid_transfer``: a well-formed transfer whose content decode cannot use (a
    ``first_token_id`` outside the vocabulary, pages of another geometry than this pool's);
    refused like a malformed payload, no room touched."""

    status = 400
    code = ErrorCode.INVALID_TRANSFER


class DuplicateTransferError(EngineError):
    """409 ``duplicate_transfer``: a second transfer for a room that already received one."""

    status = 409
    code = ErrorCode.DUPLICATE_TRANSFER


async def reserve_pages(engine: Engine, request_id: str, prompt_tokens: int, max_new_tokens: int) -> list[PageHandle]:
    """Reserve ceil((prompt_tokens + max_new_tokens) / page_size) pages for ``request_id``; returns
    their handles. Waits (in arrival order) while the pool is full; :class:`PoolExhaustedError`
    (503) after ``pool_wait_timeout_seconds``, at once when they exceed the whole pool; never a
    400. :class:`InvalidRequestError` (400) for a live id or non-positive sizes; 503 when the
    engine is not running. Cancelling frees them."""
    if prompt_tokens < 1 or max_new_tokens < 1:
        raise InvalidRequestError("prompt_tokens and max_new_tokens must be >= 1", request_id=request_id)
    fut: asyncio.Future[PagesGranted | Failed] = asyncio.get_running_loop().create_future()
    res = PageReservation(request_id, engine.pool.pages_for(prompt_tokens + max_new_tokens), future_setter(fut))
    engine.register(res)
    engine.submit(Reserve(res))
    match await one_reply(fut, lambda: engine.abort(request_id, res)):
        case PagesGranted(pages=pages):
            return pages
        case Failed(error=error):
            raise error


async def load_pages(engine: Engine, request_id: str, kv: torch.Tensor, num_tokens: int) -> None:
    """Write received pages into the reservation, page i into handle i (on the worker thread).
    ``kv``: [n, num_layers, 2, page_size, num_kv_heads, head_dim] (any device/dtype; cast to the
    pool's). Raises ``KeyError`` for an unknown reservation, ``ValueError`` for a shape that does not
    fit (more pages than reserved, wrong dims, ``num_tokens > n * page_size``),
    :class:`StaleHandleError` through a stale handle."""
    fut: asyncio.Future[Loaded | Failed] = asyncio.get_running_loop().create_future()
    engine.submit(LoadPages(request_id, kv, num_tokens, future_setter(fut)))
    match await one_reply(fut):
        case Failed(error=error):
            raise error
        case Loaded():
            return


async def decode_reserved(
    engine: Engine,
    request_id: str,
    prompt_ids: list[int],
    first_token_id: int,
    params: SamplingParams,
    context_tokens: int,
) -> AsyncGenerator[Token, None]:
    """Generate from a reservation whose first ``context_tokens`` positions hold the prompt's KV.

    Yields the token of ``first_token_id`` first (completion_tokens 1; it may already finish the
    request: EOS, stop, max_new_tokens 1), then one per decoded token; decode step j feeds the
    previous token at position ``context_tokens + j - 1`` and attends over positions
    ``0 .. context_tokens + j - 1`` of the reservation's pages. ``prompt_tokens`` of the tokens is
    ``len(prompt_ids)``. The reservation is freed when finished or aborted (also when the iterator is
    closed early). Raises (on the first ``__anext__``, the reservation then freed) ``KeyError`` for
    an unknown reservation, :class:`InvalidRequestError` for bad params or when ``context_tokens +
    max_new_tokens`` exceeds it, :class:`StaleHandleError` for a stale handle (unless ``no_scrub``),
    and :class:`TransferMismatchError` when ``context_tokens`` differs from the ``num_tokens`` given
    to :func:`load_pages` (invariant 2 held by the engine too; lifted by ``skip_transfer_check``).
    """
    res = engine.requests.live.get(request_id)  # the reservation this call decodes from
    res = res if isinstance(res, PageReservation) else None
    try:
        params.validate()
    except InvalidRequestError:
        if res is not None:
            engine.abort(request_id, res)
        raise
    params = params.clamped(engine.max_new_tokens_for(context_tokens))
    queue: asyncio.Queue[Reply] = asyncio.Queue()
    msg = StartDecode(
        request_id, list(prompt_ids), first_token_id, params, context_tokens, engine.sample_seed(params), emitter(queue)
    )
    engine.submit(msg)

    def leave() -> None:
        """Abort this call's request only: its reservation, or the sequence the worker made of it
        (which answers to ``msg.emit``); once it retired, a later request may hold the id."""
        live = engine.requests.live.get(request_id)
        if live is not None and (live is res or getattr(live, "emit", None) is msg.emit):
            engine.abort(request_id, live)

    async with contextlib.aclosing(queue_tokens(queue, leave)) as tokens:
        async for tok in tokens:
            yield tok


class DecodeNode:
    """Wraps a decode-side :class:`Engine` with the room table and the transfer check.

    ``faults``: the process's :class:`~gpu_backend.faults.Faults` (only ``skip_transfer_check``
    matters here; ``no_scrub`` is the engine's). ``transfer_timeout_seconds``: how long a
    reservation waits for its pages; a transfer waits for its reservation that long plus the
    engine's ``pool_wait_timeout_seconds`` (the reservation itself may be waiting for pages).
    """

    def __init__(self, engine: Engine, *, faults: Faults = NO_FAULTS, transfer_timeout_seconds: float = 30.0) -> None:
        self.engine = engine
        self.skip_transfer_check = faults.skip_transfer_check
        self.transfer_timeout = transfer_timeout_seconds
        self.reservation_wait = transfer_timeout_seconds + float(engine.cfg.pool_wait_timeout_seconds)
        self.rooms = RoomTable(tombstone_seconds=max(120.0, 4 * transfer_timeout_seconds))
        self.counters = {
            "transfers_accepted": 0,
            "transfers_refused": 0,
            "transfer_mismatches": 0,
            "transfer_timeouts": 0,
            "released": 0,
        }

    def server_info(self) -> dict[str, Any]:
        """The engine's SGLang fields with ``disaggregation_mode`` ``"decode"`` and live room count."""
        info = dict(self.engine.server_info())
        info["disaggregation_mode"] = "decode"
        info["live_rooms"] = len(self.rooms)
        return info

    async def generate(
        self, room: int, request_id: str, prompt_ids: list[int], params: dict[str, Any]
    ) -> AsyncGenerator[Token, None]:
        """Reserve (prompt + ``max_new_tokens`` clamped as decode will clamp it), wait for the
        transfer, then yield the engine's :class:`Token` s.

        Raises :class:`PoolExhaustedError` (503), :class:`TransferMismatchError` (500),
        :class:`TransferTimeoutError` (504), :class:`RoomGoneError` (410) or
        :class:`RequestAbortedError` (499, released meanwhile) before the first event.
        """
        sp = sampling_params(params)
        if not prompt_ids:
            raise InvalidRequestError("prompt_ids must not be empty", param="prompt")
        try:
            digest = prompt_ids_sha256(prompt_ids)  # what the room's transfer must have prefilled
        except struct.error:
            raise InvalidRequestError("prompt_ids must be integer token ids", param="prompt") from None
        r = self._room_for_generate(room)
        rid = engine_request_id(request_id, room)
        # decode clamps to the same limit over context == prompt tokens (_context_tokens); >= 1 as before
        new = max(1, min(sp.max_new_tokens, self.engine.max_new_tokens_for(len(prompt_ids))))
        r.reservation = Reservation(rid, len(prompt_ids), new, digest)
        reserve = asyncio.ensure_future(reserve_pages(self.engine, rid, len(prompt_ids), new))
        reason = "finished"
        try:
            await self._reserved(r, room, reserve)
            first_token_id, context = await self._transferred(r, room)
            events = decode_reserved(self.engine, rid, prompt_ids, first_token_id, sp, context)
            async with contextlib.aclosing(events) as evs:
                async for ev in evs:
                    yield ev
                    if ev.finished:
                        return
        except BaseException as e:
            reason = f"failed: {type(e).__name__}"
            raise
        finally:
            reserve.cancel()  # a reservation still waiting is aborted (the worker frees it in order)
            self.engine.abort(rid)
            self.rooms.close(room, reason)

    def _room_for_generate(self, room: int) -> Room:
        """The open room for a generate call: 410 when it is closed, 400 when it already has one."""
        try:
            r = self.rooms.open(room)
        except RoomClosedError as e:
            raise RoomGoneError(str(e)) from None
        if r.reservation is not None:
            raise InvalidRequestError(f"room {room} already has a generate call", param="room")
        return r

    async def _reserved(self, r: Room, room: int, reserve: asyncio.Future[list[PageHandle]]) -> None:
        """Wait for the pages or the room's close, whichever first; then mark the room reserved.
        Raises the room's error (or 499) when it closed, the reservation's error when it failed."""
        closed = asyncio.ensure_future(r.signals.closed.wait())
        try:
            waiting: set[asyncio.Future[Any]] = {reserve, closed}
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        finally:
            closed.cancel()
        if not reserve.done():
            raise r.error or RequestAbortedError(f"room {room} was released while reserving")
        reserve.result()  # PoolExhaustedError / InvalidRequestError propagate
        if r.signals.closed.is_set():
            raise r.error or RequestAbortedError(f"room {room} was released")
        r.state = RoomState.RESERVED
        r.signals.reserved.set()

    async def _transferred(self, r: Room, room: int) -> tuple[int, int]:
        """Wait up to ``transfer_timeout_seconds`` for the room's pages to be loaded (504 after it;
        the room's error, or 499, when it closed meanwhile); then mark the room decoding. Returns
        the transfer's first token id and the context tokens decode attends over."""
        try:
            loaded = await r.wait_for(r.signals.loaded, self.transfer_timeout)
        except TimeoutError:
            self.counters["transfer_timeouts"] += 1
            raise TransferTimeoutError(
                f"no KV transfer arrived for room {room} within {self.transfer_timeout:g} s"
            ) from None
        if not loaded:
            raise r.error or RequestAbortedError(f"room {room} was released")
        r.state = RoomState.DECODING
        t = r.transfer
        assert t is not None and t.context_tokens is not None  # loaded implies a loaded transfer
        return t.manifest.first_token_id, t.context_tokens

    async def accept_transfer(self, manifest: Manifest, kv: torch.Tensor, *, verified: bool = False) -> int:
        """Accept prefill's pages for ``manifest.room``; returns the context tokens decode will
        attend over. Waits up to ``transfer_timeout_seconds`` for the reservation.

        ``verified``: the payload's checksums were already checked (HTTP path); otherwise they are
        checked here. Idempotent: the same manifest again gets the first call's answer. Raises
        :class:`RoomGoneError` (410), :class:`DuplicateTransferError` (409, a different transfer),
        :class:`TransferMismatchError` (500; the room fails and its pages are freed),
        :class:`TransferTimeoutError` (504), ``TransferFormatError`` (400),
        :class:`InvalidTransferError` (400; ``first_token_id`` not in ``0 .. vocab_size - 1``, or
        pages of another geometry than this pool's).
        """
        if not verified:
            verify_pages(manifest, kv)
        refusal = self._unusable(manifest)
        if refusal is not None:
            self.counters["transfers_refused"] += 1
            raise InvalidTransferError(refusal)
        r = self._room_for_transfer(manifest.room)
        if r.transfer is not None:
            return await self._repeated_transfer(r, manifest)
        transfer = r.transfer = RoomTransfer(manifest)
        res = await self._reservation(r, manifest.room)
        context = self._context_tokens(r, res, manifest)
        try:
            await load_pages(self.engine, res.request_id, kv, manifest.num_tokens)
        except Exception as e:
            self._fail(manifest.room, r, "load_pages failed", e)
            raise
        if r.signals.closed.is_set():  # released while loading: the abort behind the load freed the pages
            self.counters["transfers_refused"] += 1
            raise RoomGoneError(f"bootstrap room {manifest.room} is closed ({r.close_reason})")
        transfer.context_tokens = context
        r.state = RoomState.LOADED
        r.signals.loaded.set()
        self.counters["transfers_accepted"] += 1
        return context

    def _unusable(self, manifest: Manifest) -> str | None:
        """Why a well-formed transfer cannot be used here, or ``None``: a ``first_token_id``
        outside the vocabulary, or pages of another geometry than this pool's (a peer with another
        model or page size)."""
        pool, vocab = self.engine.pool, self.engine.vocab_size
        if not 0 <= manifest.first_token_id < vocab:
            return (
                f"transfer for room {manifest.room} has first_token_id {manifest.first_token_id}, "
                f"outside the vocabulary (0 .. {vocab - 1})"
            )
        page = [pool.num_layers, 2, pool.page_size, pool.num_kv_heads, pool.head_dim]
        if manifest.shape[1:] != page:
            shape = manifest.shape[1:]
            return f"transfer for room {manifest.room} has pages of shape {shape}; this node's pages are {page}"
        return None

    def _room_for_transfer(self, room: int) -> Room:
        """The open room for a transfer; 410 (counted as refused) when it is closed."""
        try:
            return self.rooms.open(room)
        except RoomClosedError as e:
            self.counters["transfers_refused"] += 1
            raise RoomGoneError(str(e)) from None

    async def _repeated_transfer(self, r: Room, manifest: Manifest) -> int:
        """A room that already has a transfer: the same manifest again (prefill retrying a lost
        connection) gets the first one's context tokens once loaded, else 410; a different one 409."""
        assert r.transfer is not None
        if r.transfer.manifest != manifest:
            self.counters["transfers_refused"] += 1
            raise DuplicateTransferError(f"room {manifest.room} already received a different transfer")
        try:
            if await r.wait_for(r.signals.loaded, self.reservation_wait):
                assert r.transfer.context_tokens is not None  # set before loaded
                return r.transfer.context_tokens
        except TimeoutError:
            pass
        raise RoomGoneError(f"bootstrap room {manifest.room} is closed ({r.close_reason})")

    async def _reservation(self, r: Room, room: int) -> Reservation:
        """The room's reservation once its generate call has reserved pages: 504 (the room failed)
        when none appears within the reservation wait, 410 when the room closed meanwhile."""
        try:
            reserved = await r.wait_for(r.signals.reserved, self.reservation_wait)
        except TimeoutError:
            self.counters["transfer_timeouts"] += 1
            err = TransferTimeoutError(f"no reservation for room {room} within {self.reservation_wait:g} s")
            self._fail(room, r, "transfer without reservation", err)
            raise err from None
        if not reserved:
            self.counters["transfers_refused"] += 1
            raise RoomGoneError(f"bootstrap room {room} is closed ({r.close_reason})")
        assert r.reservation is not None  # reserved implies a reservation
        return r.reservation

    def _context_tokens(self, r: Room, res: Reservation, manifest: Manifest) -> int:
        """The positions decode attends over: the transfer's ``num_tokens`` when it matches the
        reserved prompt length. A mismatch fails the room (500) unless ``skip_transfer_check``,
        under which decode attends over every reserved prompt position. A transfer built for
        another request (its ``request_id`` is not the room's), or one of the reserved length
        prefilled over other token ids (its ``prompt_ids_sha256`` is not the room's prompt's),
        fails the room (500) whatever the faults: its pages hold another prompt's KV."""
        room = manifest.room
        if engine_request_id(manifest.request_id, room) != res.request_id:
            own = res.request_id.rsplit("@", 1)[0]
            raise self._mismatch(
                r,
                "transfer for another request",
                f"transfer for room {room} was built for request {manifest.request_id!r}, "
                f"the room's request is {own!r}",
            )
        if manifest.num_tokens == res.prompt_tokens:
            if manifest.prompt_ids_sha256 != res.prompt_ids_sha256:
                # the digests go to the log only: the client's error must not carry another prompt's digest
                log.warning(
                    "room %d: transfer prefilled over prompt sha256 %s, the room's prompt is sha256 %s",
                    room,
                    manifest.prompt_ids_sha256,
                    res.prompt_ids_sha256,
                )
                raise self._mismatch(
                    r,
                    "transfer of another prompt",
                    f"transfer for room {room} was prefilled over other token ids than the room's "
                    f"{res.prompt_tokens}-token prompt (the prompt digests differ); the request is aborted and "
                    "nothing is generated",
                )
            return manifest.num_tokens
        if not self.skip_transfer_check:
            raise self._mismatch(
                r,
                "transfer mismatch",
                f"decode reserved {res.prompt_tokens} prompt tokens for room {room} but the transfer "
                f"holds {manifest.num_tokens}; the request is aborted and nothing is generated",
            )
        self.counters["transfer_mismatches"] += 1
        log.warning(
            "fault skip_transfer_check: room %d accepted %d of %d tokens; decode attends over all "
            "%d reserved positions",
            manifest.room,
            manifest.num_tokens,
            res.prompt_tokens,
            res.prompt_tokens,
        )
        return res.prompt_tokens

    def _mismatch(self, r: Room, reason: str, message: str) -> TransferMismatchError:
        """Count a transfer mismatch and fail room ``r`` with it (its pages freed); returns the
        :class:`TransferMismatchError` (500 ``transfer_mismatch``) to raise."""
        self.counters["transfer_mismatches"] += 1
        mismatch = TransferMismatchError(message)
        self._fail(r.room, r, reason, mismatch)
        return mismatch

    def _fail(self, room: int, r: Room, reason: str, err: BaseException) -> None:
        self.rooms.close(room, reason, err)
        if r.reservation is not None:
            self.engine.abort(r.reservation.request_id)

    def release(self, room: int) -> bool:
        """Release ``room`` (router: prefill rejected it, the client left, an abort): frees the
        reservation or aborts the running decode; later transfers for it are refused. Idempotent;
        True if the room was live."""
        r = self.rooms.close(room, "released", RequestAbortedError(f"room {room} was released"))
        if r is None:
            return False
        self.counters["released"] += 1
        if r.reservation is not None:
            self.engine.abort(r.reservation.request_id)
        return True


def event_line(tok: Token) -> bytes:
    """One NDJSON line of the decode stream for a token (:meth:`Token.to_json`)."""
    return orjson.dumps(tok.to_json()) + b"\n"


def error_line(exc: BaseException) -> bytes:
    """The in-band error line of the decode stream: the OpenAI body plus ``status``."""
    err = backend_error(exc)
    return orjson.dumps({**err.body(), "status": err.status}) + b"\n"


class DecodeStream:
    """One room's generation, decoupled from the HTTP response that carries it (decode node over
    HTTP). A pump task runs :meth:`DecodeNode.generate` and records NDJSON lines; any number of
    followers read them from an index. So a router whose connection was lost re-attaches with the
    count of lines it already has and loses nothing. With no follower for ``grace_seconds`` the
    pump is cancelled, which releases the room (the router normally releases it at once)."""

    def __init__(
        self,
        node: DecodeNode,
        room: int,
        request_id: str,
        prompt_ids: list[int],
        params: dict[str, Any],
        grace_seconds: float,
    ) -> None:
        self.room = room
        self.lines: list[bytes] = []
        self.done = False
        self.finished_at: float | None = None
        self.followers = 0
        self.grace = grace_seconds
        self._changed = asyncio.Event()
        self._gen = node.generate(room, request_id, prompt_ids, params)
        self.task = asyncio.ensure_future(self._pump())
        # a follower that never starts reading does not count: check once the grace period is over
        asyncio.get_running_loop().call_later(self.grace, self._orphan_check)

    async def _pump(self) -> None:
        try:
            async with contextlib.aclosing(self._gen) as evs:
                async for ev in evs:
                    self._add(event_line(ev))
        except asyncio.CancelledError:
            self._add(error_line(RequestAbortedError(f"room {self.room}: no reader left")))
        except Exception as e:  # reported in band
            self._add(error_line(e))
        finally:
            self.done = True
            self.finished_at = time.monotonic()
            self._changed.set()

    def _add(self, line: bytes) -> None:
        self.lines.append(line)
        self._changed.set()

    async def follow(self, start: int) -> AsyncIterator[bytes]:
        """Lines from index ``start`` on, until the stream ends."""
        self.followers += 1
        i = start
        try:
            while True:
                while i < len(self.lines):
                    yield self.lines[i]
                    i += 1
                if self.done:
                    return
                self._changed.clear()
                if i < len(self.lines) or self.done:
                    continue
                await self._changed.wait()
        finally:
            self.followers -= 1
            if self.followers == 0 and not self.done:
                asyncio.get_running_loop().call_later(self.grace, self._orphan_check)

    def _orphan_check(self) -> None:
        if self.followers == 0 and not self.done:
            self.task.cancel()


class DecodeStreams:
    """The decode node's :class:`DecodeStream` s by room: ``open`` starts one or re-attaches to the
    live one (idempotent per room); finished streams are kept ``keep_seconds`` for late re-attach."""

    def __init__(self, node: DecodeNode, grace_seconds: float = 5.0, keep_seconds: float = 30.0) -> None:
        self.node = node
        self.grace = grace_seconds
        self.keep = keep_seconds
        self._streams: dict[int, DecodeStream] = {}

    def open(
        self, room: int, request_id: str, prompt_ids: list[int], params: dict[str, Any], start: int = 0
    ) -> AsyncIterator[bytes]:
        """Follow room ``room`` from line ``start``, starting its generation if it is new."""
        now = time.monotonic()
        for k in [k for k, s in self._streams.items() if s.done and now - (s.finished_at or now) > self.keep]:
            del self._streams[k]
        s = self._streams.get(room)
        if s is None:
            s = self._streams[room] = DecodeStream(self.node, room, request_id, prompt_ids, params, self.grace)
        return s.follow(start)
