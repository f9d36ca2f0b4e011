"""``kvgate probe``: the runbook's signal 2, a canary probe at the live limit.

Steps (``L`` = the live limit, prompt + ``max_tokens`` tokens; ``@n`` = a prompt of
``n - max_tokens`` tokens, so prompt + completion is ``n``):

1. ``plant@L/2`` - canaries in a prompt that fits any sane pool, so the KV pages it leaves behind
   hold canaries;
2. ``plant@L``, then ``fresh@L`` - canaries at the boundary, then a fresh long prompt;
3. ``plant@L+1``, then ``fresh@L+1`` - one past the boundary (the rejection path), then fresh.

Every response BODY (never the status: a 200 proves nothing, a 400 is fine) is searched for
canaries its own prompt does not hold. Evidence is any canary in a ``fresh`` step's body (its
prompt holds none to imitate). In a ``plant`` step's body a model that sees its own canary
repeated may echo it mistyped or write new ones in its pattern, so there a canary is evidence when
an earlier step planted it, when it is a garbled copy of one (at most :data:`NEAR_DIGITS` of its 16
hex digits differ, and it is not as near the step's own), or when the canary registry knows it
(``known``: another run's, another replica's or a honeypot tenant's canary); any other is
``unmatched``, counted but no evidence.

Prompts are sized exactly with the served model's own count: the target's vLLM-shaped ``/tokenize``
(the gateway's answers from the gate's counter; :class:`RemoteCounter`), iterating until prompt +
``max_tokens`` is the step's target; only without one, the bundled cl100k tokenizer. The at-limit
steps must be answered 200, else the boundary was never exercised and the outcome is ``unknown``.
Runs through the gateway as a probe tenant (``--base-url http://gw:8080/v1 --api-key ...``) or
straight at an engine's OpenAI base URL. Exit status: 0 clean, 1 a canary surfaced, 2 could not
tell (no limit, transport errors, no step got a 2xx, or an at-limit step was not answered 200).
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import random
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from config.pool import effective_pool_limit
from verifier.canary import find_canaries, new_canary
from verifier.shingles import encode

EXIT_CLEAN, EXIT_LEAK, EXIT_UNKNOWN = 0, 1, 2

_WORDS = (
    "river stone garden window market silver morning letter bridge paper orange yellow winter "
    "summer forest coffee engine rocket planet castle doctor farmer island mirror pencil pocket "
    "rabbit saddle shadow signal spring square summit table temple ticket timber tower travel "
    "valley velvet violin wagon water weather wheel whistle wonder yard anchor basket blanket "
    "bottle button candle canvas carpet cattle circle cotton copper cradle crystal dragon "
    "feather fiddle finger flower garlic ginger hammer harbor helmet honey insect jacket jungle "
    "kettle kitchen ladder lantern lemon lizard magnet marble meadow monkey needle noodle "
    "orchard oyster palace parrot pepper pillow pirate puzzle quarter ribbon saddle sailor "
    "salmon scarf shovel shelter sugar tiger tunnel turtle umbrella village walnut"
).split()


def _one_token_words() -> list[str]:
    return [w for w in dict.fromkeys(_WORDS) if len(encode(" " + w)) == 1]


_FILLER: list[str] | None = None


def filler_words() -> list[str]:
    """Words that are one cl100k token each with their leading space."""
    global _FILLER
    if _FILLER is None:
        _FILLER = _one_token_words()
    return _FILLER


PROMPT_HEAD = "Summarize this:"


def build_prompt(n_tokens: int, canary: str | None, rng: random.Random, every_tokens: int = 48) -> str:
    """A prompt of exactly ``n_tokens`` cl100k tokens: ``Summarize this:`` and random one-token
    words, with ``canary`` (when given) repeated every ``every_tokens`` tokens. Raises
    ``ValueError`` when ``n_tokens`` is too small to hold the head (and one canary)."""
    words = filler_words()
    head = len(encode(PROMPT_HEAD))
    can_piece = f" {canary}" if canary else ""
    can_tokens = len(encode(can_piece)) if canary else 0
    if n_tokens < head + can_tokens + 1:
        raise ValueError(f"a probe prompt needs at least {head + can_tokens + 1} tokens")
    parts = [PROMPT_HEAD]
    used = head
    since = every_tokens  # plant first canary right away
    while used < n_tokens:
        if canary and since >= every_tokens and n_tokens - used >= can_tokens:
            parts.append(can_piece)
            used += can_tokens
            since = 0
            continue
        parts.append(" " + rng.choice(words))
        used += 1
        since += 1
    text = "".join(parts)
    got = len(encode(text))
    if got != n_tokens:  # cannot happen with one-token words on pre-token boundaries; be loud
        raise AssertionError(f"probe prompt sized {got} tokens, wanted {n_tokens}")
    return text


def _pieces(n_tokens: int, canary: str | None, rng: random.Random, every: int = 48) -> list[str]:
    """``PROMPT_HEAD`` then ``n_tokens`` pieces: `` <word>`` fillers with `` <canary>`` (when
    given) first and every ``every`` pieces. Every piece is at least one token in any BPE
    tokenizer, so a prefix of at most ``n_tokens`` pieces holds any prompt of ``n_tokens``."""
    words = filler_words()
    out = [PROMPT_HEAD]
    for i in range(max(n_tokens, 1)):
        out.append(f" {canary}" if canary and i % every == 0 else " " + rng.choice(words))
    return out


#: one-token pads tried (in order) to close the last gap of a remotely sized prompt
_PADS = (" the", " a", " and", ".", ",", " x", "!")


class _PieceCounts:
    """The count of the first ``k + 1`` pieces (plus a ``tail``), at most ``max_calls`` counts."""

    def __init__(self, count: Callable[[str], Any], pieces: list[str], n_tokens: int, max_calls: int) -> None:
        self.count = count
        self.pieces = pieces
        self.n_tokens = n_tokens
        self.max_calls = max_calls
        self.calls = 0

    def text(self, k: int, tail: str = "") -> str:
        return "".join(self.pieces[: k + 1]) + tail

    async def __call__(self, k: int, tail: str = "") -> int:
        self.calls += 1
        if self.calls > self.max_calls:
            raise ValueError(f"could not size a {self.n_tokens}-token probe prompt in {self.max_calls} counts")
        return int(await self.count(self.text(k, tail)))


async def _search_pieces(f: _PieceCounts, k: int, c: int, k_lo: int, c_lo: int) -> tuple[int, int, int]:
    """Secant steps from a first guess ``k`` (count ``c``) above the piece count ``k_lo`` (count
    ``c_lo``, under the target): ``(k, c, c_lo)`` where ``c`` is the target when ``k`` hits it;
    otherwise ``k`` is the largest piece count found under the target and ``c_lo`` its count."""
    n_tokens, c0 = f.n_tokens, c_lo
    k_hi, c_hi = (k, c) if c >= n_tokens else (len(f.pieces), n_tokens + 10**9)
    if c < n_tokens:
        k_lo, c_lo = k, c
    while c != n_tokens and k_hi - k_lo > 1:
        # each piece is >= 1 token, so the count rises with k
        per = (c_hi - c_lo) / (k_hi - k_lo) if c_hi < 10**9 else max(1.0, (c_lo - c0) / max(k_lo, 1))
        k = k_lo + max(1, min(k_hi - k_lo - 1, int((n_tokens - c_lo) / max(per, 1.0))))
        c = await f(k)
        if c < n_tokens:
            k_lo, c_lo = k, c
        elif c > n_tokens:
            k_hi, c_hi = k, c
    return (k, c, c_lo) if c == n_tokens else (k_lo, c, c_lo)


async def fit_prompt_remote(
    count: Callable[[str], Any], n_tokens: int, canary: str | None, rng: random.Random, max_calls: int = 40
) -> str:
    """A prompt of exactly ``n_tokens`` tokens as ``count`` (an async ``text -> int``, the served
    model's own count, e.g. its ``/tokenize``) counts it: head + filler pieces (canaries every 48),
    the piece count found by secant steps then single steps, the last gap closed with one-token
    pads (:data:`_PADS`). Raises ``ValueError`` when the count cannot be hit exactly within
    ``max_calls`` counts, or when ``n_tokens`` cannot hold the head and a canary."""
    f = _PieceCounts(count, _pieces(n_tokens, canary, rng), n_tokens, max_calls)
    c_lo = await f(0)  # the head alone (plus any special tokens the model adds)
    need = 2 if canary else 1
    if c_lo + need > n_tokens:
        raise ValueError(f"a probe prompt needs more than {n_tokens} tokens here")
    k = max(need, min(len(f.pieces) - 1, n_tokens - c_lo))
    k, c, c_lo = await _search_pieces(f, k, await f(k), 0, c_lo)
    if c == n_tokens:
        return f.text(k)
    gap = n_tokens - c_lo  # 0 < gap < (tokens of piece k + 1)
    for pad in _PADS:
        if await f(k, pad * gap) == n_tokens:
            return f.text(k, pad * gap)
    raise ValueError(f"could not size a probe prompt to exactly {n_tokens} tokens with the served tokenizer")


class RemoteCounter:
    """The served model's own prompt count, from a vLLM-shaped ``POST /tokenize`` (``{"model",
    "prompt", "add_special_tokens": true}`` -> ``{"count", "max_model_len"}``): the gateway's
    (answered from the gate's own counter, ``max_model_len`` = the tenant's live limit), the
    bundled engine's or vLLM's. Tries ``<base_url>/tokenize`` (the gateway and the bundled engine
    serve it under ``/v1/``) then ``/tokenize`` at the URL's root (vLLM). ``available`` is False
    when neither answers; ``max_model_len`` is the last one reported (tokens, or ``None``)."""

    def __init__(self, client: httpx.AsyncClient, target: ProbeTarget, headers: dict[str, str]) -> None:
        self.client = client
        self.target = target
        self.headers = headers
        base = target.base_url.rstrip("/")
        root = base[: -len("/v1")] if base.endswith("/v1") else base
        self.urls = [base + "/tokenize"] + ([root + "/tokenize"] if root != base else [])
        self.url: str | None = None
        self.max_model_len: int | None = None

    async def _post(self, url: str, text: str) -> int | None:
        body: dict[str, Any] = {"prompt": text, "add_special_tokens": True}
        if self.target.model:
            body["model"] = self.target.model
        try:
            r = await self.client.post(url, json=body, headers=self.headers)
            data = r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None
        if not isinstance(data, dict) or not isinstance(data.get("count"), int) or isinstance(data["count"], bool):
            return None
        mml = data.get("max_model_len")
        if isinstance(mml, int) and not isinstance(mml, bool) and mml > 0:
            self.max_model_len = mml
        return int(data["count"])

    async def available(self) -> bool:
        """Whether a ``/tokenize`` answers a count (picks the URL)."""
        for url in self.urls:
            if await self._post(url, PROMPT_HEAD) is not None:
                self.url = url
                return True
        return False

    async def __call__(self, text: str) -> int:
        """``text``'s prompt tokens. Raises ``ValueError`` when the endpoint stops answering."""
        got = await self._post(self.url or self.urls[0], text)
        if got is None:
            raise ValueError("the served model's /tokenize stopped answering")
        return got


@dataclass
class ProbeStep:
    """One request: ``label`` (e.g. ``fresh@L+1``), prompt and completion sizes, HTTP status
    (``None`` on a transport error), ``surfaced``: canaries in the body that are evidence (see the
    module doc; count), ``unmatched``: other canary-shaped strings in a ``plant`` step's body."""

    label: str
    prompt_tokens: int
    max_tokens: int
    status: int | None = None
    surfaced: int = 0
    unmatched: int = 0
    error: str | None = None
    found: list[str] = field(default_factory=list, repr=False)


@dataclass
class ProbeResult:
    """``outcome``: ``clean``, ``leak`` or ``unknown``; ``surfaced``: the steps' evidence canaries
    (see the module doc); ``limit``: the live limit probed."""

    outcome: str
    limit: int | None
    surfaced: int = 0
    steps: list[ProbeStep] = field(default_factory=list)
    reason: str | None = None

    @property
    def exit_code(self) -> int:
        return {"clean": EXIT_CLEAN, "leak": EXIT_LEAK}.get(self.outcome, EXIT_UNKNOWN)


@dataclass
class ProbeTarget:
    """Where a probe goes: ``base_url`` (OpenAI base, ending in ``/v1``), ``model``, optional
    ``api_key``; ``limit`` (tokens) or ``server_info_urls`` + ``context_length`` + ``headroom``
    to read it live. ``upstream``: the upstream's name (for incidents)."""

    base_url: str
    model: str | None = None
    api_key: str | None = None
    limit: int | None = None
    server_info_urls: list[str] = field(default_factory=list)
    context_length: int | None = None
    headroom: float = 1.25
    upstream: str = "direct"


async def live_limit(client: httpx.AsyncClient, target: ProbeTarget) -> int | None:
    """``target.limit``, else the minimum :func:`config.pool.effective_pool_limit` over its
    server-info URLs (``None`` when any is unreachable or lacks the pool field)."""
    if target.limit:
        return target.limit
    if not target.server_info_urls:
        return None
    from verifier.deploy_gate import pool_tokens_of

    limits = []
    for url in target.server_info_urls:
        try:
            r = await client.get(url)
            r.raise_for_status()
            info = r.json()
        except (httpx.HTTPError, ValueError):
            return None
        if not isinstance(info, dict):
            return None
        found = pool_tokens_of(info)
        ctx = target.context_length or info.get("context_length")
        if found is None or not isinstance(ctx, int):
            return None
        mril = info.get("max_req_input_len") if isinstance(info.get("max_req_input_len"), int) else None
        limits.append(effective_pool_limit(ctx, found[0], mril, target.headroom))
    return min(limits) if limits else None


def _plan(limit: int) -> list[tuple[str, int, bool]]:
    """The steps at the live limit ``limit``: ``(label, prompt + completion tokens, plant)``."""
    return [
        ("plant@L/2", limit // 2, True),
        ("plant@L", limit, True),
        ("fresh@L", limit, False),
        ("plant@L+1", limit + 1, True),
        ("fresh@L+1", limit + 1, False),
    ]


async def _step_prompt(remote: RemoteCounter | None, step: ProbeStep, canary: str | None, rng: random.Random) -> str:
    """The step's prompt, sized by the served model's count (``remote``) or the bundled one.
    Raises ``ValueError`` when it cannot be sized exactly."""
    if remote is not None:
        return await fit_prompt_remote(remote, step.prompt_tokens, canary, rng)
    return build_prompt(step.prompt_tokens, canary, rng)


async def _send_step(
    client: httpx.AsyncClient,
    target: ProbeTarget,
    headers: dict[str, str],
    step: ProbeStep,
    prompt: str,
    canary: str | None,
) -> None:
    """Send one step's completion request; fills ``step.status`` and ``step.found`` (the canaries
    in the body other than its own, for :func:`judge_found`), or ``step.error`` on a transport
    error."""
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": step.max_tokens, "temperature": 0}
    if target.model:
        body["model"] = target.model
    try:
        r = await client.post(target.base_url.rstrip("/") + "/completions", json=body, headers=headers)
    except httpx.HTTPError as e:
        step.error = f"{type(e).__name__}: {e}"[:300]
        return
    step.status = r.status_code
    step.found = [c for c in find_canaries(r.text) if c != canary]


#: hex digits (of a canary's 16) in which a garbled copy may differ from the canary it copies
NEAR_DIGITS = 4

#: which canaries the registry knows (``True`` each: some tenant planted it); may be a coroutine
Known = Callable[[list[str]], Any]


async def _settled(value: Any) -> Any:
    """``value``, awaited first when it is awaitable (a callback may be a plain function or a
    coroutine function)."""
    return await value if inspect.isawaitable(value) else value


def _distance(a: str, b: str) -> int:
    """Hex digits in which two canaries differ."""
    return sum(x != y for x, y in zip(a[-16:], b[-16:], strict=True))


def _evidence_in_plant(c: str, own: str, earlier: frozenset[str]) -> bool | None:
    """A canary in a ``plant`` step's body: evidence (``True``), an echo of its own (``False``),
    or not known from this run (``None``)."""
    if c in earlier:
        return True
    near_own = _distance(c, own)
    nearest = min((_distance(c, e) for e in earlier), default=17)
    if nearest <= NEAR_DIGITS and nearest < near_own:
        return True  # a garbled copy of an earlier step's canary
    return False if near_own <= NEAR_DIGITS else None


async def judge_found(step: ProbeStep, canary: str | None, earlier: frozenset[str], known: Known | None) -> None:
    """``step.surfaced`` and ``step.unmatched`` from ``step.found`` (see the module doc):
    ``canary``: the step's own (``None``: a fresh step, whose every canary is evidence);
    ``earlier``: those of the steps before it; ``known``: the registry's lookup, or ``None``."""
    if canary is None:
        step.surfaced, step.unmatched = len(step.found), 0
        return
    verdicts = [_evidence_in_plant(c, canary, earlier) for c in step.found]
    unknown = [c for c, v in zip(step.found, verdicts, strict=True) if v is None]
    registered: list[bool] = []
    if unknown and known is not None:
        registered = list(await _settled(known(unknown)))
    step.surfaced = verdicts.count(True) + sum(registered)
    step.unmatched = len(step.found) - step.surfaced


def _judge(result: ProbeResult) -> None:
    """Set ``result.outcome`` (and ``reason``) from its steps (see the module doc)."""
    steps = result.steps
    at_limit = [s for s in steps if s.label in ("plant@L", "fresh@L") and s.status is not None]
    result.surfaced = sum(s.surfaced for s in steps)
    if result.surfaced:
        result.outcome = "leak"
    elif any(s.error for s in steps):
        result.outcome, result.reason = "unknown", "some probe requests failed"
    elif not any(s.status is not None and 200 <= s.status < 300 for s in steps):
        result.outcome, result.reason = "unknown", "no probe request was answered with a 2xx"
    elif bad := [s for s in at_limit if s.status != 200]:
        result.outcome = "unknown"
        result.reason = (
            f"the at-limit request {bad[0].label} (prompt {bad[0].prompt_tokens} + max_tokens {bad[0].max_tokens}"
            f" = {result.limit} tokens) was answered HTTP {bad[0].status}, not 200: the boundary was not exercised"
            " (the limit or the prompt sizing does not match the served model)"
        )


async def run_probe(
    client: httpx.AsyncClient,
    target: ProbeTarget,
    *,
    max_tokens: int = 64,
    rng: random.Random | None = None,
    register: Callable[[list[str]], Any] | None = None,
    known: Known | None = None,
) -> ProbeResult:
    """Run the five steps against ``target`` (see module doc). ``register`` is called with the
    canaries before they are sent (the gateway's verifier records them as honeypot canaries);
    ``known`` says which canaries of a ``plant`` answer the registry knows (:func:`judge_found`).
    A result of either that is awaitable is awaited first."""
    rng = rng or random.Random()
    headers = {"content-type": "application/json"}
    if target.api_key:
        headers["authorization"] = f"Bearer {target.api_key}"
    remote = RemoteCounter(client, target, headers)
    sized_remotely = await remote.available()
    limit = await live_limit(client, target)
    if limit is None and remote.max_model_len:
        limit = remote.max_model_len  # the gateway's /tokenize: the tenant's live limit
    if limit is None:
        return ProbeResult("unknown", None, reason="live limit unknown (no --limit and no readable pool)")
    result = ProbeResult("clean", limit)
    planted: list[str] = []
    for label, total, plant in _plan(limit):
        step = ProbeStep(label, total - max_tokens, max_tokens)
        result.steps.append(step)
        canary = new_canary() if plant else None
        try:
            prompt = await _step_prompt(remote if sized_remotely else None, step, canary, rng)
        except ValueError as e:
            step.error = str(e)
            continue
        if canary and register is not None:
            await _settled(register([canary]))  # a coroutine from the gateway's periodic probe
        await _send_step(client, target, headers, step, prompt, canary)
        await judge_found(step, canary, frozenset(planted), known)
        planted += [canary] if canary else []
    _judge(result)
    return result


def targets_from_settings(settings) -> list[ProbeTarget]:
    """One engine-direct target per upstream of a :class:`~config.models.Settings` (the
    gateway's periodic probe): its first model, its pool URLs (or static pool)."""
    out = []
    for u in settings.upstreams:
        m = settings.model_by_name(u.models[0]) if u.models else None
        model = (m.upstream_model or m.id) if m else None
        ctx = m.context_length if m else None
        limit = None
        if u.pool_source == "static" and u.static_pool_tokens and ctx:
            limit = effective_pool_limit(ctx, u.static_pool_tokens, None, settings.pool.headroom)
        out.append(
            ProbeTarget(
                u.api_url,
                model,
                u.api_key.get_secret_value() if u.api_key else None,
                limit,
                list(u.pool_urls) if u.pool_source in ("sglang", "kvgate") else [],
                ctx,
                settings.pool.headroom,
                u.name,
            )
        )
    return out


async def run_probe_targets(
    targets: list[ProbeTarget],
    *,
    max_tokens: int = 64,
    timeout_seconds: float = 120.0,
    register: Callable[[list[str]], Any] | None = None,
    known: Known | None = None,
) -> list[tuple[ProbeTarget, ProbeResult]]:
    """Probe each target in turn (``register``, ``known``: as :func:`run_probe`)."""
    out = []
    async with httpx.AsyncClient(timeout=timeout_seconds) as client:
        for t in targets:
            out.append((t, await run_probe(client, t, max_tokens=max_tokens, register=register, known=known)))
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """CLI flags of ``kvgate probe``."""
    parser.add_argument(
        "--base-url", required=True, help="OpenAI base URL: the gateway's (http://host:8080/v1) or an engine's"
    )
    parser.add_argument("--api-key", default=None, help="the probe tenant's API key (through the gateway)")
    parser.add_argument("--model", default=None, help="model to ask for")
    parser.add_argument(
        "--limit",
        type=int,
        default=None,
        help="the live limit in tokens (prompt + completion); default: read --server-info-url",
    )
    parser.add_argument(
        "--server-info-url",
        nargs="*",
        default=[],
        metavar="URL",
        help="prefill nodes' server info URLs to read the live limit from",
    )
    parser.add_argument("--context-length", type=int, default=None, help="context length (default: the engine's)")
    parser.add_argument("--headroom", type=float, default=1.25, help="pool headroom divisor (default 1.25)")
    parser.add_argument("--max-tokens", type=int, default=64, help="completion tokens per probe request (default 64)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per request (default 300)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    """Entry point; returns 0 clean, 1 leak, 2 could not tell."""
    if args.max_tokens < 1 or (args.limit is not None and args.limit < 2):
        print("kvgate probe: --max-tokens must be >= 1 and --limit >= 2", file=sys.stderr)
        return EXIT_UNKNOWN
    if not 1.0 <= args.headroom <= 100.0:  # also nan, which compares false (a traceback before)
        print("kvgate probe: --headroom must be from 1.0 to 100 (pool.headroom's bounds)", file=sys.stderr)
        return EXIT_UNKNOWN
    target = ProbeTarget(
        args.base_url,
        args.model,
        args.api_key,
        args.limit,
        list(args.server_info_url),
        args.context_length,
        args.headroom,
    )

    async def go() -> ProbeResult:
        async with httpx.AsyncClient(timeout=args.timeout) as client:
            return await run_probe(client, target, max_tokens=args.max_tokens)

    result = asyncio.run(go())
    if args.json:
        doc = asdict(result)
        for step in doc["steps"]:
            del step["found"]  # counts only: the canaries themselves stay out of logs
        print(json.dumps({**doc, "exit_code": result.exit_code}))
    else:
        print(f"probe of {args.base_url}: live limit {result.limit}")
        for s in result.steps:
            what = f"HTTP {s.status}" if s.status is not None else f"error: {s.error}"
            print(
                f"  {s.label:<10} prompt={s.prompt_tokens} max_tokens={s.max_tokens} {what} "
                f"surfaced_canaries={s.surfaced}" + (f" unmatched_canaries={s.unmatched}" if s.unmatched else "")
            )
        print(
            {
                "clean": "probe: CLEAN (no canary surfaced)",
                "leak": f"probe: LEAK ({result.surfaced} canaries surfaced in responses that did not plant them)",
                "unknown": f"probe: UNKNOWN ({result.reason})",
            }[result.outcome]
        )
    return result.exit_code
