"""The prompt-counting interface: an OpenAI request in, an exact prompt-token count out; and
where a count runs (:func:`on_loop`): on the event loop when it is short and its payer's share of
the loop's time allows, else in a worker thread."""

from __future__ import annotations

import asyncio
import contextvars
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from time import perf_counter
from typing import Any, TypeVar

from tokenizer.chat import DEFAULT_CHAT, ChatOptions, chat_cost
from tokenizer.errors import InvalidPromptError, InvalidTokenIdError
from tokenizer.guard import fault_param

_T = TypeVar("_T")

#: Above this cost (characters, plus the per-element weights below), the async API counts in a
#: worker thread: sized so that counting the worst text this long (random characters from all of
#: Unicode) holds the event loop about 10 ms with tiktoken (docs/gateway.md, step 5 "Count").
OFFLOAD_CHARS = 16_384
#: What each element costs against ``offload_chars``, in characters, besides its own text: counting
#: an empty prompt costs about as much as encoding 32 characters, checking one token id about 4
#: (measured with the bundled tokenizer), so ``[""] * 2_000_000`` or two million ids are offloaded
#: although they hold no text.
PROMPT_ELEMENT_CHARS = 32
TOKEN_ID_CHARS = 4


class LoopAccount:
    """One payer's share of the event loop's time for counting: a token bucket holding up to
    ``burst`` seconds of loop, refilled at ``rate`` seconds per second (``0 < rate <= 1``, the
    fraction of the loop's time it may take). Kept as one number, :attr:`due`, the
    ``time.perf_counter`` instant at which all it spent is paid back (the generic cell rate
    algorithm), so :func:`on_loop` checks it with a comparison and :func:`charge_loop` charges it
    with an addition. Only the event loop's thread uses it. Raises ``ValueError`` for a rate or
    burst out of range."""

    __slots__ = ("due", "slack", "stretch")

    def __init__(self, rate: float, burst: float) -> None:
        if not 0 < rate <= 1 or burst < 0:
            raise ValueError(f"a loop account needs 0 < rate <= 1 and burst >= 0, not {rate}, {burst}")
        #: the instant its spending is paid back (in the past: its bucket is full)
        self.due = 0.0
        #: seconds of refill each second of loop it spends costs (``1 / rate``)
        self.stretch = 1.0 / rate
        #: how far :attr:`due` may run ahead of now while it still counts on the loop (``burst / rate``)
        self.slack = burst / rate


#: the account the current task's counting on the event loop is charged to (``None``: not limited;
#: the gateway sets the tenant's at authentication, ``gateway.edge.offload.set_tenant``)
LOOP_ACCOUNT: contextvars.ContextVar[LoopAccount | None] = contextvars.ContextVar("kvgate_loop_account", default=None)


def on_loop(cost: int, limit: int) -> float | None:
    """Where a count of ``cost`` (characters and element weights, as :func:`prompt_cost` and
    :func:`tokenizer.chat.chat_cost` weigh it) runs, for a counter whose ``offload_chars`` is
    ``limit``: the ``perf_counter`` instant it starts on the event loop, which the caller hands
    to :func:`charge_loop` once the count is done (however it ends), or ``None``: in a worker
    thread, because it is over ``limit`` or the current task's :data:`LOOP_ACCOUNT` has spent its
    share of the loop, so a flood of short counts waits in its payer's own threads::

        start = on_loop(cost, counter.offload_chars)
        if start is None:
            return await asyncio.to_thread(count, ...)
        try:
            return count(...)
        finally:
            charge_loop(start)
    """
    if cost > limit:
        return None
    now = perf_counter()
    account = LOOP_ACCOUNT.get()
    if account is None or account.due <= now + account.slack:
        return now
    return None


def charge_loop(start: float) -> None:
    """Charge the event loop's time since ``start`` (from :func:`on_loop`) to the current task's
    :data:`LOOP_ACCOUNT`, if it has one."""
    account = LOOP_ACCOUNT.get()
    if account is not None:
        account.due = max(account.due, start) + (perf_counter() - start) * account.stretch


async def off_loop(cost: int, limit: int, fn: Callable[..., _T], *args: Any) -> _T:
    """``fn(*args)`` where :func:`on_loop` puts a job of ``cost`` for a counter whose
    ``offload_chars`` is ``limit``: on the event loop, charged to the payer's share of it, or in a
    worker thread. Raises what ``fn`` raises."""
    start = on_loop(cost, limit)
    if start is None:
        return await asyncio.to_thread(fn, *args)
    try:
        return fn(*args)
    finally:
        charge_loop(start)


@dataclass(frozen=True)
class PromptCount:
    """Prompt tokens of a ``/v1/completions`` request: one entry per prompt (a batch has several).
    ``largest`` is what the context gate checks; ``total`` what a token quota reserves."""

    per_prompt: tuple[int, ...]

    @property
    def total(self) -> int:
        """Sum over the prompts, in tokens."""
        return sum(self.per_prompt)

    @property
    def largest(self) -> int:
        """The longest prompt, in tokens."""
        return max(self.per_prompt)


#: elements checked per C call in :func:`_all_of_type` (about a millisecond each)
TYPE_CHECK_SLICE = 1 << 16


def _all_of_type(items: list[Any], kind: type) -> bool:
    """Whether every element's type is exactly ``kind`` (so ``bool`` is no ``int``; JSON makes no
    subclasses). Checked in C (``map(type, ...)``), a slice at a time, so that a worker thread
    checking two million ids lets the event loop's thread take the GIL in between; a Python
    loop over them cost about 100 ms of interpreter time."""
    step = TYPE_CHECK_SLICE
    for i in range(0, len(items), step):
        if set(map(type, items[i : i + step] if len(items) > step else items)) != {kind}:
            return False
    return True


def split_completion_prompt(prompt: Any, field: str = "prompt") -> list[str | list[int]]:
    """Normalise an OpenAI ``prompt`` into a list of prompts (each a string or a list of ids).

    Accepts a string, a list of strings, a list of ints (one token-id prompt) or a list of int
    lists. Raises :class:`InvalidPromptError` (``param`` ``prompt`` or ``prompt[i]``) for anything
    else, mixed lists, booleans posing as ints, or an empty list. ``field``: the request field's
    name in messages and ``param`` (``input`` for ``/v1/embeddings``, which takes the same shapes).
    The lists returned are the request's own, not copies (copying two million ids held the GIL
    for 10 ms in one call): callers read them and never change them.
    """
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise InvalidPromptError(
            f"'{field}' must be a string, a list of strings, a list of token ids or a list of token-id lists.", field
        )
    if _all_of_type(prompt, str):
        return prompt
    if _all_of_type(prompt, int):
        return [prompt]
    if _all_of_type(prompt, list):
        for i, p in enumerate(prompt):
            if not p or not _all_of_type(p, int):
                raise InvalidPromptError(
                    f"'{field}[{i}]' must be a non-empty list of integer token ids.", f"{field}[{i}]"
                )
        return prompt
    raise InvalidPromptError(
        f"'{field}' must be a string, a list of strings, a list of token ids or a list of token-id lists (not a mix).",
        field,
    )


def prompt_param(prompt: Any, index: int, field: str = "prompt") -> str:
    """The ``param`` naming prompt ``index`` of ``prompt``: ``field`` when the request holds a
    single prompt (a string or a flat list of ids), else ``field[index]``."""
    single = isinstance(prompt, str) or (
        isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], (str, list))
    )
    return field if single else f"{field}[{index}]"


def prompt_cost(prompt: Any, limit: int | None = None) -> int:
    """What counting a completions ``prompt`` costs, in characters: each string's length plus
    :data:`PROMPT_ELEMENT_CHARS` per prompt, :data:`TOKEN_ID_CHARS` per token id. Stops early once
    ``limit`` is passed (a list of more than ``limit / TOKEN_ID_CHARS`` elements is over it without
    a look at its items), so deciding costs O(limit / 4) steps at most, whatever the request."""
    if isinstance(prompt, str):
        return len(prompt) + PROMPT_ELEMENT_CHARS
    if not isinstance(prompt, list):
        return PROMPT_ELEMENT_CHARS
    floor = len(prompt) * TOKEN_ID_CHARS
    if limit is not None and floor > limit:
        return floor
    cost = 0
    for p in prompt:
        if isinstance(p, str):
            cost += len(p) + PROMPT_ELEMENT_CHARS
        elif isinstance(p, list):
            cost += len(p) * TOKEN_ID_CHARS + PROMPT_ELEMENT_CHARS
        else:
            cost += TOKEN_ID_CHARS
        if limit is not None and cost > limit:
            break
    return cost


class PromptCounter(ABC):
    """Counts prompt tokens exactly as the engine will see them (never fewer).

    Subclasses implement the synchronous ``count_*`` methods; the ``acount_*`` coroutines run them
    in a worker thread when counting would cost more than ``offload_chars`` characters
    (:func:`prompt_cost`, :func:`tokenizer.chat.chat_cost`: text plus a weight per prompt, token id
    and message), so the event loop is never blocked, however many empty elements a request holds,
    and when the payer has spent its share of the loop's time (:func:`on_loop`).
    """

    #: model's vocabulary size (ids are valid in ``[0, vocab_size)`` when defined)
    vocab_size: int
    #: per-image cost in tokens for chat image parts (never 0), used when ``image_cost`` is unset
    image_tokens: int = 765
    #: per-part image cost (``part -> tokens``, e.g. a tile formula); ``None``: ``image_tokens`` each
    image_cost: Callable[[dict], int] | None = None
    offload_chars: int = OFFLOAD_CHARS
    #: the synchronous ``count_*`` methods work (not so for a counter that asks the engine)
    counts_sync: bool = True
    #: at most how many characters of a text one token covers (``None``: unknown), so a text of
    #: ``n`` characters is at least ``n // max_token_chars`` tokens: a prompt too long for any
    #: context can be refused without being counted
    max_token_chars: int | None = None
    #: the text of each of the model's special tokens (``<|im_start|>``): an engine that parses
    #: special tokens in the rendered prompt (vLLM, SGLang) reads such text as a control token. Empty
    #: where the counter does not know them (an ``engine`` counter: the engine counts itself).
    special_token_texts: frozenset[str] = frozenset()
    #: the engine policies (upstream ``engine``) serving this counter's model, set by the gateway's
    #: model index: chats are counted as each renders them (:mod:`tokenizer.engine_render`), the
    #: largest count winning. Empty: the messages as sent (the bundled backend's own tokenizer).
    engines: frozenset[str] = frozenset()

    def images_cost(self, parts: list[dict]) -> int:
        """Tokens the image content ``parts`` of a chat cost (``image_cost`` of each, else
        ``image_tokens`` each)."""
        if self.image_cost is None:
            return len(parts) * self.image_tokens
        return sum(self.image_cost(p) for p in parts)

    @abstractmethod
    def count_text(self, text: str) -> int:
        """Tokens of ordinary text (special-token look-alikes count as text), no BOS/EOS."""

    def warm_up(self) -> None:
        """Build what a first count builds (compiled patterns, tables, a chat template) by
        counting one short chat, so that no request pays for it on the event loop (tiktoken's
        whitespace-run pattern alone: about 12 ms). Nothing for a counter that counts through the
        engine (``counts_sync`` false). Raises what :meth:`count_chat` raises."""
        if self.counts_sync:
            self.count_chat([{"role": "user", "content": "kvgate warm-up"}])

    def count_prompt_text(self, text: str) -> int:
        """Tokens of a ``/v1/completions`` string prompt as the engine encodes it: ordinary text
        plus whatever the tokenizer adds around a prompt (a BOS for Llama-family HF tokenizers).
        Defaults to :meth:`count_text` (tiktoken adds nothing)."""
        return self.count_text(text)

    @abstractmethod
    def is_valid_id(self, token_id: int) -> bool:
        """Whether ``token_id`` is a token of this vocabulary."""

    @abstractmethod
    def count_chat(self, messages: Any, tools: Any = None, options: ChatOptions = DEFAULT_CHAT) -> int:
        """Prompt tokens of a chat as ``options`` render it (by default with the generation
        prompt). Raises the typed errors of :mod:`tokenizer.errors` for bad shapes, unknown parts,
        or options this counter's template cannot apply (``param`` naming the option)."""

    def encode_text(self, text: str) -> list[int]:
        """Token ids of ``text`` as ordinary text (no BOS/EOS), for local tokenizers (the demo
        corpus cuts texts on them). Counters that only tokenize over the network raise
        ``NotImplementedError``."""
        raise NotImplementedError(f"{type(self).__name__} cannot encode text locally")

    def decode(self, ids: list[int]) -> str:
        """The text of token ids as this tokenizer decodes them, special tokens included. Bytes
        that are not valid UTF-8 (ids cut inside a multi-byte character) become U+FFFD
        (``errors="replace"``), so a prompt that ends mid-character still decodes. The verifier
        uses it to know a token-id prompt's own text (docs/design.md step 8). Subclasses that can
        only decode over the network raise ``NotImplementedError`` and implement :meth:`adecode`."""
        raise NotImplementedError(f"{type(self).__name__} cannot decode token ids")

    async def adecode(self, ids: list[int]) -> str:
        """:meth:`decode`, in a worker thread for long input (over ``offload_chars`` ids) or when
        the payer's share of the loop is spent (:func:`on_loop`). Raises what :meth:`decode` raises."""
        return await off_loop(len(ids), self.offload_chars, self.decode, ids)

    def prompt_decoder(self, prompt_ids: Sequence[Sequence[int]]) -> Callable[[list[int]], Awaitable[str]]:
        """The decoder of one request's token-id prompts ``prompt_ids``, made once per request and
        called once per prompt: :meth:`adecode` here (a local tokenizer answers in bounded memory);
        a counter that decodes over the network bounds what all the answers may hold together."""
        return self.adecode

    def check_ids(self, ids: list[int], param: str) -> None:
        """Raise :class:`InvalidTokenIdError` (with ``param``) for the first id that is negative or
        undefined. Ids are ints (:func:`split_completion_prompt` checked that)."""
        for t in ids:
            if t < 0 or not self.is_valid_id(t):
                raise InvalidTokenIdError(t, self.vocab_size, param)

    def count_prompt(self, prompt: Any) -> PromptCount:
        """Prompt tokens of a ``/v1/completions`` ``prompt``, one count per prompt.

        Strings are encoded (:meth:`count_prompt_text`); token ids are validated
        (:meth:`check_ids`) and counted, not re-tokenized. Raises :class:`InvalidPromptError` for
        a wrong shape and :class:`InvalidTokenIdError` (``param`` ``prompt`` or ``prompt[i]``)."""
        prompts = split_completion_prompt(prompt)
        counts = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                with fault_param(prompt_param(prompt, i)):
                    counts.append(self.count_prompt_text(p))
            else:
                self.check_ids(p, prompt_param(prompt, i))
                counts.append(len(p))
        return PromptCount(tuple(counts))

    async def acount_prompt(self, prompt: Any) -> PromptCount:
        """:meth:`count_prompt`, in a worker thread for long input or when the payer's share of
        the event loop is spent (:func:`on_loop`)."""
        return await off_loop(prompt_cost(prompt, self.offload_chars), self.offload_chars, self.count_prompt, prompt)

    async def acount_chat(self, messages: Any, tools: Any = None, options: ChatOptions = DEFAULT_CHAT) -> int:
        """:meth:`count_chat`, in a worker thread for long input or when the payer's share of
        the event loop is spent (:func:`on_loop`)."""
        cost = chat_cost(messages, tools, self.offload_chars)
        return await off_loop(cost, self.offload_chars, self.count_chat, messages, tools, options)

    # ------------------------------------------------------------ token ids (/tokenize)
    def prompt_token_ids(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a completions-style text as the engine encodes it (with the tokenizer's
        added tokens when ``add_special_tokens``): what ``/tokenize`` answers. Counters that
        only count over the network raise ``NotImplementedError``."""
        raise NotImplementedError(f"{type(self).__name__} does not produce token ids")

    def chat_token_ids(self, messages: Any, tools: Any = None, options: ChatOptions = DEFAULT_CHAT) -> list[int]:
        """Token ids of a chat rendered with ``options`` (text-only: raises
        :class:`~tokenizer.errors.ImagesNotSupportedError` on an image part, whose ids the
        gateway does not know)."""
        raise NotImplementedError(f"{type(self).__name__} does not produce token ids")

    def token_strs(self, ids: list[int]) -> list[str]:
        """Each id's token as a string (vLLM ``/tokenize``'s ``return_token_strs``)."""
        raise NotImplementedError(f"{type(self).__name__} does not produce token strings")
