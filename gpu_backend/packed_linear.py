"""fp32 linear layers on the CPU through MKL's packed GEMM, for the row counts where it is faster.

MKL can pack a GEMM operand once (``cblas_sgemm_pack``) and reuse it (``cblas_sgemm_compute``);
PyTorch exposes the pair as ``torch.ops.mkl._mkl_reorder_linear_weight`` / ``_mkl_linear``, the
path its inductor takes for frozen fp32 linears. For a few rows (a decode batch, the logits of a
few sequences) plain ``F.linear`` re-packs the weight inside every call; the packed copy skips that.
Measured per decode step of SmolLM2-135M on 2 threads (docs/performance.md): the layers' weights
at 8 rows 27.7 ms against 32.9 ms, the logits at 8 rows 6.4 ms against 14.8 ms; at 1-2 rows the
layers are as fast unpacked, so :data:`LAYER_ROWS` starts at 3.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: Row counts a layer's matmul takes packed (below and above: ``F.linear``, as fast or faster).
LAYER_ROWS = (3, 16)
#: Row counts the logits matmul takes packed (a wide weight: packed wins from 1 row).
LOGITS_ROWS = (1, 16)
#: The row count the packing is asked for (MKL packs the weight, B, independently of A's rows;
#: tests/test_backend_core_packed_linear.py checks every row count in range against ``F.linear``).
PACK_ROWS_HINT = 8


def _mkl_ops() -> tuple | None:
    """``(reorder, linear)`` when this torch build has MKL's packed linear ops, else ``None``."""
    if not torch.backends.mkl.is_available():
        return None
    try:
        return torch.ops.mkl._mkl_reorder_linear_weight, torch.ops.mkl._mkl_linear
    except (AttributeError, RuntimeError):
        return None


_OPS = _mkl_ops()


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
    ``w`` in MKL's packed layout: made by :meth:`pack` or on first use, made again whenever ``w``
    changes (a new tensor, or written in place). Results equal ``F.linear``'s within float
    rounding. Anything else (other rows, a device other than the CPU, a dtype other than fp32, a
    weight without a version counter, a torch without MKL) is ``F.linear`` itself. The copy
    holds the weight's size again in memory (:meth:`packed_bytes`).
    """

    def __init__(self, rows: tuple[int, int]) -> None:
        self.min_rows, self.max_rows = rows
        self.enabled = True  #: false: always ``F.linear``, nothing packed
        self._key: tuple[int, int | None] | None = None
        self._packed: torch.Tensor | None = None
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
            "_weight": None,
        }

    def forget(self) -> None:
        """Drop the packed copy: the next packed call packs the weight again (for a caller that
        knows the weight was written through a tensor whose version ``w`` does not share)."""
        self._key, self._packed, self._weight = None, None, None

    @staticmethod
    def packable(w: torch.Tensor) -> bool:
        """Whether ``w`` can be packed: fp32, 2-D, on the CPU, with a version counter (without
        one, an in-place write could not be told), and MKL's ops are here."""
        return (
            _OPS is not None and w.device.type == "cpu" and w.dtype == torch.float32 and w.dim() == 2
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
        assert _OPS is not None
        with torch.inference_mode(False), torch.no_grad():
            self._packed = _OPS[0](w.detach(), PACK_ROWS_HINT)
        self._key, self._weight = key, w
        return self._packed

    def packed_bytes(self, w: torch.Tensor) -> int:
        """Memory the packed copy of ``w`` holds, or will once packed: the weight's own size
        (resident set measured after packing SmolLM2-135M's layers: 427 MB for 425 MB of weights;
        MKL's reported buffer size is about 4x that, most of it never touched)."""
        return w.numel() * w.element_size() if self.enabled and self.packable(w) else 0

    def __call__(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.shape[0]
        if x.dim() != 2 or not self.min_rows <= rows <= self.max_rows or x.dtype != torch.float32:
            return F.linear(x, w, b)
        packed = self.pack(w)
        if packed is None or (b is not None and (b.dtype != torch.float32 or b.device.type != "cpu")):
            return F.linear(x, w, b)
        assert _OPS is not None
        return _OPS[1](x.contiguous(), packed, w, b, rows)
