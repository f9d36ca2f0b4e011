"""The verifier against the bundled backend (``python -m gpu_backend``, real processes):

- ``kvgate deploy-gate`` on backends whose pools are below and above context x headroom;
- the incident end to end: ``KVGATE_FAULTS=admit_rejected,skip_transfer_check,no_scrub``, the
  ``copy-probe`` model, the gateway app with a static pool limit larger than the real pool; the
  probe fails, and canary scan, leak index and latency detector are measured against the test's
  own ground truth (counts printed with ``-s``).
"""

from __future__ import annotations

import gc
import json
import os
import random
import socket
import subprocess
import sys
import time
import uuid

import httpx
import pytest
from conftest import ROOT
from test_verifier_e2e import (
    NORMAL,
    SECRETS,
    STRICT,
    TenantText,
    Truth,
    _send,
    _wait_idle,
    gw_settings,
    key_of,
    tenants,
)
from test_verifier_leaky_engine import ServerThread

from gateway.app import create_app
from gateway.cli import main
from gateway.ops.tenants import TenantRegistry
from verifier.build import build_verifier
from verifier.shingles import encode

FAULTS = "admit_rejected,skip_transfer_check,no_scrub"


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Bundled:
    """One ``--role all`` backend process on a free port; ``stop()`` kills it."""

    def __init__(self, *, faults: str = "", model: str = "copy-probe", prefill_pool: int | None = None) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        env.pop("KVGATE_FAULTS", None)
        if faults:
            env["KVGATE_FAULTS"] = faults
        args = [
            sys.executable,
            "-m",
            "gpu_backend",
            "--role",
            "all",
            "--port",
            str(self.port),
            "--model",
            model,
            "--device",
            "cpu",
        ]
        if prefill_pool:
            args += ["--prefill-max-total-tokens", str(prefill_pool)]
        self.proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    @property
    def api_url(self) -> str:
        return self.url + "/v1"

    @property
    def info_url(self) -> str:
        return self.url + "/server_info"

    def wait(self, timeout: float = 90.0) -> "Bundled":
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"backend exited: {self.proc.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(self.info_url, timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("backend did not start")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stderr:
            self.proc.stderr.close()


def test_the_backend_freezes_its_startup_heap(monkeypatch):
    """Before it serves, the backend process moves its startup objects out of the collector's
    scans: unfrozen, a full collection on an engine's worker thread (91-107 ms on 2 cores) landed
    inside a leaky one-token prefill and hid it from the latency detector in about half of the runs
    of the incident test below."""
    import uvicorn

    from gpu_backend import cli

    seen = {}

    def serve(app, **kw):  # stands in for uvicorn.run: what the server would start with
        tracked = gc.get_objects()
        objs = [app, app.state.engines["prefill"].model, app.state.engines["decode"].pool]
        seen["tracked"] = [any(o is x for o in tracked) for x in objs]
        seen["frozen"] = gc.get_freeze_count()
        seen["port"] = kw["port"]

    monkeypatch.setattr(uvicorn, "run", serve)
    gc.unfreeze()  # whatever this process froze before is tracked again
    try:
        assert cli.main(["--role", "all", "--model", "tiny-random", "--device", "cpu", "--port", "30999"]) == 0
    finally:
        gc.unfreeze()
    assert (seen["tracked"], seen["port"]) == ([False, False, False], 30999)
    assert seen["frozen"] > 0


@pytest.mark.timeout(120)
def test_deploy_gate_against_the_bundled_backend(capsys):
    small = Bundled(model="tiny-random")  # prefill pool 4,096 < 8,192 x 1.25
    big = Bundled(model="tiny-random", prefill_pool=10_240)  # 10,240 = 8,192 x 1.25 exactly
    try:
        small.wait()
        big.wait()
        assert main(["deploy-gate", "--server-info-url", big.info_url, "--json"]) == 0
        node = json.loads(capsys.readouterr().out)["nodes"][0]
        assert (node["status"], node["pool_tokens"], node["context_length"], node["required_tokens"]) == (
            "ok",
            10_240,
            8192,
            10_240,
        )
        assert main(["deploy-gate", "--server-info-url", small.info_url, "--json"]) == 1
        node = json.loads(capsys.readouterr().out)["nodes"][0]
        assert (node["status"], node["pool_tokens"], node["effective_limit_tokens"]) == ("too_small", 4096, 3276)
        # every prefill node must pass: one small node fails the gate
        assert main(["deploy-gate", "--server-info-url", big.info_url, small.info_url]) == 1
        capsys.readouterr()
        # a node that went away: could not tell, fail closed
        small.stop()
        assert main(["deploy-gate", "--server-info-url", big.info_url, small.info_url]) == 2
        assert "UNKNOWN (unreachable)" in capsys.readouterr().out
    finally:
        small.stop()
        big.stop()


@pytest.mark.timeout(170)
def test_incident_detected_against_the_bundled_backend(tmp_path):
    backend = Bundled(faults=FAULTS, model="copy-probe").wait()
    s = gw_settings(tmp_path, backend, static_pool=16384)  # the incident: limit 8,192 on a 4,096 pool
    s.models[0].upstream_model = "kvgate-tiny"
    s.verifier.latency_min_samples = 5  # streamed and non-streamed TTFTs calibrate apart
    svc = build_verifier(s, secrets=SECRETS)
    gw = ServerThread(create_app(s, TenantRegistry(tenants()), verifier=svc, secrets=SECRETS)).start()
    # the gateway runs in this process, whose heap holds every earlier test's objects: frozen, as
    # `kvgate serve` freezes its startup objects, so that no full collection of them lands inside
    # a streamed TTFT the gateway measures (the backend, a process of its own, freezes its own)
    gc.collect()
    gc.freeze()
    truth = Truth()
    order = NORMAL + STRICT
    texts = {tid: TenantText(tid, i) for i, tid in enumerate(order)}
    rng = random.Random(7)
    pool = 4090  # the backend's max_req_input_len: longer prompts take the rejection path
    records = []
    try:
        with httpx.Client(timeout=120) as client:
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
                rid = f"bk-{uuid.uuid4().hex[:12]}"
                got = _send(client, gw.url, tid, prompt, max_tokens, stream, rid)
                truth.add_prompt(tid, prompt)
                n_tok = len(encode(prompt))
                records.append((rid, tid, n_tok, n_tok > pool, got, stream))

            # calibration: admitted prompts, streamed and not, long (the upper half of the bucket
            # under the pool: on 2 CPU cores a 2,000-token prefill is only ~40 ms) and short
            for i in range(12):
                one(order[i % 8], rng.randrange(2600, 3400), 16, i % 2 == 1)
                one(order[(i + 1) % 8], rng.randrange(130, 220), 16, i % 2 == 1)
            for i in range(24):
                a, b = order[i % 8], order[(i + 3) % 8]
                one(a, rng.randrange(2600, 3400), 16, i % 2 == 1)
                one(b, rng.randrange(4300, 6800), rng.choice([24, 64, 128]), i % 4 == 3)
        _wait_idle(svc)
    finally:
        gc.unfreeze()
        gw.stop()
        backend.stop()
    det_by_rid: dict[str, set[str]] = {}
    for inc in svc.incidents.recent:
        det_by_rid.setdefault(inc.request_id, set()).add(inc.detector)
    leaking = [r for r in records if r[3]]
    admitted = [r for r in records if not r[3]]
    c = dict.fromkeys(
        [
            "canary",
            "canary_hit",
            "long",
            "long_hit",
            "short",
            "short_hit",
            "lat_whole",
            "lat_whole_hit",
            "lat_stream",
            "lat_stream_hit",
            "strict",
            "strict_withheld",
        ],
        0,
    )
    strict_longest = 0
    for rid, tid, n, _, got, stream in leaking:
        det = det_by_rid.get(rid, set())
        key = "lat_stream" if stream else "lat_whole"
        c[key] += 1
        c[key + "_hit"] += "latency" in det
        if tid in STRICT:
            c["strict"] += 1
            c["strict_withheld"] += got["status"] == 502 or (stream and got["text"] == "")
            assert not truth.foreign_canaries(tid, got["text"])
            strict_longest = max(strict_longest, truth.longest_foreign_run(tid, got["text"]))
            continue
        assert got["status"] == 200
        cans = truth.foreign_canaries(tid, got["text"])
        run = truth.longest_foreign_run(tid, got["text"])
        if cans:
            c["canary"] += 1
            c["canary_hit"] += "canary" in det
        if run >= 50:
            c["long"] += 1
            c["long_hit"] += "leak_index" in det
        elif run >= 8 and not cans:
            c["short"] += 1
            c["short_hit"] += bool(det & {"canary", "leak_index"})
    content_fp = [rid for rid, *_ in admitted if det_by_rid.get(rid, set()) & {"canary", "leak_index"}]
    lat_fp = [rid for rid, *_ in admitted if "latency" in det_by_rid.get(rid, set())]
    print(
        f"\nbundled backend, faults on: {len(records)} responses, {len(leaking)} over the pool, "
        f"{len(admitted)} admitted"
    )
    print(f"  whole foreign canary: {c['canary']}, flagged by the canary scan: {c['canary_hit']}")
    print(f"  run >= 50 tokens of another tenant's prompt: {c['long']}, flagged by the leak index: {c['long_hit']}")
    print(f"  only shorter runs (8-49, no canary): {c['short']}, caught by content checks: {c['short_hit']}")
    print(
        f"  latency: non-streamed {c['lat_whole_hit']}/{c['lat_whole']}, streamed {c['lat_stream_hit']}/"
        f"{c['lat_stream']} flagged too fast"
    )
    print(
        f"  strict: {c['strict']} leaking, {c['strict_withheld']} withheld with nothing sent; "
        f"longest foreign run received {strict_longest} tokens"
    )
    print(f"  false positives on admitted responses: content {len(content_fp)}, latency {len(lat_fp)}")
    assert c["canary"] > 0 and c["canary_hit"] == c["canary"]
    assert c["long"] > 0 and c["long_hit"] == c["long"]
    assert c["lat_whole"] > 0 and c["lat_whole_hit"] == c["lat_whole"]
    assert c["lat_stream"] > 0 and c["lat_stream_hit"] == c["lat_stream"]
    assert c["strict"] > 0 and strict_longest == 0
    assert content_fp == []
