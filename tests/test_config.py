"""config/: YAML loading with exact error messages, environment overrides, secrets."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from pydantic import ValidationError
from conftest import ROOT

from config import (
    ConfigError,
    Settings,
    TenantConfig,
    TokenizerConfig,
    UpstreamConfig,
    check_tenant_models,
    load_settings,
    load_tenants,
)
from config.loader import DEFAULT_CONFIG, DEFAULT_TENANTS, env_overrides, served_tenants
from config.secrets import SECRET_NAMES, SecretsError, load_secrets, permission_problems, private_dir

UPSTREAM = """\
upstreams:
  - name: local
    api_url: http://127.0.0.1:30000/v1
    pool_urls: [http://127.0.0.1:30000/server_info]
    models: [m1]
"""
MODELS = """\
models:
  - id: m1
    aliases: [m1-alias]
    context_length: 8192
"""


def write(tmp_path: Path, text: str, name: str = "kvgate.yaml") -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text), encoding="utf-8")
    return p


def problems(path: Path, environ: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as ei:
        load_settings(path, environ=environ or {})
    assert ei.value.source == str(path)
    return str(ei.value)


# ---------------------------------------------------------------- the shipped files
def test_default_files_load_and_agree():
    s = load_settings(environ={})
    assert (s.gateway.host, s.gateway.port, s.gateway.max_body_bytes) == ("127.0.0.1", 8080, 8 * 1024 * 1024)
    assert s.pool.headroom == 1.25 and s.redis_url is None
    assert [m.id for m in s.models] == ["kvgate-tiny"]
    assert s.model_by_name("tiny-random").id == "kvgate-tiny"
    assert s.model_by_name("nope") is None
    assert s.models[0].tokenizer == TokenizerConfig(kind="bundled", chat_template="chatml", image_tokens=765)
    assert s.upstreams[0].pool_urls == ["http://127.0.0.1:30000/server_info"]
    assert (s.backend.context_length, s.backend.prefill_max_total_tokens, s.backend.decode_max_total_tokens) == (
        8192,
        4096,
        16384,
    )
    t = load_tenants()
    assert [x.id for x in t.tenants] == ["demo-a", "demo-b"]
    assert t.tenants[0].api_key_sha256 == [hashlib.sha256(b"sk-demo-a").hexdigest()]
    assert t.tenants[1].api_key_sha256 == [hashlib.sha256(b"sk-demo-b").hexdigest()]
    assert (t.tenants[0].strict_verify, t.tenants[1].strict_verify) == (False, True)
    check_tenant_models(s, t, DEFAULT_TENANTS)
    assert DEFAULT_CONFIG.parent == ROOT / "config"


def test_process_environment_is_used_by_default(monkeypatch):
    monkeypatch.setenv("KVGATE_GATEWAY__PORT", "8181")
    assert load_settings().gateway.port == 8181
    monkeypatch.setenv("KVGATE_CONFIG", str(DEFAULT_CONFIG))
    assert load_settings().gateway.port == 8181


def test_empty_file_is_all_defaults(tmp_path):
    s = load_settings(write(tmp_path, ""), environ={})
    assert s == Settings()
    assert (s.gateway.port, s.quotas.window_seconds, s.verifier.shingle_k, s.state_dir) == (8080, 60.0, 16, ".kvgate")


# ---------------------------------------------------------------- one test per failure kind
def test_bad_yaml_names_file_and_line(tmp_path):
    p = write(tmp_path, "gateway:\n  port: 8080\n  host: [127.0.0.1\n")
    assert problems(p) == f"{p}: invalid YAML: line 4, column 1: expected ',' or ']', but got '<stream end>'"
    p = write(tmp_path, "gateway:\n  port: 8080\n\tdrain_timeout_seconds: 1\n")
    assert problems(p).startswith(f"{p}: invalid YAML: line 3, column 1: found character '\\t'")


def test_unknown_key_names_its_path_and_line(tmp_path):
    p = write(tmp_path, "gateway:\n  host: 127.0.0.1\n  prot: 9000\n")
    assert problems(p) == f"{p}: line 3: gateway.prot: unknown key (not a kvgate setting; check the spelling)"
    p = write(tmp_path, MODELS + "    tokeniser: {kind: bundled}\n")
    assert problems(p) == f"{p}: line 5: models[0].tokeniser: unknown key (not a kvgate setting; check the spelling)"
    p = write(tmp_path, "verbose: true\n")
    assert problems(p) == f"{p}: line 1: verbose: unknown key (not a kvgate setting; check the spelling)"


def test_wrong_type_names_path_and_value(tmp_path):
    p = write(tmp_path, "gateway:\n  port: eighty\npool:\n  headroom: 0.5\n")
    assert problems(p) == (
        f"{p}: line 2: gateway.port: Input should be a valid integer, unable to parse string as an integer "
        f"(got 'eighty')\n"
        f"{p}: line 4: pool.headroom: Input should be greater than or equal to 1 (got 0.5)"
    )
    p = write(tmp_path, "gateway: 5\n")
    assert (
        problems(p)
        == f"{p}: line 1: gateway: Input should be a valid dictionary or instance of GatewaySettings (got 5)"
    )
    p = write(tmp_path, "- a\n- b\n")
    assert problems(p) == f"{p}: (top level): expected a mapping of keys, got list"


def test_infinite_and_absurd_numbers_are_refused_with_their_key(tmp_path):
    """.inf passed every gt=0 bound: quotas.window_seconds and lease_ttl_seconds then stopped the
    start with an OverflowError traceback, pool.headroom .inf made every limit 0, and a lease TTL
    of 1e300 made every reservation's PEXPIRE fail (a 503 for every request)."""
    p = write(tmp_path, "quotas:\n  window_seconds: .inf\n  lease_ttl_seconds: 1e300\npool:\n  headroom: .inf\n")
    assert problems(p) == (
        f"{p}: line 5: pool.headroom: Input should be a finite number (got inf)\n"
        f"{p}: line 2: quotas.window_seconds: Input should be a finite number (got inf)\n"
        f"{p}: line 3: quotas.lease_ttl_seconds: Input should be less than or equal to 31536000 (got '1e300')"
    )
    p = write(tmp_path, "verifier:\n  leak_index_ttl_seconds: -.inf\ngateway:\n  exchange_timeout_seconds: .nan\n")
    assert problems(p) == (
        f"{p}: line 4: gateway.exchange_timeout_seconds: Input should be a finite number (got nan)\n"
        f"{p}: line 2: verifier.leak_index_ttl_seconds: Input should be a finite number (got -inf)"
    )


def test_missing_field_and_rule_violations(tmp_path):
    p = write(tmp_path, "models:\n  - id: m1\n")
    assert problems(p) == f"{p}: line 2: models[0].context_length: Field required"
    p = write(
        tmp_path,
        MODELS + "upstreams:\n  - name: s\n    api_url: http://x/v1\n    pool_source: static\n    models: [m1]\n",
    )
    assert problems(p) == f"{p}: line 6: upstreams[0]: pool_source 'static' needs 'static_pool_tokens'"
    p = write(tmp_path, MODELS + "    tokenizer: {kind: hf}\n")
    assert problems(p) == f"{p}: line 5: models[0].tokenizer: kind 'hf' needs 'path' (a folder with tokenizer.json)"
    p = write(tmp_path, MODELS + "    tokenizer: {kind: tiktoken, chat_template: hf}\n")
    assert problems(p) == (
        f"{p}: line 5: models[0].tokenizer: kind 'tiktoken' counts chats with kvgate's ChatML "
        "template (chat_template: chatml)"
    )
    hf = load_settings(write(tmp_path, MODELS + "    tokenizer: {kind: hf, path: /models/x}\n"), environ={})
    assert hf.models[0].tokenizer.chat_template == "hf"  # follows the kind when left out


def test_missing_file(tmp_path):
    p = tmp_path / "nope.yaml"
    assert problems(p) == f"{p}: cannot read: No such file or directory"
    with pytest.raises(ConfigError, match="cannot read: No such file or directory"):
        load_tenants(tmp_path / "tenants.yaml")


def test_duplicate_key_is_an_error(tmp_path):
    p = write(tmp_path, "gateway:\n  port: 8080\n  host: 0.0.0.0\n  port: 9090\n")
    assert problems(p) == f"{p}: invalid YAML: line 4, column 3: duplicate key 'port' (first given on line 2)"


def test_not_utf8(tmp_path):
    p = tmp_path / "kvgate.yaml"
    p.write_bytes(b"gateway:\n  host: caf\xe9\n")
    assert problems(p) == f"{p}: not UTF-8 text: invalid continuation byte at byte 20"


# ---------------------------------------------------------------- cross references
def test_upstream_serving_an_unknown_model(tmp_path):
    p = write(tmp_path, MODELS + UPSTREAM.replace("models: [m1]", "models: [m1, m2]"))
    assert problems(p) == (
        f"{p}: line 9: upstreams[0].models[1]: unknown model 'm2' (not the id or an alias of any entry in 'models')"
    )
    ok = load_settings(write(tmp_path, MODELS + UPSTREAM.replace("models: [m1]", "models: [m1-alias]")), environ={})
    assert ok.upstreams[0].models == ["m1-alias"]


def test_names_used_twice(tmp_path):
    p = write(tmp_path, MODELS + "  - id: m1-alias\n    context_length: 10\n")
    assert problems(p) == f"{p}: line 5: models[1]: model name 'm1-alias' is already used by model 'm1'"
    p = write(tmp_path, MODELS + UPSTREAM + UPSTREAM.replace("upstreams:\n", ""))
    assert problems(p) == f"{p}: line 10: upstreams[1].name: upstream name 'local' is used twice"


def test_tenants_file_cross_references(tmp_path):
    h = hashlib.sha256(b"k").hexdigest()
    p = write(
        tmp_path,
        f"tenants:\n  - id: a\n    api_key_sha256: [{h}]\n  - id: b\n    api_key_sha256: [{h}]\n",
        "tenants.yaml",
    )
    with pytest.raises(ConfigError) as ei:
        load_tenants(p)
    assert str(ei.value) == f"{p}: line 5: tenants[1].api_key_sha256[0]: this API key hash also belongs to tenant 'a'"
    p = write(tmp_path, "tenants:\n  - id: a\n  - id: a\n", "tenants.yaml")
    with pytest.raises(ConfigError) as ei:
        load_tenants(p)
    assert str(ei.value) == f"{p}: line 3: tenants[1].id: tenant id 'a' is used twice"
    p = write(tmp_path, "tenants:\n  - id: a\n    api_key_sha256: [ABC]\n    rpm: -1\n", "tenants.yaml")
    with pytest.raises(ConfigError) as ei:
        load_tenants(p)
    assert str(ei.value) == (
        f"{p}: line 3: tenants[0].api_key_sha256: each entry must be 64 lowercase hex digits (the SHA-256 of a key)\n"
        f"{p}: line 4: tenants[0].rpm: Input should be greater than or equal to 0 (got -1)"
    )
    settings = load_settings(write(tmp_path, MODELS), environ={})
    tenants = load_tenants(write(tmp_path, "tenants:\n  - id: a\n    allowed_models: [m1-alias, m9]\n", "t.yaml"))
    with pytest.raises(ConfigError) as ei:
        check_tenant_models(settings, tenants, "t.yaml")
    assert str(ei.value) == (
        "t.yaml: tenants[0].allowed_models[1]: unknown model 'm9' (not the id or an alias of any model in the settings)"
    )


def test_served_tenants_leaves_out_tenants_of_other_models_never_widens(tmp_path):
    settings = load_settings(write(tmp_path, MODELS), environ={})
    text = (
        "tenants:\n  - id: every\n  - id: tied\n    allowed_models: [m9]\n"
        "  - id: mixed\n    allowed_models: [m9, m1-alias, m8]\n  - id: ok\n    allowed_models: [m1]\n"
    )
    tenants = load_tenants(write(tmp_path, text, "t.yaml"))
    kept, notes = served_tenants(settings, tenants)
    assert [(t.id, t.allowed_models) for t in kept.tenants] == [("every", []), ("mixed", ["m1-alias"]), ("ok", ["m1"])]
    assert notes == [
        "tenant tied: allowed only m9, not served by this stack; left out",
        "tenant mixed: allowed m9, m8 not served by this stack; those ignored",
    ]
    check_tenant_models(settings, kept)  # what is kept passes the strict check
    assert [t.allowed_models for t in tenants.tenants][1] == ["m9"]  # the input is not changed
    assert served_tenants(settings, kept) == (kept, [])


def test_a_name_or_key_hash_with_a_final_newline_is_refused():
    """The patterns ended in "$", which also matches before a final newline: "acme\\n" was a
    second tenant that looked like acme in every message, and a hash written as a YAML block
    scalar (as a template easily writes one) loaded with its newline and matched no key."""
    digest = hashlib.sha256(b"sk").hexdigest()
    with pytest.raises(ValidationError, match="1-64 characters"):
        TenantConfig(id="acme\n", api_key_sha256=[digest])
    with pytest.raises(ValidationError, match="64 lowercase hex digits"):
        TenantConfig(id="acme", api_key_sha256=[digest + "\n"])
    with pytest.raises(ValidationError):
        UpstreamConfig(name="u1\n", api_url="http://x/v1", pool_source="static", static_pool_tokens=1)
    assert TenantConfig(id="acme", api_key_sha256=[digest]).id == "acme"


def test_tenant_entry_carries_every_contract_field():
    t = TenantConfig(
        id="acme",
        api_key_sha256=[hashlib.sha256(b"sk").hexdigest()],
        rpm=60,
        tpm=1000,
        max_concurrent=2,
        max_context_tokens=4096,
        max_tokens_cap=512,
        default_max_tokens=64,
        allowed_models=["m1"],
        verify_sample_rate=0.5,
        strict_verify=True,
        honeypot=True,
    )
    assert t.model_dump()["max_context_tokens"] == 4096
    with pytest.raises(ValueError):
        TenantConfig(id="bad name!")
    with pytest.raises(ValueError):
        TenantConfig(id="a", verify_sample_rate=1.5)
    with pytest.raises(ValueError):
        UpstreamConfig(name="u", api_url="http://x/v1", models=["m"])  # kvgate pool source needs pool_urls


@pytest.mark.parametrize(
    ("api_url", "why"),
    [
        ("engine:8000/v1", "an http:// or https:// URL with a host"),
        ("ftp://engine/v1", "an http:// or https:// URL with a host"),
        ("http:///v1", "an http:// or https:// URL with a host"),
        ("http://user:secret@engine:8000/v1", "must not hold credentials: put the engine's key in 'api_key'"),
    ],
)
def test_an_upstream_url_is_http_with_a_host_and_no_credentials(api_url, why):
    ok = {"name": "u", "pool_source": "static", "static_pool_tokens": 8, "models": ["m"]}
    assert UpstreamConfig(api_url="https://engine:8443/v1", **ok).api_url == "https://engine:8443/v1"
    with pytest.raises(ValueError, match=why):
        UpstreamConfig(api_url=api_url, **ok)


# ---------------------------------------------------------------- environment overrides
def test_env_overrides(tmp_path):
    p = write(tmp_path, "gateway:\n  port: 8080\n  host: 127.0.0.1\n")
    env = {
        "KVGATE_GATEWAY__PORT": "9000",
        "KVGATE_REDIS_URL": "redis://127.0.0.1:6379/5",
        "KVGATE_POOL__HEADROOM": "1.5",
        "KVGATE_QUOTAS__ENABLED": "false",
        "KVGATE_FAULTS": "admit_rejected,no_scrub",
        "KVGATE_STATE_DIR_FOR_TESTS": "1",
        "KVGATE_CONFIG": str(p),
        "KVGATE_SECRET_ADMIN_KEY": "x",
        "OTHER": "1",
    }
    s = load_settings(p, environ=env)
    assert (s.gateway.port, s.gateway.host) == (9000, "127.0.0.1")  # the file's other keys stay
    assert s.redis_url == "redis://127.0.0.1:6379/5"
    assert (s.pool.headroom, s.quotas.enabled) == (1.5, False)
    assert env_overrides(Settings, env) == {
        "gateway": {"port": 9000},
        "redis_url": "redis://127.0.0.1:6379/5",
        "pool": {"headroom": 1.5},
        "quotas": {"enabled": False},
    }
    assert load_settings(environ={"KVGATE_CONFIG": str(p)}).gateway.port == 8080
    assert load_settings(p, environ={"KVGATE_REDIS_URL": ""}).redis_url is None


def test_bad_env_override_names_the_variable(tmp_path):
    p = write(tmp_path, "gateway:\n  port: 8080\n")
    assert problems(p, {"KVGATE_GATEWAY__PORT": "ninety"}) == (
        f"{p}: gateway.port: Input should be a valid integer, unable to parse string as an integer (got 'ninety') "
        "(from environment variable KVGATE_GATEWAY__PORT)"
    )
    assert problems(p, {"KVGATE_GATEWAY__PROT": "1"}) == (
        f"{p}: gateway.prot: unknown key (not a kvgate setting; check the spelling) "
        "(from environment variable KVGATE_GATEWAY__PROT)"
    )


# ---------------------------------------------------------------- secrets
def test_secrets_generated_once_with_mode_0600(tmp_path):
    state = tmp_path / "state"
    first = load_secrets(state, environ={})
    assert set(first) == set(SECRET_NAMES)
    assert all(len(v) == 64 and int(v, 16) >= 0 for v in first.values())  # 32 random bytes, hex
    assert len(set(first.values())) == 3
    path = state / "secrets.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    stored = json.loads(path.read_text())
    mtime = path.stat().st_mtime_ns
    assert load_secrets(state, environ={}) == first  # same keys on the next start, file untouched
    assert path.stat().st_mtime_ns == mtime and json.loads(path.read_text()) == stored
    env = load_secrets(state, environ={"KVGATE_SECRET_ADMIN_KEY": "from-env-16-bytes"})
    assert env["admin_key"] == b"from-env-16-bytes" and env["cache_salt_key"] == first["cache_salt_key"]
    all_env = {f"KVGATE_SECRET_{n.upper()}": n + "-0123456789" for n in SECRET_NAMES}
    assert load_secrets(tmp_path / "unused", environ=all_env) == {n: (n + "-0123456789").encode() for n in SECRET_NAMES}
    assert not (tmp_path / "unused").exists()  # nothing written when the environment has them all


def test_secrets_from_the_environment_need_16_bytes(tmp_path):
    for short in ("x", "k" * 15, "é" * 7):  # 1, 15 and 14 bytes
        with pytest.raises(SecretsError) as ei:
            load_secrets(tmp_path, environ={"KVGATE_SECRET_CACHE_SALT_KEY": short})
        n = len(short.encode())
        assert str(ei.value) == (
            f"KVGATE_SECRET_CACHE_SALT_KEY holds {n} byte(s); a secret needs at least 16 "
            "(e.g. the output of: openssl rand -hex 32)"
        )
    assert not (tmp_path / "secrets.json").exists()  # refused before anything was written
    assert load_secrets(tmp_path, environ={"KVGATE_SECRET_CACHE_SALT_KEY": "k" * 16})["cache_salt_key"] == b"k" * 16
    assert (
        load_secrets(tmp_path, environ={"KVGATE_SECRET_CACHE_SALT_KEY": "é" * 8})["cache_salt_key"]
        == ("é" * 8).encode()
    )


def test_state_dirs_are_created_0700_and_secret_files_0600_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        load_secrets(tmp_path / "a" / "b" / "state", environ={})
        private_dir(tmp_path / "c" / "d")
    finally:
        os.umask(old)
    for d in ("a", "a/b", "a/b/state", "c", "c/d"):
        assert stat.S_IMODE((tmp_path / d).stat().st_mode) == 0o700, d
    for f in ("secrets.json", "secrets.lock"):
        assert stat.S_IMODE((tmp_path / "a/b/state" / f).stat().st_mode) == 0o600, f
    assert permission_problems(tmp_path / "a/b/state", environ={}) == []


def test_open_secrets_are_named_with_the_chmod_to_run(tmp_path):
    state = tmp_path / "state"
    load_secrets(state, environ={})
    os.chmod(state, 0o777)
    os.chmod(state / "secrets.json", 0o666)
    os.chmod(state / "secrets.lock", 0o640)
    assert permission_problems(state, environ={}) == [
        f"{state} is mode 0777 (open to other users); run: chmod 700 {state}",
        f"{state}/secrets.json is mode 0666 (open to other users); run: chmod 600 {state}/secrets.json",
        f"{state}/secrets.lock is mode 0640 (open to other users); run: chmod 600 {state}/secrets.lock",
    ]
    all_env = {f"KVGATE_SECRET_{n.upper()}": "s" * 32 for n in SECRET_NAMES}
    assert len(permission_problems(state, environ=all_env)) == 3  # the file exists: still reported
    (state / "secrets.json").unlink()
    (state / "secrets.lock").unlink()
    assert permission_problems(state, environ=all_env) == []  # no file is read or written
    assert permission_problems(tmp_path / "missing", environ={}) == []


def _serve_args(tmp_path, state, *extra):
    import argparse

    from gateway.commands import serve

    cfg = tmp_path / "kvgate.yaml"
    cfg.write_text(f"state_dir: {state}\n" + MODELS + UPSTREAM)
    ten = tmp_path / "tenants.yaml"
    ten.write_text("tenants: []\n")
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return serve, parser.parse_args(["--config", str(cfg), "--tenants", str(ten), *extra])


def test_serve_refuses_open_secrets_unless_allowed(tmp_path, capsys, monkeypatch, caplog):
    import gateway.edge.server
    import gateway.ops.access_log

    for k in [k for k in os.environ if k.startswith("KVGATE_")]:
        monkeypatch.delenv(k)
    state = tmp_path / "state"
    load_secrets(state, environ={})
    os.chmod(state / "secrets.json", 0o644)
    served = []
    monkeypatch.setattr(gateway.edge.server, "run_server", lambda app, *a, **kw: served.append(app) or 0)
    monkeypatch.setattr(gateway.ops.access_log, "setup_logging", lambda *a, **kw: None)  # keep pytest's handlers
    serve, args = _serve_args(tmp_path, state)
    assert serve.run(args) == 2 and served == []
    assert capsys.readouterr().err == (
        "kvgate serve: the secrets are open to other users:\n"
        f"  {state}/secrets.json is mode 0644 (open to other users); run: chmod 600 {state}/secrets.json\n"
        "(or start with --allow-open-secrets to only warn)\n"
    )
    serve, args = _serve_args(tmp_path, state, "--allow-open-secrets")
    assert serve.run(args) == 0 and len(served) == 1
    assert (
        f"secrets open to other users (--allow-open-secrets): {state}/secrets.json is mode 0644 (open to "
        f"other users); run: chmod 600 {state}/secrets.json"
    ) in [r.getMessage() for r in caplog.records if r.name == "kvgate.serve" and r.levelname == "WARNING"]
    monkeypatch.setenv("KVGATE_SECRET_ADMIN_KEY", "short")
    os.chmod(state / "secrets.json", 0o600)
    serve, args = _serve_args(tmp_path, state)
    assert serve.run(args) == 2 and len(served) == 1
    assert capsys.readouterr().err == (
        "kvgate serve: KVGATE_SECRET_ADMIN_KEY holds 5 byte(s); a secret needs at least 16 "
        "(e.g. the output of: openssl rand -hex 32)\n"
    )


def test_a_short_secret_in_secrets_json_is_refused(tmp_path, capsys, monkeypatch):
    """A hand-edited file is held to the environment's 16 bytes; kvgate serve names the entry, never
    its value."""
    import gateway.edge.server
    import gateway.ops.access_log

    for k in [k for k in os.environ if k.startswith("KVGATE_")]:
        monkeypatch.delenv(k)
    state = tmp_path / "state"
    load_secrets(state, environ={})
    stored = json.loads((state / "secrets.json").read_text())
    (state / "secrets.json").write_text(json.dumps({**stored, "leak_index_key": "k" * 15}))
    with pytest.raises(SecretsError) as ei:
        load_secrets(state, environ={})
    expected = (
        f"{state}/secrets.json: leak_index_key holds 15 byte(s); a secret needs at least 16 (remove the entry "
        "to have one generated, or set e.g. the output of: openssl rand -hex 32)"
    )
    assert str(ei.value) == expected
    served = []
    monkeypatch.setattr(gateway.edge.server, "run_server", lambda app, *a, **kw: served.append(app) or 0)
    monkeypatch.setattr(gateway.ops.access_log, "setup_logging", lambda *a, **kw: None)
    serve, args = _serve_args(tmp_path, state)
    assert serve.run(args) == 2 and served == []
    assert capsys.readouterr().err == f"kvgate serve: {expected}\n"
    (state / "secrets.json").write_text(json.dumps({**stored, "leak_index_key": "k" * 16}))
    assert load_secrets(state, environ={})["leak_index_key"] == b"k" * 16


def test_secrets_file_missing_a_key_is_completed(tmp_path):
    (tmp_path / "secrets.json").write_text(json.dumps({"admin_key": "a" * 16}))
    out = load_secrets(tmp_path, environ={})
    assert out["admin_key"] == b"a" * 16 and len(out["leak_index_key"]) == 64
    assert json.loads((tmp_path / "secrets.json").read_text())["admin_key"] == "a" * 16
    (tmp_path / "secrets.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a kvgate secrets file"):
        load_secrets(tmp_path, environ={})


@pytest.mark.timeout(60)
def test_processes_starting_together_agree_on_secrets(tmp_path):
    code = (
        "import json, sys; from config.secrets import load_secrets; "
        "print(json.dumps({k: v.decode() for k, v in load_secrets(sys.argv[1], environ={}).items()}))"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_SECRET_")}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path / "s")], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True
        )
        for _ in range(4)
    ]
    try:
        outs = [json.loads(p.communicate(timeout=30)[0]) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(o == outs[0] for o in outs)
    assert outs[0] == json.loads((tmp_path / "s" / "secrets.json").read_text())


def test_serve_init_tenant_creates_a_tenants_file_with_a_generated_key_once(tmp_path):
    from gateway.commands.serve import init_tenant
    from gateway.ops.tenants import TenantRegistry

    path = tmp_path / "vol" / "tenants.yaml"
    state = tmp_path / "vol" / "state"
    assert init_tenant(str(path), "default", str(state)) is True
    key_file = state / "default.key"
    key = key_file.read_text().strip()
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600 and stat.S_IMODE(state.stat().st_mode) == 0o700
    assert key.startswith("sk-kvg-") and len(key) == 50 and key not in path.read_text()
    reg = TenantRegistry.from_path(path)
    assert reg.lookup(key).id == "default" and reg.lookup("sk-demo-a") is None
    before = path.read_text()
    assert init_tenant(str(path), "default", str(state)) is False  # an existing file is left alone
    assert path.read_text() == before and key_file.read_text().strip() == key


@pytest.mark.parametrize("name", ["../escaped", "acme\n", "", "x" * 65])
def test_serve_init_tenant_checks_the_name_before_writing_anything(tmp_path, name):
    """'../escaped' wrote its key file outside the state folder, then the start refused the name."""
    from gateway.commands.serve import init_tenant

    path, state = tmp_path / "conf" / "tenants.yaml", tmp_path / "state"
    with pytest.raises(ConfigError) as e:
        init_tenant(str(path), name, str(state))
    assert str(e.value) == (
        f"{path}: --init-tenant {name!r}: Value error, must be 1-64 characters of letters, digits, '.', '_' or '-'"
    )
    assert not path.exists() and not state.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("models_extra", "state", "why"),
    [
        (
            "    tokenizer: {kind: hf, path: /nonexistent}\n",
            None,
            "models[0] (m1): tokenizer path '/nonexistent' holds no tokenizer.json",
        ),
        (
            "    tokenizer: {kind: tiktoken, name: nope_base}\n",
            None,
            "models[0] (m1): tiktoken encoding 'nope_base' is not available offline",
        ),
        ("", "/proc/kv", "state_dir /proc/kv: cannot be created or used: No such file or directory"),
    ],
    ids=["hf-folder-missing", "tiktoken-unknown", "state-dir-impossible"],
)
def test_serve_refuses_a_tokenizer_or_state_dir_it_cannot_use_with_a_message(
    tmp_path, capsys, monkeypatch, models_extra, state, why
):
    """Each was a traceback from deep in the start (FileNotFoundError, ValueError) after the
    settings had loaded."""
    import gateway.edge.server
    import gateway.ops.access_log

    for k in [k for k in os.environ if k.startswith("KVGATE_")]:
        monkeypatch.delenv(k)
    served = []
    monkeypatch.setattr(gateway.edge.server, "run_server", lambda app, *a, **kw: served.append(app) or 0)
    # keep pytest's handlers: a handler on this test's captured stderr outlives it, and later
    # tests' gateways then log into the closed capture ("I/O operation on closed file")
    monkeypatch.setattr(gateway.ops.access_log, "setup_logging", lambda *a, **kw: None)
    serve, args = _serve_args(tmp_path, state or tmp_path / "state")
    cfg = tmp_path / "kvgate.yaml"
    cfg.write_text(cfg.read_text().replace(MODELS, MODELS + models_extra))
    assert serve.run(args) == 2 and served == []
    assert capsys.readouterr().err.startswith(f"kvgate serve: {why}")


@pytest.mark.parametrize("headroom", ["nan", "inf", "0.5"])
def test_deploy_gate_and_probe_refuse_a_headroom_that_is_no_divisor(headroom, capsys):
    from gateway.cli import main

    assert main(["deploy-gate", "--headroom", headroom, "--server-info-url", "http://127.0.0.1:9/server_info"]) == 2
    assert (
        capsys.readouterr().err == "kvgate deploy-gate: --headroom must be from 1.0 to 100 (pool.headroom's bounds)\n"
    )
    probe = ["probe", "--headroom", headroom, "--base-url", "http://127.0.0.1:9/v1", "--model", "m", "--api-key", "k"]
    assert main(probe) == 2
    assert capsys.readouterr().err == "kvgate probe: --headroom must be from 1.0 to 100 (pool.headroom's bounds)\n"
