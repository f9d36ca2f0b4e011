"""The model registry: every served model (its config, its prompt counter and the engines that
serve it), found by id or alias for a tenant (:class:`ModelIndex`); a name the tenant may not
use is 404 ``model_not_found``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from config.errors import ErrorCode, OpenAIError
from config.models import ModelConfig, Settings, TenantConfig, url_origin
from tokenizer import PromptCounter, make_counter
from tokenizer.images import ImageCoster

log = logging.getLogger("kvgate.models")


@dataclass
class ModelEntry:
    """A served model: its config, its counter and the engines (upstream ``engine`` values) that
    serve it, which pick the fields passed through (:mod:`gateway.admission.fields`)."""

    config: ModelConfig
    counter: PromptCounter
    engines: frozenset[str] = frozenset()

    @property
    def id(self) -> str:
        return self.config.id

    @property
    def upstream_model(self) -> str:
        return self.config.upstream_model or self.config.id


def engine_api_key(settings: Settings, tokenize_url: str | None) -> str | None:
    """The ``api_key`` of the first upstream whose ``api_url`` shares the scheme, host and port of
    ``tokenize_url`` (an engine tokenizer's base URL), else ``None``. ``tokenizer.api_key``, when
    set, wins over it (:func:`tokenizer.make_counter`)."""
    if not tokenize_url:
        return None
    want = url_origin(tokenize_url)
    for u in settings.upstreams:
        if u.api_key is not None and url_origin(u.api_url) == want:
            return u.api_key.get_secret_value() or None
    return None


class ModelIndex:
    """Name (id or alias) -> :class:`ModelEntry`, built once per app from settings."""

    def __init__(self, settings: Settings, offload_chars: int | None = None) -> None:
        self.by_name: dict[str, ModelEntry] = {}
        self.entries: list[ModelEntry] = []
        engines: dict[str, set[str]] = {}
        for u in settings.upstreams:
            for n in u.models:
                served = settings.model_by_name(n)
                if served is not None and u.engine is not None:
                    engines.setdefault(served.id, set()).add(u.engine)
        for m in settings.models:
            counter = make_counter(m.tokenizer, m.upstream_model or m.id, engine_api_key(settings, m.tokenizer.url))
            if offload_chars is not None:
                counter.offload_chars = offload_chars
            counter.engines = frozenset(engines.get(m.id, ()))  # chats counted as these engines render them
            if m.images.cost != "fixed":
                counter.image_cost = ImageCoster(m.images, m.tokenizer.image_tokens)
            e = ModelEntry(m, counter, frozenset(engines.get(m.id, ())))
            self.entries.append(e)
            for n in (m.id, *m.aliases):
                self.by_name[n] = e
        self._allowed_cache: dict[tuple[str, ...], tuple[ModelEntry, ...]] = {}

    def warm_up(self) -> None:
        """Each model's counter's :meth:`~tokenizer.PromptCounter.warm_up` (blocking: call it in
        a worker thread); a counter that fails is logged and left to fail on its requests."""
        for e in self.entries:
            try:
                e.counter.warm_up()
            except Exception as exc:  # the model's requests meet the same error, answered as usual
                log.warning("warming up the counter of model %s failed: %s", e.id, exc)

    def allowed(self, tenant: TenantConfig) -> tuple[ModelEntry, ...]:
        """The models ``tenant`` may use (``allowed_models`` names ids or aliases; empty = all)."""
        key = tuple(tenant.allowed_models)
        hit = self._allowed_cache.get(key)
        if hit is None:
            if not key:
                hit = tuple(self.entries)
            else:
                seen: list[ModelEntry] = []
                for n in key:
                    e = self.by_name.get(n)
                    if e is not None and e not in seen:
                        seen.append(e)
                hit = tuple(seen)
            self._allowed_cache[key] = hit
        return hit

    def resolve(self, tenant: TenantConfig, name: str | None) -> ModelEntry:
        """The model ``name`` names for ``tenant``. Raises :class:`OpenAIError` 404
        ``model_not_found`` (unknown or not allowed) or 400 (``model`` missing while the tenant
        has several models)."""
        allowed = self.allowed(tenant)
        if name is None:
            if len(allowed) == 1:
                return allowed[0]
            raise OpenAIError(400, "you must provide a model parameter", code=ErrorCode.INVALID_REQUEST, param="model")
        e = self.by_name.get(name)
        if e is None or e not in allowed:
            raise OpenAIError(
                404,
                f"The model `{name}` does not exist or you do not have access to it.",
                code=ErrorCode.MODEL_NOT_FOUND,
                param="model",
            )
        return e
