"""copy-probe: a one-layer, one-head model that makes the KV cache observable (docs/design.md contracts).

- key at absolute position p: ``code(p)``, a multi-frequency sinusoidal code
  ``[cos(theta_j p), sin(theta_j p)]_j`` (32 frequencies, periods geometric from 2.5 to
  4 x context_length), so ``code(t) . code(p) = sum_j cos(theta_j (p - t))`` peaks only at p = t;
- value at position p: the unit-norm embedding ``E[token at p]`` (random, seeded, 64-dim: the
  largest cosine between two of the 100,277 embeddings stays far below 1, so the argmax is exact);
- query of a token: ``s * code(target)`` where the engine supplies the target position
  (``attn.target_positions``: the last prompt token targets 0, decode step i targets i);
- logits: ``attention output @ E^T``.

``s`` is chosen at build time from the exact minimum score margin over every offset in
``1 .. context_length`` (computed in float64), so that every non-target key's softmax weight is below
``exp(-40)``; the attention is one-hot on the target position and the argmax is the stored token.
Positions whose pages were never written (zeros) score 0, far below the target.

So with isolation intact completion token i == prompt token i (for i < prompt length; further on
it repeats its own completion, i.e. the prompt again); a stale page yields whatever token another
request left at that position. It runs through the same :class:`~gpu_backend.attention.PagedAttention`
as the Llama model.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

HEAD_DIM = 64
NUM_FREQS = HEAD_DIM // 2
#: Log-odds gap between the target key and any other key.
GAP = 40.0


def _thetas(max_positions: int) -> np.ndarray:
    periods = 2.5 * (4.0 * max_positions / 2.5) ** (np.arange(NUM_FREQS) / (NUM_FREQS - 1))
    return 2.0 * np.pi / periods


def min_margin(max_positions: int) -> float:
    """min over d in 1..max_positions of ``NUM_FREQS - sum_j cos(theta_j d)`` (float64, chunked)."""
    th = _thetas(max_positions)
    best = float("inf")
    for a in range(1, max_positions + 1, 65536):
        d = np.arange(a, min(max_positions, a + 65535) + 1, dtype=np.float64)
        best = min(best, float((NUM_FREQS - np.cos(np.outer(d, th)).sum(1)).min()))
    return best


class CopyProbeModel(nn.Module):
    """The copy-probe model. ``forward(input_ids [T], attn) -> hidden [T, HEAD_DIM]`` reads
    ``attn.positions`` and ``attn.target_positions``; ``compute_logits`` -> [N, vocab_size] fp32.

    ``vocab_size``: the tokenizer's (100,277); ``max_positions``: the context length (positions and
    targets must stay below it); ``seed`` fixes the value embeddings.
    """

    def __init__(self, vocab_size: int, max_positions: int, seed: int = 0) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.max_positions = max_positions
        g = torch.Generator().manual_seed(seed)
        emb = torch.randn(vocab_size, HEAD_DIM, generator=g)
        self.embed = nn.Parameter(emb / emb.norm(dim=-1, keepdim=True), requires_grad=False)
        self.register_buffer("theta", torch.from_numpy(_thetas(max_positions)).float(), persistent=False)
        self.query_scale = GAP / min_margin(max_positions)

    @property
    def kv_geometry(self) -> tuple[int, int, int]:
        """(num_layers, num_kv_heads, head_dim) of the KV cache."""
        return 1, 1, HEAD_DIM

    def code(self, positions: torch.Tensor) -> torch.Tensor:
        """Position codes [T, HEAD_DIM] (fp32; angles reduced in float64 for exactness)."""
        ang = positions.double()[:, None] * self.theta.double()[None, :]
        ang = torch.remainder(ang, 2 * math.pi)
        return torch.cat((ang.cos(), ang.sin()), dim=-1).float()

    def forward(self, input_ids: torch.Tensor, attn) -> torch.Tensor:
        dt = self.embed.dtype
        q = (self.code(attn.target_positions) * self.query_scale).to(dt)[:, None, :]
        k = self.code(attn.positions).to(dt)[:, None, :]
        v = self.embed[input_ids][:, None, :]
        return attn.attend(0, q, k, v, 1.0)[:, 0, :]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (hidden @ self.embed.T).float()
