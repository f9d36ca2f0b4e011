"""``rediss+sentinel://`` against real servers whose TLS is on both sides of the lookup: a
``redis-server --port 0 --tls-port P`` master and a sentinel that listens on ``tls-port`` only
(``port 0``, ``tls-replication yes``: the layout of a TLS Sentinel deployment, e.g. Bitnami's
chart), both with a certificate for 127.0.0.1 signed by a CA made here with ``openssl``. The
client :func:`config.redis_client.redis_client` makes from the URL asks the sentinel over TLS for
the master, then speaks TLS to the master, sync and asyncio alike; a URL trusting another CA,
or a plaintext ``redis+sentinel://``, finds no master. A second sentinel that listens in
plaintext (in front of the same TLS master) is reached with ``sentinel_ssl=false``.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio.sentinel
import redis.sentinel
from redis_servers import NoTls, TlsRedis, _kill, _server, free_ports, no_tls_reason, other_ca, started_tls, wait_until

from config.redis_client import parse_redis_url, redis_client

pytestmark = pytest.mark.timeout(60)

SERVICE = "mymaster"
PLAIN_SERVICE = "plainmaster"  # the same master, as the plaintext sentinel names it
SCRIPT = "redis.call('SET', KEYS[1], ARGV[1]); return redis.call('STRLEN', KEYS[1])"


class TlsSentinel(TlsRedis):
    """A TLS-only master, a TLS-only sentinel watching it as :data:`SERVICE` and a plaintext
    sentinel watching it as :data:`PLAIN_SERVICE` (quorum 1; both reach the master over TLS)."""

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir)
        self.port, self.tls_sentinel, self.plain_sentinel = free_ports(3)
        self.procs: list[Any] = []

    def _tls_conf(self) -> str:
        d = self.workdir
        return (
            f"tls-cert-file {d / 'server.pem'}\ntls-key-file {d / 'server.key'}\n"
            f"tls-ca-cert-file {self.ca}\ntls-auth-clients no\ntls-replication yes\n"
        )

    def _start(self, name: str, conf: str, *args: str) -> None:
        path = self.workdir / f"{name}.conf"
        path.write_text(f"bind 127.0.0.1\ndir {self.workdir}\n{self._tls_conf()}{conf}")
        self.procs.append(_server([str(path), *args], self.workdir / f"{name}.log"))

    def _exited(self) -> None:
        """Raise for a server that exited: ``NoTls`` when its log says it knows no TLS directive."""
        for proc, name in zip(self.procs, ("master", "sentinel-tls", "sentinel-plain"), strict=True):
            if proc.poll() is not None:
                log = self.workdir / f"{name}.log"
                why = no_tls_reason(log)
                if why:
                    raise NoTls(why)
                raise RuntimeError(f"{name} exited {proc.returncode}: {log.read_text(errors='replace')[-2000:]}")

    def start(self) -> None:
        self._certs()
        self._start("master", f"port 0\ntls-port {self.port}\nsave ''\nappendonly no\n")
        # one name per sentinel: each ignores the other's hello messages, and so never dials it
        monitor = f"sentinel monitor {{}} 127.0.0.1 {self.port} 1\n"
        self._start("sentinel-tls", f"port 0\ntls-port {self.tls_sentinel}\n" + monitor.format(SERVICE), "--sentinel")
        self._start("sentinel-plain", f"port {self.plain_sentinel}\n" + monitor.format(PLAIN_SERVICE), "--sentinel")
        up = wait_until(lambda: any(p.poll() is not None for p in self.procs) or self.ready(), 15, 0.1)
        self._exited()
        if not up:
            raise RuntimeError("TLS sentinel group not ready in 15 s")

    def _sentinel(self, port: int, tls: bool) -> redis.Redis:
        return redis.Redis(
            host="127.0.0.1", port=port, ssl=tls, ssl_ca_certs=str(self.ca) if tls else None, socket_timeout=1
        )

    def ready(self) -> bool:
        """Both sentinels name the master, up (no ``s_down``)."""
        try:
            for port, tls, name in ((self.tls_sentinel, True, SERVICE), (self.plain_sentinel, False, PLAIN_SERVICE)):
                with self._sentinel(port, tls) as s:
                    m = s.sentinel_master(name)
                    if not m["is_master"] or m["is_sdown"] or int(m["port"]) != self.port:
                        return False
            return True
        except (redis.RedisError, OSError, KeyError):
            return False

    def url(self, query: str = "", scheme: str = "rediss+sentinel", plain_sentinel: bool = False) -> str:
        """A URL of the TLS sentinel (or, with ``plain_sentinel``, of the plaintext one)."""
        port, name = (self.plain_sentinel, PLAIN_SERVICE) if plain_sentinel else (self.tls_sentinel, SERVICE)
        return f"{scheme}://127.0.0.1:{port}/{name}{query}"

    def close(self) -> None:
        for proc in self.procs:
            _kill(proc)


@pytest.fixture(scope="module")
def group(tmp_path_factory) -> Iterator[TlsSentinel]:
    yield from started_tls(lambda: TlsSentinel(tmp_path_factory.mktemp("tls-sentinel")))


def _sync_round(url: str, timeout: float = 2.0) -> list[Any]:
    """SET, GET, SCRIPT LOAD and EVALSHA through the sync client of ``url``, and the master's
    address as its pool resolved it."""
    c = redis_client(url, timeout, sync=True)
    try:
        sha = c.script_load(SCRIPT)
        out = [c.set("k", "v"), c.get("k"), sha, c.evalsha(sha, 1, "k", "hello"), c.get("k")]
        return [*out, c.connection_pool.get_master_address()]
    finally:
        c.close()


def _async_round(url: str, timeout: float = 2.0) -> list[Any]:
    """:func:`_sync_round` through the ``redis.asyncio`` client of ``url``."""

    async def run() -> list[Any]:
        c = redis_client(url, timeout)
        try:
            sha = await c.script_load(SCRIPT)
            out = [await c.set("k", "v"), await c.get("k"), sha, await c.evalsha(sha, 1, "k", "hello")]
            return [*out, await c.get("k"), await c.connection_pool.get_master_address()]
        finally:
            await c.aclose()

    return asyncio.run(run())


def _sync_error(url: str, timeout: float = 2.0) -> BaseException:
    c = redis_client(url, timeout, sync=True)
    try:
        with pytest.raises(Exception) as e:
            c.ping()
        return e.value
    finally:
        c.close()


def _async_error(url: str, timeout: float = 2.0) -> BaseException:
    async def run() -> BaseException:
        c = redis_client(url, timeout)
        try:
            with pytest.raises(Exception) as e:
                await c.ping()
            return e.value
        finally:
            await c.aclose()

    return asyncio.run(run())


def _expected(group: TlsSentinel) -> list[Any]:
    sha = hashlib.sha1(SCRIPT.encode()).hexdigest()
    return [True, b"v", sha, 5, b"hello", ("127.0.0.1", group.port)]


def test_sync_client_asks_a_tls_only_sentinel_and_speaks_tls_to_the_master(group: TlsSentinel) -> None:
    assert _sync_round(group.url(f"?ssl_ca_certs={group.ca}")) == _expected(group)


def test_asyncio_client_asks_a_tls_only_sentinel_and_speaks_tls_to_the_master(group: TlsSentinel) -> None:
    assert _async_round(group.url(f"?ssl_ca_certs={group.ca}")) == _expected(group)


def test_a_ca_that_signed_nothing_finds_no_master(group: TlsSentinel, tmp_path: Path) -> None:
    url = group.url(f"?ssl_ca_certs={other_ca(tmp_path)}")
    sync_err, async_err = _sync_error(url), _async_error(url)
    assert type(sync_err) is redis.sentinel.MasterNotFoundError
    assert type(async_err) is redis.asyncio.sentinel.MasterNotFoundError
    for err in (sync_err, async_err):
        assert str(err).startswith("No master found for 'mymaster' : "), err
        want = (
            f"connecting to 127.0.0.1:{group.tls_sentinel}. [SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed"
        )
        assert want in str(err), err


def test_plaintext_redis_sentinel_url_is_refused_by_a_tls_only_sentinel(group: TlsSentinel) -> None:
    url = group.url(scheme="redis+sentinel")
    sync_err, async_err = _sync_error(url), _async_error(url)
    assert type(sync_err) is redis.sentinel.MasterNotFoundError
    assert type(async_err) is redis.asyncio.sentinel.MasterNotFoundError
    for err in (sync_err, async_err):
        # the sentinel's handshake reads the command as a bad TLS record and drops the connection
        assert str(err).endswith(
            f"Error while reading from 127.0.0.1:{group.tls_sentinel} : (104, 'Connection reset by peer')"
        )


def test_sentinel_ssl_false_keeps_plaintext_sentinels_in_front_of_a_tls_master(group: TlsSentinel) -> None:
    url = group.url(f"?ssl_ca_certs={group.ca}&sentinel_ssl=false", plain_sentinel=True)
    assert _sync_round(url) == _async_round(url) == _expected(group)
    # without it the client opens a TLS handshake the plaintext sentinel never answers: each
    # sentinel costs the connect bound, then no master
    url = group.url(f"?ssl_ca_certs={group.ca}", plain_sentinel=True)
    sync_err, async_err = _sync_error(url, 0.3), _async_error(url, 0.3)
    assert type(sync_err) is redis.sentinel.MasterNotFoundError
    assert type(async_err) is redis.asyncio.sentinel.MasterNotFoundError
    for err in (sync_err, async_err):
        assert str(err).startswith("No master found for 'plainmaster' : "), err
        assert str(err).endswith("network:TimeoutError: Timeout connecting to server"), err


def _sentinel_pool(client: Any) -> Any:
    """The connection pool of ``client``'s (first) sentinel."""
    return client.connection_pool.sentinel_manager.sentinels[0].connection_pool


@pytest.mark.parametrize("sync", [True, False])
def test_the_sentinels_get_the_tls_options_unless_sentinel_ssl_is_false(sync: bool) -> None:
    """No server: the options each client is made with."""
    import redis.asyncio.connection
    import redis.connection

    ssl_cls = redis.connection.SSLConnection if sync else redis.asyncio.connection.SSLConnection
    plain_cls = redis.connection.Connection if sync else redis.asyncio.connection.Connection
    query = "?ssl_ca_certs=/ca.pem&ssl_cert_reqs=optional&ssl_check_hostname=off&sentinel_password=sp"
    base = "rediss+sentinel://:pw@127.0.0.1:26380/svc"
    keys = ("ssl_ca_certs", "ssl_cert_reqs", "ssl_check_hostname", "password", "socket_timeout")
    tls = _sentinel_pool(redis_client(base + query, 0.4, sync=sync))
    assert tls.connection_class is ssl_cls
    assert [tls.connection_kwargs.get(k) for k in keys] == ["/ca.pem", "optional", False, "sp", 0.4]
    master = redis_client(base + query + "&sentinel_ssl=no", 0.4, sync=sync)
    plain = _sentinel_pool(master)
    assert plain.connection_class is plain_cls
    assert [plain.connection_kwargs.get(k) for k in keys] == [None, None, None, "sp", 0.4]
    assert master.connection_pool.connection_class.__name__ == "SentinelManagedSSLConnection"
    assert [master.connection_pool.connection_kwargs.get(k) for k in keys] == ["/ca.pem", "optional", False, "pw", 0.4]
    insecure = _sentinel_pool(redis_client("redis+sentinel://127.0.0.1/svc?sentinel_ssl=false", 0.4, sync=sync))
    assert insecure.connection_class is plain_cls


def test_sentinel_ssl_parses_as_a_boolean() -> None:
    assert parse_redis_url("rediss+sentinel://h/s?sentinel_ssl=FALSE").options == {"sentinel_ssl": False}
    assert parse_redis_url("rediss+sentinel://h/s?sentinel_ssl=1").options == {"sentinel_ssl": True}
    assert parse_redis_url("rediss+sentinel://h/s").options == {}


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("rediss+sentinel://h/s?sentinel_ssl=flase", "redis URL: sentinel_ssl must be true or false, not 'flase'"),
        # was read as false: a typo turned the hostname check off
        ("rediss+sentinel://h/s?ssl_check_hostname=ture", "ssl_check_hostname must be true or false, not 'ture'"),
        ("rediss+cluster://h:7000?ssl_check_hostname=ture", "ssl_check_hostname must be true or false, not 'ture'"),
        # TLS to the sentinels, plaintext to the master: refused rather than half done
        ("redis+sentinel://h/s?sentinel_ssl=true", r"sentinel_ssl=true needs rediss\+sentinel://"),
        # redis-py's clients of the other modes raised TypeError at their first connection
        ("rediss://h:6380/0?sentinel_ssl=false", r"sentinel_ssl applies to redis\+sentinel:// and rediss"),
        ("rediss+cluster://h:7000?sentinel_password=x", r"sentinel_password applies to redis\+sentinel://"),
    ],
)
def test_bad_sentinel_and_tls_flags_are_refused(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        redis_client(url, 0.25)
