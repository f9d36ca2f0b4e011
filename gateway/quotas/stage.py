"""The contract between the gateway's request path and its quota stage (docs/design.md step 6);
``gateway/quotas/tenant_quotas.py`` implements it and :class:`NullQuotas` admits everything (quotas off).
The verification stage's contract (step 8) lives in ``verifier/stage.py``, since dependencies
point ``gateway -> verifier``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from config.models import TenantConfig
from verifier.stage import PendingWrite


# ---------------------------------------------------------------- quotas (step 6)
@dataclass
class QuotaLease:
    """What :meth:`QuotaStage.reserve` hands back: the request's reservation.

    ``reserved_tokens``: prompt + n x max_tokens reserved against TPM. ``headers``: the
    ``x-ratelimit-remaining-requests`` / ``-tokens`` values to put on the response.
    """

    tenant_id: str
    request_id: str
    reserved_tokens: int
    headers: dict[str, str] = field(default_factory=dict)
    state: Any = None  # the implementation's own bookkeeping


class QuotaStage(Protocol):
    """Per-tenant RPM/TPM/concurrency, atomic across replicas."""

    async def reserve(
        self, tenant: TenantConfig, reserve_tokens: int, request_id: str, *, also: PendingWrite | None = None
    ) -> QuotaLease:
        """Reserve one request, ``reserve_tokens`` tokens and a concurrency lease, all or none.
        ``also``: other Redis calls (the verifier's index write) to send in the same round trip
        when this reservation makes one; their outcome goes to ``also.sent`` (left unsent
        otherwise: the caller's ``also.finish()`` sends it). Raises
        ``config.errors.OpenAIError``: 429 ``rate_limit_exceeded`` (with ``Retry-After``, or for
        a request above the whole TPM ``x-should-retry: false``, and rate-limit headers) or 503
        when the store is down and the policy is fail closed."""
        ...

    async def begin(self, tenant: TenantConfig, request_id: str) -> QuotaLease:
        """Admit one request against RPM and take its concurrency lease, before its body is read
        (no tokens yet). Raises ``config.errors.OpenAIError`` 429 / 503 as :meth:`reserve`."""
        ...

    async def reserve_tokens(
        self, tenant: TenantConfig, lease: QuotaLease, tokens: int, *, also: PendingWrite | None = None
    ) -> None:
        """Add ``tokens`` (counted) to a begun request's reservation against TPM; sets
        ``lease.reserved_tokens``. Raises 429 / 503 as :meth:`reserve`; the lease stays held
        either way (the caller settles it). ``also``: the verifier's index write, sent with this
        reservation's round trip and made only if the reservation was (``also.guarded``), or in
        the next round trip when the reservation makes none; left unsent where neither happens
        (the caller's ``also.finish()`` sends it, and ``also.discard()`` after a refusal)."""
        ...

    def combines(self, tenant: TenantConfig) -> bool:
        """Whether a request of ``tenant`` whose whole body has arrived may be decided by
        :meth:`begin_reserve` once counted, instead of :meth:`begin` before its body is read
        (false where that saves no round trip, and for a tenant recently refused for RPM or
        concurrency: its requests are refused before their bodies are parsed)."""
        ...

    async def begin_reserve(
        self, tenant: TenantConfig, request_id: str, tokens: int, *, also: PendingWrite | None = None
    ) -> QuotaLease:
        """:meth:`begin` then :meth:`reserve_tokens` as one step (one round trip), with the same
        outcome: the lease, or the 429 / 503 either would raise (a lease the tokens' refusal
        leaves is released here). ``also``: as :meth:`reserve_tokens`."""
        ...

    async def send_writes(self, writes: PendingWrite) -> None:
        """Send ``writes.calls`` (the verifier's index write of an admitted prompt) in the
        round trip of this turn's other quota calls, when the store coalesces them (Redis, not a
        cluster); their outcome goes to ``writes.sent``. Otherwise leaves them unsent (the
        caller's ``writes.finish()`` sends them). Never raises, except ``asyncio.CancelledError``."""
        ...

    async def settle(self, lease: QuotaLease, used_tokens: int) -> None:
        """Release the concurrency lease and correct TPM to ``used_tokens`` (prompt + completion
        actually produced); ``used_tokens`` 0 for a request refused after :meth:`begin`. Never
        raises, except ``asyncio.CancelledError``; called exactly once per successful reserve or
        begin, with nothing awaited between the request's end and the call that a cancellation
        could cut. Once called the settle is the stage's: it stops renewing the lease before its
        first await, and a settle whose caller is cancelled while it awaits the store is still
        made (sent again in the background)."""
        ...

    async def aclose(self) -> None:
        """Release connections."""
        ...


class NullQuotas:
    """Admits everything (quotas switched off)."""

    async def reserve(
        self, tenant: TenantConfig, reserve_tokens: int, request_id: str, *, also: PendingWrite | None = None
    ) -> QuotaLease:
        return QuotaLease(tenant.id, request_id, reserve_tokens)

    async def begin(self, tenant: TenantConfig, request_id: str) -> QuotaLease:
        return QuotaLease(tenant.id, request_id, 0)

    async def reserve_tokens(
        self, tenant: TenantConfig, lease: QuotaLease, tokens: int, *, also: PendingWrite | None = None
    ) -> None:
        lease.reserved_tokens = tokens

    def combines(self, tenant: TenantConfig) -> bool:
        return False

    async def begin_reserve(
        self, tenant: TenantConfig, request_id: str, tokens: int, *, also: PendingWrite | None = None
    ) -> QuotaLease:
        return QuotaLease(tenant.id, request_id, tokens)

    async def send_writes(self, writes: PendingWrite) -> None:
        return None

    async def settle(self, lease: QuotaLease, used_tokens: int) -> None:
        return None

    async def aclose(self) -> None:
        return None
