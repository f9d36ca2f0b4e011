"""Attention over the KV cache: the paged op every model calls, and a contiguous reference.

A model calls ``attn.attend(layer, q, k, v, scale)`` with the new tokens' projections
(q: [T, Hq, D], k/v: [T, Hkv, D], T = all new tokens of the batch, sequence after sequence). The
op stores k/v into the cache at the tokens' slots, gathers each sequence's K/V for positions
``0 .. ctx_len - 1`` (paged: through the page table) and runs
``torch.nn.functional.scaled_dot_product_attention`` with a causal mask on absolute positions.
Queries are processed in chunks so the score tensor stays under ``SCORE_BUDGET`` elements.

``target_positions`` ([T] long) is extra per-token data only copy-probe reads (docs/design.md: "at decode
step i the engine supplies the target position i").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

#: Max elements of one attention score block (B x Hq x q_chunk x Lmax), ~64 MiB in fp32.
SCORE_BUDGET = 16 * 1024 * 1024


@dataclass
class SeqSpan:
    """One sequence of a batch: ``pages`` (page indices, its page table), ``start`` (positions
    already in the cache), ``num_new`` (tokens computed now, at positions start .. start+num_new-1),
    ``target_base`` (copy-probe: token at position m targets ``max(0, m - target_base + 1)``; the
    engine passes the prompt length, so the last prompt token targets 0 and decode step i targets i)."""

    pages: list[int]
    start: int
    num_new: int
    target_base: int = 0


def _batch_layout(spans: list[SeqSpan], device: torch.device):
    """Common index tensors: q_index/q_valid/q_pos [B, Qmax], kv_len [B], positions/targets [T]."""
    B = len(spans)
    qmax = max(s.num_new for s in spans)
    lmax = max(s.start + s.num_new for s in spans)
    q_index = torch.zeros(B, qmax, dtype=torch.long)
    q_pos = torch.zeros(B, qmax, dtype=torch.long)
    q_valid = torch.zeros(B, qmax, dtype=torch.bool)
    positions, targets = [], []
    t = 0
    for b, s in enumerate(spans):
        pos = torch.arange(s.start, s.start + s.num_new)
        q_index[b, : s.num_new] = torch.arange(t, t + s.num_new)
        q_pos[b, : s.num_new] = pos
        q_valid[b, : s.num_new] = True
        positions.append(pos)
        targets.append((pos - s.target_base + 1).clamp_min(0))
        t += s.num_new
    kpos = torch.arange(lmax)
    mask = kpos[None, None, :] <= q_pos[:, :, None]  # [B, Qmax, Lmax]; padded rows see key 0 only
    return (
        q_index.to(device),
        q_valid.to(device),
        mask.to(device),
        torch.cat(positions).to(device),
        torch.cat(targets).to(device),
        lmax,
    )


def _sdpa_chunked(Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Q [B, Hq, Qmax, D], K/V [B, Hkv, Lmax, D], mask [B, Qmax, Lmax] bool -> [B, Hq, Qmax, D]."""
    B, Hq, Qmax, D = Q.shape
    gqa = Hq != K.shape[1]
    chunk = max(1, SCORE_BUDGET // max(1, B * Hq * K.shape[2]))
    if chunk >= Qmax:
        return F.scaled_dot_product_attention(Q, K, V, attn_mask=mask[:, None], scale=scale, enable_gqa=gqa)
    out = torch.empty_like(Q)
    for a in range(0, Qmax, chunk):
        b = min(Qmax, a + chunk)
        out[:, :, a:b] = F.scaled_dot_product_attention(
            Q[:, :, a:b], K, V, attn_mask=mask[:, None, a:b], scale=scale, enable_gqa=gqa
        )
    return out


class _Seq(NamedTuple):
    """One sequence's share of a batch: new-token rows ``q0 .. q0 + n - 1`` attend over ``kv_len``
    cached positions read through ``kv`` (a slot range when the pages holding them are consecutive,
    else a [kv_len] slot index); ``mask`` ([1, n, kv_len] bool) only where neither a single query
    (``n == 1``) nor a causal square (``start == 0``) describes which keys each query sees."""

    q0: int
    n: int
    kv_len: int
    kv: slice | torch.Tensor
    mask: torch.Tensor | None


def _kv_source(pages: list[int], kv_len: int, page_size: int, device: torch.device) -> slice | torch.Tensor:
    """Slots of positions 0 .. kv_len - 1: a range when their pages are consecutive (read as a view,
    no copy), else a [kv_len] long tensor of slots (read with ``index_select``)."""
    need = -(-kv_len // page_size)
    p0 = pages[0]
    if pages[need - 1] - p0 == need - 1 and pages[:need] == list(range(p0, p0 + need)):
        return slice(p0 * page_size, p0 * page_size + kv_len)
    kpos = torch.arange(kv_len)
    table = torch.tensor(pages[:need], dtype=torch.long)
    return (table[kpos // page_size] * page_size + kpos % page_size).to(device)


def _seq_mask(s: SeqSpan, device: torch.device) -> torch.Tensor | None:
    """[1, num_new, kv_len] bool (key position <= query position), or ``None`` when no mask is
    needed (one query sees every key; a prompt from position 0 is a causal square)."""
    if s.num_new == 1 or s.start == 0:
        return None
    qpos = torch.arange(s.start, s.start + s.num_new)
    return (torch.arange(s.start + s.num_new)[None, :] <= qpos[:, None])[None].to(device)


def _padded_slots(seqs: list[_Seq], device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """A decode batch read as one padded block: [B * Lmax] slots (row b: its positions, then its
    first slot again), the [B, 1, 1, Lmax] bool mask of real positions (``None`` when every
    sequence has Lmax) and Lmax."""
    lmax = max(q.kv_len for q in seqs)
    rows = []
    for q in seqs:
        src = q.kv if isinstance(q.kv, torch.Tensor) else torch.arange(q.kv.start, q.kv.stop, device=device)
        rows.append(torch.cat((src, src[:1].expand(lmax - q.kv_len))) if q.kv_len < lmax else src)
    if all(q.kv_len == lmax for q in seqs):
        return torch.cat(rows), None, lmax
    lens = torch.tensor([q.kv_len for q in seqs])
    mask = (torch.arange(lmax)[None, :] < lens[:, None])[:, None, None, :]
    return torch.cat(rows), mask.to(device), lmax


def _attend_one(Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, mask: torch.Tensor | None, scale: float):
    """One sequence: Q [1, Hq, n, D], K/V [1, Hkv, L, D] (strided views are fine) -> [1, Hq, n, D].
    No mask: a single query sees every key, a square is causal (flash kernels skip the masked half
    and never hold the scores)."""
    gqa = Q.shape[1] != K.shape[1]
    if mask is None:
        causal = Q.shape[2] > 1
        return F.scaled_dot_product_attention(Q, K, V, scale=scale, is_causal=causal, enable_gqa=gqa)
    return _sdpa_chunked(Q, K, V, mask, scale)


class PagedAttention:
    """Batch metadata + attention through the pool's page tables (the engine's path).

    Built from the batch's :class:`SeqSpan` s. ``positions`` and
    ``target_positions`` ([T] long) feed the model; ``attend`` writes then reads the pool
    ``pool`` (a :class:`~gpu_backend.kv_pool.KVPool`: ``page_size``, ``device``, ``layer_cache``).

    Everything per step is computed here once, so a layer's call is a store and one attention:
    a sequence whose pages are consecutive is read as a view of the pool (no gather), one with
    scattered pages through ``index_select``; a decode batch of several sequences is gathered into
    one padded block (reused by every layer) and attended in one call.
    """

    def __init__(self, pool, spans: list[SeqSpan]) -> None:
        dev, P = pool.device, pool.page_size
        self.pool = pool
        pos: list[int] = []
        tgt: list[int] = []
        slots: list[int] = []
        self._seqs: list[_Seq] = []
        for s in spans:
            end = s.start + s.num_new
            if end > len(s.pages) * P:
                raise ValueError(f"sequence needs {end} slots, has {len(s.pages) * P}")
            new = range(s.start, end)
            pos.extend(new)
            tgt.extend(max(0, m - s.target_base + 1) for m in new)
            slots.extend(s.pages[m // P] * P + m % P for m in new)
            kv = _kv_source(s.pages, end, P, dev)
            self._seqs.append(_Seq(len(pos) - s.num_new, s.num_new, end, kv, _seq_mask(s, dev)))
        self.positions = torch.tensor(pos, dtype=torch.long, device=dev)
        self.target_positions = torch.tensor(tgt, dtype=torch.long, device=dev)
        self.slot_mapping = torch.tensor(slots, dtype=torch.long, device=dev)
        self._padded: tuple[torch.Tensor, torch.Tensor | None, int] | None = None
        if len(spans) > 1 and all(q.n == 1 for q in self._seqs):
            self._padded = _padded_slots(self._seqs, dev)
        self._bufs: tuple[torch.Tensor, torch.Tensor] | None = None

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """Store k/v ([T, Hkv, D]) at the new tokens' slots, attend q ([T, Hq, D]) over each
        sequence's cached positions; returns [T, Hq, D]."""
        kc, vc = self.pool.layer_cache(layer)
        kc.index_copy_(0, self.slot_mapping, k.to(kc.dtype))
        vc.index_copy_(0, self.slot_mapping, v.to(vc.dtype))
        if self._padded is not None:
            return self._attend_decode_batch(kc, vc, q, scale)
        if len(self._seqs) == 1:
            return self._attend_seq(self._seqs[0], kc, vc, q, scale)
        out = torch.empty_like(q)
        for s in self._seqs:
            out[s.q0 : s.q0 + s.n] = self._attend_seq(s, kc, vc, q, scale)
        return out

    @staticmethod
    def _attend_seq(s: _Seq, kc: torch.Tensor, vc: torch.Tensor, q: torch.Tensor, scale: float) -> torch.Tensor:
        """One sequence's rows: [n, Hq, D]."""
        if isinstance(s.kv, slice):
            K, V = kc[s.kv], vc[s.kv]
        else:
            K, V = kc.index_select(0, s.kv), vc.index_select(0, s.kv)
        Q = q[s.q0 : s.q0 + s.n].transpose(0, 1)[None]
        K, V = K.to(q.dtype).transpose(0, 1)[None], V.to(q.dtype).transpose(0, 1)[None]
        return _attend_one(Q, K, V, s.mask, scale)[0].transpose(0, 1)

    def _attend_decode_batch(self, kc: torch.Tensor, vc: torch.Tensor, q: torch.Tensor, scale: float) -> torch.Tensor:
        """B sequences, one query each: their K/V gathered into one padded [B, Lmax] block (the
        buffers are this step's, reused by every layer), one attention call; [B, Hq, D]."""
        assert self._padded is not None
        slots, mask, lmax = self._padded
        if self._bufs is None:
            self._bufs = (kc.new_empty((slots.numel(), *kc.shape[1:])), vc.new_empty((slots.numel(), *vc.shape[1:])))
        kb, vb = self._bufs
        torch.index_select(kc, 0, slots, out=kb)
        torch.index_select(vc, 0, slots, out=vb)
        B, Hq, D = q.shape
        K = kb.view(B, lmax, *kb.shape[1:]).transpose(1, 2).to(q.dtype)
        V = vb.view(B, lmax, *vb.shape[1:]).transpose(1, 2).to(q.dtype)
        gqa = Hq != K.shape[1]
        out = F.scaled_dot_product_attention(q[:, :, None], K, V, attn_mask=mask, scale=scale, enable_gqa=gqa)
        return out[:, :, 0]


class ContiguousKVCache:
    """A contiguous cache per sequence: [num_layers, 2, B, max_len, Hkv, D] (the reference the
    benchmark and tests compare the paged path with; no page table, no gather)."""

    def __init__(
        self,
        num_layers: int,
        batch: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.kv = torch.zeros(num_layers, 2, batch, max_len, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.device = torch.device(device)


class ContiguousAttention:
    """Batch metadata + attention over a :class:`ContiguousKVCache`: sequence b of the batch lives
    in row b; ``spans[b].start`` tokens are cached, ``num_new`` come now (``pages`` is ignored)."""

    def __init__(self, cache: ContiguousKVCache, spans: list[SeqSpan]) -> None:
        self.cache = cache
        (self.q_index, self.q_valid, self.mask, self.positions, self.target_positions, self.lmax) = _batch_layout(
            spans, cache.device
        )
        rows = [torch.full((s.num_new,), b, dtype=torch.long) for b, s in enumerate(spans)]
        self.rows = torch.cat(rows).to(cache.device)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """Same contract as :meth:`PagedAttention.attend`."""
        kc, vc = self.cache.kv[layer, 0], self.cache.kv[layer, 1]  # [B, max_len, Hkv, D]
        kc[self.rows, self.positions] = k.to(kc.dtype)
        vc[self.rows, self.positions] = v.to(vc.dtype)
        K = kc[:, : self.lmax].transpose(1, 2)
        V = vc[:, : self.lmax].transpose(1, 2)
        Q = q[self.q_index].transpose(1, 2)
        out = _sdpa_chunked(Q, K.to(q.dtype), V.to(q.dtype), self.mask, scale)
        return out.transpose(1, 2)[self.q_valid]
