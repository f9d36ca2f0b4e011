"""Sampling parameters and the sampler: greedy, or temperature + top-p with a per-request seed.

Sampling happens on CPU in fp32 with one ``torch.Generator`` per request, so a seeded request gives
the same tokens whatever else shares its batch (and on CPU or CUDA alike, given the same logits).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from gpu_backend.errors import InvalidRequestError

#: a temperature above 0 but below this samples at this (vLLM's ``_MAX_TEMP`` and
#: ``SamplingParams.__post_init__``, vllm/sampling_params.py): ``logits / 1e-300`` overflows to
#: +-inf, softmax to NaN, and ``torch.multinomial`` raises, failing the whole decode batch
MIN_TEMPERATURE = 1e-2
#: most ``stop`` strings, longest one and all together in UTF-8 bytes: every decode step scans
#: the new text against each string on the engine's one worker thread (the gateway's caps,
#: gateway/admission/checks.py ``MAX_STOPS``, ``MAX_STOP_BYTES``, ``MAX_STOP_TOTAL_BYTES``)
MAX_STOPS = 16
MAX_STOP_BYTES = 1024
MAX_STOP_TOTAL_BYTES = 4096
#: the seeds a ``torch.Generator`` takes (``manual_seed`` raises ``ValueError`` outside them)
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1


@dataclass
class SamplingParams:
    """Per-request sampling (names as SGLang's ``SamplingParams``).

    ``max_new_tokens`` >= 1 (clamped at admission to what the context and pool allow, as SGLang);
    ``temperature`` 0 means greedy (argmax), one above 0 samples at least at
    :data:`MIN_TEMPERATURE` (as vLLM); ``top_p`` in (0, 1]; ``seed`` makes temperature
    sampling reproducible (an int in [:data:`MIN_SEED`, :data:`MAX_SEED`]; ``None``: drawn from the
    engine's seeded generator); ``stop``: strings
    that end the completion (excluded from the text, finish_reason ``stop``; at most
    :data:`MAX_STOPS`, see :meth:`validate`); ``stop_token_ids``:
    extra ids that end it; ``ignore_eos``: do not stop at ``<|im_end|>`` / ``<|endoftext|>``.
    """

    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def clamped(self, max_new_tokens: int) -> SamplingParams:
        """A copy (own lists) with ``max_new_tokens`` at most ``max_new_tokens`` (SGLang clamps it to
        what fits the context)."""
        n = min(self.max_new_tokens, max_new_tokens)
        return dataclasses.replace(
            self, max_new_tokens=n, stop=list(self.stop), stop_token_ids=list(self.stop_token_ids)
        )

    def validate(self) -> None:
        """Raise :class:`~gpu_backend.errors.InvalidRequestError` (400) on ill-typed or out-of-range
        values (never a TypeError that would surface as a 500)."""

        def bad(msg: str, param: str) -> InvalidRequestError:
            return InvalidRequestError(msg, param=param)

        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise bad("max_new_tokens must be an integer >= 1.", "max_tokens")
        if not _is_num(self.temperature) or not 0.0 <= float(self.temperature) <= 100.0:
            raise bad("temperature must be a number in [0, 100].", "temperature")
        if not _is_num(self.top_p) or not 0.0 < float(self.top_p) <= 1.0:
            raise bad("top_p must be a number in (0, 1].", "top_p")
        if self.seed is not None and not (_is_int(self.seed) and MIN_SEED <= self.seed <= MAX_SEED):
            raise bad(f"seed must be an integer in [{MIN_SEED}, {MAX_SEED}].", "seed")
        if not isinstance(self.stop, list) or any(not isinstance(x, str) or not x for x in self.stop):
            raise bad("stop must be a list of non-empty strings.", "stop")
        sizes = [len(x.encode("utf-8", "surrogatepass")) for x in self.stop]
        if len(sizes) > MAX_STOPS or any(n > MAX_STOP_BYTES for n in sizes) or sum(sizes) > MAX_STOP_TOTAL_BYTES:
            raise bad(
                f"stop takes at most {MAX_STOPS} strings of at most {MAX_STOP_BYTES} bytes each, "
                f"{MAX_STOP_TOTAL_BYTES} bytes in all.",
                "stop",
            )
        if not isinstance(self.stop_token_ids, list) or not all(_is_int(t) for t in self.stop_token_ids):
            raise bad("stop_token_ids must be a list of integers.", "stop_token_ids")


def sampling_params(params: dict[str, Any]) -> SamplingParams:
    """Build and validate :class:`SamplingParams` from the router's dict (400 on bad values)."""
    allowed = set(SamplingParams.__dataclass_fields__)
    unknown = sorted(set(params) - allowed)
    if unknown:
        raise InvalidRequestError(f"unknown sampling parameter(s): {', '.join(unknown)}", param="sampling_params")
    try:
        sp = SamplingParams(**params)
    except TypeError as e:
        raise InvalidRequestError(f"bad sampling parameters: {e}", param="sampling_params") from e
    sp.validate()
    return sp


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v  # NaN is not a number here


def sample_seed(params: SamplingParams, rng: torch.Generator) -> int | None:
    """The seed of a request's draws: ``None`` for greedy (``temperature <= 0``), else
    ``params.seed`` or, without one, a draw from ``rng`` (the engine's seeded generator)."""
    if params.temperature <= 0.0:
        return None
    return params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,), generator=rng))


_MASK64 = 2**64 - 1


def draw_generator(seed: int, position: int) -> torch.Generator:
    """The generator of one draw: seeded by a request's ``seed`` mixed with the ``position`` of
    the token drawn (splitmix64), so a draw depends on where the token is, not on the draws
    before it. SGLang keys its seeded sampling noise the same way (``multinomial_with_seed`` in
    ``srt/layers/sampler.py``: a hash of seed and position). A disaggregated request thus draws
    what one engine would: prefill draws the first token, decode the rest, each node from the
    request's seed alone, and no two positions share their noise."""
    x = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return torch.Generator().manual_seed(x ^ (x >> 31))


def sample(
    logits: torch.Tensor, params: list[SamplingParams], seeds: list[int | None], positions: list[int]
) -> list[int]:
    """Next token per row. ``logits``: [B, V] (any device/dtype); ``params``, ``seeds``
    (:func:`sample_seed`; needed for rows with temperature > 0) and ``positions`` (the position
    of the token each row draws): B each. Returns B token ids.

    Greedy rows: ``argmax``. Other rows, each on CPU in fp32 with its own generator
    (:func:`draw_generator`): softmax of ``logits / max(temperature, MIN_TEMPERATURE)``, keep
    the smallest prefix of tokens (by descending probability) whose mass reaches ``top_p`` (the
    top token always kept), renormalise, ``torch.multinomial``."""
    out = logits.argmax(dim=-1).tolist()
    for b, p in enumerate(params):
        if p.temperature <= 0.0:
            continue
        seed = seeds[b]
        assert seed is not None, "a sampled row needs its request's seed"
        gen = draw_generator(seed, positions[b])
        row = logits[b].float().cpu() / max(float(p.temperature), MIN_TEMPERATURE)
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sp, si = probs.sort(descending=True)
            cum = sp.cumsum(0)
            keep = (cum - sp) < p.top_p
            keep[0] = True
            sp = torch.where(keep, sp, torch.zeros_like(sp))
            choice = torch.multinomial(sp / sp.sum(), 1, generator=gen)
            out[b] = int(si[choice])
        else:
            out[b] = int(torch.multinomial(probs, 1, generator=gen))
    return out
