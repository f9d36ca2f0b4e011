"""The passive leak index (docs/design.md, Verifier): which tenants recently sent which shingles.

For each tenant's prompt the index stores its *winnowed* keyed shingle fingerprints
(:mod:`verifier.shingles`, k = 16, w = 35) with a TTL; for a response it looks up *every*
shingle. A response shingle counts as foreign evidence when exactly one tenant sent it and that
tenant is not the response's own tenant (and it is not in the response's own prompt). Shingles
sent by two or more tenants are public (a shared system prompt, a quoted passage) and ignored.
Because every response shingle is looked up and every window of ``w`` prompt shingles keeps
one, any run of ``w + k - 1`` (= 50) tokens of another tenant's prompt in a response is found.

Stores: :class:`MemoryLeakStore` (one process) and :class:`RedisLeakStore` (shared by gateway
replicas; one round trip per ingest or lookup). Both store only 64-bit keyed hashes
and tenant ids, never text.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from config.redis_client import ascript_by_slot, is_cluster, script_by_slot
from verifier.shingles import ShingleHasher, encode, fold


class LeakStore(Protocol):
    """Fingerprint -> set of tenant ids, each entry expiring ``ttl_seconds`` after its last add.
    ``thread_safe``: whether calls from several threads at once are safe without a caller's lock."""

    thread_safe: bool

    def add(self, tenant: str, fps: Iterable[int]) -> None:
        """Record that ``tenant`` sent these fingerprints now."""
        ...

    def owners(self, fps: list[int]) -> list[set[str]]:
        """For each fingerprint (same order), the tenants that sent it within the TTL."""
        ...


class MemoryLeakStore:
    """In-process store: ``{fingerprint: {tenant: expiry_monotonic}}``; expired entries are
    purged lazily on read and, every ``sweep_every`` adds, among the next ``sweep_every``
    entries of a pass over the store (adds run on the gateway's event loop: a sweep of the whole
    store took 0.33 s per million entries). ``clock`` is injectable for tests (seconds). Not
    thread-safe (a sweep replaces the entries an add may be updating): callers serialise its calls."""

    #: calls from several threads at once need the caller's lock
    thread_safe = False

    def __init__(self, ttl_seconds: float, clock=time.monotonic, sweep_every: int = 10_000) -> None:
        self.ttl_seconds = ttl_seconds
        self.clock = clock
        self._data: dict[int, dict[str, float]] = {}
        self._adds = 0
        self._sweep_every = sweep_every
        self._pass: list[int] = []  # the keys the current sweep pass has still to visit

    def __len__(self) -> int:
        return len(self._data)

    def add(self, tenant: str, fps: Iterable[int]) -> None:
        exp = self.clock() + self.ttl_seconds
        data = self._data
        for fp in fps:
            owners = data.get(fp)
            if owners is None:
                data[fp] = {tenant: exp}
            else:
                owners[tenant] = exp
            self._adds += 1
        if self._adds >= self._sweep_every:
            self._adds = 0
            if not self._pass:
                self._pass = list(self._data)
            n = min(self._sweep_every, len(self._pass))
            self._drop_expired(self._pass[-n:])
            del self._pass[-n:]

    def sweep(self) -> None:
        """Drop every expired entry."""
        self._drop_expired(list(self._data))

    def _drop_expired(self, fps: list[int]) -> None:
        now = self.clock()
        for fp in fps:
            entry = self._data.get(fp)
            if entry is None:
                continue
            owners = {t: e for t, e in entry.items() if e > now}
            if owners:
                self._data[fp] = owners
            else:
                del self._data[fp]

    def owners(self, fps: list[int]) -> list[set[str]]:
        now = self.clock()
        out = []
        for fp in fps:
            owners = self._data.get(fp)
            out.append({t for t, e in owners.items() if e > now} if owners else set())
        return out


#: the value a fingerprint key takes once two tenants sent it (tenant ids never contain "*")
PUBLIC = "*"

#: sets each fingerprint key from ``KEYS[first]`` on to the tenant ``ARGV[1]`` (or to
#: :data:`PUBLIC` when another tenant holds it), expiring ``ARGV[2]`` ms later
_SET_OWNERS = """
local t, ttl = ARGV[1], ARGV[2]
for i = first, #KEYS do
  local k = KEYS[i]
  local v = redis.call('GET', k)
  if (not v) or v == t then
    redis.call('SET', k, t, 'PX', ttl)
  else
    redis.call('SET', k, '*', 'PX', ttl)
  end
end
"""

_ADD_LUA = "local first = 1" + _SET_OWNERS + "return #KEYS\n"

#: :data:`_ADD_LUA` made only if the hash ``KEYS[1]`` holds the field ``ARGV[3]`` when it runs
#: (the quota reservation sent just before it in the same pipeline, :meth:`RedisLeakStore.add_call`'s
#: ``guard``); ``-1`` when it does not, and nothing is written
_ADD_IF_LUA = (
    "if redis.call('HEXISTS', KEYS[1], ARGV[3]) == 0 then return -1 end\nlocal first = 2"
    + _SET_OWNERS
    + "return #KEYS - 1\n"
)


class RedisLeakStore:
    """Redis store shared by gateway replicas: one string key per fingerprint,
    ``<prefix>{<bucket>}:fp:<16 hex digits>`` (``bucket``: the fingerprint's top 6 bits, two hex
    digits, a hash tag that spreads the index over 64 slots of a Redis Cluster), holding the one
    tenant that sent it, or ``*`` once a second tenant did (public); its TTL is renewed on every
    add, so an entry lives ``ttl_seconds`` after the last time any tenant sent it. About 100
    bytes of Redis memory per stored fingerprint (~5.6 per 100 prompt tokens: size
    ``leak_index_ttl_seconds`` to the prompt volume). ``client``: a synchronous redis-py client
    (standalone, Sentinel or Cluster). :meth:`add` is one Lua call and :meth:`owners` one
    ``MGET`` per ``batch`` keys; on a Redis Cluster each is split by slot (one script or ``MGET``
    per slot, in one pipeline: a round trip per node). Raises ``redis.RedisError`` when Redis is
    down (the service counts it and skips the check). Thread-safe: every call is one atomic
    Redis command on the client's connection pool and it keeps no state of its own, so callers
    need no lock around it (:attr:`thread_safe`). ``aclient``: an optional ``redis.asyncio``
    client on the same deployment, for :meth:`aadd` on the event loop (the admission of a small
    prompt: a thread hop and the GIL hand-offs cost more than the call)."""

    #: safe to call from several threads at once without the caller's lock
    thread_safe = True

    def __init__(
        self, client, ttl_seconds: float, prefix: str = "kvgate:leak:", batch: int = 2000, aclient=None
    ) -> None:
        self.client = client
        self.cluster = is_cluster(client)
        self.ttl_ms = max(1, int(ttl_seconds * 1000))
        self.prefix = prefix
        self.batch = batch
        self._add = client.register_script(_ADD_LUA)
        self._add_if = client.register_script(_ADD_IF_LUA)
        self.aclient = aclient
        self._aadd = aclient.register_script(_ADD_LUA) if aclient is not None else None

    def _key(self, fp: int) -> str:
        return f"{self.prefix}{{{fp >> 58:02x}}}:fp:{fp:016x}"

    def add(self, tenant: str, fps: Iterable[int]) -> None:
        if tenant == PUBLIC:
            raise ValueError("'*' is not a tenant id")
        keys = [self._key(fp) for fp in fps]
        for i in range(0, len(keys), self.batch):
            if self.cluster:
                script_by_slot(self.client, self._add, keys[i : i + self.batch], [tenant, self.ttl_ms])
            else:
                self._add(keys=keys[i : i + self.batch], args=[tenant, self.ttl_ms])

    def add_call(
        self, tenant: str, fps: Iterable[int], guard: tuple[str, str] | None = None
    ) -> tuple[str, list[str], list[Any]]:
        """:meth:`add` of at most ``batch`` fingerprints as one unsent Lua call, ``(sha1, keys,
        args)``, for a caller that sends it with other commands (:class:`verifier.stage.PendingWrite`;
        a server that lost the script answers ``NOSCRIPT``, and :meth:`aadd` loads it). Its keys
        span slots: a Redis Cluster caller leaves it to :meth:`aadd`. ``guard``: ``(hash key,
        field)``: the call writes only if that hash holds that field when it runs, and answers
        ``-1`` when it does not (a write that rides a quota reservation and must follow only an
        admitted one). Raises ``ValueError`` for the public marker or more than ``batch``
        fingerprints."""
        if tenant == PUBLIC:
            raise ValueError("'*' is not a tenant id")
        keys = [self._key(fp) for fp in fps]
        if len(keys) > self.batch:
            raise ValueError(f"{len(keys)} fingerprints: at most {self.batch} in one call")
        if guard is not None:
            return (self._add_if.sha, [guard[0], *keys], [tenant, self.ttl_ms, guard[1]])
        return (self._add.sha, keys, [tenant, self.ttl_ms])

    async def aload_scripts(self) -> None:
        """Load :meth:`add_call`'s scripts (plain and guarded) into Redis through ``aclient``,
        after a ``NOSCRIPT`` answer: calls sent by their SHA-1 alone find them from then on.
        Raises ``RuntimeError`` without an ``aclient``, ``redis.RedisError`` when Redis is down."""
        if self.aclient is None:
            raise RuntimeError("this RedisLeakStore has no asyncio client")
        for script in (_ADD_LUA, _ADD_IF_LUA):
            await self.aclient.script_load(script)

    async def aadd(self, tenant: str, fps: Iterable[int]) -> None:
        """:meth:`add` through ``aclient`` (the same Lua call, awaited on the event loop).
        Raises ``RuntimeError`` when the store has no ``aclient``, ``redis.RedisError`` when
        Redis is down."""
        if self._aadd is None:
            raise RuntimeError("this RedisLeakStore has no asyncio client")
        if tenant == PUBLIC:
            raise ValueError("'*' is not a tenant id")
        keys = [self._key(fp) for fp in fps]
        for i in range(0, len(keys), self.batch):
            if self.cluster:
                await ascript_by_slot(self.aclient, self._aadd, keys[i : i + self.batch], [tenant, self.ttl_ms])
            else:
                await self._aadd(keys=keys[i : i + self.batch], args=[tenant, self.ttl_ms])

    def owners(self, fps: list[int]) -> list[set[str]]:
        """Owners per fingerprint: ``{tenant}``, an empty set, or (public) two placeholder
        owners ``{"*", "**"}`` (callers only count them)."""
        out: list[set[str]] = []
        keys = [self._key(fp) for fp in fps]
        for i in range(0, len(keys), self.batch):
            batch = keys[i : i + self.batch]
            out += map(_owner_set, self.client.mget_nonatomic(batch) if self.cluster else self.client.mget(batch))
        return out

    async def aowners(self, fps: list[int]) -> list[set[str]]:
        """:meth:`owners` through ``aclient`` (one awaited ``MGET`` per ``batch`` keys). Raises
        ``RuntimeError`` when the store has no ``aclient``, ``redis.RedisError`` when Redis is down."""
        if self.aclient is None:
            raise RuntimeError("this RedisLeakStore has no asyncio client")
        out: list[set[str]] = []
        keys = [self._key(fp) for fp in fps]
        for i in range(0, len(keys), self.batch):
            batch = keys[i : i + self.batch]
            got = await (self.aclient.mget_nonatomic(batch) if self.cluster else self.aclient.mget(batch))
            out += map(_owner_set, got)
        return out


def _owner_set(v: bytes | str | None) -> set[str]:
    """One stored owner value as :meth:`RedisLeakStore.owners` reports it."""
    if v is None:
        return set()
    v = v.decode() if isinstance(v, bytes) else v
    return {PUBLIC, PUBLIC * 2} if v == PUBLIC else {v}


_SPREAD_LUA = """
local t, ttl, cap = ARGV[1], ARGV[2], tonumber(ARGV[3])
for i, k in ipairs(KEYS) do
  if redis.call('SCARD', k) < cap then
    redis.call('SADD', k, t)
  end
  redis.call('PEXPIRE', k, ttl)
end
return #KEYS
"""


class RedisSpreadStore:
    """Redis store of *which tenants' answers* held a fingerprint (the public-text rule,
    :class:`LeakIndex`): a set per fingerprint, ``<prefix>fp:<16 hex>``, of at most ``cap``
    tenant ids (more need not be known), its TTL renewed on every add. :meth:`add` is one Lua
    call, :meth:`owners` one pipelined round trip of ``SMEMBERS``. Same protocol, thread safety
    and key tag (``<prefix>{<2 hex>}:fp:<16 hex>``, one script per slot on a Cluster) as
    :class:`RedisLeakStore`."""

    thread_safe = True

    def __init__(self, client, ttl_seconds: float, prefix: str = "kvgate:spread:", cap: int = 3) -> None:
        self.client = client
        self.ttl_ms = max(1, int(ttl_seconds * 1000))
        self.prefix = prefix
        self.cap = cap
        self.cluster = is_cluster(client)
        self._add = client.register_script(_SPREAD_LUA)

    def _key(self, fp: int) -> str:
        return f"{self.prefix}{{{fp >> 58:02x}}}:fp:{fp:016x}"

    def add(self, tenant: str, fps: Iterable[int]) -> None:
        keys = [self._key(fp) for fp in fps]
        if keys and self.cluster:
            script_by_slot(self.client, self._add, keys, [tenant, self.ttl_ms, self.cap])
        elif keys:
            self._add(keys=keys, args=[tenant, self.ttl_ms, self.cap])

    def owners(self, fps: list[int]) -> list[set[str]]:
        if not fps:
            return []
        pipe = self.client.pipeline(transaction=False)
        for fp in fps:
            pipe.smembers(self._key(fp))
        return [{m.decode() if isinstance(m, bytes) else m for m in got} for got in pipe.execute()]


@dataclass
class LeakVerdict:
    """What a lookup found. Counts are of distinct response shingles.

    ``checked``: shingles looked up; ``own``: in the tenant's own prompt or sent by the tenant;
    ``public``: sent by >= 2 tenants, or public text (``public_answers`` of them: found in answers
    to ``public_tenants`` distinct tenants, see :class:`LeakIndex`); ``foreign``: sent by exactly
    one other tenant and not public text (evidence);
    ``foreign_by_tenant``: evidence per source tenant; ``evidence_hashes``: up to 8 of the
    foreign fingerprints as hex (safe to log: keyed hashes, no text)."""

    checked: int = 0
    own: int = 0
    public: int = 0
    public_answers: int = 0
    foreign: int = 0
    foreign_by_tenant: dict[str, int] = field(default_factory=dict)
    evidence_hashes: list[str] = field(default_factory=list)

    def merge(self, other: LeakVerdict) -> None:
        """Add ``other``'s counts (incremental stream checks)."""
        self.checked += other.checked
        self.own += other.own
        self.public += other.public
        self.public_answers += other.public_answers
        self.foreign += other.foreign
        for t, n in other.foreign_by_tenant.items():
            self.foreign_by_tenant[t] = self.foreign_by_tenant.get(t, 0) + n
        room = 8 - len(self.evidence_hashes)
        if room > 0:
            self.evidence_hashes.extend(other.evidence_hashes[:room])

    @property
    def source_tenant(self) -> str | None:
        """The tenant with the most evidence, or ``None``."""
        if not self.foreign_by_tenant:
            return None
        return max(sorted(self.foreign_by_tenant), key=self.foreign_by_tenant.__getitem__)


class LeakIndex:
    """Ingest prompts, check responses. ``hasher`` holds the key and ``k``; ``w`` the window.

    Public text: a shingle of one tenant's prompt that answers to ``public_tenants`` distinct
    other tenants held (``spread``: a :class:`LeakStore` of answer tenants per fingerprint, its
    TTL the public-text window) is text models recite (a licence, a famous poem) and no longer
    evidence, so nobody can prime the index with it and have an honest tenant's answer count
    against an upstream. Each check records the answer's foreign shingles there (unless
    ``record_spread`` is false); the first ``public_tenants`` answers are still reported. No
    ``spread``: the rule is off.

    Not thread-safe by itself; the service serialises calls.
    """

    def __init__(
        self,
        store: LeakStore,
        hasher: ShingleHasher,
        w: int = 35,
        spread: LeakStore | None = None,
        public_tenants: int = 3,
    ) -> None:
        self.store = store
        self.hasher = hasher
        self.w = w
        self.spread = spread
        self.public_tenants = public_tenants

    def prompt_fingerprints(self, text: str) -> set[int]:
        """Winnowed fingerprints of a prompt's text."""
        return self.hasher.fingerprints(encode(fold(text)), self.w)

    def ingest(self, tenant: str, text: str, *, keep_own: bool = False) -> tuple[int, set[int] | None]:
        """Record ``tenant``'s prompt. Returns how many fingerprints were stored and, with
        ``keep_own``, the prompt's own-shingle set (see :meth:`own_shingles`)."""
        ids = encode(fold(text))
        fast = self.hasher.fast(ids)
        fps = self.hasher.fingerprints(ids, self.w, fast)
        self.store.add(tenant, fps)
        return len(fps), (set(fast.tolist()) if keep_own else None)

    def own_shingles(self, text: str) -> set[int]:
        """Selection hashes of every shingle of a prompt (kept in memory by the service for the
        life of one response, never stored): a response quoting its own prompt is never evidence."""
        return set(self.hasher.fast(encode(fold(text))).tolist())

    def check_ids(
        self,
        tenant: str,
        ids: list[int],
        own: set[int] | frozenset[int] = frozenset(),
        seen: set[int] | None = None,
        *,
        record_spread: bool = True,
    ) -> LeakVerdict:
        """Classify the shingles of response token ids (see :class:`LeakVerdict`). ``own``: the
        own prompt's :meth:`own_shingles`; ``seen``: shingles already checked for this response
        (updated in place, so a stream's repeats are not counted twice); ``record_spread``: add
        this answer's foreign shingles to the public-text count (false for answers whose own text
        is not fully known, such as echoes)."""
        v, hashes = self.prepare_ids(ids, own, seen)
        if hashes:
            self.classify(v, tenant, hashes, record_spread)
        return v

    def prepare_ids(
        self, ids: list[int], own: set[int] | frozenset[int] = frozenset(), seen: set[int] | None = None
    ) -> tuple[LeakVerdict, list[int]]:
        """:meth:`check_ids` up to its store call (CPU only): the verdict so far (checked, own)
        and the fingerprints still to look up, for :meth:`classify`."""
        v = LeakVerdict()
        todo = self._new_shingles(v, ids, own, seen)
        return v, (self.hasher.hashes_at(ids, todo) if todo else [])

    def classify(
        self,
        v: LeakVerdict,
        tenant: str,
        hashes: list[int],
        record_spread: bool = True,
        owners: list[set[str]] | None = None,
    ) -> None:
        """The rest of :meth:`check_ids`: count ``hashes`` (from :meth:`prepare_ids`) into ``v``
        by their owners; ``owners``: the store's answer for ``hashes`` (same order) when the
        caller already looked them up, else one store lookup here."""
        self._classify_stored(v, tenant, hashes, record_spread, owners)

    def _new_shingles(
        self, v: LeakVerdict, ids: list[int], own: set[int] | frozenset[int], seen: set[int] | None
    ) -> list[int]:
        """Positions of the shingles of ``ids`` to look up: each distinct one not in ``seen``
        (updated) and not the tenant's own prompt's (``own``: counted in ``v.own``)."""
        todo: list[int] = []
        local: set[int] = set()
        for i, f in enumerate(self.hasher.fast(ids).tolist()):
            if f in local or (seen is not None and f in seen):
                continue
            local.add(f)
            v.checked += 1
            if f in own:
                v.own += 1
            else:
                todo.append(i)
        if seen is not None:
            seen |= local
        return todo

    def _classify_stored(
        self, v: LeakVerdict, tenant: str, hashes: list[int], record_spread: bool, looked_up: list[set[str]] | None
    ) -> None:
        """Count the fingerprints ``hashes`` by who sent them (the store's owners, or
        ``looked_up``): the tenant itself (own), two or more tenants (public) or one other tenant
        (:meth:`_classify_foreign`)."""
        foreign: list[tuple[int, str]] = []
        stored = self.store.owners(hashes) if looked_up is None else looked_up
        for h, owners in zip(hashes, stored, strict=True):
            if not owners:
                continue
            if tenant in owners:
                v.own += 1
            elif len(owners) >= 2:
                v.public += 1
            else:
                foreign.append((h, next(iter(owners))))
        if foreign:
            self._classify_foreign(v, tenant, foreign, record_spread)

    def _classify_foreign(self, v: LeakVerdict, tenant: str, foreign: list[tuple[int, str]], record: bool) -> None:
        """Count ``foreign`` (``(fingerprint, source tenant)``) as evidence or, when answers to
        ``public_tenants`` distinct other tenants held it, as public text; record this answer."""
        fps = [h for h, _ in foreign]
        spread = self.spread.owners(fps) if self.spread is not None else [set()] * len(fps)
        for (h, src), answered in zip(foreign, spread, strict=True):
            if len(answered - {tenant}) >= self.public_tenants:
                v.public += 1
                v.public_answers += 1
                continue
            v.foreign += 1
            v.foreign_by_tenant[src] = v.foreign_by_tenant.get(src, 0) + 1
            if len(v.evidence_hashes) < 8:
                v.evidence_hashes.append(f"{h:016x}")
        if record and self.spread is not None:
            self.spread.add(tenant, fps)

    def check_text(self, tenant: str, text: str, own: set[int] | frozenset[int] = frozenset()) -> LeakVerdict:
        """Check a whole response's text."""
        return self.check_ids(tenant, encode(fold(text)), own)
