"""An operator editing the tenants file while the gateway runs, and a careless one's files: an edit
made while the gateway starts, a file rewritten in place while a reload reads it, a file being
generated that holds only its header comment, YAML nested too deeply for the parser, and
``kvgate tenant ...`` run through a symlink to the file the gateway reads."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import yaml

from config.loader import ConfigError, load_settings, load_tenants
from gateway.cli import main
from gateway.ops.metrics import GatewayMetrics
from gateway.ops.tenant_reload import TenantFileWatcher
from gateway.ops.tenants import TenantRegistry, hash_key

DEEP = "[" * 1000 + "]" * 1000


def _tenants(*keys: str) -> str:
    return yaml.safe_dump({"tenants": [{"id": f"t{i}", "api_key_sha256": [hash_key(k)]} for i, k in enumerate(keys)]})


def _ids(reg: TenantRegistry, *keys: str) -> list[str | None]:
    return [t.id if (t := reg.lookup(k)) is not None else None for k in keys]


# ---------------------------------------------------------------- the watcher and the reload
def test_a_key_revoked_while_the_gateway_starts_is_refused_once_it_runs(tmp_path: Path) -> None:
    """``kvgate serve`` reads the file, then builds its app (tokenizers, Redis: seconds), then starts
    the watcher, which took the file as it was then for the one read: a key revoked meanwhile
    stayed valid until the next edit, with ``kvgate_tenants_file_valid`` at 1."""
    p = tmp_path / "tenants.yaml"
    p.write_text(_tenants("sk-old", "sk-other"))
    reg = TenantRegistry.from_path(p)
    p.write_text(_tenants("sk-new-one", "sk-other"))  # `kvgate tenant revoke-key` + `add-key`, meanwhile
    w = TenantFileWatcher(reg, interval_seconds=3600)
    assert [w.check(), w.check(), w.check()] == [False, True, False]  # settles, then reloads once
    assert _ids(reg, "sk-old", "sk-new-one", "sk-other") == [None, "t0", "t1"]
    assert (w.reloads, w.last_error) == (1, None)


class _WrittenDuringTheRead(TenantRegistry):
    """A registry whose file is rewritten in place (truncated, its first part written) just as a
    reload begins: the writer's ``open(..., "w")`` after the watcher's stat, before the read."""

    partial: str | None = None

    def reload(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if self.partial is not None and self.path is not None:
            self.path.write_text(self.partial)
            self.partial = None
        return super().reload(*args, **kwargs)


def test_a_file_rewritten_in_place_during_a_reload_is_not_applied_half_written(tmp_path: Path) -> None:
    """A reload that began as ``cat new.yaml > tenants.yaml`` did read the first half: a valid
    file of fewer tenants, whose keys got 401 until the next check. The file as read must be the
    file the check saw settle; else the reload waits for it to settle again."""
    p = tmp_path / "tenants.yaml"
    p.write_text(_tenants("sk-a", "sk-b"))
    reg = _WrittenDuringTheRead(load_tenants(p), p)
    w = TenantFileWatcher(reg, interval_seconds=3600)
    full = _tenants("sk-a", "sk-b", "sk-c")
    p.write_text(full)
    assert w.check() is False  # settling
    reg.partial = _tenants("sk-a")  # the first tenant only: valid YAML
    assert full.startswith(reg.partial)
    assert w.check() is False
    assert _ids(reg, "sk-a", "sk-b", "sk-c") == ["t0", "t1", None]  # the old table stays
    assert w.last_error == (
        f"{p}: the file changed while it was read (being written?); read again once it stays the same"
    )
    p.write_text(full)  # the writer ends
    assert [w.check(), w.check()] == [False, True]
    assert _ids(reg, "sk-a", "sk-b", "sk-c") == ["t0", "t1", "t2"]


@pytest.mark.parametrize(
    "text",
    [
        "# kvgate tenants. Keys are stored only as SHA-256 hashes; `kvgate tenant ...` edits this file.\n",
        "---\n",
        "{}\n",
    ],
)
def test_a_file_holding_no_tenants_list_never_empties_the_table(tmp_path: Path, text: str) -> None:
    """``{ echo '# tenants'; ./generate; } > tenants.yaml``: the header is there while the generator
    runs, and a reload read it as a table of no tenants (every key 401); an empty file was
    refused so, but not one of comments. An empty table is ``tenants: []``."""
    m = GatewayMetrics()
    p = tmp_path / "tenants.yaml"
    p.write_text(_tenants("sk-a"))
    reg = TenantRegistry.from_path(p)
    w = TenantFileWatcher(reg, interval_seconds=3600, on_result=m.tenant_reloaded)
    p.write_text(text)
    assert [w.check(), w.check()] == [False, False]
    assert _ids(reg, "sk-a") == ["t0"]
    assert w.last_error == f"{p}: no 'tenants' list (being written?); an empty table is 'tenants: []'"
    assert m.registry.get_sample_value("kvgate_tenants_file_valid") == 0.0
    p.write_text("tenants: []\n")
    assert [w.check(), w.check()] == [False, True] and reg.tenants == ()


# ---------------------------------------------------------------- YAML nested too deeply
def test_yaml_nested_too_deeply_is_a_config_error_naming_the_file_or_variable(tmp_path: Path) -> None:
    """PyYAML composes recursively: ``[[[...`` a few hundred deep raised ``RecursionError``, a
    traceback from ``kvgate serve`` instead of the file's name, and from a reload an exception the
    watcher did not count (``kvgate_tenants_file_valid`` stayed 1)."""
    p = tmp_path / "tenants.yaml"
    p.write_text(f"tenants: {DEEP}\n")
    with pytest.raises(ConfigError) as e:
        load_tenants(p)
    assert str(e.value) == f"{p}: invalid YAML: lists or mappings nested too deeply to parse"
    s = tmp_path / "kvgate.yaml"
    s.write_text("")
    with pytest.raises(ConfigError) as e:
        load_settings(s, environ={"KVGATE_GATEWAY__PORT": DEEP})
    assert str(e.value).startswith(f"{s}: gateway.port: Input should be a valid integer")
    assert str(e.value).endswith("(from environment variable KVGATE_GATEWAY__PORT)")

    m = GatewayMetrics()
    p.write_text(_tenants("sk-a"))
    reg = TenantRegistry.from_path(p)
    w = TenantFileWatcher(reg, interval_seconds=3600, on_result=m.tenant_reloaded)
    p.write_text(f"tenants: {DEEP}\n")
    assert [w.check(), w.check()] == [False, False]
    assert _ids(reg, "sk-a") == ["t0"]
    assert w.last_error == f"{p}: invalid YAML: lists or mappings nested too deeply to parse"
    assert m.registry.get_sample_value("kvgate_tenants_reload_failures_total") == 1.0


def test_the_tenant_cli_reports_yaml_nested_too_deeply(capsys, tmp_path: Path) -> None:
    p = tmp_path / "tenants.yaml"
    p.write_text(f"tenants: {DEEP}\n")
    assert main(["tenant", "add", "acme", "--tenants", str(p)]) == 1
    out, err = capsys.readouterr()
    assert (out, err) == ("", f"kvgate tenant add: {p}: invalid YAML: lists or mappings nested too deeply to parse\n")
    assert p.read_text() == f"tenants: {DEEP}\n"


# ---------------------------------------------------------------- the CLI through a symlink
def test_the_tenant_cli_edits_the_file_a_symlink_names_not_the_link(capsys, tmp_path: Path) -> None:
    """``/etc/kvgate/tenants.yaml -> /srv/kvgate/tenants.yaml``: ``os.replace`` onto the link put a
    regular file in its place, so a gateway started with the target's path never saw the edit
    (a revoked key stayed valid while the command said it was revoked), and the two paths no
    longer named one file."""
    (tmp_path / "srv").mkdir()
    (tmp_path / "etc").mkdir()
    target, link = tmp_path / "srv" / "tenants.yaml", tmp_path / "etc" / "tenants.yaml"
    target.write_text(_tenants("sk-a"))
    target.chmod(0o640)
    link.symlink_to(target)
    reg = TenantRegistry.from_path(target)
    w = TenantFileWatcher(reg, interval_seconds=3600)

    assert main(["tenant", "add-key", "t0", "--tenants", str(link)]) == 0
    new_key = capsys.readouterr().out.strip()
    assert main(["tenant", "revoke-key", "t0", "sk-a", "--tenants", str(link)]) == 0
    capsys.readouterr()
    assert link.is_symlink() and link.resolve() == target
    assert oct(target.stat().st_mode & 0o777) == "0o640"
    assert yaml.safe_load(target.read_text()) == {"tenants": [{"id": "t0", "api_key_sha256": [hash_key(new_key)]}]}
    assert [w.check(), w.check()] == [False, True]
    assert _ids(reg, "sk-a", new_key) == [None, "t0"]

    assert main(["tenant", "remove", "t0", "--tenants", str(link)]) == 0
    capsys.readouterr()
    assert link.is_symlink() and yaml.safe_load(target.read_text()) == {"tenants": []}


# ---------------------------------------------------------------- secrets in error lines
@pytest.mark.parametrize(
    "text, problem",
    [
        (
            "gateway:\n  metrics_token:tok-hunter2-0123456789\n",
            "line 1: gateway: Input should be a valid dictionary or instance of GatewaySettings "
            "(got 'metrics_token:***')",
        ),
        (
            "gateway: {metrics_token:tok-hunter2-0123456789}\n",
            "line 1: gateway.metrics_token:***: unknown key (not a kvgate setting; check the spelling)",
        ),
        (
            "models: [{id: m, context_length: 8192}]\nupstreams:\n  - name: u\n"
            "      api_key:sk-hunter2-0123456789\n    api_url: http://e/v1\n    pool_source: static\n"
            "    static_pool_tokens: 100\n    models: [m]\n",
            "line 3: upstreams[0].name: must be 1-64 characters of letters, digits, '.', '_' or '-' "
            "(got 'u api_key:***')",
        ),
    ],
    ids=["section-value", "flow-key", "continued-scalar"],
)
def test_a_secret_typed_without_the_space_after_its_colon_is_never_shown(tmp_path: Path, text: str, problem: str):
    """``metrics_token:tok`` (no space) is one YAML string: the section's value, a flow mapping's
    key, or the end of the scalar above it. The error line showed it whole, secret included, in
    the start's output and the logs."""
    p = tmp_path / "kvgate.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_settings(p, environ={})
    assert str(e.value) == f"{p}: {problem}"
    assert "hunter2" not in str(e.value)


# ---------------------------------------------------------------- kvgate serve --init-tenant
def test_init_tenant_makes_a_leftover_key_file_private(tmp_path):
    """``O_CREAT``'s mode applies only to a new file: a key file left from an earlier try with
    mode 0644 kept it, while the log line said 0600."""
    from gateway.commands.serve import init_tenant

    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    key_file = state / "default.key"
    key_file.write_text("stale\n")
    key_file.chmod(0o644)
    assert init_tenant(str(tmp_path / "tenants.yaml"), "default", str(state)) is True
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert key_file.read_text().startswith("sk-kvg-")


def test_init_tenant_beside_a_replica_that_created_the_file_first_keeps_its_key(tmp_path, monkeypatch):
    """Two replicas started together with ``--init-tenant`` both saw no tenants file: the second
    overwrote the key file with its own key, then failed validation ("used twice"), leaving a key
    file whose key the tenants file does not hold. Now the one that takes the lock second sees
    the file and writes nothing."""
    import gateway.commands.tenant as tenant_cli
    from gateway.commands.serve import init_tenant
    from gateway.ops.tenants import TenantRegistry, hash_key

    path, state = tmp_path / "tenants.yaml", tmp_path / "state"
    real = tenant_cli.edit_tenants

    def first_replica_wins(p):  # the other replica creates the file while this one waits for the lock
        state.mkdir(mode=0o700, exist_ok=True)
        (state / "default.key").write_text("sk-other-replica\n")
        path.write_text(f"tenants:\n  - id: default\n    api_key_sha256: ['{hash_key('sk-other-replica')}']\n")
        return real(p)

    monkeypatch.setattr(tenant_cli, "edit_tenants", first_replica_wins)
    before = path.exists()
    assert (before, init_tenant(str(path), "default", str(state))) == (False, False)
    assert (state / "default.key").read_text() == "sk-other-replica\n"
    assert TenantRegistry.from_path(path).lookup("sk-other-replica").id == "default"
