"""`kvgate tenant add NAME`: a new key printed once, only its SHA-256 stored, the rest of the file
(comments, other tenants, flow style) kept byte for byte."""

from __future__ import annotations

import hashlib
import re
import shutil
from pathlib import Path

import pytest

from config.loader import DEFAULT_TENANTS, load_tenants
from gateway.cli import main

KEY_RE = re.compile(r"^sk-kvg-[A-Za-z0-9_-]{43}$")


@pytest.fixture()
def tenants_file(tmp_path: Path) -> Path:
    p = tmp_path / "tenants.yaml"
    shutil.copy(DEFAULT_TENANTS, p)
    return p


def _add(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["tenant", "add", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_add_appends_one_entry_and_keeps_the_rest(capsys, tenants_file: Path) -> None:
    before = tenants_file.read_text()
    rc, out, err = _add(capsys, "acme", "--tenants", str(tenants_file))
    assert rc == 0
    key = out.strip()
    assert out == key + "\n"  # stdout holds the key and nothing else
    assert KEY_RE.match(key), key
    digest = hashlib.sha256(key.encode()).hexdigest()
    after = tenants_file.read_text()
    assert after == before + f"  - id: acme\n    api_key_sha256: [{digest}]\n"
    assert key not in after and key not in err
    assert "tenant 'acme' added" in err and "once" in err
    loaded = load_tenants(tenants_file)
    assert [t.id for t in loaded.tenants] == ["demo-a", "demo-b", "acme"]
    assert loaded.tenants[2].api_key_sha256 == [digest]
    assert loaded.tenants[2].default_max_tokens == 256  # the model's default, not written


def test_add_with_limits_writes_them(capsys, tenants_file: Path) -> None:
    before = tenants_file.read_text()
    rc, out, _ = _add(
        capsys,
        "team-1",
        "--tenants",
        str(tenants_file),
        "--rpm",
        "30",
        "--tpm",
        "9000",
        "--max-concurrent",
        "2",
        "--max-context-tokens",
        "2048",
        "--max-tokens-cap",
        "512",
        "--default-max-tokens",
        "32",
        "--model",
        "kvgate-tiny",
    )
    assert rc == 0
    digest = hashlib.sha256(out.strip().encode()).hexdigest()
    assert tenants_file.read_text() == before + (
        f"  - id: team-1\n    api_key_sha256: [{digest}]\n    rpm: 30\n    tpm: 9000\n    max_concurrent: 2\n"
        "    max_context_tokens: 2048\n    max_tokens_cap: 512\n    default_max_tokens: 32\n"
        "    allowed_models: [kvgate-tiny]\n"
    )
    t = load_tenants(tenants_file).tenants[2]
    assert (
        t.rpm,
        t.tpm,
        t.max_concurrent,
        t.max_context_tokens,
        t.max_tokens_cap,
        t.default_max_tokens,
        t.allowed_models,
    ) == (30, 9000, 2, 2048, 512, 32, ["kvgate-tiny"])


def test_two_adds_give_different_keys(capsys, tenants_file: Path) -> None:
    _, k1, _ = _add(capsys, "one", "--tenants", str(tenants_file))
    _, k2, _ = _add(capsys, "two", "--tenants", str(tenants_file))
    assert k1 != k2
    hashes = [t.api_key_sha256 for t in load_tenants(tenants_file).tenants[2:]]
    assert hashes == [
        [hashlib.sha256(k1.strip().encode()).hexdigest()],
        [hashlib.sha256(k2.strip().encode()).hexdigest()],
    ]


def test_existing_name_is_refused_and_file_untouched(capsys, tenants_file: Path) -> None:
    before = tenants_file.read_text()
    rc, out, err = _add(capsys, "demo-a", "--tenants", str(tenants_file))
    assert (rc, out) == (1, "")
    assert f"{tenants_file}: tenant 'demo-a' already exists" in err
    assert tenants_file.read_text() == before


@pytest.mark.parametrize("name", ["a b", "_x", "x/y", "", "x" * 65, "é"])
def test_invalid_name_is_refused(capsys, tenants_file: Path, name: str) -> None:
    before = tenants_file.read_text()
    rc, out, err = _add(capsys, name, "--tenants", str(tenants_file))
    assert (rc, out) == (2, "")
    assert f"invalid tenant name {name!r}" in err
    assert tenants_file.read_text() == before


def test_invalid_limit_is_refused_before_writing(capsys, tenants_file: Path) -> None:
    before = tenants_file.read_text()
    rc, out, err = _add(capsys, "neg", "--tenants", str(tenants_file), "--rpm", "-1")
    assert (rc, out) == (2, "")  # a bad argument, named as the flag, not as an entry of the file
    assert err == "kvgate tenant add: --rpm: Input should be greater than or equal to 0 (got -1)\n"
    assert tenants_file.read_text() == before
    rc, out, _ = _add(capsys, "v", "--tenants", str(tenants_file), "--verify-sample-rate", "1", "--strict-verify")
    assert rc == 0 and KEY_RE.match(out.strip())
    added = load_tenants(tenants_file).tenants[2]
    assert (added.id, added.verify_sample_rate, added.strict_verify) == ("v", 1.0, True)


def test_missing_file_is_created(capsys, tmp_path: Path) -> None:
    p = tmp_path / "sub" / "t.yaml"
    rc, out, _ = _add(capsys, "first", "--tenants", str(p))
    assert rc == 0
    digest = hashlib.sha256(out.strip().encode()).hexdigest()
    assert p.read_text() == (
        "# kvgate tenants. Keys are stored only as SHA-256 hashes; `kvgate tenant ...` "
        f"edits this file.\ntenants:\n  - id: first\n    api_key_sha256: [{digest}]\n"
    )
    assert p.stat().st_mode & 0o777 == 0o600
    assert sorted(x.name for x in p.parent.iterdir()) == ["t.yaml"]  # no lock or temp file left


def test_not_yaml_is_reported(capsys, tmp_path: Path) -> None:
    p = tmp_path / "t.yaml"
    p.write_text("tenants: [\n")
    rc, out, err = _add(capsys, "x", "--tenants", str(p))
    assert (rc, out) == (1, "")
    assert f"{p}: invalid YAML" in err
    assert p.read_text() == "tenants: [\n"


def test_env_names_the_default_file(capsys, tenants_file: Path, monkeypatch) -> None:
    monkeypatch.setenv("KVGATE_TENANTS", str(tenants_file))
    rc, out, _ = _add(capsys, "via-env")
    assert rc == 0
    assert load_tenants(tenants_file).tenants[-1].id == "via-env"


def test_action_is_required(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["tenant"])
    assert e.value.code == 2
    assert "ACTION" in capsys.readouterr().err


COMMENTED = """\
# header
tenants:
  # first tenant
  - id: a
    api_key_sha256: [aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa]
    rpm: 5  # five
  # the b team
  - id: b
    api_key_sha256: [bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb]
    allowed_models: [kvgate-tiny]

  # c below
  - id: c
    api_key_sha256: []
# trailer
"""


def _remove(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["tenant", "remove", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize(
    ("name", "gone"),
    [
        ("a", "  # first tenant\n  - id: a\n    api_key_sha256: [" + "a" * 64 + "]\n    rpm: 5  # five\n"),
        ("b", "  # the b team\n  - id: b\n    api_key_sha256: [" + "b" * 64 + "]\n    allowed_models: [kvgate-tiny]\n"),
        ("c", "  # c below\n  - id: c\n    api_key_sha256: []\n"),
    ],
)
def test_remove_cuts_the_entry_and_its_comments_only(capsys, tmp_path: Path, name: str, gone: str) -> None:
    p = tmp_path / "t.yaml"
    p.write_text(COMMENTED)
    rc, out, err = _remove(capsys, name, "--tenants", str(p))
    assert (rc, out) == (0, "")
    assert p.read_text() == COMMENTED.replace(gone, "")  # every other byte kept, in order
    assert f"tenant '{name}' removed from {p} (2 tenant(s) left)" in err
    assert [t.id for t in load_tenants(p).tenants] == [x for x in "abc" if x != name]


def test_remove_from_the_shipped_file_keeps_the_other_entry(capsys, tenants_file: Path) -> None:
    before = tenants_file.read_text()
    start, end = before.index("  - id: demo-a\n"), before.index("  - id: demo-b\n")
    rc, _, _ = _remove(capsys, "demo-a", "--tenants", str(tenants_file))
    assert rc == 0
    assert tenants_file.read_text() == before[:start] + before[end:]


def test_remove_the_last_tenant_leaves_an_empty_list(capsys, tenants_file: Path) -> None:
    before = tenants_file.read_text()
    assert _remove(capsys, "demo-b", "--tenants", str(tenants_file))[0] == 0
    rc, _, err = _remove(capsys, "demo-a", "--tenants", str(tenants_file))
    assert rc == 0 and "(0 tenant(s) left)" in err
    assert tenants_file.read_text() == before[: before.index("tenants:\n")] + "tenants: []\n"
    assert load_tenants(tenants_file).tenants == []


def test_remove_an_unknown_tenant_is_refused_and_file_untouched(capsys, tenants_file: Path) -> None:
    before = tenants_file.read_text()
    rc, out, err = _remove(capsys, "acme", "--tenants", str(tenants_file))
    assert (rc, out) == (1, "")
    assert err == f"kvgate tenant remove: {tenants_file}: no tenant 'acme'\n"
    assert tenants_file.read_text() == before


def test_remove_from_a_flow_style_list(capsys, tmp_path: Path) -> None:
    p = tmp_path / "t.yaml"
    p.write_text("tenants: [{id: x, api_key_sha256: []}, {id: y, api_key_sha256: []}]\n")
    assert _remove(capsys, "x", "--tenants", str(p))[0] == 0
    assert [t.id for t in load_tenants(p).tenants] == ["y"]


def test_removing_a_tenant_another_refers_to_by_anchor_is_refused_and_the_file_untouched(capsys, tmp_path: Path):
    """The cut entry held ``&models``, which the next entry refers to: a ComposerError traceback
    before; now a message naming why, exit 1, the file unchanged."""
    p = tmp_path / "t.yaml"
    p.write_text(
        "tenants:\n  - id: base\n    api_key_sha256: []\n    allowed_models: &models [kvgate-tiny]\n"
        "  - id: derived\n    api_key_sha256: []\n    allowed_models: *models\n"
    )
    before = p.read_text()
    rc, out, err = _remove(capsys, "base", "--tenants", str(p))
    assert (rc, out, p.read_text()) == (1, "", before)
    assert err == (
        f"kvgate tenant remove: {p}: removing 'base' would leave the file invalid YAML (found undefined alias "
        "'models'); another entry refers to an anchor in it: edit the file by hand\n"
    )
    assert _remove(capsys, "derived", "--tenants", str(p))[0] == 0  # the entry that refers to it goes
    assert [t.id for t in load_tenants(p).tenants] == ["base"]
