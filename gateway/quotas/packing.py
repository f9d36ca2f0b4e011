"""The quota store's Redis commands packed by hiredis (C) instead of redis-py's asyncio
connection, which packs every argument in Python (its ``pack_command`` was the largest single
cost of the quota calls: docs/performance.md, "Gateway: the hot path outside the verifier").

:func:`hiredis_packing` gives a connection class that packs with ``hiredis.pack_command`` the
commands whose arguments are all ``str``, ``bytes`` or ``int`` (``bool`` excluded) under the
UTF-8 strict encoder; any other command is packed by the class it extends. The bytes on the
wire are the same either way (RESP: ``*N``, then ``$len`` and each argument as its UTF-8 or
decimal text).
"""

from __future__ import annotations

from typing import Any

_PLAIN = frozenset((str, bytes, int))


def hiredis_packing(base: type) -> type:
    """A subclass of the ``redis.asyncio`` connection class ``base`` packing with hiredis;
    ``base`` itself when hiredis is not installed (or is already such a subclass)."""
    try:
        from hiredis import pack_command
    except ImportError:  # hiredis is a dependency; without it redis-py packs as before
        return base
    if getattr(base, "_kvgate_hiredis_packing", False):
        return base
    base_pack: Any = base.pack_command  # type: ignore[attr-defined]

    def pack(self: Any, *args: Any) -> list[bytes]:
        enc = self.encoder
        first = args[0] if args else None
        if (
            enc.encoding != "utf-8"
            or enc.encoding_errors != "strict"
            or not isinstance(first, str)
            or " " in first
            or not _PLAIN.issuperset(map(type, args))
        ):
            return base_pack(self, *args)
        return [pack_command(args)]

    return type(base.__name__, (base,), {"pack_command": pack, "_kvgate_hiredis_packing": True})


def pack_with_hiredis(client: Any) -> Any:
    """``client`` (a ``redis.asyncio`` ``Redis``: standalone or a Sentinel's master) with its pool
    making :func:`hiredis_packing` connections from now on; a client without a connection pool
    (a cluster) is returned unchanged. Returns ``client``."""
    pool = getattr(client, "connection_pool", None)
    if pool is not None and isinstance(getattr(pool, "connection_class", None), type):
        pool.connection_class = hiredis_packing(pool.connection_class)
    return client
