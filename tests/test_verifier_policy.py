"""The verifier's policies against an attacker, through the real gateway app and a mock engine
(docs/verifier.md): the background worker survives any one job (a real tiktoken panic, a
``BaseException`` stand-in) and ``/readyz`` says when it is down; two keys of one actor priming
the leak index with recitable text quarantine nothing, and text that answers to several
tenants hold becomes public.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import hashlib
import io
import random
import time

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import verifier.findings
from config.models import ModelConfig, Settings, TenantConfig, TenantsFile, UpstreamConfig, VerifierSettings
from gateway.app import create_app
from gateway.ops.tenants import TenantRegistry
from tests.fixtures.settings import verifier_settings
from tests.mock_engine import ServerThread
from tokenizer.encodings import bundled_encoding
from verifier.build import build_verifier
from verifier.incidents import REGISTRY
from verifier.probe import filler_words
from verifier.service import VerifierService

SECRETS = {
    "leak_index_key": b"policy-test-leak-key",
    "cache_salt_key": b"policy-test-salt-key",
    "admin_key": b"policy-test-admin-key",
}

MIT = (
    "Permission is hereby granted, free of charge, to any person obtaining a copy of this software and "
    'associated documentation files (the "Software"), to deal in the Software without restriction, including '
    "without limitation the rights to use, copy, modify, merge, publish, distribute, sublicense, and/or sell "
    "copies of the Software, and to permit persons to whom the Software is furnished to do so, subject to the "
    "following conditions: The above copyright notice and this permission notice shall be included in all "
    'copies or substantial portions of the Software. THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY '
    "KIND, EXPRESS OR IMPLIED, INCLUDING BUT NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY, FITNESS FOR A "
    "PARTICULAR PURPOSE AND NONINFRINGEMENT. IN NO EVENT SHALL THE AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR "
    "ANY CLAIM, DAMAGES OR OTHER LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING FROM, "
    "OUT OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER DEALINGS IN THE SOFTWARE."
)


def zen_of_python() -> str:
    with contextlib.redirect_stdout(io.StringIO()):
        import this
    return codecs.decode(this.s, "rot13")


ZEN = zen_of_python()
#: 1,000,000 whitespace characters and one more: a real pyo3 PanicException in tiktoken's regex
#: (alternating, so the verifier's own squeezing of repeated characters does not shorten it)
PANIC_TEXT = " \t" * 500_000 + "x"


def key_of(tid: str) -> str:
    return f"sk-policy-{tid}"


class State:
    def __init__(self) -> None:
        self.text = "ok"


def build_engine(st: State) -> Starlette:
    async def chat(request: Request) -> Response:
        await request.body()
        return JSONResponse(
            {
                "id": "c1",
                "object": "chat.completion",
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": st.text}, "finish_reason": "stop"}
                ],
                "usage": {"completion_tokens": 5},
            }
        )

    async def server_info(request: Request) -> Response:
        return JSONResponse({"max_total_num_tokens": 16384, "context_length": 8192})

    return Starlette(routes=[Route("/server_info", server_info), Route("/v1/chat/completions", chat, methods=["POST"])])


TENANTS = {  # id: (strict, sample rate)
    "victim": (False, 0.0),
    "a1": (False, 0.0),
    "a2": (False, 0.0),
    "p": (False, 1.0),
    "h1": (True, 1.0),
    "h2": (False, 1.0),
    "h3": (False, 1.0),
    "h4": (False, 1.0),
    "h5": (False, 1.0),
}


@pytest.fixture
def stack(tmp_path):
    st = State()
    engine = ServerThread(build_engine(st)).start()
    s = Settings(
        state_dir=str(tmp_path),
        verifier=VerifierSettings(quarantine_min_prompt_tokens=16),
        models=[ModelConfig(id="m", context_length=8192)],
        upstreams=[
            UpstreamConfig(
                name="up", api_url=engine.url + "/v1", pool_source="static", static_pool_tokens=8192, models=["m"]
            )
        ],
    )
    rows = [
        TenantConfig(
            id=tid,
            api_key_sha256=[hashlib.sha256(key_of(tid).encode()).hexdigest()],
            strict_verify=strict,
            verify_sample_rate=rate,
            max_tokens_cap=64,
        )
        for tid, (strict, rate) in TENANTS.items()
    ]
    svc = build_verifier(s, secrets=SECRETS)
    app = create_app(s, TenantRegistry(TenantsFile(tenants=rows)), verifier=svc, secrets=SECRETS)
    gw = ServerThread(app).start()
    client = httpx.Client(base_url=gw.url, timeout=30)
    try:
        yield st, svc, client, gw
    finally:
        client.close()
        gw.stop()
        engine.stop()


def ask(client: httpx.Client, tid: str, content: str) -> httpx.Response:
    body = {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 16}
    return client.post("/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key_of(tid)}"})


def drain(gw: ServerThread, svc: VerifierService) -> None:
    """Wait (up to 10 s) until the verifier's queue is empty and no batch runs."""
    deadline = time.monotonic() + 10
    while svc.queued_jobs or svc.stats["in_flight"]:
        assert time.monotonic() < deadline, "the verifier's queue was not drained"
        time.sleep(0.01)


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels or None) or 0.0


def victim_passage() -> str:
    rng = random.Random(5)
    return " ".join(rng.choice(filler_words()) for _ in range(200))


@pytest.mark.timeout(120)
def test_the_worker_survives_a_real_panic_and_a_base_exception_and_records_the_next_leak(stack, monkeypatch):
    st, svc, client, gw = stack
    raw = bundled_encoding()

    class Boom(BaseException):
        """A stand-in for any other BaseException a job might raise."""

    def encode(text: str) -> list[int]:  # the raw tokenizer, unsqueezed and unsplit: tiktoken panics
        if text == "boom":
            raise Boom("a BaseException that is not an Exception")
        return raw.encode_ordinary(text)

    with pytest.raises(BaseException) as e:
        raw.encode_ordinary(PANIC_TEXT)
    assert (type(e.value).__module__, type(e.value).__name__) == ("pyo3_runtime", "PanicException")
    assert not isinstance(e.value, Exception)
    monkeypatch.setattr(verifier.findings, "encode", encode)
    faults = metric("kvgate_verifier_job_faults_total", kind="check")
    assert ask(client, "victim", "Please keep this safe: " + victim_passage()).status_code == 200
    for text in (PANIC_TEXT, "boom"):  # a sampled answer whose check raises
        st.text = text
        assert ask(client, "p", "Say something.").status_code == 200
        drain(gw, svc)
    assert svc.stats["job_faults"] == 2
    assert metric("kvgate_verifier_job_faults_total", kind="check") == faults + 2
    ready = client.get("/readyz")
    assert (ready.status_code, ready.json()["checks"]) == (200, {"verifier_worker": True})
    # the worker goes on: the next leak is an incident
    st.text = victim_passage()
    assert ask(client, "p", "Say something else.").status_code == 200
    drain(gw, svc)
    (inc,) = [i for i in svc.incidents.recent if i.detector == "leak_index"]
    assert (inc.tenant, inc.evidence["source_tenant"], inc.confirmed) == ("p", "victim", True)


@pytest.mark.timeout(60)
def test_a_cancellederror_nobody_asked_for_fails_one_batch_not_the_worker(stack, monkeypatch):
    """A ``CancelledError`` raised inside a check (a library's stray one, not the worker task's
    cancel) ended the verifier's worker: every later sampled answer went unchecked, ``/readyz``
    503. It is that batch's fault now (``kvgate_verifier_job_faults_total{kind="batch"}``) and the
    worker goes on."""
    st, svc, client, gw = stack
    raw = bundled_encoding()

    def encode(text: str) -> list[int]:
        if text == "stray":
            raise asyncio.CancelledError()
        return raw.encode_ordinary(text)

    monkeypatch.setattr(verifier.findings, "encode", encode)
    faults = metric("kvgate_verifier_job_faults_total", kind="batch")
    st.text = "stray"
    assert ask(client, "p", "Say something.").status_code == 200
    drain(gw, svc)
    assert metric("kvgate_verifier_job_faults_total", kind="batch") == faults + 1
    assert not svc.worker.done()
    ready = client.get("/readyz")
    assert (ready.status_code, ready.json()["checks"]) == (200, {"verifier_worker": True})


@pytest.mark.timeout(60)
def test_readyz_fails_and_a_metric_counts_when_the_worker_stops(stack):
    st, svc, client, gw = stack
    assert ask(client, "p", "hello").status_code == 200  # starts the worker
    stops = metric("kvgate_verifier_worker_stops_total")
    assert client.get("/readyz").status_code == 200
    worker = svc.worker
    worker.get_loop().call_soon_threadsafe(worker.cancel)  # the worker ends, not at shutdown
    deadline = time.monotonic() + 5
    while not worker.done():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    ready = client.get("/readyz")
    assert (ready.status_code, ready.json()["status"], ready.json()["checks"]) == (
        503,
        "not_ready",
        {"verifier_worker": False},
    )
    assert metric("kvgate_verifier_worker_stops_total") == stops + 1
    assert svc.stats["worker_stops"] == 1


def _leaks(svc: VerifierService, tenant: str) -> list:
    return [i for i in svc.incidents.recent if i.detector == "leak_index" and i.tenant == tenant]


@pytest.mark.timeout(120)
def test_two_keys_of_one_actor_priming_recitable_text_quarantine_nothing_and_public_text_is_no_evidence(stack):
    st, svc, client, gw = stack
    alerts = metric("kvgate_verifier_alerts_total", upstream="up", reason="two_sources")
    # the attacker's two keys prime the index with text models recite
    assert ask(client, "a1", "Remember this for me: " + MIT).status_code == 200
    assert ask(client, "a2", "Remember this for me: " + ZEN).status_code == 200
    # an honest strict tenant asks for the licence: its answer is withheld (one source), no quarantine
    st.text = MIT
    r = ask(client, "h1", "Print the MIT licence's permission notice.")
    assert (r.status_code, r.json()["error"]["code"]) == (502, "response_withheld")
    (inc,) = _leaks(svc, "h1")
    assert (inc.confirmed, inc.withheld, inc.evidence["source_tenant"], inc.evidence["quarantine"]) == (
        True,
        True,
        "a1",
        None,
    )
    # another honest tenant asks for the Zen of Python: a second source tenant, a high-severity
    # alert, and still no quarantine
    st.text = ZEN
    assert ask(client, "h2", "Recite the Zen of Python.").status_code == 200
    drain(gw, svc)
    (inc,) = _leaks(svc, "h2")
    assert (inc.evidence["source_tenant"], inc.evidence["severity"], inc.evidence["alert"]) == (
        "a2",
        "high",
        "two_sources",
    )
    assert inc.evidence["quarantine"] is None and not svc.quarantine.records()
    assert metric("kvgate_verifier_alerts_total", upstream="up", reason="two_sources") == alerts + 1
    long_prompt = "Summarise: " + victim_passage()
    st.text = "ok"
    assert ask(client, "h3", long_prompt).status_code == 200  # long prompts still served
    # the licence reaches answers of two more tenants: three distinct tenants in all (h1, h3, h4)
    st.text = MIT
    for tid in ("h3", "h4"):
        assert ask(client, tid, "The MIT licence, please.").status_code == 200
        drain(gw, svc)
        assert len(_leaks(svc, tid)) == 1
    # from now on it is public text: no incident, and the strict tenant's answer is released
    n = len(svc.incidents.recent)
    assert ask(client, "h5", "The MIT licence, please.").status_code == 200
    r = ask(client, "h1", "The MIT licence again.")
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == MIT
    drain(gw, svc)
    assert [i.detector for i in svc.incidents.recent[n:] if i.detector in ("leak_index", "canary")] == []
    assert not svc.quarantine.records()


# ------------------------------------------------------------------ per-tenant caps, calibration
def _exchange(tid: str, prompt: str, prompt_tokens: int = 10):
    from verifier.stage import Exchange, ExchangeRequest

    t = TenantConfig(id=tid, verify_sample_rate=1.0)
    return Exchange(ExchangeRequest(f"r-{tid}", t, "up", "m", prompt_tokens, False, 0.0), prompt)


async def test_a_tenant_over_its_cap_is_not_indexed_and_the_drops_are_counted(tmp_path):
    from verifier.canary import new_canary
    from verifier.shingles import encode

    svc = build_verifier(
        verifier_settings(tmp_path, leak_index_tenant_cap_fingerprints=40, canary_tenant_cap=3), secrets=SECRETS
    )
    try:
        rng = random.Random(11)
        text = " ".join(rng.choice(filler_words()) for _ in range(1500))
        cans = [new_canary() for _ in range(5)]
        prompt = text + " " + " ".join(cans)
        fps = svc.hasher.fingerprints(encode(prompt), svc.index.w)
        assert len(fps) > 40
        dropped_fp = metric("kvgate_verifier_cap_dropped_total", store="leak_index")
        dropped_can = metric("kvgate_verifier_cap_dropped_total", store="canary")
        await svc.admit(_exchange("flood", prompt))
        stored = [o for o in svc.index.store.owners(sorted(fps)) if o]
        assert stored == [{"flood"}] * 40  # the cap, not the prompt, decides
        assert svc.caps.leak.dropped == len(fps) - 40
        assert metric("kvgate_verifier_cap_dropped_total", store="leak_index") == dropped_fp + svc.caps.leak.dropped
        owners = [m.owners for m in svc.canaries.lookup(cans)]
        assert owners == [{"flood"}] * 3 + [set()] * 2
        assert metric("kvgate_verifier_cap_dropped_total", store="canary") == dropped_can + 2
        # another tenant has a cap of its own
        other = "quiet " + new_canary()
        await svc.admit(_exchange("quiet", other))
        assert svc.canaries.lookup([other.split()[1]])[0].owners == {"quiet"}
        # the window ends: the tenant may index again
        svc.caps.canary._window -= svc.cfg.tenant_cap_window_seconds
        late = new_canary()
        await svc.admit(_exchange("flood", "late " + late))
        assert svc.canaries.lookup([late])[0].owners == {"flood"}
    finally:
        await svc.aclose()


def test_a_latency_bucket_needs_three_tenants():
    from verifier.latency import LatencyModel

    m = LatencyModel(min_samples=6, tenant_share=0.5, min_tenants=3)
    for i in range(12):  # two tenants, more than enough samples
        m.record("up", 3000, 0.4, "whole", "m", ("a", "b")[i % 2])
    assert m.bound("up", 3000, "whole", "m") is None
    m.record("up", 3000, 0.4, "whole", "m", "c")
    assert m.bound("up", 3000, "whole", "m") == pytest.approx(0.2, rel=0.02)


async def test_latency_calibration_survives_a_restart_in_redis(tmp_path):
    import uuid

    import redis

    client = redis.Redis(host="127.0.0.1", port=6379, socket_timeout=2)
    prefix = f"test-policy-{uuid.uuid4().hex[:8]}:"
    s = verifier_settings(tmp_path, latency_min_samples=6)
    try:
        first = build_verifier(s, secrets=SECRETS, redis=client, key_prefix=prefix)
        for i in range(6):
            first.latency.observe("up", 3000, 0.4 + i * 0.001, "whole", model="m", tenant=("a", "b", "c")[i % 3])
        bound = first.latency.bound("up", 3000, "whole", "m")
        assert bound == pytest.approx(0.2, rel=0.02)
        await first.aclose()  # saves what it has not saved yet
        second = build_verifier(s, secrets=SECRETS, redis=client, key_prefix=prefix)
        assert second.latency.bound("up", 3000, "whole", "m") is None
        assert second.latency_keeper.load() == 6
        assert second.latency.bound("up", 3000, "whole", "m") == bound
        assert second.latency.take_unsaved() == []  # replayed samples are not saved twice
        await second.aclose()
        # without Redis calibration is in memory only
        mem = build_verifier(verifier_settings(tmp_path / "m"), secrets=SECRETS)
        assert mem.latency_keeper.store is None and mem.latency_keeper.load() == 0
        await mem.aclose()
    finally:
        keys = list(client.scan_iter(match=prefix + "*"))
        if keys:
            client.delete(*keys)
        client.close()


def test_an_operator_quarantines_from_the_cli(tmp_path, capsys):
    import yaml

    from gateway.cli import main

    cfg = tmp_path / "kvgate.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "state_dir": str(tmp_path / "state"),
                "models": [{"id": "m", "context_length": 8192}],
                "upstreams": [
                    {
                        "name": "up",
                        "api_url": "http://127.0.0.1:1/v1",
                        "pool_source": "static",
                        "static_pool_tokens": 4096,
                        "models": ["m"],
                    }
                ],
            }
        )
    )
    assert main(["upstream", "--config", str(cfg), "quarantine", "up", "--min-prompt-tokens", "2048"]) == 0
    assert capsys.readouterr().out == "upstream 'up': quarantined for prompts above 2048 tokens (operator)\n"
    assert main(["upstream", "--config", str(cfg), "quarantine", "up"]) == 0
    assert capsys.readouterr().out == "upstream 'up' is already quarantined\n"
    assert main(["upstream", "--config", str(cfg), "quarantine", "nope"]) == 2
    assert main(["upstream", "--config", str(cfg), "list"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("up: quarantined since ") and out.endswith(
        " for prompts above 2048 tokens (incident operator, detector operator)\n"
    )
    assert main(["upstream", "--config", str(cfg), "clear", "up"]) == 0
    capsys.readouterr()
    # --config after the action, as docs/verifier.md writes it (refused as unrecognised before)
    assert main(["upstream", "list", "--config", str(cfg)]) == 0
    assert capsys.readouterr().out == "no upstream is quarantined\n"
    assert main(["upstream", "quarantine", "up", "--min-prompt-tokens", "100", "--config", str(cfg)]) == 0
    assert main(["upstream", "clear", "up", "--config", str(cfg)]) == 0
    # a negative bound quarantined every prompt
    with pytest.raises(SystemExit) as e:
        main(["upstream", "--config", str(cfg), "quarantine", "up", "--min-prompt-tokens", "-5"])
    assert e.value.code == 2 and capsys.readouterr().err.endswith(
        "kvgate upstream quarantine: error: argument --min-prompt-tokens: -5 is below 0\n"
    )


@pytest.mark.timeout(60)
def test_a_strict_answer_whose_check_panics_is_withheld_and_the_verifiers_own_encode_never_panics(stack, monkeypatch):
    from verifier.shingles import encode as verifier_encode

    st, svc, client, gw = stack
    raw = bundled_encoding()
    t = time.monotonic()
    assert verifier_encode(PANIC_TEXT) == raw.encode_ordinary(" \t" * 32 + "x")  # squeezed: no panic
    assert time.monotonic() - t < 1.0
    monkeypatch.setattr(verifier.findings, "encode", raw.encode_ordinary)  # the raw one panics
    st.text = PANIC_TEXT
    faults = metric("kvgate_verifier_job_faults_total", kind="strict")
    r = ask(client, "h1", "Say something.")
    assert (r.status_code, r.json()["error"]["code"]) == (502, "response_withheld")
    (inc,) = [i for i in svc.incidents.recent if i.detector == "check_fault"]
    assert (inc.tenant, inc.withheld, inc.evidence["error"]) == ("h1", True, "PanicException")
    assert inc.id in r.json()["error"]["message"]
    assert metric("kvgate_verifier_job_faults_total", kind="strict") == faults + 1
    st.text = "A fine answer."  # the next strict answer is checked and released
    r = ask(client, "h1", "Say something.")
    assert (r.status_code, r.json()["choices"][0]["message"]["content"]) == (200, "A fine answer.")


@pytest.mark.timeout(60)
def test_a_prompt_whose_indexing_raises_is_forwarded_and_the_fault_counted(stack, monkeypatch):
    import verifier.jobs

    st, svc, client, gw = stack
    real = verifier.jobs.encode

    class Boom(BaseException):
        pass

    def encode(text: str, *, squeezed: bool = False) -> list[int]:
        if "explode" in text:
            raise Boom
        return real(text, squeezed=squeezed)

    monkeypatch.setattr(verifier.jobs, "encode", encode)
    faults = metric("kvgate_verifier_job_faults_total", kind="ingest")
    st.text = "fine"
    r = ask(client, "p", "Please explode quietly.")
    assert (r.status_code, r.json()["choices"][0]["message"]["content"]) == (200, "fine")
    assert metric("kvgate_verifier_job_faults_total", kind="ingest") == faults + 1
    assert svc.ingest.pending_bytes == 0  # the budget got its bytes back
    assert ask(client, "p", "And now a calm one.").status_code == 200


async def test_public_text_is_shared_by_replicas_in_redis(tmp_path):
    import uuid

    import redis

    from verifier.stage import Exchange

    client = redis.Redis(host="127.0.0.1", port=6379, socket_timeout=2)
    prefix = f"test-policy-{uuid.uuid4().hex[:8]}:"
    s = verifier_settings(tmp_path)
    r1 = build_verifier(s, secrets=SECRETS, redis=client, key_prefix=prefix, incident_path=str(tmp_path / "1"))
    r2 = build_verifier(s, secrets=SECRETS, redis=client, key_prefix=prefix, incident_path=str(tmp_path / "2"))
    try:
        await r1.admit(_exchange("a1", "Remember this: " + MIT))

        async def answer(svc: VerifierService, tid: str) -> list:
            ex: Exchange = _exchange(tid, "The licence, please.")
            await svc.admit(ex)
            n = len(svc.incidents.recent)
            await svc.begin(ex).check_body(MIT, usage=None, finish_reason="stop", ttft_seconds=None)
            await svc.drain()
            return [i for i in svc.incidents.recent[n:] if i.detector == "leak_index"]

        for svc, tid in ((r1, "h1"), (r2, "h2"), (r1, "h3")):  # three tenants' answers, two replicas
            (inc,) = await answer(svc, tid)
            assert (inc.evidence["source_tenant"], inc.evidence["shingles_public_text"]) == ("a1", 0)
        assert await answer(r2, "h4") == []  # public text for every replica
        assert client.scard(prefix + "spread:" + next(iter(_spread_keys(client, prefix)))) == 4
    finally:
        await r1.aclose()
        await r2.aclose()
        keys = list(client.scan_iter(match=prefix + "*"))
        if keys:
            client.delete(*keys)
        client.close()


def _spread_keys(client, prefix: str) -> list[str]:
    """The spread store's keys after ``<prefix>spread:``: ``{<2 hex>}:fp:<16 hex>`` (a Cluster slot tag)."""
    n = len(prefix + "spread:")
    return [k.decode()[n:] for k in client.scan_iter(match=prefix + "spread:{*}:fp:*")]
