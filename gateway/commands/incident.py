"""``kvgate demo --incident``: the runbook's incident on real text, then kvgate's defences.

The bundled backend runs with ``KVGATE_FAULTS=admit_rejected,skip_transfer_check,no_scrub`` (the
incident's engine: a prompt over its pool is admitted as a one-token placeholder, decode skips
the transfer check and reads pages that were never scrubbed). Tenant ``demo-a`` sends a prompt that
repeats a secret sentence; tenant ``demo-b`` (strict) then sends a prompt longer than the
prefill pool. Every row uses **copy-probe**: its completion is the KV cache at positions 0, 1, ...,
so a stale page shows up verbatim. SmolLM2 does not reproduce the leak reliably (it continues
from whatever the stale keys and values steer it to, rarely verbatim), so it is not used here.

====  ===================================================  =========================================
row   setup                                                expected
====  ===================================================  =========================================
1     gate mis-set (static pool above the real one),       B's HTTP 200 holds A's secret sentence
      no verification
2     kvgate's gate on the live pool                       B gets 400 ``context_length_exceeded``
3     gate still mis-set, verification on                  strict B gets 502 ``response_withheld``
4     same, the periodic probe running                     the probe surfaces its own canary in
                                                           another response: the upstream is
                                                           quarantined, B gets 503
====  ===================================================  =========================================

Each setup is a fresh stack (backend + gateway) on free ports; rows 3 and 4 share one. Exit 0 when
every row shows what it should.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from config.loader import DEFAULT_TENANTS
from gateway.stack.embedded import DEMO_KEYS, EmbeddedStack, StackError, StackOptions

FAULTS = "admit_rejected,skip_transfer_check,no_scrub"
SECRET = "The vault code of tenant A is 4471-SWORDFISH, do not share it."
#: the engine's real pools (prefill, decode) and the gate's mis-set static pool (limit 2560 / 1.25 = 2048)
POOLS = (1024, 4096)
STATIC_POOL = 2560
MAX_TOKENS = 96


@dataclass
class Row:
    """One row of the table: what was set up, what B got, whether that is what the row proves."""

    name: str
    model: str
    status: int
    got: str
    ok: bool
    proves: str


def _a_prompt() -> str:
    """A's prompt: the secret sentence over and over (so any stale page of it holds the secret)."""
    return " ".join([SECRET] * 30)


def _b_prompt() -> str:
    words = ["weather", "report", "for", "tenant", "B:", "rain", "later", "in", "the", "week", "with", "wind"]
    return " ".join(words[i % len(words)] for i in range(1300))


def _send(client: httpx.Client, stack: EmbeddedStack, key: str, prompt: str) -> tuple[int, dict[str, Any]]:
    body = {"model": stack.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    r = client.post(stack.gateway_url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
    try:
        data = r.json()
    except ValueError:
        data = {}
    return r.status_code, data if isinstance(data, dict) else {}


def _text(data: dict[str, Any]) -> str:
    choices = data.get("choices") or [{}]
    return str(choices[0].get("text") or "")


def _code(data: dict[str, Any]) -> str:
    err = data.get("error")
    return str(err.get("code")) if isinstance(err, dict) else ""


def _stack(run_dir: Path, tenants: Path, *, static: bool, env: dict[str, str]) -> EmbeddedStack:
    opts = StackOptions(
        model="copy-probe",
        tenants=tenants,
        gateway_port=0,
        backend_port=0,
        run_dir=run_dir,
        startup_timeout_seconds=180,
        static_pool_tokens=STATIC_POOL if static else None,
        backend_args=[f"--prefill-max-total-tokens={POOLS[0]}", f"--decode-max-total-tokens={POOLS[1]}"],
        extra_env={"KVGATE_FAULTS": FAULTS, "KVGATE_STATE_DIR": str(run_dir / "state"), **env},
    )
    return EmbeddedStack(opts).start()


def _leak_attempts(client: httpx.Client, stack: EmbeddedStack, tries: int = 6) -> tuple[int, dict[str, Any]]:
    """A's secret prompt, then B's over-pool prompt; repeated until B's answer is not a 200 or holds
    the secret (copy-probe shows a stale page only when B's pages are the ones A just freed)."""
    status, data = 0, dict[str, Any]()
    for _ in range(tries):
        _send(client, stack, DEMO_KEYS["demo-a"], _a_prompt())
        status, data = _send(client, stack, DEMO_KEYS["demo-b"], _b_prompt())
        if status != 200 or "SWORDFISH" in _text(data):
            break
    return status, data


def _answer(data: dict[str, Any]) -> str:
    """What B got, for the table: the error code, else the start of the text."""
    return _code(data) or repr(_text(data)[:60])


def _leaked_answer(status: int, data: dict[str, Any]) -> str:
    """Row 1's answer: for a 200 the text from A's secret on (else its start), otherwise the error code."""
    if status != 200:
        return _code(data)
    text = _text(data)
    return repr(text[text.find("The vault") :][:60] if "SWORDFISH" in text else text[:60])


def _setup_incident(client: httpx.Client, base: Path, tenants: Path, out: Any) -> Row:
    """Row 1: the gate mis-set and no verification; B's 200 holds A's secret."""
    out("starting setup 1/3: gate mis-set, verification off ...")
    stack = _stack(base / "s1", tenants, static=True, env={"KVGATE_VERIFIER__ENABLED": "false"})
    try:
        status, data = _leak_attempts(client, stack)
    finally:
        stack.stop()
    return Row(
        "1 incident: gate mis-set, no verification",
        "copy-probe",
        status,
        _leaked_answer(status, data),
        status == 200 and "SWORDFISH" in _text(data),
        "tenant A's secret reaches tenant B in an HTTP 200 (the runbook's incident)",
    )


def _setup_live_gate(client: httpx.Client, base: Path, tenants: Path, out: Any) -> Row:
    """Row 2: the gate reads the live pool; B's over-pool prompt gets a 400."""
    out("starting setup 2/3: kvgate's gate on the live pool ...")
    stack = _stack(base / "s2", tenants, static=False, env={})
    try:
        _send(client, stack, DEMO_KEYS["demo-a"], _a_prompt())
        status, data = _send(client, stack, DEMO_KEYS["demo-b"], _b_prompt())
    finally:
        stack.stop()
    return Row(
        "2 defence: the gate reads the live pool",
        "copy-probe",
        status,
        _answer(data),
        status == 400 and _code(data) == "context_length_exceeded",
        "an over-pool prompt never reaches the engine's rejection path",
    )


def _setup_verified(client: httpx.Client, base: Path, tenants: Path, out: Any) -> list[Row]:
    """Rows 3 and 4 on one stack: the gate still mis-set, verification and the periodic probe on."""
    out("starting setup 3/3: gate still mis-set, verification and the periodic probe on ...")
    env = {"KVGATE_VERIFIER__PROBE_INTERVAL_SECONDS": "3"}
    stack = _stack(base / "s3", tenants, static=True, env=env)
    try:
        status, data = _leak_attempts(client, stack)
        withheld = Row(
            "3 defence: strict tenant, gate still mis-set",
            "copy-probe",
            status,
            _answer(data),
            status == 502 and _code(data) == "response_withheld",
            "the leak is detected before release; B sees no byte of A's text",
        )
        quarantined = _wait_quarantined(base / "s3" / "state" / "quarantine.json")
        status, data = _send(client, stack, DEMO_KEYS["demo-b"], _b_prompt())
        return [
            withheld,
            Row(
                "4 defence: the periodic probe",
                "copy-probe",
                status,
                _answer(data),
                quarantined and status == 503,
                "kvgate's own canary surfaced elsewhere: the upstream is quarantined",
            ),
        ]
    finally:
        stack.stop()


def _wait_quarantined(qfile: Path, timeout_seconds: float = 90) -> bool:
    """Whether the embedded upstream shows up in ``qfile`` (the quarantine state) within the time."""
    deadline = time.monotonic() + timeout_seconds
    quarantined = False
    while time.monotonic() < deadline and not quarantined:
        time.sleep(2)
        quarantined = qfile.is_file() and "embedded" in json.loads(qfile.read_text() or "{}")
    return quarantined


def _print_table(rows: list[Row], out: Any) -> int:
    """The rows as a table and the verdict line; returns the exit status (1 when a row is not as expected)."""
    head = f"{'row':<46} {'model':<11} {'B got':>5}  {'answer':<44} proves"
    out("\n" + head + "\n" + "-" * (len(head) + 50))
    for r in rows:
        mark = "" if r.ok else "   <-- NOT AS EXPECTED"
        out(f"{r.name:<46} {r.model:<11} {r.status:>5}  {r.got[:44]:<44} {r.proves}{mark}")
    bad = [r for r in rows if not r.ok]
    out(
        f"\nkvgate demo --incident: {'OK' if not bad else 'FAILED'}: {len(rows) - len(bad)} of {len(rows)} rows as "
        "expected."
    )
    return 1 if bad else 0


def run_incident(out: Any = print) -> int:
    """Run the four rows (see the module doc), print the table; returns the exit status."""
    base = Path(tempfile.mkdtemp(prefix="kvgate-incident-"))
    tenants = base / "tenants.yaml"
    shutil.copy(DEFAULT_TENANTS, tenants)
    out(
        f"the incident's engine: KVGATE_FAULTS={FAULTS}; real pools {POOLS[0]} (prefill) / {POOLS[1]} (decode) "
        f"tokens; the mis-set gate assumes {STATIC_POOL}. Tenant demo-a's prompt repeats {SECRET!r}; "
        f"demo-b (strict) sends {len(_b_prompt().split())} words, more than the prefill pool holds.\n"
    )
    try:
        with httpx.Client(timeout=httpx.Timeout(180.0, connect=10.0), trust_env=False) as client:
            rows = [_setup_incident(client, base, tenants, out), _setup_live_gate(client, base, tenants, out)]
            rows += _setup_verified(client, base, tenants, out)
    except (StackError, httpx.HTTPError) as e:
        out(f"kvgate demo --incident: {e}")
        return 1
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return _print_table(rows, out)


def main() -> int:
    """Entry point used by ``kvgate demo --incident``."""
    try:
        return run_incident()
    except KeyboardInterrupt:
        print("kvgate demo --incident: interrupted", file=sys.stderr)
        return 130
