"""Counting with a Hugging Face ``tokenizer.json`` and the Jinja chat template of
``tokenizer_config.json`` (extra ``hf``: tokenizers, jinja2). Loads only from a local folder and
never imports ``transformers`` (nor, through it, torch).

What is counted, and why it is never fewer than what the engine sees:

- chats are rendered as ``transformers``' ``apply_chat_template(..., add_generation_prompt=True,
  tokenize=True)`` does (same Jinja environment: ``trim_blocks``, ``lstrip_blocks``, loop
  controls, its ``tojson``, ``raise_exception``, ``strftime_now``; the tokenizer's special tokens
  as variables) and the rendered text is encoded without added BOS/EOS, as vLLM and SGLang do for
  chats. Content parts are joined as each engine joins them before a "string"-format template
  runs (:func:`_plain_messages`): behind vLLM text parts with ``"\\n"``, empty ones dropped, and
  each image's placeholder in front of the text (or in place) with a ``"\\n"`` of its own, the
  prompt cut where each placeholder stands; each image part costs what the image policy says;
- a ``/v1/completions`` string prompt is encoded with the tokenizer's post-processor (BOS for
  Llama-family tokenizers), as the engines' ``tokenizer.encode(prompt)`` does;
- a special-token look-alike (``<|im_start|>``) in any request string is counted as ordinary text:
  the engine's tokenizer would read it as one special token, kvgate adds the difference to its
  text encoding (so the count is the engine's plus that surcharge, never less).

The same class is the bundled engine's tokenizer when it serves an HF folder (docs/design.md, Models):
``encode_text`` / ``encode_prompt_text`` / ``encode_chat`` return ids whose length is exactly
``count_text`` / ``count_prompt_text`` / ``count_chat``, with every look-alike in user text encoded
as text (special tokens come only from the template and the post-processor). ``token_bytes`` and
``eos_token_ids`` drive the engine's incremental detokenization and stopping.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizer.base import PromptCounter
from tokenizer.chat import DEFAULT_CHAT, IMAGE_PART_TYPES, ChatOptions, render_chatml
from tokenizer.engine_render import (
    engine_tools,
    schema_forms,
    sglang_messages,
    sglang_parts_messages,
    views_of,
    vllm_messages,
    vllm_parts,
    vllm_string_content,
)
from tokenizer.errors import ImagesNotSupportedError, InvalidPromptError
from tokenizer.guard import fault_param, guarded

#: tokenizer_config.json keys passed to the template as variables (transformers' special_tokens_map).
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (``openai/gpt-2`` ``encoder.py``, also the
    ``tokenizers`` ByteLevel pre-tokenizer): the alphabet byte-level BPE vocabularies are written in."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


_UNICODE_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _uses_byte_level(component: Any) -> bool:
    """Whether a ``tokenizer.json`` component (dict, possibly a ``Sequence``) is or holds ByteLevel."""
    if not isinstance(component, dict):
        return False
    if component.get("type") == "ByteLevel":
        return True
    return any(_uses_byte_level(c) for c in component.get("decoders") or component.get("pretokenizers") or [])


def _model_eos_ids(folder: Path) -> set[int]:
    """``eos_token_id`` (an int or a list) of ``generation_config.json`` and ``config.json``."""
    out: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        f = folder / name
        if not f.is_file():
            continue
        try:
            v = json.loads(f.read_text(encoding="utf-8")).get("eos_token_id")
        except (ValueError, AttributeError):
            continue
        for i in v if isinstance(v, list) else [v]:
            if isinstance(i, int) and not isinstance(i, bool) and i >= 0:
                out.add(i)
    return out


def _strings(obj: Any) -> Iterator[str]:
    """Every string (dict keys included) inside ``obj``, iteratively."""
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, str):
            yield x
        elif isinstance(x, dict):
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)


NO_TEMPLATE = "This model's tokenizer has no chat template; use /v1/completions."


def _marker_swap(special_re: re.Pattern[str], nonce: str, found: list[str]) -> Callable[[Any], Any]:
    """A function that copies a request value (dicts, lists, strings; keys too) with each match of
    ``special_re`` replaced by ``\\ue000{nonce}:{i}\\ue001``, ``i`` the match's index in ``found``
    (where the matched text is appended)."""

    def mark(m: re.Match[str]) -> str:
        found.append(m.group())
        return f"\ue000{nonce}:{len(found) - 1}\ue001"

    def swap(x: Any) -> Any:
        if isinstance(x, str):
            return special_re.sub(mark, x)
        if isinstance(x, dict):
            return {swap(k): swap(v) for k, v in x.items()}
        if isinstance(x, list):
            return [swap(v) for v in x]
        return x

    return swap


def _joined(content: Any) -> Any:
    """The messages as sent (the bundled backend's own rendering, and an ``openai`` upstream's,
    which counts on its side): text parts joined with ``"\\n"``, images left out (costed apart);
    ``None`` (an assistant turn of tool calls) becomes ``""``. Behind vLLM see :func:`_vllm_text`."""
    if isinstance(content, list):
        return "\n".join(p.get(p["type"]) for p in content if p["type"] not in IMAGE_PART_TYPES)
    return "" if content is None else content


def _vllm_text(content: Any, interleave: bool, image_mark: str) -> str:
    """A message's content as vLLM hands it to a "string"-format template, with ``image_mark``
    where each image's placeholder goes (:func:`~tokenizer.engine_render.vllm_string_content`;
    ``vllm/entrypoints/chat_utils.py@001eadcf`` ``_parse_chat_message_content_parts``: text and
    refusal parts joined with ``"\\n"``, an empty one dropped by ``if parse_res:``; with an image,
    ``_get_full_multimodal_text_prompt``: ``"\\n".join(missing_placeholders + [text_prompt])``, the
    placeholders alone when no text is left, or, ``interleave`` (``--interleave-mm-strings``),
    each where its image was, joined with ``"\\n"``).

    The placeholder is the model's (``get_placeholder_str``: Qwen2-VL's
    ``<|vision_start|><|image_pad|><|vision_end|>``), special tokens that the tokenizer splits the
    text at and that the model's processor replaces with the image's tokens, which the image
    policy costs. The mark stands for it: the rendered prompt is cut at each mark and each piece
    encoded alone (:meth:`HFCounter.count_chat`), so the ``"\\n"`` vLLM puts beside each
    placeholder is counted, and the placeholder itself only as the image's cost."""
    joined = vllm_string_content(content, interleave)
    if isinstance(joined, str):
        return joined
    return "".join(p["text"] if p.get("type") == "text" else image_mark for p in joined)


def _plain_messages(
    messages: list[dict[str, Any]],
    engine: str | None,
    parts: bool = False,
    interleave: bool = False,
    image_mark: str = "",
) -> list[dict[str, Any]]:
    """Validated ``messages`` as ``engine`` hands them to a string-content template:
    :func:`~tokenizer.engine_render.vllm_messages` with content as :func:`_vllm_text` makes it
    (``interleave``, ``image_mark``), or :func:`~tokenizer.engine_render.sglang_messages` (text
    parts joined with a space, images dropped: SGLang's "string" format never loads them);
    ``None``: every key as sent, content as :func:`_joined`. ``parts``: as the engine hands them
    to an "openai"-format template (content as a list of parts, each image ``{"type": "image"}``,
    whose placeholder the template writes: :func:`~tokenizer.engine_render.vllm_parts`,
    :func:`~tokenizer.engine_render.sglang_parts_messages`)."""
    if engine == "sglang":
        return _alias_reasoning(sglang_parts_messages(messages) if parts else sglang_messages(messages))
    if engine == "vllm" and parts:
        return _alias_reasoning(
            [{**m, "content": vllm_parts(m.get("content"), m.get("role"))} for m in vllm_messages(messages)]
        )
    if engine == "vllm":
        return _alias_reasoning(
            [{**m, "content": _vllm_text(m.get("content"), interleave, image_mark)} for m in vllm_messages(messages)]
        )
    return _alias_reasoning([{**m, "content": _joined(m.get("content"))} for m in messages])


def _is_content(node: Any, aliases: frozenset[str]) -> bool:
    """Whether a Jinja AST node reads some ``x['content']`` / ``x.content`` (through filters, tests
    and slices), or a name set from one (``aliases``)."""
    from jinja2 import nodes

    while True:
        if isinstance(node, (nodes.Filter, nodes.Test)) and node.node is not None:
            node = node.node
        elif isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
            node = node.node
        else:
            break
    if isinstance(node, nodes.Getattr):
        return node.attr == "content"
    if isinstance(node, nodes.Getitem):
        return isinstance(node.arg, nodes.Const) and node.arg.value == "content"
    return isinstance(node, nodes.Name) and node.name in aliases


def _loops_over_content(source: str) -> bool:
    """Whether a chat template iterates a message's content (vLLM's and SGLang's test for an
    "openai"-format template, taken loosely: any ``for`` over any ``.content``, directly or
    through a ``set`` alias), so that the engines may hand it content as a list of parts."""
    import jinja2
    from jinja2 import nodes

    try:
        ast = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(source)
    except jinja2.TemplateError:
        return False
    aliases = frozenset(
        a.target.name
        for a in ast.find_all(nodes.Assign)
        if isinstance(a.target, nodes.Name) and _is_content(a.node, frozenset())
    )
    return any(_is_content(f.iter, aliases) for f in ast.find_all(nodes.For))


def _parts_engines(source: str) -> frozenset[str]:
    """The rebuilding engines that may hand ``source`` content as parts: both for a template that
    loops over content; SGLang also for any template that mentions image/audio/video/vision
    (``detect_jinja_template_content_format``'s shortcut)."""
    if _loops_over_content(source):
        return frozenset({"vllm", "sglang"})
    if any(k in source for k in ("image", "audio", "video", "vision")):
        return frozenset({"sglang"})
    return frozenset()


#: the names a message's reasoning goes under, the first the one templates read (transformers
#: utils/chat_template_utils.py, 5.x, ``_REASONING_FIELDS``)
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _alias_reasoning(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """transformers' ``_alias_reasoning_fields`` (chat_template_utils.py, 5.x), which
    ``apply_chat_template`` runs on every message before the template, the engines' included:
    the first non-null of :data:`REASONING_FIELDS` also becomes ``thinking`` (unless set) and
    ``reasoning_content``."""
    out = []
    for m in messages:
        reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
        out.append(m if reasoning is None else {"thinking": reasoning, **m, "reasoning_content": reasoning})
    return out


def _compile_template(source: str) -> Any:
    """The chat template compiled in transformers' sandboxed Jinja environment."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])

    def tojson(
        x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
    ) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


#: texts longer than this (characters) are encoded with the GIL released (:meth:`HFCounter._encode`)
GIL_FREE_ENCODE_CHARS = 16_384


class HFCounter(PromptCounter):
    """A Hugging Face tokenizer folder (``tokenizer.json``, optional ``tokenizer_config.json`` with
    ``chat_template`` and the special tokens). Raises ``FileNotFoundError`` when ``tokenizer.json``
    is missing and ``ImportError`` without the ``hf`` extra."""

    def __init__(self, path: str | Path, image_tokens: int = 765) -> None:
        from tokenizers import Tokenizer  # extra "hf"

        folder = Path(path)
        #: the tokenizer's folder
        self.path = folder
        tok_file = folder / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"{tok_file}: no tokenizer.json in the model's tokenizer folder")
        self.tokenizer = Tokenizer.from_file(str(tok_file))
        #: the same tokenizer, reading special-token text as ordinary text
        self._text_tokenizer = Tokenizer.from_file(str(tok_file))
        self._text_tokenizer.encode_special_tokens = True
        cfg_path = folder / "tokenizer_config.json"
        self.config: dict[str, Any] = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.exists() else {}
        vocab = self.tokenizer.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1 if vocab else 0
        # a token's vocabulary entry is at least as long as the text it covers (byte-level: one
        # character per byte; metaspace: one per character; byte fallback "<0xE3>": 6 for 1 byte)
        self.max_token_chars = max((len(k) for k in vocab), default=0) or None
        self._holes = frozenset(range(self.vocab_size)) - frozenset(vocab.values())
        self.image_tokens = image_tokens
        specials = [t.content for t in self.tokenizer.get_added_tokens_decoder().values() if t.special]
        self.special_token_texts = frozenset(specials)
        #: special token -> extra tokens when read as text (only those costing more than 1)
        self._surcharge: dict[str, int] = {}
        for s in specials:
            extra = len(self._text_tokenizer.encode(s, add_special_tokens=False).ids) - 1
            if extra > 0:
                self._surcharge[s] = extra
        self._by_prefix: dict[str, list[str]] = {}
        for s in sorted(self._surcharge, key=len, reverse=True):
            self._by_prefix.setdefault(s[:2], []).append(s)
        #: every special token's text, longest first (leftmost-longest, as the tokenizer matches them)
        self._special_re = (
            re.compile("|".join(re.escape(s) for s in sorted(set(specials), key=len, reverse=True)))
            if specials
            else None
        )
        self.special_ids = frozenset(i for i, t in self.tokenizer.get_added_tokens_decoder().items() if t.special)
        probe = self._encode("a", add_special_tokens=False).ids
        framed = self._encode("a", add_special_tokens=True).ids
        at = next((i for i in range(len(framed) - len(probe) + 1) if framed[i : i + len(probe)] == probe), 0)
        #: what the post-processor puts around a prompt (a Llama BOS: ``[1]``, ``[]``)
        self.prompt_prefix, self.prompt_suffix = framed[:at], framed[at + len(probe) :]
        self._byte_level = _uses_byte_level(json.loads(self.tokenizer.to_str()).get("decoder"))
        self._token_bytes: dict[int, bytes] = {}
        eos = self._special_value("eos_token")
        eos_id = self.tokenizer.token_to_id(eos) if eos else None
        #: ids that end a completion: tokenizer_config ``eos_token`` + the model's ``eos_token_id`` list
        self.eos_token_ids = frozenset(({eos_id} if eos_id is not None else set()) | _model_eos_ids(folder))
        template = self.config.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            template = next(
                (t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"), None
            )
        self._template = _compile_template(template) if isinstance(template, str) and template else None
        #: engines that may render this template with content as a list of parts (both forms are counted)
        self._parts_engines = _parts_engines(template) if isinstance(template, str) and template else frozenset()

    # ---- the engine's side: ids, bytes ------------------------------------------------------------
    def encode_text(self, text: str) -> list[int]:
        """Ids of ordinary text, no BOS/EOS; a special-token look-alike becomes its text encoding.
        ``len(encode_text(t)) == count_text(t)``: the tokenizer splits its input at special tokens
        before pre-tokenizing, so each look-alike's one id is replaced by its text ids alone."""
        if self._special_re is None or not self._special_re.search(text):
            return self._encode(text, add_special_tokens=False).ids
        ids: list[int] = []
        pos = 0
        for m in self._special_re.finditer(text):
            if m.start() > pos:
                ids += self._encode(text[pos : m.start()], add_special_tokens=False).ids
            ids += guarded(self._text_tokenizer.encode, m.group(), add_special_tokens=False).ids
            pos = m.end()
        if pos < len(text):
            ids += self._encode(text[pos:], add_special_tokens=False).ids
        return ids

    def encode_prompt_text(self, text: str) -> list[int]:
        """Ids of a completions prompt: :meth:`encode_text` framed by the post-processor's tokens
        (``len == count_prompt_text``)."""
        return [*self.prompt_prefix, *self.encode_text(text), *self.prompt_suffix]

    def encode_chat(self, messages: Any, tools: Any = None, options: ChatOptions = DEFAULT_CHAT) -> list[int]:
        """Ids of a chat rendered with the template (generation prompt included), special tokens
        only from the template; ``len == count_chat`` (text-only chats). Each look-alike in a request
        string is swapped for a random marker before rendering, and the marker for the look-alike's
        text ids after. Raises :class:`InvalidPromptError` (as :meth:`render_chat`),
        :class:`ImagesNotSupportedError` for an image part (the engine takes text only)."""
        prompt, images = self.render_chat(messages, tools, options)
        if images:
            raise ImagesNotSupportedError("This model does not accept image content parts.", "messages")
        strings = _strings([messages, tools, options.template_kwargs])
        if self._special_re is None or not any(self._special_re.search(s) for s in strings):
            return self._encode(prompt, add_special_tokens=False).ids
        return self._encode_marked(self._special_re, messages, tools, options)

    def _encode_marked(self, special_re: re.Pattern[str], messages: Any, tools: Any, options: ChatOptions) -> list[int]:
        """:meth:`encode_chat` of a chat holding look-alikes (``special_re`` matches): the chat
        rendered with each look-alike swapped for a marker, then each marker encoded as its
        look-alike's text and the rest as rendered."""
        nonce = secrets.token_hex(8)
        found: list[str] = []
        swap = _marker_swap(special_re, nonce, found)
        # template kwargs stay as they are: count_chat charges no surcharge for them either
        prompt, _ = self.render_chat(swap(messages), swap(tools) if tools else tools, options)
        ids: list[int] = []
        pos = 0
        for m in re.finditer(f"\ue000{nonce}:(\\d+)\ue001", prompt):
            if m.start() > pos:
                ids += self._encode(prompt[pos : m.start()], add_special_tokens=False).ids
            ids += guarded(self._text_tokenizer.encode, found[int(m.group(1))], add_special_tokens=False).ids
            pos = m.end()
        if pos < len(prompt):
            ids += self._encode(prompt[pos:], add_special_tokens=False).ids
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one id stands for, for incremental UTF-8 detokenization (special and unknown
        ids: ``b""``). Byte-level vocabularies map each character back through GPT-2's table;
        others: ``<0xNN>`` byte-fallback tokens are that byte, ``▁`` is a space (SentencePiece)."""
        b = self._token_bytes.get(token_id)
        if b is not None:
            return b
        piece = self.tokenizer.id_to_token(token_id)
        if piece is None or token_id in self.special_ids:
            b = b""
        elif self._byte_level and all(c in _UNICODE_TO_BYTE for c in piece):
            b = bytes(_UNICODE_TO_BYTE[c] for c in piece)
        elif m := _BYTE_FALLBACK.fullmatch(piece):
            b = bytes([int(m.group(1), 16)])
        else:
            b = piece.replace("\u2581", " ").encode("utf-8")
        self._token_bytes[token_id] = b
        return b

    def _special_value(self, name: str) -> str | None:
        v = self.config.get(name)
        return v.get("content") if isinstance(v, dict) else v

    def _encode(self, text: str, add_special_tokens: bool = True) -> Any:
        """``tokenizers.Tokenizer.encode`` of ``text``; above :data:`GIL_FREE_ENCODE_CHARS`
        characters through ``encode_batch``, which releases the GIL while it runs (``encode``
        holds it: a 1 MB prompt counted in a worker thread stopped the event loop for 0.6 s,
        measured with tokenizers 0.23). The same ids either way."""
        if len(text) > GIL_FREE_ENCODE_CHARS:
            return guarded(self.tokenizer.encode_batch, [text], add_special_tokens=add_special_tokens)[0]
        return guarded(self.tokenizer.encode, text, add_special_tokens=add_special_tokens)

    def special_surcharge(self, text: str) -> int:
        """Extra tokens so that special-token look-alikes in ``text`` count as their text
        encoding rather than as one special token (occurrences found left to right, longest first)."""
        extra = 0
        for prefix, candidates in self._by_prefix.items():
            i = text.find(prefix)
            while i != -1:
                step = 1
                for s in candidates:
                    if text.startswith(s, i):
                        extra += self._surcharge[s]
                        step = len(s)
                        break
                i = text.find(prefix, i + step)
        return extra

    def count_text(self, text: str) -> int:
        """Tokens of ``text`` as ordinary text (no BOS/EOS)."""
        return len(self._encode(text, add_special_tokens=False).ids) + self.special_surcharge(text)

    def count_prompt_text(self, text: str) -> int:
        """Tokens of a completions prompt, with the post-processor's BOS/EOS as engines add them."""
        return len(self._encode(text, add_special_tokens=True).ids) + self.special_surcharge(text)

    def decode(self, ids: list[int]) -> str:
        """Text of token ids with the tokenizer's own decoder, special tokens kept (as the
        engine's ``/detokenize`` with ``skip_special_tokens=False``). The byte-level decoders
        replace invalid UTF-8 (a character cut by the last id) with U+FFFD."""
        return guarded(self.tokenizer.decode, list(ids), skip_special_tokens=False)

    def is_valid_id(self, token_id: int) -> bool:
        """Whether ``token_id`` is in the vocabulary (added tokens included)."""
        return 0 <= token_id < self.vocab_size and token_id not in self._holes

    def render_chat(
        self,
        messages: Any,
        tools: Any = None,
        options: ChatOptions = DEFAULT_CHAT,
        engine: str | None = None,
        parts: bool = False,
        rewrite_schema: bool = True,
        interleave: bool = False,
        image_mark: str = "",
    ) -> tuple[str, list]:
        """``(prompt text, image parts)``: the chat rendered with the model's template as
        ``transformers``' ``apply_chat_template`` does with ``options``, after ``engine``'s
        pre-template steps (:func:`_plain_messages`, with ``parts``, ``interleave`` and
        ``image_mark``; ``None``: the messages as sent; tools as
        :func:`~tokenizer.engine_render.engine_tools` gives them with ``rewrite_schema``) (generation prompt,
        ``continue_final_message``: the text cut where the final message ends, as transformers >= 5,
        template kwargs as variables). Raises :class:`InvalidPromptError` for a bad shape, no
        template, a template that rejects the chat, or a final message that cannot be continued
        (``param`` ``continue_final_message``); :class:`~tokenizer.errors.UnknownContentPartError`
        for an unknown part type."""
        # validation (shapes, part types) only
        rendered = render_chatml(messages, tools, ChatOptions(add_generation_prompt=options.add_generation_prompt))
        if self._template is None:
            raise InvalidPromptError(NO_TEMPLATE, "messages")
        plain = _plain_messages(messages, engine, parts, interleave, image_mark)
        tools = engine_tools(tools, engine, rewrite_schema)
        variables: dict[str, Any] = {k: v for k in SPECIAL_TOKEN_KEYS if (v := self._special_value(k)) is not None}
        variables.update(options.template_kwargs)
        variables["add_generation_prompt"] = options.add_generation_prompt and not options.continue_final_message
        if options.continue_final_message:
            prompt = self._continued(plain, tools, variables)
        else:
            prompt = self._render(plain, tools, variables)
        return prompt, rendered.image_parts

    def _render(self, plain: list[dict], tools: Any, variables: dict[str, Any]) -> str:
        if self._template is None:  # callers check first; this keeps the error in one place
            raise InvalidPromptError(NO_TEMPLATE, "messages")
        try:
            return self._template.render(messages=plain, tools=tools or None, **variables)
        except Exception as e:  # jinja2 TemplateError, or a template tripping over a value's type
            raise InvalidPromptError(f"The model's chat template rejected the messages: {e}", "messages") from None

    def _continued(self, plain: list[dict], tools: Any, variables: dict[str, Any]) -> str:
        """The prompt with the final message left open, as transformers >= 5 does (a tag appended
        to the final text, the rendering cut at it). Older transformers cut after the final text
        stripped instead; the two agree unless that text ends in whitespace, which is refused."""
        final = plain[-1].get("content") if plain else None
        if not isinstance(final, str) or not final.strip() or final != final.rstrip():
            raise InvalidPromptError(
                "'continue_final_message' needs a final message whose text is not empty"
                " and does not end in whitespace.",
                "continue_final_message",
            )
        tag = "CONTINUE_FINAL_MESSAGE_TAG "
        tagged = [*plain[:-1], {**plain[-1], "content": final + tag}]
        rendered = self._render(tagged, tools, variables)
        if tag.strip() not in rendered or final.strip() not in rendered:
            raise InvalidPromptError(
                "'continue_final_message': the chat template drops the final message's text.", "continue_final_message"
            )
        at = rendered.rindex(tag.strip())
        if rendered[at : at + len(tag)] == tag:
            return rendered[:at]
        return rendered[:at].rstrip()

    def _engine_prompts(self, messages: Any, tools: Any, options: ChatOptions) -> list[tuple[list[str], list]]:
        """``(prompt pieces, image parts)``: :meth:`render_chat` once per rendering of
        :attr:`engines` (:func:`tokenizer.engine_render.views_of`), the prompt cut where an image's
        placeholder stands (:func:`_vllm_text`; a mark with a random nonce per count, which no
        request can hold). Behind vLLM with an image sent, both placements of the placeholders
        (in front, and in place for ``--interleave-mm-strings``, which kvgate cannot see)."""
        mark = f"\ue000{secrets.token_hex(8)}:image\ue001"
        out = []
        for v in views_of(self.engines):
            for rewrite in schema_forms(tools, v):
                prompt, images = self.render_chat(messages, tools, options, v, rewrite_schema=rewrite, image_mark=mark)
                out.append((prompt.split(mark), images))
                if v == "vllm" and images:
                    prompt, _ = self.render_chat(
                        messages, tools, options, v, rewrite_schema=rewrite, interleave=True, image_mark=mark
                    )
                    out.append((prompt.split(mark), images))
                if v in self._parts_engines:  # the engine may hand this template content as parts
                    prompt, _ = self.render_chat(messages, tools, options, v, parts=True, rewrite_schema=rewrite)
                    out.append(([prompt], images))
        return out

    def count_chat(self, messages: Any, tools: Any = None, options: ChatOptions = DEFAULT_CHAT) -> int:
        """Prompt tokens of a chat: the rendered template (with ``options``, as each of
        :attr:`engines` renders it: the largest count) encoded without added BOS/EOS (each piece
        between two image placeholders alone: :meth:`_engine_prompts`), plus the special-token
        surcharge of every request string, plus :meth:`images_cost` of the image parts."""
        renderings = self._engine_prompts(messages, tools, options)
        with fault_param("messages"):
            tokens = max(
                sum(len(self._encode(p, add_special_tokens=False).ids) for p in pieces if p) for pieces, _ in renderings
            )
        images = renderings[0][1]
        surcharge = sum(self.special_surcharge(s) for s in _strings([messages, tools, options.template_kwargs]))
        return tokens + surcharge + self.images_cost(images)

    def prompt_token_ids(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids of a completions prompt as the engine's ``tokenizer.encode`` gives them (a
        look-alike of a special token is that special token here, as in the engine)."""
        return self._encode(text, add_special_tokens=add_special_tokens).ids

    def chat_token_ids(self, messages: Any, tools: Any = None, options: ChatOptions = DEFAULT_CHAT) -> list[int]:
        """Ids of the chat template rendered with ``options``, without added BOS/EOS (as vLLM and
        SGLang encode chats; the longest over :attr:`engines`' renderings). Raises
        :class:`~tokenizer.errors.ImagesNotSupportedError` on an image part."""
        renderings = self._engine_prompts(messages, tools, options)
        if renderings[0][1]:
            raise ImagesNotSupportedError("Token ids of image content parts are not known here.", "messages")
        # no image: no placeholder mark, each rendering is one piece
        with fault_param("messages"):
            return max((self._encode(pieces[0], add_special_tokens=False).ids for pieces, _ in renderings), key=len)

    def token_strs(self, ids: list[int]) -> list[str]:
        """Each id's vocabulary entry (``id_to_token``; ``""`` for an id it lacks)."""
        return [self.tokenizer.id_to_token(i) or "" for i in ids]
