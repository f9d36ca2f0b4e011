"""The gateway's periodic probe (``verifier.probe_interval_seconds``): :mod:`verifier.probe`'s
canary probe against each target, its canaries registered as the probe tenant's, a confirmed
``probe`` incident recorded for each leak (which quarantines the upstream), in a worker thread.
A canary of a ``plant`` answer that no step planted is evidence only when kvgate planted it (a
probe's, a honeypot's: docs/design.md step 8); any tenant can register a canary by sending it."""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from config.background import one_round
from config.models import Settings, TenantConfig
from verifier.canary import CanaryRegistry
from verifier.findings import Evidence, incident
from verifier.incidents import Incident, RoundFaults
from verifier.stage import Exchange, ExchangeRequest

if TYPE_CHECKING:  # verifier.probe imports httpx: only the probe loop needs it
    from verifier.probe import ProbeResult, ProbeTarget

log = logging.getLogger("kvgate.verifier")


class PeriodicProbe:
    """Probes every ``settings.verifier.probe_interval_seconds``. ``targets``: a list of
    :class:`verifier.probe.ProbeTarget` (``None``: every upstream, straight at the engine);
    ``lock``: the state lock the canary registry is used under; ``stats``: the verifier's
    counters (``probes``); ``planted``: ``tenant id -> bool``, whether that tenant's canaries
    were planted by kvgate itself (:func:`verifier.findings.kvgate_planted`; default: the probe
    tenant's only)."""

    def __init__(
        self,
        settings: Settings,
        targets: list | None,
        canaries: CanaryRegistry,
        evidence: Evidence,
        lock: threading.Lock,
        stats: collections.Counter,
        planted: Callable[[str], bool] | None = None,
    ) -> None:
        self.settings = settings
        self.targets = targets
        self.canaries = canaries
        self.evidence = evidence
        self.lock = lock
        self.stats = stats
        #: a fault that persists in the probe's rounds (an operator's interval) is logged once a minute
        self._faults = RoundFaults("probe", stats)
        self.tenant_id = settings.verifier.probe_tenant or "kvgate-probe"
        self.planted = planted or (lambda tenant: tenant == self.tenant_id)

    async def loop(self) -> None:
        """Run the probe every interval, forever (the service cancels it)."""
        interval = float(self.settings.verifier.probe_interval_seconds or 0)
        while True:
            await asyncio.sleep(interval)
            # a round's fault, a native panic or its incident's store included
            with one_round(self._faults):
                await self._round()

    async def _round(self) -> None:
        """One probe of every target, its leaks recorded as incidents."""
        from verifier.probe import run_probe_targets, targets_from_settings

        try:
            targets = self.targets or targets_from_settings(self.settings)
            results = await run_probe_targets(targets, register=self.register, known=self.known)
        except Exception as e:
            log.warning("verifier probe failed to run: %s", e)
            return
        self.stats["probes"] += len(results)
        for target, result in results:
            if unmatched := sum(s.unmatched for s in result.steps):
                log.warning(
                    "verifier probe of %s: %d canary-shaped strings no step planted and no tenant"
                    " registered (a model echoing its own canary mistyped, or inventing some)",
                    target.upstream,
                    unmatched,
                )
        leaks = [self._incident(target, result) for target, result in results if result.outcome == "leak"]
        if leaks:  # the incident log is a file and the quarantine may be Redis: off the loop
            await asyncio.to_thread(self.evidence.record, leaks)

    def _incident(self, target: ProbeTarget, result: ProbeResult) -> Incident:
        """The confirmed ``probe`` incident of a leak ``result`` through ``target``."""
        request = ExchangeRequest(
            f"probe-{int(time.time())}",
            TenantConfig(id=self.tenant_id, honeypot=True),
            target.upstream,
            target.model or "",  # ExchangeRequest.model: "" when unnamed, as in verifier/latency.py
            result.limit or 0,
            False,
            time.monotonic(),
        )
        evidence = {"surfaced_canaries": result.surfaced, "limit_tokens": result.limit or 0}
        return incident("probe", Exchange(request, ""), evidence, confirmed=True)

    async def register(self, canaries: list[str]) -> None:
        """Register the probe's canaries as the probe tenant's, in a worker thread: the state
        lock may be held by the background worker for a whole batch, and the store may be Redis
        (a blocking client), neither of which the event loop may wait for."""
        await asyncio.to_thread(self._register, canaries)

    async def known(self, canaries: list[str]) -> list[bool]:
        """Whether kvgate planted each canary (a probe of another run or replica, a honeypot
        tenant: a tenant :attr:`planted` says so registered it), in a worker thread as
        :meth:`register`. A regular tenant's canary is not: one that registered
        ``KVGATE-CANARY-0123456789abcdef`` would have the probe quarantine an honest upstream
        whose model writes canaries in the pattern of the ones it reads."""
        return await asyncio.to_thread(self._known, canaries)

    def _known(self, canaries: list[str]) -> list[bool]:
        with self.lock:
            return [any(map(self.planted, m.owners)) for m in self.canaries.lookup(canaries)]

    def _register(self, canaries: list[str]) -> None:
        with self.lock:
            self.canaries.register(self.tenant_id, canaries)
