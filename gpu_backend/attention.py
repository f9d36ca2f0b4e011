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


class PagedAttention:
    """Batch metadata + attention through the pool's page tables (the engine's path).

    Built by :meth:`build` from the batch's :class:`SeqSpan` s. ``positions`` and
    ``target_positions`` ([T] long) feed the model; ``attend`` writes then reads the pool of
    :class:`~gpu_backend.kv_pool.KVPool` ``pool``.
    """

    def __init__(self, pool, spans: list[SeqSpan]) -> None:
        dev = pool.device
        P = pool.page_size
        self.pool = pool
        (self.q_index, self.q_valid, self.mask, self.positions, self.target_positions, lmax) = _batch_layout(spans, dev)
        max_pages = max(len(s.pages) for s in spans)
        table = torch.zeros(len(spans), max_pages, dtype=torch.long)
        for b, s in enumerate(spans):
            if s.start + s.num_new > len(s.pages) * P:
                raise ValueError(f"sequence needs {s.start + s.num_new} slots, has {len(s.pages) * P}")
            table[b, : len(s.pages)] = torch.tensor(s.pages, dtype=torch.long)
        kpos = torch.arange(lmax)
        kv_len = torch.tensor([s.start + s.num_new for s in spans])
        # Slots of positions 0..lmax-1 per sequence (positions past a sequence's length point at its
        # first slot and are masked out anyway).
        pidx = (kpos // P).clamp_max(max_pages - 1)
        slots = table[:, pidx] * P + (kpos % P)[None, :]
        slots = torch.where(kpos[None, :] < kv_len[:, None], slots, slots[:, :1])
        self.kv_slots = slots.to(dev)
        new = [slots[b, s.start : s.start + s.num_new] for b, s in enumerate(spans)]
        self.slot_mapping = torch.cat(new).to(dev)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """Store k/v ([T, Hkv, D]) at the new tokens' slots, attend q ([T, Hq, D]) over each
        sequence's cached positions; returns [T, Hq, D]."""
        kc, vc = self.pool.layer_cache(layer)
        kc.index_copy_(0, self.slot_mapping, k.to(kc.dtype))
        vc.index_copy_(0, self.slot_mapping, v.to(vc.dtype))
        K = kc[self.kv_slots].transpose(1, 2)  # [B, Hkv, Lmax, D]
        V = vc[self.kv_slots].transpose(1, 2)
        Q = q[self.q_index].transpose(1, 2)  # [B, Hq, Qmax, D]
        out = _sdpa_chunked(Q, K.to(q.dtype), V.to(q.dtype), self.mask, scale)
        return out.transpose(1, 2)[self.q_valid]


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
