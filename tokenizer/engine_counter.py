"""Counting with the engine's own tokenize endpoint (exact by definition; costs a round trip).

Shapes (request -> response), as the engines define them:

- SGLang ``POST {base}/v1/tokenize`` (``serving_tokenize.py``): ``{"model", "prompt": str |
  [str], "add_special_tokens": true}`` -> ``{"tokens": [...] | [[...]], "count": n | [n...],
  "max_model_len": m}``. SGLang takes no ``messages`` there; the bundled backend serves the same
  path and also takes ``{"model", "messages", "add_generation_prompt", "tools"}``.
- vLLM ``POST {base}/tokenize`` (``serving_tokenization.py``): ``{"model", "prompt": str,
  "add_special_tokens": true}`` or ``{"model", "messages", "add_generation_prompt": true,
  "tools"}`` -> ``{"count": n, "max_model_len": m, "tokens": [...]}``.

Detokenize (:meth:`EngineCounter.adecode`, the verifier's view of a token-id prompt):

- SGLang ``POST {base}/v1/detokenize`` (``serving_detokenize``; the bundled backend serves the
  same): ``{"model", "tokens": [...]}`` -> ``{"text": str}``;
- vLLM ``POST {base}/detokenize`` (``serving_tokenization.py``): ``{"model", "tokens": [...]}``
  -> ``{"prompt": str}``.

kvgate sends one string per request (SGLang's list form is not served by every engine that
offers the path). Image parts are removed from the messages sent and cost what the model's image
policy says, as with the other counters. Chat options that change the prompt
(``add_generation_prompt``, ``continue_final_message``, ``chat_template_kwargs``) are sent too.
A failed or malformed answer is an :class:`~tokenizer.errors.EngineTokenizeError` (502): the
engine's fault, never the client's 400 and never a 500. Every call is bounded as the gateway's
other engine clients are (the pool watcher's ``_get``, the forward path): it asks for
``identity`` and refuses any other content coding, reads at most :data:`MAX_ENGINE_BODY_BYTES`
(in all, for the calls of one batch prompt: :class:`ByteBudget`; the decodes of one request's
token-id prompts share one budget, sized by what their ids can honestly answer:
:func:`decode_budget`), takes at most ``timeout_seconds`` from the connect to the answer's last
byte, and parses with orjson, whose nesting limit is a parse failure like any other.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeGuard

import httpx
import orjson

from tokenizer.base import PromptCount, PromptCounter, off_loop, prompt_cost, prompt_param, split_completion_prompt
from tokenizer.chat import DEFAULT_CHAT, IMAGE_PART_TYPES, ChatOptions, chat_cost, render_chatml
from tokenizer.errors import EngineTokenizeError

ENGINE_APIS = ("sglang", "vllm")
#: tokenize requests in flight for one batch prompt
MAX_CONCURRENT_REQUESTS = 8
#: the most bytes one tokenize or detokenize answer may have; a longer one is the engine's fault
#: (502). The largest honest answers: a body of the default ``gateway.max_body_bytes`` (8 MiB)
#: holds at most 4 Mi token ids (``0,`` each), and ``/tokenize`` of a prompt that long writes each
#: id in at most 12 bytes (10 digits, a comma, a space): 48 MiB. ``/detokenize`` answers the text
#: of at most a context's ids, the text a completion of as many tokens answers, which the forward
#: path reads whole under ``gateway.max_response_bytes`` (default 64 MiB). This bounds the memory
#: and the parse (on the event loop) a broken engine costs one request: the answers to a batch
#: prompt's strings share it (:class:`ByteBudget`), as the strings share one body (their ids
#: together are those of one string as long; each answer adds some tens of bytes of framing, and
#: a batch holds at most a tenant's ``max_embedding_inputs``, default 2,048, strings); so do the
#: ``/detokenize`` answers to a batch's token-id prompts, up to what their ids can honestly answer
#: (:func:`decode_budget`)
MAX_ENGINE_BODY_BYTES = 64 << 20
#: the most bytes one token id's text can take in an honest ``/detokenize`` answer: the longest
#: token of the vocabularies kvgate ships or counts with (128 bytes: cl100k_base's longest, 128
#: spaces; SmolLM2's is 81) times 6. Each byte of a token decodes to at most one character (a byte
#: that is no whole character becomes U+FFFD), and a character's JSON is at most 6 bytes a UTF-16
#: unit (``\uXXXX``; a 4-byte character is two units, 12 bytes, 3 a byte). A token's text is not
#: bounded by the id's few bytes in the request body, so a batch's ids do not bound its text
MAX_ANSWER_BYTES_PER_ID = 128 * 6


class ByteBudget:
    """The bytes the engine's answers to one request's calls may still hold, all calls together:
    ``limit``, :data:`MAX_ENGINE_BODY_BYTES` (read when the budget is made) when ``None``.
    ``calls``: how many calls share it (for the message). Once an answer went over it, it is
    ``spent``: the calls that share it read nothing more, and a call not yet made is not made
    (:meth:`check`)."""

    __slots__ = ("calls", "left", "limit", "spent")

    def __init__(self, calls: int = 1, limit: int | None = None) -> None:
        self.limit = self.left = MAX_ENGINE_BODY_BYTES if limit is None else limit
        self.calls = calls
        self.spent = False

    def take(self, what: str, url: str, n: int) -> None:
        """Charge ``n`` more bytes of an answer, before they are kept. Raises
        :class:`EngineTokenizeError` when they are more than the budget has left, or it is spent."""
        if self.spent or n > self.left:
            self.spent = True
            raise self._over(what, url)
        self.left -= n

    def check(self, what: str, url: str) -> None:
        """Before a call is made: raises :class:`EngineTokenizeError` (the message :meth:`take`
        raised) when the budget is spent, so the call is never asked."""
        if self.spent:
            raise self._over(what, url)

    def _over(self, what: str, url: str) -> EngineTokenizeError:
        shared = f" in all to {self.calls} calls" if self.calls > 1 else ""
        return EngineTokenizeError(f"engine {what} at {url} answered more than {self.limit} bytes{shared}")


def decode_budget(prompt_ids: Sequence[Sequence[int]]) -> ByteBudget:
    """The one budget of the ``/detokenize`` answers to one request's token-id prompts: what an
    honest engine can answer for their ids (:data:`MAX_ANSWER_BYTES_PER_ID` each; an answer's
    framing, some tens of bytes, fits in what its ids leave: no token of those vocabularies takes
    more than 128 bytes of JSON, even escaped to ASCII), at least :data:`MAX_ENGINE_BODY_BYTES`
    (one answer's cap) and at most that cap a prompt (what each decode read on its own before
    they shared a budget)."""
    ids = sum(map(len, prompt_ids))
    prompts = len(prompt_ids)
    limit = max(MAX_ENGINE_BODY_BYTES, min(prompts * MAX_ENGINE_BODY_BYTES, ids * MAX_ANSWER_BYTES_PER_ID))
    return ByteBudget(prompts, limit)


def _is_count(x: Any) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _counts_of(data: Any, expected: int) -> list[int]:
    """Counts from a tokenize answer: ``count`` (an int, or a list for a batch) or else the length
    of ``tokens``. Raises :class:`EngineTokenizeError` for any other shape."""
    if not isinstance(data, dict):
        raise EngineTokenizeError("engine tokenize answered JSON that is not an object")
    count, tokens = data.get("count"), data.get("tokens")
    if expected == 1:
        if _is_count(count):
            return [count]
        if isinstance(tokens, list):
            return [len(tokens)]
    else:
        if isinstance(count, list) and len(count) == expected and all(map(_is_count, count)):
            return list(count)
        if isinstance(tokens, list) and len(tokens) == expected and all(isinstance(t, list) for t in tokens):
            return [len(t) for t in tokens]
    raise EngineTokenizeError(f"engine tokenize answered without a usable 'count' or 'tokens' for {expected} prompt(s)")


def chat_tokenize_payload(messages: list[Any], tools: Any, options: ChatOptions) -> dict[str, Any]:
    """A chat tokenize request's body without ``model`` (vLLM ``TokenizeChatRequest``): the
    messages without their image parts, ``add_generation_prompt``, and the fields that change the
    prompt when they are set (``continue_final_message``, ``chat_template_kwargs``, ``tools``)."""
    payload: dict[str, Any] = {
        "messages": _without_images(messages),
        "add_generation_prompt": options.add_generation_prompt,
    }
    if options.continue_final_message:
        payload["continue_final_message"] = True
    if options.template_kwargs:
        payload["chat_template_kwargs"] = dict(options.template_kwargs)
    if tools:
        payload["tools"] = tools
    return payload


def _without_images(messages: list[Any]) -> list[Any]:
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            m = {**m, "content": [p for p in content if p.get("type") not in IMAGE_PART_TYPES]}
        out.append(m)
    return out


class EngineCounter(PromptCounter):
    """Asks the engine at ``base_url`` (no ``/v1``) for ``model``'s counts; ``api`` is ``sglang``
    (``/v1/tokenize``) or ``vllm`` (``/tokenize``). Only the async API is available (network I/O);
    the sync methods raise ``NotImplementedError``. ``vocab_size`` bounds token-id validation (the
    engine's vocabulary is not known here). Token ids are validated locally, never sent.
    ``api_key``: sent as ``Authorization: Bearer`` on every tokenize call (an engine started with
    ``--api-key`` answers 401 without it, which is a 502 here). ``timeout_seconds`` bounds each
    call whole, from the connect to the answer's last byte (httpx's timeout bounds each wait in
    it, so an engine that trickles its answer would hold the request, and its tenant's lease,
    for as long as it likes)."""

    def __init__(
        self,
        base_url: str,
        model: str,
        api: str = "sglang",
        vocab_size: int = 1 << 31,
        image_tokens: int = 765,
        timeout_seconds: float = 5.0,
        client: httpx.AsyncClient | None = None,
        api_key: str | None = None,
    ) -> None:
        if api not in ENGINE_APIS:
            raise ValueError(f"engine api must be one of {ENGINE_APIS}, not {api!r}")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.api = api
        self.vocab_size = vocab_size
        self.image_tokens = image_tokens
        self.timeout_seconds = timeout_seconds
        self._client = client or httpx.AsyncClient(timeout=timeout_seconds, trust_env=False)
        self.url = f"{self.base_url}/v1/tokenize" if api == "sglang" else f"{self.base_url}/tokenize"
        self._headers = {"authorization": f"Bearer {api_key}"} if api_key else None
        #: ``identity``: the byte bound counts the bytes as sent, so they must be the body itself
        self._post_headers = {
            "content-type": "application/json",
            "accept-encoding": "identity",
            **(self._headers or {}),
        }
        self.detokenize_url = f"{self.base_url}/v1/detokenize" if api == "sglang" else f"{self.base_url}/detokenize"

    counts_sync = False

    @property
    def auth_headers(self) -> dict[str, str] | None:
        """The ``Authorization`` header sent with every tokenize and detokenize call (``None``: no
        API key)."""
        return self._headers

    def count_text(self, text: str) -> int:
        raise NotImplementedError("EngineCounter counts only through its async API")

    def count_chat(self, messages: Any, tools: Any = None, options: ChatOptions = DEFAULT_CHAT) -> int:
        raise NotImplementedError("EngineCounter counts only through its async API")

    def is_valid_id(self, token_id: int) -> bool:
        """Ids in ``[0, vocab_size)``."""
        return 0 <= token_id < self.vocab_size

    async def _ask(self, payload: dict[str, Any], expected: int = 1, budget: ByteBudget | None = None) -> list[int]:
        return await self._ask_raw(orjson.dumps({"model": self.model, **payload}), expected, budget)

    async def _ask_raw(self, body: bytes, expected: int = 1, budget: ByteBudget | None = None) -> list[int]:
        return _counts_of(await self._post_json(self.url, body, "tokenize", budget), expected)

    async def _post_json(self, url: str, body: bytes, what: str, budget: ByteBudget | None = None) -> Any:
        """``POST body`` to ``url`` and the answer's JSON, bounded as the module docstring says
        (``what``: ``tokenize`` or ``detokenize``, for the message; ``budget``: the bytes it may
        read, shared with the request's other calls; a budget of its own when ``None``). Raises
        :class:`EngineTokenizeError` for a failure, a late, coded or oversized answer, a non-200,
        or a body orjson cannot parse (nesting past its limit included), and without asking when
        ``budget`` is already spent."""
        budget = budget or ByteBudget()
        budget.check(what, url)
        try:
            async with asyncio.timeout(self.timeout_seconds):
                raw = await self._read_bounded(url, body, what, budget)
        except TimeoutError:
            raise EngineTokenizeError(
                f"engine {what} at {url} answered nothing whole within {self.timeout_seconds:g} s"
            ) from None
        except httpx.HTTPError as e:
            raise EngineTokenizeError(f"engine {what} at {url} failed: {type(e).__name__}") from None
        try:
            return orjson.loads(raw)
        except (ValueError, RecursionError):
            raise EngineTokenizeError(f"engine {what} at {url} answered a body that is not JSON") from None

    async def _read_bounded(self, url: str, body: bytes, what: str, budget: ByteBudget) -> bytearray:
        async with self._client.stream("POST", url, content=body, headers=self._post_headers) as r:
            if r.status_code != 200:
                raise EngineTokenizeError(f"engine {what} at {url} answered HTTP {r.status_code}")
            coding = r.headers.get("content-encoding", "").strip()
            if coding.lower() not in ("", "identity"):
                raise EngineTokenizeError(f"engine {what} at {url} answered with Content-Encoding {coding!r}")
            raw = bytearray()
            async for chunk in r.aiter_bytes():  # the bytes as sent: no coding is left to undo
                budget.take(what, url, len(chunk))
                if len(raw) + len(chunk) > MAX_ENGINE_BODY_BYTES:  # one answer's own cap, whatever the budget left
                    raise EngineTokenizeError(
                        f"engine {what} at {url} answered more than {MAX_ENGINE_BODY_BYTES} bytes"
                    )
                raw += chunk
            return raw

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError("EngineCounter decodes only through its async API")

    async def adecode(self, ids: list[int], budget: ByteBudget | None = None) -> str:
        """The engine's text of ``ids`` (its ``/detokenize``: SGLang ``text``, vLLM ``prompt``).
        ``budget``: the bytes the answer may hold, shared with the other decodes of one request's
        token-id prompts (:meth:`prompt_decoder`); a budget of its own when
        ``None``. Raises :class:`EngineTokenizeError` when the engine fails or answers another
        shape, or the budget is over (or was spent by an earlier answer: the engine is not asked)."""
        url = self.detokenize_url
        body = orjson.dumps({"model": self.model, "tokens": list(ids)})
        data = await self._post_json(url, body, "detokenize", budget)
        text = data.get("text", data.get("prompt")) if isinstance(data, dict) else None
        if not isinstance(text, str):
            raise EngineTokenizeError(f"engine detokenize at {url} answered without a 'text' string")
        return text

    def prompt_decoder(self, prompt_ids: Sequence[Sequence[int]]) -> Callable[[list[int]], Awaitable[str]]:
        """:meth:`adecode` with one :class:`ByteBudget` for all of one request's token-id prompts
        ``prompt_ids``, sized by what an honest engine can answer for their ids
        (:func:`decode_budget`: an id's text is not bounded by its bytes in the body; N prompts of
        a few ids never hold N answers' worth of the engine's text)."""
        return functools.partial(self.adecode, budget=decode_budget(prompt_ids))

    def _local_part(self, prompt: Any) -> tuple[list[int | None], list[tuple[int, str]]]:
        """Split ``prompt``; count and check its token-id prompts here. Returns the counts so far
        (``None`` for each string) and ``(index, string)`` of the strings to ask the engine about."""
        counts: list[int | None] = []
        texts: list[tuple[int, str]] = []
        for i, p in enumerate(split_completion_prompt(prompt)):
            if isinstance(p, str):
                texts.append((i, p))
                counts.append(None)
            else:
                self.check_ids(p, prompt_param(prompt, i))
                counts.append(len(p))
        return counts, texts

    async def acount_prompt(self, prompt: Any) -> PromptCount:
        """Counts of a completions ``prompt``: ids validated and counted here, each string asked
        of the engine in a request of its own (:meth:`_count_texts`). Raises the typed errors of
        :mod:`tokenizer.errors`."""
        cost = prompt_cost(prompt, self.offload_chars)
        counts, texts = await off_loop(cost, self.offload_chars, self._local_part, prompt)
        answers = await self._count_texts([t for _, t in texts])
        for (i, _), n in zip(texts, answers, strict=True):
            counts[i] = n
        return PromptCount(tuple(int(c) for c in counts if c is not None))

    async def _count_texts(self, texts: list[str]) -> list[int]:
        """The engine's count of each of ``texts``, one request each (a single string is the shape
        every engine takes), up to :data:`MAX_CONCURRENT_REQUESTS` at once, their answers reading
        one :class:`ByteBudget` together (N strings never cost N answers' worth of memory). The
        first failure ends the others (cancelled, not left reading after the request's 502) and is
        raised as it is."""
        budget = ByteBudget(len(texts))
        sem = asyncio.Semaphore(MAX_CONCURRENT_REQUESTS)

        async def one(text: str) -> int:
            async with sem:
                return (await self._ask({"prompt": text, "add_special_tokens": True}, budget=budget))[0]

        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(one(t)) for t in texts]
        except BaseExceptionGroup as group:
            raise group.exceptions[0] from None
        return [t.result() for t in tasks]

    async def acount_chat(self, messages: Any, tools: Any = None, options: ChatOptions = DEFAULT_CHAT) -> int:
        """Tokens of a chat as the engine renders it, plus :meth:`images_cost` of the image parts
        (image parts are not sent). Every field that changes the engine's prompt goes to its
        tokenize endpoint: ``messages``, ``tools``, ``add_generation_prompt``,
        ``continue_final_message`` and ``chat_template_kwargs`` (vLLM ``TokenizeChatRequest``)."""
        cost = chat_cost(messages, tools, self.offload_chars)
        rendered, body = await off_loop(cost, self.offload_chars, self._chat_payload, messages, tools, options)
        return (await self._ask_raw(body))[0] + self.images_cost(rendered.image_parts)

    def _chat_payload(self, messages: Any, tools: Any, options: ChatOptions) -> tuple[Any, bytes]:
        """Validate and render the chat locally (shapes, part types, image parts) and encode the
        tokenize request's JSON body."""
        rendered = render_chatml(messages, tools, ChatOptions(add_generation_prompt=options.add_generation_prompt))
        return rendered, orjson.dumps({"model": self.model, **chat_tokenize_payload(messages, tools, options)})

    async def atokenize_ids(self, payload: dict[str, Any]) -> tuple[int, list[int]]:
        """``(count, tokens)`` of one tokenize request (``{"prompt", "add_special_tokens"}`` or
        ``{"messages", "add_generation_prompt", "tools", ...}``, image parts already removed), as
        the engine answers it: ``count`` is the engine's (``len(tokens)`` when it sends none).
        Raises :class:`EngineTokenizeError` for a failure or an answer without a list of int
        ``tokens``. (kvgate's ``/tokenize`` for ``engine`` tokenizers.)"""
        data = await self._post_json(self.url, orjson.dumps({"model": self.model, **payload}), "tokenize")
        answer = data if isinstance(data, dict) else {}
        tokens = answer.get("tokens")
        if not isinstance(tokens, list) or not all(_is_count(t) for t in tokens):
            raise EngineTokenizeError(f"engine tokenize at {self.url} answered without a list of token ids")
        count = answer.get("count")
        return (count if _is_count(count) else len(tokens)), tokens

    async def aclose(self) -> None:
        """Close the HTTP client."""
        await self._client.aclose()
