"""kvgate's verifier: deploy gate, canary probes, leak index, usage-drift and latency detectors.

Depends on ``tokenizer`` and ``config`` only (docs/design.md). The gateway builds its stage with
:func:`from_settings`; everything heavier is imported only then.
"""

from __future__ import annotations


def from_settings(settings, secrets: dict[str, bytes] | None = None, **kwargs):
    """The gateway's verifier stage (:class:`verifier.service.VerifierService`) for ``settings``
    (``verifier`` section, ``redis_url``, ``state_dir``); ``secrets`` as returned by
    ``config.secrets.load_secrets`` (loaded from ``state_dir`` when ``None``). Extra keyword
    arguments go to :func:`verifier.build.build_verifier` (``redis``, ``key_prefix``, ``rng``,
    ``incident_path``, ``tenant_source``, ...)."""
    from verifier.build import build_verifier

    return build_verifier(settings, secrets=secrets, **kwargs)
