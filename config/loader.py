"""Load :class:`~config.models.Settings` and :class:`~config.models.TenantsFile` from YAML.

Errors name the file, the key path and the problem, e.g.::

    config/kvgate.yaml: gateway.port: Input should be a valid integer (got 'eighty')

Environment overrides (DESIGN.md, Contracts): ``KVGATE_<SECTION>__<KEY>=value`` sets
``section.key`` (values parsed as YAML scalars, so ``8081`` is an int and ``[a, b]`` a list);
a top-level key is ``KVGATE_<KEY>`` (e.g. ``KVGATE_REDIS_URL``). Variables whose first part is not
a settings key (``KVGATE_FAULTS``, ``KVGATE_CONFIG``) are not settings and are left alone.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from config.models import Settings, TenantsFile

DEFAULT_DIR = Path(__file__).resolve().parent
DEFAULT_CONFIG = DEFAULT_DIR / "kvgate.yaml"
DEFAULT_TENANTS = DEFAULT_DIR / "tenants.yaml"
ENV_PREFIX = "KVGATE_"

M = TypeVar("M", bound=BaseModel)


class ConfigError(ValueError):
    """A configuration file (or environment override) is wrong. ``str()`` names the source,
    the key path and the problem; ``source`` is the file path or ``"environment"``."""

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


def _format_validation(err: ValidationError) -> list[str]:
    problems = []
    for e in err.errors(include_url=False):
        loc = _loc(tuple(p for p in e["loc"] if p not in ("function-after",)))
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key (not a kvgate setting; check the spelling)"
        elif "input" in e and e["type"] not in ("missing",) and not isinstance(e["input"], (dict, list)):
            msg = f"{msg} (got {e['input']!r})"
        problems.append(f"{loc}: {msg}")
    return problems


def read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Parse a YAML mapping. Raises :class:`ConfigError` naming the file (and line) when it is
    unreadable, not YAML, or not a mapping. An empty file is ``{}``."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(str(p), [f"cannot read: {e.strerror or e}"]) from e
    except UnicodeDecodeError as e:
        raise ConfigError(str(p), [f"not UTF-8 text: {e.reason} at byte {e.start}"]) from e
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(str(p), [f"invalid YAML: {where}{problem}"]) from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(str(p), [f"(top level): expected a mapping of keys, got {type(data).__name__}"])
    return data


def env_overrides(model: type[BaseModel], environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Collect ``KVGATE_<SECTION>__<KEY>`` overrides that name fields of ``model``, as a nested dict."""
    environ = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    fields = set(model.model_fields)
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX):
            continue
        parts = [p.lower() for p in name[len(ENV_PREFIX):].split("__")]
        if not parts[0] or parts[0] not in fields:
            continue
        try:
            value = yaml.safe_load(raw) if raw != "" else None
        except yaml.YAMLError:
            value = raw
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                break
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


def load_yaml_model(path: str | os.PathLike[str], model: type[M], *, use_env: bool = False,
                    environ: Mapping[str, str] | None = None) -> M:
    """Read ``path`` and validate it as ``model``; with ``use_env``, apply environment overrides.

    Raises :class:`ConfigError` naming the file and the key path of every problem.
    """
    data = read_yaml(path)
    source = str(path)
    if use_env:
        over = env_overrides(model, environ)
        if over:
            data = _merge(data, over)
            source = f"{path} (with KVGATE_* environment overrides)"
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ConfigError(source, _format_validation(e)) from None


def load_settings(path: str | os.PathLike[str] | None = None, *,
                  environ: Mapping[str, str] | None = None) -> Settings:
    """Load ``kvgate.yaml`` (default: the embedded stack's, beside this module) with env overrides.
    ``KVGATE_CONFIG`` names the file when ``path`` is ``None``."""
    env = os.environ if environ is None else environ
    path = path or env.get("KVGATE_CONFIG") or DEFAULT_CONFIG
    return load_yaml_model(path, Settings, use_env=True, environ=env)


def load_tenants(path: str | os.PathLike[str] | None = None) -> TenantsFile:
    """Load ``tenants.yaml`` (default beside this module; ``KVGATE_TENANTS`` names another)."""
    path = path or os.environ.get("KVGATE_TENANTS") or DEFAULT_TENANTS
    return load_yaml_model(path, TenantsFile)
