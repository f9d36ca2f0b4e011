"""The index barrier: a response guard whose checks first await the admission ingests that were in
flight when it began (:meth:`verifier.service.VerifierService.start_admit` indexes a prompt while
its request is forwarded), so a check never misses a prompt forwarded before the check began.

- a strict guard's calls await the barrier, then check as before (nothing leaves unchecked);
- a background (sampled, non-strict) guard passes events at once as before; its whole-response
  check is queued once the barrier ended, by a task of its own that the service's drain waits
  for, so neither an ingest's slowness nor its failure holds or fails the response.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from typing import Any

from verifier.guards import BackgroundGuard, StrictGuard


class BarrierGuard:
    """Wraps ``guard`` (:class:`~verifier.stage.ResponseGuard`); ``ingests``: the ingest tasks in
    flight when it began; ``deferred``: the service's set of background checks still waiting for
    their barrier (a task is in it until it queued its check)."""

    def __init__(
        self, guard: BackgroundGuard | StrictGuard, ingests: list[asyncio.Task], deferred: set[asyncio.Task]
    ) -> None:
        self.guard = guard
        self.exchange = guard.exchange
        self._ingests = ingests
        self._deferred = deferred
        self._background = isinstance(guard, BackgroundGuard)

    def _pending(self) -> bool:
        self._ingests = [t for t in self._ingests if not t.done()]
        return bool(self._ingests)

    async def _wait(self) -> None:
        """Until every ingest of the barrier ended (an ingest never raises; awaiting does not
        cancel it when this guard's request is cancelled)."""
        if self._pending():
            await asyncio.wait(self._ingests)
            self._ingests = []

    def _defer(self, check: Coroutine[Any, Any, Any]) -> None:
        async def later() -> None:
            await self._wait()
            await check

        task = asyncio.get_running_loop().create_task(later())
        self._deferred.add(task)
        task.add_done_callback(self._deferred.discard)

    async def feed(
        self, delta_text: str, raw_event: bytes, pieces: Sequence[tuple[str, str]] | None = None
    ) -> list[bytes]:
        if not self._background:
            await self._wait()
        return await self.guard.feed(delta_text, raw_event, pieces)

    async def finish_stream(
        self, *, usage: dict[str, Any] | None, finish_reason: str | None, ttft_seconds: float | None
    ) -> list[bytes]:
        kw: dict[str, Any] = {"usage": usage, "finish_reason": finish_reason, "ttft_seconds": ttft_seconds}
        if self._background and self._pending():
            self._defer(self.guard.finish_stream(**kw))  # holds nothing back: returns []
            return []
        await self._wait()
        return await self.guard.finish_stream(**kw)

    async def check_body(
        self,
        text: str | Sequence[str],
        *,
        usage: dict[str, Any] | None,
        finish_reason: str | None,
        ttft_seconds: float | None,
    ) -> None:
        kw: dict[str, Any] = {"usage": usage, "finish_reason": finish_reason, "ttft_seconds": ttft_seconds}
        if self._background and self._pending():
            self._defer(self.guard.check_body(text, **kw))
            return
        await self._wait()
        await self.guard.check_body(text, **kw)
