"""The contract between the gateway's request path and the verifier (DESIGN.md step 8).

It lives here, not in the gateway, because dependencies point ``gateway -> verifier``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from config.models import TenantConfig


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
    work off the request path; for strict tenants it holds back a window of tokens.

    The methods are coroutines and are awaited on the gateway's event loop, one at a time per
    guard, in stream order (a guard is not safe for concurrent calls). An implementation must
    not block the loop: blocking work (tokenizing, hashing, store round trips, locks shared
    with a worker thread) runs in a worker thread, and the awaited call returns (or raises)
    only once that work is done, so ordering and withholding are as if it ran inline."""

    async def feed(self, delta_text: str, raw_event: bytes) -> list[bytes]:
        """A stream event (its raw SSE bytes) and the text it adds (``""`` for an event without
        text). Returns the events that may be sent now, in order (for a strict tenant possibly
        none: they stay in the hold-back window). Raises :class:`ResponseWithheld` once
        detected text must not leave; every later call raises it again."""
        ...

    async def finish_stream(
        self, *, usage: dict[str, Any] | None, finish_reason: str | None, ttft_seconds: float | None
    ) -> list[bytes]:
        """End of stream: runs the final checks and returns the held-back events, in order.
        ``usage``: the engine's usage object, if sent; ``ttft_seconds``: seconds from forwarding
        to the first text. Raises :class:`ResponseWithheld`."""
        ...

    async def check_body(
        self, text: str, *, usage: dict[str, Any] | None, finish_reason: str | None, ttft_seconds: float | None
    ) -> None:
        """A whole non-streamed response's text. Strict: checked before this returns, raises
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

    async def aclose(self) -> None: ...


class NullVerifier:
    """Checks nothing (verification switched off)."""

    def begin(self, exchange: Exchange) -> ResponseGuard | None:
        return None

    def is_quarantined(self, upstream: str, prompt_tokens: int) -> bool:
        return False

    async def aclose(self) -> None:
        return None
