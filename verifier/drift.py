"""Usage drift and aborted-under-200 detection (docs/design.md, Verifier: "Usage drift").

The engine's ``usage.prompt_tokens`` should equal the gateway's exact count; a prompt of 624
tokens reported as 1 is a known engine failure (the placeholder of a rejected request). In the
runbook's incident the counts matched, so this only complements the content checks.

A usage object whose counts are not counts is drift too: ``prompt_tokens`` absent, ``null``, a
bool, a string, a float (``12.0``, or an integer past 64 bits, which orjson reads as a float:
``2**70`` arrives as ``1.18e21``), and ``prompt_tokens_details.cached_tokens`` that is not a count
from 0 to ``prompt_tokens``. Every engine kvgate fronts writes them as ints (vLLM
``vllm/entrypoints/openai/protocol.py``: ``UsageInfo.prompt_tokens: int``,
``PromptTokenUsageInfo.cached_tokens: Optional[int]``; OpenAI's ``CompletionUsage`` the same),
so a malformed report is a broken or hostile engine's: before, it compared with nothing and left
no trace, and an impossible cache hit only made the latency detector treat the count as unsaid.
No usage object at all is not drift: there is nothing to compare.

So are a stream's usage reports that disagree on ``prompt_tokens`` (``prompt_tokens:disagree``;
the relay hands them over as a :class:`verifier.stage.StreamUsage`): an engine's prompt does not
change within one answer, and vLLM's continuous usage stats repeat the same count in every chunk
(``vllm/entrypoints/openai/serving_chat.py``, ``chat_completion_stream_generator``:
``num_prompt_tokens`` in each chunk's ``UsageInfo``). The relay keeps each count's largest
(:func:`gateway.relay.stream.merge_usage`, what the quota charges), so a stream reporting 1 in one
chunk and the right count in another reached this check as the right count alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from verifier.stage import StreamUsage

#: what a field absent from the usage object reads as
_ABSENT = object()


@dataclass(frozen=True)
class DriftFinding:
    """``detector``: ``usage_drift`` or ``finish_abort``; ``evidence``: counts only."""

    detector: str
    evidence: dict[str, Any]


def check_usage(gateway_prompt_tokens: int, usage: dict[str, Any] | None, tolerance_tokens: int) -> DriftFinding | None:
    """A finding when ``|usage.prompt_tokens - gateway_prompt_tokens| > tolerance_tokens``, or when
    the usage is malformed (:func:`usage_problems`).

    ``usage``: the OpenAI ``usage`` object of the response (``None``: nothing to compare, returns
    ``None``). Evidence: both counts and the difference (engine minus gateway; ``None`` when the
    engine's is not an int), each clamped to the signed 64-bit range (the incident record's JSON
    holds no larger integer; a hostile engine may send one), ``malformed_usage``, the list of
    what was malformed (only when something was), and, for a stream whose reports disagreed
    (a :class:`~verifier.stage.StreamUsage`), ``engine_prompt_tokens_reported``: the distinct
    values reported, in the order first sent (``engine_prompt_tokens`` is their largest count).
    """
    if not isinstance(usage, dict):
        return None
    reported = usage.get("prompt_tokens", _ABSENT)
    engine = reported if _is_count(reported) else None
    diff = None if engine is None else engine - gateway_prompt_tokens
    problems = usage_problems(usage)
    if not problems and diff is not None and abs(diff) <= tolerance_tokens:
        return None
    evidence: dict[str, Any] = {
        "gateway_prompt_tokens": gateway_prompt_tokens,
        "engine_prompt_tokens": None if engine is None else _int64(engine),
        "difference_tokens": None if diff is None else _int64(diff),
        "tolerance_tokens": tolerance_tokens,
    }
    if problems:
        evidence["malformed_usage"] = problems
    if isinstance(usage, StreamUsage):
        evidence["engine_prompt_tokens_reported"] = list(usage.prompt_tokens_reported)
    return DriftFinding("usage_drift", evidence)


def usage_problems(usage: dict[str, Any]) -> list[str]:
    """What is malformed in a usage object, as short codes (each at most 40 characters):
    ``prompt_tokens:<kind>`` when ``prompt_tokens`` is not an int (``<kind>``: ``missing``,
    ``null``, ``bool``, ``float``, ``str``, ``list``, ``object``); ``prompt_tokens_details:<kind>``
    when the details are neither an object nor ``null``; ``cached_tokens:<kind>`` when the cached
    count is neither an int nor ``null``, ``cached_tokens<0``, and ``cached_tokens>prompt_tokens``
    (a cache hit larger than the prompt the engine itself reported); last,
    ``prompt_tokens:disagree`` for a stream whose reports disagreed (a
    :class:`~verifier.stage.StreamUsage`)."""
    problems = _report_problems(usage)
    if isinstance(usage, StreamUsage):
        problems.append("prompt_tokens:disagree")
    return problems


def reported_count(usage: dict[str, Any]) -> int | str:
    """``usage.prompt_tokens`` as evidence may name it: the count (clamped to 64 bits), or the
    kind of a value that is not one (``missing``, ``null``, ``bool``, ``float``, ``str``,
    ``list``, ``object``), never an engine's string itself."""
    v = usage.get("prompt_tokens", _ABSENT)
    return _int64(v) if _is_count(v) else _kind(v)


def _report_problems(usage: dict[str, Any]) -> list[str]:
    """:func:`usage_problems` of one report."""
    reported = usage.get("prompt_tokens", _ABSENT)
    problems = [] if _is_count(reported) else [f"prompt_tokens:{_kind(reported)}"]
    details = usage.get("prompt_tokens_details")
    if details is None:
        return problems
    if not isinstance(details, dict):
        return [*problems, f"prompt_tokens_details:{_kind(details)}"]
    cached = details.get("cached_tokens")
    if cached is None:
        return problems
    if not _is_count(cached):
        return [*problems, f"cached_tokens:{_kind(cached)}"]
    if cached < 0:
        return [*problems, "cached_tokens<0"]
    if _is_count(reported) and cached > reported:
        return [*problems, "cached_tokens>prompt_tokens"]
    return problems


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _kind(v: Any) -> str:
    """The JSON kind of a usage field's value, as :func:`usage_problems` names it."""
    if v is _ABSENT:
        return "missing"
    if v is None:
        return "null"
    if isinstance(v, dict):
        return "object"
    return {bool: "bool", float: "float", str: "str", list: "list"}.get(type(v), type(v).__name__[:16])


def _int64(n: int) -> int:
    """``n`` clamped to the signed 64-bit range."""
    return max(-(2**63), min(n, 2**63 - 1))


def check_finish(finish_reason: str | None, status_code: int = 200) -> DriftFinding | None:
    """A finding when a response that came back as HTTP 2xx says ``finish_reason: "abort"``
    (SGLang's reason for a request its scheduler aborted: the client got a 200 with no answer)."""
    if finish_reason == "abort" and 200 <= status_code < 300:
        return DriftFinding("finish_abort", {"status_code": status_code})
    return None
