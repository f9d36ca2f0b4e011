"""The response guards the verifier hands the gateway (:class:`verifier.stage.ResponseGuard`).

- :class:`BackgroundGuard` (sampled, non-strict): passes every event at once and queues the
  whole text for the background worker (:class:`verifier.jobs.JobQueue`).
- :class:`StrictGuard` (``strict_verify``): checks before release through
  :class:`verifier.strict.StrictChecks` (never a lock of its own, never on the event loop); a
  stream is held back by ``strict_holdback_tokens`` tokens per text stream and cut on detection.
- :class:`EchoStrip` and :class:`TextStream`: one text stream's echo strip, canary scan and
  shingler, and how far it has been checked.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Sequence
from typing import Any

from tokenizer.json_values import JsonStrings
from verifier.canary import CanaryScanner
from verifier.findings import MAX_TEXT_STREAMS, CheckJob
from verifier.incidents import Incident
from verifier.jobs import FATAL, JobQueue
from verifier.leak_index import LeakVerdict
from verifier.shingles import IncrementalShingler, ShingleHasher
from verifier.stage import Exchange, ResponseWithheld
from verifier.strict import StrictChecks

#: most characters of one response a background guard keeps for its check
MAX_CHECK_CHARS = 4 * 1024 * 1024
#: where a background guard keeps the text of the streams past :data:`MAX_TEXT_STREAMS`
OVERFLOW_STREAM = "-:overflow"
#: the suffix of a strict stream's decoded twin: the string values of a text stream that is JSON
#: (``"0:tool:0:arguments#json"``; a document escaped once more inside it: ``...#json#json``)
JSON_SUFFIX = "#json"
#: how many times over a strict stream's JSON is decoded (as :data:`verifier.findings.UNESCAPE_LEVELS`)
JSON_LEVELS = 3


def json_stream(key: str) -> bool:
    """Whether text stream ``key`` is JSON from its start: a tool call's or a legacy
    ``function_call``'s ``arguments`` (chat ``"0:tool:3:arguments"``, Responses
    ``"1:0:arguments"``, and its ``:snapshot``)."""
    return key.endswith(":arguments") or key.endswith(":arguments:snapshot")


class EchoStrip:
    """:func:`strip_echo` for a text that arrives in pieces: while the text so far is a prefix of
    one of the prompts it is swallowed (kept for :meth:`flush`); once it is a whole prompt (or
    diverges from every one) the rest passes. Each piece costs its own length, not the prompt's."""

    def __init__(self, prompts: Sequence[str]) -> None:
        self._cands = [(p.rstrip("\ufffd"), len(p) > len(p.rstrip("\ufffd"))) for p in prompts if p.rstrip("\ufffd")]
        self._buf: list[str] = []
        self._n = 0
        self._extra = 0  # characters of a cut character still to swallow after a whole prompt
        self.done = not self._cands

    def push(self, piece: str) -> str:
        """Text of ``piece`` that is not echo (maybe ``""``)."""
        if self.done:
            return piece
        if self._extra:
            self.done = True
            return piece[1:]
        live = []
        for core, cut in self._cands:
            seg = core[self._n : self._n + len(piece)]
            if piece.startswith(seg) and (len(seg) == len(piece) or self._n + len(seg) == len(core)):
                live.append((core, cut))
        if not live:  # not an echo: everything held passes
            self.done = True
            held, self._buf = "".join(self._buf), []
            return held + piece
        self._cands = live
        self._n += len(piece)
        finished = [(c, cut) for c, cut in live if self._n >= len(c)]
        if finished:
            core, cut = max(finished, key=lambda x: len(x[0]))
            rest = piece[len(piece) - (self._n - len(core)) :] if self._n > len(core) else ""
            self._buf = []
            if cut and not rest:
                self._extra = 1
                return ""
            self.done = True
            return rest[1:] if cut else rest
        self._buf.append(piece)
        return ""

    @property
    def held_chars(self) -> int:
        """Characters swallowed that may still turn out not to be an echo (not yet checked)."""
        return sum(len(b) for b in self._buf)

    def flush(self) -> str:
        """What is still swallowed at the end (a partial echo: the tenant's own text anyway)."""
        held, self._buf = "".join(self._buf), []
        self.done = True
        return held


class TextStream:
    """One text stream of a strict guard (a choice's field): echo strip, canary scan, shingler,
    and how far it has been checked. Pieces are numbered in arrival order (``pieces``); once
    every character of a piece has been encoded by the shingler (text still buffered for a safe
    cut, or swallowed as a possible echo, is not checked yet), :meth:`after` counts the tokens
    checked behind it, in the shingler's exact count of the text as a whole: an engine that
    streams one character per event cannot shrink the hold-back window (each character alone
    encodes as a token, while a 50-token run is some 200 characters)."""

    __slots__ = ("_at", "_bounds", "_chars", "echo", "json", "pieces", "scanner", "shingler")

    def __init__(self, hasher: ShingleHasher, exchange: Exchange, *, json: bool = False, echo: bool = True) -> None:
        self.echo = EchoStrip(exchange.echo_prompts) if exchange.echo and echo else None
        #: the decoder of this stream's text when it is JSON (its values are checked as a twin stream)
        self.json: JsonStrings | None = JsonStrings() if json else None
        self.scanner = CanaryScanner()
        self.shingler = IncrementalShingler(hasher, max_pending_chars=256, folded=True)
        self.pieces = 0
        self._chars = 0
        self._bounds: collections.deque[tuple[int, int]] = collections.deque()  # (chars, piece) at piece ends
        self._at: dict[int, int] = {}  # piece -> the shingler's token count once the piece was checked

    def _advance(self) -> None:
        pending = self.shingler.pending_chars + (self.echo.held_chars if self.echo is not None else 0)
        done = self._chars - pending
        while self._bounds and self._bounds[0][0] <= done:
            self._at[self._bounds.popleft()[1]] = self.shingler.tokens_seen

    def after(self, piece: int) -> int:
        """Tokens checked after ``piece`` (at least; ``-1`` while the piece itself is not checked)."""
        at = self._at.get(piece)
        return -1 if at is None else self.shingler.tokens_seen - at

    def forget(self, piece: int) -> None:
        """``piece`` has been released."""
        self._at.pop(piece, None)

    def push(self, piece: str) -> tuple[list[str], list[int]]:
        """Add ``piece`` (numbered ``pieces - 1`` afterwards): canaries it completes and ids
        whose shingles are new."""
        self._chars += len(piece)
        self._bounds.append((self._chars, self.pieces))
        self.pieces += 1
        cans: list[str] = []
        ids: list[int] = []
        text = self.echo.push(piece) if self.echo is not None else piece
        if text:
            cans, ids = self.scanner.push(text), self.shingler.push(text)
        self._advance()
        return cans, ids

    def flush(self) -> tuple[list[str], list[list[int]]]:
        """End of the text: canaries and id runs (each with its own ``k - 1`` carry) still due."""
        cans: list[str] = []
        runs: list[list[int]] = []
        if self.echo is not None:
            held = self.echo.flush()
            if held:
                cans = self.scanner.push(held)
                runs.append(self.shingler.push(held))
        runs.append(self.shingler.flush())
        self._bounds.clear()
        return cans, runs


def _pieces(delta_text: str, pieces: Sequence[tuple[str, str]] | None) -> list[tuple[str, str]]:
    if pieces is None:
        return [("0", delta_text)] if delta_text else []
    return [(k, t) for k, t in pieces if t]


class BackgroundGuard:
    """Sampled, non-strict: passes everything at once; the check runs in the background. Its
    coroutines never suspend (no thread hop per event): they only append to a list or queue."""

    def __init__(self, jobs: JobQueue, exchange: Exchange) -> None:
        self.jobs = jobs
        self.exchange = exchange
        self._parts: dict[str, list[str]] = {}
        self._chars = 0

    async def feed(
        self, delta_text: str, raw_event: bytes, pieces: Sequence[tuple[str, str]] | None = None
    ) -> list[bytes]:
        parts = self._parts
        for key, text in _pieces(delta_text, pieces):
            if self._chars < MAX_CHECK_CHARS:
                if key not in parts and len(parts) >= MAX_TEXT_STREAMS:
                    key = OVERFLOW_STREAM  # the streams past the cap, checked as one text
                parts.setdefault(key, []).append(text)
                self._chars += len(text)
        return [raw_event]

    async def finish_stream(
        self, *, usage: dict[str, Any] | None, finish_reason: str | None, ttft_seconds: float | None
    ) -> list[bytes]:
        texts = ["".join(p) for p in self._parts.values()]
        self.jobs.enqueue(CheckJob(self.exchange, texts, usage, finish_reason, ttft_seconds))
        return []

    async def check_body(
        self,
        text: str | Sequence[str],
        *,
        usage: dict[str, Any] | None,
        finish_reason: str | None,
        ttft_seconds: float | None,
    ) -> None:
        texts, room = [], MAX_CHECK_CHARS
        for t in [text] if isinstance(text, str) else text:
            if room > 0 and t:
                texts.append(t[:room])
                room -= len(texts[-1])
        if len(texts) > MAX_TEXT_STREAMS:  # the rest as one text
            texts[MAX_TEXT_STREAMS:] = ["\n".join(texts[MAX_TEXT_STREAMS:])]
        self.jobs.enqueue(CheckJob(self.exchange, texts, usage, finish_reason, ttft_seconds))


class StrictGuard:
    """Strict tenant: nothing detected leaves, and nothing unchecked. Streams are held back by
    ``strict_holdback_tokens`` tokens and checked as shingles and canaries complete, each text
    stream (choice and field) on its own. A first token faster than the latency bound holds the
    whole rest of the stream until its end, where the usage's cached-token count decides. More
    than ``strict_max_text_bytes`` of text, more than :data:`MAX_TEXT_STREAMS` text streams, or
    more than ``strict_max_held_bytes`` of events held back cuts the stream (withheld, ``oversize``).

    Each call's blocking part runs in the strict thread pool
    (:meth:`StrictChecks.run`) and the call returns only when it is done; calls are
    awaited one at a time, so the guard's state is touched by one thread at a time. An event
    without text needs no check and is handled on the loop."""

    def __init__(self, checks: StrictChecks, exchange: Exchange) -> None:
        self.checks = checks
        self.exchange = exchange
        self.holdback = checks.cfg.strict_holdback_tokens
        #: held events: raw bytes and, per text stream it added to, the number of its piece there
        self._held: collections.deque[tuple[bytes, dict[str, int]]] = collections.deque()
        self._held_bytes = 0
        self.seen: set[int] = set()
        self.verdict = LeakVerdict()
        self._streams: dict[str, TextStream] = {}
        #: decoded twins of JSON streams (:data:`JSON_SUFFIX`), apart from the streams counted
        #: against :data:`MAX_TEXT_STREAMS` (each is bounded by its stream's text)
        self._twins: dict[str, TextStream] = {}
        self._cut: ResponseWithheld | None = None
        self._first_text_seen = False
        self._suspect: Incident | None = None
        self._text_bytes = 0

    def _withhold(self, found: list[Incident]) -> None:
        if self._suspect is not None and all(i.detector != "latency" for i in found):
            found = [*found, self._suspect]  # the first token was too fast as well: say so
        self._suspect = None
        self._held.clear()
        self._held_bytes = 0
        self._cut = self.checks.withhold(self.exchange, found)
        raise self._cut

    async def _checked(self, fn, /, *args):
        """:meth:`StrictChecks.run` of a check; a check that raises anything but a
        withholding or :data:`~verifier.jobs.FATAL` (a tokenizer panic) could not check the
        text, so the response is withheld (a ``check_fault`` incident): never released unchecked."""
        try:
            return await self.checks.run(fn, *args)
        except (ResponseWithheld, *FATAL):
            raise
        except BaseException as e:
            self._held.clear()
            self._held_bytes = 0
            self._cut = self.checks.fault(self.exchange, e)
            raise self._cut from None

    def _release(self) -> list[bytes]:
        """The held events, in order, each once every text stream it added to has at least
        ``holdback`` *checked* tokens of that stream behind it (per stream: two interleaved
        choices do not count each other's tokens; text the shingler still buffers, such as a
        run of CJK without a safe cut, is not checked yet); none while the stream is suspect."""
        out: list[bytes] = []
        if self._suspect is not None:
            return out
        streams, twins = self._streams, self._twins
        while self._held:
            raw, ends = self._held[0]
            if any((streams.get(k) or twins[k]).after(piece) < self.holdback for k, piece in ends.items()):
                break
            self._held.popleft()
            self._held_bytes -= len(raw)
            for k, piece in ends.items():
                (streams.get(k) or twins[k]).forget(piece)
            out.append(raw)
        return out

    async def feed(
        self, delta_text: str, raw_event: bytes, pieces: Sequence[tuple[str, str]] | None = None
    ) -> list[bytes]:
        if self._cut is not None:
            raise self._cut
        ps = _pieces(delta_text, pieces)
        if not ps:  # no tokens, nothing to check: no thread hop (but to withhold)
            if not self._hold(raw_event, {}):
                await self._checked(self._withhold_held)
            return self._release()
        # the first text's arrival time is taken here, not after the hop
        return await self._checked(self._feed_text, ps, raw_event, time.monotonic())

    def _stream(self, key: str) -> TextStream:
        """The text stream ``key``; a new one past :data:`MAX_TEXT_STREAMS` withholds (``oversize``)."""
        st = self._streams.get(key)
        if st is None:
            if len(self._streams) >= MAX_TEXT_STREAMS:
                self._withhold([self.checks.oversize(self.exchange, self._text_bytes, len(self._streams) + 1)])
            st = self._streams[key] = TextStream(self.checks.hasher, self.exchange, json=json_stream(key))
        return st

    def _push(self, key: str, st: TextStream, text: str, ends: dict[str, int], cans: list[str], ids: list) -> None:
        """Push ``text`` to stream ``key`` and, when it is JSON, its decoded string values to its
        twin (created with its first decoded text; a twin is JSON too, up to :data:`JSON_LEVELS`):
        an event is released only once each of them has the hold-back window behind it."""
        c, new = st.push(text)
        ends[key] = st.pieces - 1
        cans += c
        ids.append(new)
        if st.json is None:
            return
        decoded = st.json.push(text)
        tkey = key + JSON_SUFFIX
        twin = self._twins.get(tkey)
        if twin is None:
            if not decoded:
                return
            deeper = tkey.count(JSON_SUFFIX) < JSON_LEVELS
            twin = self._twins[tkey] = TextStream(self.checks.hasher, self.exchange, json=deeper, echo=False)
        self._push(tkey, twin, decoded, ends, cans, ids)

    def _feed_text(self, pieces: list[tuple[str, str]], raw_event: bytes, now: float) -> list[bytes]:
        """:meth:`feed`'s blocking part (strict pool thread): count, pre-check, check, release."""
        self._text_bytes += sum(len(t.encode("utf-8", "replace")) for _, t in pieces)
        if self._text_bytes > self.checks.cfg.strict_max_text_bytes:
            self._withhold([self.checks.oversize(self.exchange, self._text_bytes, len(self._streams))])
        if not self._first_text_seen:
            self._first_text_seen = True
            req = self.exchange.request
            t0 = req.started_monotonic if req.forwarded_monotonic is None else req.forwarded_monotonic
            self._suspect = self.checks.latency_precheck(self.exchange, now - t0)
        ends: dict[str, int] = {}
        cans: list[str] = []
        ids_list: list[list[int]] = []
        for key, text in pieces:
            self._push(key, self._stream(key), text, ends, cans, ids_list)
        cans = list(dict.fromkeys(cans))  # a canary in a JSON stream completes in its twin too
        held = self._hold(raw_event, ends)
        if cans or any(ids_list):
            found = self.checks.check_piece(self.exchange, self.verdict, self.seen, cans, ids_list)
            if found:
                self._withhold(found)
        if not held:
            self._withhold_held()
        return self._release()

    def _hold(self, raw_event: bytes, ends: dict[str, int]) -> bool:
        """Hold ``raw_event`` back; ``False`` once the held events pass ``strict_max_held_bytes``."""
        self._held.append((raw_event, ends))
        self._held_bytes += len(raw_event)
        return self._held_bytes <= self.checks.cfg.strict_max_held_bytes

    def _withhold_held(self) -> None:
        """Withhold the stream as ``oversize``: it holds back more than ``strict_max_held_bytes``."""
        self._withhold([self.checks.oversize(self.exchange, self._text_bytes, len(self._streams), self._held_bytes)])

    async def finish_stream(
        self, *, usage: dict[str, Any] | None, finish_reason: str | None, ttft_seconds: float | None
    ) -> list[bytes]:
        if self._cut is not None:
            raise self._cut
        return await self._checked(self._finish_stream, usage, finish_reason, ttft_seconds)

    def _finish_stream(
        self, usage: dict[str, Any] | None, finish_reason: str | None, ttft_seconds: float | None
    ) -> list[bytes]:
        """:meth:`finish_stream`'s blocking part (strict pool thread)."""
        checks = self.checks
        cans: list[str] = []
        ids_list: list[list[int]] = []
        for st in [*self._streams.values(), *self._twins.values()]:
            c, runs = st.flush()
            cans += c
            ids_list += runs
        found = checks.check_piece(self.exchange, self.verdict, self.seen, list(dict.fromkeys(cans)), ids_list)
        checks.checked(self.exchange)
        if found:
            self._withhold(found)
        withhold = checks.tail(self.exchange, usage, finish_reason, ttft_seconds)
        if withhold:
            self._withhold(withhold)
        out = [raw for raw, _ in self._held]
        self._held.clear()
        self._held_bytes = 0
        return out

    async def check_body(
        self,
        text: str | Sequence[str],
        *,
        usage: dict[str, Any] | None,
        finish_reason: str | None,
        ttft_seconds: float | None,
    ) -> None:
        texts = [text] if isinstance(text, str) else [t for t in text if t]
        found = await self._checked(
            self.checks.check_body, CheckJob(self.exchange, texts, usage, finish_reason, ttft_seconds)
        )
        if found:
            self.checks.stats["withheld"] += 1
            raise ResponseWithheld(found[0].id, found[0].detector)
