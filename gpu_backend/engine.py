"""The engine: model + paged KV pool + scheduler, stepped by a worker thread, driven from asyncio.

Public API (the contract between the engine core, issue 3, and the disaggregation layer, issue 4;
change it here first and keep both sides working):

- :class:`EngineConfig` — how to build an engine.
- :class:`TokenEvent` — one streamed token.
- :class:`PrefillResult` — what :meth:`Engine.prefill_export` hands to the transfer.
- :class:`Engine` — ``start``/``stop``; ``generate`` (single engine); ``abort``;
  ``prefill_export`` (prefill node); ``reserve``/``load_pages``/``decode_reserved``/``release``
  (decode node); ``server_info``/``pool_stats``.

Threading: every forward pass runs in one worker thread (``Scheduler.step`` in a loop), so the
asyncio event loop of the servers stays free. Calls into the engine come from the event loop;
results go back with ``loop.call_soon_threadsafe`` into per-request ``asyncio.Queue`` s.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import AsyncIterator

import torch

from gpu_backend.errors import (  # noqa: F401  (re-exported for callers)
    EngineError,
    InvalidRequestError,
    PoolExhaustedError,
    PromptTooLongError,
    RequestAbortedError,
    StaleHandleError,
    TransferMismatchError,
)
from gpu_backend.kv_pool import KVPool, PageHandle
from gpu_backend.sampling import SamplingParams

#: Faults the engine understands (test use only; see ``gpu_backend.faults``).
ENGINE_FAULTS = frozenset({"admit_rejected", "skip_transfer_check", "no_scrub"})


@dataclass
class EngineConfig:
    """How to build an :class:`Engine` (names follow DESIGN.md's backend flags / SGLang's server args).

    - ``model``: ``"tiny-random"`` (seeded Llama, cl100k+ChatML vocabulary 100,277), ``"copy-probe"``
      (the isolation oracle's model, DESIGN.md contracts) or a local Hugging Face Llama folder
      (``config.json`` + ``*.safetensors``).
    - ``device``: ``"auto"`` (CUDA when available, else CPU), ``"cpu"``, ``"cuda"``, ``"cuda:N"``.
    - ``context_length``: the model's context window in tokens.
    - ``page_size``: tokens per KV page.
    - ``max_total_tokens``: cap on the pool size in tokens (SGLang ``--max-total-tokens``).
    - ``mem_budget_bytes``: on CPU, stands in for free device memory (default 512 MiB); on CUDA,
      when set, it replaces the measured free memory.
    - ``mem_fraction_static``: share of free memory for weights + KV pool (SGLang's name).
    - ``pool_wait_timeout_seconds``: how long a request waits for pages before
      :class:`PoolExhaustedError` (503).
    - ``max_batch_tokens``: tokens per prefill step (longer prompts are prefilled in chunks, as
      SGLang's chunked prefill); ``max_running_requests``: sequences admitted at once.
    - ``seed``: seeds tiny-random weights and the sampler of requests without a seed.
    - ``dtype``: ``"float32"``, ``"float16"`` or ``"bfloat16"`` (weights and KV cache).
    - ``faults``: subset of ``{"admit_rejected", "skip_transfer_check", "no_scrub"}``, test use only.
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
    faults: frozenset[str] = frozenset()


@dataclass
class TokenEvent:
    """One generated token.

    ``text`` is the incremental UTF-8-safe text this token adds (may be ``""`` while a multi-byte
    character or a possible stop string is incomplete; EOS / stop tokens add no text; a matched stop
    string is cut out). ``finish_reason``: ``"stop"`` (EOS, stop id or stop string), ``"length"``
    (max_new_tokens) or ``"abort"``; ``None`` until ``finished``. ``prompt_tokens``: the prompt's
    token count (for a placeholder-admitted request, the original count, as the incident reported);
    ``completion_tokens``: tokens generated so far, this one included. An ``"abort"`` event carries
    ``token_id == -1`` and no text.
    """

    token_id: int
    text: str
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int


@dataclass
class PrefillResult:
    """What a prefill node sends to decode (issue 4 wraps it in a manifest).

    ``kv``: [num_pages, num_layers, 2, page_size, num_kv_heads, head_dim], contiguous, CPU, the pool
    dtype; positions past ``num_tokens`` in the last page are zeros. ``num_tokens``: tokens actually
    written (1 for a placeholder). ``first_token_id``: sampled from the last prompt position.
    ``prefill_seconds``: wall time from admission to the first token. ``placeholder``: the prompt was
    over the limit and replaced (``admit_rejected`` fault). ``original_prompt_tokens``: length of the
    prompt as received.
    """

    kv: torch.Tensor
    num_tokens: int
    first_token_id: int
    prefill_seconds: float
    placeholder: bool
    original_prompt_tokens: int


class Engine:
    """A single-process engine over one paged KV pool (nano-vllm style: Sequence, KVPool,
    Scheduler, ModelRunner).

    Attributes after ``__init__``: ``counter`` (the bundled ``TiktokenCounter``), ``eos_token_id``
    (``<|im_end|>`` 100265; ``<|endoftext|>`` 100257 also stops), ``max_total_num_tokens`` (pool size
    in tokens, a multiple of ``page_size``), ``max_req_input_len`` (= min(context_length - 1,
    max_total_num_tokens - 1) - 5, SGLang's), ``context_length``, ``page_size``, ``pool``
    (:class:`~gpu_backend.kv_pool.KVPool`), ``stats`` (step counters, see ``Scheduler.stats``).
    """

    def __init__(self, cfg: EngineConfig) -> None:
        """Build model + pool on the chosen device; pool size derived as SGLang does
        (:mod:`gpu_backend.pool_sizing`). Raises ``ValueError`` for bad config / unknown model /
        not enough memory for one page, ``FileNotFoundError`` for a missing checkpoint folder."""
        raise NotImplementedError

    def server_info(self) -> dict:
        """SGLang ``/server_info`` fields: ``max_total_num_tokens``, ``max_req_input_len``,
        ``context_length``, ``page_size``, ``disaggregation_mode`` (``"null"``; issue 4 overrides
        per role), ``status`` (``"ready"``/``"starting"``), ``version``, plus ``free_tokens`` /
        ``used_tokens`` read from the live pool and ``model_path``, ``device``."""
        raise NotImplementedError

    def pool_stats(self) -> dict:
        """``{"total_pages", "free_pages", "used_pages", "page_size"}`` from the live pool;
        ``free_pages + used_pages == total_pages`` always (invariant 4)."""
        raise NotImplementedError

    async def start(self) -> None:
        """Start the worker thread that steps the scheduler. Idempotent."""
        raise NotImplementedError

    async def stop(self) -> None:
        """Abort everything in flight (iterators end with ``"abort"``), free every page, join the
        worker thread (off the event loop). Idempotent."""
        raise NotImplementedError

    async def generate(self, request_id: str, prompt_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[TokenEvent]:
        """Prefill + decode one request; yields a :class:`TokenEvent` per token, the last with
        ``finished=True``.

        Admission happens on the first ``__anext__``: raises :class:`PromptTooLongError` (400, state
        REJECTED, terminal, nothing allocated) when ``len(prompt_ids) > max_req_input_len``;
        :class:`InvalidRequestError` (400) for an empty prompt, ids outside the model vocabulary or
        bad params; a duplicate live ``request_id`` is an InvalidRequestError too. While the pool is
        full the request waits; after ``pool_wait_timeout_seconds`` it raises
        :class:`PoolExhaustedError` (503). ``max_new_tokens`` is clamped to
        ``min(context_length - 1, max_total_num_tokens - 1) - prompt_tokens - 1`` (SGLang). Pages
        for prompt + max_new_tokens are allocated at admission. Closing the iterator early (client
        gone) aborts the request and frees its pages.
        """
        raise NotImplementedError
        yield  # pragma: no cover

    def abort(self, request_id: str) -> None:
        """Abort a request (waiting, prefilling, decoding or a reservation): every page is freed
        by the worker at the next step boundary; its iterator ends with a ``"abort"`` event.
        Unknown ids are ignored."""
        raise NotImplementedError

    def request_state(self, request_id: str) -> str | None:
        """State name of a live or recently retired request (``"waiting"``, ``"prefilling"``,
        ``"decoding"``, ``"finished"``, ``"rejected"``, ``"aborted"``), ``None`` if unknown."""
        raise NotImplementedError

    # ---- disaggregation hooks: prefill side -------------------------------------------------
    async def prefill_export(self, request_id: str, prompt_ids: list[int],
                             params: SamplingParams | None = None) -> PrefillResult:
        """Admit, prefill, copy the written pages out and free them.

        Admission: :class:`PromptTooLongError` unless the ``admit_rejected`` fault is on, in which
        case the prompt is replaced by the one-token placeholder ``[0]`` and admitted (SGLang's
        rejection path: ``origin_input_ids = [0]``). ``params`` (default greedy) picks the first
        token. Waits for pages like ``generate`` (:class:`PoolExhaustedError` after the timeout).
        Cancelling the await aborts the request and frees its pages.
        """
        raise NotImplementedError

    # ---- disaggregation hooks: decode side --------------------------------------------------
    async def reserve(self, request_id: str, prompt_tokens: int, max_new_tokens: int) -> list[PageHandle]:
        """Reserve ceil((prompt_tokens + max_new_tokens) / page_size) pages for ``request_id``.
        Waits while the pool is momentarily full; :class:`PoolExhaustedError` (503) after
        ``pool_wait_timeout_seconds`` (never a 400). :class:`InvalidRequestError` for a duplicate id
        or non-positive sizes."""
        raise NotImplementedError

    def load_pages(self, request_id: str, kv: torch.Tensor, num_tokens: int) -> None:
        """Write received pages into the reservation, page i into handle i.
        ``kv``: [n, num_layers, 2, page_size, num_kv_heads, head_dim] (any device/dtype; cast to the
        pool's). Raises ``KeyError`` for an unknown reservation, ``ValueError`` for a shape that does
        not fit (more pages than reserved, wrong dims, ``num_tokens > n * page_size``),
        :class:`StaleHandleError` through a stale handle."""
        raise NotImplementedError

    async def decode_reserved(self, request_id: str, prompt_ids: list[int], first_token_id: int,
                              params: SamplingParams, context_tokens: int) -> AsyncIterator[TokenEvent]:
        """Generate from a reservation whose first ``context_tokens`` positions hold the prompt's KV.

        Yields the event of ``first_token_id`` first (completion_tokens 1; it may already finish the
        request: EOS, stop, max_new_tokens 1), then one event per decoded token; the decode step j
        feeds the previous token at position ``context_tokens + j - 1`` and attends over positions
        ``0 .. context_tokens + j - 1`` of the reservation's pages. ``prompt_tokens`` of the events
        is ``len(prompt_ids)``. Frees the reservation when finished or aborted (also when the
        iterator is closed early). Raises ``KeyError`` for an unknown reservation,
        :class:`InvalidRequestError` when ``context_tokens + max_new_tokens`` exceeds it;
        :class:`StaleHandleError` if a handle went stale (unless ``no_scrub``).
        """
        raise NotImplementedError
        yield  # pragma: no cover

    def release(self, request_id: str) -> None:
        """Free a reservation (or abort the decode running on it). Idempotent; unknown ids ignored."""
        raise NotImplementedError
