"""Usage drift and aborted-under-200 detection (docs/design.md, Verifier: "Usage drift").

The engine's ``usage.prompt_tokens`` should equal the gateway's exact count; a prompt of 624
tokens reported as 1 is a known engine failure (the placeholder of a rejected request). In the
runbook's incident the counts matched, so this only complements the content checks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DriftFinding:
    """``detector``: ``usage_drift`` or ``finish_abort``; ``evidence``: counts only."""

    detector: str
    evidence: dict[str, Any]


def check_usage(gateway_prompt_tokens: int, usage: dict[str, Any] | None, tolerance_tokens: int) -> DriftFinding | None:
    """A finding when ``|usage.prompt_tokens - gateway_prompt_tokens| > tolerance_tokens``.

    ``usage``: the OpenAI ``usage`` object of the response (``None`` or without an integer
    ``prompt_tokens``: nothing to compare, returns ``None``). Evidence: both counts and the
    difference (engine minus gateway), each clamped to the signed 64-bit range (the incident
    record's JSON holds no larger integer; a hostile engine may send one).
    """
    if not usage:
        return None
    reported = usage.get("prompt_tokens")
    if not isinstance(reported, int) or isinstance(reported, bool):
        return None
    diff = reported - gateway_prompt_tokens
    if abs(diff) <= tolerance_tokens:
        return None
    return DriftFinding(
        "usage_drift",
        {
            "gateway_prompt_tokens": gateway_prompt_tokens,
            "engine_prompt_tokens": _int64(reported),
            "difference_tokens": _int64(diff),
            "tolerance_tokens": tolerance_tokens,
        },
    )


def _int64(n: int) -> int:
    """``n`` clamped to the signed 64-bit range."""
    return max(-(2**63), min(n, 2**63 - 1))


def check_finish(finish_reason: str | None, status_code: int = 200) -> DriftFinding | None:
    """A finding when a response that came back as HTTP 2xx says ``finish_reason: "abort"``
    (SGLang's reason for a request its scheduler aborted: the client got a 200 with no answer)."""
    if finish_reason == "abort" and 200 <= status_code < 300:
        return DriftFinding("finish_abort", {"status_code": status_code})
    return None
