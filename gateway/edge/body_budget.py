"""A process-wide budget of large-body bytes per second (``gateway.large_body_bytes_per_second``;
docs/gateway.md, "Client connections"): what request bodies beyond their first
:data:`FREE_BODY_BYTES` may cost the event loop, shared in turn between tenants.

Every byte of a request body goes through the event loop (the transport's read, the HTTP
parser, the ASGI message, :class:`gateway.admission.density.StringDensity`): about 2 ms of it per MB on
the team machine. A client sending large bodies back to back, each refused as soon as it can be,
still kept the loop 88% busy (``bench/hostile.py``, bodies alone: about 480 MB/s) and doubled the
p99 of small requests. Small bodies, all of a chat request in practice, are never slowed: only
the bytes past a body's first :data:`FREE_BODY_BYTES` draw from the budget, a token bucket of
``bytes_per_second`` holding at most ``burst_bytes``. A read that finds it empty waits (the
connection is not read meanwhile: uvicorn stops reading a connection whose app holds 64 KiB
unread, so TCP slows the client; nothing more is buffered). Waiters are served first come, first
served, one read per tenant at a time: a tenant sending many large bodies at once gets one
tenant's share, not one per connection. The body's read deadline (``gateway.body_timeout_seconds``,
the server layer's) still runs while a read waits.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

#: bytes of each request body that never draw from the budget (``gateway.admission.admit.OFFLOAD_BODY_BYTES``
#: too: a body this small is parsed on the event loop)
FREE_BODY_BYTES = 64 * 1024


class BodyBudget:
    """The token bucket (``bytes_per_second``, at most ``burst_bytes`` saved up; both > 0) and its
    waiters; see the module docstring. ``clock`` (seconds, monotonic) and ``sleep``: tests pass
    their own. Raises ``ValueError`` for a rate or burst that is not positive."""

    def __init__(
        self,
        bytes_per_second: float,
        burst_bytes: int = 1 << 20,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
    ) -> None:
        if bytes_per_second <= 0 or burst_bytes <= 0:
            raise ValueError("a body budget needs a positive rate and burst")
        self.bytes_per_second = float(bytes_per_second)
        self.burst_bytes = burst_bytes
        self._clock = clock
        self._sleep = sleep
        self._tokens = float(burst_bytes)
        self._at = clock()
        self._turn = asyncio.Lock()  # FIFO: one waiter per tenant (below) takes the bucket at a time
        self._tenants: dict[str, tuple[asyncio.Lock, int]] = {}  # tenant id -> (its lock, its waiters)

    async def take(self, tenant_id: str, n: int) -> None:
        """Spend ``n`` bytes (>= 0) for ``tenant_id``, waiting until the bucket has them: behind
        this tenant's earlier reads, then behind other tenants' waiting reads. Returns at once
        while the bucket holds ``n``; cancelled (the client left), it spends nothing more."""
        if n <= 0:
            return
        lock, users = self._tenants.get(tenant_id) or (asyncio.Lock(), 0)
        self._tenants[tenant_id] = (lock, users + 1)
        try:
            async with lock, self._turn:
                now = self._clock()
                self._tokens = min(float(self.burst_bytes), self._tokens + (now - self._at) * self.bytes_per_second)
                self._at = now
                self._tokens -= n
                if self._tokens < 0:  # in debt: wait until the debt is paid back
                    await self._sleep(-self._tokens / self.bytes_per_second)
        finally:
            lock, users = self._tenants[tenant_id]
            if users == 1:
                del self._tenants[tenant_id]
            else:
                self._tenants[tenant_id] = (lock, users - 1)

    def pacer(self, tenant_id: str) -> Callable[[int], Awaitable[None]]:
        """``take`` bound to ``tenant_id``: the ``pace`` argument of :func:`gateway.admission.body.read_body`."""
        return lambda n: self.take(tenant_id, n)
