"""The offload executor's per-tenant share (gateway/edge/offload.py): a tenant whose jobs fill its share
waits for its own threads, while another tenant's job starts at once; jobs without a tenant are
not limited; results, exceptions and cancellation come back as from a plain thread pool."""

from __future__ import annotations

import asyncio
import threading

import pytest

from gateway.edge import offload

pytestmark = pytest.mark.timeout(30)


async def test_a_tenant_waits_for_its_own_share_while_another_runs_at_once():
    loop = asyncio.get_running_loop()
    ex = offload.install(loop, threads=4, share=2, cores=1)
    assert (ex._max_workers, ex.share) == (4, 2)
    release = threading.Event()

    async def as_tenant(tenant: str, fn, *args):
        offload.set_tenant(tenant)
        return await asyncio.to_thread(fn, *args)

    flood = [asyncio.ensure_future(as_tenant("flood", release.wait, 10)) for _ in range(6)]
    await asyncio.sleep(0.1)
    assert (ex.running("flood"), ex.waiting("flood")) == (2, 4)
    # the other tenant's job runs on a free thread now, not after the flood's six
    assert await asyncio.wait_for(as_tenant("victim", lambda: threading.current_thread().name), 2)
    assert await asyncio.wait_for(asyncio.to_thread(lambda: 7), 2) == 7  # no tenant: not limited
    release.set()
    assert await asyncio.gather(*flood) == [True] * 6
    assert (ex.running("flood"), ex.waiting("flood")) == (0, 0)


async def test_exceptions_and_cancelled_waiting_jobs():
    loop = asyncio.get_running_loop()
    offload.install(loop, threads=2, share=1, cores=1)
    offload.set_tenant("t")
    with pytest.raises(ZeroDivisionError):
        await asyncio.to_thread(lambda: 1 / 0)
    release = threading.Event()
    first = asyncio.ensure_future(asyncio.to_thread(release.wait, 10))
    second = asyncio.ensure_future(asyncio.to_thread(lambda: "ran"))
    await asyncio.sleep(0.05)
    second.cancel()  # waiting for the share: it never runs
    release.set()
    assert await first is True
    with pytest.raises(asyncio.CancelledError):
        await second
    assert await asyncio.to_thread(lambda: "next") == "next"  # the share was handed on
    ex = offload.install(loop, threads=9, share=9, cores=1)
    assert (ex.running("t"), ex.waiting("t"), ex._max_workers) == (0, 0, 2)  # the loop keeps its executor
