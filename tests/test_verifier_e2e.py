"""End to end: the incident through the real gateway app, detected by content.

An engine that reproduces the incident token for token (tests/test_verifier_leaky_engine.py:
paged KV, never scrubbed, rejected prompts admitted on a one-token placeholder, the copy-probe
model) sits behind the gateway (``gateway.app.create_app``, served by uvicorn on loopback) with
the verifier stage. With the faults on and a static pool limit larger than the real pool (as in
the incident), a workload of tenants with canaries and distinct texts leaks; the test's own
records give the ground truth, and every detector's recall is measured against it. With the
faults off and the live pool limit, the same workload plus 5,000 clean responses of 8 tenants
sharing boilerplate give no false positive. (The 5,000 clean responses are driven into the
verifier stage directly, as synthetic exchanges with TTFTs from the engine's timing model:
through HTTP they would not fit the test budget on 2 cores.) The counts are printed (``-s``).
"""

from __future__ import annotations

import asyncio
import difflib
import hashlib
import logging
import random
import time
import uuid

import httpx
import pytest
from conftest import SEEDS
from test_verifier_leaky_engine import LeakyEngine, ServerThread

from config.models import (
    ModelConfig,
    PoolSettings,
    Settings,
    TenantConfig,
    TenantsFile,
    UpstreamConfig,
    VerifierSettings,
)
from gateway.app import create_app
from gateway.ops.tenants import TenantRegistry
from tests.mock_engine import gateway_id
from verifier.build import build_verifier
from verifier.canary import find_canaries, new_canary
from verifier.probe import filler_words
from verifier.service import VerifierService
from verifier.shingles import encode
from verifier.stage import Exchange, ExchangeRequest

SECRETS = {"leak_index_key": b"e2e-leak-key", "cache_salt_key": b"e2e-salt", "admin_key": b"e2e-admin"}
TEXTS = [(SEEDS / "001_85707760a0179a93.txt").read_text(), (SEEDS / "000_cd7ee3cfd92e9ff1.txt").read_text()]
NORMAL = [f"t{i}" for i in range(6)]
STRICT = ["s0", "s1"]


def key_of(tid: str) -> str:
    return f"sk-e2e-{tid}"


def tenants() -> TenantsFile:
    out = []
    for tid in NORMAL + STRICT:
        out.append(
            TenantConfig(
                id=tid,
                api_key_sha256=[hashlib.sha256(key_of(tid).encode()).hexdigest()],
                max_tokens_cap=512,
                verify_sample_rate=1.0,
                strict_verify=tid in STRICT,
            )
        )
    return TenantsFile(tenants=out)


def gw_settings(tmp_path, engine: LeakyEngine, *, static_pool: int | None) -> Settings:
    if static_pool is not None:  # the incident: a configured pool larger than the real one
        up = UpstreamConfig(
            name="leaky", api_url=engine.api_url, pool_source="static", static_pool_tokens=static_pool, models=["m"]
        )
    else:  # the fix: the live pool, read from the engine
        up = UpstreamConfig(
            name="leaky", api_url=engine.api_url, pool_source="kvgate", pool_urls=[engine.info_url], models=["m"]
        )
    return Settings(
        state_dir=str(tmp_path),
        pool=PoolSettings(poll_interval_seconds=1.0),
        verifier=VerifierSettings(
            latency_min_samples=10, latency_min_prompt_tokens=512, quarantine_min_prompt_tokens=100_000
        ),
        models=[ModelConfig(id="m", context_length=8192)],
        upstreams=[up],
    )


class TenantText:
    """Each tenant's own distinct text: a seed translation or its own random one-token words,
    with fresh canaries planted at random offsets."""

    def __init__(self, tid: str, idx: int) -> None:
        self.tid = tid
        self.rng = random.Random(1000 + idx)
        if idx < len(TEXTS):
            self.ids = encode(TEXTS[idx] * 3)
        else:
            words = filler_words()
            mine = self.rng.sample(words, 40)
            self.ids = encode(
                "".join(
                    " "
                    + self.rng.choice(mine)
                    + (f" {idx}{self.rng.randrange(1000)}" if self.rng.random() < 0.2 else "")
                    for _ in range(6000)
                )
            )

    def prompt(self, n_tokens: int, canaries: dict[str, str]) -> str:
        """About ``n_tokens`` tokens: a slice of the tenant's text with a canary every ~120 tokens
        from a random first offset."""
        start = self.rng.randrange(0, len(self.ids) - n_tokens)
        body = self.ids[start : start + n_tokens]
        from verifier.shingles import _counter

        out = []
        first = self.rng.randrange(0, 60)
        out.append(_counter().decode(body[:first]))
        for p in range(first, len(body), 120):
            c = new_canary()
            canaries[c] = self.tid
            out.append(f" {c} ")
            out.append(_counter().decode(body[p : p + 120]))
        return "".join(out)


@pytest.fixture
def leaky_stack(tmp_path):
    engine = LeakyEngine(pool_tokens=4096, context_length=8192, faults=True, per_token_seconds=1e-4).start()
    svc = build_verifier(gw_settings(tmp_path, engine, static_pool=16384), secrets=SECRETS)
    app = create_app(
        gw_settings(tmp_path, engine, static_pool=16384), TenantRegistry(tenants()), verifier=svc, secrets=SECRETS
    )
    gw = ServerThread(app).start()
    try:
        yield engine, svc, gw
    finally:
        gw.stop()
        engine.stop()


def _send(client: httpx.Client, gw_url: str, tid: str, prompt: str, max_tokens: int, stream: bool, rid: str) -> dict:
    """One request; returns what the client received: status, text, error code."""
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "stream": stream, "temperature": 0}
    h = {"authorization": f"Bearer {key_of(tid)}", "x-request-id": rid}
    if not stream:
        r = client.post(gw_url + "/v1/completions", json=body, headers=h)
        j = r.json()
        text = j["choices"][0]["text"] if r.status_code == 200 else ""
        return {"status": r.status_code, "text": text, "error": j.get("error"), "raw": r.text}
    text, error, raw = [], None, []
    with client.stream("POST", gw_url + "/v1/completions", json=body, headers=h) as r:
        status = r.status_code
        for line in r.iter_lines():
            raw.append(line)
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            import json

            obj = json.loads(line[6:])
            if "error" in obj:
                error = obj["error"]
                continue
            for ch in obj.get("choices") or ():
                text.append(ch.get("text") or "")
            if "error" in obj:
                error = obj["error"]
    if status != 200 and not raw:
        error = {"code": "?"}
    full_raw = "\n".join(raw)
    if status != 200:
        import json

        try:
            error = json.loads(full_raw)["error"]
        except Exception:
            pass
    return {"status": status, "text": "".join(text), "error": error, "raw": full_raw}


class Truth:
    """Ground truth from the test's own records: which tenant planted which canary, every
    prompt's token ids by tenant."""

    def __init__(self) -> None:
        self.canaries: dict[str, str] = {}
        self.prompts: list[tuple[str, list[int]]] = []
        self._matchers: list[tuple[str, difflib.SequenceMatcher]] = []

    def add_prompt(self, tid: str, text: str) -> None:
        ids = encode(text)
        self.prompts.append((tid, ids))
        sm = difflib.SequenceMatcher(None, autojunk=False)
        sm.set_seq2(ids)
        self._matchers.append((tid, sm))

    def foreign_canaries(self, tid: str, text: str) -> list[str]:
        return [c for c in find_canaries(text) if self.canaries.get(c) not in (None, tid)]

    def longest_foreign_run(self, tid: str, text: str, enough: int | None = None) -> int:
        """The longest run of ``text``'s tokens found in another tenant's prompt; ``enough``: stop
        at the first run at least that long (for a caller that only asks whether one is)."""
        r = encode(text)
        best = 0
        for owner, sm in reversed(self._matchers):  # the latest first: a leak reads recently freed pages
            if owner == tid:
                continue
            sm.set_seq1(r)
            m = sm.find_longest_match(0, len(r), 0, len(sm.b))
            best = max(best, m.size)
            if enough is not None and best >= enough:
                break
        return best


def _wait_idle(svc: VerifierService, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while svc.queued_jobs or svc.stats["in_flight"]:
        assert time.monotonic() < deadline, "verifier queue did not drain"
        time.sleep(0.01)


def _upstream_request_ids(caplog: pytest.LogCaptureFixture, rids: list[str], timeout: float = 5.0) -> dict[str, str]:
    """Each client request id of ``rids`` -> the ``x-request-id`` the gateway sent the engine for
    it (its access line's ``upstream_request_id``, each asserted to be the gateway's own id),
    waiting up to ``timeout`` seconds for the last lines."""
    deadline = time.monotonic() + timeout
    while True:
        lines = {r.fields["request_id"]: r.fields for r in caplog.records if r.name == "kvgate.access"}
        if all(rid in lines for rid in rids) or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    return {rid: gateway_id(lines[rid]["upstream_request_id"], rid) for rid in rids}


@pytest.mark.timeout(150)
def test_incident_detected_end_to_end(leaky_stack, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="kvgate.access")
    engine, svc, gw = leaky_stack
    truth = Truth()
    texts = {tid: TenantText(tid, i) for i, tid in enumerate(NORMAL + STRICT)}
    rng = random.Random(42)
    records = []  # (rid, tid, prompt_tokens, leaking, received)
    order = NORMAL + STRICT
    with httpx.Client(timeout=60) as client:
        # the probe, through the gateway as a tenant: fails (exit 1)
        from gateway.cli import main

        assert (
            main(
                [
                    "probe",
                    "--base-url",
                    gw.url + "/v1",
                    "--api-key",
                    key_of("t5"),
                    "--model",
                    "m",
                    "--limit",
                    "8192",
                    "--max-tokens",
                    "64",
                ]
            )
            == 1
        )

        def one(tid: str, n: int, max_tokens: int, stream: bool) -> None:
            prompt = texts[tid].prompt(n, truth.canaries)
            rid = f"e2e-{uuid.uuid4().hex[:12]}"
            got = _send(client, gw.url, tid, prompt, max_tokens, stream, rid)
            truth.add_prompt(tid, prompt)
            n_tok = len(encode(prompt))
            records.append((rid, tid, n_tok, n_tok > engine.state.pool_tokens, got, max_tokens, stream))

        # calibration: admitted prompts of 2,100-3,300 tokens (one length bucket), under the pool;
        # 20 streamed and 20 whole, so both kinds are calibrated (min_samples 10) before any leak
        for i in range(40):
            one(order[i % len(order)], rng.randrange(2100, 3300), 16, i % 2 == 0)
        # rounds: an admitted prompt from one tenant, then an over-pool prompt from another
        for i in range(40):
            a = order[i % len(order)]
            b = order[(i + 3) % len(order)]
            one(a, rng.randrange(1800, 3300), 16, i % 2 == 1)
            one(b, rng.randrange(4300, 6800), rng.choice([24, 40, 64, 128, 200]), i % 3 == 0)
    _wait_idle(svc)
    incidents = {}
    for inc in svc.incidents.recent:
        incidents.setdefault(inc.request_id, set()).add(inc.detector)
    # ground truth: what the ENGINE produced for each request (the client of a strict tenant may
    # have received nothing); the engine echoes the admitted prompts, leaks for the others. The
    # engine knows a request by the gateway's id for it, its access line's upstream_request_id
    produced = {r["x_request_id"]: r for r in engine.state.requests if r.get("x_request_id")}
    sent = _upstream_request_ids(caplog, [rec[0] for rec in records])
    leaking = [rec for rec in records if rec[3]]
    admitted = [rec for rec in records if not rec[3]]
    n_canary = n_canary_hit = n_long = n_long_hit = n_short = n_short_hit = n_lat = 0
    strict_leaks = strict_clean_received = 0
    strict_by = {"canary": 0, "leak_index": 0, "latency": 0}
    for rid, tid, n, _, got, mt, stream in leaking:
        out_text = produced[sent[rid]]["output_text"]
        det = incidents.get(rid, set())
        n_lat += "latency" in det
        if "latency" not in det:
            bound = svc.latency.bound("leaky", n, "stream" if stream else "whole", "m")
            print(f"  latency miss: {rid} {tid} stream={stream} prompt={n} bound now={bound}")
        if tid in STRICT:
            # strict: withheld (a stream is cut at its first text by the latency check, so the
            # content detectors never see the rest); the client received no leaked text at all
            strict_leaks += 1
            for d in strict_by:
                strict_by[d] += d in det
            assert not truth.foreign_canaries(tid, got["text"]) and truth.longest_foreign_run(tid, got["text"]) == 0
            assert got["status"] == 502 or stream
            if got["status"] == 502:
                assert got["error"]["code"] == "response_withheld" and "incident inc_" in got["error"]["message"]
            strict_clean_received += got["text"] == ""
            continue
        # non-strict: the verifier saw the whole text (sampled at 100%, checked in the background)
        assert got["text"] == out_text
        cans = truth.foreign_canaries(tid, out_text)
        run = truth.longest_foreign_run(tid, out_text, enough=50)  # only run >= 50, or its length below 50, counts
        if cans:
            n_canary += 1
            n_canary_hit += "canary" in det
        if run >= 50:
            n_long += 1
            n_long_hit += "leak_index" in det
        elif run >= 8 and not cans:
            n_short += 1
            n_short_hit += bool(det & {"leak_index", "canary"})
    false_pos = [(rid, incidents[rid]) for rid, *_ in admitted if rid in incidents]
    print(
        f"\nfaults on: {len(records)} responses, {len(leaking)} leaking (over the pool), {len(admitted)} admitted;"
        f" non-strict leaking: {len(leaking) - strict_leaks}"
    )
    print(f"  whole foreign canary: {n_canary}, flagged by the canary scan: {n_canary_hit}")
    print(f"  run >= 50 tokens of another tenant's prompt: {n_long}, flagged by the leak index: {n_long_hit}")
    print(f"  only shorter runs (8-49 tokens, no canary): {n_short}, caught by content checks: {n_short_hit}")
    print(f"  flagged too fast by the latency detector: {n_lat}/{len(leaking)}")
    print(
        f"  strict tenants: {strict_leaks} leaking responses, {strict_clean_received} received no text at all; "
        f"flagged by {strict_by}"
    )
    print(f"  incidents on admitted responses: {len(false_pos)}")
    assert n_canary > 0 and n_long > 0
    assert n_canary_hit == n_canary and n_long_hit == n_long
    assert n_lat == len(leaking)
    assert strict_leaks > 0 and strict_clean_received == strict_leaks
    assert false_pos == []
    # leaks of several source tenants raised high-severity alerts, but quarantined nothing: tenants
    # can plant such evidence (two keys of one actor); only kvgate's own canaries or an operator do
    assert not svc.quarantine.records()
    alerts = [i for i in svc.incidents.recent if i.evidence.get("alert") == "two_sources"]
    assert alerts and {i.evidence["severity"] for i in alerts} == {"high"}
    # the gateway's /metrics carries the verifier's counters
    metrics = httpx.get(gw.url + "/metrics").text
    for det in ("canary", "leak_index", "latency"):
        assert f'kvgate_verifier_incidents_total{{detector="{det}",upstream="leaky"}}' in metrics
    assert 'kvgate_verifier_alerts_total{reason="two_sources",upstream="leaky"}' in metrics
    # the operator, alerted, quarantines: long prompts are refused, short ones served
    svc.quarantine.put("leaky", "operator", "operator", 1024)
    with httpx.Client(timeout=60) as client:
        refused = _send(client, gw.url, "t4", texts["t4"].prompt(2000, truth.canaries), 16, False, "e2e-q-refused")
        assert refused["status"] == 503 and refused["error"]["code"] == "upstream_unavailable"
        assert "quarantined" in refused["error"]["message"]
        short = _send(client, gw.url, "t4", texts["t4"].prompt(400, truth.canaries), 16, False, "e2e-q-short")
        assert short["status"] == 200
        # the operator clears it with the CLI; running gateways pick it up within a second
        cfg = tmp_path / "kvgate.yaml"
        cfg.write_text(
            f"state_dir: {tmp_path}\nmodels: [{{id: m, context_length: 8192}}]\n"
            f"upstreams: [{{name: leaky, api_url: '{engine.api_url}', pool_source: static, "
            "static_pool_tokens: 16384, models: [m]}]\n"
        )
        from gateway.cli import main

        assert main(["upstream", "--config", str(cfg), "clear", "leaky"]) == 0
        time.sleep(1.1)
        again = _send(client, gw.url, "t4", texts["t4"].prompt(2000, truth.canaries), 16, False, "e2e-q-again")
        assert again["status"] == 200


@pytest.mark.timeout(60)
def test_usage_drift_against_an_engine_that_miscounts(tmp_path):
    """The drift detector, proven separately: an engine that reports usage.prompt_tokens = 1
    (in the runbook's incident the counts matched; this is the other known failure)."""
    engine = LeakyEngine(pool_tokens=4096, context_length=8192, faults=False, wrong_usage=True).start()
    s = gw_settings(tmp_path, engine, static_pool=None)
    svc = build_verifier(s, secrets=SECRETS)
    gw = ServerThread(create_app(s, TenantRegistry(tenants()), verifier=svc, secrets=SECRETS)).start()
    try:
        with httpx.Client(timeout=30) as client:
            prompt = TEXTS[0][:1500]
            n = len(encode(prompt))
            for i, stream in enumerate((False, True)):
                got = _send(client, gw.url, "t0", prompt, 8, stream, f"drift-{i}")
                assert got["status"] == 200
            got = _send(client, gw.url, "s0", prompt, 8, False, "drift-strict")
            assert got["status"] == 200  # drift is reported, never withheld
        _wait_idle(svc)
        drift = [i for i in svc.incidents.recent if i.detector == "usage_drift"]
        assert [i.request_id for i in drift] == ["drift-0", "drift-1", "drift-strict"]
        for i in drift:
            assert (
                i.evidence["gateway_prompt_tokens"],
                i.evidence["engine_prompt_tokens"],
                i.evidence["difference_tokens"],
            ) == (n, 1, 1 - n)
            assert i.upstream == "leaky" and not i.confirmed
        assert {i.detector for i in svc.incidents.recent} == {"usage_drift"}
    finally:
        gw.stop()
        engine.stop()


BOILER_SYSTEM = (
    "You are the support assistant of a game studio. Answer politely, never reveal internal "
    "tooling, and keep answers under two hundred words. Quote the passage below when relevant."
)


@pytest.mark.timeout(150)
def test_no_false_positives_with_faults_off(tmp_path):
    """Faults off, the live pool limit: the same workload through the gateway (over-length
    prompts now get a 400 at the edge), then 5,000 clean responses of 8 tenants sharing one
    system prompt and one quoted passage, driven into the verifier stage directly."""
    engine = LeakyEngine(pool_tokens=4096, context_length=8192, faults=False, per_token_seconds=1e-4).start()
    s = gw_settings(tmp_path, engine, static_pool=None)
    svc = build_verifier(s, secrets=SECRETS)
    gw = ServerThread(create_app(s, TenantRegistry(tenants()), verifier=svc, secrets=SECRETS)).start()
    truth = Truth()
    texts = {tid: TenantText(tid, i) for i, tid in enumerate(NORMAL + STRICT)}
    rng = random.Random(43)
    order = NORMAL + STRICT
    statuses: dict[int, int] = {}
    try:
        with httpx.Client(timeout=60) as client:
            from gateway.cli import main

            # the probe through the gateway at the live limit (3276): clean
            assert (
                main(
                    [
                        "probe",
                        "--base-url",
                        gw.url + "/v1",
                        "--api-key",
                        key_of("t5"),
                        "--model",
                        "m",
                        "--server-info-url",
                        engine.info_url,
                    ]
                )
                == 0
            )
            for i in range(14):
                got = _send(
                    client,
                    gw.url,
                    order[i % 8],
                    texts[order[i % 8]].prompt(rng.randrange(1800, 2700), truth.canaries),
                    16,
                    i % 2 == 0,
                    f"clean-cal-{i}",
                )
                statuses[got["status"]] = statuses.get(got["status"], 0) + 1
            for i in range(40):
                a, b = order[i % 8], order[(i + 3) % 8]
                for who, n, mt, st in (
                    (a, rng.randrange(1800, 2700), 16, False),
                    (b, rng.randrange(4300, 6800), rng.choice([24, 64, 128]), i % 3 == 0),
                ):
                    got = _send(client, gw.url, who, texts[who].prompt(n, truth.canaries), mt, st, f"clean-{i}-{who}")
                    statuses[got["status"]] = statuses.get(got["status"], 0) + 1
                    if got["status"] == 400:
                        assert got["error"]["code"] == "context_length_exceeded"
        _wait_idle(svc)
        http_incidents = list(svc.incidents.recent)
        assert statuses == {200: 54, 400: 40}
        assert http_incidents == []

        # 5,000 clean responses from 8 tenants sharing boilerplate, straight into the stage
        passage = TEXTS[0][200:1400]
        tids = [f"shared-{i}" for i in range(8)]
        tcfg = {t: TenantConfig(id=t, verify_sample_rate=1.0) for t in tids}
        own_words = {t: rng.sample(filler_words(), 30) for t in tids}
        lat_rng = random.Random(5)
        n_checked = 0
        runner = asyncio.Runner()  # the guard's methods are coroutines; this thread has no loop
        for j in range(5000):
            t = tids[j % 8]
            question = " ".join(rng.choice(own_words[t]) for _ in range(rng.randrange(300, 2500)))
            prompt = f'{BOILER_SYSTEM}\n\n"{passage}"\n\nQuestion {j}: {question}'
            n = len(encode(prompt))
            # copy-probe answers (echo of the prompt's start: the shared system prompt and passage),
            # quotes of the passage, or the tenant's own words
            kind = j % 3
            if kind == 0:
                answer = prompt[: rng.randrange(100, 900)]
            elif kind == 1:
                a0 = rng.randrange(0, len(passage) - 300)
                answer = "As quoted: " + passage[a0 : a0 + rng.randrange(100, 300)]
            else:
                answer = " ".join(rng.choice(own_words[t]) for _ in range(60))
            ttft = (0.002 + 1e-4 * n) * (1 + lat_rng.uniform(0, 0.1))
            if lat_rng.random() < 0.01:
                ttft *= lat_rng.uniform(1.5, 4)  # a slow outlier (queueing)
            req = ExchangeRequest(f"syn-{j}", tcfg[t], "leaky", "m", n, False, time.monotonic())
            ex = Exchange(req, prompt)
            g = svc.begin(ex)
            runner.run(
                g.check_body(
                    answer,
                    usage={"prompt_tokens": n, "completion_tokens": 16},
                    finish_reason="length",
                    ttft_seconds=ttft,
                )
            )
            n_checked += 1
            if svc.queued_jobs > 2000:
                _wait_idle(svc, timeout=60)
        runner.close()
        _wait_idle(svc, timeout=90)
        by = {}
        for inc in svc.incidents.recent:
            by[inc.detector] = by.get(inc.detector, 0) + 1
        lat_fp = by.get("latency", 0)
        print(
            f"\nfaults off: {sum(statuses.values())} responses through the gateway {statuses}; "
            f"{n_checked} synthetic clean responses of 8 tenants sharing boilerplate"
        )
        print(f"  incidents: {by or 'none'}; latency false-positive rate {lat_fp / n_checked:.4%}")
        assert by.get("canary", 0) == 0 and by.get("leak_index", 0) == 0
        assert lat_fp / n_checked <= 0.001
        assert not svc.quarantine.records()
    finally:
        gw.stop()
        engine.stop()


@pytest.mark.timeout(60)
def test_gateway_runs_the_periodic_probe_without_traffic(tmp_path):
    """``verifier.probe_interval_seconds``: the gateway starts the probe with the app; with no
    client request at all, the leaking upstream is found and quarantined."""
    engine = LeakyEngine(pool_tokens=4096, context_length=8192, faults=True).start()
    s = gw_settings(tmp_path, engine, static_pool=16384)
    s.verifier.probe_interval_seconds = 0.3
    s.verifier.quarantine_min_prompt_tokens = 1024
    svc = build_verifier(s, secrets=SECRETS)
    gw = ServerThread(create_app(s, TenantRegistry(tenants()), verifier=svc, secrets=SECRETS)).start()
    try:
        deadline = time.monotonic() + 30
        while not svc.quarantine.records() and time.monotonic() < deadline:
            time.sleep(0.05)
        (inc,) = [i for i in svc.incidents.recent if i.detector == "probe"][:1]
        assert (inc.upstream, inc.confirmed, inc.tenant) == ("leaky", True, "kvgate-probe")
        with httpx.Client(timeout=30) as client:
            got = _send(client, gw.url, "t0", TEXTS[0][:8000], 16, False, "after-probe")
        assert got["status"] == 503 and got["error"]["code"] == "upstream_unavailable"
    finally:
        gw.stop()
        engine.stop()
