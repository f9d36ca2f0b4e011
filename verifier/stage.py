"""The contract between the gateway's request path and the verifier (docs/design.md step 8).

It lives here, not in the gateway, because dependencies point ``gateway -> verifier``.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from config.models import TenantConfig


@dataclass(frozen=True)
class ExchangeRequest:
    """The request's inputs as the gateway admitted it (fixed; the gateway swaps in a copy with
    ``upstream`` set once it picks one). ``prompt_tokens``: the gateway's exact count (a batch's
    largest prompt's); ``prompt_tokens_total``: the batch's prompts together, what an engine's
    ``usage.prompt_tokens`` reports for it (``None``: one prompt, the same as ``prompt_tokens``).
    ``started_monotonic``: ``time.monotonic()`` at arrival; ``upstream`` is ``""`` until chosen;
    ``forwarded_monotonic``: ``time.monotonic()`` when the request was sent to that upstream (TTFT
    is measured from it, so the gateway's own work before forwarding never counts as prefill;
    ``None`` until forwarded)."""

    request_id: str
    tenant: TenantConfig
    upstream: str
    model: str
    prompt_tokens: int
    stream: bool
    started_monotonic: float
    forwarded_monotonic: float | None = None
    prompt_tokens_total: int | None = None


@dataclass
class VerifierState:
    """What the verifier fills in for one exchange: ``admitted`` (the prompt was decoded and
    ingested at admission), ``sampled`` (``None`` until decided), ``own_shingles`` (the prompt's
    own-shingle set, kept for this response only; read only: a cached prompt's is shared),
    ``own_canaries`` (the canaries of the prompt, found once per response), ``own_text_complete``
    (``False`` when a token-id prompt could not be decoded)."""

    admitted: bool = False
    sampled: bool | None = None
    own_shingles: set[int] | frozenset[int] | None = None
    own_canaries: frozenset[str] | None = None
    own_text_complete: bool = True


@dataclass
class Exchange:
    """One request as the verifier sees it: its fixed inputs (:class:`ExchangeRequest`), its
    prompt, and the verifier's per-request :class:`VerifierState`.

    ``prompt_text``: the prompt's text (every string the engine renders, joined: the route's
    ``prompt_text``), used only to build keyed shingle hashes, never stored or logged.
    ``prompt_ids``: the request's token-id prompts
    (``/v1/completions``), decoded by the verifier's admission (:meth:`VerifierStage.admit`) and
    appended to ``prompt_text`` so they get the own-text exclusion and the leak index like text;
    ``echo``: the client asked the engine to echo its prompt (never evidence); ``echo_prompts``:
    each prompt's text, to recognise an echo (the gateway fills the text ones, admission appends
    the decoded ones). ``internal_id``: the verifier's own key for this exchange (never the
    client's ``x-request-id``, which a client may repeat)."""

    request: ExchangeRequest
    prompt_text: str
    prompt_ids: Sequence[Sequence[int]] = ()
    echo: bool = False
    echo_prompts: list[str] = field(default_factory=list)
    internal_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    state: VerifierState = field(default_factory=VerifierState)


#: a token-id decoder the gateway hands to :meth:`VerifierStage.admit` (the model's tokenizer:
#: ``tokenizer.PromptCounter.adecode``)
Decoder = Callable[[list[int]], Awaitable[str]]


class StreamUsage(dict[str, Any]):
    """A stream's usage as the relay hands it to :meth:`ResponseGuard.finish_stream` when the
    engine's usage reports disagreed: the merged report (each count the largest reported, what
    the client's quota is charged: :func:`gateway.relay.stream.merge_usage`), and
    ``prompt_tokens_reported``, the distinct ``prompt_tokens`` values of the reports in the order
    first sent (at most :data:`MAX_PROMPT_TOKENS_REPORTED`), each a count, or the kind of a value
    that is not one (``"str"``, ``"missing"``...: :func:`verifier.drift.reported_count`). The
    values are an attribute, not a key, so no engine can write them; a stream whose reports
    agreed is handed its plain merged dict."""

    __slots__ = ("prompt_tokens_reported",)

    def __init__(self, merged: dict[str, Any], prompt_tokens_reported: Sequence[int | str]) -> None:
        super().__init__(merged)
        self.prompt_tokens_reported = tuple(prompt_tokens_reported)


#: the most distinct ``prompt_tokens`` values a :class:`StreamUsage` keeps (an engine can send a
#: new one in every chunk)
MAX_PROMPT_TOKENS_REPORTED = 8


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

    async def feed(
        self, delta_text: str, raw_event: bytes, pieces: Sequence[tuple[str, str]] | None = None
    ) -> list[bytes]:
        """A stream event (its raw SSE bytes) and the text it adds (``""`` for an event without
        text). ``pieces``: the same text per text stream, ``(key, text)`` with ``key`` naming the
        choice and field (``"0:content"``, ``"1:tool:0:arguments"``; see
        :mod:`verifier.engine_response`), so interleaved choices and fields are checked each as
        its own text; ``None`` = one stream holding ``delta_text``. Returns the events that may
        be sent now, in order (for a strict tenant possibly none: they stay in the hold-back
        window). Raises :class:`ResponseWithheld` once detected text must not leave; every later
        call raises it again."""
        ...

    async def finish_stream(
        self, *, usage: dict[str, Any] | None, finish_reason: str | None, ttft_seconds: float | None
    ) -> list[bytes]:
        """End of stream: runs the final checks and returns the held-back events, in order.
        ``usage``: the engine's usage object, if sent (several reports merged; a
        :class:`StreamUsage` naming the ``prompt_tokens`` values when they disagreed);
        ``ttft_seconds``: seconds from forwarding to the first text. Raises :class:`ResponseWithheld`."""
        ...

    async def check_body(
        self,
        text: str | Sequence[str],
        *,
        usage: dict[str, Any] | None,
        finish_reason: str | None,
        ttft_seconds: float | None,
    ) -> None:
        """A whole non-streamed response's text: one string, or one per text stream (each
        choice's each text-bearing field, checked each on its own). Strict: checked before this
        returns, raises :class:`ResponseWithheld`; otherwise queued for the background checker."""
        ...


class PendingWrite(Protocol):
    """Store writes an admission computed and has not sent: ``calls``, one ``(sha1, keys, args)``
    per Redis Lua call (``EVALSHA sha1 len(keys) *keys *args``). Whoever sends them in a round trip of its own
    (the quota reservation's, :class:`gateway.quotas.stores.RedisQuotaStore`) hands the outcome
    to :meth:`sent`: the calls' results in order (a failed call's exception in its place), or the
    exception that ended the round trip. :meth:`finish`, awaited exactly once whatever happened,
    sends what was not sent (or failed with ``NOSCRIPT``), records the outcome and releases what
    the admission held."""

    @property
    def calls(self) -> list[tuple[str, list[str], list[Any]]]: ...

    def guarded(self, key: str, field: str) -> list[tuple[str, list[str], list[Any]]]:
        """:attr:`calls`, each writing only if the Redis hash ``key`` holds ``field`` when it
        runs (else answering ``-1``, which :meth:`finish` treats as unsent): for a round trip
        whose first call is the reservation that sets that field."""
        ...

    def sent(self, outcome: list[Any] | BaseException) -> None: ...

    def discard(self) -> None:
        """The request was refused: :meth:`finish` sends nothing and counts no ingest."""
        ...

    async def finish(self) -> None: ...


class VerifierStage(Protocol):
    """Creates guards; owns background checking, metrics and incident records."""

    async def admit(
        self, exchange: Exchange, decode: Decoder | None = None, *, defer_write: bool = False
    ) -> PendingWrite | None:
        """Admission (before the request is forwarded): decode ``exchange.prompt_ids`` with
        ``decode`` and index the prompt, in a worker thread this request awaits, so its cost is
        its own and a later check finds it indexed. Never raises for the request's sake (a
        failed decode or a full ingest budget is counted and the request goes on).
        ``defer_write``: when the prompt's store write can ride another round trip, return it
        as a :class:`PendingWrite` instead of sending it (the caller must await its ``finish``);
        otherwise ``None``, the prompt indexed."""
        ...

    def defers(self, exchange: Exchange) -> bool:
        """Whether :meth:`admit` with ``defer_write`` would return the prompt's writes unsent
        (nothing indexed, no engine call made before it returns) rather than index it."""
        ...

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

    async def admit(
        self, exchange: Exchange, decode: Decoder | None = None, *, defer_write: bool = False
    ) -> PendingWrite | None:
        return None

    def defers(self, exchange: Exchange) -> bool:
        return False

    def begin(self, exchange: Exchange) -> ResponseGuard | None:
        return None

    def is_quarantined(self, upstream: str, prompt_tokens: int) -> bool:
        return False

    async def aclose(self) -> None:
        return None
