"""Paged KV pool: pages of ``page_size`` tokens, a free list, per-page owner and generation.

Storage: one tensor ``kv`` of shape [num_layers, 2, num_pages, page_size, num_kv_heads, head_dim]
(layer-major, so one layer's K or V of all pages is one contiguous block the attention gathers from
by slot index ``page * page_size + offset``). Pages travel (export/load) as
[n, num_layers, 2, page_size, num_kv_heads, head_dim].

Scrubbing (docs/design.md invariant 3): a released page is zeroed and its generation bumped; a handle
``(index, generation)`` whose generation no longer matches is stale and every read or write through
it raises :class:`~gpu_backend.errors.StaleHandleError`. ``scrub=False`` (the ``no_scrub`` fault,
test use only) disables both the zeroing and the generation check.

Accounting (invariant 4): ``free_pages + used_pages == total_pages``; :meth:`KVPool.check_integrity`
counts owned pages independently of the free list. Single-threaded by design: only the engine's
worker thread allocates, frees, reads or writes pages (every such call reaches it as a typed message,
:mod:`gpu_backend.messages`), so there is no lock. :meth:`KVPool.stats` may be read from any thread.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import NamedTuple

import torch

from gpu_backend.errors import StaleHandleError


class PageHandle(NamedTuple):
    """A page reference: ``index`` into the pool, ``generation`` the page had when it was handed
    out. Any read or write through a handle whose generation moved on raises StaleHandleError."""

    index: int  # type: ignore[assignment]  # the field shadows tuple.index(); renaming it would change every caller
    generation: int


class KVPool:
    """The paged KV cache of one engine.

    ``num_pages`` pages of ``page_size`` tokens; K and V for ``num_layers`` layers of
    ``num_kv_heads`` x ``head_dim``, ``dtype`` on ``device``. Pages are handed out FIFO from the free
    list (released pages go to its back, as SGLang's token allocator).

    17 members, more than the team's ~15: four are read-only properties, ``page_is_zero`` is a
    test helper and ``_unfreeable`` is :meth:`free`'s check; the rest are accounting, allocation
    and page IO, which belong together.
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        scrub: bool = True,
    ) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"KV pool needs >= 1 page of >= 1 token (got {num_pages} x {page_size})")
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.scrub = scrub
        self.kv = torch.zeros(
            num_layers, 2, num_pages, page_size, num_kv_heads, head_dim, dtype=dtype, device=self.device
        )
        self.generation = [0] * num_pages
        self.owner: list[str | None] = [None] * num_pages
        self._free: deque[int] = deque(range(num_pages))

    # ---- accounting ----------------------------------------------------------------------
    @property
    def total_pages(self) -> int:
        return self.num_pages

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        """Pages handed out (``total - free``; :meth:`check_integrity` counts owners independently)."""
        return self.num_pages - len(self._free)

    @property
    def total_tokens(self) -> int:
        return self.num_pages * self.page_size

    def bytes_per_page(self) -> int:
        """Bytes of K+V one page takes over all layers."""
        return 2 * self.num_layers * self.page_size * self.num_kv_heads * self.head_dim * self.kv.element_size()

    def stats(self) -> dict:
        """``{"total_pages","free_pages","used_pages","page_size"}``: one read of the free list, so
        consistent from any thread (``free + used == total``)."""
        free = len(self._free)
        return {
            "total_pages": self.num_pages,
            "free_pages": free,
            "used_pages": self.num_pages - free,
            "page_size": self.page_size,
        }

    def check_integrity(self) -> None:
        """Invariant 4, counted two ways (mini-sglang's ``check_integrity``): pages with an owner plus
        pages on the free list equal the total, the free list holds each page at most once and only
        pages without an owner. Call it where no allocation runs (the worker, or an idle engine).
        Raises ``AssertionError`` with the counts."""
        free = list(self._free)
        owned = sum(o is not None for o in self.owner)
        assert len(set(free)) == len(free), f"free list holds a page twice: {len(free)} entries, {len(set(free))} pages"
        assert all(self.owner[i] is None for i in free), "a page on the free list has an owner"
        assert owned + len(free) == self.num_pages, f"free {len(free)} + used {owned} != total {self.num_pages}"

    def layer_cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat K and V of one layer: two [num_pages * page_size, num_kv_heads, head_dim] views
        (slot = page * page_size + offset)."""
        k = self.kv[layer, 0].view(self.num_pages * self.page_size, self.num_kv_heads, self.head_dim)
        v = self.kv[layer, 1].view(self.num_pages * self.page_size, self.num_kv_heads, self.head_dim)
        return k, v

    # ---- allocation ------------------------------------------------------------------------
    def pages_for(self, num_tokens: int) -> int:
        """Pages needed for ``num_tokens`` tokens (ceil)."""
        return -(-num_tokens // self.page_size)

    def try_alloc(self, num_pages: int, owner: str) -> list[PageHandle] | None:
        """``num_pages`` pages for ``owner``, or ``None`` (nothing taken) when fewer are free."""
        if num_pages < 1:
            raise ValueError("num_pages must be >= 1")
        if len(self._free) < num_pages:
            return None
        out = []
        for _ in range(num_pages):
            i = self._free.popleft()
            self.owner[i] = owner
            out.append(PageHandle(i, self.generation[i]))
        return out

    def free(self, handles: Sequence[PageHandle], ignore_stale: bool = False) -> int:
        """Release pages: zero them and bump their generation (scrub), then return them to the free
        list. Returns the number of pages freed. A stale handle (a double free, or a page that was
        released and handed to someone else since), a handle given twice in one call (it would
        put its page on the free list twice, to be handed to two requests) or one naming no page
        of the pool (a negative index would name another page) raises :class:`StaleHandleError`
        with nothing freed, or with ``ignore_stale`` is skipped (a sequence handed stale pages
        frees only its own, each once)."""
        if not handles:
            return 0
        live: list[PageHandle] = []
        seen: set[int] = set()
        for h in handles:
            why = self._unfreeable(h, seen)
            if why is not None:
                if ignore_stale:
                    continue
                raise StaleHandleError(f"free through handle {tuple(h)}: {why}")
            seen.add(h.index)
            live.append(h)
        if not live:
            return 0
        idx = [h.index for h in live]
        if self.scrub:
            self.kv[:, :, torch.tensor(idx, device=self.device)] = 0
        for i in idx:
            self.generation[i] += 1
            self.owner[i] = None
            self._free.append(i)
        return len(idx)

    def _unfreeable(self, h: PageHandle, seen: set[int]) -> str | None:
        """Why :meth:`free` must not free through ``h`` (``seen``: pages this call frees already), or ``None``."""
        if not 0 <= h.index < self.num_pages:
            return f"no page {h.index} in a pool of {self.num_pages}"
        if h.index in seen:
            return "given twice in one call"
        if self.generation[h.index] != h.generation or self.owner[h.index] is None:
            return f"stale (page generation {self.generation[h.index]})"
        return None

    def check(self, handles: Sequence[PageHandle]) -> None:
        """Raise :class:`StaleHandleError` if any handle's generation moved on (no-op without scrub)."""
        if not self.scrub:
            return
        gen = self.generation
        for h in handles:
            if gen[h.index] != h.generation:
                raise StaleHandleError(
                    f"page {h.index}: handle generation {h.generation}, "
                    f"page generation {gen[h.index]} (page was released)"
                )

    # ---- page IO (transfer, tests) ---------------------------------------------------------
    def read_pages(self, handles: Sequence[PageHandle]) -> torch.Tensor:
        """Copy pages out: [n, num_layers, 2, page_size, num_kv_heads, head_dim], contiguous, CPU.
        Raises :class:`StaleHandleError` through a stale handle."""
        self.check(handles)
        idx = torch.tensor([h.index for h in handles], dtype=torch.long, device=self.device)
        out = self.kv.index_select(2, idx)
        return out.permute(2, 0, 1, 3, 4, 5).contiguous().cpu()

    def write_pages(self, handles: Sequence[PageHandle], data: torch.Tensor) -> None:
        """Write ``data`` ([n, num_layers, 2, page_size, num_kv_heads, head_dim]) into the pages.
        Raises ``ValueError`` on a shape mismatch, :class:`StaleHandleError` through a stale handle."""
        expect = (len(handles), self.num_layers, 2, self.page_size, self.num_kv_heads, self.head_dim)
        if tuple(data.shape) != expect:
            raise ValueError(f"pages of shape {tuple(data.shape)}, expected {expect}")
        src = data.to(device=self.device, dtype=self.dtype).permute(1, 2, 0, 3, 4, 5)
        self.check(handles)
        idx = torch.tensor([h.index for h in handles], dtype=torch.long, device=self.device)
        self.kv.index_copy_(2, idx, src)

    def page_is_zero(self, index: int) -> bool:
        """Whether page ``index`` holds only zeros (tests of the scrub)."""
        return not bool(self.kv[:, :, index].any())
