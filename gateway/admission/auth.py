"""Step 2, authenticate: ``Authorization: Bearer <key>`` -> the tenant (docs/design.md).

Errors are 401 ``invalid_api_key`` in the OpenAI shape; they never echo the key.
"""

from __future__ import annotations

from config.errors import ErrorCode, OpenAIError
from config.models import TenantConfig
from gateway.ops.tenants import TenantRegistry

_MISSING = (
    "You didn't provide an API key. You need to provide your API key in an Authorization "
    "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
)
_WRONG = "Incorrect API key provided."
_MANY = "Send one Authorization header; this request has {n}."


def bearer_key(authorization: str | None) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` header (scheme case-insensitive), else ``None``."""
    if not authorization:
        return None
    scheme, _, key = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    key = key.strip()
    return key or None


def authenticate(authorization: str | list[str] | None, registry: TenantRegistry) -> TenantConfig:
    """The tenant of the presented key. ``authorization``: the header's value, or every value
    the request sent. Raises :class:`OpenAIError` 401 ``invalid_api_key`` (type
    ``authentication_error``, as the OpenAI API answers) when the header is missing, sent more
    than once (a proxy that reads another of them would bill another tenant), not Bearer, or
    the key matches no tenant."""
    if isinstance(authorization, list):
        if len(authorization) > 1:
            raise OpenAIError(401, _MANY.format(n=len(authorization)), code=ErrorCode.INVALID_API_KEY)
        authorization = authorization[0] if authorization else None
    key = bearer_key(authorization)
    if key is None:
        raise OpenAIError(401, _MISSING, code=ErrorCode.INVALID_API_KEY)
    tenant = registry.lookup(key)
    if tenant is None:
        raise OpenAIError(401, _WRONG, code=ErrorCode.INVALID_API_KEY)
    return tenant
