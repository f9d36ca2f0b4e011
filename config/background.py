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


class Repeats:
    """When a loop whose rounds come often reports a fault: a fault of a type not reported in the
    last ``every_s`` seconds at once, else not, counted, and reported with that count once
    ``every_s`` has passed since its type's last report; so a fault that persists in a loop of 10
    rounds a second is one line a minute, not ten tracebacks a second, also when two types take
    turns (a flapping store's refused and timed-out connects). ``every_s=0``: every fault at once.
    ``clock``: monotonic seconds. ``faults``: how many it has seen."""

    def __init__(self, every_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s, self.clock = every_s, clock
        self.faults = 0
        #: per fault type: when it was last reported, and how many like it since
        self._types: dict[str, list[float]] = {}

    def due(self, e: BaseException) -> int | None:
        """``None`` when fault ``e`` is not to be reported now, else how many faults of its type
        were not reported since that type's last report (0 for a type not seen lately)."""
        self.faults += 1
        kind, now = type(e).__name__, self.clock()
        seen = self._types.get(kind)
        if seen is not None and now - seen[0] < self.every_s:
            seen[1] += 1
            return None
        self._types[kind] = [now, 0]
        return int(seen[1]) if seen is not None else 0


def since_text(n: int) -> str:
    """What a report of a fault says of the ``n`` like it not reported (:meth:`Repeats.due`)."""
    return f" ({n} more like it since the last report)" if n else ""


class FaultLog:
    """:func:`one_round`'s ``fault`` for a loop whose rounds come often: :meth:`message` ("<what>
    failed") logged at error with its traceback when :class:`Repeats` says so (default: a new
    type of fault at once, one like it once a minute with a count). ``log``: the logger."""

    def __init__(self, log: logging.Logger, what: str, repeats: Repeats | None = None) -> None:
        self.log, self.what = log, what
        self.repeats = repeats if repeats is not None else Repeats()

    def __call__(self, e: BaseException) -> None:
        since = self.repeats.due(e)
        if since is not None:
            self.log.error("%s%s", self.message(e), since_text(since), exc_info=(type(e), e, e.__traceback__))

    def message(self, e: BaseException) -> str:
        """What the report of fault ``e`` says before its count of those not reported."""
        return f"{self.what} failed"
