"""The one formula that turns a live KV pool into a context limit (docs/gateway.md, "Live pool limit").

The gateway's pool watcher and the verifier's deploy gate both call :func:`effective_pool_limit`,
so the limit a request is gated against and the limit a deployment is checked against never
disagree.
"""

from __future__ import annotations

from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal


def pool_limit_from_headroom(pool_tokens: int, headroom: float) -> int:
    """``floor(pool_tokens / headroom)``, computed in decimal so that ``681280 / 1.25`` is exactly
    ``545024`` (binary floating point can land one token short of an exact quotient)."""
    if pool_tokens < 0:
        raise ValueError("pool_tokens must be >= 0")
    if headroom < 1.0:
        raise ValueError("headroom must be >= 1.0")
    q = Decimal(pool_tokens) / Decimal(repr(float(headroom)))
    return int(q.to_integral_value(rounding=ROUND_FLOOR))


def signal_1_required_tokens(context_length: int, headroom: float) -> int:
    """The runbook's signal 1: the smallest pool (tokens) that serves ``context_length`` with
    ``headroom``, ``ceil(context_length x headroom)`` in decimal (1,048,576 x 1.25 = 1,310,720)."""
    required = Decimal(int(context_length)) * Decimal(repr(float(headroom)))
    return int(required.to_integral_value(rounding=ROUND_CEILING))


def effective_pool_limit(context_length: int, pool_tokens: int, max_req_input_len: int | None, headroom: float) -> int:
    """The largest prompt + completion (in tokens) one request may have on a pool.

    ``limit = min(context_length, max_req_input_len (when reported), floor(pool_tokens / headroom))``

    - ``context_length``: the model's context window in tokens.
    - ``pool_tokens``: the engine's KV pool (SGLang server_info ``max_total_num_tokens``; vLLM
      ``/v1/models`` ``max_model_len``).
    - ``max_req_input_len``: SGLang server_info ``max_req_input_len`` (context less its reserve),
      ``None`` when the engine does not report it.
    - ``headroom``: divisor >= 1 (the runbook's 1.25).

    Example (the incident): ``effective_pool_limit(1048576, 681280, None, 1.25) == 545024``.
    Raises ``ValueError`` for a negative pool or a headroom below 1.
    """
    limit = min(int(context_length), pool_limit_from_headroom(int(pool_tokens), headroom))
    if max_req_input_len is not None:
        limit = min(limit, int(max_req_input_len))
    return max(limit, 0)
