"""Time to first token against prompt length (the runbook's signal 3: "too good to be true").

Per upstream, model and kind of measurement (``stream``: time to the first streamed token, measured by
the gateway; ``whole``: the engine's reported prefill time of a non-streamed response; the two
are never mixed), prompts are bucketed by length (powers of two: bucket ``b`` holds lengths in
``[2**b, 2**(b+1))``); each bucket keeps a DDSketch (Datadog's relative-error quantile sketch,
the ``ddsketch`` package) of TTFT in seconds. Once a bucket has ``min_samples`` samples its
*calibrated lower bound* is ``quantile(q) * margin``. Prefill time never shrinks as prompts get
longer, so the bound that applies to a prompt is the largest bound of its bucket and every
shorter bucket of at least ``min_prompt_tokens`` (the judged ones): a prompt longer than the pool
(whose bucket never saw a clean sample, since every such prompt took the rejection path) is
still held to the bound of shorter prompts. Buckets below ``min_prompt_tokens`` never raise a
longer prompt's bound (they only give its fixed-cost ``floor``, see :meth:`LatencyModel.bound`):
short prompts are cheap to send in bulk and their TTFT is mostly queueing, so a short bucket
calibrated slow (by an actor's keys keeping the engine's queue full) would otherwise lift the
bound of every longer prompt above its honest TTFT.

A prompt of at least ``min_prompt_tokens`` answered faster than its bound is an anomaly: its
prefill most likely ran on a one-token placeholder and its answer came from someone else's KV.

Prefix-cache hits are not prefill: a prompt whose first ``cached_tokens`` tokens the engine
served from its cache (OpenAI/vLLM/SGLang ``usage.prompt_tokens_details.cached_tokens``) is
judged by the tokens it really prefilled (``prompt_tokens - cached_tokens``), so an honest cache
hit is not flagged; it calibrates nothing (a cached long prompt prefills few tokens but its TTFT
still grows with the cached context, so it fits neither its prefilled-length bucket nor the
whole prompt's). When the engine does not say (``cached_tokens`` is ``None``) the whole prompt
counts, for judging and calibration, and the caller only alerts on an anomaly (see
:class:`LatencyVerdict`'s ``cached_known``). A count the engine did send but that cannot be one
(negative, not an integer, above the prompt: :func:`cached_tokens_of`,
:func:`verifier.drift.usage_problems`) is known to be no cache hit: the engine's claim is not
evidence of one, so the whole prompt counts as prefilled, and a strict answer too fast for it is
withheld like one whose engine said 0. Before, it read as "not said", so such an engine turned a
withheld answer into an alert by writing ``"cached_tokens": -1``.

No tenant dominates calibration: each bucket keeps one sketch per tenant (at most
``max_tenants_per_bucket``, least recently updated evicted); a tenant's samples count at most
``ceil(tenant_share x min_samples)`` towards ``min_samples``, and a bucket needs samples of
``min_tenants`` (3) distinct tenants; the bucket's level is the *lower* median of the tenants'
quantiles. A tenant can make its own answers fast (a prompt the engine caches without saying
so) and slow (its other keys keep the engine's queue full), so one tenant, or two keys of one
actor, cannot calibrate a bucket alone, and slow tenants move the level only when they are a
strict majority of the bucket's tenants (2 of 4 do not). Fast tenants move it as half of them
(2 of 4): with an even count one side must win, and a level too low only weakens the check of
that bucket, while one too high flags, and for strict tenants withholds, honest answers (and
keeps them out of calibration, so it would not heal). An actor with ``min_tenants`` keys can
still calibrate a bucket nobody else uses, and set a judged bucket's level where its keys are
the majority.

Calibration survives restarts: every sample is also appended (:meth:`LatencyModel.take_unsaved`)
to a :class:`RedisLatencyStore` when the verifier has Redis, and a starting gateway replays what
is stored (:meth:`LatencyModel.replay`); without Redis it lives in memory.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ddsketch import DDSketch

from config.background import one_round
from verifier.incidents import RoundFaults

log = logging.getLogger("kvgate.verifier")

#: samples kept for a store between two saves (a store that is down loses the excess)
MAX_UNSAVED = 10_000


def bucket_of(prompt_tokens: int) -> int:
    """The length bucket of a prompt: ``floor(log2(prompt_tokens))`` (0 for 0 or 1 token)."""
    return max(int(prompt_tokens), 1).bit_length() - 1


@dataclass(frozen=True)
class LatencyVerdict:
    """``anomaly``: faster than the bound; ``bound_seconds``: the bound applied (``None`` while
    no bucket at or below this length is calibrated); ``bucket``: the bucket of the prefilled
    tokens; ``cached_known``: the engine said how many prompt tokens came from its cache (only
    then may an anomaly alone withhold a strict response)."""

    anomaly: bool
    bound_seconds: float | None
    bucket: int
    cached_known: bool = False


class LatencyModel:
    """Calibrated TTFT lower bounds per (upstream, model, kind, length bucket).

    ``quantile``: e.g. 0.001; ``margin``: multiplies the quantile (0.5 = half of it);
    ``min_samples``: samples before a bucket's bound counts; ``min_prompt_tokens``: shorter
    prompts (prefilled tokens) are recorded but never flagged, and their buckets never raise a
    longer prompt's bound. ``relative_accuracy``: DDSketch's.
    ``tenant_share``: the most of ``min_samples`` one tenant's samples can fill (1.0: one tenant
    may calibrate a bucket alone; the service uses ``verifier.latency_tenant_share``, 0.5);
    ``max_tenants_per_bucket``: sketches kept per bucket; ``min_tenants``: distinct tenants a
    bucket needs samples of before it calibrates (the service uses ``verifier.latency_min_tenants``, 3).
    """

    def __init__(
        self,
        *,
        quantile: float = 0.001,
        margin: float = 0.5,
        min_samples: int = 50,
        min_prompt_tokens: int = 512,
        relative_accuracy: float = 0.01,
        tenant_share: float = 1.0,
        max_tenants_per_bucket: int = 64,
        min_tenants: int = 1,
    ) -> None:
        self.quantile = quantile
        self.margin = margin
        self.min_samples = min_samples
        self.min_prompt_tokens = min_prompt_tokens
        self.relative_accuracy = relative_accuracy
        self.tenant_cap = max(1, math.ceil(tenant_share * min_samples))
        self.max_tenants_per_bucket = max_tenants_per_bucket
        self.min_tenants = min_tenants
        #: samples recorded and not yet handed to a store: ``(key, tenant, ttft_seconds)``
        self._unsaved: list[tuple[tuple[str, str, str, int], str, float]] = []
        #: (upstream, model, kind, bucket) -> {tenant: sketch}, in least-recently-updated order
        self._sketches: dict[tuple[str, str, str, int], dict[str, DDSketch]] = {}
        #: cached levels (``None``: not calibrated); dropped when the bucket gets a sample
        self._levels: dict[tuple[str, str, str, int], float | None] = {}

    def _level(self, key: tuple[str, str, str, int]) -> float | None:
        if key in self._levels:
            return self._levels[key]
        per = self._sketches.get(key)
        level = None
        if per and len(per) >= self.min_tenants:
            total = sum(min(int(s.count), self.tenant_cap) for s in per.values())
            if total >= self.min_samples:
                qs = sorted(q for s in per.values() if (q := s.get_quantile_value(self.quantile)) is not None)
                if qs:
                    level = qs[(len(qs) - 1) // 2]  # the lower median: slow needs a strict majority
        self._levels[key] = level
        return level

    def bound(self, upstream: str, prompt_tokens: int, kind: str = "whole", model: str = "") -> float | None:
        """The lower bound (seconds) for a prompt of this length (prefilled tokens), or ``None``
        when uncalibrated.

        ``L(b)`` = the level of calibrated bucket ``b`` (see the module doc); ``top`` = the
        largest ``L`` of the prompt's bucket and every shorter one from ``min_prompt_tokens``'s
        bucket on (a bucket below it never raises a longer prompt's bound); ``floor`` = the
        smallest ``L`` of the calibrated buckets shorter than ``top``'s, short ones included (the
        fixed cost every request pays: network, queueing, first decode step), capped at
        ``0.8 x top``, else 0. The bound is ``floor + margin x (top - floor)``: the margin
        applies to the length-dependent part, so a fixed overhead (large in streamed TTFTs)
        cannot hide a prefill that did not happen. ``None`` while no bucket that may give
        ``top`` is calibrated.
        """
        own = bucket_of(prompt_tokens)
        lowest = min(bucket_of(self.min_prompt_tokens), own)
        levels: list[tuple[int, float]] = []
        for b in range(own + 1):
            q = self._level((upstream, model, kind, b))
            if q is not None:
                levels.append((b, q))
        judged = [(b, q) for b, q in levels if b >= lowest]
        if not judged:
            return None
        top_b, top = max(judged, key=lambda x: (x[1], x[0]))
        shorter = [q for b, q in levels if b < top_b]
        floor = min(min(shorter), 0.8 * top) if shorter else 0.0
        return floor + self.margin * (top - floor)

    def record(
        self,
        upstream: str,
        prompt_tokens: int,
        ttft_seconds: float,
        kind: str = "whole",
        model: str = "",
        tenant: str = "",
    ) -> None:
        """Add a sample that was not an anomaly (anomalies are kept out of calibration);
        ``prompt_tokens``: the tokens really prefilled."""
        if not 0 < ttft_seconds < math.inf:  # also NaN: a sketch keeps NaN, and inf overflows it
            return
        key = (upstream, model, kind, bucket_of(prompt_tokens))
        self._add(key, tenant, ttft_seconds)
        if len(self._unsaved) < MAX_UNSAVED:
            self._unsaved.append((key, tenant, ttft_seconds))

    def _add(self, key: tuple[str, str, str, int], tenant: str, ttft_seconds: float) -> None:
        per = self._sketches.setdefault(key, {})
        s = per.pop(tenant, None)
        if s is None:
            s = DDSketch(relative_accuracy=self.relative_accuracy)
            while len(per) >= self.max_tenants_per_bucket:
                per.pop(next(iter(per)))
        per[tenant] = s  # most recently updated last
        s.add(ttft_seconds)
        self._levels.pop(key, None)

    def take_unsaved(self) -> list[tuple[tuple[str, str, str, int], str, float]]:
        """The samples recorded since the last call (for a store), oldest first; at most
        :data:`MAX_UNSAVED` are kept between calls."""
        out, self._unsaved = self._unsaved, []
        return out

    def replay(self, samples: Iterable[tuple[tuple[str, str, str, int], str, float]]) -> int:
        """Add stored samples (``(key, tenant, ttft_seconds)``, as :meth:`take_unsaved` gave
        them) without handing them to the store again; returns how many were added."""
        n = 0
        for key, tenant, ttft in samples:
            if ttft > 0:
                self._add(key, tenant, ttft)
                n += 1
        return n

    @staticmethod
    def prefilled_tokens(prompt_tokens: int, cached_tokens: int | None) -> int:
        """Tokens the engine really prefilled: ``prompt_tokens - cached_tokens`` (the gateway's
        count less the engine's cache hit; ``None`` or a value outside ``[0, prompt_tokens]``
        counts as no hit: the whole prompt)."""
        if cached_tokens is None or not 0 <= cached_tokens <= prompt_tokens:
            return prompt_tokens
        return prompt_tokens - cached_tokens

    def judge(
        self,
        upstream: str,
        prompt_tokens: int,
        ttft_seconds: float | None,
        kind: str = "whole",
        *,
        model: str = "",
        cached_tokens: int | None = None,
    ) -> LatencyVerdict:
        """Judge one TTFT without recording it (see :meth:`observe`). A ``cached_tokens`` outside
        ``[0, prompt_tokens]`` (the gateway's count) is known: no cache hit, the whole prompt."""
        n = self.prefilled_tokens(prompt_tokens, cached_tokens)
        b = bucket_of(n)
        known = cached_tokens is not None
        if ttft_seconds is None or not 0 <= ttft_seconds < math.inf:
            return LatencyVerdict(False, None, b, known)
        bound = self.bound(upstream, n, kind, model)
        anomaly = n >= self.min_prompt_tokens and bound is not None and ttft_seconds < bound
        return LatencyVerdict(anomaly, bound, b, known)

    def observe(
        self,
        upstream: str,
        prompt_tokens: int,
        ttft_seconds: float | None,
        kind: str = "whole",
        *,
        model: str = "",
        tenant: str = "",
        cached_tokens: int | None = None,
    ) -> LatencyVerdict:
        """Judge one TTFT (``kind``: ``stream`` or ``whole``; ``cached_tokens``: the engine's
        prefix-cache hit, ``None`` when it did not say) and, when it is no anomaly and the engine
        reported no cache hit (``cached_tokens`` ``None`` or 0), add it to ``tenant``'s
        calibration of the bucket of the prompt. A TTFT that is ``None``, negative, infinite or
        NaN is neither judged nor recorded."""
        v = self.judge(upstream, prompt_tokens, ttft_seconds, kind, model=model, cached_tokens=cached_tokens)
        if not v.anomaly and ttft_seconds is not None and not cached_tokens:
            self.record(upstream, prompt_tokens, ttft_seconds, kind, model, tenant)
        return v

    def samples(self, upstream: str, bucket: int, kind: str = "whole", model: str = "") -> int:
        """How many samples a bucket holds (every tenant's)."""
        per = self._sketches.get((upstream, model, kind, bucket)) or {}
        return int(sum(s.count for s in per.values()))


def cached_tokens_of(usage: dict | None) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` (OpenAI's field; vLLM and SGLang send the
    same when prefix caching reports it, an int: ``PromptTokenUsageInfo.cached_tokens:
    Optional[int]`` in ``vllm/entrypoints/openai/protocol.py``). ``None`` when the engine did not
    say (no usage object, the details or the count absent or ``null``); 0 when what it said
    cannot be a count of cached prompt tokens (details that are not an object, a count that is
    not an int, negative, or above the usage's own ``prompt_tokens``: what
    :func:`verifier.drift.usage_problems` reports as drift), since a claim that cannot be true is
    no evidence of a cache hit."""
    if not isinstance(usage, dict):
        return None
    d = usage.get("prompt_tokens_details")
    if d is None:
        return None
    c = d.get("cached_tokens") if isinstance(d, dict) else 0
    if c is None:
        return None
    if not isinstance(c, int) or isinstance(c, bool) or c < 0:
        return 0
    prompt = usage.get("prompt_tokens")
    if isinstance(prompt, int) and not isinstance(prompt, bool) and c > prompt:
        return 0
    return c


class RedisLatencyStore:
    """Latency samples in Redis, so calibration survives a restart: per bucket and tenant a list
    ``<prefix>latency:["<upstream>","<model>","<kind>",<bucket>,"<tenant>"]`` of the last ``keep`` TTFTs
    (seconds, as text), each list expiring ``ttl_seconds`` after its last sample; the set
    ``<prefix>latency:keys`` names the lists. :meth:`save` is one pipelined round trip,
    :meth:`load` two. ``client``: a synchronous ``redis.Redis``; raises ``redis.RedisError``."""

    def __init__(self, client, prefix: str = "kvgate:", keep: int = 512, ttl_seconds: float = 7 * 86400) -> None:
        self.client = client
        self.prefix = prefix + "latency:"
        self.keep = keep
        self.ttl_seconds = int(ttl_seconds)

    def _name(self, key: tuple[str, str, str, int], tenant: str) -> str:
        return self.prefix + json.dumps([key[0], key[1], key[2], key[3], tenant], separators=(",", ":"))

    def save(self, samples: list[tuple[tuple[str, str, str, int], str, float]]) -> None:
        """Append ``samples`` (from :meth:`LatencyModel.take_unsaved`)."""
        if not samples:
            return
        pipe = self.client.pipeline(transaction=False)
        names: dict[str, None] = {}
        for key, tenant, ttft in samples:
            name = self._name(key, tenant)
            pipe.rpush(name, repr(float(ttft)))
            names[name] = None
        for name in names:
            pipe.ltrim(name, -self.keep, -1)
            pipe.expire(name, self.ttl_seconds)
        pipe.sadd(self.prefix + "keys", *names)
        pipe.expire(self.prefix + "keys", self.ttl_seconds)
        pipe.execute()

    def load(self) -> list[tuple[tuple[str, str, str, int], str, float]]:
        """Every stored sample, for :meth:`LatencyModel.replay`."""
        names = sorted(n.decode() if isinstance(n, bytes) else n for n in self.client.smembers(self.prefix + "keys"))
        if not names:
            return []
        pipe = self.client.pipeline(transaction=False)
        for name in names:
            pipe.lrange(name, 0, -1)
        out = []
        for name, values in zip(names, pipe.execute(), strict=True):
            try:
                u, m, k, b, tenant = json.loads(name[len(self.prefix) :])
                key = (str(u), str(m), str(k), int(b))
                ttfts = [float(v) for v in values]
            except (ValueError, TypeError):
                continue  # not a list this store wrote
            out += [(key, str(tenant), t) for t in ttfts]
        return out


class LatencyKeeper:
    """Keeps a :class:`LatencyModel`'s samples in ``store`` (a :class:`RedisLatencyStore`, or
    ``None``: memory only): :meth:`load` at start-up, :meth:`save` every
    :attr:`SAVE_SECONDS` (:meth:`loop`) and at shutdown. ``lock``: the lock the model is used
    under; ``stats``: the verifier's counters (``latency_loaded``)."""

    #: seconds between two saves of new samples
    SAVE_SECONDS = 1.0

    def __init__(self, model: LatencyModel, store: RedisLatencyStore | None, lock, stats) -> None:
        self.model = model
        self.store = store
        self.lock = lock
        self.stats = stats
        #: a fault that persists in the saves (every second) is logged once a minute
        self._faults = RoundFaults("latency", stats)

    def load(self) -> int:
        """Replay the stored samples into the model; returns how many. A store error is logged
        and calibration starts empty. Blocking."""
        if self.store is None:
            return 0
        try:
            samples = self.store.load()
        except Exception as e:
            log.warning("verifier: could not load latency calibration: %s", e)
            return 0
        with self.lock:
            n = self.model.replay(samples)
        self.stats["latency_loaded"] += n
        return n

    def save(self) -> None:
        """Hand the samples recorded since the last save to the store (a store error loses
        them, logged). Blocking."""
        if self.store is None:
            return
        with self.lock:
            samples = self.model.take_unsaved()
        try:
            self.store.save(samples)
        except Exception as e:
            log.warning("verifier: could not save %d latency samples: %s", len(samples), e)

    async def loop(self) -> None:
        """Load, then save every :attr:`SAVE_SECONDS`, forever (cancel to stop). A load or save that
        raises past its own store-error handling (a native panic) is counted and logged
        (:class:`verifier.incidents.RoundFaults`, kind ``latency``); the saves go on."""
        await self._guarded(self.load)
        while True:
            await asyncio.sleep(self.SAVE_SECONDS)
            await self._guarded(self.save)

    async def _guarded(self, fn: Callable[[], object]) -> None:
        with one_round(self._faults):
            await asyncio.to_thread(fn)
