"""What admission asks of an API route (docs/design.md, "Routes"): each route of
:mod:`gateway.routes` is one value carrying its path, the model tasks that serve it, its field
table (``validate``), how its prompt is counted (``count``), its gate (``decide``), the body it
forwards (``forward_body``), its upstream path, its stream protocol and how it reads a whole
answer (``whole_answer``). Admission
(:mod:`gateway.admission.admit`) reads routes through :class:`ApiRoute` only, so it never
imports a concrete route.
"""

from __future__ import annotations

from typing import Any, Protocol

from config.errors import ErrorCode, OpenAIError
from config.models import TenantConfig
from gateway.admission.gate import Admission, CountedPrompt
from gateway.admission.registry import ModelEntry
from gateway.admission.value_checks import Check
from verifier.engine_response import EngineOutput

#: model task -> the public paths it serves (for the 400's message)
TASK_PATHS: dict[str, tuple[str, ...]] = {
    "chat": ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/tokenize", "/detokenize"),
    "embedding": ("/v1/embeddings", "/tokenize", "/detokenize"),
}


class Route(Protocol):
    """Every route, with a body or without (``GET /v1/models``): ``name`` (the metrics and
    access-log label), ``path`` (its public path)."""

    name: str
    path: str


class RouteBase(Route, Protocol):
    """Every route that reads a body: ``tasks`` (the model tasks that serve it), ``id_fields``
    (the fields whose token-id arrays a large body has cut out and checked before its parse),
    ``fields`` (its field table, :mod:`gateway.admission.checks`)."""

    tasks: tuple[str, ...]
    id_fields: tuple[str, ...]
    fields: dict[str, Check]

    def validate(self, body: dict[str, Any]) -> None:
        """Check ``body`` against the route's field table. Raises :class:`OpenAIError` 400."""
        ...


class ApiRoute(RouteBase, Protocol):
    """A route admission forwards upstream. ``upstream_path``: its path under an upstream's
    ``api_url``; ``stream_protocol``: how the relay reads its stream (:mod:`gateway.relay`);
    ``streams``: its ``stream`` field asks for a stream; ``adds_usage``: the gateway asks a
    stream for its usage chunk on the client's behalf (and strips it again); ``verified``: the
    verifier indexes its prompt and checks its answer."""

    upstream_path: str
    stream_protocol: Any
    streams: bool
    adds_usage: bool
    verified: bool

    async def count(
        self, entry: ModelEntry, tenant: TenantConfig, body: dict[str, Any], served: list[Any], live: int | None
    ) -> CountedPrompt:
        """The request's prompt tokens. ``served``: the upstreams serving the model
        (:class:`gateway.relay.upstreams.Upstream`); ``live``: the live pool limit (``None``:
        unknown), which a too-long prompt's 400 quotes. Raises :class:`OpenAIError` 400, 502."""
        ...

    def decide(
        self, entry: ModelEntry, tenant: TenantConfig, body: dict[str, Any], prompt: CountedPrompt, pool_limit: int
    ) -> Admission:
        """The route's gate on a counted request. Raises :class:`OpenAIError` 400."""
        ...

    def forward_body(self, body: dict[str, Any], adm: Admission, cache_salt: str, served: list[Any]) -> bytes:
        """The JSON bytes to forward (``body`` changed in place). Raises ``orjson.JSONEncodeError``."""
        ...

    def verifier_prompts(self, body: dict[str, Any]) -> tuple[list[list[int]], list[str]]:
        """``(token-id prompts, texts an echo would repeat)`` of a validated body, for the verifier."""
        ...

    def whole_answer(self, data: Any) -> EngineOutput:
        """What a decoded whole (not streamed) answer carries (:mod:`gateway.relay.whole_answer`).
        Raises :class:`OpenAIError` (the engine's error) when it is an error object."""
        ...


def check_task(entry: ModelEntry, route: RouteBase) -> None:
    """Raise 400 ``invalid_request_error`` (``param`` ``model``) when ``entry``'s task does not
    serve ``route``; the message says which routes it serves."""
    task = entry.config.task
    if task in route.tasks:
        return
    raise OpenAIError(
        400,
        f"The model `{entry.id}` is a{'n' if task[0] in 'aeiou' else ''} {task} model and does not serve "
        f"{route.path}; it serves {', '.join(TASK_PATHS[task])}.",
        code=ErrorCode.INVALID_REQUEST,
        param="model",
    )
