"""The one place a Redis client is made from ``redis_url``, and the one store back-off.

Quotas (``gateway.quotas.tenant_quotas``), the leak index, the canary registry and quarantine (``verifier``)
and the ``kvgate upstream`` CLI all call :func:`redis_client`, so every mode works the same
everywhere:

- ``redis://``, ``rediss://`` (TLS), ``unix://``: one server (redis-py's ``from_url``);
- ``redis+sentinel://`` / ``rediss+sentinel://``: the master a Sentinel group names
  (``redis.sentinel.Sentinel`` / ``redis.asyncio.sentinel.Sentinel``);
- ``redis+cluster://HOST:PORT[,HOST:PORT...]`` / ``rediss+cluster://``: Redis Cluster
  (``redis.cluster.RedisCluster`` / ``redis.asyncio.cluster.RedisCluster``). Every Lua script
  then touches one hash slot (keys carry a ``{tag}``) and multi-key reads are grouped by slot.

TLS options ride in the query string of every scheme: ``ssl_ca_certs`` (a PEM file of the CAs to
trust), ``ssl_certfile`` / ``ssl_keyfile`` (a client certificate), ``ssl_cert_reqs``
(``required``, the default, ``optional`` or ``none``) and ``ssl_check_hostname`` (``true`` /
``false``). On ``rediss+sentinel://`` they apply to the sentinels as well as to the master (the
sentinels of a TLS deployment listen on ``tls-port`` only); ``sentinel_ssl=false`` keeps plaintext
sentinels in front of a TLS master. See docs/quotas.md, "Redis URLs".
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import SplitResult, parse_qs, unquote, urlsplit

#: scheme -> (mode, TLS)
SCHEMES: dict[str, tuple[str, bool]] = {
    "redis": ("standalone", False),
    "rediss": ("standalone", True),
    "unix": ("standalone", False),
    "redis+sentinel": ("sentinel", False),
    "rediss+sentinel": ("sentinel", True),
    "redis+cluster": ("cluster", False),
    "rediss+cluster": ("cluster", True),
}
#: query parameters passed to the connections as TLS options (the standalone schemes pass
#: every query parameter to redis-py's ``from_url`` as it is)
TLS_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs", "ssl_check_hostname")
DEFAULT_PORTS = {"sentinel": 26379, "cluster": 6379}
#: query parameters only a Sentinel URL takes (redis-py's clients of the other modes refuse them
#: with a ``TypeError`` at their first connection)
SENTINEL_OPTIONS = ("sentinel_password", "sentinel_ssl")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclass(frozen=True)
class RedisTarget:
    """A parsed ``redis_url``. ``mode``: ``standalone`` | ``sentinel`` | ``cluster``; ``hosts``:
    the sentinels or the cluster's startup nodes (empty for standalone); ``service``: the
    Sentinel service name; ``options``: TLS options, ``sentinel_password`` and ``sentinel_ssl``
    (a bool; absent: the sentinels speak TLS exactly when the master does) from the query."""

    mode: str
    tls: bool
    hosts: tuple[tuple[str, int], ...] = ()
    service: str | None = None
    db: int = 0
    username: str | None = None
    password: str | None = None
    options: dict[str, Any] = field(default_factory=dict)


def _hosts(hostlist: str, default_port: int) -> tuple[tuple[str, int], ...]:
    out: list[tuple[str, int]] = []
    for item in filter(None, hostlist.split(",")):
        host, sep, port = item.rpartition(":") if not item.endswith("]") else (item, "", "")
        if not sep:
            host, port = item, str(default_port)
        try:
            out.append((host.strip("[]"), int(port)))
        except ValueError:
            raise ValueError(f"redis URL: bad port in '{item}'") from None
    return tuple(out)


def _flag(name: str, value: str) -> bool:
    """A boolean query parameter. Raises ``ValueError`` for anything but 1/0, true/false, yes/no,
    on/off (a typo must not turn a TLS check off or on unnoticed)."""
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise ValueError(f"redis URL: {name} must be true or false, not '{value}'")


def _options(query: str) -> dict[str, Any]:
    raw = {k: v[0] for k, v in parse_qs(query).items()}
    opts: dict[str, Any] = {k: raw[k] for k in TLS_OPTIONS + SENTINEL_OPTIONS if k in raw}
    for name in ("ssl_check_hostname", "sentinel_ssl"):
        if name in opts:
            opts[name] = _flag(name, opts[name])
    return opts


def _tls_options(options: dict[str, Any]) -> dict[str, Any]:
    """The TLS options of ``options`` (a :class:`RedisTarget`'s), as connection keywords."""
    return {k: options[k] for k in TLS_OPTIONS if k in options}


def _check_sentinel_options(mode: str, tls: bool, query: str) -> None:
    """Refuse a ``sentinel_*`` query parameter on a URL of another mode (redis-py's clients for
    those raise ``TypeError`` at their first connection), and ``sentinel_ssl=true`` on
    ``redis+sentinel://`` (it would leave the master in plaintext)."""
    given = parse_qs(query)
    if mode != "sentinel":
        stray = [k for k in SENTINEL_OPTIONS if k in given]
        if stray:
            raise ValueError(f"redis URL: {', '.join(stray)} applies to redis+sentinel:// and rediss+sentinel:// only")
    elif not tls and _flag("sentinel_ssl", given.get("sentinel_ssl", ["false"])[0]):
        raise ValueError("sentinel URL: sentinel_ssl=true needs rediss+sentinel:// (TLS to the master too)")


def _is_db(s: str) -> bool:
    return s.isascii() and s.isdigit() and len(s) <= 9


def _check_standalone(parts: SplitResult) -> None:
    """A ``redis://`` or ``rediss://`` URL's port and database (``parse_redis_url``)."""
    try:
        port = parts.port
    except ValueError:  # outside 0-65535, or no number
        port = 0
    if port == 0:
        raise ValueError("redis URL: the port is not a number from 1 to 65535")
    db = parts.path.strip("/")
    if db and not _is_db(db):
        raise ValueError(f"redis URL: '{parts.path}' is not a database number (redis://host:6379/0; 0-15 by default)")


def _sentinel_db(path: list[str]) -> int:
    """The database of a sentinel URL's path segments after the service name (0 when none)."""
    if len(path) > 2 or (len(path) == 2 and not _is_db(path[1])):
        raise ValueError(f"sentinel URL: '/{'/'.join(path[1:])}' is not a database number (0-15 by default)")
    return int(path[1]) if len(path) > 1 else 0


def parse_redis_url(url: str) -> RedisTarget:
    """Parse ``url`` (any scheme of :data:`SCHEMES`). Raises ``ValueError`` for an unknown
    scheme, a ``redis://`` or ``rediss://`` URL whose port is not 1-65535 or whose path is not
    one database number (redis-py reads ``/abc`` or ``/1O`` as database 0, silently sharing it),
    a sentinel URL without hosts or service name or with a database that is no number, a
    cluster URL without hosts or with a database other than 0, a bad port, an
    ``ssl_check_hostname`` or ``sentinel_ssl`` that is no boolean, ``sentinel_ssl=true`` on
    ``redis+sentinel://``, or a ``sentinel_*`` parameter on a URL of another mode."""
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise ValueError(f"redis URL: unknown scheme '{parts.scheme}://' (one of: {', '.join(SCHEMES)})")
    mode, tls = SCHEMES[parts.scheme]
    _check_sentinel_options(mode, tls, parts.query)
    if mode == "standalone":
        if parts.scheme != "unix":
            _check_standalone(parts)
        return RedisTarget(mode, tls)
    userinfo, _, hostlist = parts.netloc.rpartition("@")
    username = password = None
    if userinfo:
        user, _, pw = userinfo.partition(":")
        username, password = unquote(user) or None, unquote(pw) or None
    hosts = _hosts(hostlist, DEFAULT_PORTS[mode])
    path = [p for p in parts.path.split("/") if p]
    opts = _options(parts.query)
    if mode == "sentinel":
        if not hosts or not path:
            raise ValueError(
                "sentinel URL needs hosts and a service name: redis+sentinel://host:26379[,host:26379]/service_name[/db]"
            )
        return RedisTarget(mode, tls, hosts, path[0], _sentinel_db(path), username, password, opts)
    if not hosts:
        raise ValueError("cluster URL needs at least one node: redis+cluster://host:6379[,host:6379...]")
    if path and path != ["0"]:
        raise ValueError("cluster URL: Redis Cluster has only database 0")
    return RedisTarget(mode, tls, hosts, None, 0, username, password, opts)


def _bounded(timeout_seconds: float, *, sync: bool, retries: int = 0) -> dict[str, Any]:
    """Connection options: every connect and read bounded by ``timeout_seconds``, ``retries``
    client retries without back-off (the caller's policy decides), no health-check pings."""
    from redis.backoff import NoBackoff

    if sync:
        from redis.retry import Retry
    else:
        from redis.asyncio.retry import Retry  # type: ignore[assignment]
    return dict(
        socket_timeout=timeout_seconds,
        socket_connect_timeout=timeout_seconds,
        retry=Retry(NoBackoff(), retries),
        health_check_interval=0,
    )


def redis_client(url: str, timeout_seconds: float, *, sync: bool = False) -> Any:
    """A client for ``url``: ``redis.asyncio`` (default) or, with ``sync``, the synchronous
    redis-py client of the same kind (``Redis``, a Sentinel's ``master_for``, ``RedisCluster``).
    Every connect and read is bounded by ``timeout_seconds``; standalone and Sentinel clients
    never retry (the caller's failure policy decides). A cluster client retries once, within
    the same bound per try, so that a ``MOVED`` after a failover or a connection to a node that
    has gone reloads the slot map and reaches the new owner. Raises ``ValueError`` for a
    malformed URL (:func:`parse_redis_url`)."""
    target = parse_redis_url(url)
    if target.mode == "cluster":
        return _cluster(target, timeout_seconds, sync)
    opts = _bounded(timeout_seconds, sync=sync)
    if target.mode == "standalone":
        if sync:
            from redis import Redis
        else:
            from redis.asyncio import Redis  # type: ignore[assignment]
        return Redis.from_url(url, **opts)
    return _sentinel_master(target, opts, timeout_seconds, sync)


def _sentinel_kwargs(target: RedisTarget, timeout_seconds: float) -> dict[str, Any]:
    """The connection options of the sentinel clients: bounded by ``timeout_seconds``, the
    ``sentinel_password``, and on ``rediss+sentinel://`` (unless ``sentinel_ssl=false``) TLS with
    the URL's TLS options. redis-py gives the sentinels these and nothing of the master's options
    (``redis.sentinel.Sentinel``: ``Redis(host, port, **sentinel_kwargs)``); it adds a ``Retry``
    of 0 retries, as master discovery moves on to the next sentinel."""
    kwargs: dict[str, Any] = dict(socket_timeout=timeout_seconds, socket_connect_timeout=timeout_seconds)
    if "sentinel_password" in target.options:
        kwargs["password"] = target.options["sentinel_password"]
    if target.options.get("sentinel_ssl", target.tls):
        kwargs.update(ssl=True, **_tls_options(target.options))
    return kwargs


def _sentinel_master(target: RedisTarget, opts: dict[str, Any], timeout_seconds: float, sync: bool) -> Any:
    """The master client of a sentinel URL. With TLS (``ssl=True``) redis-py's
    ``SentinelConnectionPool`` connects to the master the sentinels name through
    ``SentinelManagedSSLConnection``, with the URL's TLS options."""
    if sync:
        from redis.sentinel import Sentinel
    else:
        from redis.asyncio.sentinel import Sentinel  # type: ignore[assignment]
    sentinel = Sentinel(list(target.hosts), sentinel_kwargs=_sentinel_kwargs(target, timeout_seconds), **opts)
    tls: dict[str, Any] = dict(ssl=True, **_tls_options(target.options)) if target.tls else {}
    assert target.service is not None, "parse_redis_url refuses a sentinel URL without a service name"
    return sentinel.master_for(
        target.service, db=target.db, username=target.username, password=target.password, **opts, **tls
    )


def _cluster(target: RedisTarget, timeout_seconds: float, sync: bool) -> Any:
    if sync:
        from redis.cluster import ClusterNode, RedisCluster
    else:
        from redis.asyncio.cluster import ClusterNode, RedisCluster  # type: ignore[assignment]
    opts = _bounded(timeout_seconds, sync=sync, retries=1)
    tls: dict[str, Any] = dict(ssl=True, **_tls_options(target.options)) if target.tls else {}

    def make() -> Any:
        return RedisCluster(
            startup_nodes=[ClusterNode(h, p) for h, p in target.hosts],
            username=target.username,
            password=target.password,
            **opts,
            **tls,
        )

    return LazyCluster(make) if sync else make()


class LazyCluster:
    """A synchronous ``RedisCluster`` made on its first command. redis-py's constructor reads
    the slot map at once and raises when no node answers; a gateway must start (its verifier
    failing open) while the cluster is away, as it does with one server. ``register_script``
    needs no connection. A failed first read raises ``redis.ConnectionError``; the next command
    tries again. Thread-safe."""

    def __init__(self, make: Any) -> None:
        self._make = make
        self._client: Any = None
        self._lock = threading.Lock()

    def real(self) -> Any:
        """The ``RedisCluster`` (made now if it was not). Raises ``redis.ConnectionError``."""
        if self._client is None:
            from redis.exceptions import ConnectionError as RedisConnectionError
            from redis.exceptions import RedisClusterException

            with self._lock:
                if self._client is None:
                    try:
                        self._client = self._make()
                    except RedisClusterException as e:
                        raise RedisConnectionError(str(e)) from e
        return self._client

    def register_script(self, script: str) -> Any:
        from redis.commands.core import Script

        return Script(self, script)  # type: ignore[arg-type]

    def get_encoder(self) -> Any:
        """The default encoder (utf-8), as a cluster client made by :func:`redis_client` has."""
        from redis import Redis

        return Redis().get_encoder()

    def close(self) -> None:
        if self._client is not None:
            self._client.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real(), name)


def is_cluster(client: Any) -> bool:
    """Whether ``client`` is a redis-py cluster client (sync or asyncio)."""
    from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
    from redis.cluster import RedisCluster

    return isinstance(client, (RedisCluster, AsyncRedisCluster, LazyCluster))


def key_slot(key: str) -> int:
    """The Redis Cluster hash slot of ``key`` (its ``{tag}`` when it has one)."""
    from redis.crc import key_slot as _slot

    return int(_slot(key.encode()))


def store_errors() -> tuple[type[Exception], ...]:
    """What a failing Redis store raises: redis-py's errors, a cluster with no node answering
    (``RedisClusterException``, not a ``RedisError``) and the socket's own ``OSError``. These back
    a store off; anything else a store's caller meets is a fault of its own, not an outage."""
    from redis.exceptions import RedisClusterException, RedisError

    return (RedisError, RedisClusterException, OSError)


class StoreBackoff:
    """After a store error, callers skip the store for ``interval_seconds``; the first call after
    that tries it again, so a store that answers again is used again by itself. One instance per
    store user (the quota stage: 0.5 s; the verifier's leak index: 5 s). ``clock``: seconds.

    ``scope``: which part of the store failed; ``None`` (the default) is the whole store. On a
    Redis Cluster the quota stage passes the tenant's hash slot, so a master that fails over
    costs only the tenants of its slots, not every tenant of the process."""

    def __init__(self, interval_seconds: float, clock: Any = None) -> None:
        self.interval_seconds = interval_seconds
        self.clock = clock or (lambda: time.monotonic())
        #: scope -> ``clock()`` time until which it is skipped (failed scopes, until they succeed)
        self._down: dict[Any, float] = {}

    @property
    def down(self) -> bool:
        """Whether some scope's last call failed."""
        return bool(self._down)

    def down_until(self, scope: Any = None) -> float:
        """``clock()`` time until which ``scope`` is skipped (0 when it is up)."""
        return max(self._down.get(scope, 0.0), self._down.get(None, 0.0))

    def failed(self, scope: Any = None) -> bool:
        """A call failed: skip ``scope`` for the interval. Returns whether every scope was up
        before (the caller logs the outage once)."""
        was_up = not self._down
        self._down[scope] = self.clock() + self.interval_seconds
        return was_up

    def succeeded(self, scope: Any = None) -> bool:
        """A call on ``scope`` succeeded (a call on the whole store clears every scope). Returns
        whether that ended the last outage (the caller logs the recovery once)."""
        if not self._down:
            return False
        if scope is None:
            self._down.clear()
        else:
            self._down.pop(scope, None)
        return not self._down

    def usable(self, scope: Any = None) -> bool:
        """Whether ``scope`` may be called now (neither it nor the whole store is backing off)."""
        return self.clock() >= self.down_until(scope)


def by_slot(keys: list[str]) -> list[list[str]]:
    """``keys`` grouped by hash slot (first-seen order), for one script or ``MGET`` per slot."""
    groups: dict[int, list[str]] = {}
    for k in keys:
        groups.setdefault(key_slot(k), []).append(k)
    return list(groups.values())


def _script_failures(results: list[Any], groups: list[list[str]]) -> tuple[list[list[str]], Exception | None]:
    """The groups refused with ``NOSCRIPT`` (to load and run again), and the first other error."""
    from redis.exceptions import NoScriptError

    again = [g for g, r in zip(groups, results, strict=True) if isinstance(r, NoScriptError)]
    other = next((r for r in results if isinstance(r, Exception) and not isinstance(r, NoScriptError)), None)
    return again, other


def script_by_slot(client: Any, script: Any, keys: list[str], args: list[Any]) -> None:
    """Run the registered ``script`` (a redis-py ``Script`` of the synchronous cluster
    ``client``) once per hash slot of ``keys``, the calls in one cluster pipeline (a round trip
    per node); a node that lost the script gets it loaded and the call once more. Raises the
    first ``redis.RedisError``."""
    groups = by_slot(keys)
    for _ in range(2):
        pipe = client.pipeline()
        for g in groups:  # the sync cluster pipeline blocks its evalsha() helper, not the command
            pipe.execute_command("EVALSHA", script.sha, len(g), *g, *args)
        again, other = _script_failures(list(pipe.execute(raise_on_error=False)), groups)
        if other is not None:
            raise other
        if not again:
            return
        client.script_load(script.script)
        groups = again
    raise RuntimeError("script still unknown to a node after loading it")


async def ascript_by_slot(client: Any, script: Any, keys: list[str], args: list[Any]) -> None:
    """:func:`script_by_slot` for a ``redis.asyncio`` cluster client (nodes in parallel)."""
    groups = by_slot(keys)
    for _ in range(2):
        pipe = client.pipeline()
        for g in groups:  # as in script_by_slot: the command, not the blocked helper
            pipe.execute_command("EVALSHA", script.sha, len(g), *g, *args)
        again, other = _script_failures(list(await pipe.execute(raise_on_error=False)), groups)
        if other is not None:
            raise other
        if not again:
            return
        await client.script_load(script.script)
        groups = again
    raise RuntimeError("script still unknown to a node after loading it")
