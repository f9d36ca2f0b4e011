"""The end of an admitted request (docs/design.md step 6's settle, and the gateway's records): record
metrics, settle the quota lease exactly once, write one JSON access-log line. Called by the
response shell (:mod:`gateway.relay.response`) however the request ended: answered, refused by the
engine, cut, withheld, or abandoned by the client.

Tokens used, for the settle (:func:`used_tokens`): nothing when the request never reached an
engine (every upstream failed to connect); otherwise, however it ended (answered, engine error,
engine timeout or reset, client gone before or during the answer), at least the prompt as
admitted, every prompt x its sequences (:func:`prompt_charge`; the engine's ``usage.prompt_tokens``
when that is more), plus the completion: the engine's ``usage.completion_tokens``, or without it
(none sent, the stream was cut or cancelled before it, or a number no engine could report: above
``max_tokens`` for every sequence, or fewer than the events of text relayed, :func:`_usage_count`) the
completion text relayed so far, counted with the model's tokenizer. So leaving, or making the
engine fail, after the prompt was sent never makes its prefill free. A count that does not finish
(the request's task cancelled while a long completion is counted in a worker thread, or the count
failed) settles the reservation (:func:`unfinished_count_charge`): the lease is settled however
the request's task ends.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from gateway.admission.gate import Admission
from gateway.ops import access_log as glog
from gateway.ops.metrics import GatewayMetrics
from gateway.quotas.stage import QuotaStage
from gateway.relay.proxy import RelayOutcome
from tokenizer import PromptCounter
from tokenizer.base import OFFLOAD_CHARS, off_loop
from tokenizer.errors import TokenizerFaultError

log = logging.getLogger("kvgate.proxy")


class FinishContext(Protocol):
    """What finishing reads from the gateway (``gateway.app.Gateway`` provides it)."""

    quotas: QuotaStage
    metrics: GatewayMetrics


async def finish(ctx: FinishContext, outcome: RelayOutcome) -> None:
    """Metrics, settle, access log (module docstring). Never raises but a cancellation: a failing
    settle is logged. The settle is handed to the quota stage however the count of the tokens
    used ends: counted, failed (logged), or cut by a cancellation of the request's task (the server
    stopping while a long completion is counted in a worker thread), the last two at
    :func:`unfinished_count_charge`; nothing is awaited between that end and the stage's ``settle``,
    which takes the lease over before its own first await (``QuotaStage.settle``). The metrics are
    recorded just before the settle (synchronously, so a released lease means a counted request)
    and however the count ends; a cancellation skips only the access line."""
    used = unfinished_count_charge(outcome)
    try:
        used = await used_tokens(outcome)
    except Exception:
        log.exception("counting the tokens used failed; the request is settled to its reservation")
    finally:  # no await before the stage's settle: a lease nobody settles is renewed for good
        try:
            record_metrics(ctx.metrics, outcome)
        except Exception:
            log.exception("recording the request's metrics failed")
        try:
            await ctx.quotas.settle(outcome.admitted.lease, used)
        except Exception:
            log.exception("quota settle failed")
    abort = outcome.produced.finish_reason == "abort" and outcome.status == 200
    if not abort and not glog.ACCESS.isEnabledFor(logging.INFO):
        return  # no line to write: build no fields
    fields = access_fields(outcome)
    if fields["completion_tokens"] is None and outcome.forwarded and outcome.produced.texts:
        # no usage from the engine (a client that went away mid-stream: 499): the tokens streamed so far
        fields["completion_tokens"] = await completion_tokens_of(
            outcome.admitted.admission.model.counter, outcome.produced.texts.values()
        )
        fields["completion_tokens_counted"] = True
    if abort:
        log.warning("upstream finished a 200 response with finish_reason 'abort'", extra={"fields": fields})
    glog.access(fields)


def error_code(outcome: RelayOutcome) -> str | None:
    """The code of the error the request ended with: the one the response shell answered or ended
    the stream with, else an engine error relayed inside the stream."""
    return outcome.error_code or outcome.produced.error_code


def usage_ceiling(adm: Admission) -> int:
    """The most tokens an engine can have used for a request, in tokens: each of its sequences
    (prompts x ``max(n, best_of)``) holds at most the model's context length, prompt and
    completion together (or the gate's limit, where that is larger). A usage report above it is
    no engine's count."""
    return adm.sequences * max(adm.model.config.context_length, adm.limit)


def _usage_count(outcome: RelayOutcome, key: str) -> int | None:
    """``usage[key]`` when the engine reported it as an int from 0 to its ceiling (not a bool) and,
    for ``completion_tokens``, not below what the text relayed took (:func:`least_completion_tokens`),
    else ``None``: the settle then counts the text relayed, as for no report. The ceiling:
    :func:`usage_ceiling` for ``prompt_tokens``; for ``completion_tokens`` the completion bound
    the engine was sent, ``max_tokens`` for each of the request's sequences: vLLM stops a
    sequence once ``num_output_tokens >= max_tokens`` (``vllm/v1/core/sched/utils.py``,
    ``check_stop``), SGLang once ``len(output_ids) >= max_new_tokens``
    (``python/sglang/srt/managers/schedule_batch.py``, ``Req.check_finished``), reasoning
    included. Unbounded, one engine report of 2**62 tokens broke the quota scripts for every
    tenant and one of 10**12 locked its tenant out for the window; bounded by the context alone,
    an engine could charge a 5-token request 8,192."""
    usage = outcome.produced.usage
    v = usage.get(key) if isinstance(usage, dict) else None
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        return None
    adm = outcome.admitted.admission
    ceiling = adm.sequences * adm.max_tokens if key == "completion_tokens" else usage_ceiling(adm)
    if v > ceiling:
        log.warning("upstream reported usage.%s %d, above what the request could use (%d); ignored", key, v, ceiling)
        return None
    if key == "completion_tokens" and outcome.produced.pieces:
        least = least_completion_tokens(outcome)
        if v < least:
            log.warning(
                "upstream reported usage.completion_tokens %d, fewer than the %d events of text it sent; ignored",
                v,
                least,
            )
            return None
    return v


def least_completion_tokens(outcome: RelayOutcome) -> int:
    """The fewest completion tokens the text relayed can have taken: one per event that carried
    non-empty text of a choice (``Produced.pieces``; a whole answer's choice with text is one),
    summed over the choices, less one per choice when the request asked for an ``echo`` (an
    echoed prompt may come as an event of its own, before any token is generated). An engine
    decodes at least one token per step and sends at most one event per choice and step (several
    tokens an event with speculative decoding or a stream interval; an event with empty text, a
    role or a finish reason alone, is not counted), so an honest count is never below it: a
    ``completion_tokens`` of 0 after text made the text free."""
    pieces = outcome.produced.pieces.values()
    ex = outcome.admitted.exchange
    if ex is not None and ex.echo:
        return sum(max(n - 1, 0) for n in pieces)
    return sum(pieces)


def reported_completion_tokens(outcome: RelayOutcome) -> int | None:
    """The engine's ``usage.completion_tokens`` when it reported a plausible int (:func:`_usage_count`),
    else ``None``."""
    return _usage_count(outcome, "completion_tokens")


def prompt_charge(adm: Admission) -> int:
    """The prompt tokens a request that reached an engine is charged at least: the sum over its
    prompts x the sequences each one generates (``max(n, best_of)``), as admitted; in tokens."""
    per_prompt = adm.sequences // adm.num_prompts if adm.num_prompts > 0 else 1
    return adm.prompt_tokens_total * max(per_prompt, 1)


def unfinished_count_charge(outcome: RelayOutcome) -> int:
    """What a request is settled to when the count of its tokens used (:func:`used_tokens`) did
    not finish (its task cancelled while it awaited, or the count failed), in tokens: 0 when
    nothing reached an engine, else its reservation (``lease.reserved_tokens``: every prompt and
    the completion bound, for each sequence), the most an engine that keeps to the bound it was
    sent can have used. Computed without an await, before the count starts."""
    return outcome.admitted.lease.reserved_tokens if outcome.forwarded else 0


async def used_tokens(outcome: RelayOutcome) -> int:
    """Tokens to settle the lease to (module docstring), in tokens: 0 when nothing reached an
    engine, else ``max(usage.prompt_tokens, prompt_charge) + completion``."""
    if not outcome.forwarded:
        return 0
    a = outcome.admitted.admission
    completion = reported_completion_tokens(outcome)
    if completion is None:
        completion = await completion_tokens_of(a.model.counter, outcome.produced.texts.values())
    return max(_usage_count(outcome, "prompt_tokens") or 0, prompt_charge(a)) + completion


async def completion_tokens_of(counter: PromptCounter, texts: Iterable[str | Sequence[str]]) -> int:
    """Completion tokens of the text an engine produced, for a settle without a usage report.

    ``counter``: the model's :class:`tokenizer.PromptCounter`; ``texts``: one string (or list of
    string pieces) per choice, counted separately and summed. Long texts (above the counter's
    ``offload_chars``) are counted in a worker thread. A counter that can only count through the
    engine (``count_text`` not implemented), or whose tokenizer fails on the text
    (:class:`~tokenizer.errors.TokenizerFaultError`), falls back to the UTF-8 byte length, which
    never undercounts (a token is at least a byte)."""
    total = 0
    limit = getattr(counter, "offload_chars", OFFLOAD_CHARS)
    for t in texts:
        text = t if isinstance(t, str) else "".join(t)
        if not text:
            continue
        try:
            total += await off_loop(len(text), limit, counter.count_text, text)
        except (NotImplementedError, TokenizerFaultError):  # a tokenizer fault on engine text: never fewer
            total += len(text.encode("utf-8", "surrogatepass"))
    return total


def record_metrics(m: GatewayMetrics, outcome: RelayOutcome) -> None:
    """Count the request: status, admitted prompt tokens (when forwarded), reported completion
    tokens, gateway overhead, TTFT per upstream, the error code of a failed answer, a
    ``finish_reason: abort`` under a 200, a client disconnect."""
    a = outcome.admitted
    tenant, route, u = a.tenant.id, a.arrival.route, outcome.upstream
    m.requests.labels(tenant, route, str(outcome.status)).inc()
    if outcome.forwarded:
        m.prompt_tokens.labels(tenant).inc(a.admission.prompt_tokens_total)
    completion = reported_completion_tokens(outcome)
    if completion:
        m.completion_tokens.labels(tenant).inc(completion)
    m.overhead.labels(route).observe(outcome.overhead_seconds)
    ttft = outcome.produced.ttft_seconds
    if ttft is not None and u is not None:
        m.ttft.labels(u.name).observe(ttft)
    code = error_code(outcome)
    if code and outcome.status >= 400:
        m.rejections.labels(code).inc()
    if outcome.produced.finish_reason == "abort" and outcome.status == 200:
        m.aborts.labels(u.name if u else "-").inc()
    if outcome.disconnected:
        m.client_disconnects.labels(route).inc()


def access_fields(outcome: RelayOutcome) -> dict[str, Any]:
    """The access-log line's fields (never a key or prompt text)."""
    a, adm, p, u = outcome.admitted, outcome.admitted.admission, outcome.produced, outcome.upstream
    ttft = p.ttft_seconds
    fields: dict[str, Any] = {
        "request_id": a.arrival.request_id,
        "tenant": a.tenant.id,
        "route": a.arrival.route,
        "status": outcome.status,
        "model": adm.model.id,
        "upstream": u.name if u else None,
        "upstream_request_id": outcome.upstream_request_id if outcome.forwarded else None,
        "stream": a.forward.stream,
        "prompt_tokens": adm.prompt_tokens_total,
        "max_tokens": adm.max_tokens,
        "limit_tokens": adm.limit,
        "completion_tokens": reported_completion_tokens(outcome),
        "finish_reason": p.finish_reason,
        "overhead_ms": round(outcome.overhead_seconds * 1000, 3),
        "ttft_ms": round(ttft * 1000, 3) if ttft is not None else None,
        "total_ms": round((time.perf_counter() - a.arrival.t_perf) * 1000, 3),
    }
    code = error_code(outcome)
    if code:
        fields["error_code"] = code
    if outcome.disconnected:
        fields["client_disconnected"] = True
    return fields
