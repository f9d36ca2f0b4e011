"""Typed replies from the engine's worker thread to the event loop (mini-sglang's shape, ``message/``:
one dataclass per reply kind; the requests, loop -> worker, are in :mod:`gpu_backend.messages`).

The worker hands each reply to a callable (:data:`ReplyTo`) that crosses back with
``loop.call_soon_threadsafe`` (:mod:`gpu_backend.bridge`) and never blocks; the receiver ``match`` es
on its type: :class:`~gpu_backend.wire.Token` (one output token, the last ``finished``),
:class:`PagesGranted`, :class:`Loaded`, :class:`Exported`, or :class:`Failed` (the error that ended
the request or refused the message).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpu_backend.wire import Token

if TYPE_CHECKING:
    import torch

    from gpu_backend.kv_pool import PageHandle
    from gpu_backend.wire import PrefillOutcome


@dataclass(frozen=True)
class PagesGranted:
    """A reservation's pages are allocated: their handles, in page-table order."""

    pages: list[PageHandle]


@dataclass(frozen=True)
class Loaded:
    """Received pages were written into the reservation (answer to :class:`LoadPages`)."""


@dataclass(frozen=True)
class Exported:
    """A prefilled prompt's written pages, copied out before they were freed, and its outcome."""

    kv: torch.Tensor  # [num_pages, num_layers, 2, page_size, num_kv_heads, head_dim], CPU, pool dtype
    outcome: PrefillOutcome


@dataclass(frozen=True)
class Failed:
    """The request ended with ``error`` (its pages are freed), or the message was refused."""

    error: BaseException


#: Every reply the worker sends.
Reply = Token | PagesGranted | Loaded | Exported | Failed
#: Where the worker sends a request's replies (called on the worker thread; must not block).
ReplyTo = Callable[[Reply], None]
#: Where the worker answers :class:`LoadPages`.
LoadReplyTo = Callable[[Loaded | Failed], None]


def unexpected(reply: object) -> TypeError:
    """The error for a reply its receiver never asked for (a bug, never a client's doing)."""
    return TypeError(f"unexpected worker reply {type(reply).__name__}")
