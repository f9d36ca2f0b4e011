"""The manifest of a pulled model folder (``kvgate-model.json``): each file's size, SHA-256 and
modification time, written by ``kvgate model pull`` and checked whenever the engine or the
gateway's counter loads the folder (docs/backend.md, "Models"): an edited ``tokenizer_config.json``
(the chat template both the counter and the engine render) refuses the start and is named.

Every file is hashed at load except a large weight file (:data:`WEIGHT_SUFFIXES`, above
:data:`HASH_ALWAYS_MAX_BYTES`) whose size and modification time are unchanged since the pull: its
SHA-256 is then taken as the pull's (a copy that changed the time, e.g. ``cp`` without ``-p``,
is hashed in full). The gateway's counter, which reads no weights, checks weight files by size
only. SHA-256 read 0.4-1.3 GB/s on the team machine (a 540 MB folder: 0.4-1.3 s), so hashing a
16 GB weight file at every start would cost 12-40 s.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

#: The file a completed pull writes last into the model's folder.
MANIFEST = "kvgate-model.json"
#: files holding weights: verified by size and modification time when large and untouched
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
#: a weight file up to this size is hashed at every load (bytes)
HASH_ALWAYS_MAX_BYTES = 1 << 30


class ModelFolderError(ValueError):
    """A model folder does not match its manifest; the message names the file and what to do."""


def sha256_of(path: Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def describe_files(folder: Path) -> dict[str, Any]:
    """The manifest's file fields for every file now in ``folder`` (the manifest itself aside):
    ``files`` {name: bytes}, ``sha256`` {name: hex digest}, ``mtime_ns`` {name: ns}."""
    files: dict[str, int] = {}
    digests: dict[str, str] = {}
    mtimes: dict[str, int] = {}
    for p in sorted(folder.iterdir()):
        if p.name == MANIFEST or not p.is_file():
            continue
        st = p.stat()
        files[p.name], mtimes[p.name] = st.st_size, st.st_mtime_ns
        digests[p.name] = sha256_of(p)
    return {"files": files, "sha256": digests, "mtime_ns": mtimes}


def _trusted(name: str, st: os.stat_result, man: dict[str, Any], weights: bool) -> bool:
    if not name.endswith(WEIGHT_SUFFIXES):
        return False
    if not weights:
        return True
    return st.st_size > HASH_ALWAYS_MAX_BYTES and man.get("mtime_ns", {}).get(name) == st.st_mtime_ns


def verify_folder(folder: str | os.PathLike[str], *, weights: bool = True) -> dict[str, Any] | None:
    """Check a folder against its manifest: ``None`` for a folder without one (not a pull: nothing
    to check), else the manifest. Raises :class:`ModelFolderError` naming the first file that is
    missing, of another size or another SHA-256 (see the module docstring for large weights), or
    for a manifest without checksums (a pull by an older kvgate) or that cannot be read.
    ``weights`` False (a counter, which never reads them): weight files are checked by size only."""
    path = Path(folder)
    mpath = path / MANIFEST
    if not mpath.is_file():
        return None
    import json

    again = f"remove {path} and pull it again (kvgate model pull NAME)"
    try:
        man = json.loads(mpath.read_text(encoding="utf-8"))
        files = man["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelFolderError(f"{mpath} cannot be read ({type(e).__name__}: {e}); {again}") from None
    digests = man.get("sha256") if isinstance(man, dict) else None
    if not isinstance(digests, dict) or not isinstance(files, dict):
        raise ModelFolderError(
            f"{mpath} has no file checksums (pulled by an older kvgate); run kvgate model pull "
            f"{path.name}, which adds them"
        )
    for name, size in files.items():
        f = path / name
        try:
            st = f.stat()
        except OSError:
            raise ModelFolderError(f"{f} is missing: the folder is not as pulled; {again}") from None
        if st.st_size != size:
            raise ModelFolderError(f"{f} is {st.st_size} bytes, not the pulled {size}: it was changed; {again}")
        if not _trusted(name, st, man, weights) and sha256_of(f) != digests.get(name):
            raise ModelFolderError(
                f"{f} does not match its SHA-256 in {MANIFEST}: it was changed since the pull; {again}"
            )
    return man
