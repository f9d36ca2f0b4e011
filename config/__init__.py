"""kvgate configuration: pydantic models of every setting, YAML loading with env overrides,
and the wire shapes every part shares (the OpenAI error body).

Dependency rule: ``config`` imports nothing else of kvgate.
"""

from config.errors import ErrorCode, OpenAIError, openai_error, openai_error_bytes
from config.loader import ConfigError, check_tenant_models, load_settings, load_tenants, load_yaml_model
from config.models import (
    BackendSettings,
    GatewaySettings,
    ModelConfig,
    PoolSettings,
    QuotaSettings,
    Settings,
    TenantConfig,
    TenantsFile,
    TokenizerConfig,
    UpstreamConfig,
    VerifierSettings,
)

__all__ = [
    "BackendSettings",
    "ConfigError",
    "ErrorCode",
    "GatewaySettings",
    "ModelConfig",
    "OpenAIError",
    "PoolSettings",
    "QuotaSettings",
    "Settings",
    "TenantConfig",
    "TenantsFile",
    "TokenizerConfig",
    "UpstreamConfig",
    "VerifierSettings",
    "check_tenant_models",
    "load_settings",
    "load_tenants",
    "load_yaml_model",
    "openai_error",
    "openai_error_bytes",
]
