"""Per-tenant caps on what one tenant may put into the leak index and the canary registry.

A tenant's prompts are indexed so that its text is recognised in other tenants' answers; without
a cap one tenant could fill the shared store (every fingerprint costs about 100 bytes of Redis
for ``leak_index_ttl_seconds``) or flood it with canaries. :class:`TenantCap` admits at most
``limit`` entries per tenant per fixed window; the rest are not indexed and are counted
(``kvgate_verifier_cap_dropped_total{store}``). Dropping only weakens the protection of the
tenant that sent too much: its own text is what goes unindexed. Counted per gateway process.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

from config.models import VerifierSettings
from verifier.incidents import CAP_DROPPED

T = TypeVar("T")


class TenantCap:
    """At most ``limit`` entries per tenant per window of ``window_seconds`` (fixed windows:
    the counts restart when one ends). ``store``: the metric's label (``leak_index``,
    ``canary``). Thread-safe."""

    def __init__(self, limit: int, window_seconds: float, store: str, clock: Callable[[], float] = time.monotonic):
        self.limit = limit
        self.window_seconds = window_seconds
        self.store = store
        self.clock = clock
        self._lock = threading.Lock()
        self._window = float("-inf")
        self._used: dict[str, int] = {}
        #: entries dropped since start (tests, the admin view)
        self.dropped = 0

    def take(self, tenant: str, items: Iterable[T]) -> list[T]:
        """The part of ``items`` the tenant may still index in this window (in their order);
        the rest are counted as dropped."""
        return self.take_in_window(tenant, items)[0]

    def take_in_window(self, tenant: str, items: Iterable[T]) -> tuple[list[T], float]:
        """:meth:`take`, and the start of the window it counted them in (for :meth:`give_back`)."""
        items = list(items)
        with self._lock:
            now = self.clock()
            if now - self._window >= self.window_seconds:
                self._window, self._used = now, {}
            used = self._used.get(tenant, 0)
            room = max(0, self.limit - used)
            kept = items[:room]
            self._used[tenant] = used + len(kept)
            drop = len(items) - len(kept)
            self.dropped += drop
            window = self._window
        if drop:
            CAP_DROPPED.labels(self.store).inc(drop)
        return kept, window

    def used(self, tenant: str) -> int:
        """Entries the tenant has put in during the current window."""
        with self._lock:
            return self._used.get(tenant, 0)

    def give_back(self, tenant: str, n: int, window: float) -> None:
        """Return ``n`` entries that :meth:`take_in_window` let in during ``window`` and that were
        never stored (their request was refused) to the tenant's room; nothing once that window
        has ended (the counts restarted)."""
        with self._lock:
            if self._window == window and n > 0:
                self._used[tenant] = max(0, self._used.get(tenant, 0) - n)


class TenantCaps:
    """The two caps of a verifier (``verifier`` settings: ``leak_index_tenant_cap_fingerprints``,
    ``canary_tenant_cap``, ``tenant_cap_window_seconds``)."""

    def __init__(self, cfg: VerifierSettings, clock: Callable[[], float] = time.monotonic) -> None:
        w = cfg.tenant_cap_window_seconds
        self.leak = TenantCap(cfg.leak_index_tenant_cap_fingerprints, w, "leak_index", clock)
        self.canary = TenantCap(cfg.canary_tenant_cap, w, "canary", clock)
