"""Secrets (cache-salt key, leak-index key, admin key): from the environment, else generated once
into ``<state_dir>/secrets.json`` (mode 0600, directory 0700). Never a default in code.

Environment names: ``KVGATE_SECRET_CACHE_SALT_KEY``, ``KVGATE_SECRET_LEAK_INDEX_KEY``,
``KVGATE_SECRET_ADMIN_KEY`` (hex or any string of at least :data:`MIN_SECRET_BYTES` UTF-8 bytes;
the bytes are used as HMAC keys). Several processes starting at once (gateway replicas,
``kvgate up``) agree on one file: creation and completion happen under an exclusive lock on
``<state_dir>/secrets.lock``.

Every state directory kvgate creates is mode 0700 (:func:`private_dir`) and every secret file
0600. :func:`permission_problems` names an existing secrets file or folder that other users can
read, with the ``chmod`` that fixes it; ``kvgate serve`` refuses to start on any of them unless
told otherwise (``--allow-open-secrets``).
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets as _secrets
import stat
from collections.abc import Mapping
from pathlib import Path

SECRET_NAMES = ("cache_salt_key", "leak_index_key", "admin_key")
SECRETS_FILE = "secrets.json"
LOCK_FILE = "secrets.lock"
#: the shortest secret accepted from the environment (bytes of its UTF-8 text); generated ones are 64
MIN_SECRET_BYTES = 16


class SecretsError(ValueError):
    """A secret is unusable: too short, or its file is not a secrets file or cannot be read."""


def private_dir(path: str | os.PathLike[str]) -> Path:
    """Create ``path`` (and any missing parent) with mode 0700, whatever the umask, and return it.
    A folder that already exists is left as it is (:func:`permission_problems` reports it)."""
    folder = Path(path)
    missing = []
    p = folder
    while not p.exists():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    for p in reversed(missing):
        try:
            p.mkdir(mode=0o700)
        except FileExistsError:  # another process made it meanwhile
            continue
        os.chmod(p, 0o700)
    return folder


def _open_mode(path: Path) -> int | None:
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        return None
    return mode if mode & 0o077 else None


def permission_problems(state_dir: str | os.PathLike[str], environ: Mapping[str, str] | None = None) -> list[str]:
    """One line per secret path that a group or other users may access: the state directory (when
    it exists) and ``secrets.json`` / ``secrets.lock`` in it (when they exist). Each line says the
    mode and the ``chmod`` to run, e.g. ``"/srv/kv/secrets.json is mode 0644 (open to other
    users); run: chmod 600 /srv/kv/secrets.json"``. Empty when all is private, and when the
    environment (``environ``, default ``os.environ``) supplies every secret and no secrets file exists."""
    folder = Path(state_dir)
    env = os.environ if environ is None else environ
    if all(env.get(secret_env_name(n)) for n in SECRET_NAMES) and not (folder / SECRETS_FILE).exists():
        return []
    out = []
    mode = _open_mode(folder)
    if mode is not None:
        out.append(f"{folder} is mode {mode:04o} (open to other users); run: chmod 700 {folder}")
    for name in (SECRETS_FILE, LOCK_FILE):
        p = folder / name
        mode = _open_mode(p)
        if mode is not None:
            out.append(f"{p} is mode {mode:04o} (open to other users); run: chmod 600 {p}")
    return out


def secret_env_name(name: str) -> str:
    """The environment variable that supplies secret ``name`` (``KVGATE_SECRET_<NAME>``)."""
    return f"KVGATE_SECRET_{name.upper()}"


def _read(path: Path) -> dict[str, str]:
    try:
        if not path.exists():
            return {}
        stored = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:  # another user's 0600 file, a folder: was a traceback from kvgate serve
        raise SecretsError(f"{path}: cannot read: {e.strerror or e}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise SecretsError(f"{path}: not a kvgate secrets file ({e}); remove it to generate new secrets") from None
    if not isinstance(stored, dict) or not all(isinstance(v, str) and v for v in stored.values()):
        raise SecretsError(f"{path}: not a kvgate secrets file (expected an object of non-empty strings)")
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
    ``<state_dir>/secrets.json``, which is created (32 random bytes, hex, per missing key; the
    file 0600, the folders 0700) on first use and never rewritten once it holds every key. Raises
    ``OSError`` when the state directory cannot be written and :class:`SecretsError` (a
    ``ValueError``) when the file cannot be read or is not a secrets file or a secret, from the environment or the
    file, is shorter than :data:`MIN_SECRET_BYTES` bytes (the message names it, never its value).
    """
    env = os.environ if environ is None else environ
    out: dict[str, bytes] = {}
    missing = []
    for name in SECRET_NAMES:
        value = env.get(secret_env_name(name))
        if value:
            raw = value.encode("utf-8", "surrogatepass")
            if len(raw) < MIN_SECRET_BYTES:
                raise SecretsError(
                    f"{secret_env_name(name)} holds {len(raw)} byte(s); a secret needs at least "
                    f"{MIN_SECRET_BYTES} (e.g. the output of: openssl rand -hex 32)"
                )
            out[name] = raw
        else:
            missing.append(name)
    if not missing:
        return out
    folder = Path(state_dir)
    path = folder / SECRETS_FILE
    stored = _read(path)
    if any(name not in stored for name in missing):
        private_dir(folder)
        lock_fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
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
        raw = stored[name].encode("utf-8", "surrogatepass")
        if len(raw) < MIN_SECRET_BYTES:  # an operator's hand-edited file: refused as the environment's is
            raise SecretsError(
                f"{path}: {name} holds {len(raw)} byte(s); a secret needs at least {MIN_SECRET_BYTES} "
                "(remove the entry to have one generated, or set e.g. the output of: openssl rand -hex 32)"
            )
        out[name] = raw
    return out
