"""`kvgate tenant set / add-key / revoke-key`: edit limits and rotate keys in the tenants file,
keeping everything else byte for byte; keys are printed once and never stored or echoed."""

from __future__ import annotations

import hashlib
import re
import shutil
from pathlib import Path

import pytest

from config.loader import DEFAULT_TENANTS, load_tenants
from gateway.cli import main

KEY_RE = re.compile(r"^sk-kvg-[A-Za-z0-9_-]{43}$")
DEMO_A_HASH = "d044463b6a7678708e01561788c68427a73e3ed92652940783ca56df4689fe1e"  # sha256("sk-demo-a")


@pytest.fixture()
def tenants_file(tmp_path: Path) -> Path:
    p = tmp_path / "tenants.yaml"
    shutil.copy(DEFAULT_TENANTS, p)
    return p


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["tenant", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_set_changes_only_the_named_fields(capsys, tenants_file: Path) -> None:
    before = tenants_file.read_text()
    rc, out, err = _run(
        capsys,
        "set",
        "demo-a",
        "--tenants",
        str(tenants_file),
        "--rpm",
        "5",
        "--tpm",
        "1000",
        "--clear",
        "max_concurrent",
    )
    assert (rc, out) == (0, "")
    assert "rpm=5, tpm=1000, max_concurrent=null" in err
    expected = before.replace(
        "    rpm: 600\n    tpm: 2000000\n    max_concurrent: 16\n",
        "    rpm: 5\n    tpm: 1000\n    max_concurrent: null\n",
        1,
    )
    assert expected != before
    assert tenants_file.read_text() == expected
    a, b = load_tenants(tenants_file).tenants
    assert (a.rpm, a.tpm, a.max_concurrent, a.max_tokens_cap) == (5, 1000, None, 4096)
    assert (b.rpm, b.tpm, b.max_concurrent) == (600, 2000000, 16)


def test_set_refuses_unknown_tenant_invalid_values_and_no_change(capsys, tenants_file: Path) -> None:
    before = tenants_file.read_text()
    rc, _, err = _run(capsys, "set", "nobody", "--tenants", str(tenants_file), "--rpm", "5")
    assert rc == 1 and "no tenant 'nobody'" in err
    rc, out, err = _run(capsys, "set", "demo-a", "--tenants", str(tenants_file), "--rpm", "-3")
    assert (rc, out, err) == (2, "", "kvgate tenant set: --rpm: Input should be greater than or equal to 0 (got -3)\n")
    rc, _, err = _run(capsys, "set", "demo-a", "--tenants", str(tenants_file))
    assert rc == 2 and "nothing to change" in err
    rc, _, err = _run(capsys, "set", "demo-a", "--tenants", str(tenants_file), "--rpm", "4", "--clear", "rpm")
    assert rc == 2 and "contradict" in err
    assert tenants_file.read_text() == before


def test_set_turns_verification_on_and_off(capsys, tenants_file: Path) -> None:
    """``--verify-sample-rate`` and ``--strict-verify`` / ``--no-strict-verify`` write the tenant's
    verification fields (tenants added by the CLI start with sampling 0); a rate outside [0, 1]
    is a bad argument (2) and the file is left as it was."""
    rc, _, err = _run(
        capsys, "set", "demo-b", "--tenants", str(tenants_file), "--verify-sample-rate", "0.25", "--strict-verify"
    )
    assert rc == 0 and "verify_sample_rate=0.25, strict_verify=True" in err
    b = load_tenants(tenants_file).tenants[1]
    assert (b.verify_sample_rate, b.strict_verify) == (0.25, True)
    rc, _, _ = _run(capsys, "set", "demo-b", "--tenants", str(tenants_file), "--no-strict-verify")
    assert rc == 0 and load_tenants(tenants_file).tenants[1].strict_verify is False
    before = tenants_file.read_text()
    rc, out, err = _run(capsys, "set", "demo-b", "--tenants", str(tenants_file), "--verify-sample-rate", "1.5")
    assert (rc, out) == (2, "")
    assert err == "kvgate tenant set: --verify-sample-rate: Input should be less than or equal to 1 (got 1.5)\n"
    assert tenants_file.read_text() == before


def test_add_key_then_revoke_the_old_one(capsys, tenants_file: Path) -> None:
    before = tenants_file.read_text()
    rc, out, err = _run(capsys, "add-key", "demo-a", "--tenants", str(tenants_file))
    assert rc == 0
    key = out.strip()
    assert out == key + "\n" and KEY_RE.match(key)
    digest = hashlib.sha256(key.encode()).hexdigest()
    assert key not in err and key not in tenants_file.read_text()
    assert f"kvgate tenant revoke-key demo-a {digest[:12]}" in err
    assert tenants_file.read_text() == before.replace(f"[{DEMO_A_HASH}]", f"[{DEMO_A_HASH}, {digest}]", 1)
    assert load_tenants(tenants_file).tenants[0].api_key_sha256 == [DEMO_A_HASH, digest]

    # revoke by the key itself
    rc, out, err = _run(capsys, "revoke-key", "demo-a", "sk-demo-a", "--tenants", str(tenants_file))
    assert (rc, out) == (0, "")
    assert "begins d044463b6a76 (1 key(s) left)" in err
    assert load_tenants(tenants_file).tenants[0].api_key_sha256 == [digest]
    # revoke by a hash prefix: the last key; the tenant is told it has none left
    rc, _, err = _run(capsys, "revoke-key", "demo-a", digest[:8].upper(), "--tenants", str(tenants_file))
    assert rc == 0 and "now has no key" in err
    assert load_tenants(tenants_file).tenants[0].api_key_sha256 == []
    assert tenants_file.read_text() == before.replace(f"[{DEMO_A_HASH}]", "[]", 1)


def test_revoke_key_needs_one_exact_match_and_never_echoes_a_key(capsys, tenants_file: Path) -> None:
    before = tenants_file.read_text()
    rc, _, err = _run(capsys, "revoke-key", "demo-a", "sk-not-a-key-of-anyone", "--tenants", str(tenants_file))
    assert rc == 1 and "holds no key matching (give the key itself" in err
    assert "sk-not" not in err
    rc, _, err = _run(capsys, "revoke-key", "demo-a", "d04446", "--tenants", str(tenants_file))  # 6 < 8 digits
    assert rc == 1 and "at least 8 leading hex digits" in err
    rc, _, err = _run(capsys, "revoke-key", "demo-b", DEMO_A_HASH[:10], "--tenants", str(tenants_file))
    assert rc == 1 and f"holds no key matching '{DEMO_A_HASH[:10]}'" in err  # demo-a's key, not demo-b's
    rc, _, err = _run(capsys, "add-key", "nobody", "--tenants", str(tenants_file))
    assert rc == 1 and "no tenant 'nobody'" in err
    assert tenants_file.read_text() == before
