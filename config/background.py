"""What ends a background loop (the pool watcher, the quota stage's rounds, the verifier's
periodic tasks) and what only fails one of its rounds. Shared by the gateway and the verifier."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator


def stopping(e: BaseException) -> bool:
    """Whether ``e``, raised in a round of a background loop, stops the loop rather than failing
    that round: ``KeyboardInterrupt``, ``SystemExit``, or a ``CancelledError`` while the task is
    being cancelled (its owner's stop or the event loop's shutdown: ``Task.cancelling()``, Python
    3.11). A ``CancelledError`` nobody asked for (a library's stray one) and any other
    ``BaseException`` (a native library's panic, pyo3's ``PanicException``) fail that round."""
    if isinstance(e, asyncio.CancelledError):
        task = asyncio.current_task()
        return task is None or task.cancelling() > 0
    return isinstance(e, (KeyboardInterrupt, SystemExit))


@contextlib.contextmanager
def one_round(fault: Callable[[BaseException], None]) -> Iterator[None]:
    """One round of a background loop: what the body raises ends the loop when it is a stop
    (:func:`stopping`, re-raised); anything else, a ``BaseException`` such as a native panic
    included, is handed to ``fault`` (which counts or logs it) and goes no further, so the loop
    runs its next round. ``with one_round(fault): await poll()``."""
    try:
        yield
    except BaseException as e:
        if stopping(e):
            raise
        fault(e)
