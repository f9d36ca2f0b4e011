"""The contracts between the gateway's request path and its pluggable stages: quotas (DESIGN.md
step 6) and verification (step 8). The request path calls only these; ``gateway/quotas.py`` and
the ``verifier`` package implement them. The null implementations here admit everything and
check nothing (used when a stage is switched off).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from config.models import TenantConfig


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

    async def reserve(self, tenant: TenantConfig, reserve_tokens: int, request_id: str) -> QuotaLease:
        """Reserve one request, ``reserve_tokens`` tokens and a concurrency lease, all or none.
        Raises ``config.errors.OpenAIError``: 429 ``rate_limit_exceeded`` (with ``Retry-After``
        and rate-limit headers) or 503 when the store is down and the policy is fail closed."""
        ...

    async def settle(self, lease: QuotaLease, used_tokens: int) -> None:
        """Release the concurrency lease and correct TPM to ``used_tokens`` (prompt + completion
        actually produced). Never raises; called exactly once per successful reserve."""
        ...

    async def aclose(self) -> None:
        """Release connections."""
        ...


class NullQuotas:
    """Admits everything (quotas switched off)."""

    async def reserve(self, tenant: TenantConfig, reserve_tokens: int, request_id: str) -> QuotaLease:
        return QuotaLease(tenant.id, request_id, reserve_tokens)

    async def settle(self, lease: QuotaLease, used_tokens: int) -> None:
        return None

    async def aclose(self) -> None:
        return None


# ---------------------------------------------------------------- verification (step 8)
@dataclass
class Exchange:
    """One request as the verifier sees it. ``prompt_text``: the prompt's text (all messages'
    text joined), used only to build keyed shingle hashes, never stored or logged.
    ``prompt_tokens``: the gateway's exact count. ``started_monotonic``: ``time.monotonic()`` at
    arrival."""

    request_id: str
    tenant: TenantConfig
    upstream: str
    model: str
    route: str
    prompt_text: str
    prompt_tokens: int
    stream: bool
    started_monotonic: float


class ResponseWithheld(Exception):
    """Raised by a guard of a strict tenant when detected text must not leave. The gateway
    answers 502 ``response_withheld`` (or, mid-stream, an error event) naming ``incident_id``."""

    def __init__(self, incident_id: str, detector: str) -> None:
        super().__init__(f"response withheld: incident {incident_id} ({detector})")
        self.incident_id = incident_id
        self.detector = detector


class ResponseGuard(Protocol):
    """Watches one response. For non-strict tenants it never holds anything back and does its
    work off the request path; for strict tenants it holds back a window of tokens."""

    def feed(self, delta_text: str, raw_event: bytes) -> list[bytes]:
        """A stream event (its raw SSE bytes) and the text it adds. Returns the events that may
        be sent now, in order. Raises :class:`ResponseWithheld`."""
        ...

    def finish_stream(self, *, usage: dict[str, Any] | None, finish_reason: str | None,
                      ttft_seconds: float | None) -> list[bytes]:
        """End of stream: returns the held-back events. Raises :class:`ResponseWithheld`."""
        ...

    def check_body(self, text: str, *, usage: dict[str, Any] | None, finish_reason: str | None,
                   ttft_seconds: float | None) -> None:
        """A whole non-streamed response's text. Strict: checked now, raises
        :class:`ResponseWithheld`; otherwise queued for the background checker."""
        ...


class VerifierStage(Protocol):
    """Creates guards; owns background checking, metrics and incident records."""

    def begin(self, exchange: Exchange) -> ResponseGuard | None:
        """A guard for this response, or ``None`` when it is neither sampled nor strict.
        Also records the prompt in the leak index (off the request path)."""
        ...

    def is_quarantined(self, upstream: str, prompt_tokens: int) -> bool:
        """Whether ``upstream`` must not receive a prompt of this length (confirmed leak)."""
        ...

    async def aclose(self) -> None:
        ...


class NullVerifier:
    """Checks nothing (verification switched off)."""

    def begin(self, exchange: Exchange) -> ResponseGuard | None:
        return None

    def is_quarantined(self, upstream: str, prompt_tokens: int) -> bool:
        return False

    async def aclose(self) -> None:
        return None
