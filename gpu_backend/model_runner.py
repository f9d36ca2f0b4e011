"""ModelRunner: turns a scheduled batch into one forward pass over the paged KV cache and samples.

Prefill and decode use the same path: each sequence contributes ``num_new`` tokens at positions
``start .. start + num_new - 1``; :class:`~gpu_backend.attention.PagedAttention` writes their K/V
into the sequence's pages and attends over positions ``0 .. start + num_new - 1`` through its page
table. Logits are taken at the last new token of each sequence that needs a sample.
"""

from __future__ import annotations

import torch

from gpu_backend.attention import PagedAttention, SeqSpan
from gpu_backend.kv_pool import KVPool
from gpu_backend.sampling import sample
from gpu_backend.sequence import Sequence
from gpu_backend.vocab import Vocab


def vocab_bias(vocab: Vocab, vocab_size: int) -> torch.Tensor:
    """[vocab_size] fp32: 0 for ids the tokenizer can decode, -inf for the rest (the model's vocabulary
    may be padded past the tokenizer's)."""
    bias = torch.full((vocab_size,), float("-inf"))
    valid = [i for i in range(min(vocab_size, vocab.n_vocab)) if vocab.is_valid_id(i)]
    bias[torch.tensor(valid, dtype=torch.long)] = 0.0
    return bias


class ModelRunner:
    """Owns the model and the pool's device. ``vocab_bias`` ([vocab] fp32 on the device, 0 or -inf)
    masks ids the tokenizer cannot decode, so every sampled id has text."""

    def __init__(self, model: torch.nn.Module, pool: KVPool, vocab_bias: torch.Tensor) -> None:
        self.model = model
        self.pool = pool
        self.device = pool.device
        self.vocab_bias = vocab_bias.to(self.device)

    @torch.inference_mode()
    def run(self, batch: list[tuple[Sequence, int]], sample_rows: list[bool]) -> list[int | None]:
        """One forward pass. ``batch``: (sequence, num_new) pairs; a sequence's new tokens are its
        prompt tokens ``num_cached .. num_cached + num_new - 1`` while prefilling, else its last
        token. ``sample_rows[b]``: sample a next token for sequence b. Returns a token id per
        sequence (``None`` where not sampled). Reads the sequences only: the scheduler advances
        their ``num_cached`` in ``postprocess``. So a call may be repeated over any subset of the
        rows (the engine does after a pass raised, :func:`~gpu_backend.engine.bisect_rows`): each
        row writes the same positions of its own pages again and samples with the same per-draw
        generator (:func:`~gpu_backend.sampling.draw_generator`)."""
        spans, ids = [], []
        for seq, n in batch:
            start = seq.num_cached
            if start + n <= seq.num_context_tokens:
                ids.extend(seq.prompt_ids[start : start + n])
            else:  # decode: the last generated token, at position num_tokens - 1
                ids.append(seq.last_token)
            spans.append(SeqSpan(seq.page_indices, start, n, seq.num_context_tokens))
        attn = PagedAttention(self.pool, spans)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        hidden = self.model(input_ids, attn)
        ends = torch.tensor([s.num_new for s in spans]).cumsum(0) - 1
        rows = [int(ends[b]) for b in range(len(batch)) if sample_rows[b]]
        out: list[int | None] = [None] * len(batch)
        if rows:
            logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
            logits = logits + self.vocab_bias[: logits.shape[-1]]
            picked = [seq for (seq, _), s in zip(batch, sample_rows, strict=True) if s]
            toks = sample(
                logits, [s.params for s in picked], [s.sample_seed for s in picked], [s.num_tokens for s in picked]
            )
            it = iter(toks)
            out = [next(it) if s else None for s in sample_rows]
        return out
