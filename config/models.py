"""Pydantic models of every kvgate setting. Unknown keys are errors (``extra="forbid"``).

Two files carry them (docs/design.md, Contracts): ``config/kvgate.yaml`` -> :class:`Settings`
(gateway, upstreams, models, quotas, verifier, backend) and ``config/tenants.yaml`` ->
:class:`TenantsFile`.
"""

from __future__ import annotations

import re
import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin
from urllib.parse import SplitResult, urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    StrictBool,
    StrictInt,
    ValidationInfo,
    field_validator,
    model_validator,
)

_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # fullmatch: "$" lets a final newline in


#: the longest duration a setting that becomes a Redis expiry may name (a year, in seconds): above it
#: a typo (1e300) made every reservation's PEXPIRE fail and every request a 503
MAX_TTL_SECONDS = 365 * 24 * 3600.0


#: the largest quota limit (2**53 - 1): the quota scripts count in Lua numbers (doubles), and a
#: limit of 2**63 made every x-ratelimit-remaining header 0 while requests were admitted
MAX_LIMIT = (1 << 53) - 1


#: the port of each scheme an origin is read for (:func:`split_origin`) when its URL names none
DEFAULT_PORTS = {"http": 80, "https": 443}


def split_origin(parts: SplitResult) -> tuple[str, str, int | None]:
    """``(scheme, host, port)`` of a split URL, the one reading of an origin: the scheme
    lower-cased; the host as ``SplitResult.hostname`` has it (lower-cased, an IPv6 one without
    its brackets and its zone id as written: ``%eth0`` and ``%ETH0`` name two interfaces; never
    the user information; ``""`` for none); the URL's port, else the scheme's default
    (:data:`DEFAULT_PORTS`), ``None`` for another scheme or a port out of range or not a number.
    The forward path's pools read it strictly (:func:`gateway.relay.h1_transport.url_origin`)."""
    scheme = parts.scheme.lower()
    try:
        port = parts.port or DEFAULT_PORTS.get(scheme)
    except ValueError:
        port = None
    return scheme, parts.hostname or "", port


def url_origin(url: str) -> tuple[str, str, int | None]:
    """:func:`split_origin` of ``url``: how a tokenizer's URL is matched to the upstream at the
    same address (here, and :func:`gateway.admission.registry.engine_api_key`) and which
    upstreams share a tenant's share of one origin's pool
    (:func:`gateway.relay.upstreams.share_origins`). Raises ``ValueError`` only where
    ``urlsplit`` does (a bracketed host that is not an IP address, a bracket left open)."""
    return split_origin(urlsplit(url))


def http_url(url: str) -> str:
    """``url`` when it is an http(s) URL with a host, a port from 0 to 65535 (or none) and no
    credentials (a field validator's check of an engine's URL: a request to it would fail every
    time). Raises ``ValueError`` naming what is wrong."""
    parts = urlsplit(url)  # a bracket left open: ValueError "Invalid IPv6 URL"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("must be an http:// or https:// URL with a host")
    if split_origin(parts)[2] is None:  # urllib raises for a port out of range or not a number
        raise ValueError("must have a port from 0 to 65535 (or none)")
    if parts.username is not None or parts.password is not None:
        raise ValueError("must not hold credentials: put the engine's key in 'api_key'")
    return url


def _numeric_not_bool(annotation: Any) -> bool:
    """Whether a field of this type takes a number but no boolean (``int``, ``float | None``, ...)."""
    args = get_args(annotation) if get_origin(annotation) in (Union, types.UnionType) else (annotation,)
    return bool({int, float} & set(args)) and bool not in args


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, v: Any, info: ValidationInfo) -> Any:
        """pydantic reads ``true`` as 1 for a number: ``rpm: yes`` was a limit of 1 request,
        ``max_concurrent: off`` one of 0."""
        field = cls.model_fields.get(info.field_name or "")
        if isinstance(v, bool) and field is not None and _numeric_not_bool(field.annotation):
            raise ValueError("must be a number, not a boolean (YAML reads true/false, yes/no and on/off as booleans)")
        return v


class TokenizerConfig(_Strict):
    """How a model's prompts are counted (docs/tokenizer.md).

    ``kind``: ``tiktoken`` (``name`` an encoding, e.g. ``cl100k_base``), ``bundled`` (cl100k_base
    + ChatML specials, the bundled backend's own), ``hf`` (``path`` a folder with tokenizer.json
    and tokenizer_config.json), ``engine`` (the upstream's tokenize endpoint; ``url`` its base URL
    without ``/v1``, ``engine_api`` its shape). ``chat_template``: ``chatml`` (kvgate's ChatML, for
    ``tiktoken`` and ``bundled``) or ``hf`` (the Jinja template of tokenizer_config.json, for
    ``hf``); left out, it follows ``kind``. ``image_tokens``: what one image content part costs
    (never 0). ``api_key`` (``kind: engine``): the bearer key of the tokenize endpoint; left out,
    the ``api_key`` of the upstream whose ``api_url`` has the same scheme, host and port as ``url``.
    """

    kind: Literal["tiktoken", "bundled", "hf", "engine"] = "bundled"
    name: str = "cl100k_base"
    path: str | None = None
    url: str | None = None
    engine_api: Literal["sglang", "vllm"] = "sglang"
    chat_template: Literal["chatml", "hf"] = "chatml"
    image_tokens: int = Field(default=765, ge=1)
    api_key: SecretStr | None = None

    @field_validator("url")
    @classmethod
    def _url_ok(cls, v: str | None) -> str | None:
        return None if v is None else http_url(v)

    @model_validator(mode="before")
    @classmethod
    def _template_follows_kind(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("chat_template") is None:
            data = {**data, "chat_template": "hf" if data.get("kind") == "hf" else "chatml"}
        return data

    @model_validator(mode="after")
    def _needs(self) -> TokenizerConfig:
        if self.kind == "hf" and not self.path:
            raise ValueError("kind 'hf' needs 'path' (a folder with tokenizer.json)")
        if self.kind == "engine" and not self.url:
            raise ValueError("kind 'engine' needs 'url' (the engine's base URL)")
        if self.kind == "hf" and self.chat_template != "hf":
            raise ValueError("kind 'hf' counts chats with the template of tokenizer_config.json (chat_template: hf)")
        if self.kind in ("tiktoken", "bundled") and self.chat_template != "chatml":
            raise ValueError(f"kind '{self.kind}' counts chats with kvgate's ChatML template (chat_template: chatml)")
        return self


class ImagePolicy(_Strict):
    """What an image content part costs and where its bytes may come from (docs/gateway.md, Images).

    ``cost``: ``fixed`` (every image costs ``tokenizer.image_tokens``; set it to at least the
    model's largest per-image cost), ``openai_tiles`` (OpenAI's tile formula: fit within
    2048 x 2048, shortest side scaled to 768, then ``base_tokens + tile_tokens x`` 512-px tiles;
    ``detail: low`` is ``base_tokens``) or ``qwen2_vl`` (Qwen2-VL / Qwen2.5-VL: the image resized
    as ``smart_resize`` does, to multiples of 28 px with ``min_pixels <= h x w <= max_pixels``,
    then ``(h / 28) x (w / 28)`` tokens plus 2 for the vision start/end tokens). Images whose size
    cannot be read from the bytes (any URL that is not ``data:``) cost the formula's maximum.
    ``allowed_url_hosts``: host names whose ``http(s)`` image URLs may be forwarded (the engine
    fetches them); empty (the default) means ``data:`` URLs only. A model served by an upstream
    whose engine is ``kvgate`` (the bundled backend, text only) takes no images: its image parts
    are a 400, and a policy other than the default is a load error (:meth:`Settings._images_served`).
    """

    cost: Literal["fixed", "openai_tiles", "qwen2_vl"] = "fixed"
    base_tokens: int = Field(default=85, ge=0)
    tile_tokens: int = Field(default=170, ge=1)
    min_pixels: int = Field(default=56 * 56, ge=28 * 28)
    max_pixels: int = Field(default=28 * 28 * 16384, ge=28 * 28)
    allowed_url_hosts: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _pixels(self) -> ImagePolicy:
        if self.min_pixels > self.max_pixels:
            raise ValueError("min_pixels must be <= max_pixels")
        return self


class ModelConfig(_Strict):
    """A model the gateway serves. ``id`` is the public name; ``aliases`` other accepted names;
    ``upstream_model`` the name sent upstream (default ``id``); ``context_length`` in tokens;
    ``images``: the image cost and URL policy (:class:`ImagePolicy`).
    ``task``: what it serves (docs/design.md, "New keys"): ``chat`` (``/v1/chat/completions``,
    ``/v1/completions``, ``/v1/responses``) or ``embedding`` (``/v1/embeddings``); both serve
    ``/tokenize`` and ``/detokenize``. ``matryoshka`` (embedding models): which ``dimensions`` the
    engine takes, as vLLM reads the model's config (``is_matryoshka``, ``matryoshka_dimensions``):
    ``false`` none (``dimensions`` is refused), ``true`` any, or the list of those it takes
    (:func:`gateway.admission.engine_refusals.check_embedding_dimensions`)."""

    id: str
    aliases: list[str] = Field(default_factory=list)
    upstream_model: str | None = None
    context_length: int = Field(ge=2)
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig)
    images: ImagePolicy = Field(default_factory=ImagePolicy)
    task: Literal["chat", "embedding"] = "chat"
    matryoshka: StrictBool | Annotated[list[Annotated[StrictInt, Field(ge=1)]], Field(min_length=1)] = False

    @model_validator(mode="after")
    def _matryoshka_embeds(self) -> ModelConfig:
        if self.matryoshka is not False and self.task != "embedding":
            raise ValueError("'matryoshka' is for embedding models (task: embedding)")
        return self


class UpstreamConfig(_Strict):
    """An engine deployment (docs/design.md, "Upstream entry").

    ``api_url``: OpenAI base URL (ending in ``/v1``). ``pool_source``: where the live pool is
    read. ``pool_urls``: server-info URLs of every prefill node (sglang/kvgate) or the
    ``/v1/models`` URL (vllm). ``static_pool_tokens``: the pool for ``pool_source: static``.
    ``models``: model ids (or aliases) it serves. ``engine``: what serves it (``sglang`` |
    ``vllm`` | ``kvgate`` | ``openai``), which picks the table of extension fields passed through
    (gateway/admission/fields.py); left out, it follows ``pool_source`` (``static``: ``openai``, the OpenAI
    fields only).
    ``pass_stateful_responses``: forward
    ``/v1/responses`` requests that use engine-side state (``previous_response_id``,
    ``conversation``, ``background``, ``store: true``) instead of refusing them with a 400; the
    prompt the engine then builds from its stored state is not the one kvgate counted
    (docs/gateway.md, "Routes").
    """

    name: str
    api_url: str
    pool_source: Literal["sglang", "vllm", "kvgate", "static"] = "kvgate"
    engine: Literal["sglang", "vllm", "kvgate", "openai"] | None = None
    pool_urls: list[str] = Field(default_factory=list)
    static_pool_tokens: int | None = Field(default=None, ge=1)
    models: list[str]
    api_key: SecretStr | None = None
    weight: int = Field(default=1, ge=1)
    pass_stateful_responses: bool = False

    @field_validator("name")
    @classmethod
    def _name_ok(cls, v: str) -> str:
        if not _NAME.fullmatch(v):
            raise ValueError("must be 1-64 characters of letters, digits, '.', '_' or '-'")
        return v

    @field_validator("api_url")
    @classmethod
    def _api_url_ok(cls, v: str) -> str:
        return http_url(v)

    @model_validator(mode="after")
    def _engine_follows_pool_source(self) -> UpstreamConfig:
        if self.engine is None:
            engine = "openai" if self.pool_source == "static" else self.pool_source
            object.__setattr__(self, "engine", engine)  # no re-validation loop
        return self

    @model_validator(mode="after")
    def _pool_needs(self) -> UpstreamConfig:
        if self.pool_source == "static" and self.static_pool_tokens is None:
            raise ValueError("pool_source 'static' needs 'static_pool_tokens'")
        if self.pool_source != "static" and not self.pool_urls:
            raise ValueError(f"pool_source '{self.pool_source}' needs at least one entry in 'pool_urls'")
        return self


class PoolSettings(_Strict):
    """Live-pool watcher: ``headroom`` divides the pool (runbook: 1.25); polling and staleness in seconds.

    ``poll_interval_seconds`` must be below ``max_staleness_seconds``: otherwise every reading is
    stale before the next poll and admission and ``/readyz`` fail (503 ``pool_size_unknown``)
    between polls. ``request_timeout_seconds`` is not part of the rule: a poll that fails (one
    that takes its whole timeout too) drops the reading at once, so the timeout never keeps a
    reading alive; and a staleness below interval + timeout is how a hung pool read fails closed
    before its timeout."""

    headroom: float = Field(default=1.25, ge=1.0, le=100.0)
    poll_interval_seconds: float = Field(default=5.0, gt=0)
    max_staleness_seconds: float = Field(default=30.0, gt=0)
    request_timeout_seconds: float = Field(default=2.0, gt=0)

    @model_validator(mode="after")
    def _polled_before_stale(self) -> PoolSettings:
        if self.poll_interval_seconds >= self.max_staleness_seconds:
            raise ValueError(
                f"poll_interval_seconds ({self.poll_interval_seconds:.15g}) must be less than max_staleness_seconds "
                f"({self.max_staleness_seconds:.15g}): every reading would go stale before the next poll, and "
                "admission and /readyz would fail with 503 pool_size_unknown between polls"
            )
        return self


class GatewaySettings(_Strict):
    """The HTTP edge: bind address, body limit, upstream timeouts (seconds), drain on SIGTERM.

    Engine side: ``connect_timeout_seconds`` (a connect, or the wait for a pooled connection),
    ``read_timeout_seconds`` (between two bytes of an answer) and ``exchange_timeout_seconds``
    (the whole exchange, from the request written to the answer's last byte; ``None``: unbounded),
    each 504 ``upstream_timeout`` beyond it, or a stream's error tail once the stream has started.

    Client side (:mod:`gateway.edge.protocol`; docs/gateway.md, "Edge limits"): ``max_inbound_connections``
    client connections per process (``max_connections`` sizes each upstream's connection pool, of which
    one tenant holds at most ``upstream_tenant_share``, a fraction in (0, 1]: ``max(1, floor(share x
    max_connections))`` connections, 1 no cap; :mod:`gateway.relay.upstreams`; ``upstream_client``
    picks its transport, ``h1`` or ``aiohttp``: :mod:`gateway.relay.upstream_client`),
    ``max_connections_per_client`` of them per client address (``None``: an eighth of the total),
    ``max_pipelined_requests`` queued on one connection, ``max_body_chunks`` /
    ``min_chunk_bytes`` (413 for a chunked body of more chunks, or chunks averaging less),
    ``max_header_bytes`` / ``max_header_count``
    (431 above), ``header_timeout_seconds`` / ``body_timeout_seconds`` (408 when a request head or
    body arrives slower), ``keepalive_timeout_seconds``, ``send_timeout_seconds`` (a client
    that takes none of the answer bytes waiting for it this long is cut off). ``max_sse_event_bytes`` bounds one
    upstream stream event, ``max_response_bytes`` an upstream answer read whole (502 above);
    ``max_body_values`` the JSON values of one request body besides its
    token-id arrays, which are parsed in slices and not counted (413 above, before it is parsed);
    ``large_body_bytes_per_second`` what the bytes past each body's first 64 KiB may take of one
    process, shared in turn by tenants (:mod:`gateway.edge.body_budget`; ``None``: unpaced);
    ``refusal_delay_seconds`` how long a 401 (no valid key:
    :func:`gateway.routes.handlers.refusal`) or a 431 (a head too large: :mod:`gateway.edge.protocol`)
    waits before it is answered (0: at once);
    ``metrics_token``, when set, is the bearer token ``/metrics`` and ``/readyz``'s details need.
    ``offload_count_chars``: a request whose counting costs more (characters plus element weights,
    :func:`tokenizer.base.prompt_cost`) is counted in a worker thread, as are a tenant's shorter
    ones once it has spent its share of the event loop (:mod:`gateway.edge.offload`).
    ``offload_threads``: threads of the pool that parses large bodies and counts (``None``:
    ``min(32, usable cores + 4)``); ``offload_tenant_share``: the most of them one tenant holds at
    once (``None``: a quarter, at least 1; :mod:`gateway.edge.offload`).

    ``workers``: gateway worker processes on the one port (docs/design.md, Contracts: "Workers");
    ``None`` = the usable cores (``os.sched_getaffinity``, capped by a cgroup CPU quota) when
    ``redis_url`` is set, else 1. ``reuse_port``: each worker binds its own ``SO_REUSEPORT``
    socket instead of sharing the supervisor's (any process of the same user may then bind the
    port too and receive connections; :mod:`gateway.edge.workers`).
    """

    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=1, le=65535)
    max_body_bytes: int = Field(default=8 * 1024 * 1024, ge=1024)
    connect_timeout_seconds: float = Field(default=5.0, gt=0)
    read_timeout_seconds: float = Field(default=300.0, gt=0)
    exchange_timeout_seconds: float | None = Field(default=3600.0, gt=0)
    drain_timeout_seconds: float = Field(default=30.0, ge=0)
    max_connections: int = Field(default=512, ge=1)
    upstream_tenant_share: float = Field(default=0.75, gt=0, le=1)
    upstream_client: Literal["h1", "aiohttp"] = "h1"
    offload_count_chars: int = Field(default=16_384, ge=0)
    offload_threads: int | None = Field(default=None, ge=1, le=256)
    offload_tenant_share: int | None = Field(default=None, ge=1, le=256)
    max_inbound_connections: int = Field(default=1024, ge=1)
    max_connections_per_client: int | None = Field(default=None, ge=1)
    max_pipelined_requests: int = Field(default=8, ge=1)
    max_body_chunks: int = Field(default=16_384, ge=16)
    min_chunk_bytes: int = Field(default=256, ge=1)
    max_header_bytes: int = Field(default=64 * 1024, ge=1024)
    max_header_count: int = Field(default=100, ge=8)
    header_timeout_seconds: float = Field(default=10.0, gt=0)
    body_timeout_seconds: float = Field(default=30.0, gt=0)
    keepalive_timeout_seconds: float = Field(default=5.0, gt=0)
    send_timeout_seconds: float = Field(default=30.0, gt=0)
    max_sse_event_bytes: int = Field(default=1 << 20, ge=1024)
    max_response_bytes: int = Field(default=64 << 20, ge=1024)
    max_body_values: int = Field(default=131_072, ge=1024)
    large_body_bytes_per_second: int | None = Field(default=16 * 1024 * 1024, ge=65_536)
    refusal_delay_seconds: float = Field(default=0.5, ge=0, le=10)
    metrics_token: SecretStr | None = Field(default=None, min_length=1)
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    workers: int | None = Field(default=None, ge=1, le=256)
    reuse_port: bool = False


class QuotaSettings(_Strict):
    """Per-tenant quota enforcement. Windows in seconds (a minute by default; tests shorten them).

    ``redis_failure_policy``: ``fail_closed`` (503 + Retry-After) or ``local_fallback``
    (per-process limits of limit / (``replicas`` x ``gateway.workers``): ``replicas`` counts
    ``kvgate serve`` instances, each running ``gateway.workers`` processes).
    ``redis_timeout_seconds`` bounds every Redis connect and read (the verifier's stores too).
    """

    enabled: bool = True
    window_seconds: float = Field(default=60.0, gt=0, le=MAX_TTL_SECONDS)
    lease_ttl_seconds: float = Field(default=120.0, gt=0, le=MAX_TTL_SECONDS)
    redis_timeout_seconds: float = Field(default=0.25, gt=0)
    redis_failure_policy: Literal["fail_closed", "local_fallback"] = "fail_closed"
    replicas: int = Field(default=1, ge=1)
    retry_after_on_failure_seconds: int = Field(default=1, ge=1)


class VerifierSettings(_Strict):
    """Response verification (docs/design.md, Verifier). Lengths in tokens, times in seconds."""

    enabled: bool = True
    shingle_k: int = Field(default=16, ge=4)
    winnow_w: int = Field(default=35, ge=1)
    leak_index_ttl_seconds: float = Field(default=3600.0, gt=0, le=MAX_TTL_SECONDS)
    leak_min_shingles: int = Field(default=1, ge=1)
    leak_confirm_shingles: int = Field(default=4, ge=1)
    usage_drift_tolerance_tokens: int = Field(default=0, ge=0)
    latency_min_samples: int = Field(default=50, ge=1)
    latency_quantile: float = Field(default=0.001, gt=0, lt=0.5)
    latency_margin: float = Field(default=0.5, gt=0, le=1.0)
    latency_min_prompt_tokens: int = Field(default=512, ge=1)
    strict_holdback_tokens: int = Field(default=64, ge=1)
    quarantine_min_prompt_tokens: int = Field(default=1024, ge=1)
    probe_interval_seconds: float | None = Field(default=None, gt=0)
    probe_tenant: str | None = None
    incident_log: str | None = None
    queue_size: int = Field(default=10_000, ge=1)
    #: characters of text the background queue may hold (checks' texts and prompts, ingests'
    #: prompts); beyond it a job is dropped (``queue_full``), as beyond ``queue_size`` jobs
    queue_max_chars: int = Field(default=64 * 1024 * 1024, ge=1)
    #: most of ``queue_size`` and of ``queue_max_chars`` one tenant's jobs may hold
    queue_tenant_share: float = Field(default=0.5, gt=0, le=1.0)
    #: most of ``latency_min_samples`` one tenant's samples may fill (no tenant calibrates alone)
    latency_tenant_share: float = Field(default=0.5, gt=0, le=1.0)
    #: prompt text (UTF-8 bytes) waiting for or in admission-time ingest; beyond it a prompt is
    #: not indexed (counted in ``kvgate_verifier_dropped_total{reason="ingest_bytes"}``)
    max_pending_ingest_bytes: int = Field(default=64 * 1024 * 1024, ge=1)
    #: admission-time ingests of one tenant running at once (the rest of its requests wait)
    ingest_concurrency_per_tenant: int = Field(default=1, ge=1)
    #: a strict response with more text (UTF-8 bytes, every field) is withheld whole
    strict_max_text_bytes: int = Field(default=1024 * 1024, ge=1)
    #: raw event bytes a strict stream may hold back at once (a fast first token holds the whole
    #: rest; events without text queue behind held text); beyond it the stream is cut (withheld)
    strict_max_held_bytes: int = Field(default=64 * 1024 * 1024, ge=1024)
    #: window in which leak evidence from two distinct source tenants raises a high-severity alert
    #: (it never quarantines: only kvgate's own canaries or an operator do)
    quarantine_window_seconds: float = Field(default=600.0, gt=0)
    #: a shingle of one tenant's prompt found in answers to this many distinct other tenants
    #: within ``public_text_window_seconds`` is public text (licences, famous quotes): no evidence
    public_text_tenants: int = Field(default=3, ge=2)
    public_text_window_seconds: float = Field(default=3600.0, gt=0)
    #: per tenant and ``tenant_cap_window_seconds``: most leak-index fingerprints and canaries
    #: indexed (beyond: not indexed, counted in ``kvgate_verifier_cap_dropped_total``)
    tenant_cap_window_seconds: float = Field(default=60.0, gt=0)
    leak_index_tenant_cap_fingerprints: int = Field(default=120_000, ge=1)
    canary_tenant_cap: int = Field(default=1_000, ge=1)
    #: distinct tenants whose samples a latency bucket needs before it calibrates
    latency_min_tenants: int = Field(default=3, ge=1)


class BackendSettings(_Strict):
    """The bundled engine (``python -m gpu_backend``); names follow docs/design.md's backend flags."""

    role: Literal["all", "prefill", "decode", "router"] = "all"
    host: str = "127.0.0.1"
    port: int = Field(default=30000, ge=1, le=65535)
    prefill_url: str = "http://127.0.0.1:30001"
    decode_url: str = "http://127.0.0.1:30002"
    model: str = "tiny-random"
    served_model_name: str = "kvgate-tiny"
    device: str = "auto"
    context_length: int = Field(default=8192, ge=16)
    page_size: int = Field(default=16, ge=1)
    max_total_tokens: int | None = Field(default=None, ge=16)
    prefill_max_total_tokens: int = Field(default=4096, ge=16)
    decode_max_total_tokens: int = Field(default=16384, ge=16)
    mem_budget_bytes: int | None = Field(default=None, ge=1)
    mem_fraction_static: float = Field(default=0.88, gt=0, le=1)
    pool_wait_timeout_seconds: float = Field(default=10.0, gt=0)
    transfer_timeout_seconds: float = Field(default=30.0, gt=0)
    seed: int = 0


class Settings(_Strict):
    """Everything in ``kvgate.yaml``. ``redis_url``: one URL (``redis://``, ``rediss://``,
    ``unix://``, ``redis+sentinel://``, ``redis+cluster://`` and their TLS twins: see
    :mod:`config.redis_client`); ``None`` keeps quotas and the leak index in process.
    ``state_dir``: where generated secrets and incident records live."""

    gateway: GatewaySettings = Field(default_factory=GatewaySettings)
    pool: PoolSettings = Field(default_factory=PoolSettings)
    quotas: QuotaSettings = Field(default_factory=QuotaSettings)
    verifier: VerifierSettings = Field(default_factory=VerifierSettings)
    backend: BackendSettings = Field(default_factory=BackendSettings)
    models: list[ModelConfig] = Field(default_factory=list)
    upstreams: list[UpstreamConfig] = Field(default_factory=list)
    redis_url: str | None = None
    state_dir: str = ".kvgate"

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, v: str | None) -> str | None:
        """A URL :func:`config.redis_client.parse_redis_url` accepts (unknown scheme, sentinel
        without service, cluster without nodes: refused at load, not at the first request)."""
        if v:
            from config.redis_client import parse_redis_url

            parse_redis_url(v)
        return v

    @model_validator(mode="after")
    def _cross_refs(self) -> Settings:
        """Model ids and aliases are unique; upstream names are unique; every model an upstream
        serves is a model id or alias. Messages start with the key path at fault."""
        names: dict[str, str] = {}
        for i, m in enumerate(self.models):
            for n in [m.id, *m.aliases]:
                if n in names:
                    raise ValueError(f"models[{i}]: model name '{n}' is already used by model '{names[n]}'")
                names[n] = m.id
        seen: set[str] = set()
        for i, u in enumerate(self.upstreams):
            if u.name in seen:
                raise ValueError(f"upstreams[{i}].name: upstream name '{u.name}' is used twice")
            seen.add(u.name)
            for j, n in enumerate(u.models):
                if n not in names:
                    raise ValueError(
                        f"upstreams[{i}].models[{j}]: unknown model '{n}' "
                        "(not the id or an alias of any entry in 'models')"
                    )
        return self

    @model_validator(mode="after")
    def _embeddings_served(self) -> Settings:
        """No upstream whose engine is the bundled backend (``kvgate``, which has no
        ``/v1/embeddings``) serves an embedding model: its every request would be admitted,
        charged and answered 404."""
        for at, u, m in self._bundled_backend_models():
            if m.task == "embedding":
                raise ValueError(
                    f"{at}: model '{m.id}' has task 'embedding', but upstream '{u.name}' "
                    "has engine 'kvgate' (the bundled backend serves no /v1/embeddings)"
                )
        return self

    @model_validator(mode="after")
    def _images_served(self) -> Settings:
        """No upstream whose engine is the bundled backend (``kvgate``, which encodes its prompt as
        text and refuses image parts) serves a model whose ``images`` policy differs from the
        default (any key: a cost formula, its sizes, ``allowed_url_hosts``): the policy says the
        model takes images, and the gateway refuses every image for it (any of its upstreams may
        get the request). The default policy, which every model has, written out or not, loads."""
        default = ImagePolicy()
        for at, u, m in self._bundled_backend_models():
            if m.images != default:
                raise ValueError(
                    f"{at}: model '{m.id}' has an 'images' policy, but upstream '{u.name}' "
                    "has engine 'kvgate' (the bundled backend takes no images); remove the policy or serve the "
                    "model elsewhere"
                )
        return self

    @model_validator(mode="after")
    def _chats_countable(self) -> Settings:
        """No chat model (``task: chat``) is counted by SGLang's ``/v1/tokenize`` (``kind: engine``,
        ``engine_api: sglang``), which takes no ``messages`` (docs/tokenizer.md, "engine"): every
        chat would be a 502 ``upstream_unavailable`` while ``/readyz`` says 200. The bundled
        backend (engine ``kvgate``) takes ``messages`` on that path, so a model it counts loads;
        which engine answers is :meth:`_tokenize_engines`'s reading."""
        for i, m in enumerate(self.models):
            tok = m.tokenizer
            if m.task != "chat" or tok.kind != "engine" or tok.engine_api != "sglang":
                continue
            engines = self._tokenize_engines(m)
            if "sglang" in engines and "kvgate" not in engines:
                raise ValueError(
                    f"models[{i}].tokenizer: model '{m.id}' serves chats (task: chat), but kind 'engine' with "
                    "engine_api 'sglang' asks SGLang's /v1/tokenize, which takes no messages: every chat request "
                    "would answer 502 upstream_unavailable. Count it with the model's own tokenizer files (kind: hf, "
                    "path: a folder with its tokenizer.json and tokenizer_config.json) or with vLLM's /tokenize "
                    "(engine_api: vllm, url: a vLLM server of the model)"
                )
        return self

    def _tokenize_engines(self, m: ModelConfig) -> set[str | None]:
        """The engines behind ``m.tokenizer.url`` as far as the settings say: those of the upstreams
        whose ``api_url`` has its scheme, host and port, else (none has) those of the upstreams
        serving ``m``."""
        want = url_origin(m.tokenizer.url or "")
        at: set[str | None] = {u.engine for u in self.upstreams if url_origin(u.api_url) == want}
        names = {m.id, *m.aliases}
        return at or {u.engine for u in self.upstreams if names.intersection(u.models)}

    def _bundled_backend_models(self) -> list[tuple[str, UpstreamConfig, ModelConfig]]:
        """``(key path, upstream, model)`` for each model an upstream whose engine is the bundled
        backend (``kvgate``) serves, the path ``upstreams[i].models[j]``."""
        return [
            (f"upstreams[{i}].models[{j}]", u, m)
            for i, u in enumerate(self.upstreams)
            if u.engine == "kvgate"
            for j, n in enumerate(u.models)
            if (m := self.model_by_name(n)) is not None
        ]

    def model_by_name(self, name: str) -> ModelConfig | None:
        """The model whose id or alias is ``name``, else ``None``."""
        for m in self.models:
            if name == m.id or name in m.aliases:
                return m
        return None


class TenantConfig(_Strict):
    """A tenant (docs/design.md, "Tenant entry"). Limits: ``rpm`` requests/window, ``tpm`` prompt +
    completion tokens/window, ``max_concurrent`` in-flight requests, ``max_context_tokens``
    prompt + completion per request; ``None`` means unlimited. ``api_key_sha256``: lowercase hex
    SHA-256 of each valid key. ``verify_sample_rate`` in [0, 1]. ``max_sequences_per_request``:
    prompts x max(n, best_of) one request may ask for (every route). ``max_embedding_inputs``: the most
    inputs one ``/v1/embeddings`` request may carry (OpenAI's own cap is 2048)."""

    id: str
    api_key_sha256: list[str] = Field(default_factory=list)
    rpm: int | None = Field(default=None, ge=0, le=MAX_LIMIT)
    tpm: int | None = Field(default=None, ge=0, le=MAX_LIMIT)
    max_concurrent: int | None = Field(default=None, ge=0, le=MAX_LIMIT)
    max_context_tokens: int | None = Field(default=None, ge=2)
    max_tokens_cap: int | None = Field(default=None, ge=1)
    default_max_tokens: int = Field(default=256, ge=1)
    max_sequences_per_request: int = Field(default=16, ge=1)
    allowed_models: list[str] = Field(default_factory=list)
    verify_sample_rate: float = Field(default=0.0, ge=0.0, le=1.0)
    strict_verify: bool = False
    honeypot: bool = False
    max_embedding_inputs: int = Field(default=2048, ge=1)

    @field_validator("id")
    @classmethod
    def _id_ok(cls, v: str) -> str:
        if not _NAME.fullmatch(v):
            raise ValueError("must be 1-64 characters of letters, digits, '.', '_' or '-'")
        return v

    @field_validator("api_key_sha256")
    @classmethod
    def _hashes_ok(cls, v: list[str]) -> list[str]:
        for h in v:
            if not _SHA256_HEX.fullmatch(h):
                raise ValueError("each entry must be 64 lowercase hex digits (the SHA-256 of a key)")
        return v


class TenantsFile(_Strict):
    """Everything in ``tenants.yaml``: ``tenants`` (a list)."""

    tenants: list[TenantConfig] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique(self) -> TenantsFile:
        """Tenant ids are unique and no API key hash belongs to two tenants."""
        ids: set[str] = set()
        hashes: dict[str, str] = {}
        for i, t in enumerate(self.tenants):
            if t.id in ids:
                raise ValueError(f"tenants[{i}].id: tenant id '{t.id}' is used twice")
            ids.add(t.id)
            for j, h in enumerate(t.api_key_sha256):
                if hashes.get(h) == t.id:
                    raise ValueError(f"tenants[{i}].api_key_sha256[{j}]: this API key hash is listed twice")
                if h in hashes:
                    raise ValueError(
                        f"tenants[{i}].api_key_sha256[{j}]: this API key hash also belongs to tenant '{hashes[h]}'"
                    )
                hashes[h] = t.id
        return self
