"""How to build an :class:`~gpu_backend.engine.Engine`: :class:`EngineConfig` and the device rule."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_backend.faults import NO_FAULTS, Faults
from gpu_backend.weights import DTYPES


@dataclass
class EngineConfig:
    """How to build an :class:`Engine` (names follow docs/design.md's backend flags / SGLang's server args).

    ``model``: ``"tiny-random"`` (seeded Llama, cl100k+ChatML vocabulary 100,277), ``"copy-probe"``
    (the isolation oracle's model) or a local Hugging Face Llama folder. ``device``: ``"auto"``,
    ``"cpu"``, ``"cuda"``, ``"cuda:N"``. ``context_length``: tokens; ``page_size``: tokens per KV
    page; ``max_total_tokens``: pool cap (SGLang ``--max-total-tokens``); ``mem_budget_bytes``:
    replaces the measured free memory (:mod:`gpu_backend.pool_sizing`);
    ``mem_fraction_static``: share of free memory for weights + pool; ``pool_wait_timeout_seconds``:
    wait for pages before :class:`PoolExhaustedError` (503); ``max_batch_tokens``: tokens per
    prefill step (chunked prefill beyond); ``max_running_requests``: sequences admitted at once;
    ``seed``: tiny-random weights and unseeded sampling; ``dtype``: ``float32``/``float16``/
    ``bfloat16``; ``packed_weights``: on the CPU, multiply a few rows (a decode batch, the logits)
    by MKL-packed copies of the weights (:mod:`gpu_backend.packed_linear`: faster, the weights'
    memory again, counted before the pool is sized); ``faults``: the test-only
    :class:`~gpu_backend.faults.Faults` switches.
    """

    model: str = "tiny-random"
    device: str = "auto"
    context_length: int = 8192
    page_size: int = 16
    max_total_tokens: int | None = None
    mem_budget_bytes: int | None = None
    mem_fraction_static: float = 0.88
    pool_wait_timeout_seconds: float = 10.0
    max_batch_tokens: int = 4096
    max_running_requests: int = 256
    seed: int = 0
    dtype: str = "float32"
    packed_weights: bool = True
    faults: Faults = NO_FAULTS

    def check(self) -> None:
        """``ValueError`` for an unknown dtype, ``page_size < 1`` or ``context_length < 16``."""
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype '{self.dtype}' not one of {sorted(DTYPES)}")
        if self.page_size < 1 or self.context_length < 16:
            raise ValueError("page_size must be >= 1 and context_length >= 16")


def resolve_device(name: str) -> torch.device:
    """``auto`` -> CUDA when available, else CPU; ``ValueError`` for CUDA without CUDA."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    return dev
