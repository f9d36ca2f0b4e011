"""Shared fixtures. Tests start real processes on loopback; Redis is the real server that
scripts/test.sh (or .ci/run, which runs it) makes sure answers on 127.0.0.1:6379.

Fixtures (their parts live in tests/fixtures/): ``engine`` (one mock engine per test) and
``module_engine`` (one per module), of the kind and state a ``pytest.mark.engine(kind, **state)``
on the test or module names (default: ``mock``, fresh state); ``engines`` (start any number, all
stopped after the test); ``gateway`` (start :class:`tests.gateway_harness.Gateway` apps, all
stopped after the test); ``redis_prefix`` (a key prefix of the test's own on the shared Redis,
emptied after it), ``redis_client`` (a client of it) and ``redis_store`` / ``quota_store`` (the
quota store on it; the latter parametrised over that and the in-process store).

Some tests use the incident runbook (two translations, real multilingual text) from the project's
shared design folder, ``../shared/seeds`` beside the checkout. In a clone without that folder those
test files are not collected, and the run says so at the end.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"
SEEDS = SHARED / "seeds"
sys.path.insert(0, str(ROOT))

from tests.fixtures.engines import running_engine  # noqa: E402  (needs ROOT on sys.path)
from tests.fixtures.redis_keys import REDIS_URL, delete_prefix, new_prefix  # noqa: E402

#: test files that read the runbook texts in SEEDS (tests/test_imports.py checks that every test file
#: naming SEEDS is listed, and only those)
NEEDS_SEEDS = [
    "test_backend_core_copy_probe.py",
    "test_gateway_http.py",
    "test_hostile_verifier.py",
    "test_tokenizer.py",
    "test_tokenizer_hf.py",
    "test_tokenizer_parallel.py",
    "test_verifier_backend.py",
    "test_verifier_batch_checks.py",
    "test_verifier_e2e.py",
    "test_verifier_hostile_round3.py",
    "test_verifier_service.py",
    "test_verifier_units.py",
]
HAVE_SEEDS = (SEEDS / "000_cd7ee3cfd92e9ff1.txt").is_file() and (SEEDS / "001_85707760a0179a93.txt").is_file()
collect_ignore = [] if HAVE_SEEDS else NEEDS_SEEDS


def pytest_terminal_summary(terminalreporter) -> None:
    if not HAVE_SEEDS:
        terminalreporter.write_line(
            f"kvgate: {len(NEEDS_SEEDS)} test files were not run: they read the runbook texts of the shared "
            "design folder (../shared/seeds beside the checkout), which this checkout lacks: " + ", ".join(NEEDS_SEEDS),
            yellow=True,
        )


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers", "engine(kind='mock', **state): the kind and state of the engine / module_engine fixture"
    )


def _engine_spec(request) -> tuple[str, dict[str, Any]]:
    marker = request.node.get_closest_marker("engine")
    if marker is None:
        return "mock", {}
    return (marker.args[0] if marker.args else "mock"), dict(marker.kwargs)


@pytest.fixture
def engine(request) -> Iterator[Any]:
    """A started mock engine for this test (see the module docstring for its kind and state)."""
    kind, state = _engine_spec(request)
    with running_engine(kind, **state) as e:
        yield e


@pytest.fixture(scope="module")
def module_engine(request) -> Iterator[Any]:
    """A started mock engine shared by the module's tests (kind and state from the module's mark)."""
    kind, state = _engine_spec(request)
    with running_engine(kind, **state) as e:
        yield e


@pytest.fixture
def engines() -> Iterator[Callable[..., Any]]:
    """``engines(kind="mock", **state)`` starts another mock engine; all stop after the test."""
    with ExitStack() as stack:
        yield lambda kind="mock", **state: stack.enter_context(running_engine(kind, **state))


@pytest.fixture
def gateway() -> Iterator[Callable[..., Any]]:
    """``gateway(settings, registry=None, **create_app_kw)`` starts a gateway app on a free port
    (:class:`tests.gateway_harness.Gateway`); all stop after the test."""
    from tests.gateway_harness import Gateway

    started: list[Any] = []

    def start(settings, registry=None, **kw: Any) -> Any:
        started.append(Gateway(settings, registry, **kw).start())
        return started[-1]

    yield start
    for g in reversed(started):
        g.stop()


@pytest.fixture
def redis_prefix(request) -> Iterator[str]:
    """A key prefix only this test uses on the shared Redis; its keys are deleted after the test."""
    prefix = new_prefix(request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_"))
    yield prefix
    delete_prefix(prefix)


@pytest.fixture
def redis_client() -> Iterator[Any]:
    """A ``redis.Redis`` client of the shared Redis, closed after the test."""
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    yield client
    client.close()


@pytest.fixture
async def redis_store(redis_prefix: str) -> AsyncIterator[Any]:
    """:class:`gateway.quotas.stores.RedisQuotaStore` on the shared Redis, under ``redis_prefix``."""
    from gateway.quotas.stores import RedisQuotaStore
    from gateway.quotas.tenant_quotas import redis_client_from_url

    store = RedisQuotaStore(redis_client_from_url(REDIS_URL, 0.5), prefix=redis_prefix)
    yield store
    await store.aclose()


@pytest.fixture(params=["redis", "local"])
async def quota_store(request, redis_store) -> Any:
    """Both quota stores, in turn: they must give the same answers to the same calls."""
    from gateway.quotas.stores import LocalQuotaStore

    return redis_store if request.param == "redis" else LocalQuotaStore()
