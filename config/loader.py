"""Load :class:`~config.models.Settings` and :class:`~config.models.TenantsFile` from YAML.

Errors name the file, the line, the key path and the problem, e.g.::

    config/kvgate.yaml: line 3: gateway.port: Input should be a valid integer, unable to parse string as an
    integer (got 'eighty')

A key that is not a setting, and a key given twice in one mapping, are errors, never ignored.

Environment overrides (docs/design.md, Contracts): ``KVGATE_<SECTION>__<KEY>=value`` sets
``section.key`` (values parsed as YAML scalars, so ``8081`` is an int and ``[a, b]`` a list);
a top-level key is ``KVGATE_<KEY>`` (e.g. ``KVGATE_REDIS_URL``). Variables whose first part is not
a settings key (``KVGATE_FAULTS``, ``KVGATE_CONFIG``) are not settings and are left alone, unless
their name, its underscores aside, spells a setting exactly: ``KVGATE_GATEWAY_PORT`` (one
underscore) or ``KVGATE_REDIS__URL`` is an error naming the spelling that is read
(:func:`env_name_problems`), not a setting silently left at its default.
"""

from __future__ import annotations

import os
import re
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, SecretStr, ValidationError

from config.models import Settings, TenantsFile

DEFAULT_DIR = Path(__file__).resolve().parent
DEFAULT_CONFIG = DEFAULT_DIR / "kvgate.yaml"
DEFAULT_TENANTS = DEFAULT_DIR / "tenants.yaml"
ENV_PREFIX = "KVGATE_"

M = TypeVar("M", bound=BaseModel)


class ConfigError(ValueError):
    """A configuration file (or an environment override applied to it) is wrong. ``str()`` is one
    line per problem, ``SOURCE: [line N: ]key.path: problem``; ``source`` is the file path and
    ``problems`` the lines without it. A problem from the environment names its variable."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        super().__init__("\n".join(f"{source}: {p}" for p in problems))


def _loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "(top level)"


_LEADING_PATH = re.compile(r"^([A-Za-z_][\w]*(?:\[\d+\]|\.[A-Za-z_]\w*)*): ")


def _parse_loc(text: str) -> tuple[Any, ...]:
    """``"upstreams[0].models[1]"`` -> ``("upstreams", 0, "models", 1)`` (inverse of :func:`_loc`)."""
    return tuple(int(p[1:-1]) if p.startswith("[") else p for p in re.findall(r"\[\d+\]|[^.\[\]]+", text))


#: keys whose values are secrets, or (``api_key_sha256``) where a key is pasted instead of its hash:
#: a problem with one never shows the value
_SECRET_KEYS = frozenset({"api_key", "metrics_token", "api_key_sha256"})
#: a URL's user and password (up to the last ``@``) and a password in its query string
_URL_SECRETS = re.compile(r"(?<=://).*(?=@)|(?<=password=)[^&\s]*", re.S)
#: a secret key and its value run together in one scalar: ``api_key:sk-...`` (no space after the
#: colon: YAML reads one string), a section's value or, in a flow mapping, a key
_INLINE_SECRETS = re.compile(r"((?:api_key|metrics_token)\s*[:=]\s*)\S+")


def _masked(text: str) -> str:
    """``text`` with a URL's credentials and an inline ``api_key:VALUE`` masked as ``***``."""
    return _INLINE_SECRETS.sub(r"\1***", _URL_SECRETS.sub("***", text))


def _shown(path: tuple[Any, ...], value: Any) -> str | None:
    """``repr(value)`` for an error line, with a URL's credentials and an inline ``api_key:VALUE``
    masked; ``None`` for a secret."""
    if _SECRET_KEYS.intersection(p for p in path if isinstance(p, str)):
        return None
    return repr(_masked(value) if isinstance(value, str) else value)


def _format_validation(
    err: ValidationError,
    lines: Mapping[tuple[Any, ...], int] | None = None,
    env_vars: Mapping[tuple[str, ...], str] | None = None,
) -> list[str]:
    """One line per problem: ``[line N: ]key.path: problem[ (got value)][ (from VARIABLE)]``.

    ``lines`` maps key paths to the line they are on in the file (the deepest known ancestor of
    the path is used); ``env_vars`` maps the key paths set by environment overrides to their
    variable names."""
    problems = []
    for e in err.errors(include_url=False):
        path = tuple(p for p in e["loc"] if p not in ("function-after",))
        loc = _masked(_loc(path))  # an unknown key `metrics_token:tok` (a flow mapping's typo) is one
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key (not a kvgate setting; check the spelling)"
        elif e["type"] == "value_error" and msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        if (
            "input" in e
            and e["type"] not in ("missing", "extra_forbidden")
            and not isinstance(e["input"], (dict, list))
            and (shown := _shown(path, e["input"])) is not None
        ):
            msg = f"{msg} (got {shown})"
        var = _env_source(path, msg, env_vars or {})
        if var:
            msg = f"{msg} (from {var})"
        line = None
        if lines and not var:
            for n in range(len(path), 0, -1):
                if path[:n] in lines:
                    line = lines[path[:n]]
                    break
        if not path and lines and not var and (m := _LEADING_PATH.match(msg)):
            line = lines.get(_parse_loc(m.group(1)))
        prefix = f"line {line}: " if line else ""
        problems.append(f"{prefix}{loc}: {msg}" if path else f"{prefix}{msg}")
    return problems


def _env_source(path: tuple[Any, ...], msg: str, env_vars: Mapping[tuple[str, ...], str]) -> str | None:
    """``environment variable NAME`` when the problem at ``path`` is in a value set by the
    environment: the variable that set ``path`` or a mapping above it, else, for a rule across the
    keys of the mapping at ``path`` (``pool: poll_interval_seconds (60) must be less than
    max_staleness_seconds (0.5)``), the variables that set the keys ``msg`` names."""
    var = next((v for p, v in env_vars.items() if path[: len(p)] == p), None)
    if var:
        return f"environment variable {var}"
    named = [
        v
        for p, v in env_vars.items()
        if path and len(p) == len(path) + 1 and p[:-1] == path and re.search(rf"\b{re.escape(p[-1])}\b", msg)
    ]
    return f"environment variable{'s' if len(named) > 1 else ''} {', '.join(named)}" if named else None


class _Loader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last silently).
    A key that overrides one of a merge (``<<: *base``) is not given twice: that is what merges are for."""


def _construct_mapping(loader: _Loader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            first = seen.get(key)
        except TypeError:  # unhashable key: construct_mapping reports it
            continue
        if first is not None:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first given on line {first + 1})", key_node.start_mark
            )
        seen[key] = key_node.start_mark.line
    loader.flatten_mapping(node)  # merged keys first: the mapping's own keys win
    return loader.construct_mapping(node, deep=True)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _line_map(
    node: yaml.Node | None,
    path: tuple[Any, ...] = (),
    out: dict[tuple[Any, ...], int] | None = None,
    seen: set[int] | None = None,
) -> dict[tuple[Any, ...], int]:
    """``{key path: 1-based line}`` for every mapping key and sequence item under ``node``. An
    aliased node (``*name``) is walked once, at its anchor: walking every alias of aliases (a
    "billion laughs" file) took time exponential in the file's length."""
    out = {} if out is None else out
    seen = set() if seen is None else seen
    if id(node) in seen:
        return out
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            if isinstance(key_node, yaml.ScalarNode):
                sub = (*path, key_node.value)
                out[sub] = key_node.start_mark.line + 1
                _line_map(value_node, sub, out, seen)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            sub = (*path, i)
            out[sub] = item.start_mark.line + 1
            _line_map(item, sub, out, seen)
    return out


def _parse(path: Path) -> tuple[dict[str, Any], dict[tuple[Any, ...], int]]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(str(path), [f"cannot read: {e.strerror or e}"]) from e
    except UnicodeDecodeError as e:
        raise ConfigError(str(path), [f"not UTF-8 text: {e.reason} at byte {e.start}"]) from e
    return _parse_text(text, path)


def _parse_text(text: str, path: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[tuple[Any, ...], int]]:
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
        lines = _line_map(node) if isinstance(data, dict) else {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(str(path), [f"invalid YAML: {where}{problem}"]) from e
    except RecursionError:  # PyYAML composes and constructs recursively: `[[[...` 300 deep was a traceback
        raise ConfigError(str(path), ["invalid YAML: lists or mappings nested too deeply to parse"]) from None
    finally:
        loader.dispose()
    if data is None:
        return {}, {}
    if not isinstance(data, dict):
        raise ConfigError(str(path), [f"(top level): expected a mapping of keys, got {type(data).__name__}"])
    return data, lines


def read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Parse a YAML mapping. Raises :class:`ConfigError` naming the file (and line) when it is
    unreadable, not YAML, not a mapping, or gives a key twice. An empty file is ``{}``."""
    return _parse(Path(path))[0]


def _union_args(annotation: Any) -> tuple[Any, ...]:
    return get_args(annotation) if get_origin(annotation) in (Union, types.UnionType) else (annotation,)


def _takes_text(model: type[BaseModel], parts: tuple[str, ...]) -> bool:
    """Whether ``parts`` names a field of ``model`` (through nested settings) that holds text only."""
    annotation: Any = model
    for part in parts:
        sub = next((a for a in _union_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if sub is None or part not in sub.model_fields:
            return False
        annotation = sub.model_fields[part].annotation
    args = [a for a in _union_args(annotation) if a is not type(None)]
    return bool(args) and all(a in (str, SecretStr) for a in args)


#: values a variable unsets its setting with (YAML's null, as every setting reads it; empty too)
_YAML_NULLS = frozenset(("", "null", "Null", "NULL", "~"))


def env_override_items(
    model: type[BaseModel], environ: Mapping[str, str] | None = None
) -> list[tuple[tuple[str, ...], str, Any]]:
    """``(key path, variable name, value)`` for each ``KVGATE_<SECTION>__<KEY>`` (or
    ``KVGATE_<KEY>``) variable whose first part is a field of ``model``, sorted by name.
    Values are parsed as YAML scalars/flow collections (``9000`` -> int, ``[a, b]`` -> list,
    ``null`` or the empty string -> ``None``); text that is not YAML stays a string. A field that
    holds only text (``redis_url``, ``gateway.metrics_token``, ``state_dir``) takes the value as it
    is, but for YAML's null: YAML read a token ``#x...`` as a comment (``None``: no token) and
    ``0123`` as a number."""
    environ = os.environ if environ is None else environ
    fields = set(model.model_fields)
    items = []
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX):
            continue
        parts = tuple(p.lower() for p in name[len(ENV_PREFIX) :].split("__"))
        if not parts[0] or parts[0] not in fields or not all(parts):
            continue
        raw = environ[name]
        try:
            if raw in _YAML_NULLS:
                value = None
            else:
                value = raw if _takes_text(model, parts) else yaml.safe_load(raw)
        except (yaml.YAMLError, RecursionError):  # `[[[...` nested too deep for PyYAML: text, as any non-YAML
            value = raw
        items.append((parts, name, value))
    return items


def _sections(model: type[BaseModel]) -> dict[str, type[BaseModel]]:
    """The fields of ``model`` that hold settings of their own (``gateway``, ``pool``, ...): the
    ``<SECTION>`` of ``KVGATE_<SECTION>__<KEY>``. A list of settings (``models``) is no section."""
    out: dict[str, type[BaseModel]] = {}
    for name, field in model.model_fields.items():
        sub = next((a for a in _union_args(field.annotation) if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if sub is not None:
            out[name] = sub
    return out


def _settings_spelt(model: type[BaseModel], words: list[str]) -> list[tuple[str, str]]:
    """Every setting of ``model`` that ``words`` (a name split at its underscores) spells exactly,
    as ``(key path, the variable that sets it)``: the top-level key ``"_".join(words)`` (not a
    section: ``KVGATE_GATEWAY__`` lacks its key), and each section and key of that section that
    ``words`` split in two make."""
    found = []
    whole = "_".join(words)
    sections = _sections(model)
    if whole in model.model_fields and whole not in sections:
        found.append((whole, ENV_PREFIX + whole.upper()))
    for i in range(1, len(words)):
        section, key = "_".join(words[:i]), "_".join(words[i:])
        if section in sections and key in sections[section].model_fields:
            found.append((f"{section}.{key}", f"{ENV_PREFIX}{section.upper()}__{key.upper()}"))
    return found


def env_name_problems(model: type[BaseModel], environ: Mapping[str, str] | None = None) -> list[str]:
    """One problem line per ``KVGATE_`` variable that :func:`env_override_items` does not read but
    that is meant as a setting, sorted by name: its name, underscores aside, spells a setting
    exactly (``KVGATE_GATEWAY_PORT``, ``KVGATE_POOL_HEADROOM``: one underscore between section and
    key; ``KVGATE_REDIS__URL``; ``KVGATE_GATEWAY____PORT``), or it starts with a setting but has an
    empty part (``KVGATE_GATEWAY____NOPE``). The line names the variable and the spelling that is
    read. Every other variable (``KVGATE_FAULTS``, ``KVGATE_CONFIG``, ``KVGATE_SECRET_ADMIN_KEY``)
    is no setting and no problem; a variable that is read and names a key its section lacks
    (``KVGATE_GATEWAY__PROT``) is refused by validation (``gateway.prot: unknown key``)."""
    environ = os.environ if environ is None else environ
    problems = []
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX):
            continue
        rest = name[len(ENV_PREFIX) :].lower()
        parts = rest.split("__")
        if parts[0] in model.model_fields and all(parts):
            continue  # read by env_override_items
        spelt = _settings_spelt(model, [w for w in rest.split("_") if w])
        if len(spelt) == 1:
            path, good = spelt[0]
            how = "a top-level key is KVGATE_<KEY>" if "." not in path else "two underscores between section and key"
            problems.append(f"{path}: environment variable {name} is not read: write {good} ({how})")
        elif spelt:  # a section and a top-level key, or two sections, whose names share words
            goods = " or ".join(f"{good} ({path})" for path, good in spelt)
            problems.append(f"environment variable {name} is not read: write {goods}")
        elif parts[0] in model.model_fields:
            problems.append(
                f"{parts[0]}: environment variable {name} is not read: a part between its double underscores is "
                "empty (KVGATE_<SECTION>__<KEY>, or KVGATE_<KEY> for a top-level key)"
            )
    return problems


def env_overrides(model: type[BaseModel], environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Collect ``KVGATE_<SECTION>__<KEY>`` overrides that name fields of ``model``, as a nested dict."""
    out: dict[str, Any] = {}
    for parts, _, value in env_override_items(model, environ):
        node = out
        for p in parts[:-1]:
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):  # a scalar override of the section itself wins
                break
            node = nxt
        else:
            node[parts[-1]] = value
    return out


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(merged.get(k), dict):
            merged[k] = _merge(merged[k], v)
        else:
            merged[k] = v
    return merged


def validate_yaml_text(text: str, model: type[M], source: str | os.PathLike[str]) -> M:
    """Validate ``text`` as the file ``source`` would be by :func:`load_yaml_model` (no environment),
    before it is written there. Raises :class:`ConfigError` as it does."""
    data, lines = _parse_text(text, source)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ConfigError(str(source), _format_validation(e, lines)) from None


def load_yaml_model(
    path: str | os.PathLike[str], model: type[M], *, use_env: bool = False, environ: Mapping[str, str] | None = None
) -> M:
    """Read ``path`` and validate it as ``model``; with ``use_env``, apply environment overrides.

    Raises :class:`ConfigError` naming the file and, for every problem, its line, key path and,
    for a value set by the environment, the variable; with ``use_env``, also a variable meant as a
    setting but misspelt so that it is not read (:func:`env_name_problems`).
    """
    data, lines = _parse(Path(path))
    env_vars: dict[tuple[str, ...], str] = {}
    problems: list[str] = []
    if use_env:
        problems = env_name_problems(model, environ)
        over = env_overrides(model, environ)
        if over:
            data = _merge(data, over)
            env_vars = {parts: name for parts, name, _ in env_override_items(model, environ)}
    try:
        loaded = model.model_validate(data)
    except ValidationError as e:
        problems += _format_validation(e, lines, env_vars)
    if problems:
        raise ConfigError(str(path), problems)
    return loaded


def load_settings(path: str | os.PathLike[str] | None = None, *, environ: Mapping[str, str] | None = None) -> Settings:
    """Load ``kvgate.yaml`` (default: the one beside this module, ``config/kvgate.yaml``) with env overrides.
    ``KVGATE_CONFIG`` names the file when ``path`` is ``None``."""
    env = os.environ if environ is None else environ
    path = path or env.get("KVGATE_CONFIG") or DEFAULT_CONFIG
    return load_yaml_model(path, Settings, use_env=True, environ=env)


def load_tenants(path: str | os.PathLike[str] | None = None) -> TenantsFile:
    """Load ``tenants.yaml`` (default beside this module; ``KVGATE_TENANTS`` names another)."""
    path = path or os.environ.get("KVGATE_TENANTS") or DEFAULT_TENANTS
    return load_yaml_model(path, TenantsFile)


def check_tenant_models(settings: Settings, tenants: TenantsFile, source: str | os.PathLike[str] = "tenants") -> None:
    """Cross-file check: every tenant's ``allowed_models`` entry is a model id or alias of
    ``settings``. Raises :class:`ConfigError` (source: the tenants file) listing each unknown one
    as ``tenants[i].allowed_models[j]: unknown model 'x'``."""
    problems = []
    for i, t in enumerate(tenants.tenants):
        for j, name in enumerate(t.allowed_models):
            if settings.model_by_name(name) is None:
                problems.append(
                    f"tenants[{i}].allowed_models[{j}]: unknown model '{name}' "
                    "(not the id or an alias of any model in the settings)"
                )
    if problems:
        raise ConfigError(str(source), problems)


def served_tenants(settings: Settings, tenants: TenantsFile) -> tuple[TenantsFile, list[str]]:
    """The lenient form of :func:`check_tenant_models`, for a stack that serves only some models.

    Returns ``(kept, notes)``: ``kept`` holds, in file order, every tenant whose ``allowed_models``
    is empty (every model) or names a model of ``settings``; a tenant's entries that name no model
    of ``settings`` are dropped from its list. A tenant none of whose entries is known is left out
    (never kept with an empty list, which would mean every model). ``notes``: one line per tenant
    left out or narrowed. Raises nothing."""
    kept = []
    notes = []
    for t in tenants.tenants:
        known = [n for n in t.allowed_models if settings.model_by_name(n) is not None]
        unknown = [n for n in t.allowed_models if settings.model_by_name(n) is None]
        if not unknown:
            kept.append(t)
        elif known:
            kept.append(t.model_copy(update={"allowed_models": known}))
            notes.append(f"tenant {t.id}: allowed {', '.join(unknown)} not served by this stack; those ignored")
        else:
            notes.append(f"tenant {t.id}: allowed only {', '.join(unknown)}, not served by this stack; left out")
    return tenants.model_copy(update={"tenants": kept}), notes
