"""Time to first token against prompt length (the runbook's signal 3: "too good to be true").

Per upstream and kind of measurement (``stream``: time to the first streamed token, measured by
the gateway; ``whole``: the engine's reported prefill time of a non-streamed response; the two
are never mixed), prompts are bucketed by length (powers of two: bucket ``b`` holds lengths in
``[2**b, 2**(b+1))``); each bucket keeps a DDSketch (Datadog's relative-error quantile sketch,
the ``ddsketch`` package) of TTFT in seconds. Once a bucket has ``min_samples`` samples its
*calibrated lower bound* is ``quantile(q) * margin``. Prefill time never shrinks as prompts get
longer, so the bound that applies to a prompt is the largest bound of its bucket and every
shorter bucket: a prompt longer than the pool (whose bucket never saw a clean sample, since every
such prompt took the rejection path) is still held to the bound of shorter prompts.

A prompt of at least ``min_prompt_tokens`` answered faster than its bound is an anomaly: its
prefill most likely ran on a one-token placeholder and its answer came from someone else's KV.
"""

from __future__ import annotations

from dataclasses import dataclass

from ddsketch import DDSketch


def bucket_of(prompt_tokens: int) -> int:
    """The length bucket of a prompt: ``floor(log2(prompt_tokens))`` (0 for 0 or 1 token)."""
    return max(int(prompt_tokens), 1).bit_length() - 1


@dataclass(frozen=True)
class LatencyVerdict:
    """``anomaly``: faster than the bound; ``bound_seconds``: the bound applied (``None`` while
    no bucket at or below this length is calibrated); ``bucket``: the prompt's bucket."""

    anomaly: bool
    bound_seconds: float | None
    bucket: int


class LatencyModel:
    """Calibrated TTFT lower bounds per (upstream, length bucket).

    ``quantile``: e.g. 0.001; ``margin``: multiplies the quantile (0.5 = half of it);
    ``min_samples``: samples before a bucket's bound counts; ``min_prompt_tokens``: shorter
    prompts are recorded but never flagged. ``relative_accuracy``: DDSketch's.
    """

    def __init__(
        self,
        *,
        quantile: float = 0.001,
        margin: float = 0.5,
        min_samples: int = 50,
        min_prompt_tokens: int = 512,
        relative_accuracy: float = 0.01,
    ) -> None:
        self.quantile = quantile
        self.margin = margin
        self.min_samples = min_samples
        self.min_prompt_tokens = min_prompt_tokens
        self.relative_accuracy = relative_accuracy
        self._sketches: dict[tuple[str, str, int], DDSketch] = {}

    def bound(self, upstream: str, prompt_tokens: int, kind: str = "whole") -> float | None:
        """The lower bound (seconds) for a prompt of this length, or ``None`` when uncalibrated.

        ``L(b)`` = the ``quantile`` of calibrated bucket ``b``; ``top`` = the largest ``L`` of the
        prompt's bucket and every shorter one; ``floor`` = the smallest ``L`` of the calibrated
        buckets shorter than ``top``'s (the fixed cost every request pays: network, queueing,
        first decode step), capped at ``0.8 x top``, else 0. The bound is
        ``floor + margin x (top - floor)``: the margin applies to the length-dependent part, so a
        fixed overhead (large in streamed TTFTs) cannot hide a prefill that did not happen.
        """
        levels: list[tuple[int, float]] = []
        for b in range(bucket_of(prompt_tokens) + 1):
            s = self._sketches.get((upstream, kind, b))
            if s is None or s.count < self.min_samples:
                continue
            q = s.get_quantile_value(self.quantile)
            if q is not None:
                levels.append((b, q))
        if not levels:
            return None
        top_b, top = max(levels, key=lambda x: (x[1], x[0]))
        shorter = [q for b, q in levels if b < top_b]
        floor = min(min(shorter), 0.8 * top) if shorter else 0.0
        return floor + self.margin * (top - floor)

    def record(self, upstream: str, prompt_tokens: int, ttft_seconds: float, kind: str = "whole") -> None:
        """Add a sample that was not an anomaly (anomalies are kept out of calibration)."""
        if ttft_seconds <= 0:
            return
        key = (upstream, kind, bucket_of(prompt_tokens))
        s = self._sketches.get(key)
        if s is None:
            s = self._sketches[key] = DDSketch(relative_accuracy=self.relative_accuracy)
        s.add(ttft_seconds)

    def observe(
        self, upstream: str, prompt_tokens: int, ttft_seconds: float | None, kind: str = "whole"
    ) -> LatencyVerdict:
        """Judge one TTFT (``kind``: ``stream`` or ``whole``) and, when it is no anomaly, add it
        to calibration."""
        b = bucket_of(prompt_tokens)
        if ttft_seconds is None or ttft_seconds < 0:
            return LatencyVerdict(False, None, b)
        bound = self.bound(upstream, prompt_tokens, kind)
        anomaly = prompt_tokens >= self.min_prompt_tokens and bound is not None and ttft_seconds < bound
        if not anomaly:
            self.record(upstream, prompt_tokens, ttft_seconds, kind)
        return LatencyVerdict(anomaly, bound, b)

    def samples(self, upstream: str, bucket: int, kind: str = "whole") -> int:
        """How many samples a bucket holds."""
        s = self._sketches.get((upstream, kind, bucket))
        return int(s.count) if s is not None else 0
