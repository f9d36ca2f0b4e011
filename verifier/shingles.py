"""Keyed token shingles and winnowing (Schleimer, Wilkerson, Aiken: "Winnowing: local algorithms
for document fingerprinting", SIGMOD 2003).

Text is tokenized with the bundled cl100k encoding (the verifier's own, whatever the model's:
both sides of a comparison only need the same tokenizer), once :func:`fold`-ed (NFKC, no
invisible characters, line breaks and runs of spaces one space) alike on both sides. A
*shingle* is ``k`` consecutive token ids; its fingerprint is a 64-bit keyed BLAKE2b hash (the
key is the ``leak_index_key`` secret, so stored fingerprints cannot be tested against guessed
text without it). Winnowing keeps, from every window of ``w`` consecutive shingles, the one with
the smallest *selection hash* (rightmost on ties), which guarantees: any run of at least
``w + k - 1`` tokens shared by two texts contains a shingle kept by the winnowing of either
text (k = 16, w = 35 -> 50 tokens).

Speed: the selection hash is a keyed polynomial hash of the shingle computed for all shingles at
once with numpy (plus a 64-bit finaliser); only the selected shingles (about 2 / (w + 1) of them)
get the BLAKE2b fingerprint that is stored. It is also what a response's shingles are compared
with its own prompt's by (in memory only). It is never stored.

Nothing here keeps text; callers get integers.
"""

from __future__ import annotations

import functools
import hashlib
import re
import unicodedata
from collections.abc import Iterable, Sequence

import numpy as np

from tokenizer.tiktoken_counter import TiktokenCounter, bundled_counter

#: token ids: a list, or a 1-d integer array (converted to one array once by a caller that hashes twice)
Ids = Sequence[int] | np.ndarray

_COUNTER: TiktokenCounter | None = None


def _counter() -> TiktokenCounter:
    global _COUNTER
    if _COUNTER is None:
        _COUNTER = bundled_counter()
    return _COUNTER


#: a run of one repeated character (or of whitespace) longer than this is shortened to this
#: many before encoding
MAX_RUN_CHARS = 64
#: whether a code point is whitespace (``str.isspace``, the pre-tokenizer's ``\s``; none is
#: above U+3000; the last entry, U+3001, stands for every code point above it)
_IS_WHITESPACE = np.array([chr(c).isspace() for c in range(0x3002)], dtype=bool)
#: a whitespace run longer than MAX_RUN_CHARS (``re``'s ``\s`` is ``str.isspace``, code point for code point)
_WS_RUN = re.compile(rf"\s{{{MAX_RUN_CHARS + 1}}}")
#: texts of at most this many characters are first searched with :data:`_WS_RUN` (a regex
#: holds the GIL: tens of microseconds here, milliseconds on a megabyte)
_QUICK_CHARS = 16_384
#: the grid :func:`squeeze_runs` samples first: a run of ``MAX_RUN_CHARS + 1`` characters covers
#: at least ``_GRID_POINTS`` consecutive points of every ``_GRID``-th character
_GRID = 13
_GRID_POINTS = (MAX_RUN_CHARS + 1) // _GRID
#: on the grid: one non-whitespace character, or whitespace, at ``_GRID_POINTS`` points in a row
_GRID_RUN = re.compile(rf"(\S)\1{{{_GRID_POINTS - 1}}}|\s{{{_GRID_POINTS}}}")


def squeeze_runs(text: str) -> str:
    """``text`` with every run of one repeated character, and every run of whitespace, longer
    than :data:`MAX_RUN_CHARS` shortened to that many (numpy finds the runs; cost is linear
    and mostly outside the GIL). BPE on one huge pre-token (900,000 spaces is a single cl100k
    pre-token) takes seconds and holds the GIL in stretches of hundreds of milliseconds,
    stalling every other thread of the gateway; a squeezed run encodes in microseconds. Mixed
    whitespace counts as one run: 1,000,000 alternating spaces and tabs before a letter
    overflow tiktoken's regex stack (a ``pyo3_runtime.PanicException``). Both sides of a
    comparison are squeezed alike, and runs that long carry no text worth a shingle. Most texts
    have no such run, and say so on a sample of every ``_GRID``-th character: a run of one
    non-whitespace character shows there as one character ``_GRID_POINTS`` times in a row, a
    whitespace run (``re``'s ``\\s`` is ``str.isspace``) as that many whitespace characters."""
    if len(text) <= MAX_RUN_CHARS or not _GRID_RUN.search(text[::_GRID]):
        return text  # no run that long: its grid points would show it (about 2 us per KiB)
    if text.isascii():  # one byte a character: a quarter of the copying
        a = np.frombuffer(text.encode("ascii"), dtype=np.uint8)
    else:
        a = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    change = np.flatnonzero(a[1:] != a[:-1]) + 1
    starts = np.concatenate(([0], change))
    ends = np.concatenate((change, [len(a)]))
    if len(a) <= _QUICK_CHARS and int((ends - starts).max()) <= MAX_RUN_CHARS and not _WS_RUN.search(text):
        return text  # a short text without a long run (the common prompt): no whitespace table
    # a table lookup (a few ms per MB); code points past the table are no whitespace
    ws = _IS_WHITESPACE[a if a.dtype == np.uint8 else np.minimum(a, np.uint32(len(_IS_WHITESPACE) - 1))]
    same = np.flatnonzero((ends - starts > MAX_RUN_CHARS) & ~ws[starts])  # whitespace: below
    zero = np.zeros(1, dtype=np.int8)
    edges = np.diff(ws.view(np.int8), prepend=zero, append=zero)
    ws_starts, ws_ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    ws_long = np.flatnonzero(ws_ends - ws_starts > MAX_RUN_CHARS)
    if not len(same) and not len(ws_long):
        return text
    runs = sorted(
        [(int(starts[i]), int(ends[i])) for i in same.tolist()]
        + [(int(ws_starts[i]), int(ws_ends[i])) for i in ws_long.tolist()]
    )
    out, prev = [], 0
    for st, en in runs:  # disjoint: a run of one whitespace character lies inside a whitespace run
        out.append(text[prev : st + MAX_RUN_CHARS])
        prev = en
    out.append(text[prev:])
    return "".join(out)


#: invisible format characters :func:`fold` drops: soft hyphen, zero-width space, non-joiner and
#: joiner, word joiner, byte-order mark (text pasted from the web carries them; a model copying
#: the text need not)
INVISIBLE_CHARS = "\u00ad\u200b\u200c\u200d\u2060\ufeff"
_INVISIBLE = re.compile(f"[{INVISIBLE_CHARS}]")
#: a run of spaces (:func:`fold` makes it one, once line breaks are spaces)
_SPACES = re.compile(" {2,}")


def fold_chars(text: str) -> str:
    """:func:`fold`'s character step: ``text`` without :data:`_INVISIBLE` characters, in Unicode
    NFKC (ASCII text as it is). The canary scan reads text so (:func:`verifier.canary.find_canaries`)."""
    if text.isascii():
        return text
    return unicodedata.normalize("NFKC", _INVISIBLE.sub("", text))


def fold(text: str) -> str:
    """``text`` as it is shingled: without :data:`_INVISIBLE` characters, in Unicode NFKC (an
    NFD prompt comes back NFC from an engine whose tokenizer normalizes, e.g. Qwen2's ``NFC``
    normalizer in its ``tokenizer.json``; full-width punctuation comes back ASCII from NFKC
    ones; :func:`fold_chars`), and with every line break and every run of spaces and line
    breaks one space (a model copying a text re-wraps its lines and drops double spaces). Both
    sides of a comparison are folded alike. Tabs and other whitespace are kept (runs of them are
    :func:`squeeze_runs`'s). ASCII text is only searched for line breaks and double spaces."""
    text = fold_chars(text)
    if "\n" in text or "\r" in text:  # str.replace: a regex match per line costs more than encoding
        text = text.replace("\r", " ").replace("\n", " ")
    return _SPACES.sub(" ", text) if "  " in text else text


def encode(text: str, *, squeezed: bool = False) -> list[int]:
    """Token ids of ``text`` (cl100k_base, ordinary text: special-token look-alikes are text),
    after :func:`squeeze_runs` (``squeezed``: the caller already did). Shingles are of
    ``encode(fold(text))``."""
    return _counter().encode_text(text if squeezed else squeeze_runs(text))


def guaranteed_run_tokens(k: int, w: int) -> int:
    """The shortest shared run (tokens) that winnowing with ``k``/``w`` is sure to find: ``w + k - 1``."""
    return w + k - 1


_M1 = np.uint64(0xFF51AFD7ED558CCD)
_M2 = np.uint64(0xC4CEB9FE1A85EC53)
_S33 = np.uint64(33)
_MASK64 = (1 << 64) - 1
#: at most this many shingles are hashed in Python ints, not numpy: a short answer's one or two
#: shingles cost about 3 us each that way, the array path's ten-odd operations about 15 us
FEW_SHINGLES = 4
#: at most this many shingles are hashed with one matrix product (the windows of ``k`` ids times
#: the powers of the polynomial; numpy's integer matmul wraps mod 2**64): about half the cost of
#: the doubling's 2 log2 k array operations on a prompt of a few hundred tokens, twice it on 200,000
MATMUL_SHINGLES = 1024


def _windows(a: np.ndarray, w: int) -> np.ndarray:
    """The ``len(a) - w + 1`` windows of ``w`` consecutive items of the contiguous 1-d ``a``, as a
    read-only view (``as_strided`` without its checks, which cost more than the arithmetic here)."""
    v = np.ndarray((len(a) - w + 1, w), a.dtype, a, 0, (a.itemsize, a.itemsize))
    v.flags.writeable = False
    return v


class ShingleHasher:
    """Keyed 64-bit fingerprints of ``k``-token shingles.

    ``key``: the leak-index secret (bytes; keys longer than 64 bytes are first hashed to 64, as
    BLAKE2b's key parameter allows 64). Raises ``ValueError`` for an empty key or ``k < 1``.
    """

    def __init__(self, key: bytes, k: int = 16) -> None:
        if not key:
            raise ValueError("the leak-index key must not be empty")
        if k < 1:
            raise ValueError("k must be >= 1")
        if len(key) > 64:
            key = hashlib.blake2b(key).digest()
        self.k = k
        self._base = hashlib.blake2b(key=key, digest_size=8, person=b"kvgate-shingle")
        sel = hashlib.blake2b(key=key, digest_size=16, person=b"kvgate-select").digest()
        self._poly = np.uint64(int.from_bytes(sel[:8], "little") | 1)
        self._xor = np.uint64(int.from_bytes(sel[8:], "little"))
        powers = [1]
        for _ in range(k - 1):
            powers.append((powers[-1] * int(self._poly)) & _MASK64)
        #: ``poly ** (k - 1 - j)`` mod 2**64 for j in 0..k-1: a shingle's hash is its ids dotted with these
        self._powers = np.array(powers[::-1], dtype=np.uint64)

    def hash_ids(self, window: Sequence[int]) -> int:
        """The BLAKE2b fingerprint of one shingle (``k`` token ids) as an unsigned 64-bit int."""
        h = self._base.copy()
        h.update(b"".join(int(t).to_bytes(4, "little") for t in window))
        return int.from_bytes(h.digest(), "little")

    def hashes(self, ids: Ids) -> list[int]:
        """BLAKE2b fingerprints of every shingle of ``ids``, in order (``len(ids) - k + 1`` of
        them, or none)."""
        return self.hashes_at(ids, range(len(ids) - self.k + 1))

    def hashes_at(self, ids: Ids, positions: Iterable[int]) -> list[int]:
        """BLAKE2b fingerprints of the shingles starting at ``positions``."""
        k = self.k
        raw = np.asarray(ids, dtype="<u4").tobytes()
        base = self._base
        out = []
        for i in positions:
            h = base.copy()
            h.update(raw[4 * i : 4 * (i + k)])
            out.append(int.from_bytes(h.digest(), "little"))
        return out

    def fast(self, ids: Ids) -> np.ndarray:
        """Selection hashes (uint64) of every shingle: a keyed polynomial hash of the ``k`` ids
        (``sum(ids[i + j] * poly ** (k - 1 - j))`` mod 2**64) with MurmurHash3's 64-bit finaliser.
        In memory only, never stored. Up to :data:`MATMUL_SHINGLES` shingles the polynomial is one
        matrix product (the windows of ids times the powers of ``poly``); above, it is built by
        doubling (the hash of a run of ``2m`` ids is the first half's times ``poly ** m`` plus the
        second half's), so a shingle of ``k`` ids takes about ``2 log2 k`` array operations, not
        ``2 k``: the same values either way."""
        k = self.k
        n = len(ids) - k + 1
        if n <= 0:
            return np.zeros(0, dtype=np.uint64)
        if n <= FEW_SHINGLES:
            return np.array([self._fast_one(ids[i : i + k]) for i in range(n)], dtype=np.uint64)
        a = np.ascontiguousarray(ids, dtype=np.uint64)
        if n <= MATMUL_SHINGLES:
            return self._finish(_windows(a, k) @ self._powers)
        total = len(a)
        res: np.ndarray | None = None  # hashes of runs of res_len ids (total - res_len + 1 of them)
        res_len = 0
        blk, m, pm = a, 1, self._poly  # hashes of runs of m ids; pm = poly ** m
        kk = k
        while True:
            if kk & 1:
                if res is None:
                    res, res_len = blk, m
                else:
                    cnt = total - res_len - m + 1
                    res = res[:cnt] * pm + blk[res_len : res_len + cnt]
                    res_len += m
            kk >>= 1
            if not kk:
                break
            cnt = total - 2 * m + 1
            blk = blk[:cnt] * pm + blk[m : m + cnt]
            m *= 2
            pm = np.uint64((int(pm) * int(pm)) & _MASK64)  # numpy scalars warn on the (wanted) wrap
        assert res is not None and res_len == k
        return self._finish(res.copy() if res is a else res)  # k == 1: ``res`` is ``a`` itself

    def _finish(self, h: np.ndarray) -> np.ndarray:
        """The polynomial hashes ``h`` (a new array, changed in place) keyed and finalised."""
        h ^= self._xor
        h ^= h >> _S33
        h *= _M1
        h ^= h >> _S33
        h *= _M2
        h ^= h >> _S33
        return h

    def _fast_one(self, window: Ids) -> int:
        """:meth:`fast` of one shingle in Python ints (Horner, mod 2**64): the same value."""
        poly, h = int(self._poly), 0
        for t in window:
            h = (h * poly + int(t)) & _MASK64
        h ^= int(self._xor)
        h ^= h >> 33
        h = (h * 0xFF51AFD7ED558CCD) & _MASK64
        h ^= h >> 33
        h = (h * 0xC4CEB9FE1A85EC53) & _MASK64
        return h ^ (h >> 33)

    def select(self, ids: Ids, w: int, fast: np.ndarray | None = None) -> list[int]:
        """Start positions of the shingles winnowing keeps: in every window of ``w`` consecutive
        shingles the one with the smallest selection hash (rightmost on ties); fewer than ``w``
        shingles keep their minimum. ``fast``: :meth:`fast` of ``ids`` when the caller has it.
        Returns the positions in increasing order, each once."""
        h = self.fast(ids) if fast is None else fast
        n = len(h)
        if n == 0:
            return []
        if n <= w:
            return [int(n - 1 - h[::-1].argmin())]
        # reversed once, so each window's first minimum (argmin) is the original's rightmost
        r = np.ascontiguousarray(h[::-1])
        pos = (n - 1) - (np.arange(n - w + 1) + _windows(r, w).argmin(axis=1))
        # window j of r is window n - w - j of h: pos runs from the last window to the first; the
        # rightmost minimum never moves left as a window slides right, so repeats are adjacent
        pos = pos[::-1]
        keep = np.empty(len(pos), dtype=bool)
        keep[0] = True
        np.not_equal(pos[1:], pos[:-1], out=keep[1:])
        return pos[keep].tolist()

    def fingerprints(self, ids: Ids, w: int, fast: np.ndarray | None = None) -> set[int]:
        """BLAKE2b fingerprints of the winnowed shingles of ``ids`` (what is stored for a prompt).
        ``fast``: :meth:`fast` of ``ids`` when the caller has it (it is computed once)."""
        return set(self.hashes_at(ids, self.select(ids, w, fast)))


def winnow(hashes: Sequence[int], w: int) -> set[int]:
    """Values selected by winnowing ``hashes`` with window ``w`` (reference implementation, the
    definition :meth:`ShingleHasher.select` vectorises): the minimum of every
    window of ``w`` consecutive hashes (rightmost minimum on ties). A sequence shorter than ``w``
    contributes its minimum (so short prompts are still indexed). Returns a set of ints."""
    n = len(hashes)
    if n == 0:
        return set()
    if n <= w:
        return {min(hashes)}
    selected: set[int] = set()
    # monotone deque of indices with increasing hash values -> O(n)
    from collections import deque

    dq: deque[int] = deque()
    for i, h in enumerate(hashes):
        while dq and hashes[dq[-1]] >= h:  # >= keeps the rightmost minimum
            dq.pop()
        dq.append(i)
        if dq[0] <= i - w:
            dq.popleft()
        if i >= w - 1:
            selected.add(hashes[dq[0]])
    return selected


def fingerprints(hasher: ShingleHasher, ids: Sequence[int], w: int) -> set[int]:
    """Winnowed fingerprints of a token sequence (what the leak index stores for a prompt)."""
    return hasher.fingerprints(ids, w)


#: characters that canonical composition joins to the starter before them although they are
#: starters themselves (Indic and Sinhala vowel signs and length marks, two Tibetan subjoined
#: letters, ...): NFKC of a text cut before one differs from NFKC of the whole. Every second
#: character of a two-character canonical decomposition with combining class 0 (Unicode 14,
#: ``unicodedata.decomposition``; tests/test_verifier_hostile_round3.py recomputes it)
_COMPOSES_BACK = frozenset(
    (0x09BE, 0x09D7, 0x0B3E, 0x0B56, 0x0B57, 0x0BBE, 0x0BD7, 0x0CC2, 0x0CD5, 0x0CD6, 0x0D3E, 0x0D57, 0x0DCF)
    + (0x0DDF, 0x0FB5, 0x0FB7, 0x102E, 0x1B35, 0x11127, 0x1133E, 0x11357, 0x114B0, 0x114BA, 0x114BD)
    + (0x115AF, 0x11930)
)


@functools.lru_cache(maxsize=4096)
def _folds_apart(a: str, c: str) -> bool:
    """Whether :func:`fold` of a text cut between the letter ``a`` and the non-letter ``c`` is
    the two halves folded apart, still split by cl100k there: ``a`` folds to text ending in a
    letter, ``c`` is kept, composes with nothing before it and folds to text starting with a
    starter that is no letter, digit or line break."""
    fa, fc = unicodedata.normalize("NFKC", a), unicodedata.normalize("NFKC", c)
    c0 = fc[0]
    return (
        fa[-1].isalpha()
        and not _INVISIBLE.match(c)
        and not unicodedata.combining(c)
        and ord(c) not in _COMPOSES_BACK
        and not unicodedata.combining(c0)
        and ord(c0) not in _COMPOSES_BACK
        and not c0.isalpha()
        and not c0.isnumeric()
        and c0 not in "\r\n"
    )


def is_cut_point(text: str, p: int) -> bool:
    """Whether cl100k's pre-tokenizer always splits :func:`fold`-ed ``text`` at index ``p``,
    whatever follows.

    True when ``text[p-1]`` is a letter, ``text[p]`` is neither a letter, a digit nor a line
    break, and ``text[p+1]`` is a letter: the letter run before ends at ``p`` and a new
    pre-token (``[^\\r\\n\\p{L}\\p{N}]?\\p{L}+`` or a contraction) starts at ``p``. BPE never
    merges across pre-tokens, so encoding ``text[:p]`` and ``text[p:]`` separately gives the
    same ids as encoding ``text`` (this is what makes incremental stream shingling exact). A
    non-ASCII pair must also fold apart (:func:`_folds_apart`: NFKC neither composes across
    ``p`` nor turns ``text[p]`` into a letter, e.g. ``™`` into ``TM``).
    """
    if p <= 0 or p + 1 >= len(text):
        return False
    a, c, b = text[p - 1], text[p], text[p + 1]
    return (
        a.isalpha()
        and b.isalpha()
        and not c.isalpha()
        and not c.isnumeric()
        and c not in "\r\n"
        and ((a + c).isascii() or _folds_apart(a, c))
    )


def last_cut_point(text: str, start: int = 0) -> int:
    """The largest ``p > start`` with :func:`is_cut_point`, or ``-1`` when there is none."""
    for p in range(len(text) - 2, start, -1):
        if is_cut_point(text, p):
            return p
    return -1


class IncrementalShingler:
    """Tokenizes a text that arrives in pieces (a stream) exactly as if it were whole.

    Pieces are buffered; :meth:`push` encodes the buffered text up to its last safe cut point
    (:func:`is_cut_point`) and returns the token ids whose shingles are new: the last ``k - 1``
    ids seen before, then the new ids (shingle them with :meth:`ShingleHasher.hashes`, or an
    empty list when nothing was encoded); :meth:`flush` encodes the rest. Keeps only the last
    ``k - 1`` ids and the unencoded tail. ``max_pending_chars`` bounds the tail: past it the
    tail is encoded anyway (at worst a shingle or two around that cut differs from whole-text
    encoding). ``folded``: the ids are those of ``encode(fold(text))`` (what the leak index
    shingles), else of ``encode(text)``; every cut point is safe for both.
    """

    def __init__(self, hasher: ShingleHasher, max_pending_chars: int = 4096, *, folded: bool = False) -> None:
        self.hasher = hasher
        self.max_pending_chars = max_pending_chars
        self.folded = folded
        self._pending = ""
        self._carry: list[int] = []
        self.tokens_seen = 0

    def _emit(self, text: str) -> list[int]:
        ids = encode(fold(text) if self.folded else text)
        self.tokens_seen += len(ids)
        seq = self._carry + ids
        self._carry = seq[-(self.hasher.k - 1) :] if self.hasher.k > 1 else []
        return seq if len(seq) >= self.hasher.k else []

    def push(self, piece: str) -> list[int]:
        """Add ``piece``; returns ids whose shingles are new (maybe none)."""
        self._pending += piece
        p = last_cut_point(self._pending)
        if p < 0:
            if len(self._pending) <= self.max_pending_chars:
                return []
            p = len(self._pending)
        head, self._pending = self._pending[:p], self._pending[p:]
        return self._emit(head)

    @property
    def pending_chars(self) -> int:
        """Characters pushed but not yet encoded (not yet checked)."""
        return len(self._pending)

    def flush(self) -> list[int]:
        """Encode whatever is buffered; returns ids whose shingles are new."""
        if not self._pending:
            return []
        head, self._pending = self._pending, ""
        return self._emit(head)


def longest_common_run(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest contiguous run of ids present in both ``a`` and ``b`` (dynamic
    programming, O(len(a) * len(b)); for tests and evaluation, not the request path)."""
    best = 0
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0] * (len(b) + 1)
        for j, y in enumerate(b, 1):
            if x == y:
                v = prev[j - 1] + 1
                cur[j] = v
                if v > best:
                    best = v
        prev = cur
    return best


def iter_distinct(values: Iterable[int]) -> list[int]:
    """``values`` without repeats, first occurrence order kept."""
    seen: set[int] = set()
    out = []
    for v in values:
        if v not in seen:
            seen.add(v)
            out.append(v)
    return out
