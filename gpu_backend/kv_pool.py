"""Paged KV pool: pages of ``page_size`` tokens, a free list, per-page owner and generation."""
from __future__ import annotations

from typing import NamedTuple


class PageHandle(NamedTuple):
    """A page reference: ``index`` into the pool, ``generation`` the page had when it was handed
    out. Any read or write through a handle whose generation moved on raises StaleHandleError."""

    index: int
    generation: int


class KVPool:
    """Placeholder; implemented below in the engine-core work (issue 3)."""
