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
import collections
import contextlib
import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator

import torch

from gpu_backend import pool_sizing
from gpu_backend.model_runner import ModelRunner
from gpu_backend.scheduler import Scheduler
from gpu_backend.sequence import Sequence, SeqState
from gpu_backend.weights import DTYPES, build_model, weight_bytes
from tokenizer import bundled_counter

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

log = logging.getLogger("gpu_backend.engine")

#: Version reported by ``server_info``.
VERSION = "kvgate-backend-0.1.0"
#: ``<|endoftext|>`` of cl100k_base; also ends a completion (with ``<|im_end|>``).
ENDOFTEXT_ID = 100257
#: Retired requests remembered by ``request_state``.
RETIRED_MEMORY = 8192
#: The one-token prompt an over-length prompt is replaced with under ``admit_rejected`` (SGLang's
#: rejection path sets ``origin_input_ids = [0]``).
PLACEHOLDER_PROMPT = [0]

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
        unknown = set(cfg.faults) - ENGINE_FAULTS
        if unknown:
            raise ValueError(f"unknown faults {sorted(unknown)}")
        if cfg.dtype not in DTYPES:
            raise ValueError(f"dtype '{cfg.dtype}' not one of {sorted(DTYPES)}")
        if cfg.page_size < 1 or cfg.context_length < 16:
            raise ValueError("page_size must be >= 1 and context_length >= 16")
        self.cfg = cfg
        self.faults = frozenset(cfg.faults)
        self.device = _resolve_device(cfg.device)
        self.dtype = DTYPES[cfg.dtype]
        self.context_length = cfg.context_length
        self.page_size = cfg.page_size
        free_bytes = pool_sizing.free_device_memory(self.device, cfg.mem_budget_bytes)
        self.model = build_model(cfg.model, cfg.context_length, cfg.seed, self.dtype, self.device)
        self.weight_bytes = weight_bytes(self.model)
        layers, kv_heads, head_dim = self.model.kv_geometry
        cell = pool_sizing.kv_cell_bytes(layers, kv_heads, head_dim, self.dtype)
        self.max_total_num_tokens = pool_sizing.max_total_num_tokens(
            free_bytes, self.weight_bytes, cell, cfg.mem_fraction_static, cfg.page_size, cfg.max_total_tokens
        )
        self.max_req_len = min(cfg.context_length - 1, self.max_total_num_tokens - 1)
        self.max_req_input_len = pool_sizing.max_req_input_len(cfg.context_length, self.max_total_num_tokens)
        if self.max_req_input_len < 1:
            raise ValueError(f"pool of {self.max_total_num_tokens} tokens leaves no room for a prompt")
        self.pool = KVPool(
            self.max_total_num_tokens // cfg.page_size,
            cfg.page_size,
            layers,
            kv_heads,
            head_dim,
            self.dtype,
            self.device,
            scrub="no_scrub" not in self.faults,
        )
        self.counter = bundled_counter()
        self.eos_token_id = self.counter.im_end_id
        self.eos_ids = {self.counter.im_end_id, ENDOFTEXT_ID}
        self.vocab_size = int(getattr(getattr(self.model, "config", None), "vocab_size", 0) or self.model.vocab_size)
        enc = self.counter.encoding
        bias = torch.full((self.vocab_size,), float("-inf"))
        valid = [i for i in range(min(self.vocab_size, enc.n_vocab)) if self.counter.is_valid_id(i)]
        bias[torch.tensor(valid, dtype=torch.long)] = 0.0
        self._token_bytes_cache: dict[int, bytes] = {}
        self.runner = ModelRunner(self.model, self.pool, bias)
        self.scheduler = Scheduler(
            self.runner,
            self.pool,
            max_batch_tokens=cfg.max_batch_tokens,
            max_running_requests=cfg.max_running_requests,
            pool_wait_timeout_seconds=cfg.pool_wait_timeout_seconds,
            token_bytes=self._token_bytes,
            eos_ids=self.eos_ids,
            make_event=_make_event,
            on_retire=self._on_retire,
        )
        self.stats = self.scheduler.stats
        self._rng = torch.Generator().manual_seed(cfg.seed)
        self._live: dict[str, Sequence] = {}
        self._retired: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._reservations: dict[str, _Reservation] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._ready = False

    # ---- info --------------------------------------------------------------------------------
    def server_info(self) -> dict:
        """SGLang ``/server_info`` fields: ``max_total_num_tokens``, ``max_req_input_len``,
        ``context_length``, ``page_size``, ``disaggregation_mode`` (``"null"``; issue 4 overrides
        per role), ``status`` (``"starting"`` before ``start``, ``"ready"``, ``"stopped"``), ``version``, plus ``free_tokens`` /
        ``used_tokens`` read from the live pool and ``model_path``, ``device``."""
        st = self.pool.stats()
        return {
            "max_total_num_tokens": self.max_total_num_tokens,
            "max_req_input_len": self.max_req_input_len,
            "context_length": self.context_length,
            "page_size": self.page_size,
            "disaggregation_mode": "null",
            "status": "ready" if self._ready else ("stopped" if self._stopping else "starting"),
            "version": VERSION,
            "model_path": self.cfg.model,
            "device": str(self.device),
            "free_tokens": st["free_pages"] * self.page_size,
            "used_tokens": st["used_pages"] * self.page_size,
        }

    def pool_stats(self) -> dict:
        """``{"total_pages", "free_pages", "used_pages", "page_size"}`` from the live pool;
        ``free_pages + used_pages == total_pages`` always (invariant 4)."""
        return self.pool.stats()

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the worker thread that steps the scheduler. Idempotent."""
        if self._thread is not None:
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._worker, name="kvgate-engine", daemon=True)
        self._thread.start()
        self._ready = True

    async def stop(self) -> None:
        """Abort everything in flight (iterators end with ``"abort"``), free every page, join the
        worker thread (off the event loop). Idempotent."""
        if self._thread is None:
            return
        self._ready = False
        self._stopping = True
        self.scheduler.submit("abort_all", None)
        thread, self._thread = self._thread, None
        await asyncio.to_thread(thread.join)
        for rid in list(self._reservations):
            self.release(rid)

    def _worker(self) -> None:
        sched = self.scheduler
        while True:
            if self._stopping:
                sched.submit("abort_all", None)
                sched.step()
                return
            try:
                ran = sched.step()
            except Exception:  # never let the worker die: the step already failed its batch
                log.exception("scheduler step failed")
                ran = False
            if not ran:
                with sched.cond:
                    if not sched._inbox and not self._stopping:
                        sched.cond.wait(timeout=0.02 if sched.waiting else 0.5)

    # ---- single-engine path ------------------------------------------------------------------
    async def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[TokenEvent]:
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
        queue: asyncio.Queue = asyncio.Queue()
        seq = self._admit(request_id, prompt_ids, params, _emitter(queue), pages_for_output=True)
        self.scheduler.submit("add", seq)
        async with contextlib.aclosing(self._drain(seq, queue)) as events:  # closing us closes it now
            async for ev in events:
                yield ev

    async def _drain(self, seq: Sequence, queue: asyncio.Queue) -> AsyncIterator[TokenEvent]:
        done = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                if item.finished:
                    done = True
                yield item
                if done:
                    return
        finally:
            if not done:
                self.abort(seq.request_id)

    def _admit(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        emit,
        *,
        pages_for_output: bool,
        placeholder_ok: bool = False,
    ) -> Sequence:
        """Validate and build a WAITING sequence (nothing allocated). A prompt over
        ``max_req_input_len`` is REJECTED here (terminal) and its PromptTooLongError raised."""
        if not self._ready:
            raise RequestAbortedError("engine is not running", request_id=request_id, status=503)
        if request_id in self._live or request_id in self._reservations:
            raise InvalidRequestError(f"request id '{request_id}' is already in flight", request_id=request_id)
        params.validate()
        prompt_ids = list(prompt_ids)
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty", request_id=request_id, param="prompt")
        for t in prompt_ids:
            if (
                not isinstance(t, int)
                or isinstance(t, bool)
                or not 0 <= t < self.vocab_size
                or not self.counter.is_valid_id(t)
            ):
                raise InvalidRequestError(
                    f"token id {t!r} is not in the model's vocabulary", request_id=request_id, param="prompt"
                )
        original = len(prompt_ids)
        if original > self.max_req_input_len:
            if not placeholder_ok:
                seq = Sequence(request_id, prompt_ids, params, emit)
                seq.error = PromptTooLongError(original, self.max_req_input_len, request_id=request_id)
                seq.set_state(SeqState.REJECTED)
                self._on_retire(seq)
                raise seq.error
            prompt_ids = list(PLACEHOLDER_PROMPT)
        max_new = min(params.max_new_tokens, self.max_req_len - len(prompt_ids) - 1)
        params = dataclasses.replace(
            params, max_new_tokens=max_new, stop=list(params.stop), stop_token_ids=list(params.stop_token_ids)
        )
        seq = Sequence(request_id, prompt_ids, params, emit, reported_prompt_tokens=original)
        seq.stop_token_ids = set(params.stop_token_ids)
        seq.generator = self._generator(params)
        seq.pages_needed = self.pool.pages_for(len(prompt_ids) + (max_new if pages_for_output else 0))
        self._live[request_id] = seq
        return seq

    def _generator(self, params: SamplingParams) -> torch.Generator | None:
        if params.temperature <= 0.0:
            return None
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self._rng))
        return torch.Generator().manual_seed(seed)

    def abort(self, request_id: str) -> None:
        """Abort a request (waiting, prefilling, decoding or a reservation): every page is freed
        by the worker at the next step boundary; its iterator ends with a ``"abort"`` event.
        Unknown ids are ignored."""
        if request_id in self._reservations:
            self.release(request_id)
            return
        if request_id in self._live:
            self.scheduler.submit("abort", request_id)

    def request_state(self, request_id: str) -> str | None:
        """State name of a live or recently retired request (``"waiting"``, ``"prefilling"``,
        ``"decoding"``, ``"finished"``, ``"rejected"``, ``"aborted"``), ``None`` if unknown."""
        seq = self._live.get(request_id)
        if seq is not None:
            return seq.state.value
        if request_id in self._reservations:
            return "reserved"
        return self._retired.get(request_id)

    def _on_retire(self, seq: Sequence) -> None:
        # may run in the worker thread; dict ops are atomic under the GIL
        if self._live.get(seq.request_id) is seq:
            self._live.pop(seq.request_id, None)
        self._retired[seq.request_id] = seq.state.value
        while len(self._retired) > RETIRED_MEMORY:
            self._retired.popitem(last=False)

    def _token_bytes(self, token_id: int) -> bytes:
        b = self._token_bytes_cache.get(token_id)
        if b is None:
            try:
                b = self.counter.encoding.decode_single_token_bytes(token_id)
            except KeyError:
                b = b""
            self._token_bytes_cache[token_id] = b
        return b

    # ---- disaggregation hooks: prefill side -------------------------------------------------
    async def prefill_export(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams | None = None
    ) -> PrefillResult:
        """Admit, prefill, copy the written pages out and free them.

        Admission: :class:`PromptTooLongError` unless the ``admit_rejected`` fault is on, in which
        case the prompt is replaced by the one-token placeholder ``[0]`` and admitted (SGLang's
        rejection path: ``origin_input_ids = [0]``). ``params`` (default greedy) picks the first
        token. Waits for pages like ``generate`` (:class:`PoolExhaustedError` after the timeout).
        Cancelling the await aborts the request and frees its pages.
        """
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        t0 = time.monotonic()
        original = len(prompt_ids)
        params = params or SamplingParams(max_new_tokens=1)
        seq = self._admit(
            request_id,
            prompt_ids,
            dataclasses.replace(params, max_new_tokens=1),
            _future_setter(loop, fut),
            pages_for_output=False,
            placeholder_ok="admit_rejected" in self.faults,
        )
        placeholder = seq.prompt_ids != list(prompt_ids)
        pool = self.pool

        def export(s: Sequence) -> PrefillResult:  # worker thread, before the pages are freed
            n = s.num_context_tokens
            kv = pool.read_pages(s.pages[: pool.pages_for(n)])
            return PrefillResult(
                kv=kv,
                num_tokens=n,
                first_token_id=s.completion_ids[0],
                prefill_seconds=time.monotonic() - t0,
                placeholder=placeholder,
                original_prompt_tokens=original,
            )

        seq.on_prefilled = export
        self.scheduler.submit("add", seq)
        try:
            result = await asyncio.shield(fut)
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        if isinstance(result, BaseException):
            raise result
        return result

    # ---- disaggregation hooks: decode side --------------------------------------------------
    async def reserve(self, request_id: str, prompt_tokens: int, max_new_tokens: int) -> list[PageHandle]:
        """Reserve ceil((prompt_tokens + max_new_tokens) / page_size) pages for ``request_id``.
        Waits while the pool is momentarily full; :class:`PoolExhaustedError` (503) after
        ``pool_wait_timeout_seconds`` (never a 400). :class:`InvalidRequestError` for a duplicate id
        or non-positive sizes."""
        if prompt_tokens < 1 or max_new_tokens < 1:
            raise InvalidRequestError("prompt_tokens and max_new_tokens must be >= 1", request_id=request_id)
        if request_id in self._reservations or request_id in self._live:
            raise InvalidRequestError(f"request id '{request_id}' is already in flight", request_id=request_id)
        n = self.pool.pages_for(prompt_tokens + max_new_tokens)
        deadline = time.monotonic() + self.cfg.pool_wait_timeout_seconds
        while True:
            pages = self.pool.try_alloc(n, request_id)
            if pages is not None:
                break
            if time.monotonic() >= deadline:
                raise PoolExhaustedError(
                    f"KV pool full: no room for {n} pages ({n * self.page_size} tokens) within "
                    f"{self.cfg.pool_wait_timeout_seconds:g} s; retry later",
                    request_id=request_id,
                )
            await asyncio.sleep(0.005)
        self._reservations[request_id] = _Reservation(pages, prompt_tokens, max_new_tokens)
        return list(pages)

    def load_pages(self, request_id: str, kv: torch.Tensor, num_tokens: int) -> None:
        """Write received pages into the reservation, page i into handle i.
        ``kv``: [n, num_layers, 2, page_size, num_kv_heads, head_dim] (any device/dtype; cast to the
        pool's). Raises ``KeyError`` for an unknown reservation, ``ValueError`` for a shape that does
        not fit (more pages than reserved, wrong dims, ``num_tokens > n * page_size``),
        :class:`StaleHandleError` through a stale handle."""
        res = self._reservations[request_id]
        n = int(kv.shape[0]) if kv.dim() > 0 else 0
        if n < 1 or n > len(res.pages):
            raise ValueError(f"{n} pages received, {len(res.pages)} reserved")
        if not 0 < num_tokens <= n * self.page_size:
            raise ValueError(f"num_tokens {num_tokens} does not fit {n} pages of {self.page_size}")
        self.pool.write_pages(res.pages[:n], kv)
        res.loaded_tokens = num_tokens

    async def decode_reserved(
        self, request_id: str, prompt_ids: list[int], first_token_id: int, params: SamplingParams, context_tokens: int
    ) -> AsyncIterator[TokenEvent]:
        """Generate from a reservation whose first ``context_tokens`` positions hold the prompt's KV.

        Yields the event of ``first_token_id`` first (completion_tokens 1; it may already finish the
        request: EOS, stop, max_new_tokens 1), then one event per decoded token; the decode step j
        feeds the previous token at position ``context_tokens + j - 1`` and attends over positions
        ``0 .. context_tokens + j - 1`` of the reservation's pages. ``prompt_tokens`` of the events
        is ``len(prompt_ids)``. Frees the reservation when finished or aborted (also when the
        iterator is closed early). Raises (on the first ``__anext__``, the reservation then freed)
        ``KeyError`` for an unknown reservation, :class:`InvalidRequestError` when
        ``context_tokens + max_new_tokens`` exceeds it, :class:`StaleHandleError` if a handle went
        stale (unless ``no_scrub``), and :class:`TransferMismatchError` when ``context_tokens`` differs
        from the ``num_tokens`` given to ``load_pages`` (invariant 2 held by the engine too; the
        ``skip_transfer_check`` fault lifts this check).
        """
        res = self._reservations.pop(request_id)
        try:
            params.validate()
            if not self._ready:
                raise RequestAbortedError("engine is not running", request_id=request_id, status=503)
            if not 1 <= context_tokens <= self.max_req_len - 1:
                raise InvalidRequestError(f"context_tokens {context_tokens} out of range", request_id=request_id)
            max_new = min(params.max_new_tokens, self.max_req_len - context_tokens - 1)
            if context_tokens + max_new - 1 > len(res.pages) * self.page_size:
                raise InvalidRequestError(
                    f"reservation of {len(res.pages) * self.page_size} tokens cannot hold {context_tokens} "
                    f"context + {max_new} new tokens",
                    request_id=request_id,
                )
            self.pool.check(res.pages)
            if context_tokens != res.loaded_tokens and "skip_transfer_check" not in self.faults:
                raise TransferMismatchError(
                    f"decode over {context_tokens} context tokens but {res.loaded_tokens} were loaded into the "
                    f"reservation; nothing is generated",
                    request_id=request_id,
                )
        except BaseException:
            self.pool.free(res.pages, ignore_stale=True)
            raise
        params = dataclasses.replace(
            params, max_new_tokens=max_new, stop=list(params.stop), stop_token_ids=list(params.stop_token_ids)
        )
        queue: asyncio.Queue = asyncio.Queue()
        seq = Sequence(request_id, prompt_ids, params, _emitter(queue), reported_prompt_tokens=len(prompt_ids))
        seq.stop_token_ids = set(params.stop_token_ids)
        seq.generator = self._generator(params)
        seq.num_context_tokens = context_tokens
        seq.num_cached = context_tokens
        seq.pages = list(res.pages)
        seq.pages_needed = len(res.pages)
        self._live[request_id] = seq
        text, reason = seq.append_token(first_token_id, self._token_bytes(first_token_id), self.eos_ids)
        if reason is not None:
            seq.set_state(SeqState.DECODING)
            seq.set_state(SeqState.FINISHED)
            seq.finish_reason = reason
            self.pool.free(seq.pages, ignore_stale=True)
            seq.pages = []
            self._on_retire(seq)
            yield _make_event(seq, first_token_id, text, reason)
            return
        self.scheduler.submit("add_decoding", seq)
        first = _make_event(seq, first_token_id, text, None)
        done = False
        try:
            yield first
            async with contextlib.aclosing(self._drain(seq, queue)) as events:
                async for ev in events:
                    yield ev
            done = True
        finally:
            if not done:
                self.abort(request_id)

    def release(self, request_id: str) -> None:
        """Free a reservation (or abort the decode running on it). Idempotent; unknown ids ignored."""
        res = self._reservations.pop(request_id, None)
        if res is not None:
            self.pool.free(res.pages, ignore_stale=True)
            self.scheduler.submit("wake", None)
            return
        seq = self._live.get(request_id)
        if seq is not None and seq.on_prefilled is None:
            self.scheduler.submit("abort", request_id)


@dataclass
class _Reservation:
    pages: list[PageHandle]
    prompt_tokens: int
    max_new_tokens: int
    loaded_tokens: int = 0


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    return dev


def _make_event(seq: Sequence, token_id: int, text: str, finish_reason: str | None) -> TokenEvent:
    return TokenEvent(
        token_id=token_id,
        text=text,
        finished=finish_reason is not None,
        finish_reason=finish_reason,
        prompt_tokens=seq.reported_prompt_tokens,
        completion_tokens=len(seq.completion_ids),
    )


def _emitter(queue: asyncio.Queue):
    """An ``emit`` for the worker thread: hands items to ``queue`` on its event loop."""
    loop = asyncio.get_running_loop()

    def emit(item: object) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # loop closed: nobody is listening any more
            pass

    return emit


def _future_setter(loop: asyncio.AbstractEventLoop, fut: asyncio.Future):
    def set_result(item: object) -> None:
        def _set() -> None:
            if not fut.done():
                fut.set_result(item)

        try:
            loop.call_soon_threadsafe(_set)
        except RuntimeError:
            pass

    return set_result
