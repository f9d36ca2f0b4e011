"""Canaries (docs/design.md, Contracts): ``KVGATE-CANARY-`` + 16 lowercase hex digits (64 random bits).

A canary is planted in a prompt; found in a response whose own prompt does not hold it, it is
proof that text crossed between requests (the runbook's signal 2). :class:`CanaryRegistry`
remembers which tenant planted which canary (as keyed hashes, with a TTL, in the same stores as
the leak index) so the gateway can recognise a honeypot's canary in any other tenant's response.

Text is searched for canaries as the leak index reads it (:func:`verifier.shingles.fold_chars`:
without zero-width characters, soft hyphens and byte-order marks, in NFKC), prompts and responses
alike: a canary with a zero-width space between its letters, or in full-width or mathematical
digits, is the same canary to a reader and to a copy-paste, and was not found before. Case,
homoglyphs and other obfuscation are not folded (as the leak index's).
"""

from __future__ import annotations

import hashlib
import re
import secrets
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass, field

from verifier.leak_index import LeakStore
from verifier.shingles import INVISIBLE_CHARS, fold_chars

CANARY_PREFIX = "KVGATE-CANARY-"
CANARY_RE = re.compile(r"KVGATE-CANARY-[0-9a-f]{16}")
#: characters of one canary (14 + 16)
CANARY_CHARS = len(CANARY_PREFIX) + 16


def new_canary() -> str:
    """A fresh canary from the OS CSPRNG, e.g. ``KVGATE-CANARY-9f1c03a4b2d7e655``."""
    return CANARY_PREFIX + secrets.token_hex(8)


def find_canaries(text: str) -> list[str]:
    """Every whole canary in ``text`` read folded (module doc), distinct, in order of first
    appearance, each as planted (ASCII)."""
    return list(dict.fromkeys(CANARY_RE.findall(canary_text(text))))


def canary_text(text: str) -> str:
    """``text`` as canaries are searched in it (:func:`verifier.shingles.fold_chars`); text
    already so (ASCII, or NFKC without invisible characters: most text, checked in one pass)
    is returned as it is."""
    if text.isascii() or (unicodedata.is_normalized("NFKC", text) and not _has_invisible(text)):
        return text
    return fold_chars(text)


def _has_invisible(text: str) -> bool:
    return any(c in text for c in INVISIBLE_CHARS)


def surfaced(response_text: str, own_prompt_text: str) -> list[str]:
    """Canaries in a response that its own prompt does not hold (a model may echo its own
    prompt; the copy-probe model does exactly that)."""
    own = set(find_canaries(own_prompt_text))
    return [c for c in find_canaries(response_text) if c not in own]


class CanaryScanner:
    """Finds whole canaries in a text that arrives in pieces: keeps only the last
    ``CANARY_CHARS - 1`` characters of the text read folded (:func:`canary_text`) between
    pieces so a canary split across pieces is found once, when its last digit arrives (with
    zero-width characters between its letters it is longer than that raw, not folded)."""

    def __init__(self) -> None:
        self._tail = ""
        self.found: set[str] = set()

    def push(self, piece: str) -> list[str]:
        """Add ``piece``; returns canaries completed by it (each canary once per scanner)."""
        text = canary_text(self._tail + piece)
        new = list(dict.fromkeys(c for c in find_canaries(text) if c not in self.found))
        self.found.update(new)
        self._tail = text[-(CANARY_CHARS - 1) :]
        return new


@dataclass
class CanaryMatch:
    """A canary found in a response: ``fingerprint`` (keyed hash, hex; the canary itself is not
    logged) and ``owners`` (tenants that planted it within the TTL; empty = unknown origin)."""

    fingerprint: str
    owners: set[str] = field(default_factory=set)


class CanaryRegistry:
    """Which tenant planted which canary, as keyed 64-bit hashes in a :class:`LeakStore`
    (memory or Redis, under its own key prefix)."""

    def __init__(self, store: LeakStore, key: bytes) -> None:
        self.store = store
        self._base = hashlib.blake2b(key=hashlib.blake2b(key).digest(), digest_size=8, person=b"kvgate-canary")

    def fingerprint(self, canary: str) -> int:
        """Keyed hash of one canary."""
        h = self._base.copy()
        h.update(canary.encode())
        return int.from_bytes(h.digest(), "little")

    def register(self, tenant: str, canaries: Iterable[str]) -> int:
        """Record ``tenant``'s canaries; returns how many."""
        fps = [self.fingerprint(c) for c in canaries]
        if fps:
            self.store.add(tenant, fps)
        return len(fps)

    def lookup(self, canaries: list[str]) -> list[CanaryMatch]:
        """Owners of each canary (same order)."""
        fps = [self.fingerprint(c) for c in canaries]
        return [CanaryMatch(f"{fp:016x}", owners) for fp, owners in zip(fps, self.store.owners(fps), strict=True)]
