"""fp32 linear layers on the CPU through a packed GEMM, for the row counts where it is faster.

A GEMM library can pack the weight operand once into its own blocked layout and reuse it. PyTorch
exposes two such pairs: MKL's (``torch.ops.mkl._mkl_reorder_linear_weight`` / ``_mkl_linear``,
``cblas_sgemm_pack`` / ``cblas_sgemm_compute``, the path its inductor takes for frozen fp32
linears) and oneDNN's (``torch.ops.mkldnn._reorder_linear_weight`` / ``_linear_pointwise``, the
one it takes for bf16 ones). For a few rows (a decode batch, the logits of a few sequences) plain
``F.linear`` re-packs the weight inside every call; a packed copy skips that. Which library is
faster depends on the CPU, so each weight shape is timed once on both (:func:`fastest`) and takes
the faster: on the Intel Xeons measured MKL's (SmolLM2-135M, 2 threads: the layers at 8 rows
27.7 ms against ``F.linear``'s 32.9, the logits 6.4 against 14.8), on an AMD EPYC (family 25)
oneDNN's (the logits at 8 rows 7.6 ms against MKL's 19.5; docs/performance.md, eighteenth pass).
At 1-2 rows the layers are as fast unpacked on those Xeons, so :data:`LAYER_ROWS` starts at 3.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

#: Row counts a layer's matmul takes packed (below and above: ``F.linear``, as fast or faster).
LAYER_ROWS = (3, 16)
#: Row counts the logits matmul takes packed (a wide weight: packed wins from 1 row).
LOGITS_ROWS = (1, 16)
#: The row count the packing is asked for and :func:`fastest` times (both libraries pack the
#: weight, B, independently of A's rows; tests/test_backend_core_packed_linear.py checks every row
#: count in range against ``F.linear``).
PACK_ROWS_HINT = 8
#: calls :func:`fastest` times per library after one warm-up call; the best counts
TIMED_CALLS = 3


class Packer(NamedTuple):
    """One library's packed GEMM: ``pack(w, rows_hint)`` -> the packed copy of ``w`` (``[out,
    in]``); ``linear(x, packed, w, b, rows)`` -> ``x @ w.T + b`` (``[rows, out]``)."""

    name: str
    pack: Callable[[torch.Tensor, int], torch.Tensor]
    linear: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, int], torch.Tensor]


def _mkl() -> Packer | None:
    """MKL's packed GEMM when this torch build has its ops, else ``None``."""
    if not torch.backends.mkl.is_available():
        return None
    try:
        reorder, linear = torch.ops.mkl._mkl_reorder_linear_weight, torch.ops.mkl._mkl_linear
    except (AttributeError, RuntimeError):
        return None
    return Packer("mkl", reorder, linear)


def _onednn() -> Packer | None:
    """oneDNN's packed linear when this torch build has its ops, else ``None``."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        reorder, pointwise = torch.ops.mkldnn._reorder_linear_weight, torch.ops.mkldnn._linear_pointwise
    except (AttributeError, RuntimeError):
        return None
    return Packer("onednn", reorder, lambda x, packed, w, b, rows: pointwise(x, packed, b, "none", [], ""))


#: the packed GEMMs this torch build has (none: every matmul is ``F.linear``)
PACKERS: tuple[Packer, ...] = tuple(p for p in (_mkl(), _onednn()) if p is not None)
#: the faster packer per weight shape ``(out, in)`` on this machine (:func:`fastest`)
_FASTEST: dict[tuple[int, ...], Packer] = {}


def _seconds(packer: Packer, packed: torch.Tensor, w: torch.Tensor, x: torch.Tensor) -> float:
    packer.linear(x, packed, w, None, x.shape[0])  # warm-up: the library's first call sets up
    best = float("inf")
    for _ in range(TIMED_CALLS):
        t = time.perf_counter()
        packer.linear(x, packed, w, None, x.shape[0])
        best = min(best, time.perf_counter() - t)
    return best


def fastest(w: torch.Tensor) -> Packer:
    """The packer of :data:`PACKERS` that multiplies :data:`PACK_ROWS_HINT` rows by a weight of
    ``w``'s shape (fp32, on the CPU) fastest here: on the first weight of a shape each one packs
    ``w`` and is timed (:data:`TIMED_CALLS`, the best kept); the winner is remembered for the
    shape. A model's prepack times its few shapes at start (SmolLM2-135M: five, 0.33 s on 2 threads).
    Either gives ``F.linear``'s values within float rounding."""
    key = tuple(w.shape)
    found = _FASTEST.get(key)
    if found is not None:
        return found
    if len(PACKERS) == 1:
        found = PACKERS[0]
    else:
        x = torch.ones(PACK_ROWS_HINT, w.shape[1])
        with torch.inference_mode(False), torch.no_grad():
            found = min(PACKERS, key=lambda p: _seconds(p, p.pack(w.detach(), PACK_ROWS_HINT), w, x))
    _FASTEST[key] = found
    return found


def tensor_version(t: torch.Tensor) -> int | None:
    """``t``'s version counter (it moves on every in-place write), or ``None`` where it has none:
    an inference tensor, or a parameter made under ``inference_mode`` whose ``.data`` was later
    replaced (``is_inference()`` is false for it, yet its counter cannot be read)."""
    try:
        return t._version
    except RuntimeError:
        return None


class PackedMatmul:
    """``F.linear(x, w, b)`` (x: ``[rows, in]``, w: ``[out, in]``, b: ``[out]`` or ``None``;
    returns ``[rows, out]``) that, for ``min_rows <= rows <= max_rows``, multiplies by a copy of
    ``w`` in the packed layout of the faster library here (:func:`fastest`): made by :meth:`pack`
    or on first use, made again whenever ``w`` changes (a new tensor, or written in place).
    Results equal ``F.linear``'s within float rounding. Anything else (other rows, a device other
    than the CPU, a dtype other than fp32, a weight without a version counter, a torch without
    either library) is ``F.linear`` itself. The copy holds the weight's size again in memory
    (:meth:`packed_bytes`).
    """

    def __init__(self, rows: tuple[int, int]) -> None:
        self.min_rows, self.max_rows = rows
        self.enabled = True  #: false: always ``F.linear``, nothing packed
        self._key: tuple[int, int | None] | None = None
        self._packed: torch.Tensor | None = None
        self._packer: Packer | None = None  # the library that packed ``_packed``
        self._weight: torch.Tensor | None = None  # held, so no new tensor can take its address

    def __deepcopy__(self, memo: dict) -> PackedMatmul:
        copied = PackedMatmul((self.min_rows, self.max_rows))  # a copied model packs its own weights
        copied.enabled = self.enabled
        return copied

    def __getstate__(self) -> dict:
        return {
            "min_rows": self.min_rows,
            "max_rows": self.max_rows,
            "enabled": self.enabled,
            "_key": None,
            "_packed": None,
            "_packer": None,
            "_weight": None,
        }

    def forget(self) -> None:
        """Drop the packed copy: the next packed call packs the weight again (for a caller that
        knows the weight was written through a tensor whose version ``w`` does not share)."""
        self._key, self._packed, self._packer, self._weight = None, None, None, None

    @staticmethod
    def packable(w: torch.Tensor) -> bool:
        """Whether ``w`` can be packed: fp32, 2-D, on the CPU, with a version counter (without
        one, an in-place write could not be told), and a packed GEMM is here (:data:`PACKERS`)."""
        return (
            bool(PACKERS) and w.device.type == "cpu" and w.dtype == torch.float32 and w.dim() == 2
        ) and tensor_version(w) is not None

    def pack(self, w: torch.Tensor) -> torch.Tensor | None:
        """The packed copy of ``w`` (made now if missing or stale), or ``None`` if not packable
        or not :attr:`enabled`."""
        if not self.enabled:
            return None
        key = (w.data_ptr(), tensor_version(w))  # an in-place load keeps the pointer, not the version
        if key == self._key and self._packed is not None:
            return self._packed
        if not self.packable(w):
            return None
        packer = fastest(w)
        with torch.inference_mode(False), torch.no_grad():
            self._packed = packer.pack(w.detach(), PACK_ROWS_HINT)
        self._key, self._packer, self._weight = key, packer, w
        return self._packed

    def packed_bytes(self, w: torch.Tensor) -> int:
        """Memory the packed copy of ``w`` holds, or will once packed: the weight's own size
        (resident set measured after packing SmolLM2-135M's layers with MKL: 427 MB for 425 MB of
        weights, its reported buffer size about 4x that, most of it never touched; oneDNN's copy
        is the weight's size, ``torch.ops.mkldnn._nbytes``)."""
        return w.numel() * w.element_size() if self.enabled and self.packable(w) else 0

    def __call__(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.shape[0]
        if x.dim() != 2 or not self.min_rows <= rows <= self.max_rows or x.dtype != torch.float32:
            return F.linear(x, w, b)
        packed = self.pack(w)
        if packed is None or (b is not None and (b.dtype != torch.float32 or b.device.type != "cpu")):
            return F.linear(x, w, b)
        assert self._packer is not None
        return self._packer.linear(x.contiguous(), packed, w, b, rows)
