"""Small parts of the quota stage: tenant-file reload (poll and SIGHUP), counting completion text
when the engine reports no usage, per-replica limits, rate-limit headers."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import yaml

from config.loader import ConfigError
from gateway.ops.tenant_reload import TenantFileWatcher
from gateway.ops.tenants import TenantRegistry, hash_key
from gateway.quotas.stores import QuotaDecision, QuotaLimits
from gateway.quotas.tenant_quotas import rate_limit_headers
from gateway.relay.finish import completion_tokens_of
from tokenizer import bundled_counter


def _write(path: Path, rpm: int, key: str = "sk-one") -> None:
    path.write_text(yaml.safe_dump({"tenants": [{"id": "acme", "api_key_sha256": [hash_key(key)], "rpm": rpm}]}))


def test_watcher_reloads_on_change_and_keeps_the_old_table_when_the_file_is_invalid(tmp_path: Path) -> None:
    p = tmp_path / "tenants.yaml"
    _write(p, 5)
    reg = TenantRegistry.from_path(p)
    w = TenantFileWatcher(reg, interval_seconds=3600)
    assert w.check() is False  # unchanged
    _write(p, 7, key="sk-two")
    assert w.check() is False  # changed: read once it has stayed the same for one check
    assert reg.lookup("sk-one") is not None and w.check() is True
    assert (reg.get("acme").rpm, reg.lookup("sk-one"), reg.lookup("sk-two").id, w.reloads) == (7, None, "acme", 1)
    p.write_text("tenants:\n  - id: acme\n    rpm: -1\n")
    assert w.check() is False and w.check() is False
    assert reg.get("acme").rpm == 7 and reg.lookup("sk-two") is not None  # the previous table stays
    assert w.last_error is not None and "tenants[0].rpm: Input should be greater than or equal to 0" in w.last_error
    assert w.check() is False  # the same bad file is not re-read
    _write(p, 9, key="sk-two")
    assert w.check() is False and w.check() is True and reg.get("acme").rpm == 9 and w.last_error is None


def test_a_failed_reload_shows_in_the_metrics_until_the_file_is_fixed(tmp_path: Path) -> None:
    """A tenants file that fails to read keeps the previous tenants, revoked keys included, and
    said so only in a log line: ``kvgate_tenants_file_valid`` is 0 from the failed read until a
    good one, and each failed read counts in ``kvgate_tenants_reload_failures_total``."""
    from gateway.ops.metrics import GatewayMetrics

    m = GatewayMetrics()
    p = tmp_path / "tenants.yaml"
    _write(p, 5)
    w = TenantFileWatcher(TenantRegistry.from_path(p), interval_seconds=3600, on_result=m.tenant_reloaded)

    def shown() -> tuple[float | None, float | None]:
        return (
            m.registry.get_sample_value("kvgate_tenants_file_valid"),
            m.registry.get_sample_value("kvgate_tenants_reload_failures_total"),
        )

    assert shown() == (1.0, 0.0)
    p.write_text("tenants:\n  - id: acme\n    rpm: yes\n")
    assert w.check() is False and w.check() is False
    assert shown() == (0.0, 1.0)
    p.write_text("tenants: [\n")
    assert w.check() is False and w.check() is False and shown() == (0.0, 2.0)
    _write(p, 6)
    assert w.check() is False and w.check() is True and shown() == (1.0, 2.0)


def test_a_file_written_in_place_is_not_read_half_written_and_an_empty_one_never_empties_the_table(
    tmp_path: Path,
) -> None:
    """Written in place (``cat new > tenants.yaml``), the file reads empty for a moment: read then,
    it was a table of no tenants, and every key got 401 until the write ended. A changed file is
    read once it has stayed the same for one check, and an empty one is refused (the table
    stays; an empty table is ``tenants: []``)."""
    p = tmp_path / "tenants.yaml"
    _write(p, 5)
    reg = TenantRegistry.from_path(p)
    w = TenantFileWatcher(reg, interval_seconds=3600)
    p.write_text("")  # the truncation; the rest of the write comes later
    assert w.check() is False and reg.lookup("sk-one") is not None
    assert w.check() is False and reg.lookup("sk-one") is not None  # read now: empty, refused
    assert w.last_error == f"{p}: the file is empty (being written?); an empty table is 'tenants: []'"
    _write(p, 6)
    assert w.check() is False and w.check() is True and reg.get("acme").rpm == 6
    p.write_text("tenants: []\n")
    assert w.check() is False and w.check() is True and reg.tenants == ()


def test_a_reload_never_lets_in_a_refused_key(tmp_path: Path) -> None:
    """kvgate serve without --demo refuses the documented demo keys at start; a reload refused
    nothing, so a tenants file edited to accept sk-demo-a was served."""
    p = tmp_path / "tenants.yaml"
    _write(p, 5)
    reg = TenantRegistry.from_path(p)
    reg.refused_key_hashes = frozenset({hash_key("sk-demo-a")})
    _write(p, 6, key="sk-demo-a")
    with pytest.raises(ConfigError) as e:
        reg.reload()
    assert str(e.value) == (
        f"{p}: tenant(s) acme accept a documented demo key (sk-demo-a/sk-demo-b), "
        "and this gateway was started without --demo"
    )
    assert reg.lookup("sk-one") is not None and reg.lookup("sk-demo-a") is None


def test_watcher_polls_and_sighup_forces_a_reload(tmp_path: Path) -> None:
    p = tmp_path / "tenants.yaml"
    _write(p, 5)
    reg = TenantRegistry.from_path(p)
    w = TenantFileWatcher(reg, interval_seconds=0.05).start()
    old = signal.getsignal(signal.SIGHUP)
    try:
        _write(p, 6)
        deadline = time.monotonic() + 5
        while reg.get("acme").rpm != 6 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert reg.get("acme").rpm == 6
        w.interval_seconds = 3600  # from now on only SIGHUP reloads
        time.sleep(0.1)
        w.install_sighup()
        before = w.reloads
        os.kill(os.getpid(), signal.SIGHUP)
        deadline = time.monotonic() + 5
        while w.reloads == before and time.monotonic() < deadline:
            time.sleep(0.02)
        assert w.reloads == before + 1  # forced, though the file did not change
    finally:
        signal.signal(signal.SIGHUP, old)
        w.stop()


def test_watcher_needs_a_file() -> None:
    from config.models import TenantsFile

    with pytest.raises(ValueError, match="no file to watch"):
        TenantFileWatcher(TenantRegistry(TenantsFile()))


async def test_completion_tokens_counted_per_choice() -> None:
    counter = bundled_counter()
    a, b = "Hello there, general Kenobi.", " naïve café — ok"
    assert await completion_tokens_of(counter, [[a[:7], a[7:]], b, ""]) == counter.count_text(a) + counter.count_text(b)
    assert await completion_tokens_of(counter, []) == 0

    class EngineOnly:
        offload_chars = 10

        def count_text(self, text: str) -> int:
            raise NotImplementedError

    assert await completion_tokens_of(EngineOnly(), ["naïve"]) == 6  # UTF-8 bytes: never fewer than tokens
    counter.offload_chars = 4  # long text is counted in a worker thread, same answer
    assert await completion_tokens_of(counter, [a]) == counter.count_text(a)


def test_per_replica_limits_and_headers() -> None:
    lim = QuotaLimits(rpm=5, tpm=1001, max_concurrent=1)
    assert lim.divided(2) == QuotaLimits(2, 500, 0)  # floor: replicas together never exceed the limit
    assert QuotaLimits(None, 10, None).divided(3) == QuotaLimits(None, 3, None)
    d = QuotaDecision(True, (), 0, 4, -7)
    assert rate_limit_headers(lim, d) == {
        "x-ratelimit-limit-requests": "5",
        "x-ratelimit-remaining-requests": "4",
        "x-ratelimit-limit-tokens": "1001",
        "x-ratelimit-remaining-tokens": "0",
    }
    assert rate_limit_headers(QuotaLimits(None, None, 3), d) == {}
