"""Secrets (cache-salt key, leak-index key, admin key): from the environment, else generated once
into ``<state_dir>/secrets.json`` (mode 0600). Never a default in code (DESIGN.md, Contracts).

Environment names: ``KVGATE_SECRET_CACHE_SALT_KEY``, ``KVGATE_SECRET_LEAK_INDEX_KEY``,
``KVGATE_SECRET_ADMIN_KEY`` (hex or any string; used as HMAC keys).
"""
from __future__ import annotations

import json
import os
import secrets as _secrets
from pathlib import Path

SECRET_NAMES = ("cache_salt_key", "leak_index_key", "admin_key")


def load_secrets(state_dir: str | os.PathLike[str]) -> dict[str, bytes]:
    """Return ``{name: key_bytes}`` for every name in :data:`SECRET_NAMES`.

    Each comes from ``KVGATE_SECRET_<NAME>`` when set, else from the secrets file, which is
    created (with 32 random bytes per missing key) on first use. Raises ``OSError`` when the
    state directory cannot be written.
    """
    out: dict[str, bytes] = {}
    missing = []
    for name in SECRET_NAMES:
        env = os.environ.get(f"KVGATE_SECRET_{name.upper()}")
        if env:
            out[name] = env.encode()
        else:
            missing.append(name)
    if not missing:
        return out
    path = Path(state_dir) / "secrets.json"
    stored: dict[str, str] = {}
    if path.exists():
        stored = json.loads(path.read_text())
    changed = False
    for name in missing:
        if name not in stored:
            stored[name] = _secrets.token_hex(32)
            changed = True
        out[name] = stored[name].encode()
    if changed:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(stored, f)
        os.replace(tmp, path)
    return out
