"""What chat and completions share as routes: the prompt counted by the gate's
:func:`~gateway.admission.gate.count_prompt` (the route says how), the completion-bound rule of
:func:`~gateway.admission.gate.decide`, the body forwarded by
:func:`~gateway.admission.gate.upstream_body`, a stream that carries its usage chunk, a whole answer
read by its choices."""

from __future__ import annotations

from typing import Any

from config.models import TenantConfig
from gateway.admission.gate import Admission, CountedPrompt, count_prompt, decide, effective_limit, upstream_body
from gateway.admission.registry import ModelEntry
from gateway.relay.stream_protocol import CHAT_SSE, StreamProtocol
from gateway.relay.whole_answer import read_choices_answer
from verifier.engine_response import EngineOutput


class PromptApiRoute:
    """The base of :data:`gateway.routes.chat.CHAT` and :data:`gateway.routes.completions.COMPLETIONS`;
    a subclass gives the :class:`gateway.admission.gate.PromptRoute` methods and its tables."""

    name: str
    path: str
    upstream_path: str
    fields: dict[str, Any]
    bound_fields: tuple[str, ...]
    prompt_param: str
    tasks: tuple[str, ...] = ("chat",)
    id_fields: tuple[str, ...] = ("prompt", "input")
    stream_protocol: StreamProtocol = CHAT_SSE
    streams = True
    adds_usage = True
    verified = True

    async def count(
        self, entry: ModelEntry, tenant: TenantConfig, body: dict[str, Any], served: list[Any], live: int | None
    ) -> CountedPrompt:
        limit = effective_limit(entry, tenant, live) if live is not None else None
        return await count_prompt(entry, body, self, max_sequences=tenant.max_sequences_per_request, limit=limit)  # type: ignore[arg-type]

    def decide(
        self, entry: ModelEntry, tenant: TenantConfig, body: dict[str, Any], prompt: CountedPrompt, pool_limit: int
    ) -> Admission:
        return decide(entry, tenant, body, self, prompt, pool_limit)  # type: ignore[arg-type]

    def forward_body(self, body: dict[str, Any], adm: Admission, cache_salt: str, served: list[Any]) -> bytes:
        return upstream_body(body, adm, cache_salt)

    def whole_answer(self, data: Any) -> EngineOutput:
        return read_choices_answer(data)
