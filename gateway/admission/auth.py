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


def bearer_key(authorization: str | None) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` header (scheme case-insensitive), else ``None``."""
    if not authorization:
        return None
    scheme, _, key = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    key = key.strip()
    return key or None


def authenticate(authorization: str | None, registry: TenantRegistry) -> TenantConfig:
    """The tenant of the presented key. Raises :class:`OpenAIError` 401 ``invalid_api_key``
    (type ``authentication_error``, as the OpenAI API answers) when the header is missing,
    not Bearer, or the key matches no tenant."""
    key = bearer_key(authorization)
    if key is None:
        raise OpenAIError(401, _MISSING, code=ErrorCode.INVALID_API_KEY)
    tenant = registry.lookup(key)
    if tenant is None:
        raise OpenAIError(401, _WRONG, code=ErrorCode.INVALID_API_KEY)
    return tenant
