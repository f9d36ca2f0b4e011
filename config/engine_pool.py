"""What an engine reports about its KV pool, parsed from its own wire shapes.

The gateway's pool watcher and the verifier's deploy gate both read engines through these
functions, so the two never disagree on which field, endpoint or rank counts. No HTTP here: the
callers fetch, these parse. docs/gateway.md ("Live pool limit") has the table of engine versions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from prometheus_client.parser import text_string_to_metric_families

#: the query the pool reader sends to SGLang's ``GET /v1/loads``: the core section carries
#: ``max_total_num_tokens``, the memory section ``token_capacity``
SGLANG_LOADS_QUERY = "include=core,memory"


class EnginePoolError(ValueError):
    """The engine's answer lacks a field the pool needs, or a data-parallel rank is missing."""


@dataclass(frozen=True)
class SGLangPool:
    """One SGLang (or bundled backend) node.

    ``rank_pools_tokens``: the KV pool of each data-parallel rank, indexed by rank; ``source``:
    ``/v1/loads``, ``internal_states`` or ``server_info``; ``max_req_input_len`` and
    ``context_length``: the smallest the node reports, ``None`` when it reports none."""

    rank_pools_tokens: tuple[int, ...]
    source: str
    max_req_input_len: int | None
    context_length: int | None

    @property
    def pool_tokens(self) -> int:
        """The smallest rank's pool: a request may land on any rank."""
        return min(self.rank_pools_tokens)


@dataclass(frozen=True)
class VLLMCapacity:
    """vLLM's KV capacity in tokens (the smallest over its ``engine`` ranks) and where it came from:
    ``/v1/server/kv-cache``, ``kv_cache_size_tokens`` or ``num_gpu_blocks x block_size``."""

    kv_capacity_tokens: int
    source: str


#: the largest count (tokens, blocks, ranks) taken from an engine: 2**40, a trillion tokens, is no
#: real engine's pool; a larger number is a broken or hostile answer and reads as missing (the pool
#: then fails closed), never as a pool that admits anything or a rank list that fills memory
MAX_REPORTED = 1 << 40


def _positive_int(v: Any) -> int | None:
    """``v`` as an int in ``[1, MAX_REPORTED]`` (an int, an integral float, or a digit string as
    Prometheus labels carry), else ``None``."""
    if isinstance(v, bool):
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    elif isinstance(v, str) and 0 < len(v) <= 15 and v.isascii() and v.isdigit():
        v = int(v)
    if isinstance(v, int) and 0 < v <= MAX_REPORTED:
        return v
    return None


def _smallest(values: list[Any]) -> int | None:
    found = [p for p in (_positive_int(v) for v in values) if p is not None]
    return min(found) if found else None


def server_info_base(url: str) -> str | None:
    """The node's base URL for a ``.../server_info`` or ``.../get_server_info`` URL, else ``None``
    (a URL of another shape names no base, so ``/v1/loads`` is not asked there)."""
    parts = urlsplit(url)
    path = parts.path.rstrip("/")
    for suffix in ("/get_server_info", "/server_info"):
        if path.endswith(suffix):
            return urlunsplit(parts._replace(path=path[: -len(suffix)], query="", fragment=""))
    return None


def _loads_ranks(loads: Any) -> dict[int, int]:
    """Rank -> pool from a ``GET /v1/loads`` body. SGLang python/sglang/srt/entrypoints/v1_loads.py
    (``get_loads``, commit 0564b52) returns ``{"loads": [GetLoadsReqOutput.to_dict(include)]}``;
    each entry has ``dp_rank`` and ``max_total_num_tokens`` (core section) and, with the memory
    section, ``memory.token_capacity`` (io_struct.py ``MemoryMetrics``). Both bound the rank."""
    entries = loads.get("loads") if isinstance(loads, dict) else None
    if not isinstance(entries, list) or not entries:
        raise EnginePoolError("/v1/loads has no loads[]")
    ranks: dict[int, int] = {}
    for i, e in enumerate(entries):
        if not isinstance(e, dict):
            raise EnginePoolError(f"/v1/loads loads[{i}] is not an object")
        rank = e.get("dp_rank", i)
        memory = e.get("memory")
        capacity = memory.get("token_capacity") if isinstance(memory, dict) else None
        pool = _smallest([e.get("max_total_num_tokens"), capacity])
        if not isinstance(rank, int) or isinstance(rank, bool) or pool is None:
            raise EnginePoolError(f"/v1/loads loads[{i}] has no dp_rank or max_total_num_tokens")
        ranks[rank] = min(pool, ranks.get(rank, pool))
    return ranks


def _internal_state_ranks(info: dict[str, Any]) -> dict[int, int]:
    """Rank -> pool from ``/server_info``'s ``internal_states[]``: one entry per DP rank, each
    scheduler's ``get_internal_state`` (SGLang python/sglang/srt/managers/scheduler_components/
    internal_state.py ``_add_memory_usage``, commit 81ee63e, and memory_usage.py
    ``build_memory_usage``: ``memory_usage.token_capacity = max_total_num_tokens``; older
    schedulers put ``max_total_num_tokens`` in the entry itself). Entries with neither are left out."""
    states = info.get("internal_states")
    ranks: dict[int, int] = {}
    for i, s in enumerate(states if isinstance(states, list) else []):
        if not isinstance(s, dict):
            continue
        rank = s.get("dp_rank", i)
        memory = s.get("memory_usage")
        capacity = memory.get("token_capacity") if isinstance(memory, dict) else None
        pool = _smallest([s.get("max_total_num_tokens"), capacity])
        if isinstance(rank, int) and not isinstance(rank, bool) and pool is not None:
            ranks[rank] = min(pool, ranks.get(rank, pool))
    return ranks


def sglang_pool(info: Any, loads: Any | None = None) -> SGLangPool:
    """One node's pool from its ``/server_info`` body and, when the node serves it, its
    ``/v1/loads?include=core,memory`` body.

    SGLang's ``/server_info`` (python/sglang/srt/entrypoints/http_server.py ``get_server_info``)
    is ``{**server_args, **scheduler_info, "internal_states": [...], "version"}``: the top-level
    ``max_total_num_tokens`` and ``max_req_input_len`` are **rank 0's** scheduler info, and
    ``dp_size`` (server args) says how many ranks there are. Every rank in ``range(dp_size)``
    needs a pool, from ``/v1/loads`` when given, else from ``internal_states``; with one rank the
    top level also counts. A missing rank, or a ``dp_size`` that is not a positive integer up to
    :data:`MAX_REPORTED`, raises :class:`EnginePoolError` (unknown fails closed).
    """
    if not isinstance(info, dict):
        raise EnginePoolError("server_info is not a JSON object")
    dp_size = _positive_int(info.get("dp_size", 1))
    if dp_size is None:  # 0, negative, a string, above MAX_REPORTED: how many ranks need a pool is unknown
        raise EnginePoolError("server_info has no usable dp_size (a positive integer up to 2**40)")
    listed = info.get("internal_states")
    states = [s for s in listed if isinstance(s, dict)] if isinstance(listed, list) else []
    if loads is not None:
        ranks, source = _loads_ranks(loads), "/v1/loads"
    else:
        ranks = _internal_state_ranks(info)
        source = "internal_states" if ranks else "server_info"
    top = _positive_int(info.get("max_total_num_tokens"))
    if dp_size == 1 and top is not None:
        ranks[0] = min(top, ranks.get(0, top))
    # ranks holds at most one entry per rank the answer lists, so this never walks a range the
    # engine's dp_size alone sized
    missing = next((r for r in range(len(ranks) + 1) if r not in ranks), None)
    if missing is not None and missing < dp_size:
        if dp_size == 1 and loads is None:
            raise EnginePoolError("server_info has no max_total_num_tokens (a positive integer up to 2**40)")
        raise EnginePoolError(f"no max_total_num_tokens for data-parallel rank {missing} of {dp_size} ({source})")
    return SGLangPool(
        tuple(ranks[r] for r in range(dp_size)),
        source,
        _smallest([info.get("max_req_input_len"), *(s.get("max_req_input_len") for s in states)]),
        _smallest([info.get("context_length"), *(s.get("context_length") for s in states)]),
    )


def vllm_max_model_len(models: Any) -> int:
    """The smallest ``data[].max_model_len`` of a vLLM ``GET /v1/models`` body (vLLM
    vllm/entrypoints/openai/protocol.py ``ModelCard.max_model_len``); raises
    :class:`EnginePoolError` when no entry reports one."""
    entries = models.get("data") if isinstance(models, dict) else None
    listed = entries if isinstance(entries, list) else []
    found = _smallest([e.get("max_model_len") for e in listed if isinstance(e, dict)])
    if found is None:
        raise EnginePoolError("/v1/models reports no max_model_len")
    return found


def vllm_capacity_from_endpoint(body: Any) -> VLLMCapacity | None:
    """vLLM's ``GET /v1/server/kv-cache`` (vllm/entrypoints/serve/kv_cache/api_router.py
    ``get_kv_cache``, commit b326cde; protocol.py ``KVCacheRuntimeInfo``): ``kv_cache_size_tokens``,
    ``None`` when the body does not carry a positive one."""
    tokens = _positive_int(body.get("kv_cache_size_tokens")) if isinstance(body, dict) else None
    return VLLMCapacity(tokens, "/v1/server/kv-cache") if tokens is not None else None


def vllm_capacity_from_metrics(text: str) -> VLLMCapacity | None:
    """vLLM's ``vllm:cache_config_info`` gauge on ``/metrics`` (vllm/v1/metrics/loggers.py
    ``log_metrics_info``, commit a6f0308: every ``CacheConfig`` field as a string label, one series
    per ``engine`` label under data parallelism). ``kv_cache_size_tokens`` wins when every
    engine reports it (it is right on hybrid models, where blocks x block size is not); else
    ``num_gpu_blocks x block_size``. The smallest over engines; ``None`` when neither is there or
    the gauge's lines do not parse. Only the gauge's own lines (and its ``# HELP`` / ``# TYPE``)
    are parsed: a page of a megabyte of other series costs a line scan, and a line elsewhere that
    prometheus_client's parser fails on (0.26 ``parser.py`` ``_unquote_unescape`` raises
    ``IndexError`` on an empty label name after a comma) cannot hide it or crash a caller."""
    by_size: list[int | None] = []
    by_blocks: list[int | None] = []
    name = "vllm:cache_config_info"
    own = [
        line
        for line in text.splitlines()
        if line.startswith(name) or (line.startswith("#") and name in line.split(None, 3)[2:3])
    ]
    try:
        families = list(text_string_to_metric_families("\n".join(own) + "\n"))
    except Exception:  # the parser's ValueError, and what it raises besides on a malformed line
        return None
    for family in families:
        for sample in family.samples:
            if sample.name != "vllm:cache_config_info":
                continue
            labels = sample.labels
            by_size.append(_positive_int(labels.get("kv_cache_size_tokens")))
            blocks, size = _positive_int(labels.get("num_gpu_blocks")), _positive_int(labels.get("block_size"))
            by_blocks.append(_positive_int(blocks * size) if blocks is not None and size is not None else None)
    if by_size and all(v is not None for v in by_size):
        return VLLMCapacity(min(v for v in by_size if v is not None), "kv_cache_size_tokens")
    if by_blocks and all(v is not None for v in by_blocks):
        return VLLMCapacity(min(v for v in by_blocks if v is not None), "num_gpu_blocks x block_size")
    return None
