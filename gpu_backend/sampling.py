"""Sampling parameters and the sampler: greedy, or temperature + top-p with a per-request seed.

Sampling happens on CPU in fp32 with one ``torch.Generator`` per request, so a seeded request gives
the same tokens whatever else shares its batch (and on CPU or CUDA alike, given the same logits).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gpu_backend.errors import InvalidRequestError


@dataclass
class SamplingParams:
    """Per-request sampling (names as SGLang's ``SamplingParams``).

    ``max_new_tokens`` >= 1 (clamped at admission to what the context and pool allow, as SGLang);
    ``temperature`` 0 means greedy (argmax); ``top_p`` in (0, 1]; ``seed`` makes temperature
    sampling reproducible (``None``: drawn from the engine's seeded generator); ``stop``: strings
    that end the completion (excluded from the text, finish_reason ``stop``); ``stop_token_ids``:
    extra ids that end it; ``ignore_eos``: do not stop at ``<|im_end|>`` / ``<|endoftext|>``.
    """

    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def validate(self) -> None:
        """Raise :class:`~gpu_backend.errors.InvalidRequestError` (400) on out-of-range values."""
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise InvalidRequestError("max_new_tokens must be an integer >= 1.", param="max_tokens")
        if not 0.0 <= float(self.temperature) <= 100.0:
            raise InvalidRequestError("temperature must be in [0, 100].", param="temperature")
        if not 0.0 < float(self.top_p) <= 1.0:
            raise InvalidRequestError("top_p must be in (0, 1].", param="top_p")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop must be a list of non-empty strings.", param="stop")


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """Next token per row. ``logits``: [B, V] (any device/dtype); ``params``/``generators``: B each
    (a generator is needed for rows with temperature > 0). Returns B token ids.

    Greedy rows: ``argmax``. Other rows, each on CPU in fp32 with its own generator: softmax of
    ``logits / temperature``, keep the smallest prefix of tokens (by descending probability) whose
    mass reaches ``top_p`` (the top token always kept), renormalise, ``torch.multinomial``."""
    out = logits.argmax(dim=-1).tolist()
    for b, p in enumerate(params):
        if p.temperature <= 0.0:
            continue
        row = logits[b].float().cpu() / float(p.temperature)
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sp, si = probs.sort(descending=True)
            cum = sp.cumsum(0)
            keep = (cum - sp) < p.top_p
            keep[0] = True
            sp = torch.where(keep, sp, torch.zeros_like(sp))
            choice = torch.multinomial(sp / sp.sum(), 1, generator=generators[b])
            out[b] = int(si[choice])
        else:
            out[b] = int(torch.multinomial(probs, 1, generator=generators[b]))
    return out
