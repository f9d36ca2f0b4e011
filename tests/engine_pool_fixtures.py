"""Pool reports as current SGLang and vLLM serve them, and a fixture engine that serves them.

Each fixture names the engine source it reproduces (file, function, commit as stored by the public
code index); only the fields kvgate reads are kept, with the engines' own names and nesting.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Mount, Route

from tests.mock_engine import MockState, ServerThread, build_app


def sglang_server_info(rank_pools: list[int], context_length: int = 8192) -> dict[str, Any]:
    """SGLang ``GET /server_info`` with ``--dp-size N --enable-dp-attention``.

    python/sglang/srt/entrypoints/http_server.py ``get_server_info`` (commit 9c0549b):
    ``{**dataclasses.asdict(server_args), **scheduler_info, "internal_states": [...], "version"}``.
    ``scheduler_info`` is rank 0's ``get_init_info`` (python/sglang/srt/managers/scheduler.py:
    ``{"status": "ready", "max_total_num_tokens", "max_req_input_len"}``), so the top level is rank
    0's pool. ``internal_states[i]`` is rank i's ``get_internal_state``
    (managers/scheduler_components/internal_state.py ``_add_memory_usage``, commit 81ee63e;
    memory_usage.py ``build_memory_usage``: ``"token_capacity": int(token_capacity)``)."""
    return {
        "dp_size": len(rank_pools),
        "enable_dp_attention": len(rank_pools) > 1,
        "context_length": context_length,
        "status": "ready",
        "max_total_num_tokens": rank_pools[0],
        "max_req_input_len": context_length - 6,
        "internal_states": [
            {"dp_size": len(rank_pools), "memory_usage": {"weight": 0.3, "kvcache": 0.1, "token_capacity": p}}
            for p in rank_pools
        ],
        "version": "0.5.9",
    }


def sglang_loads(rank_pools: list[int]) -> dict[str, Any]:
    """SGLang ``GET /v1/loads?include=core,memory`` (PR #16976).

    python/sglang/srt/entrypoints/v1_loads.py ``get_loads`` (commit 0564b52): ``{"timestamp",
    "version", "accelerator", "num_accelerators", "loads": [load.to_dict(include)]}``, one load per
    DP rank; ``GetLoadsReqOutput.to_dict`` (managers/io_struct.py) always carries ``dp_rank`` and
    ``max_total_num_tokens`` (core), and ``memory`` = ``MemoryMetrics`` with ``token_capacity``."""
    return {
        "timestamp": "2026-12-01T00:00:00+00:00",
        "version": "0.5.9",
        "accelerator": "NVIDIA H200",
        "num_accelerators": 1,
        "loads": [
            {
                "dp_rank": r,
                "num_running_reqs": 0,
                "num_waiting_reqs": 0,
                "num_used_tokens": 0,
                "max_total_num_tokens": p,
                "token_usage": 0.0,
                "memory": {"weight_gb": 0.3, "kv_cache_gb": 0.1, "graph_gb": 0.0, "token_capacity": p},
            }
            for r, p in enumerate(rank_pools)
        ],
    }


def vllm_models(max_model_len: int, model: str = "kvgate-tiny") -> dict[str, Any]:
    """vLLM ``GET /v1/models`` (vllm/entrypoints/openai/protocol.py ``ModelCard.max_model_len``)."""
    return {"object": "list", "data": [{"id": model, "object": "model", "max_model_len": max_model_len}]}


def vllm_kv_cache(kv_cache_size_tokens: int, num_gpu_blocks: int, block_size: int = 16) -> dict[str, Any]:
    """vLLM ``GET /v1/server/kv-cache`` (vllm/entrypoints/serve/kv_cache/api_router.py
    ``get_kv_cache``, commit b326cde; protocol.py ``KVCacheRuntimeInfo``)."""
    return {
        "kv_cache_size_tokens": kv_cache_size_tokens,
        "max_concurrency": None,
        "num_gpu_blocks": num_gpu_blocks,
        "num_cpu_blocks": 0,
        "groups": [{"spec_type": "FullAttentionSpec", "block_size": block_size}],
    }


def vllm_cache_config_metrics(engines: list[dict[str, str]]) -> str:
    """vLLM ``/metrics``' ``vllm:cache_config_info``: a gauge set to 1 whose labels are every
    ``CacheConfig`` field as a string plus ``engine`` (vllm/v1/metrics/loggers.py
    ``PrometheusStatLogger.log_metrics_info``, commit a6f0308; one series per engine index under
    ``--data-parallel-size``). ``kv_cache_size_tokens`` is the label PR #42206 added."""
    lines = [
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
        "# TYPE vllm:cache_config_info gauge",
    ]
    for i, labels in enumerate(engines):
        all_labels = {"block_size": "16", "cache_dtype": "auto", "enable_prefix_caching": "True", **labels}
        all_labels["engine"] = str(i)
        body = ",".join(f'{k}="{v}"' for k, v in all_labels.items())
        lines.append(f"vllm:cache_config_info{{{body}}} 1.0")
    lines.append('vllm:num_requests_running{engine="0",model_name="kvgate-tiny"} 0.0')
    return "\n".join(lines) + "\n"


@dataclass
class FixtureRoutes:
    """Path -> JSON body (dict) or metrics text (str); a path absent or ``None`` is a 404."""

    bodies: dict[str, Any] = field(default_factory=dict)
    hits: list[str] = field(default_factory=list)


class FixtureEngine(ServerThread):
    """The mock engine (chat, completions) whose pool endpoints answer the fixtures in ``routes``."""

    POOL_PATHS = ("/server_info", "/get_server_info", "/v1/loads", "/v1/models", "/v1/server/kv-cache", "/metrics")

    def __init__(self, bodies: dict[str, Any]) -> None:
        self.routes = FixtureRoutes(dict(bodies))
        self.state = MockState()

        async def serve(request: Request) -> Response:
            self.routes.hits.append(str(request.url.path) + ("?" + request.url.query if request.url.query else ""))
            body = self.routes.bodies.get(request.url.path)
            if body is None:
                return JSONResponse({"detail": "Not Found"}, status_code=404)
            if isinstance(body, str):
                return PlainTextResponse(body)
            return JSONResponse(body)

        routes = [Route(p, serve, methods=["GET"]) for p in self.POOL_PATHS]
        super().__init__(Starlette(routes=[*routes, Mount("/", app=build_app(self.state))]))
