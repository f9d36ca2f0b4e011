"""The tokenizer seam of the engine: which ids exist, what bytes each one stands for, which ids end a
completion, and which prompt tokenizer the router API uses. :func:`vocab_for` is the one place a
model's tokenizer is chosen; the engine and ``cli`` only ever ask it.

``tiny-random``, ``copy-probe`` (and a checkpoint folder without ``tokenizer.json``) use the
bundled tokenizer (cl100k_base + ChatML specials): ``<|im_end|>`` (100265) and ``<|endoftext|>``
(100257) end a completion. A Hugging Face folder with ``tokenizer.json`` uses its own tokenizer,
chat template and EOS (docs/design.md, Models) through :class:`tokenizer.hf_counter.HFCounter`, the
counter the gateway uses for ``tokenizer.kind: hf``: the ids that end a completion are the
tokenizer's ``eos_token`` and every ``eos_token_id`` of ``generation_config.json`` /
``config.json``. No torch here.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tokenizer import TiktokenCounter, bundled_counter
from tokenizer.hf_counter import HFCounter

#: Models built into the engine (the bundled tokenizer).
BUILTIN_MODELS = ("tiny-random", "copy-probe")

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

    counter: TiktokenCounter | HFCounter
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


def hf_vocab(folder: str | Path) -> Vocab:
    """A Hugging Face folder's own tokenizer (see the module doc). ``eos_token_id``: the first
    ``eos_token_id`` of ``config.json`` (an int or a list), else the tokenizer's ``eos_token``, else
    -1 (no EOS; ``stop_ids`` empty). Raises ``FileNotFoundError`` without ``tokenizer.json``."""
    counter = HFCounter(folder)
    try:
        cfg = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        cfg = {}
    first = cfg.get("eos_token_id") if isinstance(cfg, dict) else None
    first = first[0] if isinstance(first, list) and first else first
    stop = frozenset(counter.eos_token_ids)
    eos = first if isinstance(first, int) and not isinstance(first, bool) else min(stop, default=-1)
    return Vocab(counter, counter.vocab_size, counter.is_valid_id, counter.token_bytes, eos, (stop | {eos}) - {-1})


def vocab_for(model: str) -> Vocab:
    """The tokenizer of ``model``: the bundled one for ``tiny-random``, ``copy-probe`` and a folder
    without ``tokenizer.json``; the folder's own otherwise (:func:`hf_vocab`)."""
    if model not in BUILTIN_MODELS and (Path(model) / "tokenizer.json").is_file():
        return hf_vocab(model)
    return bundled_vocab()
