"""``kvgate deploy-gate`` and ``kvgate probe`` against engines on loopback: exit codes 0/1/2,
human and JSON output."""

from __future__ import annotations

import json

import pytest

from gateway.cli import main

pytestmark = pytest.mark.engine("leaky")


def _dead_url() -> str:
    from tests.gateway_harness import refused_port

    return f"http://127.0.0.1:{refused_port()}/server_info"


def test_deploy_gate_exit_codes(engine, capsys):
    # pool 4096 < 8192 x 1.25 = 10240: FAIL
    assert main(["deploy-gate", "--server-info-url", engine.info_url]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out == [
        f"{engine.info_url}: kv_pool=4096 (max_total_num_tokens) context=8192 required=10240 "
        "effective_limit=3276  FAIL: pool smaller than context window x headroom; over-length "
        "prompts reach the rejection path",
        "deploy gate: FAIL (block the deploy)",
    ]
    # pool 4096 >= 3000 x 1.25 = 3750: OK (the given context length wins over the engine's)
    assert main(["deploy-gate", "--server-info-url", engine.info_url, "--context-length", "3000", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc == {
        "ok": True,
        "exit_code": 0,
        "headroom": 1.25,
        "nodes": [
            {
                "url": engine.info_url,
                "status": "ok",
                "pool_tokens": 4096,
                "pool_field": "max_total_num_tokens",
                "context_length": 3000,
                "required_tokens": 3750,
                "effective_limit_tokens": 3000,
                "max_req_input_len": 8186,
                "error": None,
                "read_from": "server_info",
                "rank_pools_tokens": [4096],
            }
        ],
    }
    # exactly at the boundary: 3276.8 x 1.25 -> required 4096 passes, 3277 x 1.25 = 4096.25 fails
    assert main(["deploy-gate", "--server-info-url", engine.url, "--context-length", "3277"]) == 1
    capsys.readouterr()
    # the runbook's numbers, read live: pool 681,280, context 1,048,576 -> FAIL, limit 545,024
    engine.state.pool_tokens = 681_280
    engine.state.context_length = 1_048_576
    assert main(["deploy-gate", "--server-info-url", engine.info_url, "--json"]) == 1
    node = json.loads(capsys.readouterr().out)["nodes"][0]
    assert (node["required_tokens"], node["effective_limit_tokens"]) == (1_310_720, 545_024)
    engine.state.pool_tokens = 2_040_000
    assert main(["deploy-gate", "--server-info-url", engine.info_url, "--json"]) == 0
    node = json.loads(capsys.readouterr().out)["nodes"][0]
    assert node["effective_limit_tokens"] == 1_048_570  # context less SGLang's 6-token reserve


def test_deploy_gate_fails_closed(engine, capsys):
    dead = _dead_url()
    # one node fine, one unreachable -> 2
    code = main(["deploy-gate", "--server-info-url", engine.info_url, dead, "--context-length", "3000", "--json"])
    assert code == 2
    doc = json.loads(capsys.readouterr().out)
    assert [n["status"] for n in doc["nodes"]] == ["ok", "unreachable"] and doc["exit_code"] == 2
    # a server without the pool field -> 2
    engine.state.info_missing = True
    assert main(["deploy-gate", "--server-info-url", engine.info_url]) == 2
    out = capsys.readouterr().out.splitlines()
    assert out == [
        f"{engine.info_url}: UNKNOWN (no_pool_field): none of max_total_num_tokens, kv_pool_tokens, "
        "max_total_tokens in server info - fail closed",
        "deploy gate: UNKNOWN (fail closed: block the deploy)",
    ]
    # the /get_server_info fallback is used when /server_info is missing
    engine.state.info_missing = False
    assert (
        main(["deploy-gate", "--server-info-url", engine.url + "/nothing/server_info", "--context-length", "100"]) == 2
    )
    capsys.readouterr()


def test_probe_finds_the_leak_and_passes_a_fixed_engine(engine, capsys):
    # gateway-style misconfiguration: a limit of 8192 on a 4096-token pool, faults on
    assert main(["probe", "--base-url", engine.api_url, "--limit", "8192", "--max-tokens", "64", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["outcome"] == "leak" and doc["limit"] == 8192 and doc["exit_code"] == 1
    labels = [(s["label"], s["prompt_tokens"], s["status"]) for s in doc["steps"]]
    assert labels == [
        ("plant@L/2", 4032, 200),
        ("plant@L", 8128, 200),
        ("fresh@L", 8128, 200),
        ("plant@L+1", 8129, 200),
        ("fresh@L+1", 8129, 200),
    ]
    assert doc["steps"][0]["surfaced"] == 0 and doc["surfaced"] >= 1
    # the live limit read from the engine (3276), faults off: clean
    engine.state.faults = False
    code = main(["probe", "--base-url", engine.api_url, "--server-info-url", engine.info_url])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.splitlines()[0] == f"probe of {engine.api_url}: live limit 3276"
    assert out.splitlines()[-1] == "probe: CLEAN (no canary surfaced)"
    # faults off but the limit still too high: the engine answers 400 at "the limit", so the boundary
    # was never exercised: could not tell (exit 2), never CLEAN
    assert main(["probe", "--base-url", engine.api_url, "--limit", "8192"]) == 2
    assert capsys.readouterr().out.splitlines()[-1] == (
        "probe: UNKNOWN (the at-limit request plant@L (prompt 8128 + max_tokens 64 = 8192 tokens) was answered"
        " HTTP 400, not 200: the boundary was not exercised (the limit or the prompt sizing does not match the"
        " served model))"
    )


def test_probe_could_not_tell(capsys):
    dead = _dead_url().rsplit("/", 1)[0]
    assert main(["probe", "--base-url", dead + "/v1", "--limit", "4096"]) == 2
    assert capsys.readouterr().out.splitlines()[-1] == "probe: UNKNOWN (some probe requests failed)"
    assert main(["probe", "--base-url", dead + "/v1", "--server-info-url", dead + "/server_info"]) == 2
    assert "live limit unknown" in capsys.readouterr().out
