"""Bootstrap rooms: how a request is named across the router, the prefill node and the decode node.

The router draws a fresh room per request (:func:`new_room`, a random 63-bit integer, as SGLang's
``bootstrap_room``) and sends it to both nodes. On the decode node a :class:`RoomTable` keeps one
:class:`Room` per live room. The two halves of a request reach decode in either order: the router's
generate call (which reserves pages) and prefill's transfer (which fills them). Whichever arrives
first opens the room; the other finds it. A closed room (released, failed, finished) leaves a
tombstone for ``tombstone_seconds`` so a late transfer or a late reservation for it is refused
instead of reopening it (and a late reservation can never leak pages).
"""

from __future__ import annotations

import asyncio
import enum
import secrets
import time
from dataclasses import dataclass, field
from typing import Any


def new_room() -> int:
    """A fresh bootstrap room: a uniformly random integer in [0, 2**63)."""
    return secrets.randbits(63)


class RoomState(enum.Enum):
    """Lifecycle of a room on the decode node."""

    OPEN = "open"  # known, nothing reserved yet
    RESERVED = "reserved"  # decode holds pages for prompt + max_new_tokens
    LOADED = "loaded"  # a transfer was accepted into the reservation
    DECODING = "decoding"  # generating
    CLOSED = "closed"  # released / finished / failed: terminal


class RoomClosedError(Exception):
    """The room was already closed (released, failed or finished); ``reason`` says why."""

    def __init__(self, room: int, reason: str) -> None:
        super().__init__(f"bootstrap room {room} is closed ({reason})")
        self.room = room
        self.reason = reason


@dataclass(frozen=True)
class Reservation:
    """What a room's generate call reserved: the engine request id, the prompt length decode
    expects to receive and ``max_new_tokens`` (pages are held for their sum), and
    ``prompt_ids_sha256``, the digest of the prompt the router sent (the one a transfer's
    ``prompt_ids_sha256`` must equal; :func:`gpu_backend.transfer.prompt_ids_sha256`)."""

    request_id: str
    prompt_tokens: int
    max_new_tokens: int
    prompt_ids_sha256: str


@dataclass
class RoomTransfer:
    """The transfer a room accepted: its ``manifest``, and ``context_tokens``, the positions decode
    attends over (== received tokens, or the reserved prompt length under the
    ``skip_transfer_check`` fault), set once the pages are loaded (``None`` until then)."""

    manifest: Any
    context_tokens: int | None = None


@dataclass
class RoomSignals:
    """The events a room's waiters wait on: ``reserved`` (pages held), ``loaded`` (a transfer is in
    the reservation), ``closed`` (terminal; wakes every waiter)."""

    reserved: asyncio.Event = field(default_factory=asyncio.Event)
    loaded: asyncio.Event = field(default_factory=asyncio.Event)
    closed: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class Room:
    """One request's state on the decode node: its identity and lifecycle, the reservation (set by
    the generate call), the accepted transfer (set by prefill's push) and the events between them.

    ``error``: why the room closed when it failed (raised to the waiting generate call).
    """

    room: int
    created: float = field(default_factory=time.monotonic)
    state: RoomState = RoomState.OPEN
    reservation: Reservation | None = None
    transfer: RoomTransfer | None = None
    error: BaseException | None = None
    close_reason: str | None = None
    signals: RoomSignals = field(default_factory=RoomSignals)

    async def wait_for(self, event: asyncio.Event, timeout: float) -> bool:
        """Wait until ``event`` is set or the room closes; True if ``event`` is set.
        Raises ``asyncio.TimeoutError`` after ``timeout`` seconds."""
        closed = self.signals.closed
        if event.is_set() or closed.is_set():
            return event.is_set()
        waiters = [asyncio.ensure_future(event.wait()), asyncio.ensure_future(closed.wait())]
        try:
            done, _ = await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()
        if not done:
            raise TimeoutError()
        return event.is_set()


class RoomTable:
    """The decode node's rooms, keyed by room number. Single event loop; not thread-safe."""

    def __init__(self, tombstone_seconds: float = 120.0) -> None:
        self.tombstone_seconds = tombstone_seconds
        self._rooms: dict[int, Room] = {}
        self._tombstones: dict[int, tuple[float, str]] = {}

    def __len__(self) -> int:
        return len(self._rooms)

    def _gc(self, now: float) -> None:
        old = [r for r, (t, _) in self._tombstones.items() if now - t > self.tombstone_seconds]
        for r in old:
            del self._tombstones[r]

    def open(self, room: int) -> Room:
        """The live room ``room``, opened if new. Raises :class:`RoomClosedError` for a tombstone."""
        now = time.monotonic()
        self._gc(now)
        if room in self._tombstones:
            raise RoomClosedError(room, self._tombstones[room][1])
        r = self._rooms.get(room)
        if r is None:
            r = self._rooms[room] = Room(room)
        return r

    def get(self, room: int) -> Room | None:
        """The live room, or None (unknown or closed)."""
        return self._rooms.get(room)

    def close(self, room: int, reason: str, error: BaseException | None = None) -> Room | None:
        """Close ``room`` (idempotent): tombstone it, record ``error`` and wake every waiter.
        Returns the room that was live, if any."""
        r = self._rooms.pop(room, None)
        self._tombstones.setdefault(room, (time.monotonic(), reason))
        if r is not None:
            if r.error is None and error is not None:
                r.error = error
            r.close_reason = reason
            r.state = RoomState.CLOSED
            r.signals.closed.set()
        return r

    def live_rooms(self) -> list[Room]:
        """Rooms not yet closed (for stats and tests)."""
        return list(self._rooms.values())
