"""The bridge between the engine's worker thread and asyncio: what the worker calls to hand a result
to the event loop (``loop.call_soon_threadsafe``, never blocking), and the loop-side readers."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable

from gpu_backend.wire import Token


def emitter(queue: asyncio.Queue) -> Callable[[object], None]:
    """An ``emit`` for the worker thread: puts each item into ``queue`` on the running loop."""
    loop = asyncio.get_running_loop()

    def emit(item: object) -> None:
        with contextlib.suppress(RuntimeError):  # loop closed: nobody is listening any more
            loop.call_soon_threadsafe(queue.put_nowait, item)

    return emit


def future_setter(fut: asyncio.Future) -> Callable[[object], None]:
    """An ``emit`` for the worker thread that resolves ``fut`` with the first item (later ones dropped)."""
    loop = fut.get_loop()

    def set_first(item: object) -> None:
        if not fut.done():
            fut.set_result(item)

    def emit(item: object) -> None:
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(set_first, item)

    return emit


async def queue_tokens(queue: asyncio.Queue, on_leave: Callable[[], None]) -> AsyncGenerator[Token, None]:
    """The tokens the worker puts in ``queue`` until the final one; an error item is raised.
    Leaving before the end calls ``on_leave`` (the request's abort)."""
    done = False
    try:
        while not done:
            item = await queue.get()
            done = isinstance(item, BaseException) or item.finished
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        if not done:
            on_leave()


async def one_reply(fut: asyncio.Future, on_cancel: Callable[[], None] | None = None) -> object:
    """Await the worker's one reply in ``fut`` (see :func:`future_setter`); an exception is raised.
    Cancelling the await calls ``on_cancel`` (the request's abort); the work itself is not cancelled."""
    try:
        result = await asyncio.shield(fut)
    except asyncio.CancelledError:
        if on_cancel is not None:
            on_cancel()
        raise
    if isinstance(result, BaseException):
        raise result
    return result
