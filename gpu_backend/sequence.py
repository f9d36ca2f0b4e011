"""One request inside the engine: its tokens, pages, state, sampling and output stream.

States (docs/design.md invariant 1): WAITING -> PREFILLING -> DECODING -> FINISHED, or ABORTED from any
live state; REJECTED only from WAITING at admission, before any page. FINISHED, ABORTED and REJECTED
are terminal: leaving them raises ``RuntimeError``.
"""

from __future__ import annotations

import codecs
import collections
import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gpu_backend.errors import InvalidRequestError
from gpu_backend.kv_pool import KVPool, PageHandle
from gpu_backend.replies import Exported, Failed, PagesGranted, ReplyTo
from gpu_backend.sampling import SamplingParams
from gpu_backend.wire import PrefillOutcome


class SeqState(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"
    ABORTED = "aborted"
    REJECTED = "rejected"


TERMINAL = frozenset({SeqState.FINISHED, SeqState.ABORTED, SeqState.REJECTED})
_ALLOWED = {
    SeqState.WAITING: {SeqState.PREFILLING, SeqState.DECODING, SeqState.REJECTED, SeqState.ABORTED},
    SeqState.PREFILLING: {SeqState.DECODING, SeqState.FINISHED, SeqState.ABORTED},
    SeqState.DECODING: {SeqState.FINISHED, SeqState.ABORTED},
}


class Sequence:
    """A request's engine-side record.

    ``prompt_ids``: the prompt as admitted; ``num_context_tokens``: positions the prompt occupies in
    the cache (normally ``len(prompt_ids)``; for a decode reservation, the ``context_tokens`` given);
    ``completion_ids``: generated tokens; ``num_cached``: positions whose KV is in the pages;
    ``pages``: page handles (its page table); ``emit``: the :data:`~gpu_backend.replies.ReplyTo`
    the worker hands each reply to (a ``Token`` per output token, ``Exported`` for an export,
    ``Failed`` for the error that ended it).

    A prefill node's export is its own kind, :class:`ExportSequence`; a decode reservation is its
    own record, :class:`PageReservation`, which :meth:`decoding_from` turns into a sequence.
    """

    def __init__(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        emit: ReplyTo,
        *,
        reported_prompt_tokens: int | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.emit = emit
        self.state = SeqState.WAITING
        self.num_context_tokens = len(self.prompt_ids)
        self.reported_prompt_tokens = len(self.prompt_ids) if reported_prompt_tokens is None else reported_prompt_tokens
        self.completion_ids: list[int] = []
        self.num_cached = 0
        self.pages: list[PageHandle] = []
        self.pages_needed = 0
        self.finish_reason: str | None = None
        self.error: BaseException | None = None
        self.sample_seed: int | None = None  # the seed of its draws (sampling.sample_seed)
        self.arrival = time.monotonic()
        self.first_token_time: float | None = None
        self.abort_requested = False
        self.stop_token_ids: set[int] = set(params.stop_token_ids)
        # incremental detokenization
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending_text = ""

    @classmethod
    def decoding_from(
        cls,
        res: PageReservation,
        prompt_ids: list[int],
        params: SamplingParams,
        context_tokens: int,
        sample_seed: int | None,
        emit: ReplyTo,
    ) -> Sequence:
        """The WAITING request that decodes over the first ``context_tokens`` positions of loaded
        reservation ``res``, taking over its pages (worker thread). ``prompt_tokens`` of its tokens
        is ``len(prompt_ids)``."""
        seq = cls(res.request_id, prompt_ids, params, emit)
        seq.pages, seq.pages_needed, seq.arrival = res.pages, res.pages_needed, res.arrival
        seq.sample_seed = sample_seed
        seq.num_context_tokens = seq.num_cached = context_tokens
        return seq

    # ---- state ------------------------------------------------------------------------------
    def set_state(self, new: SeqState) -> None:
        """Move to ``new``; ``RuntimeError`` for a transition the state machine forbids."""
        if new not in _ALLOWED.get(self.state, ()):  # terminal states allow nothing
            raise RuntimeError(f"request {self.request_id}: illegal transition {self.state.value} -> {new.value}")
        self.state = new

    @property
    def is_terminal(self) -> bool:
        return self.state in TERMINAL

    # ---- positions --------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        """Positions the sequence spans: context + generated."""
        return self.num_context_tokens + len(self.completion_ids)

    @property
    def last_token(self) -> int:
        return self.completion_ids[-1] if self.completion_ids else self.prompt_ids[-1]

    @property
    def page_indices(self) -> list[int]:
        return [h.index for h in self.pages]

    # ---- output -----------------------------------------------------------------------------
    def append_token(self, token_id: int, token_bytes: bytes, eos_ids: frozenset[int]) -> tuple[str, str | None]:
        """Record a sampled token; returns (text to emit now, finish_reason or None).

        EOS / stop ids finish with ``stop`` and add no text; a stop string finishes with ``stop`` and
        is cut out (text after it too); reaching ``max_new_tokens`` finishes with ``length``. While a
        stop string may be forming, the matching tail of the text is held back.
        """
        self.completion_ids.append(token_id)
        p = self.params
        if token_id in self.stop_token_ids or (not p.ignore_eos and token_id in eos_ids):
            return self._flush(), "stop"
        self._pending_text += self._utf8.decode(token_bytes)
        if p.stop:
            hits = [(self._pending_text.find(s), s) for s in p.stop]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                i = min(hits)[0]
                out, self._pending_text = self._pending_text[:i], ""
                return out, "stop"
        if len(self.completion_ids) >= p.max_new_tokens:
            return self._flush(), "length"
        keep = self._stop_prefix_len() if p.stop else 0
        out = self._pending_text[: len(self._pending_text) - keep]
        self._pending_text = self._pending_text[len(out) :]
        return out, None

    def _stop_prefix_len(self) -> int:
        """Length of the longest tail of the pending text that is a proper prefix of a stop string."""
        t = self._pending_text
        best = 0
        for s in self.params.stop:
            for n in range(min(len(s) - 1, len(t)), best, -1):
                if t.endswith(s[:n]):
                    best = n
                    break
        return best

    def _flush(self) -> str:
        out = self._pending_text + self._utf8.decode(b"", final=True)
        self._pending_text = ""
        return out


@dataclass(eq=False)
class PageReservation:
    """A decode reservation, its own record: ``pages_needed`` pages (prompt + max_new_tokens) held
    for a request whose prompt KV comes from prefill. ``emit`` receives ``PagesGranted`` once they
    are allocated, or ``Failed`` with the error that ended the wait; ``loaded_tokens`` counts the
    positions received into them. It leaves no trace in the engine's retired states."""

    request_id: str
    pages_needed: int
    emit: Callable[[PagesGranted | Failed], None]
    pages: list[PageHandle] = field(default_factory=list)
    loaded_tokens: int = 0
    arrival: float = field(default_factory=time.monotonic)


class ExportSequence(Sequence):
    """A prefill node's request, its own kind: prefilled like any sequence, but once its first token
    is sampled the scheduler copies its written pages out (:meth:`export`), frees them and answers
    ``Exported`` instead of decoding. Admitted by ``Engine.admit(..., export=True)``."""

    @property
    def placeholder(self) -> bool:
        """Admitted as the one-token placeholder (the ``admit_rejected`` fault)."""
        return self.reported_prompt_tokens != len(self.prompt_ids)

    def export(self, pool: KVPool) -> Exported:
        """The written pages (``[pages, layers, 2, page_size, kv_heads, head_dim]``, CPU; positions
        past the prompt in the last page are zeros) and the outcome (worker thread, before the
        pages are freed)."""
        n = self.num_context_tokens
        kv = pool.read_pages(self.pages[: pool.pages_for(n)])
        seconds = time.monotonic() - self.arrival
        return Exported(
            kv, PrefillOutcome(n, self.completion_ids[0], seconds, self.placeholder, self.reported_prompt_tokens)
        )


def check_prompt_ids(
    prompt_ids: list[int], vocab_size: int, is_valid_id: Callable[[int], bool], request_id: str
) -> None:
    """:class:`InvalidRequestError` (400, ``param`` ``prompt``) for an empty prompt or an id that is
    not an int in ``0 .. vocab_size - 1`` the tokenizer can decode."""
    if not prompt_ids:
        raise InvalidRequestError("the prompt is empty", request_id=request_id, param="prompt")
    for t in prompt_ids:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size or not is_valid_id(t):
            msg = f"token id {t!r} is not in the model's vocabulary"
            raise InvalidRequestError(msg, request_id=request_id, param="prompt")


class RequestTable:
    """An engine's requests by id: ``live`` (added on the event loop, removed by whoever retires the
    record; dict operations are atomic under the GIL) and the states of the last ``memory`` retired
    sequences. A reservation that never decoded leaves no trace when it retires."""

    def __init__(self, memory: int = 8192) -> None:
        self.live: dict[str, Sequence | PageReservation] = {}
        self.memory = memory
        self._retired: collections.OrderedDict[str, str] = collections.OrderedDict()

    def add(self, seq: Sequence | PageReservation) -> None:
        """Make ``seq``'s id live; :class:`InvalidRequestError` (400) when it already is."""
        if seq.request_id in self.live:
            raise InvalidRequestError(f"request id '{seq.request_id}' is already in flight", request_id=seq.request_id)
        self.live[seq.request_id] = seq

    def replace(self, res: PageReservation, seq: Sequence) -> None:
        """Reservation ``res`` became decoding request ``seq`` (same id; worker thread)."""
        if self.live.get(res.request_id) is res:
            self.live[res.request_id] = seq

    def retire(self, seq: Sequence | PageReservation) -> None:
        """``seq`` reached a terminal state: drop it from ``live``, remember a sequence's state."""
        if self.live.get(seq.request_id) is seq:
            self.live.pop(seq.request_id, None)
        if isinstance(seq, PageReservation):
            return
        self._retired[seq.request_id] = seq.state.value
        while len(self._retired) > self.memory:
            self._retired.popitem(last=False)

    def state(self, request_id: str) -> str | None:
        """``"waiting"``, ``"reserved"``, ``"prefilling"``, ``"decoding"``, ``"finished"``,
        ``"rejected"`` or ``"aborted"`` of a live or recently retired request; ``None`` if unknown."""
        seq = self.live.get(request_id)
        if isinstance(seq, PageReservation):
            return "reserved" if seq.pages else "waiting"
        if seq is not None:
            return seq.state.value
        return self._retired.get(request_id)
