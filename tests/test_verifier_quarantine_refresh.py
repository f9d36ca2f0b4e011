"""A running gateway's quarantine view is refreshed in a worker thread, never on the event loop:
``is_quarantined`` on the request path is a dict lookup even when the store is slow."""

from __future__ import annotations

import asyncio
import threading
import time

from config.models import Settings
from verifier.build import build_verifier
from verifier.quarantine import FileQuarantineBackend, QuarantineRecord

SECRETS = {"leak_index_key": b"k" * 32, "cache_salt_key": b"c" * 32, "admin_key": b"a" * 32}


class SlowBackend(FileQuarantineBackend):
    """A file backend whose reads take 0.2 s and remember which thread made them."""

    def __init__(self, state_dir) -> None:
        super().__init__(state_dir)
        self.reader_threads: list[int] = []

    def load(self):
        self.reader_threads.append(threading.get_ident())
        time.sleep(0.2)
        return super().load()


async def test_quarantine_reads_happen_off_the_loop_and_new_records_appear(tmp_path) -> None:
    settings = Settings(state_dir=str(tmp_path))
    svc = build_verifier(settings, secrets=SECRETS)
    backend = SlowBackend(tmp_path)
    svc.quarantine.backend = backend
    svc.quarantine.refresh_seconds = 0.05
    svc.start()  # reads the store once, at start-up
    backend.reader_threads.clear()
    try:
        loop_thread = threading.get_ident()
        t0 = time.perf_counter()
        for _ in range(200):  # the request path: never a 0.2 s read
            assert not svc.is_quarantined("up1", 5000)
        assert time.perf_counter() - t0 < 0.2 * 3  # 200 lookups, not one blocking read among them
        # another replica (or the CLI) quarantines up1 in the shared store
        FileQuarantineBackend(tmp_path).put(QuarantineRecord("up1", "inc_x", "canary", 1024, time.time()))
        for _ in range(100):
            if svc.is_quarantined("up1", 5000):
                break
            await asyncio.sleep(0.05)
        assert svc.is_quarantined("up1", 5000) and not svc.is_quarantined("up1", 1024)
        assert backend.reader_threads and loop_thread not in backend.reader_threads
    finally:
        await svc.aclose()
    assert svc.quarantine.inline_refresh  # the CLI-style inline mode is back once the loop stops
