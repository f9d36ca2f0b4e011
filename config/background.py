"""What ends a background loop (the pool watcher, the quota stage's rounds, the verifier's
periodic tasks) and what only fails one of its rounds. Shared by the gateway and the verifier."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
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


class FaultLog:
    """The fault handler of a loop whose rounds come often (:func:`one_round`'s ``fault``): a
    fault is logged at error with its traceback when its type is not the last one's, and a fault
    like the last at most once every ``every_s`` seconds, saying how many came since, so a fault
    that persists in a loop of 10 rounds a second is one line a minute, not ten tracebacks a
    second. ``log``: the logger; ``what``: the round, as in "<what> failed"; ``clock``: monotonic
    seconds. ``faults``: how many it was handed in all."""

    def __init__(
        self, log: logging.Logger, what: str, every_s: float = 60.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.log, self.what, self.every_s, self.clock = log, what, every_s, clock
        self.faults = 0
        self._last: str | None = None
        self._logged_at = 0.0
        self._since = 0  # faults like the last not logged since the last line

    def __call__(self, e: BaseException) -> None:
        self.faults += 1
        kind, now = type(e).__name__, self.clock()
        if kind == self._last and now - self._logged_at < self.every_s:
            self._since += 1
            return
        since = f" ({self._since} more like it since the last report)" if kind == self._last and self._since else ""
        self._last, self._logged_at, self._since = kind, now, 0
        self.log.error("%s failed%s", self.what, since, exc_info=(type(e), e, e.__traceback__))
