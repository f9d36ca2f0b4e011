"""An upstream started with ``--api-key`` (vLLM, SGLang): kvgate's pool polls and the engine
tokenizer's calls carry the key, so the pool is known and counting works; without it the engine
answers 401 and the pool is unknown (503 at admission, fail closed)."""

from __future__ import annotations

import httpx
import pytest
from mock_engine import ServerThread
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from config.models import PoolSettings, Settings, TokenizerConfig, UpstreamConfig
from gateway.admission.registry import ModelIndex, engine_api_key
from gateway.ops.pool_watcher import PoolWatcher
from tokenizer import EngineTokenizeError, make_counter

KEY = "sk-upstream-0123456789abcdef"
pytestmark = [pytest.mark.timeout(30), pytest.mark.engine(api_key=KEY)]


@pytest.mark.parametrize("source", ["sglang", "vllm"])
async def test_pool_poll_sends_the_upstream_api_key(engine, source):
    engine.state.vllm_max_model_len = 4096
    url = engine.info_url if source == "sglang" else engine.api_url + "/models"
    async with httpx.AsyncClient() as client:
        with_key = UpstreamConfig(
            name="u", api_url=engine.api_url, pool_source=source, pool_urls=[url], models=["m"], api_key=KEY
        )
        w = PoolWatcher(with_key, PoolSettings(), client, 8192)
        assert await w.poll_once() == 3276  # floor(4096 / 1.25)
        assert engine.state.info_auth == [f"Bearer {KEY}"]
        without = with_key.model_copy(update={"api_key": None})
        w2 = PoolWatcher(without, PoolSettings(), client, 8192)
        assert await w2.poll_once() is None
        assert w2.status()["error"] == f"{url} answered 401"
        assert engine.state.info_auth[1] is None


def _settings(tok_url: str, tok_key: str | None = None) -> Settings:
    return Settings.model_validate(
        {
            "models": [
                {
                    "id": "m",
                    "context_length": 8192,
                    "tokenizer": {"kind": "engine", "url": tok_url, **({"api_key": tok_key} if tok_key else {})},
                }
            ],
            "upstreams": [
                {
                    "name": "other",
                    "api_url": "http://10.0.0.9:8000/v1",
                    "pool_urls": ["x"],
                    "models": ["m"],
                    "api_key": "sk-other-key-000000",
                },
                {
                    "name": "u",
                    "api_url": "http://127.0.0.1:30000/v1",
                    "pool_urls": ["x"],
                    "models": ["m"],
                    "api_key": KEY,
                },
            ],
        }
    )


def test_engine_tokenizer_takes_the_key_of_the_upstream_it_shares_a_base_url_with():
    assert engine_api_key(_settings("http://127.0.0.1:30000"), "http://127.0.0.1:30000") == KEY
    assert engine_api_key(_settings("http://tokenizer.invalid"), "http://127.0.0.1:30000/") == KEY
    assert engine_api_key(_settings("http://tokenizer.invalid"), "HTTP://127.0.0.1:30000") == KEY
    assert engine_api_key(_settings("http://tokenizer.invalid"), "http://127.0.0.1:30001") is None  # another port
    assert engine_api_key(_settings("http://tokenizer.invalid"), "https://127.0.0.1:30000") is None  # another scheme
    assert engine_api_key(_settings("http://tokenizer.invalid"), None) is None
    counter = ModelIndex(_settings("http://127.0.0.1:30000")).by_name["m"].counter
    assert counter.auth_headers == {"authorization": f"Bearer {KEY}"}
    own = ModelIndex(_settings("http://127.0.0.1:30000", "sk-tokenizer-only-1234")).by_name["m"].counter
    assert own.auth_headers == {"authorization": "Bearer sk-tokenizer-only-1234"}  # tokenizer.api_key wins
    assert ModelIndex(_settings("http://127.0.0.1:39999")).by_name["m"].counter.auth_headers is None


async def test_engine_tokenize_calls_carry_the_key(engine):
    seen: list[str | None] = []

    async def tokenize(request):
        seen.append(request.headers.get("authorization"))
        if request.headers.get("authorization") != f"Bearer {KEY}":
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
        return JSONResponse({"count": 5, "tokens": [1, 2, 3, 4, 5], "max_model_len": 8192})

    srv = ServerThread(Starlette(routes=[Route("/v1/tokenize", tokenize, methods=["POST"])])).start()
    try:
        cfg = TokenizerConfig(kind="engine", url=srv.url)
        good = make_counter(cfg, "m", api_key=KEY)
        assert (await good.acount_prompt("hello")).per_prompt == (5,)
        bad = make_counter(cfg, "m")
        with pytest.raises(EngineTokenizeError) as ei:
            await bad.acount_prompt("hello")
        assert ei.value.status == 502 and ei.value.detail.endswith("answered HTTP 401")
        assert seen == [f"Bearer {KEY}", None]
        await good.aclose()
        await bad.aclose()
    finally:
        srv.stop()
