"""Scheduler: waiting -> prefilling -> decoding, continuous batching, runs in the worker thread.

Per step (nano-vllm style): take new work from the inbox; time out requests that waited for pages
longer than ``pool_wait_timeout_seconds`` (:class:`PoolExhaustedError`, 503); then either one
prefill step or one decode step:

- **prefill** (first when there is prefill work): partially prefilled sequences continue, then
  waiting ones are admitted in arrival order while ``max_batch_tokens`` and
  ``max_running_requests`` allow and their pages (prompt + max_new_tokens) can be allocated; a
  prompt longer than the token budget is prefilled in chunks over several steps (SGLang's chunked
  prefill). Several prompts share one forward pass (prefill batching).
- **decode**: every decoding sequence advances one token in one forward pass (continuous
  batching: sequences join and leave between steps).

Only the worker thread touches the queues; other threads talk through :meth:`submit`.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable

from gpu_backend.errors import PoolExhaustedError, RequestAbortedError, StaleHandleError
from gpu_backend.kv_pool import KVPool
from gpu_backend.model_runner import ModelRunner
from gpu_backend.sequence import Sequence, SeqState

log = logging.getLogger("gpu_backend.scheduler")


class Scheduler:
    """Queues and step logic. ``token_bytes(id) -> bytes`` and ``eos_ids`` drive detokenization;
    ``make_event(seq, token_id, text, finish_reason)`` builds the output event; ``on_retire(seq)``
    is called (worker thread) when a sequence reaches a terminal state.

    ``stats``: ``prefill_steps``, ``decode_steps``, ``prefill_tokens``, ``decode_tokens``,
    ``max_prefill_batch``, ``max_decode_batch`` (sequences in one forward pass), and
    ``decode_batch_sizes`` (a Counter of batch size -> steps).
    """

    def __init__(
        self,
        runner: ModelRunner,
        pool: KVPool,
        *,
        max_batch_tokens: int,
        max_running_requests: int,
        pool_wait_timeout_seconds: float,
        token_bytes: Callable[[int], bytes],
        eos_ids: set[int],
        make_event: Callable,
        on_retire: Callable[[Sequence], None],
    ) -> None:
        self.runner = runner
        self.pool = pool
        self.max_batch_tokens = max_batch_tokens
        self.max_running_requests = max_running_requests
        self.pool_wait_timeout_seconds = pool_wait_timeout_seconds
        self.token_bytes = token_bytes
        self.eos_ids = eos_ids
        self.make_event = make_event
        self.on_retire = on_retire
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.prefilling: list[Sequence] = []
        self.running: list[Sequence] = []
        self._inbox: collections.deque[tuple[str, object]] = collections.deque()
        self.cond = threading.Condition()
        self.stats = {
            "prefill_steps": 0,
            "decode_steps": 0,
            "prefill_tokens": 0,
            "decode_tokens": 0,
            "max_prefill_batch": 0,
            "max_decode_batch": 0,
            "decode_batch_sizes": collections.Counter(),
        }

    # ---- cross-thread --------------------------------------------------------------------------
    def submit(self, kind: str, item: object) -> None:
        """Queue work from any thread: ``("add", seq)`` (to prefill), ``("add_decoding", seq)``
        (already holds its context KV), ``("abort", request_id)``, ``("abort_all", None)``,
        ``("wake", None)`` (pages were freed elsewhere)."""
        with self.cond:
            self._inbox.append((kind, item))
            self.cond.notify()

    def has_work(self) -> bool:
        return bool(self._inbox or self.prefilling or self.running or self.waiting)

    # ---- the step --------------------------------------------------------------------------
    def step(self) -> bool:
        """One scheduling round. Returns True if a forward pass ran."""
        self._drain_inbox()
        self._expire_waiting()
        batch = self._schedule_prefill()
        if batch:
            self._run_prefill(batch)
            return True
        if self.running:
            self._run_decode()
            return True
        return False

    def _drain_inbox(self) -> None:
        while True:
            with self.cond:
                if not self._inbox:
                    return
                kind, item = self._inbox.popleft()
            if kind == "add":
                self.waiting.append(item)
            elif kind == "add_decoding":
                item.set_state(SeqState.DECODING)
                self.running.append(item)
            elif kind == "abort":
                self._abort_id(item)
            elif kind == "abort_all":
                for seq in list(self.waiting) + self.prefilling + self.running:
                    self._finish(seq, "abort")

    def _abort_id(self, request_id: str) -> None:
        for seq in list(self.waiting) + self.prefilling + self.running:
            if seq.request_id == request_id:
                self._finish(seq, "abort")

    def _expire_waiting(self) -> None:
        if not self.waiting:
            return
        now = time.monotonic()
        for seq in list(self.waiting):
            if not seq.pages and now - seq.arrival > self.pool_wait_timeout_seconds:
                err = PoolExhaustedError(
                    f"KV pool full: no room for {seq.pages_needed} pages "
                    f"({seq.pages_needed * self.pool.page_size} tokens) within "
                    f"{self.pool_wait_timeout_seconds:g} s; retry later",
                    request_id=seq.request_id,
                )
                self._fail(seq, err)

    def _schedule_prefill(self) -> list[tuple[Sequence, int]]:
        budget = self.max_batch_tokens
        batch: list[tuple[Sequence, int]] = []
        for seq in self.prefilling:
            if budget <= 0:
                break
            n = min(seq.num_context_tokens - seq.num_cached, budget)
            batch.append((seq, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.prefilling) + len(self.running) < self.max_running_requests:
            seq = self.waiting[0]
            pages = self.pool.try_alloc(seq.pages_needed, seq.request_id)
            if pages is None:
                break  # head of line waits for pages (FIFO: no starvation of long prompts)
            self.waiting.popleft()
            seq.pages = pages
            seq.set_state(SeqState.PREFILLING)
            self.prefilling.append(seq)
            n = min(seq.num_context_tokens, budget)
            batch.append((seq, n))
            budget -= n
        return batch

    def _checked(self, batch: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int]]:
        """Drop (and fail) sequences holding a stale page handle (generation check, invariant 3)."""
        ok = []
        for seq, n in batch:
            try:
                self.pool.check(seq.pages)
            except StaleHandleError as e:
                self._fail(seq, e)
                continue
            ok.append((seq, n))
        return ok

    def _forward(self, batch: list[tuple[Sequence, int]], sample_rows: list[bool]) -> list[int | None] | None:
        try:
            return self.runner.run(batch, sample_rows)
        except Exception as e:  # a bug or device error: fail the batch, keep the engine alive
            log.exception("forward pass failed")
            for seq, _ in batch:
                self._fail(seq, e)
            return None

    def _run_prefill(self, batch: list[tuple[Sequence, int]]) -> None:
        batch = self._checked(batch)
        if not batch:
            return
        last = [seq.num_cached + n == seq.num_context_tokens for seq, n in batch]
        toks = self._forward(batch, last)
        if toks is None:
            return
        st = self.stats
        st["prefill_steps"] += 1
        st["prefill_tokens"] += sum(n for _, n in batch)
        st["max_prefill_batch"] = max(st["max_prefill_batch"], len(batch))
        for (seq, _), tok in zip(batch, toks):
            if tok is None:
                continue
            self.prefilling.remove(seq)
            seq.first_token_time = time.monotonic()
            if seq.on_prefilled is not None:  # prefill node: export, then free
                seq.completion_ids.append(tok)
                seq.set_state(SeqState.DECODING)
                try:
                    result = seq.on_prefilled(seq)
                except Exception as e:
                    self._fail(seq, e)
                    continue
                self._finish(seq, "length", emit=False)  # pages freed before the caller hears back
                seq.emit(result)
                continue
            seq.set_state(SeqState.DECODING)
            self.running.append(seq)
            self._append(seq, tok)

    def _run_decode(self) -> None:
        batch = self._checked([(s, 1) for s in self.running])
        if not batch:
            return
        toks = self._forward(batch, [True] * len(batch))
        if toks is None:
            return
        st = self.stats
        st["decode_steps"] += 1
        st["decode_tokens"] += len(batch)
        st["max_decode_batch"] = max(st["max_decode_batch"], len(batch))
        st["decode_batch_sizes"][len(batch)] += 1
        for (seq, _), tok in zip(batch, toks):
            self._append(seq, tok)

    def _append(self, seq: Sequence, tok: int) -> None:
        text, reason = seq.append_token(tok, self.token_bytes(tok), self.eos_ids)
        if reason is None:
            seq.emit(self.make_event(seq, tok, text, None))
        else:
            self._finish(seq, reason, token_id=tok, text=text)

    # ---- retiring --------------------------------------------------------------------------
    def _remove(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.prefilling:
            self.prefilling.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def _release_pages(self, seq: Sequence) -> None:
        self.pool.free(seq.pages, ignore_stale=True)
        seq.pages = []

    def _finish(self, seq: Sequence, reason: str, *, token_id: int = -1, text: str = "", emit: bool = True) -> None:
        """Retire with ``finish_reason`` ``reason`` (``abort`` -> state ABORTED), free every page,
        emit the final event."""
        self._remove(seq)
        seq.finish_reason = reason
        seq.set_state(SeqState.ABORTED if reason == "abort" else SeqState.FINISHED)
        self._release_pages(seq)
        self.on_retire(seq)  # before the caller hears back: the id is free to reuse once it does
        if emit:
            if seq.on_prefilled is not None:  # an export that never completed
                seq.emit(RequestAbortedError("request aborted", request_id=seq.request_id))
            else:
                seq.emit(self.make_event(seq, token_id, text, reason))

    def _fail(self, seq: Sequence, err: BaseException) -> None:
        """Retire with an error (state ABORTED, ``seq.error``), free every page, emit the error."""
        self._remove(seq)
        seq.error = err
        if not seq.is_terminal:
            seq.set_state(SeqState.ABORTED)
        self._release_pages(seq)
        self.on_retire(seq)
        seq.emit(err)
