"""The tokenizer seam of the engine: which ids exist, what bytes each one stands for, which ids end a
completion, and which prompt tokenizer the router API uses. :func:`vocab_for` is the one place a
model's tokenizer is chosen; the engine and ``cli`` only ever ask it.

Today every model uses the bundled tokenizer (cl100k_base + ChatML specials): ``<|im_end|>``
(100265) and ``<|endoftext|>`` (100257) end a completion. No torch here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tokenizer import TiktokenCounter, bundled_counter

#: ``<|endoftext|>`` of cl100k_base; ends a completion as ``<|im_end|>`` does.
ENDOFTEXT_ID = 100257


@dataclass(frozen=True)
class Vocab:
    """What an engine needs from a tokenizer.

    ``counter``: the prompt tokenizer (``encode_text``/``encode_chat``/``is_valid_id``; the router
    API tokenizes with it); ``n_vocab``: ids ``0 .. n_vocab - 1`` may exist; ``is_valid_id(id)``:
    the id decodes to text (the sampler masks the others); ``token_bytes(id)``: the id's UTF-8 bytes
    (``b""`` when it has none); ``eos_token_id``: the primary end-of-sequence id; ``stop_ids``: every
    id that ends a completion unless ``ignore_eos`` (``eos_token_id`` among them).
    """

    counter: TiktokenCounter
    n_vocab: int
    is_valid_id: Callable[[int], bool]
    token_bytes: Callable[[int], bytes]
    eos_token_id: int
    stop_ids: frozenset[int]


def bundled_vocab() -> Vocab:
    """The bundled tokenizer: cl100k_base + ChatML; stops on ``<|im_end|>`` and ``<|endoftext|>``."""
    counter = bundled_counter()
    enc = counter.encoding
    cache: dict[int, bytes] = {}

    def token_bytes(token_id: int) -> bytes:
        b = cache.get(token_id)
        if b is None:
            try:
                b = enc.decode_single_token_bytes(token_id)
            except KeyError:
                b = b""
            cache[token_id] = b
        return b

    eos = counter.im_end_id
    return Vocab(counter, enc.n_vocab, counter.is_valid_id, token_bytes, eos, frozenset({eos, ENDOFTEXT_ID}))


def vocab_for(model: str) -> Vocab:
    """The tokenizer of ``model`` (``tiny-random``, ``copy-probe`` or a checkpoint folder). Today the
    bundled one for every model."""
    return bundled_vocab()
