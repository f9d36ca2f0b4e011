"""Admission edge cases: tokenizer failures keep their status, tenants naming unknown models are
refused at start-up and on reload (the old table stays)."""

from __future__ import annotations

from pathlib import Path

import pytest

from config.errors import ErrorCode
from config.loader import ConfigError, load_settings
from gateway.ops.tenants import TenantRegistry, hash_key
from tokenizer.errors import EngineTokenizeError, InvalidTokenIdError, UnknownContentPartError

TENANT = """tenants:
  - id: t1
    api_key_sha256: [{h}]
    allowed_models: [{model}]
"""


def test_request_faults_are_400_naming_the_field() -> None:
    e = UnknownContentPartError("input_audio", "messages[0].content[1].type").to_openai()
    assert (e.status, e.code, e.param) == (400, ErrorCode.INVALID_REQUEST, "messages[0].content[1].type")
    e = InvalidTokenIdError(-1, 100277, "prompt[2]").to_openai()
    assert (e.status, e.param) == (400, "prompt[2]")


def test_engine_tokenize_failure_is_502_upstream_unavailable_not_a_400() -> None:
    e = EngineTokenizeError("engine tokenize answered 500").to_openai()
    assert (e.status, e.code, e.param) == (502, "upstream_unavailable", None)
    assert e.body()["error"]["type"] == "server_error"


def test_unknown_allowed_model_refused_at_load_and_dropped_at_reload(tmp_path: Path) -> None:
    """A start refuses a tenants file naming an unknown model. A reload applies the file with the
    unknown names dropped (a tenant left with none is left out, never widened to every model):
    refusing it kept the earlier table, a key revoked in the same edit included, valid while the
    CLI said the revocation was done."""
    settings = load_settings()
    path = tmp_path / "tenants.yaml"
    path.write_text(TENANT.format(h=hash_key("sk-t1"), model="no-such-model"))
    with pytest.raises(ConfigError) as err:
        TenantRegistry.from_path(path, settings)
    assert str(err.value) == (
        f"{path}: tenants[0].allowed_models[0]: unknown model 'no-such-model' "
        "(not the id or an alias of any model in the settings)"
    )

    path.write_text(TENANT.format(h=hash_key("sk-t1"), model="kvgate-tiny"))
    reg = TenantRegistry.from_path(path, settings)
    assert reg.lookup("sk-t1").id == "t1"
    two = TENANT + "  - id: t2\n    api_key_sha256: [{h2}]\n    allowed_models: [kvgate-tiny, typo-model]\n"
    # t1's key is rotated to sk-t3 in the same edit that gives t1 only a typo'd model
    path.write_text(two.format(h=hash_key("sk-t3"), model="typo-model", h2=hash_key("sk-t2")))
    reg.reload()
    assert (reg.lookup("sk-t1"), reg.lookup("sk-t3"), reg.version) == (None, None, 2)  # t1 left out
    assert reg.lookup("sk-t2").allowed_models == ["kvgate-tiny"]
    assert reg.notes == [
        "tenant t1: allowed only typo-model, not served by this stack; left out",
        "tenant t2: allowed typo-model not served by this stack; those ignored",
    ]
