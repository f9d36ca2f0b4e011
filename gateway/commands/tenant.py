"""``kvgate tenant ACTION ...``: edit or show the tenants file (``config/tenants.yaml`` or ``--tenants``).

Actions are argparse sub-subcommands. Each one is registered by a function in :data:`ACTIONS`
that adds its parser to the subparsers and sets ``handler`` (``handler(args) -> int``); adding an
action is one such function plus one line in :data:`ACTIONS`. Helpers shared by the actions:

- :func:`tenants_option` adds ``--tenants PATH`` to an action's parser;
- :func:`edit_tenants` opens the file for a locked read-modify-write that keeps comments, key
  order and flow style (ruamel.yaml round trip), validates the result as
  :class:`config.models.TenantsFile` before anything is written, and replaces the file atomically;
- :func:`read_tenants` reads the file as the gateway does, for ``list`` and ``show``;
- :func:`new_api_key` / :func:`key_sha256` make a key and the hash that is stored (never the key).

A running gateway reads the file at start and on reload; an edit changes nothing until then.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import hashlib
import io
import json
import os
import re
import secrets
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml as pyyaml
from pydantic import ValidationError
from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.error import YAMLError
from ruamel.yaml.scalarstring import SingleQuotedScalarString

from config.loader import DEFAULT_TENANTS, ConfigError, _format_validation, validate_yaml_text
from config.models import TenantConfig, TenantsFile

#: Prefix of generated keys (``sk-kvg-`` + 43 url-safe base64 characters = 256 random bits).
KEY_PREFIX = "sk-kvg-"

_NEW_FILE_HEADER = "# kvgate tenants. Keys are stored only as SHA-256 hashes; `kvgate tenant ...` edits this file.\n"


class TenantFileError(Exception):
    """The tenants file cannot be read, parsed, validated or written; ``str()`` says which and why."""


def new_api_key() -> str:
    """A fresh API key: :data:`KEY_PREFIX` + 256 random bits (``secrets.token_urlsafe(32)``)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def key_sha256(key: str) -> str:
    """Lowercase hex SHA-256 of the key's UTF-8 bytes: the form stored in ``api_key_sha256``
    and compared (constant-time) by the gateway's authentication."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def default_tenants_path() -> Path:
    """``$KVGATE_TENANTS`` when set, else the ``config/tenants.yaml`` beside the config package
    (the file ``kvgate up`` and ``kvgate serve`` read by default)."""
    return Path(os.environ.get("KVGATE_TENANTS") or DEFAULT_TENANTS)


def _yaml() -> YAML:
    y = YAML()  # round-trip mode: comments, key order and flow style survive
    y.indent(mapping=2, sequence=4, offset=2)
    y.width = 4096  # never fold a 64-digit hash onto a second line
    y.preserve_quotes = True
    y.representer.add_representer(type(None), lambda r, _d: r.represent_scalar("tag:yaml.org,2002:null", "null"))
    return y


def _tenants_seq(doc: Any, path: Path) -> CommentedSeq:
    if not isinstance(doc, CommentedMap):
        raise TenantFileError(f"{path}: (top level): expected a mapping with a 'tenants' list")
    seq = doc.get("tenants")
    if seq is None:
        seq = CommentedSeq()
        doc["tenants"] = seq
    if not isinstance(seq, CommentedSeq):
        raise TenantFileError(f"{path}: tenants: expected a list of tenant entries")
    if seq.fa.flow_style() and not seq:  # `tenants: []` -> block style once entries arrive
        seq.fa.set_block_style()
    return seq


@contextlib.contextmanager
def _locked(p: Path) -> Iterator[None]:
    """Hold ``flock`` on ``p``'s directory (created when missing) for the block."""
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        lock_fd = os.open(p.parent, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        raise TenantFileError(f"{p}: cannot lock for writing: {e.strerror or e}") from e
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(lock_fd)  # releases the flock


def _load(p: Path, y: YAML) -> tuple[str, CommentedMap]:
    """The file's text (a new file's header when missing) and its round-trip document."""
    try:
        text = p.read_text(encoding="utf-8") if p.exists() else _NEW_FILE_HEADER + "tenants: []\n"
        doc = y.load(text)
    except OSError as e:
        raise TenantFileError(f"{p}: cannot read: {e.strerror or e}") from e
    except UnicodeDecodeError as e:
        raise TenantFileError(f"{p}: not UTF-8 text: {e.reason} at byte {e.start}") from e
    except YAMLError as e:
        raise TenantFileError(f"{p}: invalid YAML: {e}") from e
    except RecursionError:  # ruamel composes recursively: `[[[...` some 300 deep was a traceback
        raise TenantFileError(f"{p}: invalid YAML: lists or mappings nested too deeply to parse") from None
    return text, CommentedMap() if doc is None else doc


def _validate(p: Path, doc: Any, text: str) -> TenantsFile:
    """``doc`` is a valid tenants file, and so is ``text`` (its dump) as the gateway reads it:
    with PyYAML (YAML 1.1, where ``on``, ``no``, ``yes``, ``off`` are booleans), not ruamel (1.2)."""
    try:
        TenantsFile.model_validate(_plain(doc))
    except ValidationError as e:
        raise TenantFileError("\n".join(f"{p}: {problem}" for problem in _format_validation(e))) from None
    try:
        return validate_yaml_text(text, TenantsFile, p)
    except ConfigError as e:
        raise TenantFileError(f"{e}\n{p}: (as the gateway reads the file: YAML 1.1; quote such a value)") from None


def _text(value: str) -> str:
    """``value``, single-quoted in the file when YAML 1.1 reads it as no string (``on``: true)."""
    tag = pyyaml.resolver.Resolver().resolve(pyyaml.ScalarNode, value, (True, False))
    return value if tag == "tag:yaml.org,2002:str" else SingleQuotedScalarString(value)


def _target(path: str | os.PathLike[str]) -> Path:
    """The file ``path`` names, symlinks followed: ``os.replace`` onto a symlink replaced the link
    with a regular file, and a gateway reading the link's target never saw the edit (nor did a
    second editor through the target, which locked another folder)."""
    p = Path(path)
    return Path(os.path.realpath(p)) if p.is_symlink() else p


@contextlib.contextmanager
def edit_tenants(path: str | os.PathLike[str]) -> Iterator[CommentedSeq]:
    """Locked read-modify-write of a tenants file; yields the ``tenants`` list to change in place.

    The list holds ruamel ``CommentedMap`` entries (use them like dicts). On normal exit the whole
    document is validated as :class:`~config.models.TenantsFile`, as written and as the gateway
    reads it (YAML 1.1: an ``id`` such as ``on`` is quoted), and written atomically (temporary
    file + ``os.replace``, the old file's mode and, where allowed, owner kept); if the block
    raises, nothing is written.
    A missing file is created. Raises :class:`TenantFileError` (file unreadable, not YAML, invalid
    after the edit, or not writable). Concurrent editors are serialised with ``flock`` on the
    file's directory (no lock file is left behind). A symlink is followed: its target is edited.
    """
    p = _target(path)
    with _locked(p):
        y = _yaml()
        _, doc = _load(p, y)
        seq = _tenants_seq(doc, p)
        yield seq
        for entry in seq:  # `kvgate serve --init-tenant on` appends a plain dict
            if isinstance(entry, dict) and isinstance(entry.get("id"), str) and _text(entry["id"]) is not entry["id"]:
                entry["id"] = _text(entry["id"])
        buf = io.StringIO()
        y.dump(doc, buf)
        _validate(p, doc, buf.getvalue())
        _atomic_write(p, buf.getvalue())


def read_tenants(path: str | os.PathLike[str]) -> TenantsFile:
    """The tenants file at ``path`` (a symlink followed) as the gateway reads it. Raises
    :class:`TenantFileError` as :func:`edit_tenants` does, and for a missing file."""
    p = _target(path)
    if not p.exists():
        raise TenantFileError(f"{p}: cannot read: {os.strerror(errno.ENOENT)}")
    text, doc = _load(p, _yaml())
    if not isinstance(doc, CommentedMap) or doc.get("tenants") is not None:  # `tenants:` (null) is no list
        _tenants_seq(doc, p)
    return _validate(p, doc, text)


def remove_tenant(path: str | os.PathLike[str], tenant_id: str) -> int:
    """Remove tenant ``tenant_id`` from the tenants file at ``path`` (locked, validated, atomic,
    as :func:`edit_tenants`); returns how many tenants are left (0 is allowed: ``tenants: []``).

    In a block-style list the entry's lines are cut from the text, with the comment lines right
    above it; every other byte (other entries, their comments, the comments above the next entry
    or at the end of the file) stays. Raises :class:`TenantFileError` for an unknown tenant and as
    :func:`edit_tenants` does."""
    p = _target(path)
    with _locked(p):
        y = _yaml()
        text, doc = _load(p, y)
        seq = _tenants_seq(doc, p)
        entry = find_tenant(seq, tenant_id)
        if entry is None:
            raise TenantFileError(f"{p}: no tenant '{tenant_id}'")
        i = next(n for n, e in enumerate(seq) if e is entry)
        left = len(seq) - 1
        new_text = _cut_entry(text, seq, i, doc.lc.key("tenants")[0])
        if new_text is None:  # a flow-style list: the round trip rewrites it
            del seq[i]
            buf = io.StringIO()
            y.dump(doc, buf)
            new_text = buf.getvalue()
        try:
            edited = y.load(new_text)
        except YAMLError as e:  # the cut entry held an anchor (&name) another entry refers to
            raise TenantFileError(
                f"{p}: removing '{tenant_id}' would leave the file invalid YAML ({getattr(e, 'problem', e)}); "
                "another entry refers to an anchor in it: edit the file by hand"
            ) from None
        _validate(p, edited, new_text)
        _atomic_write(p, new_text)
        return left


def _is_note(line: str) -> bool:
    return not line.strip() or line.lstrip().startswith("#")


def _cut_entry(text: str, seq: CommentedSeq, i: int, key_line: int) -> str | None:
    """``text`` without entry ``i`` of the block list ``seq`` (whose key is on line ``key_line``,
    0-based), or ``None`` when the list is not one ``- ``-item per entry."""
    lines = text.splitlines(keepends=True)
    start = seq.lc.item(i)[0]
    if seq.fa.flow_style() or not lines[start].lstrip().startswith("-"):
        return None
    end = seq.lc.item(i + 1)[0] if i + 1 < len(seq) else len(lines)
    while end > start + 1 and _is_note(lines[end - 1]):  # what stands above the next entry stays
        end -= 1
    while start > key_line + 1 and lines[start - 1].lstrip().startswith("#"):  # the entry's own comments go
        start -= 1
    kept = lines[:start] + lines[end:]
    if len(seq) == 1:
        kept[key_line] = re.sub(r"^(\s*tenants:)", r"\1 []", kept[key_line], count=1)
    return "".join(kept)


def _plain(node: Any, done: dict[int, Any] | None = None) -> Any:
    """ruamel containers -> plain dicts/lists for pydantic. An aliased container (``*name``) is
    converted once: converting every alias of aliases ("billion laughs") took exponential time."""
    done = {} if done is None else done
    if not isinstance(node, (dict, list)):
        return node
    if id(node) not in done:
        if isinstance(node, dict):
            done[id(node)] = {str(k): _plain(v, done) for k, v in node.items()}
        else:
            done[id(node)] = [_plain(v, done) for v in node]
    return done[id(node)]


def _atomic_write(p: Path, text: str) -> None:
    st = p.stat() if p.exists() else None
    mode = st.st_mode & 0o777 if st else 0o600
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        if st and (st.st_uid, st.st_gid) != (os.geteuid(), os.getegid()):
            # `sudo kvgate tenant ...` made the gateway's 0600 file root's: its reloads then failed
            # and kept the old table, a revoked key included
            with contextlib.suppress(PermissionError):
                os.chown(tmp, st.st_uid, st.st_gid)
        os.replace(tmp, p)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise TenantFileError(f"{p}: cannot write: {e.strerror or e}") from e


def find_tenant(seq: CommentedSeq, tenant_id: str) -> dict[str, Any] | None:
    """The entry of ``seq`` whose ``id`` is ``tenant_id``, else ``None``."""
    for entry in seq:
        if isinstance(entry, dict) and entry.get("id") == tenant_id:
            return entry
    return None


def tenants_option(parser: argparse.ArgumentParser) -> None:
    """Add ``--tenants PATH`` (default :func:`default_tenants_path`) to an action's parser."""
    parser.add_argument(
        "--tenants",
        type=Path,
        default=None,
        metavar="PATH",
        help="tenants file (default: $KVGATE_TENANTS or config/tenants.yaml)",
    )


def limit_options(parser: argparse.ArgumentParser) -> None:
    """Add the tenant-limit flags (``--rpm``, ``--tpm``, ``--max-concurrent``,
    ``--max-context-tokens``, ``--max-tokens-cap``, ``--default-max-tokens``, ``--model``) whose
    values :func:`limits_from_args` collects. Unset flags leave the field as it is."""
    g = parser.add_argument_group("limits (docs/configuration.md, tenants.yaml)")
    g.add_argument("--rpm", type=int, help="requests per quota window")
    g.add_argument("--tpm", type=int, help="prompt + completion tokens per quota window")
    g.add_argument("--max-concurrent", type=int, help="requests in flight at once")
    g.add_argument("--max-context-tokens", type=int, help="prompt + completion tokens per request")
    g.add_argument("--max-tokens-cap", type=int, help="largest max_tokens a request may ask for")
    g.add_argument("--default-max-tokens", type=int, help="max_tokens when a request gives none")
    g.add_argument(
        "--model",
        dest="models",
        action="append",
        metavar="MODEL",
        help="a model the tenant may use (repeat for several)",
    )
    v = parser.add_argument_group("verification (docs/verifier.md)")
    v.add_argument("--verify-sample-rate", type=float, metavar="RATE", help="share of responses checked, 0-1")
    v.add_argument(
        "--strict-verify",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="check every response before it is released (--no-strict-verify: off)",
    )


#: the tenant fields :func:`limit_options` sets, by their flag's destination
_FIELDS = (
    "rpm",
    "tpm",
    "max_concurrent",
    "max_context_tokens",
    "max_tokens_cap",
    "default_max_tokens",
    "verify_sample_rate",
    "strict_verify",
)


def limits_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The tenant fields given on the command line by :func:`limit_options` (unset ones omitted)."""
    out: dict[str, Any] = {}
    for name in _FIELDS:
        value = getattr(args, name, None)
        if value is not None:
            out[name] = value
    if getattr(args, "models", None):
        out["allowed_models"] = _flow([_text(m) for m in args.models])
    return out


def flag_problem(name: str, fields: dict[str, Any]) -> str | None:
    """What is wrong with the values given on the command line (``fields``, as
    :func:`limits_from_args`; ``None`` values are cleared fields) for tenant ``name``, checked
    alone, before the file is touched: ``--rpm: Input should be greater than or equal to 0 (got
    -1)``; ``None`` when they are valid. Checks that need the whole entry (e.g. a default above
    the cap) are the file's and are reported with it."""
    given: dict[str, Any] = {k: list(v) if isinstance(v, list) else v for k, v in fields.items() if v is not None}
    try:
        TenantConfig.model_validate({"id": name, **given})
    except ValidationError as e:
        for err in e.errors():
            loc = err.get("loc") or ()
            if loc and loc[0] in given:
                flag = "--model" if loc[0] == "allowed_models" else "--" + str(loc[0]).replace("_", "-")
                return f"{flag}: {err['msg']} (got {given[loc[0]]!r})"
    return None


def _flow(items: list[Any]) -> CommentedSeq:
    seq = CommentedSeq(items)
    seq.fa.set_flow_style()  # `[a, b]`, like the shipped file
    return seq


# ---------------------------------------------------------------- actions
def _warn_unknown_models(command: str, models: list[str] | None) -> None:
    """Warn (stderr) of each ``--model`` that is no model id or alias of the settings
    ``KVGATE_CONFIG`` names: a running gateway leaves such a tenant out, and the next ``kvgate
    serve`` refuses the whole file. No ``KVGATE_CONFIG`` (the embedded stack makes its settings
    from the model it serves), or settings that do not load: no warning."""
    source = os.environ.get("KVGATE_CONFIG")
    if not models or not source:
        return
    from config.loader import load_settings

    try:
        settings = load_settings(source)
    except Exception:  # the settings are the gateway's business: the tenants file is still written
        return
    for name in models:
        if settings.model_by_name(name) is None:
            print(
                f"kvgate tenant {command}: warning: model '{name}' is no model id or alias in {source} "
                "(KVGATE_CONFIG): a running gateway leaves this tenant out, and the next 'kvgate serve' "
                "refuses the file",
                file=sys.stderr,
            )


def _cmd_add(args: argparse.Namespace) -> int:
    path = args.tenants or default_tenants_path()
    try:
        TenantConfig(id=args.name)
    except ValidationError as e:
        print(f"kvgate tenant add: invalid tenant name {args.name!r}: {e.errors()[0]['msg']}", file=sys.stderr)
        return 2
    fields = limits_from_args(args)
    if (problem := flag_problem(args.name, fields)) is not None:
        print(f"kvgate tenant add: {problem}", file=sys.stderr)
        return 2
    key = new_api_key()
    try:
        with edit_tenants(path) as seq:
            if find_tenant(seq, args.name) is not None:
                raise TenantFileError(
                    f"{path}: tenant '{args.name}' already exists (to give it another key: kvgate tenant add-key)"
                )
            entry = CommentedMap(id=args.name, api_key_sha256=_flow([key_sha256(key)]))
            entry.update(fields)
            seq.append(entry)
    except TenantFileError as e:
        print(f"kvgate tenant add: {e}", file=sys.stderr)
        return 1
    _warn_unknown_models("add", getattr(args, "models", None))
    print(
        f"kvgate: tenant '{args.name}' added to {path}. Its API key is printed below, once: "
        "only its SHA-256 is stored. A running gateway picks it up when it re-reads the file (it watches "
        "it; SIGHUP reloads at once).",
        file=sys.stderr,
    )
    print(key)
    sys.stdout.flush()
    return 0


def _register_add(sub: Any) -> None:
    p = sub.add_parser(
        "add",
        help="add a tenant and print its new API key (once)",
        description="Add tenant NAME with a new API key. The key goes to stdout (once; "
        "messages go to stderr), only its SHA-256 to the tenants file.",
    )
    p.add_argument("name", metavar="NAME", help="tenant id: 1-64 letters, digits, '.', '_' or '-'")
    tenants_option(p)
    limit_options(p)
    p.set_defaults(handler=_cmd_add)


#: Fields ``kvgate tenant set --clear FIELD`` may set to null (unlimited / none).
CLEARABLE = ("rpm", "tpm", "max_concurrent", "max_context_tokens", "max_tokens_cap")
#: Shortest hash prefix ``revoke-key`` accepts (hex digits of the key's SHA-256).
MIN_HASH_PREFIX = 8


def _cmd_set(args: argparse.Namespace) -> int:
    path = args.tenants or default_tenants_path()
    changes = limits_from_args(args)
    for name in args.clear or []:
        if name in changes:
            print(f"kvgate tenant set: --clear {name} and a value for it contradict each other", file=sys.stderr)
            return 2
        changes[name] = None
    if not changes:
        print("kvgate tenant set: nothing to change (give --rpm, --tpm, ... or --clear FIELD)", file=sys.stderr)
        return 2
    if (problem := flag_problem(args.name, changes)) is not None:
        print(f"kvgate tenant set: {problem}", file=sys.stderr)
        return 2
    try:
        with edit_tenants(path) as seq:
            entry = find_tenant(seq, args.name)
            if entry is None:
                raise TenantFileError(f"{path}: no tenant '{args.name}' (add it with: kvgate tenant add)")
            entry.update(changes)
    except TenantFileError as e:
        print(f"kvgate tenant set: {e}", file=sys.stderr)
        return 1
    _warn_unknown_models("set", getattr(args, "models", None))
    shown = ", ".join(
        f"{k}={'null' if v is None else (list(v) if isinstance(v, list) else v)}" for k, v in changes.items()
    )
    print(
        f"kvgate: tenant '{args.name}' in {path}: {shown}. A running gateway applies it when it "
        "reloads the file (on change, or SIGHUP).",
        file=sys.stderr,
    )
    return 0


def _register_set(sub: Any) -> None:
    p = sub.add_parser(
        "set",
        help="change a tenant's limits (rpm, tpm, concurrency, models, ...)",
        description="Change limits of tenant NAME; fields not given stay as they are. "
        "A running gateway applies the change when it reloads the file.",
    )
    p.add_argument("name", metavar="NAME", help="the tenant's id")
    tenants_option(p)
    limit_options(p)
    p.add_argument(
        "--clear",
        action="append",
        choices=CLEARABLE,
        metavar="FIELD",
        help=f"set FIELD to null (no limit); one of {', '.join(CLEARABLE)}; repeatable",
    )
    p.set_defaults(handler=_cmd_set)


def _cmd_add_key(args: argparse.Namespace) -> int:
    path = args.tenants or default_tenants_path()
    key = new_api_key()
    digest = key_sha256(key)
    try:
        with edit_tenants(path) as seq:
            entry = find_tenant(seq, args.name)
            if entry is None:
                raise TenantFileError(f"{path}: no tenant '{args.name}' (add it with: kvgate tenant add)")
            hashes = entry.get("api_key_sha256")
            if isinstance(hashes, list):
                hashes.append(digest)
            else:
                entry["api_key_sha256"] = _flow([digest])
    except TenantFileError as e:
        print(f"kvgate tenant add-key: {e}", file=sys.stderr)
        return 1
    print(
        f"kvgate: tenant '{args.name}' has a new API key (its SHA-256 begins {digest[:12]}; revoke "
        f"it with: kvgate tenant revoke-key {args.name} {digest[:12]}). The key is printed below, "
        "once: only its SHA-256 is stored. Its other keys keep working until revoked.",
        file=sys.stderr,
    )
    print(key)
    sys.stdout.flush()
    return 0


def _register_add_key(sub: Any) -> None:
    p = sub.add_parser(
        "add-key",
        help="give a tenant another API key and print it (once)",
        description="Add a new API key to tenant NAME (keys rotate: a tenant may hold "
        "several). The key goes to stdout once; only its SHA-256 is stored.",
    )
    p.add_argument("name", metavar="NAME", help="the tenant's id")
    tenants_option(p)
    p.set_defaults(handler=_cmd_add_key)


def _cmd_revoke_key(args: argparse.Namespace) -> int:
    path = args.tenants or default_tenants_path()
    given = args.key_prefix.strip()
    full_key_hash = key_sha256(given)
    prefix = given.lower()
    if not (len(prefix) >= MIN_HASH_PREFIX and all(c in "0123456789abcdef" for c in prefix)):
        prefix = ""
    revoked: list[str] = []
    left = 0
    try:
        with edit_tenants(path) as seq:
            entry = find_tenant(seq, args.name)
            if entry is None:
                raise TenantFileError(f"{path}: no tenant '{args.name}'")
            hashes = entry.get("api_key_sha256") or []
            matches = [h for h in hashes if h == full_key_hash] or (
                [h for h in hashes if prefix and str(h).startswith(prefix)]
            )
            if not matches:
                # never echo what may be a key: a hex key (openssl rand -hex) reads as a long prefix
                shown = f" '{prefix[:12]}'" if prefix else ""
                raise TenantFileError(
                    f"{path}: tenant '{args.name}' holds no key matching{shown} (give the key itself, or at "
                    f"least {MIN_HASH_PREFIX} leading hex digits of its SHA-256)"
                )
            if len(matches) > 1:
                raise TenantFileError(
                    f"'{prefix}' matches {len(matches)} keys of tenant '{args.name}': give more digits"
                )
            hashes.remove(matches[0])
            revoked, left = matches, len(hashes)
    except TenantFileError as e:
        print(f"kvgate tenant revoke-key: {e}", file=sys.stderr)
        return 1
    note = "" if left else " The tenant now has no key: nobody can use it until add-key."
    print(
        f"kvgate: revoked the key of tenant '{args.name}' whose SHA-256 begins {revoked[0][:12]} "
        f"({left} key(s) left).{note} A running gateway refuses it once it reloads the file.",
        file=sys.stderr,
    )
    return 0


def _register_revoke_key(sub: Any) -> None:
    p = sub.add_parser(
        "revoke-key",
        help="revoke one of a tenant's API keys",
        description="Remove one API key of tenant NAME. KEY_PREFIX is the key itself or "
        f"at least {MIN_HASH_PREFIX} leading hex digits of its SHA-256 (as "
        "add-key prints); it must match exactly one key.",
    )
    p.add_argument("name", metavar="NAME", help="the tenant's id")
    p.add_argument("key_prefix", metavar="KEY_PREFIX", help="the key, or a prefix of its SHA-256 (hex)")
    tenants_option(p)
    p.set_defaults(handler=_cmd_revoke_key)


def _cmd_remove(args: argparse.Namespace) -> int:
    path = args.tenants or default_tenants_path()
    try:
        left = remove_tenant(path, args.name)
    except TenantFileError as e:
        print(f"kvgate tenant remove: {e}", file=sys.stderr)
        return 1
    print(
        f"kvgate: tenant '{args.name}' removed from {path} ({left} tenant(s) left). A running gateway "
        "refuses its keys once it reloads the file (on change, or SIGHUP).",
        file=sys.stderr,
    )
    return 0


def _register_remove(sub: Any) -> None:
    p = sub.add_parser(
        "remove",
        help="remove a tenant and all its API keys",
        description="Remove tenant NAME (its entry, limits and keys) from the tenants file; the "
        "other entries and the comments stay as they are.",
    )
    p.add_argument("name", metavar="NAME", help="the tenant's id")
    tenants_option(p)
    p.set_defaults(handler=_cmd_remove)


#: Hex digits of a key's SHA-256 that ``list`` and ``show`` print, as ``add-key`` does.
SHOWN_HASH_DIGITS = 12
#: ``kvgate tenant list`` columns: heading, field of :func:`tenant_view` (``show`` prints every field)
_COLUMNS = (
    ("ID", "id"),
    ("MODELS", "allowed_models"),
    ("RPM", "rpm"),
    ("TPM", "tpm"),
    ("CONCURRENT", "max_concurrent"),
    ("CONTEXT", "max_context_tokens"),
    ("VERIFY", "verify_sample_rate"),
    ("STRICT", "strict_verify"),
    ("KEYS", "api_key_sha256_prefixes"),
)
#: what an empty list means, per field
_EMPTY = {"allowed_models": "(all)", "api_key_sha256_prefixes": "(none)"}


def tenant_view(t: TenantConfig) -> dict[str, Any]:
    """What ``list`` / ``show`` print of ``t`` (and ``--json`` gives): its fields by name, its
    keys only as the SHA-256 prefixes ``add-key`` prints and ``revoke-key`` takes."""
    view = t.model_dump(exclude={"api_key_sha256"})
    view["api_key_sha256_prefixes"] = [h[:SHOWN_HASH_DIGITS] for h in t.api_key_sha256]
    return view


def _cell(field: str, value: Any) -> str:
    """``value`` for a table: ``unlimited`` for null, a list comma-joined; text with a character
    that is not printable (a model name may hold a newline) as its ``repr``, on one line."""
    if value is None:
        return "unlimited"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return ",".join(_cell(field, v) for v in value) or _EMPTY.get(field, "")
    text = str(value)
    return text if text.isprintable() else repr(text)


def _cmd_list(args: argparse.Namespace) -> int:
    path = args.tenants or default_tenants_path()
    try:
        views = [tenant_view(t) for t in read_tenants(path).tenants]
    except TenantFileError as e:
        print(f"kvgate tenant {args.action}: {e}", file=sys.stderr)
        return 1
    if args.action == "show":
        return _show(path, args, views)
    if args.json:
        print(json.dumps(views, indent=2))
    elif not views:
        print(f"kvgate: {path} holds no tenant", file=sys.stderr)
    else:
        rows = [[h for h, _ in _COLUMNS]] + [[_cell(f, v[f]) for _, f in _COLUMNS] for v in views]
        widths = [max(len(r[i]) for r in rows) for i in range(len(_COLUMNS))]
        print("\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows))
    return 0


def _show(path: Path, args: argparse.Namespace, views: list[dict[str, Any]]) -> int:
    view = next((v for v in views if v["id"] == args.name), None)
    if view is None:
        print(f"kvgate tenant show: {path}: no tenant '{args.name}'", file=sys.stderr)
        return 1
    width = max(map(len, view))
    shown = "\n".join(f"{k.ljust(width)}  {_cell(k, v)}" for k, v in view.items())
    print(json.dumps(view, indent=2) if args.json else shown)
    return 0


def _register_list(sub: Any) -> None:
    p = sub.add_parser(
        "list",
        help="list the tenants: limits, models, key hash prefixes",
        description="Print every tenant of the tenants file, one line each: its models, limits "
        f"('unlimited' where none is set), verification and keys (the first {SHOWN_HASH_DIGITS} hex digits of "
        "each key's SHA-256, as revoke-key takes them). The file is only read.",
    )
    p.add_argument("--json", action="store_true", help="print one JSON list (every field) instead")
    tenants_option(p)
    p.set_defaults(handler=_cmd_list)


def _register_show(sub: Any) -> None:
    p = sub.add_parser(
        "show",
        help="print every field of one tenant",
        description="Print every field of tenant NAME, its keys as the first "
        f"{SHOWN_HASH_DIGITS} hex digits of their SHA-256 (as revoke-key takes them). The file is only read.",
    )
    p.add_argument("name", metavar="NAME", help="the tenant's id")
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    tenants_option(p)
    p.set_defaults(handler=_cmd_list)


#: One registering function per action, in ``--help`` order.
ACTIONS: list[Callable[[Any], None]] = [
    _register_add,
    _register_set,
    _register_add_key,
    _register_revoke_key,
    _register_remove,
    _register_list,
    _register_show,
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register every action of :data:`ACTIONS` as a sub-subcommand of ``kvgate tenant``."""
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    for register in ACTIONS:
        register(sub)


def run(args: argparse.Namespace) -> int:
    """Run the chosen action; returns the exit status (0 ok, 1 file problem, 2 bad arguments)."""
    return int(args.handler(args))
