"""Counting with tiktoken encodings (cl100k_base by default) and the bundled backend's ChatML."""

from __future__ import annotations

import hashlib
import threading
from typing import Any

import tiktoken

from tokenizer.base import PromptCounter
from tokenizer.chat import DEFAULT_CHAT, ChatOptions, RenderedChat, chatml_token_count, chatml_token_ids, render_chatml
from tokenizer.encodings import IM_END_ID, IM_START_ID, bundled_encoding, get_encoding, valid_id_mask
from tokenizer.engine_render import chatml_view as chatml_view  # re-exported: one engine's first view
from tokenizer.engine_render import chatml_views, engine_tools, schema_forms, views_of
from tokenizer.guard import fault_param, guarded
from tokenizer.parallel import parallel_count
from tokenizer.tiktoken_safe import encode_ordinary as safe_encode_ordinary

#: ids checked per C call in :meth:`TiktokenCounter.check_ids` (a few milliseconds each at most)
ID_CHECK_SLICE = 1 << 16
#: texts of this many characters (inclusive) are counted once and remembered (see CountCache)
COUNT_CACHE_MIN_CHARS = 32
COUNT_CACHE_MAX_CHARS = 16_384
#: counts remembered per counter (FIFO; about 80 bytes each)
COUNT_CACHE_ENTRIES = 16_384


class CountCache:
    """Token counts of recently counted texts, keyed by a 128-bit BLAKE2b digest of the text's
    UTF-8 bytes (the text itself is never kept). A chat client re-sends its system prompt and
    the whole history on every turn, so most of a request's messages were counted before:
    hashing a message costs about 1 us per KiB, encoding it about 100 us per KiB. At most
    ``entries`` counts (oldest dropped first). Thread-safe (counting also runs in worker threads)."""

    def __init__(self, entries: int = COUNT_CACHE_ENTRIES) -> None:
        self.entries = entries
        self._counts: dict[bytes, int] = {}
        self._lock = threading.Lock()

    @staticmethod
    def key(text: str) -> bytes:
        """The digest a text is remembered under."""
        return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()

    def get(self, key: bytes) -> int | None:
        """The remembered count, or ``None``."""
        return self._counts.get(key)

    def put(self, key: bytes, count: int) -> None:
        """Remember ``count``, dropping the oldest entry when full."""
        with self._lock:
            counts = self._counts
            if key not in counts and len(counts) >= self.entries:
                del counts[next(iter(counts))]
            counts[key] = count

    def items(self) -> list[tuple[bytes, int]]:
        """The remembered ``(digest, count)`` pairs, oldest first (a copy)."""
        with self._lock:
            return list(self._counts.items())

    def __len__(self) -> int:
        return len(self._counts)


class TiktokenCounter(PromptCounter):
    """Exact counts with a tiktoken encoding; chats with the ChatML template of :mod:`tokenizer.chat`.

    ``encoding``: a name (``cl100k_base``) or an ``Encoding``. User text is encoded with
    ``encode_ordinary``, so ``<|endoftext|>`` typed by a user is text, never a special token and
    never an error. Long texts are counted on several cores (:mod:`tokenizer.parallel`) when the
    encoding uses the cl100k_base pre-token regex, whose safe cut points that module proves.
    """

    def __init__(self, encoding: str | tiktoken.Encoding = "cl100k_base", image_tokens: int = 765) -> None:
        self.encoding = get_encoding(encoding) if isinstance(encoding, str) else encoding
        self.vocab_size = self.encoding.n_vocab
        #: the longest token's bytes (cl100k_base: 128): no token covers more characters of a text
        self.max_token_chars = max((len(b) for b in self.encoding.token_byte_values()), default=0) or None
        self.image_tokens = image_tokens
        self._mask = valid_id_mask(self.encoding)
        #: ids below ``vocab_size`` that decode to nothing (cl100k_base: 100256, 100261-100275)
        self._holes = frozenset(i for i, ok in enumerate(self._mask) if not ok)
        self._parallel = self.encoding._pat_str == get_encoding("cl100k_base")._pat_str
        specials = self.encoding._special_tokens
        self.special_token_texts = frozenset(specials)
        self.im_start_id = specials.get("<|im_start|>", IM_START_ID)
        self.im_end_id = specials.get("<|im_end|>", IM_END_ID)
        #: ids that end a completion in the bundled backend: ``<|im_end|>`` and ``<|endoftext|>``
        self.eos_token_ids = frozenset(i for i in (self.im_end_id, specials.get("<|endoftext|>")) if i is not None)
        #: counts of recently counted texts (by digest; see :class:`CountCache`)
        self.count_cache = CountCache()

    def _encode_ordinary(self, text: str) -> list[int]:
        """``encode_ordinary``, guarded (:func:`tokenizer.guard.guarded`); for the cl100k regex,
        through :func:`tokenizer.tiktoken_safe.encode_ordinary`, which never lets a long
        whitespace run reach tiktoken's panicking regex."""
        if self._parallel:
            return guarded(safe_encode_ordinary, self.encoding, text)
        return guarded(self.encoding.encode_ordinary, text)

    def encode_text(self, text: str) -> list[int]:
        """Token ids of ordinary text (special-token look-alikes are text). Raises
        :class:`~tokenizer.errors.TokenizerFaultError` (``param`` ``None``) if tiktoken fails."""
        return self._encode_ordinary(text)

    def encode_prompt_text(self, text: str) -> list[int]:
        """Ids of a completions prompt: tiktoken adds nothing around it, so :meth:`encode_text`."""
        return self.encode_text(text)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of one id (``b""`` for an id the encoding lacks)."""
        try:
            return self.encoding.decode_single_token_bytes(token_id)
        except KeyError:
            return b""

    def decode(self, ids: list[int]) -> str:
        """Text of token ids (special tokens as their text; invalid UTF-8, such as a
        character cut by the last id, replaced by U+FFFD: tiktoken's ``errors="replace"``)."""
        return guarded(self.encoding.decode, ids, errors="replace")

    def _count_one(self, text: str) -> int:
        return len(self._encode_ordinary(text))

    def count_text(self, text: str) -> int:
        """Tokens of ordinary text; exact, on several threads for long cl100k-family text. Texts
        of :data:`COUNT_CACHE_MIN_CHARS` to :data:`COUNT_CACHE_MAX_CHARS` characters are counted
        once and then found in :attr:`count_cache` by digest (the same text, the same count)."""
        n = len(text)
        if COUNT_CACHE_MIN_CHARS <= n <= COUNT_CACHE_MAX_CHARS:
            key = CountCache.key(text)
            hit = self.count_cache.get(key)
            if hit is not None:
                return hit
            count = self._count_one(text)
            self.count_cache.put(key, count)
            return count
        if self._parallel:
            return parallel_count(text, self._count_one)
        return self._count_one(text)

    def is_valid_id(self, token_id: int) -> bool:
        """Whether ``token_id`` decodes in this encoding (cl100k_base has holes, e.g. 100256)."""
        return 0 <= token_id < len(self._mask) and self._mask[token_id] == 1

    def check_ids(self, ids: list[int], param: str) -> None:
        """As :meth:`PromptCounter.check_ids`, with the common all-valid case checked in C
        (``min``/``max`` and a set disjointness test) so a 1M-id prompt costs milliseconds. The
        checks run on slices of :data:`ID_CHECK_SLICE` ids: each C call holds the GIL, and a
        worker thread counting two million ids must let the event loop's thread run in between."""
        step = ID_CHECK_SLICE
        for i in range(0, len(ids), step):
            part = ids[i : i + step] if len(ids) > step else ids
            if not (min(part) >= 0 and max(part) < self.vocab_size and self._holes.isdisjoint(part)):
                super().check_ids(ids, param)
                return

    def _renderings(self, messages: Any, tools: Any, options: ChatOptions) -> list[RenderedChat]:
        """The distinct renderings of the chat, one for each way :attr:`engines` hand it to the
        template (validated first; :func:`tokenizer.engine_render.chatml_views`: arguments
        parsed, content parts joined as each engine joins them, vLLM's two image layouts). An
        engine's view equal to the messages as sent (no tool-call arguments to parse, no parts to
        join, no turn to rewrite: most chats) renders as they do, so it is not rendered again."""
        rendered = render_chatml(messages, tools, options)
        out: list[RenderedChat] = []
        for v in views_of(self.engines):
            for view in [messages] if v is None else chatml_views(messages, v):
                for rewrite in schema_forms(tools, v):
                    vtools = engine_tools(tools, v, rewrite)  # the engine's template gets each tool's model_dump()
                    r = rendered if view == messages and vtools == tools else render_chatml(view, vtools, options)
                    if all(r is not o for o in out):
                        out.append(r)
        return out

    def count_chat(self, messages: Any, tools: Any = None, options: ChatOptions = DEFAULT_CHAT) -> int:
        """Prompt tokens of a chat under the ChatML template of :mod:`tokenizer.chat` (with
        ``options``), the largest over the engines' renderings: each ``<|im_start|>``/``<|im_end|>``
        is 1 token, image parts cost :meth:`images_cost`."""
        with fault_param("messages"):
            return max(
                chatml_token_count(r, self.count_text, self.images_cost)
                for r in self._renderings(messages, tools, options)
            )

    def encode_chat(self, messages: Any, tools: Any = None) -> list[int]:
        """Token ids of a chat for a text-only engine (the bundled backend's prompt).
        Raises :class:`~tokenizer.errors.ImagesNotSupportedError` on image parts."""
        with fault_param("messages"):
            return chatml_token_ids(render_chatml(messages, tools), self.encode_text, self.im_start_id, self.im_end_id)

    def prompt_token_ids(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids of ordinary text (tiktoken adds no BOS/EOS, so ``add_special_tokens`` changes nothing)."""
        return self.encode_text(text)

    def chat_token_ids(self, messages: Any, tools: Any = None, options: ChatOptions = DEFAULT_CHAT) -> list[int]:
        """:meth:`encode_chat`, rendered with ``options`` as the engines render it (the longest)."""
        with fault_param("messages"):
            ids = [
                chatml_token_ids(r, self.encode_text, self.im_start_id, self.im_end_id)
                for r in self._renderings(messages, tools, options)
            ]
        return max(ids, key=len)

    def token_strs(self, ids: list[int]) -> list[str]:
        """Each id's bytes as UTF-8 (a piece of a multi-byte character becomes U+FFFD)."""
        return [self.encoding.decode_single_token_bytes(i).decode("utf-8", "replace") for i in ids]


def bundled_counter(image_tokens: int = 765) -> TiktokenCounter:
    """The counter of the bundled backend's tokenizer (cl100k_base + ChatML specials)."""
    return TiktokenCounter(bundled_encoding(), image_tokens=image_tokens)
