"""The live pool as current SGLang and vLLM report it, through the real gateway and the real
``kvgate deploy-gate``: every data-parallel rank (``/v1/loads``, else ``internal_states``), the
renamed ``/server_info``, and vLLM's KV capacity (``/v1/server/kv-cache``, ``vllm:cache_config_info``).
The engines' answers are the fixtures of tests/engine_pool_fixtures.py, each citing its source."""

from __future__ import annotations

import json

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from config.engine_pool import (
    MAX_REPORTED,
    EnginePoolError,
    sglang_pool,
    vllm_capacity_from_endpoint,
    vllm_capacity_from_metrics,
)
from gateway.cli import main
from gpu_backend.servers import add_common_routes, loads_body
from tests.engine_pool_fixtures import (
    FixtureEngine,
    sglang_loads,
    sglang_server_info,
    vllm_cache_config_metrics,
    vllm_kv_cache,
    vllm_models,
)
from tests.gateway_harness import MODEL, Gateway, settings_for, wait_for

#: rank 0 holds 12,288 tokens, rank 1 only 4,096: rank 1's limit is floor(4096 / 1.25) = 3,276,
#: rank 0's min(8192, 9830, 8186) = 8,186 (what a reader of the top level alone applies)
DP2 = [12_288, 4_096]
#: 4,005 prompt tokens with the bundled template (3,996 x "hello", 9 of ChatML): fits rank 0 (8,186), not rank 1 (3,276)
LONG = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hello " * 3996}]}


def _gateway(engine: FixtureEngine, pool_source: str = "sglang", info_path: str = "/server_info") -> Gateway:
    pool_url = engine.url + ("/v1/models" if pool_source == "vllm" else info_path)
    up = {"name": "u", "api_url": engine.url + "/v1", "pool_source": pool_source, "pool_urls": [pool_url]}
    up["models"] = [MODEL]
    return Gateway(settings_for([up], gateway={"max_body_bytes": 1 << 20})).start()


def _ready(gw: Gateway) -> dict:
    wait_for(lambda: gw.gw.ready()[0], timeout=5)
    return gw.gw.ready()[1]["upstreams"][0]


@pytest.mark.parametrize("loads", [True, False], ids=["v1-loads", "internal-states"])
def test_a_prompt_that_fits_rank_0_but_not_rank_1_gets_the_400(loads):
    bodies = {"/server_info": sglang_server_info(DP2), "/v1/loads": sglang_loads(DP2) if loads else None}
    engine = FixtureEngine(bodies).start()
    gw = _gateway(engine)
    try:
        status = _ready(gw)
        assert (status["limit_tokens"], status["pool_tokens"]) == (3276, 4096)
        read_from = "/v1/loads" if loads else "internal_states"
        assert status["nodes"] == [
            {"url": engine.url + "/server_info", "rank_pools_tokens": DP2, "read_from": read_from}
        ]
        assert ("/v1/loads?include=core,memory" in engine.routes.hits) is True  # asked either way
        with gw.client() as c:
            r = c.post("/v1/chat/completions", json=LONG)
            assert r.status_code == 400, r.text
            assert r.json()["error"] == {
                "message": "This model's maximum context length is 3276 tokens. However, you requested 4013 tokens "
                "(4005 in the messages, 8 in the completion). Please reduce the length of the messages or completion.",
                "type": "invalid_request_error",
                "param": "messages",
                "code": "context_length_exceeded",
            }
            assert (
                c.post(
                    "/v1/chat/completions", json={**LONG, "messages": [{"role": "user", "content": "hi"}]}
                ).status_code
                == 200
            )
    finally:
        gw.stop()
        engine.stop()


def test_a_missing_rank_is_unknown_and_fails_closed():
    engine = FixtureEngine({"/server_info": sglang_server_info(DP2), "/v1/loads": sglang_loads(DP2[:1])}).start()
    gw = _gateway(engine)
    try:
        assert wait_for(lambda: gw.gw.upstreams.all[0].watcher.last_error not in (None, "not polled yet"), timeout=5)
        status = gw.gw.ready()[1]["upstreams"][0]
        assert status["known"] is False
        assert (
            status["error"]
            == f"{engine.url}/server_info: no max_total_num_tokens for data-parallel rank 1 of 2 (/v1/loads)"
        )
        with gw.client() as c:
            r = c.post("/v1/chat/completions", json={**LONG, "messages": [{"role": "user", "content": "hi"}]})
            assert (r.status_code, r.json()["error"]["code"]) == (503, "pool_size_unknown")
    finally:
        gw.stop()
        engine.stop()


@pytest.mark.parametrize("served", ["/server_info", "/get_server_info"])
def test_the_renamed_server_info_is_read_under_either_name(served):
    """PR #13273 renamed ``/get_server_info`` to ``/server_info``; a URL naming either one works
    against an engine that serves only the other."""
    engine = FixtureEngine({served: sglang_server_info([4096])}).start()
    other = "/get_server_info" if served == "/server_info" else "/server_info"
    gw = _gateway(engine, info_path=other)
    try:
        status = _ready(gw)
        assert (status["limit_tokens"], status["nodes"][0]["read_from"]) == (3276, "internal_states")
        assert main(["deploy-gate", "--server-info-url", engine.url + other, "--context-length", "3000"]) == 0
    finally:
        gw.stop()
        engine.stop()


@pytest.mark.parametrize("loads", [True, False], ids=["v1-loads", "internal-states"])
def test_deploy_gate_judges_the_smallest_rank(capsys, loads):
    bodies = {"/server_info": sglang_server_info(DP2), "/v1/loads": sglang_loads(DP2) if loads else None}
    engine = FixtureEngine(bodies).start()
    try:
        # rank 1's 4,096 < 8,192 x 1.25: FAIL, though rank 0's 12,288 would pass
        assert main(["deploy-gate", "--server-info-url", engine.url + "/server_info", "--json"]) == 1
        node = json.loads(capsys.readouterr().out)["nodes"][0]
        assert (node["status"], node["pool_tokens"], node["rank_pools_tokens"], node["read_from"]) == (
            "too_small",
            4096,
            DP2,
            "/v1/loads" if loads else "internal_states",
        )
        assert (node["required_tokens"], node["effective_limit_tokens"]) == (10240, 3276)
        assert main(["deploy-gate", "--server-info-url", engine.url + "/server_info", "--context-length", "3276"]) == 0
    finally:
        engine.stop()


#: a hybrid attention + Mamba model as a vLLM user reported it: 320 blocks of 8 tokens (2,560) but a
#: KV capacity of 463,459 tokens, since only some layers hold KV (vLLM issue #51163)
HYBRID = {"num_gpu_blocks": "320", "block_size": "8", "kv_cache_size_tokens": "463459"}


@pytest.mark.parametrize(
    ("bodies", "capacity", "source"),
    [
        ({"/v1/server/kv-cache": vllm_kv_cache(16_384, 1024)}, 16_384, "/v1/server/kv-cache"),
        (
            {
                "/metrics": vllm_cache_config_metrics(
                    [
                        {"num_gpu_blocks": "2048", "kv_cache_size_tokens": "32768"},
                        {"num_gpu_blocks": "1000", "kv_cache_size_tokens": "16000"},
                    ]
                )
            },
            16_000,
            "kv_cache_size_tokens",
        ),
        ({"/metrics": vllm_cache_config_metrics([{"num_gpu_blocks": "2048"}])}, 32_768, "num_gpu_blocks x block_size"),
    ],
    ids=["kv-cache-endpoint", "metrics-dp2", "metrics-blocks-only"],
)
def test_vllm_capacity_is_read_for_signal_1(bodies, capacity, source):
    engine = FixtureEngine({"/v1/models": vllm_models(8192), **bodies}).start()
    gw = _gateway(engine, pool_source="vllm")
    try:
        status = _ready(gw)
        assert status["limit_tokens"] == 6553  # the gate still reads max_model_len: floor(8192 / 1.25)
        assert status["signal_1"] == {
            "status": "ok",
            "capacity_tokens": capacity,
            "capacity_source": source,
            "required_tokens": 10240,
        }
    finally:
        gw.stop()
        engine.stop()


def test_vllm_deploy_gate_fails_below_and_passes_above_max_model_len_x_headroom(capsys):
    engine = FixtureEngine({"/v1/models": vllm_models(8192), "/v1/server/kv-cache": vllm_kv_cache(10_239, 640)}).start()
    try:
        argv = ["deploy-gate", "--pool-source", "vllm", "--server-info-url", engine.url, "--json"]
        assert main(argv) == 1  # 10,239 < 8,192 x 1.25 = 10,240: the old gate compared max_model_len with itself
        node = json.loads(capsys.readouterr().out)["nodes"][0]
        assert (node["status"], node["pool_tokens"], node["pool_field"], node["context_length"]) == (
            "too_small",
            10_239,
            "/v1/server/kv-cache",
            8192,
        )
        assert (node["required_tokens"], node["effective_limit_tokens"]) == (10240, 6553)
        engine.routes.bodies["/v1/server/kv-cache"] = vllm_kv_cache(10_240, 640)
        assert main(argv) == 0
        capsys.readouterr()
        # no kv-cache route and no capacity on /metrics: unknown, fail closed
        engine.routes.bodies["/v1/server/kv-cache"] = None
        engine.routes.bodies["/metrics"] = "vllm:num_requests_running 0.0\n"
        assert main(argv) == 2
        assert json.loads(capsys.readouterr().out)["nodes"][0]["status"] == "no_pool_field"
    finally:
        engine.stop()


def test_vllm_hybrid_model_uses_kv_cache_size_tokens_not_blocks_x_block_size(capsys):
    """262,144 x 1.25 = 327,680: blocks x block size (2,560) would fail it, the real capacity passes."""
    engine = FixtureEngine(
        {"/v1/models": vllm_models(262_144), "/metrics": vllm_cache_config_metrics([HYBRID])}
    ).start()
    try:
        assert main(["deploy-gate", "--pool-source", "vllm", "--server-info-url", engine.url, "--json"]) == 0
        node = json.loads(capsys.readouterr().out)["nodes"][0]
        assert (node["pool_tokens"], node["pool_field"], node["required_tokens"]) == (
            463_459,
            "kv_cache_size_tokens",
            327_680,
        )
    finally:
        engine.stop()


def test_parsers_on_shapes_the_engines_can_send():
    # one rank: the top level counts too (older SGLang: no internal_states pool, no /v1/loads)
    assert sglang_pool({"max_total_num_tokens": 4096}).rank_pools_tokens == (4096,)
    # an older scheduler's internal state carries max_total_num_tokens itself; the smaller wins
    old = {
        "dp_size": 2,
        "max_total_num_tokens": 900,
        "internal_states": [{"max_total_num_tokens": 900}, {"max_total_num_tokens": 700}],
    }
    assert sglang_pool(old).pool_tokens == 700
    # label values are strings; "None" (an unset CacheConfig field) is not a number
    assert vllm_capacity_from_metrics(vllm_cache_config_metrics([{"num_gpu_blocks": "None"}])) is None
    assert vllm_capacity_from_metrics("not prometheus {{{") is None


def test_numbers_no_engine_reports_read_as_missing():
    """Counts above 2**40 (MAX_REPORTED), digit strings longer than 15 characters and a dp_size
    far above the ranks listed fail closed without sizing anything by the claimed number."""
    with pytest.raises(EnginePoolError, match="^server_info has no max_total_num_tokens"):
        sglang_pool({"max_total_num_tokens": 10**30})
    assert sglang_pool({"max_total_num_tokens": MAX_REPORTED}).pool_tokens == MAX_REPORTED
    with pytest.raises(EnginePoolError, match="^no max_total_num_tokens for data-parallel rank 1 of 1000000000 "):
        sglang_pool({**sglang_server_info([4096]), "dp_size": 10**9})
    for bad in (10**18, 0, -1, "-2", 1.5, True, None):
        with pytest.raises(
            EnginePoolError, match=r"^server_info has no usable dp_size \(a positive integer up to 2\*\*40\)$"
        ):
            sglang_pool({**sglang_server_info([4096]), "dp_size": bad})
    blocks = [{"num_gpu_blocks": str(1 << 30), "block_size": str(1 << 11)}]  # 2**41 tokens
    assert vllm_capacity_from_metrics(vllm_cache_config_metrics(blocks)) is None
    assert vllm_capacity_from_endpoint({"kv_cache_size_tokens": "9" * 16}) is None
    assert vllm_capacity_from_endpoint({"kv_cache_size_tokens": "9" * 5000}) is None  # int() would raise
    assert (
        vllm_capacity_from_metrics(vllm_cache_config_metrics([{"kv_cache_size_tokens": "4096"}])).kv_capacity_tokens
        == 4096
    )


def test_bundled_backend_serves_v1_loads_for_its_one_rank():
    info = {"max_total_num_tokens": 4096, "used_tokens": 1024, "version": "kvgate-0.1"}
    app = FastAPI()

    async def server_info() -> dict:
        return info

    add_common_routes(app, server_info, None)
    with TestClient(app) as c:
        body = c.get("/v1/loads", params={"include": "core,memory"}).json()
        assert body["loads"] == [
            {
                "dp_rank": 0,
                "num_used_tokens": 1024,
                "max_total_num_tokens": 4096,
                "token_usage": 0.25,
                "memory": {"token_capacity": 4096},
            }
        ]
        assert sglang_pool({**info, "dp_size": 1}, body).rank_pools_tokens == (4096,)
        assert c.get("/v1/loads", params={"include": "core"}).json()["loads"][0].get("memory") is None
        assert c.get("/v1/loads", params={"include": "bogus"}).status_code == 400
        assert c.get("/v1/loads", params={"dp_rank": "1"}).status_code == 400
    assert loads_body(info, None, "0")["num_accelerators"] == 1


@pytest.mark.parametrize("listed", [5, "x", True, {"a": 1}])
def test_a_list_field_of_another_type_is_an_engine_pool_error(listed):
    """``internal_states`` or ``data`` that is not a list: the parsers iterated it (a number raised
    ``TypeError``: ``kvgate deploy-gate`` ended in a traceback); now the usual pool error, and a
    well-formed top-level pool is still read."""
    from config.engine_pool import vllm_max_model_len

    with pytest.raises(EnginePoolError, match=r"^/v1/models reports no max_model_len$"):
        vllm_max_model_len({"data": listed})
    with pytest.raises(EnginePoolError, match=r"^server_info has no max_total_num_tokens"):
        sglang_pool({"internal_states": listed})
    pool = sglang_pool({"internal_states": listed, "max_total_num_tokens": 4096, "max_req_input_len": 4000})
    assert (pool.rank_pools_tokens, pool.max_req_input_len) == ((4096,), 4000)
