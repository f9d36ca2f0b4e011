"""An operator's bad day and an attacker who can edit a config file: YAML 1.1 booleans where a
limit, a port or a tenant name belongs (``rpm: yes``, ``kvgate tenant add on``), alias bombs, merge
keys, secrets echoed in error lines or read from the environment as YAML, a key hash listed twice,
and secrets or tenants files that another user owns (``sudo kvgate tenant ...``)."""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
from pathlib import Path

import pytest

from config.loader import DEFAULT_CONFIG, DEFAULT_TENANTS, ConfigError, load_settings, load_tenants
from config.secrets import SecretsError, load_secrets
from gateway.cli import main

BOOL = "must be a number, not a boolean (YAML reads true/false, yes/no and on/off as booleans)"
MODEL = "models: [{id: m, context_length: 8192}]\n"


def _write(tmp_path: Path, text: str, name: str = "f.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return p


def _error(load, *args, **kw) -> str:
    with pytest.raises(ConfigError) as ei:
        load(*args, **kw)
    return str(ei.value)


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["tenant", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture()
def tenants_file(tmp_path: Path) -> Path:
    p = tmp_path / "tenants.yaml"
    shutil.copy(DEFAULT_TENANTS, p)
    return p


# ---------------------------------------------------------------- YAML 1.1 booleans
def test_a_boolean_is_no_limit_or_port(tmp_path):
    """pydantic read `rpm: yes` as a limit of 1 request and `max_concurrent: off` as 0."""
    p = _write(tmp_path, "tenants:\n  - id: a\n    rpm: yes\n    max_concurrent: off\n    strict_verify: on\n")
    assert _error(load_tenants, p) == (
        f"{p}: line 3: tenants[0].rpm: {BOOL} (got True)\n{p}: line 4: tenants[0].max_concurrent: {BOOL} (got False)"
    )
    s = _write(tmp_path, "gateway:\n  port: on\npool:\n  headroom: true\n", "kvgate.yaml")
    assert _error(load_settings, s, environ={}) == (
        f"{s}: line 2: gateway.port: {BOOL} (got True)\n{s}: line 4: pool.headroom: {BOOL} (got True)"
    )
    assert load_tenants(_write(tmp_path, "tenants: [{id: a, strict_verify: on, rpm: 3}]\n")).tenants[0].strict_verify


def test_cli_quotes_a_name_yaml_1_1_reads_as_a_boolean(capsys, tmp_path):
    """`kvgate tenant add on` wrote `id: on`: the CLI (ruamel, YAML 1.2) read a name, the gateway
    (PyYAML, 1.1) `true`, refused the file at start and kept its old table on every reload."""
    p = tmp_path / "tenants.yaml"
    rc, out, _ = _cli(capsys, "add", "on", "--model", "yes", "--tenants", str(p))
    assert rc == 0 and out.startswith("sk-kvg-")
    assert "  - id: 'on'\n" in p.read_text() and "allowed_models: ['yes']" in p.read_text()
    t = load_tenants(p).tenants
    assert [(x.id, x.allowed_models) for x in t] == [("on", ["yes"])]
    from gateway.commands.serve import init_tenant

    q = tmp_path / "first.yaml"
    assert init_tenant(str(q), "off", str(tmp_path / "state")) is True
    assert [x.id for x in load_tenants(q).tenants] == ["off"]
    assert _cli(capsys, "remove", "on", "--tenants", str(p))[0] == 0
    assert load_tenants(p).tenants == []


def test_cli_refuses_an_edit_the_gateway_would_refuse(capsys, tmp_path):
    """A hand-edited `allowed_models: [no]` is the text "no" to the CLI and `false` to the gateway."""
    p = _write(tmp_path, "tenants:\n  - id: a\n    allowed_models: [no]\n")
    before = p.read_text()
    rc, out, err = _cli(capsys, "add", "b", "--tenants", str(p))
    assert (rc, out) == (1, "")
    assert err == (
        f"kvgate tenant add: {p}: line 3: tenants[0].allowed_models[0]: Input should be a valid string (got False)\n"
        f"{p}: (as the gateway reads the file: YAML 1.1; quote such a value)\n"
    )
    assert p.read_text() == before


# ---------------------------------------------------------------- anchors, aliases, merges
@pytest.mark.timeout(30)
def test_an_alias_bomb_is_refused_at_once(capsys, tmp_path):
    """Nine levels of ten aliases: 10**9 nodes when walked as a tree (the loader's line map, the
    CLI's ruamel-to-dict copy), so the file hung `kvgate serve`, a reload and every `kvgate tenant`."""
    lines = ["x0: &a0 [z, z, z, z, z, z, z, z, z, z]"]
    lines += [f"x{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    p = _write(tmp_path, "\n".join(lines) + "\ntenants: [{id: a}]\n")
    assert _error(load_tenants, p).splitlines()[0] == (
        f"{p}: line 1: x0: unknown key (not a kvgate setting; check the spelling)"
    )
    rc, _, err = _cli(capsys, "set", "a", "--rpm", "1", "--tenants", str(p))
    assert rc == 1 and err.startswith(f"kvgate tenant set: {p}: x0: unknown key")


def test_a_merge_key_override_is_no_duplicate_key(capsys, tmp_path):
    """`<<: *base` then `id: b` is how YAML shares defaults; the loader called it a duplicate key
    (the CLI, through ruamel, accepted it), while a key given twice is still refused."""
    p = _write(
        tmp_path,
        "tenants:\n  - &base {id: a, rpm: 5, tpm: 100}\n  - <<: *base\n    id: b\n    rpm: 7\n",
    )
    assert [(t.id, t.rpm, t.tpm) for t in load_tenants(p).tenants] == [("a", 5, 100), ("b", 7, 100)]
    assert _cli(capsys, "set", "b", "--tpm", "9", "--tenants", str(p))[0] == 0
    assert [(t.id, t.rpm, t.tpm) for t in load_tenants(p).tenants] == [("a", 5, 100), ("b", 7, 9)]
    q = _write(tmp_path, "tenants:\n  - <<: {rpm: 1}\n    id: c\n    rpm: 2\n    rpm: 3\n", "dup.yaml")
    duplicate = "invalid YAML: line 5, column 5: duplicate key 'rpm' (first given on line 4)"
    assert _error(load_tenants, q) == f"{q}: {duplicate}"


# ---------------------------------------------------------------- secrets in error lines
@pytest.mark.parametrize(
    ("text", "env", "problem"),
    [
        (
            "upstreams: [{name: u, api_url: 'http://user:hunter2@engine/v1', pool_urls: [http://e/s], models: [m]}]\n",
            {},
            "line 2: upstreams[0].api_url: must not hold credentials: put the engine's key in 'api_key' "
            "(got 'http://***@engine/v1')",
        ),
        (
            "redis_url: 'redis+sentinel://:hunter2@h:26379?sentinel_password=hunter3'\n",
            {},
            "line 2: redis_url: sentinel URL needs hosts and a service name: "
            "redis+sentinel://host:26379[,host:26379]/service_name[/db] "
            "(got 'redis+sentinel://***@h:26379?sentinel_password=***')",
        ),
        (
            "",
            {"KVGATE_REDIS_URL": "redis://:hunter2@h:99999/0"},
            "redis_url: redis URL: the port is not a number from 1 to 65535 (got 'redis://***@h:99999/0') "
            "(from environment variable KVGATE_REDIS_URL)",
        ),
        (
            "upstreams: [{name: u, api_url: 'http://e/v1', pool_urls: [http://e/s], models: [m], api_key: 20242024}]\n",
            {},
            "line 2: upstreams[0].api_key: Input should be a valid string",
        ),
        ("gateway: {metrics_token: 12345678}\n", {}, "line 2: gateway.metrics_token: Input should be a valid string"),
    ],
    ids=["api-url-password", "sentinel-passwords", "env-redis-password", "numeric-api-key", "numeric-metrics-token"],
)
def test_a_settings_error_never_shows_a_secret(tmp_path, text, env, problem):
    p = _write(tmp_path, MODEL + text, "kvgate.yaml")
    msg = _error(load_settings, p, environ=env)
    assert msg == f"{p}: {problem}"
    assert "hunter" not in msg and "2024" not in msg and "12345678" not in msg


def test_a_key_pasted_where_its_hash_belongs_is_not_shown(tmp_path):
    key = "sk-kvg-" + secrets.token_urlsafe(32)
    p = _write(tmp_path, f"tenants:\n  - id: a\n    api_key_sha256: {key}\n")
    assert _error(load_tenants, p) == f"{p}: line 3: tenants[0].api_key_sha256: Input should be a valid list"


def test_environment_text_settings_are_taken_as_given(tmp_path):
    """Env values were read as YAML: a metrics token `#...` was a comment (no token: /metrics open),
    `&x` an anchor (no token), `0123456789` a number (refused, and shown)."""
    p = _write(tmp_path, MODEL, "kvgate.yaml")
    for token in ("#S3cr3t-metrics-token", "&S3cr3t-metrics-token", "0123456789", "[a, b]"):
        s = load_settings(p, environ={"KVGATE_GATEWAY__METRICS_TOKEN": token, "KVGATE_STATE_DIR": "0755"})
        assert s.gateway.metrics_token is not None
        assert (s.gateway.metrics_token.get_secret_value(), s.state_dir) == (token, "0755")
    s = load_settings(p, environ={"KVGATE_GATEWAY__PORT": "9000", "KVGATE_GATEWAY__METRICS_TOKEN": ""})
    assert (s.gateway.port, s.gateway.metrics_token) == (9000, None)
    for null in ("null", "~", "NULL"):  # YAML's null still unsets a text setting (not a file named ./null)
        s = load_settings(p, environ={"KVGATE_VERIFIER__INCIDENT_LOG": null, "KVGATE_GATEWAY__METRICS_TOKEN": null})
        assert (s.verifier.incident_log, s.gateway.metrics_token) == (None, None)


# ---------------------------------------------------------------- tenants and keys
def test_a_key_hash_listed_twice_for_one_tenant_says_so(tmp_path):
    h = "ab" * 32
    p = _write(tmp_path, f"tenants:\n  - id: a\n    api_key_sha256: [{h}, {h}]\n")
    assert _error(load_tenants, p) == f"{p}: line 3: tenants[0].api_key_sha256[1]: this API key hash is listed twice"


def test_revoke_key_never_echoes_a_hex_key(capsys, tenants_file):
    """A key made with `openssl rand -hex 32`, given for the wrong tenant, read as a hash prefix and
    was printed whole."""
    hex_key = secrets.token_hex(32)
    rc, _, err = _cli(capsys, "revoke-key", "demo-b", hex_key, "--tenants", str(tenants_file))
    assert rc == 1 and hex_key not in err
    assert err == (
        f"kvgate tenant revoke-key: {tenants_file}: tenant 'demo-b' holds no key matching '{hex_key[:12]}' "
        "(give the key itself, or at least 8 leading hex digits of its SHA-256)\n"
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="changing a file's owner needs root")
def test_an_edit_as_root_keeps_the_files_owner(capsys, tenants_file):
    """`sudo kvgate tenant revoke-key` left a 0600 file owned by root: the gateway's reloads failed
    (permission denied) and kept the old table, the revoked key included."""
    os.chown(tenants_file, 65534, 65534)
    os.chmod(tenants_file, 0o600)
    assert _cli(capsys, "revoke-key", "demo-a", "sk-demo-a", "--tenants", str(tenants_file))[0] == 0
    st = tenants_file.stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (65534, 65534, 0o600)
    assert load_tenants(tenants_file).tenants[0].api_key_sha256 == []


# ---------------------------------------------------------------- secrets file
def test_an_unreadable_secrets_file_is_named_not_a_traceback(tmp_path, capsys, monkeypatch):
    """`docker run -v ./secrets.json:/state/secrets.json` with no such file on the host mounts a
    folder there: `kvgate serve` died with an IsADirectoryError traceback."""
    import gateway.edge.server
    import gateway.ops.access_log
    from gateway.commands import serve

    for k in [k for k in os.environ if k.startswith("KVGATE_")]:
        monkeypatch.delenv(k)
    state = tmp_path / "state"
    (state / "secrets.json").mkdir(parents=True, mode=0o700)
    os.chmod(state, 0o700)
    expected = f"{state}/secrets.json: cannot read: Is a directory"
    with pytest.raises(SecretsError) as ei:
        load_secrets(state, environ={})
    assert str(ei.value) == expected
    monkeypatch.setattr(gateway.edge.server, "run_server", lambda *a, **kw: pytest.fail("served"))
    monkeypatch.setattr(gateway.ops.access_log, "setup_logging", lambda *a, **kw: None)
    cfg = _write(
        tmp_path,
        f"state_dir: {state}\n{MODEL}upstreams: [{{name: u, api_url: 'http://e/v1', pool_urls: [http://e/s], "
        "models: [m]}]\n",
        "kvgate.yaml",
    )
    ten = _write(tmp_path, "tenants: []\n", "tenants.yaml")
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    assert serve.run(parser.parse_args(["--config", str(cfg), "--tenants", str(ten)])) == 2
    assert capsys.readouterr().err == f"kvgate serve: {expected}\n"
    assert (state / "secrets.json").is_dir()  # left alone


def test_a_misspelt_model_is_warned_of_when_the_settings_are_named(capsys, tenants_file, monkeypatch):
    """`kvgate tenant add --model <typo>` exited 0 in silence: a running gateway then left the
    tenant out (its key: 401) and the next start refused the whole file. With KVGATE_CONFIG set,
    each unknown model is warned of (the file is still written: the settings may be another
    machine's); without it, nothing is said."""
    monkeypatch.setenv("KVGATE_CONFIG", str(DEFAULT_CONFIG))
    rc, out, err = _cli(capsys, "add", "typo", "--tenants", str(tenants_file), "--model", "kvgate-tiy")
    assert rc == 0 and out.startswith("sk-kvg-")
    assert err.splitlines()[0] == (
        f"kvgate tenant add: warning: model 'kvgate-tiy' is no model id or alias in {DEFAULT_CONFIG} "
        "(KVGATE_CONFIG): a running gateway leaves this tenant out, and the next 'kvgate serve' refuses the file"
    )
    rc, _, err = _cli(capsys, "set", "typo", "--tenants", str(tenants_file), "--model", "tiny-random")
    assert rc == 0 and "warning" not in err  # an alias of kvgate-tiny
    monkeypatch.delenv("KVGATE_CONFIG")
    rc, _, err = _cli(capsys, "set", "typo", "--tenants", str(tenants_file), "--model", "kvgate-tiy")
    assert rc == 0 and "warning" not in err
