"""The engine: model + paged KV pool + scheduler, stepped by one worker thread, driven from asyncio.

:meth:`Engine.step` is nano-vllm's ``LLMEngine.step``: schedule -> run -> postprocess. The worker
thread calls it in a loop; the asyncio side only builds validated sequences and sends typed messages
(:mod:`gpu_backend.messages`), so every page is allocated and freed on the worker. Typed replies
(:mod:`gpu_backend.replies`) come back with ``loop.call_soon_threadsafe`` into per-request queues or futures.

A forward pass that raises fails only the requests that fail on their own: its rows are run again
in halves (:func:`bisect_rows`), the rows that pass go on, and each row that fails alone gets its
own error (pages freed); the engine keeps running.

Public API: :class:`Engine` (``start``/``stop``/``step``, ``generate``, ``abort``, ``request_state``,
``server_info``/``pool_stats``/``check_integrity``; for the role flows in :mod:`gpu_backend.prefill_node`
and :mod:`gpu_backend.decode_node`: ``admit``, ``register``, ``submit``, ``sample_seed``,
``max_new_tokens_for``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import torch

from gpu_backend import pool_sizing
from gpu_backend.bridge import emitter, queue_tokens
from gpu_backend.engine_config import EngineConfig, resolve_device
from gpu_backend.errors import PromptTooLongError, RequestAbortedError
from gpu_backend.kv_pool import KVPool
from gpu_backend.messages import Abort, AddRequest, Message
from gpu_backend.model_runner import ModelRunner, vocab_bias
from gpu_backend.replies import Reply, ReplyTo
from gpu_backend.sampling import SamplingParams, sample_seed
from gpu_backend.scheduler import Batch, Scheduler
from gpu_backend.sequence import ExportSequence, PageReservation, RequestTable, SeqState, Sequence, check_prompt_ids
from gpu_backend.vocab import Vocab, vocab_for
from gpu_backend.weights import DTYPES, shared_or_built, weight_bytes
from gpu_backend.wire import Token

log = logging.getLogger("gpu_backend.engine")

VERSION = "kvgate-backend-0.1.0"
RETIRED_MEMORY = 8192  # retired requests remembered by ``request_state``
#: The one-token prompt an over-length prompt becomes under ``admit_rejected`` (SGLang's rejection
#: path sets ``origin_input_ids = [0]``).
PLACEHOLDER_PROMPT = [0]
T = TypeVar("T")


#: ``ModelRunner.run``'s shape: (sequence, new tokens) pairs and their sample flags -> a token or
#: ``None`` per pair.
RunRows = Callable[[list[tuple[Sequence, int]], list[bool]], list[int | None]]


def bisect_rows(run: RunRows, batch: Batch, err: Exception) -> tuple[dict[int, int | None], dict[int, Exception]]:
    """The rows of ``batch`` that fail on their own, found after its pass raised ``err``.

    The rows are run again (``run``) in halves, and a half that raises is halved again down to
    single rows (the bisection of delta debugging). Returns ``(ran, failed)``: ``ran`` maps the
    index of each row whose last pass succeeded to its token (``None`` where not sampled);
    ``failed`` maps the index of each row that raised alone to its error (a batch of one is not
    run again: ``err``). Cost in extra passes: about ``2 log2 B`` for one bad row among ``B``;
    ``2B - 2`` for a fault every row meets alone (out of memory, a lost device), which fails them all.

    Running rows again is safe: ``ModelRunner.run`` reads the sequences only (``postprocess``
    advances them), a pass writes each row's K/V into that row's own pages at the same positions
    (a later pass over the row overwrites what an earlier, failed one wrote), and each sampled
    token is drawn from a generator made for that draw from the request's seed and the token's
    position (:func:`~gpu_backend.sampling.draw_generator`), so no state moves between passes.
    """
    ran: dict[int, int | None] = {}
    failed: dict[int, Exception] = {}
    suspects = [(list(range(len(batch.items))), err)]
    while suspects:
        rows, raised = suspects.pop()
        if len(rows) == 1:
            failed[rows[0]] = raised
            continue
        half = len(rows) // 2
        for group in (rows[:half], rows[half:]):
            sub = batch.rows(group)
            try:
                tokens = run(sub.items, sub.sample_rows)
            except Exception as e:
                suspects.append((group, e))
            else:
                ran.update(zip(group, tokens, strict=True))
    return ran, failed


def in_passing_thread(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a thread that ends before this returns; its result, or what it raised.

    For torch work that must not leave an OpenMP team on the caller's thread: libgomp keeps a
    thread's team as long as the thread lives, and while a process holds more OpenMP threads than
    CPUs each parallel region sleeps instead of spinning (libgomp manual, GOMP_SPINCOUNT)."""
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvgate-engine-build") as pool:
        return pool.submit(fn, *args).result()


class Engine:
    """One model over one paged KV pool (nano-vllm's shape: Sequence, KVPool, Scheduler, ModelRunner).

    ``vocab`` (default :func:`~gpu_backend.vocab.vocab_for` of ``cfg.model``) is the tokenizer seam.
    ``model`` (default: built from ``cfg.model`` by :func:`~gpu_backend.weights.build_model`) is an
    already-built model of ``cfg.model`` on ``cfg.device`` / ``cfg.dtype`` to share with another engine
    in the same process (role ``all``): the forward pass only reads its parameters (inference mode) and
    keeps every K/V in this engine's own pool, so two worker threads may run it at once.
    Attributes: ``counter``, ``eos_token_id``, ``max_total_num_tokens`` (pool tokens, a multiple of
    ``page_size``), ``max_req_input_len`` / ``max_req_len`` (SGLang's), ``pool``, ``scheduler``,
    ``stats``. ``ValueError`` for a bad config, unknown model or no room for one page;
    ``FileNotFoundError`` for a missing checkpoint folder.
    """

    def __init__(self, cfg: EngineConfig, vocab: Vocab | None = None, model: torch.nn.Module | None = None) -> None:
        cfg.check()
        self.cfg, self.faults = cfg, cfg.faults
        self.device, self.dtype = resolve_device(cfg.device), DTYPES[cfg.dtype]
        self.context_length, self.page_size = cfg.context_length, cfg.page_size
        self.requests = RequestTable(RETIRED_MEMORY)
        self._live = self.requests.live
        self.vocab = vocab or vocab_for(cfg.model)
        self.counter, self.eos_token_id = self.vocab.counter, self.vocab.eos_token_id
        in_passing_thread(self._build, cfg, model)
        self.scheduler = Scheduler(
            self.pool,
            max_batch_tokens=cfg.max_batch_tokens,
            max_running_requests=cfg.max_running_requests,
            pool_wait_timeout_seconds=cfg.pool_wait_timeout_seconds,
            token_bytes=self.vocab.token_bytes,
            stop_ids=self.vocab.stop_ids,
            requests=self.requests,
            max_req_len=self.max_req_len,
            skip_transfer_check=self.faults.skip_transfer_check,
        )
        self.stats = self.scheduler.stats
        self._rng = torch.Generator().manual_seed(cfg.seed)
        self._thread: threading.Thread | None = None
        self._stopping = self._ready = False  # lifecycle: ``status`` in server_info

    def _build(self, cfg: EngineConfig, model: torch.nn.Module | None) -> None:
        """The torch work of a build: the weights, the pool, the sampling bias."""
        self.model = shared_or_built(model, cfg.model, cfg.context_length, cfg.seed, self.dtype, self.device)
        # packed weight copies (a LlamaModel on the CPU) are made now and counted as weights
        prepack = getattr(self.model, "prepack", None)
        packed = prepack(cfg.packed_weights) if prepack is not None else 0
        self.weight_bytes = weight_bytes(self.model) + packed
        self.pool = self._build_pool(cfg)
        self.vocab_size = int(getattr(getattr(self.model, "config", None), "vocab_size", 0) or self.model.vocab_size)
        self.runner = ModelRunner(self.model, self.pool, vocab_bias(self.vocab, self.vocab_size))

    def _build_pool(self, cfg: EngineConfig) -> KVPool:
        """Size the pool from the memory budget left after the weights
        (:func:`~gpu_backend.pool_sizing.size_pool`), record the limits it implies, build it."""
        layers, kv_heads, head_dim = self.model.kv_geometry
        size = pool_sizing.size_pool(
            self.device,
            cfg.mem_budget_bytes,
            self.weight_bytes,
            pool_sizing.kv_cell_bytes(layers, kv_heads, head_dim, self.dtype),
            cfg.mem_fraction_static,
            cfg.page_size,
            cfg.max_total_tokens,
            cfg.context_length,
        )
        self.max_total_num_tokens, self.max_req_len = size.max_total_num_tokens, size.max_req_len
        self.max_req_input_len = size.max_req_input_len
        self.pool_explanation = size.explanation  #: the start-up line saying how the pool got its size
        pages = self.max_total_num_tokens // cfg.page_size
        scrub = not self.faults.no_scrub
        return KVPool(pages, cfg.page_size, layers, kv_heads, head_dim, self.dtype, self.device, scrub=scrub)

    def _limits(self) -> dict:
        """The fixed sizes of :meth:`server_info` and its ``disaggregation_mode``."""
        return {
            "max_total_num_tokens": self.max_total_num_tokens,
            "max_req_input_len": self.max_req_input_len,
            "context_length": self.context_length,
            "page_size": self.page_size,
            "disaggregation_mode": "null",
        }

    def server_info(self) -> dict:
        """SGLang ``/server_info`` fields: ``max_total_num_tokens``, ``max_req_input_len``,
        ``context_length``, ``page_size``, ``disaggregation_mode`` (``"null"``; the nodes override
        it), ``status`` (``"starting"``, ``"ready"``, ``"stopped"``), ``version``, ``model_path``,
        ``device``, and ``free_tokens`` / ``used_tokens`` read from the live pool."""
        st = self.pool.stats()
        status = "ready" if self._ready else ("stopped" if self._stopping else "starting")
        live = {"status": status, "version": VERSION, "model_path": self.cfg.model, "device": str(self.device)}
        tokens = {"free_tokens": st["free_pages"] * self.page_size, "used_tokens": st["used_pages"] * self.page_size}
        return {**self._limits(), **live, **tokens}

    def pool_stats(self) -> dict:
        """``{"total_pages", "free_pages", "used_pages", "page_size"}`` of the live pool."""
        return self.pool.stats()

    def check_integrity(self) -> None:
        """docs/design.md invariant 4 on an idle (or stopped) engine, mini-sglang's style: the pool's own
        count (:meth:`KVPool.check_integrity`), and with no request in flight every page free.
        Raises ``AssertionError``."""
        self.pool.check_integrity()
        if not self._live:
            st = self.pool.stats()
            assert st["free_pages"] == st["total_pages"], f"idle engine holds pages: {st}"

    async def start(self) -> None:
        """Start the worker thread. Idempotent."""
        if self._thread is not None:
            return
        self._stopping = False
        self.scheduler.mailbox.reopen()
        self._thread = threading.Thread(target=self._worker, name="kvgate-engine", daemon=True)
        self._thread.start()
        self._ready = True

    async def stop(self) -> None:
        """Abort everything in flight (iterators end with ``"abort"``), free every page, join the
        worker (off the event loop). Idempotent."""
        if self._thread is None:
            return
        self._ready, self._stopping = False, True
        self.scheduler.mailbox.wake()
        thread, self._thread = self._thread, None
        await asyncio.to_thread(thread.join)

    def step(self) -> bool:
        """One round on the worker thread: schedule -> run -> postprocess. True if a forward pass
        ran. A failing forward pass fails only the rows that fail on their own (:meth:`_isolate`);
        the others go on, and the engine keeps running. A pass that raises nothing costs nothing more."""
        batch = self.scheduler.schedule()
        if batch is None:
            return False
        try:
            tokens = self.runner.run(batch.items, batch.sample_rows)
        except Exception as e:
            log.exception("forward pass over %d sequences failed; running them again in halves", len(batch.items))
            batch, tokens = self._isolate(batch, e)
            if not batch.items:
                return True
        self.scheduler.postprocess(batch, tokens)
        return True

    def _isolate(self, batch: Batch, err: Exception) -> tuple[Batch, list[int | None]]:
        """``batch``'s forward pass raised ``err``: fail (pages freed, caller answered with its own
        error) each row whose pass fails alone (:func:`bisect_rows`); returns the batch of the rows
        that ran and their tokens, in batch order, for ``postprocess``."""
        ran, failed = bisect_rows(self.runner.run, batch, err)
        for i, e in sorted(failed.items()):
            log.error("request %s fails alone: %s: %s", batch.items[i][0].request_id, type(e).__name__, e)
            self.scheduler.fail(batch.rows([i]), e)
        keep = sorted(ran)
        return batch.rows(keep), [ran[i] for i in keep]

    def _worker(self) -> None:
        while not self._stopping:
            try:
                ran = self.step()
            except Exception:  # never let the worker die
                log.exception("engine step failed")
                ran = False
            if not ran:
                self.scheduler.idle_wait()
        self.scheduler.shutdown()

    def submit(self, msg: Message) -> None:
        """Send a typed message to the worker (any thread)."""
        self.scheduler.mailbox.submit(msg)

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[Token]:
        """Prefill + decode one request; yields a :class:`Token` per token, the last ``finished``.

        Raises (on the first ``__anext__``) what :meth:`admit` raises; while the pool is full the
        request waits, then :class:`PoolExhaustedError` (503). Pages for prompt + max_new_tokens are
        allocated at admission. Closing the iterator early (client gone) aborts and frees the pages.
        """
        queue: asyncio.Queue[Reply] = asyncio.Queue()
        seq = self.admit(request_id, prompt_ids, params, emitter(queue))
        self.submit(AddRequest(seq))
        async with contextlib.aclosing(queue_tokens(queue, lambda: self.abort(request_id, seq))) as tokens:
            async for tok in tokens:
                yield tok

    def register(self, seq: Sequence | PageReservation) -> None:
        """Make ``seq``'s id live: 503 :class:`RequestAbortedError` when the engine is not running,
        :class:`InvalidRequestError` (400) when the id is already in flight."""
        if not self._ready:
            raise RequestAbortedError("engine is not running", request_id=seq.request_id, status=503)
        self.requests.add(seq)

    def admit(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        emit: ReplyTo,
        *,
        export: bool = False,
    ) -> Sequence:
        """Validate and register a WAITING sequence (nothing allocated; send it as AddRequest).

        :class:`InvalidRequestError` (400) for bad params, an empty prompt or ids outside the
        vocabulary; a prompt over ``max_req_input_len`` is REJECTED (terminal) with
        :class:`PromptTooLongError`, or, for an export under the ``admit_rejected`` fault, replaced
        by :data:`PLACEHOLDER_PROMPT`. ``max_new_tokens`` is clamped to ``max_req_len -
        prompt_tokens - 1`` (SGLang). ``export``: an :class:`ExportSequence` (pages for the prompt
        only); else pages are reserved for prompt + max_new_tokens.
        """
        params.validate()
        prompt_ids = list(prompt_ids)
        check_prompt_ids(prompt_ids, self.vocab_size, self.vocab.is_valid_id, request_id)
        original, placeholder_ok = len(prompt_ids), export and self.faults.admit_rejected
        if original > self.max_req_input_len and placeholder_ok:
            prompt_ids = list(PLACEHOLDER_PROMPT)
        params = params.clamped(self.max_new_tokens_for(len(prompt_ids)))
        kind = ExportSequence if export else Sequence
        seq = kind(request_id, prompt_ids, params, emit, reported_prompt_tokens=original)
        if original > self.max_req_input_len and not placeholder_ok:
            seq.error = PromptTooLongError(original, self.max_req_input_len, request_id=request_id)
            seq.set_state(SeqState.REJECTED)
            self.requests.retire(seq)
            raise seq.error
        seq.sample_seed = self.sample_seed(params)
        seq.pages_needed = self.pool.pages_for(len(prompt_ids) + (0 if export else params.max_new_tokens))
        self.register(seq)
        return seq

    def max_new_tokens_for(self, context_tokens: int) -> int:
        """The most tokens a request over ``context_tokens`` context tokens may generate (tokens):
        ``max_req_len - context_tokens - 1`` (SGLang's clamp; < 1 when the context leaves no room).
        The one clamp of admission, of a decode reservation and of decode itself."""
        return self.max_req_len - context_tokens - 1

    def sample_seed(self, params: SamplingParams) -> int | None:
        """The seed of a request's draws (:func:`~gpu_backend.sampling.sample_seed` over the engine's seed)."""
        return sample_seed(params, self._rng)

    def abort(self, request_id: str, record: Sequence | PageReservation | None = None) -> None:
        """Abort a live request (waiting, prefilling, decoding or a reservation): the worker frees
        every page at the next step boundary; its tokens end with ``"abort"``. Unknown ids ignored.
        ``record``: abort only while the id is still that record's. A caller leaving after its
        request retired must not end a later request that reuses the id (the id is free once
        retired, :meth:`RequestTable.retire`); the Abort reaches the worker before that request's
        AddRequest, so it cannot find it."""
        live = self._live.get(request_id)
        if live is not None and (record is None or live is record):
            self.submit(Abort(request_id))

    def request_state(self, request_id: str) -> str | None:
        """The state of a live or recently retired request (:meth:`RequestTable.state`)."""
        return self.requests.state(request_id)
