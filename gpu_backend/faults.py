"""Fault injection for tests: reproduce the runbook's incident step by step (test use only).

``KVGATE_FAULTS`` is a comma-separated list of :class:`Faults` switch names; every process of the
backend (router, prefill, decode, or the single ``--role all`` process) reads it at start-up into
one :class:`Faults` value, carried by ``EngineConfig.faults`` and handed to the nodes. With all
three switches on, the response is a 200 whose ``usage.prompt_tokens`` is the original prompt's
count and whose text comes from stale pages (runbook, step 7).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

ENV_VAR = "KVGATE_FAULTS"

log = logging.getLogger("gpu_backend.faults")


@dataclass(frozen=True)
class Faults:
    """The fault switches of one process (all off by default).

    - ``admit_rejected`` (prefill engine): a prompt over ``max_req_input_len`` is not retired at
      admission; it is replaced by a one-token placeholder and admitted, as SGLang's rejection path
      did (runbook, steps 2-3). Only that one token's page is written and sent (step 4).
    - ``skip_transfer_check`` (decode node and engine): a transfer whose token count differs from
      the reservation is accepted (step 5) and decode attends over every reserved prompt position,
      pages it never received included (step 6).
    - ``no_scrub`` (both engines): released pages are neither zeroed nor generation-checked, so the
      pages decode never received still hold other tenants' KV (step 6).
    """

    admit_rejected: bool = False
    skip_transfer_check: bool = False
    no_scrub: bool = False

    @property
    def names(self) -> list[str]:
        """The names of the switches that are on, sorted."""
        return sorted(f.name for f in dataclasses.fields(self) if getattr(self, f.name))


#: Every switch off: a process without ``KVGATE_FAULTS``.
NO_FAULTS = Faults()
#: The switch names ``KVGATE_FAULTS`` accepts.
KNOWN_FAULTS = frozenset(f.name for f in dataclasses.fields(Faults))


class UnknownFaultError(ValueError):
    """``KVGATE_FAULTS`` names a fault that does not exist (a typo must not silently test nothing)."""


def parse_faults(value: str | None) -> Faults:
    """Parse a comma-separated fault list (spaces and empty items ignored) into :class:`Faults`.

    Raises :class:`UnknownFaultError` for a name outside :data:`KNOWN_FAULTS`.
    """
    names = {part.strip() for part in (value or "").split(",") if part.strip()}
    unknown = sorted(names - KNOWN_FAULTS)
    if unknown:
        raise UnknownFaultError(
            f"{ENV_VAR}: unknown fault(s) {', '.join(unknown)}; known: {', '.join(sorted(KNOWN_FAULTS))}"
        )
    return Faults(**dict.fromkeys(names, True))


def faults_from_env(environ: Mapping[str, str] | None = None) -> Faults:
    """The faults ``KVGATE_FAULTS`` switches on in this process (logged loudly when any is on)."""
    env = os.environ if environ is None else environ
    faults = parse_faults(env.get(ENV_VAR))
    if faults.names:
        log.warning(
            "FAULT INJECTION ON (%s): this backend reproduces the cross-tenant KV leak; test use only",
            ",".join(faults.names),
        )
    return faults
