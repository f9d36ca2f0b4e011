"""Live tenant changes: a running gateway re-reads ``tenants.yaml`` when the file changes (polled)
or on SIGHUP, so ``kvgate tenant set / add-key / revoke-key`` take effect without a restart.

The reload itself is :meth:`gateway.ops.tenants.TenantRegistry.reload` (one reference swap: a request
sees the old table or the new one). A changed file is read once it has stayed the same for one
check, and is not applied when it changed while it was read. An invalid or empty file, or one
with no ``tenants`` list, is logged and the previous table kept. Quota
limits are read from the tenant entry on every request, so new limits apply to the next request;
the windows already logged (in Redis or in process) stay and count against the new limits.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from typing import Any

from config.loader import ConfigError
from gateway.ops.tenants import Signature, file_signature

log = logging.getLogger("kvgate.tenants")

#: How often the tenants file is checked for a change (seconds).
POLL_INTERVAL_SECONDS = 1.0


class TenantFileWatcher:
    """Reloads ``registry`` (a :class:`~gateway.ops.tenants.TenantRegistry` with a ``path``) when the
    file's (mtime, size, inode) changes and then stays the same for one more check (a file
    written in place is not read half-written), checked every ``interval_seconds`` in a daemon
    thread, or at once after :meth:`poke` (what the SIGHUP handler calls). ``reloads`` counts successful
    reloads; ``last_error`` holds the last invalid file's message (``None`` after a good one);
    ``on_result(ok)`` is told of each read (the gateway's reload metrics). The first check compares
    with the file as the registry read it (``registry.signature``), not as it is when the watcher
    starts."""

    def __init__(
        self,
        registry: Any,
        interval_seconds: float = POLL_INTERVAL_SECONDS,
        on_result: Callable[[bool], None] | None = None,
    ) -> None:
        if registry.path is None:
            raise ValueError("the tenant registry has no file to watch")
        self.registry = registry
        self.interval_seconds = interval_seconds
        self.on_result = on_result
        self.reloads = 0
        self.last_error: str | None = None
        # the file as the registry read it (an edit made since, while the gateway was starting, is
        # a change to load: the file as it is now was taken for the one read, a revoked key kept)
        seen = getattr(registry, "signature", None)
        self._seen = seen if seen is not None else file_signature(registry.path)
        self._changed_to: Signature | None = self._seen  # what the last check saw
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def check(self, force: bool = False) -> bool:
        """Reload if the file changed (or ``force``); True when a new table was swapped in."""
        sig = file_signature(self.registry.path)
        settling, self._changed_to = sig != self._changed_to, sig
        if not force and (sig == self._seen or settling):
            return False
        self._seen = sig
        try:
            self.registry.reload(expect=sig)  # a write begun since this check is not read half done
        except (ConfigError, OSError, ValueError) as e:
            self.last_error = str(e)
            log.warning("tenants file %s is invalid; keeping the previous tenants: %s", self.registry.path, e)
            if self.on_result is not None:
                self.on_result(False)
            return False
        self.reloads += 1
        self.last_error = None
        if self.on_result is not None:
            self.on_result(True)
        log.info("tenants reloaded from %s: %d tenant(s)", self.registry.path, len(self.registry.tenants))
        return True

    def poke(self) -> None:
        """Ask for a reload now (safe from a signal handler: it only sets an event)."""
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            poked = self._wake.wait(self.interval_seconds)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.check(force=poked)
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as e:  # the watcher must outlive any surprise, a native panic included
                try:
                    self._failed(e)
                except Exception:  # its report failed too (a broken log handler): the next edit is still read
                    pass

    def _failed(self, e: BaseException) -> None:
        """A check raised ``e`` outside the expected errors (:meth:`check`'s ``ConfigError``,
        ``OSError``, ``ValueError``): a failed read as theirs is, counted (``on_result(False)``:
        ``kvgate_tenants_reload_failures_total``, ``kvgate_tenants_file_valid`` 0) and logged with
        its traceback; the previous tenants stay. State first, the log line last."""
        self.last_error = f"{self.registry.path}: reading it failed ({type(e).__name__})"
        try:
            if self.on_result is not None:
                self.on_result(False)
        finally:
            log.error(
                "reading tenants file %s failed (%s); the previous tenants stay in force",
                self.registry.path,
                type(e).__name__,
                exc_info=(type(e), e, e.__traceback__),
            )

    def start(self) -> TenantFileWatcher:
        """Start the polling thread (idempotent); returns ``self``."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvgate-tenant-reload", daemon=True)
            self._thread.start()
        return self

    def install_sighup(self) -> None:
        """Make SIGHUP reload the file (call from the main thread)."""
        signal.signal(signal.SIGHUP, lambda _sig, _frame: self.poke())

    def stop(self) -> None:
        """Stop the thread."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None
