"""Secrets (cache-salt key, leak-index key, admin key): from the environment, else generated once
into ``<state_dir>/secrets.json`` (mode 0600, directory 0700). Never a default in code (DESIGN.md,
Contracts).

Environment names: ``KVGATE_SECRET_CACHE_SALT_KEY``, ``KVGATE_SECRET_LEAK_INDEX_KEY``,
``KVGATE_SECRET_ADMIN_KEY`` (hex or any string; the UTF-8 bytes are used as HMAC keys).
Several processes starting at once (gateway replicas, ``kvgate up``) agree on one file: creation
and completion happen under an exclusive lock on ``<state_dir>/secrets.lock``.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets as _secrets
from pathlib import Path
from typing import Mapping

SECRET_NAMES = ("cache_salt_key", "leak_index_key", "admin_key")
SECRETS_FILE = "secrets.json"


def secret_env_name(name: str) -> str:
    """The environment variable that supplies secret ``name`` (``KVGATE_SECRET_<NAME>``)."""
    return f"KVGATE_SECRET_{name.upper()}"


def _read(path: Path) -> dict[str, str]:
    if not path.exists():
        return {}
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not a kvgate secrets file ({e}); remove it to generate new secrets") from None
    if not isinstance(stored, dict) or not all(isinstance(v, str) and v for v in stored.values()):
        raise ValueError(f"{path}: not a kvgate secrets file (expected an object of non-empty strings)")
    return stored


def _write(path: Path, stored: dict[str, str]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # a leftover .tmp may have had another mode
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            fd = -1
            json.dump(stored, f)
            f.flush()
            os.fsync(f.fileno())
    finally:
        if fd != -1:
            os.close(fd)
    os.replace(tmp, path)


def load_secrets(state_dir: str | os.PathLike[str], environ: Mapping[str, str] | None = None) -> dict[str, bytes]:
    """Return ``{name: key_bytes}`` for every name in :data:`SECRET_NAMES`.

    Each comes from ``KVGATE_SECRET_<NAME>`` when set and non-empty, else from
    ``<state_dir>/secrets.json``, which is created (32 random bytes, hex, per missing key) on first
    use and never rewritten once it holds every key. Raises ``OSError`` when the state directory
    cannot be written and ``ValueError`` when the file is not a secrets file.
    """
    env = os.environ if environ is None else environ
    out: dict[str, bytes] = {}
    missing = []
    for name in SECRET_NAMES:
        value = env.get(secret_env_name(name))
        if value:
            out[name] = value.encode()
        else:
            missing.append(name)
    if not missing:
        return out
    folder = Path(state_dir)
    path = folder / SECRETS_FILE
    stored = _read(path)
    if any(name not in stored for name in missing):
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        lock_fd = os.open(folder / "secrets.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            stored = _read(path)  # another process may have written it while we waited
            added = {name: _secrets.token_hex(32) for name in missing if name not in stored}
            if added:
                stored.update(added)
                _write(path, stored)
        finally:
            os.close(lock_fd)  # releases the lock
    for name in missing:
        out[name] = stored[name].encode()
    return out
