"""`kvgate tenant list` / `show`: print what a tenants file holds, read as the gateway reads it,
keys only as the SHA-256 prefixes `revoke-key` takes; the file is never written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from config.loader import DEFAULT_TENANTS
from gateway.cli import main

DEMO_A_HASH = "d044463b6a7678708e01561788c68427a73e3ed92652940783ca56df4689fe1e"  # sha256("sk-demo-a")
DEMO_B_HASH = "fc312e02ca199c763c451ee0e75457886a118ab18ff6e0b52f33c3064b22800d"  # sha256("sk-demo-b")

SHIPPED_TABLE = (
    "ID      MODELS  RPM  TPM      CONCURRENT  CONTEXT    VERIFY  STRICT  KEYS\n"
    "demo-a  (all)   600  2000000  16          unlimited  1.0     false   d044463b6a76\n"
    "demo-b  (all)   600  2000000  16          unlimited  1.0     true    fc312e02ca19\n"
)

DEMO_B = {
    "id": "demo-b",
    "rpm": 600,
    "tpm": 2000000,
    "max_concurrent": 16,
    "max_context_tokens": None,
    "max_tokens_cap": 4096,
    "default_max_tokens": 64,
    "max_sequences_per_request": 16,
    "allowed_models": [],
    "verify_sample_rate": 1.0,
    "strict_verify": True,
    "honeypot": False,
    "max_embedding_inputs": 2048,
    "api_key_sha256_prefixes": ["fc312e02ca19"],
}

MIXED = """\
tenants:
  - id: acme.prod
    api_key_sha256:
      - aaaaaaaa11111111111111111111111111111111111111111111111111111111
      - bbbbbbbb22222222222222222222222222222222222222222222222222222222
    rpm: 5
    tpm: null
    max_concurrent: 0
    max_context_tokens: 8192
    allowed_models: [kvgate-tiny, smollm2-135m-instruct]
    verify_sample_rate: 0.25
    honeypot: true
  - id: b
    api_key_sha256: []
"""


@pytest.fixture()
def tenants_file(tmp_path: Path) -> Path:
    p = tmp_path / "tenants.yaml"
    shutil.copy(DEFAULT_TENANTS, p)
    return p


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["tenant", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_list_prints_one_line_per_tenant_and_leaves_the_file(capsys, tenants_file: Path) -> None:
    before, mtime = tenants_file.read_bytes(), tenants_file.stat().st_mtime_ns
    assert _run(capsys, "list", "--tenants", str(tenants_file)) == (0, SHIPPED_TABLE, "")
    assert (tenants_file.read_bytes(), tenants_file.stat().st_mtime_ns) == (before, mtime)
    assert sorted(x.name for x in tenants_file.parent.iterdir()) == ["tenants.yaml"]


def test_show_prints_every_field_of_one_tenant(capsys, tenants_file: Path) -> None:
    assert _run(capsys, "show", "demo-b", "--tenants", str(tenants_file)) == (
        0,
        "id                         demo-b\n"
        "rpm                        600\n"
        "tpm                        2000000\n"
        "max_concurrent             16\n"
        "max_context_tokens         unlimited\n"
        "max_tokens_cap             4096\n"
        "default_max_tokens         64\n"
        "max_sequences_per_request  16\n"
        "allowed_models             (all)\n"
        "verify_sample_rate         1.0\n"
        "strict_verify              true\n"
        "honeypot                   false\n"
        "max_embedding_inputs       2048\n"
        "api_key_sha256_prefixes    fc312e02ca19\n",
        "",
    )


def test_json_is_one_document_with_the_fields_names(capsys, tenants_file: Path) -> None:
    rc, out, err = _run(capsys, "list", "--json", "--tenants", str(tenants_file))
    assert (rc, err) == (0, "")
    demo_a = {**DEMO_B, "id": "demo-a", "strict_verify": False, "api_key_sha256_prefixes": ["d044463b6a76"]}
    assert json.loads(out) == [demo_a, DEMO_B]
    assert out == json.dumps([demo_a, DEMO_B], indent=2) + "\n"
    rc, out, err = _run(capsys, "show", "demo-b", "--json", "--tenants", str(tenants_file))
    assert (rc, err) == (0, "")
    assert out == json.dumps(DEMO_B, indent=2) + "\n"


def test_limits_models_and_several_keys(capsys, tmp_path: Path) -> None:
    p = tmp_path / "t.yaml"
    p.write_text(MIXED)
    assert _run(capsys, "list", "--tenants", str(p)) == (
        0,
        "ID         MODELS                             RPM        TPM        CONCURRENT  CONTEXT    VERIFY  STRICT  "
        "KEYS\n"
        "acme.prod  kvgate-tiny,smollm2-135m-instruct  5          unlimited  0           8192       0.25    false   "
        "aaaaaaaa1111,bbbbbbbb2222\n"
        "b          (all)                              unlimited  unlimited  unlimited   unlimited  0.0     false   "
        "(none)\n",
        "",
    )
    rc, out, _ = _run(capsys, "show", "b", "--json", "--tenants", str(p))
    assert rc == 0
    assert json.loads(out)["api_key_sha256_prefixes"] == []
    assert json.loads(out)["rpm"] is None


def test_no_whole_hash_is_printed_and_a_prefix_revokes_its_key(capsys, tenants_file: Path) -> None:
    outputs = [
        _run(capsys, *argv, "--tenants", str(tenants_file))[1]
        for argv in (["list"], ["list", "--json"], ["show", "demo-a"], ["show", "demo-a", "--json"])
    ]
    for out in outputs:
        assert DEMO_A_HASH[:12] in out and DEMO_A_HASH[:13] not in out
        assert DEMO_B_HASH[:13] not in out
    prefix = json.loads(outputs[3])["api_key_sha256_prefixes"][0]
    rc, _, err = _run(capsys, "revoke-key", "demo-a", prefix, "--tenants", str(tenants_file))
    assert rc == 0 and f"begins {prefix}" in err


def test_show_of_an_unknown_tenant_names_the_file(capsys, tenants_file: Path) -> None:
    for extra in ([], ["--json"]):
        assert _run(capsys, "show", "nobody", *extra, "--tenants", str(tenants_file)) == (
            1,
            "",
            f"kvgate tenant show: {tenants_file}: no tenant 'nobody'\n",
        )


@pytest.mark.parametrize("text", ["", "# header only\n", "tenants: []\n"])
def test_an_empty_file_lists_nothing(capsys, tmp_path: Path, text: str) -> None:
    p = tmp_path / "t.yaml"
    p.write_text(text)
    assert _run(capsys, "list", "--tenants", str(p)) == (0, "", f"kvgate: {p} holds no tenant\n")
    assert _run(capsys, "list", "--json", "--tenants", str(p)) == (0, "[]\n", "")
    assert p.read_text() == text


def test_a_missing_file_is_an_error_and_is_not_created(capsys, tmp_path: Path) -> None:
    p = tmp_path / "sub" / "t.yaml"
    for action in (["list"], ["show", "demo-a"]):
        assert _run(capsys, *action, "--tenants", str(p)) == (
            1,
            "",
            f"kvgate tenant {action[0]}: {p}: cannot read: No such file or directory\n",
        )
    assert not p.parent.exists()


@pytest.mark.parametrize(
    "text",
    [
        "tenants: [\n",  # not YAML
        "- a\n",  # no mapping
        "tenants: 3\n",  # no list
        "tenants:\n  - id: a\n    rpm: -1\n",  # invalid value
        "tenants:\n  - id: a\n  - id: a\n",  # an id used twice
    ],
)
def test_an_invalid_file_gets_the_edit_actions_error(capsys, tmp_path: Path, text: str) -> None:
    p = tmp_path / "t.yaml"
    p.write_text(text)
    rc, out, edit_err = _run(capsys, "add", "x", "--tenants", str(p))
    assert (rc, out) == (1, "") and edit_err.startswith(f"kvgate tenant add: {p}: ")
    assert _run(capsys, "list", "--tenants", str(p)) == (1, "", edit_err.replace("add", "list", 1))
    assert _run(capsys, "show", "a", "--tenants", str(p)) == (1, "", edit_err.replace("add", "show", 1))
    assert p.read_text() == text


def test_the_file_is_read_as_the_gateway_reads_it(capsys, tmp_path: Path) -> None:
    """An edit quotes an ``id: on`` and makes ``tenants:`` (nothing after it: a file being written)
    a list; ``list`` says what the gateway sees: a boolean id (YAML 1.1), and no list (no YAML 1.1
    hint for that one)."""
    p = tmp_path / "t.yaml"
    p.write_text("tenants:\n  - id: on\n")
    assert _run(capsys, "show", "on", "--tenants", str(p)) == (
        1,
        "",
        f"kvgate tenant show: {p}: line 2: tenants[0].id: Input should be a valid string (got True)\n"
        f"{p}: (as the gateway reads the file: YAML 1.1; quote such a value)\n",
    )
    p.write_text("tenants:\n")
    assert _run(capsys, "list", "--tenants", str(p)) == (
        1,
        "",
        f"kvgate tenant list: {p}: tenants: Input should be a valid list (got None)\n",
    )


def test_a_symlink_and_the_environment_name_the_file(capsys, tenants_file: Path, tmp_path: Path, monkeypatch) -> None:
    link = tmp_path / "link.yaml"
    link.symlink_to(tenants_file)
    assert _run(capsys, "list", "--tenants", str(link)) == (0, SHIPPED_TABLE, "")
    assert link.is_symlink()
    monkeypatch.setenv("KVGATE_TENANTS", str(link))
    assert _run(capsys, "list") == (0, SHIPPED_TABLE, "")
    dangling = tmp_path / "dangling.yaml"
    dangling.symlink_to(tmp_path / "gone.yaml")
    assert _run(capsys, "list", "--tenants", str(dangling)) == (
        1,
        "",
        f"kvgate tenant list: {tmp_path / 'gone.yaml'}: cannot read: No such file or directory\n",
    )


def test_a_model_name_with_a_control_character_stays_on_its_line(capsys, tmp_path: Path) -> None:
    """Model names are free text in the file (only the gateway's settings know them); a newline,
    a line separator or an escape in one is printed as its repr, on the tenant's line."""
    p = tmp_path / "t.yaml"
    p.write_text('tenants:\n  - id: t\n    allowed_models: ["a\\nb", "c\\u2028d", "e\\x1b[2Jf"]\n')
    rc, out, err = _run(capsys, "list", "--tenants", str(p))
    assert (rc, err) == (0, "")
    assert out.splitlines() == [
        "ID  MODELS                         RPM        TPM        CONCURRENT  CONTEXT    VERIFY  STRICT  KEYS",
        "t   'a\\nb','c\\u2028d','e\\x1b[2Jf'  unlimited  unlimited  unlimited   unlimited  0.0     false   (none)",
    ]
    rc, out, _ = _run(capsys, "show", "t", "--tenants", str(p))
    assert rc == 0 and "allowed_models             'a\\nb','c\\u2028d','e\\x1b[2Jf'\n" in out
    assert len(out.splitlines()) == 14
    rc, out, _ = _run(capsys, "show", "t", "--json", "--tenants", str(p))
    assert json.loads(out)["allowed_models"] == ["a\nb", "c\u2028d", "e\x1b[2Jf"]


def test_an_id_with_a_newline_is_refused_by_the_loader(capsys, tmp_path: Path) -> None:
    """Ids are 1-64 of ``[A-Za-z0-9._-]`` (config.models): the file is refused, the id shown as a repr."""
    p = tmp_path / "t.yaml"
    p.write_text('tenants:\n  - id: "a\\nb"\n')
    assert _run(capsys, "list", "--tenants", str(p)) == (
        1,
        "",
        f"kvgate tenant list: {p}: tenants[0].id: must be 1-64 characters of letters, digits, '.', '_' "
        "or '-' (got 'a\\nb')\n",
    )
