"""Stage marks for bench/timeline.py: when ``TIMELINE_MARKS_OUT`` names a file, the gateway
process that imports this (``PYTHONPATH`` holds this folder) records ``(perf_counter_ns, stage)``
at each stage of the request path and writes them there at exit. Without the variable it does
nothing."""

from __future__ import annotations

import atexit
import functools
import os
import time
from typing import Any

OUT = os.environ.get("TIMELINE_MARKS_OUT")
MARKS: list[tuple[int, str]] = []


def _mark(name: str) -> None:
    MARKS.append((time.perf_counter_ns(), name))


def _before(owner: Any, attr: str, name: str) -> None:
    """Mark ``name`` when ``owner.attr`` (a plain function) is called."""
    f = getattr(owner, attr)

    @functools.wraps(f)
    def marked(*a: Any, **k: Any) -> Any:
        _mark(name)
        return f(*a, **k)

    setattr(owner, attr, marked)


def _around(owner: Any, attr: str, start: str, end: str) -> None:
    """Mark ``start`` when the coroutine function ``owner.attr`` is entered, ``end`` when it returns."""
    f = getattr(owner, attr)

    @functools.wraps(f)
    async def marked(*a: Any, **k: Any) -> Any:
        _mark(start)
        try:
            return await f(*a, **k)
        finally:
            _mark(end)

    setattr(owner, attr, marked)


def _dump() -> None:
    with open(OUT, "w") as f:  # type: ignore[arg-type]
        f.writelines(f"{t} {n}\n" for t, n in MARKS)


if OUT:
    import gateway.admission.admit as admit
    import gateway.edge.protocol as edge
    import gateway.quotas.stores as stores
    import gateway.relay.finish as finish
    import gateway.relay.h1_transport as h1

    _before(edge.BoundedHttpToolsProtocol, "data_received", "rx")  # client bytes in
    _around(admit, "admit", "admit", "admitted")
    _around(stores.RedisQuotaStore, "_execute", "redis_tx", "redis_rx")  # one Redis round trip
    _around(h1.H1Transport, "send", "up_tx", "up_head")  # the forward, to the engine's response head
    _before(h1._Connection, "data_received", "up_rx")  # engine bytes in
    _before(edge._LingeringTransport, "write", "client_tx")  # answer bytes out (held or written)
    _around(finish, "finish", "finish", "finished")  # settle, metrics, log
    import gateway.routes.handlers as handlers

    # inside admission: the small-body check, the body read, the count, the forward body, the
    # verifier's admission, the quota call up to its round trip
    _around(admit, "_received_small", "small", "small_end")
    _around(admit, "read_request", "read", "read_end")
    _around(admit, "_count_and_decide", "count", "count_end")
    _around(admit, "_forward", "fwd", "fwd_end")
    import gateway.quotas.tenant_quotas as tq
    import verifier.service as vs

    _around(vs.VerifierService, "admit", "v_admit", "v_admit_end")
    _around(tq.TenantQuotas, "begin_reserve", "quota", "quota_end")
    handlers.admit, handlers.finish = admit.admit, finish.finish  # the names it imported

    atexit.register(_dump)
