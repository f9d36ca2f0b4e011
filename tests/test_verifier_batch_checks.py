"""The background worker checks a run of queued responses together, their leak-index lookups in
one store call: every check's findings are those of the same checks run one at a time, a prompt
ingest queued between checks is seen by the checks after it only, and a failing store counts its
error as before."""

from __future__ import annotations

import asyncio
import uuid

import redis

from conftest import SEEDS

from config.models import TenantConfig
from tests.fixtures.redis_keys import REDIS_URL, delete_prefix, new_prefix
from tests.fixtures.settings import verifier_settings
from verifier.build import build_verifier
from verifier.findings import CheckJob
from verifier.service import VerifierService
from verifier.shingles import encode
from verifier.stage import Exchange, ExchangeRequest

SEED_PL = (SEEDS / "001_85707760a0179a93.txt").read_text()
SECRETS = {"leak_index_key": b"batch-test-key", "cache_salt_key": b"x", "admin_key": b"y"}
A_PROMPT, C_PROMPT = SEED_PL[:3000], SEED_PL[6000:9000]


def ex(tid: str, prompt: str) -> Exchange:
    t = TenantConfig(id=tid, verify_sample_rate=1.0)
    return Exchange(
        ExchangeRequest(f"req-{uuid.uuid4().hex[:8]}", t, "up", "m", len(encode(prompt)), False, 0.0), prompt
    )


def queue_workload(svc: VerifierService) -> None:
    """Prompts of a and c, and checks of answers quoting them (or not), an ingest in between."""
    svc.begin(ex("a", A_PROMPT))  # not admitted: its prompt is queued for the worker
    for i, (tid, text) in enumerate(
        [("b", SEED_PL[1000:1600]), ("b", "Nothing to see here, rivers and stones."), ("a", SEED_PL[500:900])]
        + [("d", SEED_PL[6500:7000]), ("e", SEED_PL[2000:2400] + " and " + SEED_PL[6100:6500])]
    ):
        if i == 3:
            svc.begin(ex("c", C_PROMPT))  # c's prompt is indexed after the first three checks only
        e = ex(tid, f"Question {i} about a text.")
        e.state.sampled = True
        svc.jobs.enqueue(CheckJob(e, [text, "" if i % 2 else text[:120]], None, "stop", None))


def findings(svc: VerifierService) -> list[tuple[str, str, bool, dict]]:
    out = []
    for inc in svc.incidents.recent:
        ev = {k: v for k, v in inc.evidence.items() if k != "request_id"}
        out.append((inc.detector, inc.tenant, inc.confirmed, ev))
    return out


def run(tmp_path, name: str, per_call: int) -> tuple[list, dict, int]:
    svc = build_verifier(verifier_settings(tmp_path / name), secrets=SECRETS)
    queue_workload(svc)
    store, lookups = svc.index.store, []
    owners = store.owners
    store.owners = lambda fps: lookups.append(len(fps)) or owners(fps)  # type: ignore[method-assign]
    while svc.jobs.jobs:
        svc.jobs._run_some(per_call)
    return findings(svc), {k: v for k, v in svc.stats.items() if v}, len(lookups)


def test_batched_checks_find_what_single_checks_find(tmp_path):
    one = run(tmp_path, "one", 1)
    batched = run(tmp_path, "batched", 32)
    assert batched[:2] == one[:2]
    assert (one[2], batched[2]) == (5, 2)  # a lookup per check; one per run of checks
    got = {(d, t) for d, t, _, _ in one[0]}
    assert ("leak_index", "b") in got and ("leak_index", "d") in got and ("leak_index", "e") in got
    assert ("leak_index", "a") not in got  # its own prompt


def test_a_failing_store_counts_as_before(tmp_path, monkeypatch):
    def down(self, fps):
        raise ConnectionError("store down")

    def both(name: str, per_call: int):
        svc = build_verifier(verifier_settings(tmp_path / name), secrets=SECRETS)
        queue_workload(svc)
        monkeypatch.setattr(type(svc.index.store), "owners", down)
        while svc.jobs.jobs:
            svc.jobs._run_some(per_call)
        monkeypatch.undo()
        return findings(svc), {k: v for k, v in svc.stats.items() if v}

    one, batched = both("one", 1), both("batched", 32)
    assert batched == one and one[1]["store_errors"] == 1 and one[1]["store_skipped"] >= 1


async def _work_until_empty(svc: VerifierService) -> None:
    svc.start()
    for _ in range(2000):
        if not svc.jobs.jobs and not svc.stats["in_flight"]:
            break
        await asyncio.sleep(0.005)
    await svc.aclose()


def run_redis(
    tmp_path, name: str, *, on_loop: bool, down: bool = False, workload=queue_workload
) -> tuple[list, dict, list[str]]:
    """The workload against Redis stores through the worker task (``on_loop``: as the service
    runs it; else every batch in the thread, as before the awaited lookup). Which lookups ran:
    ``sync`` (the worker thread's client) or ``async`` (awaited on the loop)."""
    prefix = new_prefix(f"batch-{name}")
    svc = build_verifier(verifier_settings(tmp_path / name, redis_url=REDIS_URL), secrets=SECRETS, key_prefix=prefix)
    # no latency keeper: its start-up load holds the service lock in a thread for a moment, and a run
    # of checks that finds the lock held goes to the thread (by design), so which lookup ran would
    # depend on the machine's load (seen once in a full run: sync, sync, async)
    svc.latency_keeper.store = None
    store, calls = svc.index.store, []
    owners, aowners = store.owners, store.aowners

    def sync(fps):
        calls.append("sync")
        if down:
            raise redis.ConnectionError("store down")
        return owners(fps)

    async def awaited(fps):
        calls.append("async")
        if down:
            raise redis.ConnectionError("store down")
        return await aowners(fps)

    store.owners, store.aowners = sync, awaited  # type: ignore[method-assign]
    if not on_loop:
        store.aclient = None
    try:
        workload(svc)
        asyncio.run(_work_until_empty(svc))
        return findings(svc), {k: v for k, v in svc.stats.items() if v}, calls
    finally:
        delete_prefix(prefix)


def test_checks_looked_up_on_the_loop_find_what_the_thread_finds(tmp_path):
    """Redis stores: the worker takes each run of small checks, looks their owners up in one
    awaited call (no lookup from the thread) and finds exactly what the thread's own lookups
    find; the ingest queued between the checks still splits them into two runs."""
    thread = run_redis(tmp_path, "thread", on_loop=False)
    loop = run_redis(tmp_path, "loop", on_loop=True)
    assert loop[:2] == thread[:2]
    assert thread[2] == ["sync", "sync"] and loop[2] == ["async", "async"]
    got = {(d, t) for d, t, _, _ in loop[0]}
    assert ("leak_index", "b") in got and ("leak_index", "d") in got and ("leak_index", "e") in got
    assert ("leak_index", "a") not in got


def test_an_awaited_lookup_that_fails_counts_as_before(tmp_path):
    """Redis down for lookups: the awaited lookup fails, the first check's own lookup counts the
    error, the rest are skipped in the back-off: the counts the thread's lookups give."""
    thread = run_redis(tmp_path, "thread-down", on_loop=False, down=True)
    loop = run_redis(tmp_path, "loop-down", on_loop=True, down=True)
    assert loop[:2] == thread[:2]
    assert loop[1]["store_errors"] == 1 and loop[1]["store_skipped"] >= 1
    assert loop[2] == ["async", "sync"]


def test_a_huge_answer_is_prepared_in_the_thread_not_on_the_loop(tmp_path):
    """A hostile engine's 9,000-character answer (over the loop's 8,192) at the head of the queue
    is checked in the worker thread with its own lookup; the two short answers after it are
    looked up on the loop; all three leak a's prompt and are found."""

    def workload(svc: VerifierService) -> None:
        svc.begin(ex("a", SEED_PL[:9000]))
        for i, text in enumerate([SEED_PL[:9000], SEED_PL[1000:1600], SEED_PL[2000:2400]]):
            e = ex("b", f"Question {i}.")
            e.state.sampled = True
            svc.jobs.enqueue(CheckJob(e, [text], None, "stop", None))

    got, stats, calls = run_redis(tmp_path, "huge", on_loop=True, workload=workload)
    assert calls == ["sync", "async"]
    assert [(d, t) for d, t, _, _ in got].count(("leak_index", "b")) == 3
    assert stats["checked"] == 3


def test_a_check_that_fails_on_its_own_is_a_fault_not_a_store_outage(tmp_path):
    """A check that raises something no store raises (before the fix an engine's
    ``x-prefill-seconds: inf`` reached the latency sketch, which raised OverflowError) is that
    job's fault: counted in ``job_faults``, with no store back-off, so the leak check after it
    still finds b's copy of a's prompt. Before, the job backed the store off for 5 s and every
    check in that window, a strict tenant's included, skipped the leak index."""

    def workload(svc: VerifierService) -> None:
        svc.begin(ex("a", A_PROMPT))
        for i, ttft in enumerate([float("inf"), 0.01]):
            e = ex("b", f"Question {i}.")
            e.state.sampled = True
            svc.jobs.enqueue(CheckJob(e, [SEED_PL[1000:1600]], None, "stop", ttft))

    def raising_tail(svc: VerifierService) -> None:
        tail = svc.jobs.findings.tail

        def tail_once(ex, usage, finish, ttft, strict=False):
            if ttft == float("inf"):
                raise OverflowError("cannot convert float infinity to integer")
            return tail(ex, usage, finish, ttft, strict)

        svc.jobs.findings.tail = tail_once  # type: ignore[method-assign]
        workload(svc)

    found, stats, calls = run_redis(tmp_path, "fault", on_loop=True, workload=raising_tail)
    assert [(d, t) for d, t, _, _ in found] == [("leak_index", "b")]  # the second check's; the first faulted
    assert (stats.get("job_faults"), stats.get("store_errors"), stats.get("store_skipped")) == (1, None, None)
    assert calls == ["async"]
