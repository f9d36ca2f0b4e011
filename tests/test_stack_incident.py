"""``kvgate demo --incident``: the runbook's incident reproduced (copy-probe, engine faults on, the
gate mis-set) and each of kvgate's defences shown, as real processes (three stacks)."""

from __future__ import annotations

import pytest

from gateway.commands.incident import run_incident


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_incident_table_shows_the_leak_and_each_defence() -> None:
    lines: list[str] = []
    assert run_incident(out=lines.append) == 0, "\n".join(lines)
    text = "\n".join(lines)
    rows = {line[:46].strip(): line for line in text.splitlines() if line[:2] in ("1 ", "2 ", "3 ", "4 ")}
    assert rows["1 incident: gate mis-set, no verification"][59:64].strip() == "200"
    assert "'The vault code of tenant A is 4471-SWORDFIS" in rows["1 incident: gate mis-set, no verification"]
    assert "  400  context_length_exceeded" in rows["2 defence: the gate reads the live pool"]
    assert "  502  response_withheld" in rows["3 defence: strict tenant, gate still mis-set"]
    assert "  503  upstream_unavailable" in rows["4 defence: the periodic probe"]
    assert all(r[47:58].strip() == "copy-probe" for r in rows.values())  # every row says its model
    assert text.endswith("kvgate demo --incident: OK: 4 of 4 rows as expected.")
