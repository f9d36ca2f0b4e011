"""The bridge between the engine's worker thread and asyncio: what the worker calls to hand a typed
reply (:data:`~gpu_backend.replies.Reply`) to the event loop (``loop.call_soon_threadsafe``, never
blocking), and the loop-side readers, which ``match`` on the reply's type."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable
from typing import TypeVar

from gpu_backend.replies import Failed, Reply, unexpected
from gpu_backend.wire import Token

R = TypeVar("R")


def emitter(queue: asyncio.Queue[R]) -> Callable[[R], None]:
    """A reply callable for the worker thread: puts each reply into ``queue`` on the running loop."""
    loop = asyncio.get_running_loop()

    def emit(item: R) -> None:
        with contextlib.suppress(RuntimeError):  # loop closed: nobody is listening any more
            loop.call_soon_threadsafe(queue.put_nowait, item)

    return emit


def future_setter(fut: asyncio.Future[R]) -> Callable[[R], None]:
    """A reply callable for the worker thread that resolves ``fut`` with the first reply (later ones dropped)."""
    loop = fut.get_loop()

    def set_first(item: R) -> None:
        if not fut.done():
            fut.set_result(item)

    def emit(item: R) -> None:
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(set_first, item)

    return emit


async def queue_tokens(queue: asyncio.Queue[Reply], on_leave: Callable[[], None]) -> AsyncGenerator[Token, None]:
    """The :class:`Token` s the worker puts in ``queue`` until the ``finished`` one; a :class:`Failed`
    reply raises its error, any other reply ``TypeError``. Leaving before the end (or on that
    ``TypeError``) calls ``on_leave`` (the request's abort)."""
    done = False
    try:
        while not done:
            match await queue.get():
                case Token() as tok:
                    done = tok.finished
                    yield tok
                case Failed(error=error):
                    done = True  # the worker retired the request already
                    raise error
                case other:
                    raise unexpected(other)
    finally:
        if not done:
            on_leave()


async def one_reply(fut: asyncio.Future[R], on_cancel: Callable[[], None] | None = None) -> R:
    """Await the worker's one reply in ``fut`` (see :func:`future_setter`). Cancelling the await
    calls ``on_cancel`` (the request's abort); the work itself is not cancelled."""
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        if on_cancel is not None:
            on_cancel()
        raise
