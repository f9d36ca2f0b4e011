"""The scheduler's queues as three managers (mini-sglang's shape: ``scheduler/prefill.py``'s
``PrefillManager`` and ``scheduler/decode.py``'s ``DecodeManager``), used on the worker thread only:

- :class:`PrefillManager`: sequences waiting for pages (arrival order) and prefilling (chunked);
- :class:`DecodeManager`: decoding sequences, one token each per step (continuous batching);
- :class:`ReservationManager`: decode reservations waiting for pages, then held until they decode.

They hold and order records; retiring one (freeing its pages, answering its caller) stays with
:class:`~gpu_backend.scheduler.Scheduler`.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator

from gpu_backend.kv_pool import KVPool
from gpu_backend.replies import PagesGranted
from gpu_backend.sequence import PageReservation, SeqState, Sequence


class PrefillManager:
    """Sequences ``waiting`` for pages, then ``prefilling``; ``max_batch_tokens`` prompt tokens per step.
    ``out_of_pages``: the last :meth:`schedule` left the head of ``waiting`` there because the pool
    could not give it its pages (not for the token budget or the slots): only then are the waiting
    ones waiting for pages."""

    def __init__(self, pool: KVPool, max_batch_tokens: int) -> None:
        self.pool = pool
        self.max_batch_tokens = max_batch_tokens
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.prefilling: list[Sequence] = []
        self.out_of_pages = False

    def __iter__(self) -> Iterator[Sequence]:
        return iter([*self.waiting, *self.prefilling])

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self, slots: int) -> list[tuple[Sequence, int]]:
        """One prefill batch of (sequence, new tokens): prefilling sequences continue, then waiting
        ones are admitted in arrival order (their pages allocated, state PREFILLING) while the token
        budget lasts, fewer than ``slots`` prefill at once and the head's pages can be allocated (it
        waits otherwise: FIFO, no starvation of long prompts). A longer prompt goes in chunks."""
        budget = self.max_batch_tokens
        batch: list[tuple[Sequence, int]] = []
        self.out_of_pages = False
        for seq in self.prefilling:
            if budget <= 0:
                break
            n = min(seq.num_context_tokens - seq.num_cached, budget)
            batch.append((seq, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.prefilling) < slots:
            seq = self.waiting[0]
            pages = self.pool.try_alloc(seq.pages_needed, seq.request_id)
            if pages is None:
                self.out_of_pages = True
                break
            self.waiting.popleft()
            seq.pages = pages
            seq.set_state(SeqState.PREFILLING)
            self.prefilling.append(seq)
            n = min(seq.num_context_tokens, budget)
            batch.append((seq, n))
            budget -= n
        return batch

    def remove(self, seq: Sequence) -> bool:
        """Drop ``seq`` (prefilled, or retiring); False if it is not here."""
        for q in (self.prefilling, self.waiting):
            if seq in q:
                q.remove(seq)
                return True
        return False


class DecodeManager:
    """The ``running`` (decoding) sequences."""

    def __init__(self) -> None:
        self.running: list[Sequence] = []

    def __iter__(self) -> Iterator[Sequence]:
        return iter(list(self.running))

    def __len__(self) -> int:
        return len(self.running)

    def add(self, seq: Sequence) -> None:
        self.running.append(seq)

    def schedule(self) -> list[tuple[Sequence, int]]:
        """One decode batch: every running sequence advances one token."""
        return [(s, 1) for s in self.running]

    def remove(self, seq: Sequence) -> bool:
        """Drop ``seq`` (retiring); False if it is not here."""
        if seq in self.running:
            self.running.remove(seq)
            return True
        return False


class ReservationManager:
    """Decode reservations ``waiting`` for pages (arrival order), then ``held`` by request id."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.waiting: collections.deque[PageReservation] = collections.deque()
        self.held: dict[str, PageReservation] = {}

    def __iter__(self) -> Iterator[PageReservation]:
        return iter([*self.waiting, *self.held.values()])

    def add(self, res: PageReservation) -> None:
        self.waiting.append(res)

    def grant(self) -> None:
        """Give waiting reservations their pages, head first (nobody overtakes it); each granted one
        hears ``PagesGranted``."""
        while self.waiting:
            res = self.waiting[0]
            pages = self.pool.try_alloc(res.pages_needed, res.request_id)
            if pages is None:
                break
            self.waiting.popleft()
            res.pages = pages
            self.held[res.request_id] = res
            res.emit(PagesGranted(list(pages)))

    def get(self, request_id: str) -> PageReservation | None:
        """The held reservation of ``request_id``, if any."""
        return self.held.get(request_id)

    def remove(self, res: PageReservation) -> None:
        """Drop ``res`` (it decodes now, or it is retiring)."""
        if res in self.waiting:
            self.waiting.remove(res)
        if self.held.get(res.request_id) is res:
            del self.held[res.request_id]
