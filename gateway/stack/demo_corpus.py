"""Real text for ``kvgate demo``, and prompts cut to an exact token count.

Sources, all shipped with the project (nothing is read from outside it at run time):

- :func:`prose`: the public-domain passages in ``gateway/stack/demo_texts/`` (English, Polish, Chinese);
- :func:`project_source`: kvgate's own Python source (``config``, ``tokenizer``, ``gateway``,
  ``verifier``), read from the installed packages;
- :func:`generated_log`: gateway-style JSON log lines from a seeded generator (deterministic).

:func:`fit_prompt` / :func:`fit_chat` trim token ids of a text with the bundled tokenizer (the
counter the gateway uses for the bundled backend) so the request's prompt is exactly the number
of tokens asked for, as the gateway will count it.
"""

from __future__ import annotations

import importlib.util
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenizer import PromptCounter, bundled_counter

TEXTS_DIR = Path(__file__).resolve().parent / "demo_texts"
SOURCE_PACKAGES = ("config", "tokenizer", "gateway", "verifier")


class FitError(ValueError):
    """No text of the source could be cut to the asked token count (source too short)."""


def prose() -> str:
    """The passages of ``gateway/stack/demo_texts/*.txt``, in file-name order, blank-line separated."""
    return "\n\n".join(p.read_text(encoding="utf-8").strip() for p in sorted(TEXTS_DIR.glob("*.txt")))


def project_source(packages: tuple[str, ...] = SOURCE_PACKAGES) -> str:
    """kvgate's own source: every ``*.py`` file of ``packages`` (sorted), each after a
    ``# file: package/module.py`` line. Packages that are not installed are skipped."""
    parts: list[str] = []
    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            continue
        root = Path(next(iter(spec.submodule_search_locations)))
        for f in sorted(root.rglob("*.py")):
            rel = f.relative_to(root.parent).as_posix()
            parts.append(f"# file: {rel}\n{f.read_text(encoding='utf-8')}")
    return "\n\n".join(parts)


def generated_log(lines: int = 400, seed: int = 7) -> str:
    """``lines`` JSON log lines in the gateway's style (request id, tenant, token counts, status,
    timings), from ``random.Random(seed)``: the same text on every run."""
    rng = random.Random(seed)
    routes = ["/v1/chat/completions", "/v1/completions"]
    out = []
    t = 1_764_400_000.0
    for _ in range(lines):
        t += rng.expovariate(20.0)
        prompt = int(rng.lognormvariate(6.0, 1.2))
        status = rng.choices([200, 400, 401, 429, 503], [90, 5, 1, 3, 1])[0]
        out.append(
            json.dumps(
                {
                    "ts": round(t, 3),
                    "level": "info",
                    "request_id": f"req-{rng.getrandbits(64):016x}",
                    "tenant": rng.choice(["demo-a", "demo-b", "acme", "globex"]),
                    "route": rng.choice(routes),
                    "prompt_tokens": prompt,
                    "completion_tokens": rng.randint(1, 256) if status == 200 else 0,
                    "status": status,
                    "overhead_ms": round(rng.uniform(0.2, 1.5), 3),
                    "ttft_ms": round(prompt * 0.05 + rng.uniform(5, 40), 1) if status == 200 else None,
                }
            )
        )
    return "\n".join(out)


def _fit(counter: PromptCounter, source: str, target: int, count: Callable[[str], int]) -> str:
    """The prefix of ``source`` (cut on token ids, then on characters) whose ``count`` is ``target``."""
    ids = counter.encode_text(source)
    overhead = count("")
    if overhead > target:
        raise FitError(f"the prompt's frame alone is {overhead} tokens, more than {target}")
    n = target - overhead
    if n > len(ids):
        raise FitError(f"source has {len(ids)} tokens, {n} needed")
    text, n = _fit_by_tokens(counter.decode, ids, n, target, count)
    if text is None:
        # Token-level steps oscillate at a merge boundary: walk characters from a prefix that is long enough.
        text = _fit_by_characters(counter.decode(ids[: min(len(ids), n + 4)]), target, count)
    if text is None:
        raise FitError(f"no prefix of the source counts exactly {target} tokens")
    return text


def _fit_by_tokens(
    decode: Callable[[list[int]], str], ids: list[int], n: int, target: int, count: Callable[[str], int]
) -> tuple[str | None, int]:
    """Cut ``ids`` after ``n`` ids and step the cut by the count's error, at most 32 times: the
    text that counts ``target`` and its cut, else ``None`` and the last cut (a step back to a cut
    already tried, or out of ``ids``, ends the walk)."""
    tried: set[int] = set()
    for _ in range(32):
        text, n = _whole_characters(decode, ids, n)
        got = count(text)
        if got == target:
            return text, n
        tried.add(n)
        step = target - got
        if n + step in tried or n + step < 0 or n + step > len(ids):
            break
        n += step
    return None, n


def _whole_characters(decode: Callable[[list[int]], str], ids: list[int], n: int) -> tuple[str, int]:
    """The text of the first ``n`` ids, fewer when the cut would end inside a multi-byte character."""
    text = decode(ids[:n])
    while text.endswith("\ufffd") and n > 0:
        n -= 1
        text = decode(ids[:n])
    return text, n


def _fit_by_characters(text: str, target: int, count: Callable[[str], int]) -> str | None:
    """``text`` cut a character at a time until it counts ``target``; where no prefix does (a
    character of two tokens at the cut), a prefix one short plus a filler. ``None`` when neither."""
    while text and count(text) > target:
        text = text[:-1]
        got = count(text)
        if got == target:
            return text
        if got == target - 1:
            filled = _with_filler(text, target, count)
            if filled is not None:
                return filled
    return None


def _with_filler(text: str, target: int, count: Callable[[str], int]) -> str | None:
    """``text`` plus the first filler with which it counts ``target``, else ``None``."""
    for filler in (".", "\n", " ", " .", "…"):
        if count(text + filler) == target:
            return text + filler
    return None


def fit_prompt(source: str, target: int, counter: PromptCounter | None = None, prefix: str = "") -> str:
    """A ``/v1/completions`` prompt string of exactly ``target`` prompt tokens: ``prefix`` followed
    by the start of ``source``. Raises :class:`FitError` when ``source`` is too short."""
    c = counter or bundled_counter()
    return prefix + _fit(c, source, target, lambda t: c.count_prompt(prefix + t).largest)


def fit_chat(
    source: str, target: int, counter: PromptCounter | None = None, instruction: str = "", system: str | None = None
) -> list[dict[str, Any]]:
    """Chat ``messages`` of exactly ``target`` prompt tokens (ChatML template and generation
    prompt included): an optional system message, then a user message ``instruction`` + the start
    of ``source``. Raises :class:`FitError` when ``source`` is too short."""
    c = counter or bundled_counter()

    def messages(text: str) -> list[dict[str, Any]]:
        head = [{"role": "system", "content": system}] if system else []
        return head + [{"role": "user", "content": instruction + text}]

    return messages(_fit(c, source, target, lambda t: c.count_chat(messages(t))))
