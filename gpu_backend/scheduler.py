"""Scheduler: the engine's queues and their page accounting, on the worker thread only.

:meth:`Engine.step <gpu_backend.engine.Engine.step>` is nano-vllm's ``LLMEngine.step``: ``batch =
scheduler.schedule()``, ``tokens = runner.run(batch)``, ``scheduler.postprocess(batch, tokens)``.

- :meth:`Scheduler.schedule` handles the typed messages of :mod:`gpu_backend.messages` (add, reserve,
  load pages, start decode, abort), gives pages to waiting reservations, picks one batch:
  **prefill** first when there is prefill work (partially prefilled sequences continue, then waiting
  ones are admitted in arrival order while ``max_batch_tokens`` and ``max_running_requests`` allow
  and their pages can be allocated; a prompt longer than the token budget is prefilled in chunks,
  SGLang's chunked prefill), else **decode** (every decoding sequence advances one token: continuous
  batching); and only then times out the requests the pool could not serve in this round that
  arrived more than ``pool_wait_timeout_seconds`` ago (:class:`PoolExhaustedError`, 503). A request
  that arrived while a long forward pass ran is offered the pool first: the time the worker spent
  computing is no wait for pages, and the pool may be empty.
- :meth:`Scheduler.postprocess` advances the cursors (``num_cached``), appends the sampled tokens,
  emits them and retires what finished; the runner only prepares, runs and samples.

Replies go back typed (:mod:`gpu_backend.replies`: ``Token``, ``PagesGranted``, ``Loaded``,
``Exported``, ``Failed``).

Every page is allocated and freed here, so :class:`~gpu_backend.kv_pool.KVPool` needs no lock.
Retirement has one owner: :meth:`Scheduler._finish` / :meth:`Scheduler._fail` (free every page,
record the terminal state, then emit the final token or the :class:`~gpu_backend.replies.Failed`).

Each message is handled on its own: one whose handling raises fails only the request it concerns
(its pages freed, its caller answered with ``Failed``); the rest of the batch is handled as usual.
A reservation for more pages than the whole pool holds is refused at once (503 ``pool_exhausted``)
instead of blocking the reservations behind it until its wait times out.
"""

from __future__ import annotations

import collections
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpu_backend.errors import (
    InvalidRequestError,
    PoolExhaustedError,
    RequestAbortedError,
    StaleHandleError,
    TransferMismatchError,
)
from gpu_backend.kv_pool import KVPool
from gpu_backend.managers import DecodeManager, PrefillManager, ReservationManager
from gpu_backend.messages import (
    Abort,
    AbortAll,
    AddRequest,
    LoadPages,
    Mailbox,
    Message,
    Reserve,
    StartDecode,
)
from gpu_backend.replies import Failed, Loaded
from gpu_backend.sequence import ExportSequence, PageReservation, RequestTable, SeqState, Sequence
from gpu_backend.wire import Token

log = logging.getLogger("gpu_backend.scheduler")


@dataclass
class Batch:
    """One forward pass: ``items`` are (sequence, new tokens) pairs; ``sample_rows[b]``: sample a
    next token for item b (the last chunk of a prompt, or any decode row)."""

    prefill: bool
    items: list[tuple[Sequence, int]]
    sample_rows: list[bool]

    def rows(self, indices: list[int]) -> Batch:
        """The batch of items ``indices`` only (in that order), each with its own sample flag."""
        return Batch(self.prefill, [self.items[i] for i in indices], [self.sample_rows[i] for i in indices])


def make_token(seq: Sequence, token_id: int, text: str, finish_reason: str | None) -> Token:
    """The :class:`Token` of ``seq`` for ``token_id`` (``-1`` with ``"abort"``)."""
    done = finish_reason is not None
    return Token(token_id, text, done, finish_reason, seq.reported_prompt_tokens, len(seq.completion_ids))


class Scheduler:
    """Queues and page accounting (worker thread). ``token_bytes(id) -> bytes`` and ``stop_ids``
    drive detokenization; ``requests`` (the engine's :class:`RequestTable`) retires a record when it
    reaches a terminal state, before its caller hears back; ``skip_transfer_check`` is the test-only
    fault that lets decode run over more positions than were loaded (the incident). Its records
    live in three managers (:mod:`gpu_backend.managers`): ``prefill`` (waiting, prefilling),
    ``decode`` (running) and ``reservations`` (waiting for pages, held).

    ``stats``: ``prefill_steps``, ``decode_steps``, ``prefill_tokens``, ``decode_tokens``,
    ``max_prefill_batch``, ``max_decode_batch`` (sequences in one forward pass), and
    ``decode_batch_sizes`` (a Counter of batch size -> steps).

    Messages arrive through ``mailbox`` (:class:`~gpu_backend.messages.Mailbox`; ``cond`` is its
    lock). 18 methods: the message handlers are one ``match`` in :meth:`_handle`; checks of a
    payload are module functions (:func:`write_reservation`, :func:`decode_start_error`, :func:`refuse`).
    A message whose handling raises is failed alone (:meth:`_handle_each`).
    """

    def __init__(
        self,
        pool: KVPool,
        *,
        max_batch_tokens: int,
        max_running_requests: int,
        pool_wait_timeout_seconds: float,
        token_bytes: Callable[[int], bytes],
        stop_ids: frozenset[int],
        requests: RequestTable,
        max_req_len: int,
        skip_transfer_check: bool = False,
    ) -> None:
        self.pool = pool
        self.max_running_requests = max_running_requests
        self.pool_wait_timeout_seconds = pool_wait_timeout_seconds
        self.token_bytes = token_bytes
        self.stop_ids = stop_ids
        self.requests = requests
        self.max_req_len = max_req_len
        self.skip_transfer_check = skip_transfer_check
        self.prefill = PrefillManager(pool, max_batch_tokens)
        self.decode = DecodeManager()
        self.reservations = ReservationManager(pool)
        self.mailbox = Mailbox(functools.partial(refuse, on_retire=requests.retire))
        self.cond = self.mailbox.cond
        self.stats: dict[str, Any] = {  # ints, and a Counter of decode batch sizes
            "prefill_steps": 0,
            "decode_steps": 0,
            "prefill_tokens": 0,
            "decode_tokens": 0,
            "max_prefill_batch": 0,
            "max_decode_batch": 0,
            "decode_batch_sizes": collections.Counter(),
        }

    # ---- worker thread: the step -----------------------------------------------------------------
    def idle_wait(self) -> None:
        """Nothing ran: sleep until a message arrives, or briefly while something waits for pages
        (its timeout must fire)."""
        self.mailbox.wait(0.02 if self.prefill.waiting or self.reservations.waiting else 0.5)

    def schedule(self) -> Batch | None:
        """Handle messages, serve page waits, pick the next batch (``None``: no work), then expire
        the page waits the pool could not serve (:meth:`_expire_waiting`)."""
        self._handle_each(self.mailbox.take())
        self.reservations.grant()
        items = self._checked(self.prefill.schedule(self.max_running_requests - len(self.decode)))
        self._expire_waiting()
        if items:
            return Batch(True, items, [seq.num_cached + n == seq.num_context_tokens for seq, n in items])
        items = self._checked(self.decode.schedule())
        return Batch(False, items, [True] * len(items)) if items else None

    def postprocess(self, batch: Batch, tokens: list[int | None]) -> None:
        """Record the forward pass: advance each sequence's ``num_cached`` by its new tokens (the
        runner only reads the sequences), append each sampled token, emit it, retire what finished."""
        st, n = self.stats, len(batch.items)
        kind = "prefill" if batch.prefill else "decode"
        st[f"{kind}_steps"] += 1
        st[f"{kind}_tokens"] += sum(k for _, k in batch.items)
        st[f"max_{kind}_batch"] = max(st[f"max_{kind}_batch"], n)
        if not batch.prefill:
            st["decode_batch_sizes"][n] += 1
        for (seq, k), tok in zip(batch.items, tokens, strict=True):
            seq.num_cached += k
            if tok is None:
                continue  # a prompt chunk that is not the last
            if seq.state is SeqState.PREFILLING:
                self.prefill.remove(seq)
                seq.first_token_time = time.monotonic()
                seq.set_state(SeqState.DECODING)
                if isinstance(seq, ExportSequence):  # prefill node: export, free, then answer
                    seq.completion_ids.append(tok)
                    try:
                        result = seq.export(self.pool)
                    except Exception as e:  # the export failed: fail the request, keep the engine
                        self._fail(seq, e)
                        continue
                    self._finish(seq, "length", emit=False)  # pages freed before the caller hears back
                    seq.emit(result)
                    continue
                self.decode.add(seq)
            self._append(seq, tok)

    def fail(self, batch: Batch, err: BaseException) -> None:
        """Fail every sequence of ``batch`` with ``err`` (a forward pass over them raised: a bug or a
        device error), freeing their pages; the engine keeps running. The engine calls it with the
        rows that fail alone (:func:`~gpu_backend.engine.bisect_rows`), never with rows that ran."""
        for seq, _ in batch.items:
            self._fail(seq, err)

    def shutdown(self) -> None:
        """The worker's last act: refuse later messages, handle the queued ones, abort everything."""
        self.mailbox.close()
        self._handle_each([*self.mailbox.take(), AbortAll()])

    # ---- worker thread: messages ---------------------------------------------------------------
    def _handle_each(self, msgs: list[Message]) -> None:
        """Handle ``msgs`` oldest first, each on its own: one that raises is failed alone
        (:meth:`_message_failed`) and the next one is handled all the same."""
        for msg in msgs:
            try:
                self._handle(msg)
            except Exception as e:
                log.exception("handling %s failed; the request it concerns fails", type(msg).__name__)
                self._message_failed(msg, e)

    def _handle(self, msg: Message) -> None:
        match msg:
            case AddRequest(seq=seq):
                self.prefill.add(seq)
            case Reserve(reservation=res):
                self._reserve(res)
            case LoadPages():
                try:
                    write_reservation(self.pool, self.reservations.get(msg.request_id), msg)
                except Exception as e:  # reported to the caller; the reservation stays
                    msg.reply(Failed(e))
                else:
                    msg.reply(Loaded())
            case StartDecode():
                self._start_decode(msg)
            case Abort() | AbortAll():
                live: list[Sequence | PageReservation] = [*self.prefill, *self.reservations, *self.decode]
                for rec in live:
                    if isinstance(msg, AbortAll) or rec.request_id == msg.request_id:
                        self._finish(rec, "abort")

    def _reserve(self, res: PageReservation) -> None:
        """Queue ``res`` for pages; one that needs more pages than the whole pool holds is failed at
        once (:func:`never_fits`, 503): it would block every later reservation until its timeout."""
        if res.pages_needed > self.pool.total_pages:
            self._fail(res, never_fits(self.pool, res))
        else:
            self.reservations.add(res)

    def _message_failed(self, msg: Message, err: Exception) -> None:
        """Handling ``msg`` raised ``err``: fail the live records it concerns (:func:`records_of`;
        pages freed, caller answered with ``Failed(err)``). A LoadPages, or a StartDecode with no
        live record, hears ``Failed(err)`` itself (a LoadPages leaves its reservation held, as a
        refused load does). Nothing here raises: an answer that fails again is only logged."""
        records = records_of(msg, self.requests.live, [*self.prefill, *self.reservations, *self.decode])
        for rec in records:
            if isinstance(msg, StartDecode) and isinstance(rec, PageReservation):
                rec.emit = msg.emit  # the decode call hears it (the reservation was answered)
            try:
                self._fail(rec, err)
            except Exception:
                log.exception("failing %s after a failed %s raised too", rec.request_id, type(msg).__name__)
        reply = msg.reply if isinstance(msg, LoadPages) else msg.emit if isinstance(msg, StartDecode) else None
        if reply is not None and not records:
            try:
                reply(Failed(err))
            except Exception:
                log.exception("answering a failed %s raised too", type(msg).__name__)

    def _start_decode(self, msg: StartDecode) -> None:
        res = self.reservations.get(msg.request_id)
        if res is None:
            msg.emit(Failed(KeyError(msg.request_id)))
            return
        err = decode_start_error(self.pool, res, msg, self.max_req_len, self.skip_transfer_check)
        if err is not None:
            res.emit = msg.emit  # the decode call hears the error (the reservation was answered)
            self._fail(res, err)
            return
        self.reservations.remove(res)
        seq = Sequence.decoding_from(res, msg.prompt_ids, msg.params, msg.context_tokens, msg.sample_seed, msg.emit)
        self.requests.replace(res, seq)
        seq.set_state(SeqState.DECODING)
        self.decode.add(seq)
        self._append(seq, msg.first_token_id)  # prefill's token: it may already finish the request

    # ---- worker thread: scheduling ---------------------------------------------------------------
    def _expire_waiting(self) -> None:
        """Fail with 503 ``pool_exhausted`` each record still waiting for pages after this round's
        grants and admissions that arrived over ``pool_wait_timeout_seconds`` ago. Waiting
        sequences count only when the pool refused the head of the queue (they wait behind it);
        a sequence left waiting for the token budget or a slot waits for compute, not pages."""
        now = time.monotonic()
        prefill_waits = self.prefill.waiting if self.prefill.out_of_pages else ()
        waits: list[Sequence | PageReservation] = [*prefill_waits, *self.reservations.waiting]
        for seq in [s for s in waits if now - s.arrival > self.pool_wait_timeout_seconds]:
            n = seq.pages_needed
            self._fail(
                seq,
                PoolExhaustedError(
                    f"KV pool full: no room for {n} pages ({n * self.pool.page_size} tokens) within "
                    f"{self.pool_wait_timeout_seconds:g} s; retry later",
                    request_id=seq.request_id,
                ),
            )

    def _checked(self, items: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int]]:
        """Drop (and fail) sequences holding a stale page handle (generation check, invariant 3)."""
        ok = []
        for seq, n in items:
            try:
                self.pool.check(seq.pages)
            except StaleHandleError as e:
                self._fail(seq, e)
                continue
            ok.append((seq, n))
        return ok

    def _append(self, seq: Sequence, tok: int) -> None:
        text, reason = seq.append_token(tok, self.token_bytes(tok), self.stop_ids)
        if reason is None:
            seq.emit(make_token(seq, tok, text, None))
        else:
            self._finish(seq, reason, token_id=tok, text=text)

    # ---- worker thread: retiring (the one owner) -------------------------------------------------
    def _retire(self, seq: Sequence | PageReservation) -> None:
        if isinstance(seq, PageReservation):
            self.reservations.remove(seq)
        elif not self.decode.remove(seq):
            self.prefill.remove(seq)
        self.pool.free(seq.pages, ignore_stale=True)
        seq.pages = []
        self.requests.retire(seq)  # before the caller hears back: the id is free to reuse once it does

    def _finish(
        self, seq: Sequence | PageReservation, reason: str, *, token_id: int = -1, text: str = "", emit: bool = True
    ) -> None:
        """Retire with ``finish_reason`` ``reason`` (``abort`` -> state ABORTED), free every page,
        emit the final token. A reservation (only ever aborted) fails with 499 ``aborted``."""
        if isinstance(seq, PageReservation):
            self._fail(seq, RequestAbortedError("request aborted", request_id=seq.request_id))
            return
        seq.finish_reason = reason
        seq.set_state(SeqState.ABORTED if reason == "abort" else SeqState.FINISHED)
        self._retire(seq)
        if not emit:
            return
        if isinstance(seq, ExportSequence):  # an export that never completed
            seq.emit(Failed(RequestAbortedError("request aborted", request_id=seq.request_id)))
        else:
            seq.emit(make_token(seq, token_id, text, reason))

    def _fail(self, seq: Sequence | PageReservation, err: BaseException) -> None:
        """Retire with an error (a sequence: state ABORTED, ``seq.error``), free every page, emit
        the error."""
        if isinstance(seq, Sequence):
            seq.error = err
            if not seq.is_terminal:
                seq.set_state(SeqState.ABORTED)
        self._retire(seq)
        seq.emit(Failed(err))


def records_of(
    msg: Message, live: dict[str, Sequence | PageReservation], every: list[Sequence | PageReservation]
) -> list[Sequence | PageReservation]:
    """The live records ``msg`` concerns: the one of its request id in ``live`` (none for a
    LoadPages, which holds no pages of its own), or ``every`` live record for AbortAll."""
    match msg:
        case AbortAll():
            return every
        case AddRequest(seq=rec) | Reserve(reservation=rec):
            rid = rec.request_id
        case StartDecode(request_id=rid) | Abort(request_id=rid):
            pass
        case _:  # LoadPages, or any later kind that names no request of its own
            return []
    found = live.get(rid)
    return [] if found is None else [found]


def never_fits(pool: KVPool, res: PageReservation) -> PoolExhaustedError:
    """The 503 ``pool_exhausted`` of reservation ``res``, which needs more pages than the whole
    ``pool`` holds (no wait could ever grant it)."""
    n, total, ps = res.pages_needed, pool.total_pages, pool.page_size
    return PoolExhaustedError(
        f"KV pool too small: {n} pages ({n * ps} tokens) needed, the whole pool holds {total} "
        f"({total * ps} tokens); reduce max_tokens",
        request_id=res.request_id,
    )


def write_reservation(pool: KVPool, seq: PageReservation | None, msg: LoadPages) -> None:
    """Write ``msg.kv`` into reservation ``seq``'s pages, page i into handle i (worker thread).
    ``KeyError`` for no such reservation, ``ValueError`` for a shape that does not fit (more pages
    than reserved, wrong dims, ``num_tokens > n * page_size``), StaleHandleError through a stale handle."""
    if seq is None:
        raise KeyError(msg.request_id)
    kv, ps = msg.kv, pool.page_size
    n = int(kv.shape[0]) if kv.dim() > 0 else 0
    if n < 1 or n > len(seq.pages):
        raise ValueError(f"{n} pages received, {len(seq.pages)} reserved")
    if not 0 < msg.num_tokens <= n * ps:
        raise ValueError(f"num_tokens {msg.num_tokens} does not fit {n} pages of {ps}")
    pool.write_pages(seq.pages[:n], kv)
    seq.loaded_tokens = msg.num_tokens


def decode_start_error(
    pool: KVPool, seq: PageReservation, msg: StartDecode, max_req_len: int, skip_transfer_check: bool
) -> Exception | None:
    """Why reservation ``seq`` cannot decode as ``msg`` asks, or ``None``: InvalidRequestError for
    ``context_tokens`` out of range or context + max_new_tokens over the reservation,
    StaleHandleError for a stale page, TransferMismatchError when ``context_tokens`` differs from the
    tokens loaded (invariant 2 held by the engine too; lifted by ``skip_transfer_check``)."""
    ctx, max_new, room = msg.context_tokens, msg.params.max_new_tokens, len(seq.pages) * pool.page_size
    rid = seq.request_id
    if not 1 <= ctx <= max_req_len - 1:
        return InvalidRequestError(f"context_tokens {ctx} out of range", request_id=rid)
    if ctx + max_new - 1 > room:
        return InvalidRequestError(
            f"reservation of {room} tokens cannot hold {ctx} context + {max_new} new tokens", request_id=rid
        )
    try:
        pool.check(seq.pages)
    except StaleHandleError as e:
        return e
    if ctx != seq.loaded_tokens and not skip_transfer_check:
        return TransferMismatchError(
            f"decode over {ctx} context tokens but {seq.loaded_tokens} were loaded into the reservation; "
            f"nothing is generated",
            request_id=rid,
        )
    return None


def refuse(msg: Message, *, on_retire: Callable[[Sequence | PageReservation], None]) -> None:
    """Answer a message that arrived after the worker stopped (any thread) with a 503 ``aborted``;
    no page is touched (a refused request never had one)."""
    err = RequestAbortedError("engine is not running", status=503)
    match msg:
        case AddRequest(seq=seq):
            seq.error = err
            seq.set_state(SeqState.ABORTED)
            on_retire(seq)
            seq.emit(Failed(err))
        case Reserve(reservation=res):
            on_retire(res)
            res.emit(Failed(err))
        case LoadPages(reply=reply) | StartDecode(emit=reply):
            reply(Failed(err))
