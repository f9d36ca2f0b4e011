"""The fingerprints of prompts a tenant sent recently, so that the same prompt sent again (a
client's retry after a 429 or a 5xx, the same evaluation prompt, a fixed batch prompt) costs its
digest instead of its tokenization and hashing at admission (:meth:`verifier.jobs.IngestBudget.fingerprint`).

Each entry is keyed by a 128-bit BLAKE2b digest of the tenant id and the prompt text: the text
itself is never kept (what is kept are the keyed fingerprints the leak index stores anyway, the
prompt's canary markers, and its selection hashes, which only compare within the process), and
one tenant's entry is never another's, so a cache hit tells a tenant nothing about what other
tenants sent. Bounded by :data:`CACHE_BYTES` per process (each gateway worker has its own; the
least recently used entries dropped first); prompts above :data:`MAX_TEXT_CHARS` characters are
not remembered. Thread-safe.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass, field

import numpy as np

#: the most bytes the remembered entries may hold together, per process (estimated: :attr:`Fingerprinted.nbytes`)
CACHE_BYTES = 32 << 20
#: prompts of more characters than this are fingerprinted every time (as the count cache does)
MAX_TEXT_CHARS = 16_384


#: bytes an own-shingle set holds per shingle, on the high side (a 64-bit int object and its slot)
OWN_SET_BYTES_PER_SHINGLE = 72


@dataclass(frozen=True)
class Fingerprinted:
    """One prompt's fingerprinting: ``fps`` (winnowed keyed fingerprints), ``canaries`` (the
    canary markers in it), ``fast`` (the selection hash of every shingle, read-only), from which
    :meth:`own_shingles` builds the own-shingle set of a sampled exchange once."""

    fps: frozenset[int]
    canaries: tuple[str, ...]
    fast: np.ndarray
    _own: list[frozenset[int]] = field(default_factory=list, compare=False, repr=False)

    def own_shingles(self) -> frozenset[int]:
        """The set of :attr:`fast`, built on the first call and shared by every later one (a
        sampled exchange only reads it): a sampled hit costs no set of its own."""
        if not self._own:
            self._own.append(frozenset(self.fast.tolist()))  # two threads at once: both equal, the first kept
        return self._own[0]

    @property
    def nbytes(self) -> int:
        """An estimate of the entry's memory with its key, in bytes, on the high side: the array's
        data and its own-shingle set (:data:`OWN_SET_BYTES_PER_SHINGLE` a shingle, counted
        whether or not it was built), about 100 bytes per fingerprint (a 64-bit int object and
        its set slot), about 100 per canary string, and 600 for the objects, the key and its dict
        slot."""
        shingles = int(self.fast.size)
        own = OWN_SET_BYTES_PER_SHINGLE * shingles
        return int(self.fast.nbytes) + own + 100 * len(self.fps) + sum(len(c) + 100 for c in self.canaries) + 600


class FingerprintCache:
    """Recent prompts' :class:`Fingerprinted` results, per tenant, by digest (module docstring)."""

    def __init__(self, max_bytes: int = CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._entries: dict[bytes, Fingerprinted] = {}
        self._lock = threading.Lock()

    @staticmethod
    def key(tenant: str, text: str) -> bytes | None:
        """The digest ``text`` sent by ``tenant`` is remembered under; ``None`` for a text too
        long to remember."""
        if len(text) > MAX_TEXT_CHARS:
            return None
        h = hashlib.blake2b(digest_size=16)
        h.update(f"{len(tenant)}:{tenant}:".encode("utf-8", "surrogatepass"))
        h.update(text.encode("utf-8", "surrogatepass"))
        return h.digest()

    def get(self, key: bytes | None) -> Fingerprinted | None:
        """The remembered entry (now the most recently used), or ``None``."""
        if key is None:
            return None
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is not None:
                self._entries[key] = entry
        return entry

    def put(self, key: bytes | None, entry: Fingerprinted) -> None:
        """Remember ``entry`` (its ``fast`` made read-only), dropping the least recently used
        entries while the total is above :attr:`max_bytes`; an entry larger than that is not kept."""
        size = entry.nbytes
        if key is None or size > self.max_bytes:
            return
        entry.fast.setflags(write=False)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.nbytes -= old.nbytes
            while self._entries and self.nbytes + size > self.max_bytes:
                self.nbytes -= self._entries.pop(next(iter(self._entries))).nbytes
            self._entries[key] = entry
            self.nbytes += size

    def __len__(self) -> int:
        return len(self._entries)
