"""The quota store's hiredis packing (gateway/quotas/packing.py) puts the same bytes on the wire
as redis-py's own asyncio connection, and leaves what it does not pack to redis-py."""

from __future__ import annotations

import pytest
from redis.asyncio.connection import Connection, UnixDomainSocketConnection
from redis.exceptions import DataError

from gateway.quotas.packing import hiredis_packing, pack_with_hiredis
from gateway.quotas.tenant_quotas import redis_client_from_url

COMMANDS = [
    ("EVALSHA", "0" * 40, 5, "kvgate:q:{t}:rpm", "kvgate:q:{t}:tpm", "lease", -1, 10**12, 0),
    ("EVALSHA", "ab", 1, "k:{tenant é}", b"\x00\xff raw", 3),
    ("SET", b"key", "x" * 7000),  # above redis-py's buffer cutoff
    ("PING",),
    ("CONFIG GET", "maxmemory"),  # a command name with a space: redis-py splits it
    ("SET", "k", 1.5),  # a float: redis-py's packing
]


@pytest.mark.parametrize("args", COMMANDS)
def test_same_bytes_as_redis_py(args: tuple) -> None:
    fast = hiredis_packing(Connection)()
    assert b"".join(fast.pack_command(*args)) == b"".join(Connection().pack_command(*args))


def test_pipelines_pack_the_same() -> None:
    fast = hiredis_packing(Connection)()
    assert b"".join(fast.pack_commands(COMMANDS)) == b"".join(Connection().pack_commands(COMMANDS))


def test_a_bool_is_refused_as_redis_py_refuses_it() -> None:
    with pytest.raises(DataError):
        hiredis_packing(Connection)().pack_command("SET", "k", True)


def test_another_encoding_is_left_to_redis_py() -> None:
    fast = hiredis_packing(Connection)(encoding="latin-1")
    assert fast.pack_command("SET", "k", "é") == Connection(encoding="latin-1").pack_command("SET", "k", "é")


def test_the_quota_client_packs_with_hiredis() -> None:
    client = redis_client_from_url("redis://127.0.0.1:1/0", 0.1)
    cls = client.connection_pool.connection_class
    assert issubclass(cls, Connection) and cls.pack_command is not Connection.pack_command
    unix = redis_client_from_url("unix:///tmp/none.sock", 0.1).connection_pool.connection_class
    assert issubclass(unix, UnixDomainSocketConnection)
    assert pack_with_hiredis(pack_with_hiredis(client)).connection_pool.connection_class is cls
