"""Typed messages from the event loop to the engine's worker thread, and the mailbox that carries
them (mini-sglang's shape, ``message/``: one dataclass per message kind; the replies, worker -> loop,
are in :mod:`gpu_backend.replies`).

Everything that allocates, frees, reads or writes KV pages is one of these messages, handled by
:class:`~gpu_backend.scheduler.Scheduler` on the worker thread, so the pool needs no lock:
:class:`AddRequest` (a validated WAITING sequence to prefill), :class:`Reserve` (a decode
:class:`~gpu_backend.sequence.PageReservation` waiting for pages), :class:`LoadPages`
(received KV pages for a reservation), :class:`StartDecode` (decode from a loaded reservation,
starting with prefill's first token), :class:`Abort` (one request) and :class:`AbortAll`.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from gpu_backend.replies import LoadReplyTo, ReplyTo
    from gpu_backend.sampling import SamplingParams
    from gpu_backend.sequence import PageReservation, Sequence


@dataclass
class AddRequest:
    seq: Sequence


@dataclass
class Reserve:
    reservation: PageReservation


@dataclass
class LoadPages:
    request_id: str
    kv: torch.Tensor  # [n, num_layers, 2, page_size, num_kv_heads, head_dim], any device/dtype
    num_tokens: int
    reply: LoadReplyTo


@dataclass
class StartDecode:
    request_id: str
    prompt_ids: list[int]
    first_token_id: int
    params: SamplingParams  # already clamped and validated
    context_tokens: int
    sample_seed: int | None
    emit: ReplyTo


@dataclass
class Abort:
    request_id: str


@dataclass
class AbortAll:
    pass


Message = AddRequest | Reserve | LoadPages | StartDecode | Abort | AbortAll


class Mailbox:
    """A FIFO of :data:`Message` s from any thread to the worker. ``cond`` guards it (tests hold it to
    pause the worker between steps). Once :meth:`close` d, :meth:`submit` hands each message to
    ``refuse`` instead (the worker is gone; nobody else may touch its state)."""

    def __init__(self, refuse: Callable[[Message], None]) -> None:
        self.cond = threading.Condition()
        self._queue: collections.deque[Message] = collections.deque()
        self._refuse = refuse
        self._closed = False

    def submit(self, msg: Message) -> None:
        """Queue ``msg`` and wake the worker (any thread); refused after :meth:`close`."""
        with self.cond:
            if not self._closed:
                self._queue.append(msg)
                self.cond.notify()
                return
        self._refuse(msg)

    def take(self) -> list[Message]:
        """Every queued message, oldest first (worker thread)."""
        with self.cond:
            out = list(self._queue)
            self._queue.clear()
        return out

    def wait(self, timeout: float) -> None:
        """Block the worker until a message arrives or ``timeout`` seconds pass."""
        with self.cond:
            if not self._queue:
                self.cond.wait(timeout)

    def wake(self) -> None:
        """Wake a waiting worker without a message (the engine is stopping)."""
        with self.cond:
            self.cond.notify()

    def close(self) -> None:
        """Refuse every later message (worker thread, on its way out)."""
        with self.cond:
            self._closed = True

    def reopen(self) -> None:
        """Accept messages again (the engine is starting)."""
        with self.cond:
            self._closed = False
