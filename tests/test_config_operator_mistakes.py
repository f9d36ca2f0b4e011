"""Operator mistakes the settings loader used to accept in silence: an environment override
misspelt so that it was never read (``KVGATE_GATEWAY_PORT=9000``: one underscore, and the gateway
listened on 8080), a pool poll interval no shorter than the pool's staleness bound (every
reading stale before the next poll: admission and /readyz 503 between polls), and a chat model
counted by SGLang's /v1/tokenize, which takes no messages (every chat a 502 while /readyz said 200:
the Helm chart's minimal example did it)."""

from __future__ import annotations

import argparse
import os
import textwrap
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError

from config import ConfigError, Settings, load_settings
from config.loader import DEFAULT_CONFIG, env_name_problems, env_overrides
from config.models import PoolSettings

STALE = (
    "every reading would go stale before the next poll, and admission and /readyz would fail "
    "with 503 pool_size_unknown between polls"
)

#: every KVGATE_ variable the project reads that is no setting (gateway/, config/, gpu_backend/,
#: verifier/, tokenizer/, scripts/, docker/, deploy/, bench/, tests/): each stays accepted and ignored
NOT_SETTINGS = [
    "KVGATE_BENCH_REDIS_URL",
    "KVGATE_CONFIG",
    "KVGATE_E2E_CACHE",
    "KVGATE_E2E_DATA_ROOT",
    "KVGATE_E2E_MIRROR",
    "KVGATE_E2E_SUITE",
    "KVGATE_E2E_TORCH_INDEX_URL",
    "KVGATE_FAULTS",
    "KVGATE_LISTEN_FD",
    "KVGATE_PUBLISH_HOST",
    "KVGATE_PUBLISH_PORT",
    "KVGATE_SECRET_ADMIN_KEY",
    "KVGATE_SECRET_CACHE_SALT_KEY",
    "KVGATE_SECRET_LEAK_INDEX_KEY",
    "KVGATE_STATE_DIR_FOR_TESTS",
    "KVGATE_SUPERVISOR_PID",
    "KVGATE_TENANTS",
    "KVGATE_TEST_REDIS_PORT",
    "KVGATE_TEST_STATE_DIR",
    "KVGATE_TORCH",
    "KVGATE_TORCH_CPU_INDEX",
    "KVGATE_TORCH_INDEX_URL",
    "KVGATE_TORCH_VERSION",
    "KVGATE_UNPINNED",
]


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "kvgate.yaml"
    p.write_text(textwrap.dedent(text), encoding="utf-8")
    return p


def problems(path: Path, environ: dict[str, str]) -> str:
    with pytest.raises(ConfigError) as ei:
        load_settings(path, environ=environ)
    assert ei.value.source == str(path)
    return str(ei.value)


# ---------------------------------------------------------------- misspelt environment overrides
@pytest.mark.parametrize(
    ("var", "path", "good"),
    [
        ("KVGATE_GATEWAY_PORT", "gateway.port", "KVGATE_GATEWAY__PORT"),
        ("KVGATE_POOL_HEADROOM", "pool.headroom", "KVGATE_POOL__HEADROOM"),
        ("KVGATE_QUOTAS_ENABLED", "quotas.enabled", "KVGATE_QUOTAS__ENABLED"),
        (
            "KVGATE_VERIFIER_PROBE_INTERVAL_SECONDS",
            "verifier.probe_interval_seconds",
            "KVGATE_VERIFIER__PROBE_INTERVAL_SECONDS",
        ),
        ("KVGATE_BACKEND_SEED", "backend.seed", "KVGATE_BACKEND__SEED"),
        # stray underscores: an empty part, or one before the section
        ("KVGATE_GATEWAY____PORT", "gateway.port", "KVGATE_GATEWAY__PORT"),
        ("KVGATE__GATEWAY__PORT", "gateway.port", "KVGATE_GATEWAY__PORT"),
        ("KVGATE_GATEWAY__PORT__", "gateway.port", "KVGATE_GATEWAY__PORT"),
    ],
)
def test_a_section_key_misspelt_is_refused_naming_the_spelling_that_is_read(tmp_path, var, path, good):
    p = write(tmp_path, "gateway:\n  port: 8080\n")
    assert problems(p, {var: "9000"}) == (
        f"{p}: {path}: environment variable {var} is not read: write {good} (two underscores between section and key)"
    )


@pytest.mark.parametrize(("var", "good"), [("KVGATE_REDIS__URL", "redis_url"), ("KVGATE_STATE__DIR", "state_dir")])
def test_a_top_level_key_split_by_two_underscores_is_refused(tmp_path, var, good):
    p = write(tmp_path, "")
    assert problems(p, {var: "x"}) == (
        f"{p}: {good}: environment variable {var} is not read: write KVGATE_{good.upper()} "
        "(a top-level key is KVGATE_<KEY>)"
    )


def test_an_empty_part_after_a_section_is_refused(tmp_path):
    """Read as ``gateway`` with an empty key, it was dropped; with no setting to point to, the
    message says what is wrong and the two shapes."""
    p = write(tmp_path, "")
    tail = (
        "is not read: a part between its double underscores is empty "
        "(KVGATE_<SECTION>__<KEY>, or KVGATE_<KEY> for a top-level key)"
    )
    assert problems(p, {"KVGATE_GATEWAY__": "1"}) == f"{p}: gateway: environment variable KVGATE_GATEWAY__ {tail}"
    assert problems(p, {"KVGATE_GATEWAY____NOPE": "1"}) == (
        f"{p}: gateway: environment variable KVGATE_GATEWAY____NOPE {tail}"
    )


def test_a_key_its_section_lacks_is_refused_naming_the_variable(tmp_path):
    """``KVGATE_GATEWAY__NOPE`` is read (its section exists) and refused as a file's unknown key is."""
    p = write(tmp_path, "")
    assert problems(p, {"KVGATE_GATEWAY__NOPE": "1"}) == (
        f"{p}: gateway.nope: unknown key (not a kvgate setting; check the spelling) "
        "(from environment variable KVGATE_GATEWAY__NOPE)"
    )


def test_every_misspelt_variable_is_named_in_one_error_with_the_files_problems(tmp_path):
    p = write(tmp_path, "gateway:\n  port: eighty\n")
    env = {"KVGATE_POOL_HEADROOM": "2", "KVGATE_GATEWAY_PORT": "9000", "KVGATE_FAULTS": "x"}
    assert problems(p, env).splitlines() == [
        f"{p}: gateway.port: environment variable KVGATE_GATEWAY_PORT is not read: write KVGATE_GATEWAY__PORT "
        "(two underscores between section and key)",
        f"{p}: pool.headroom: environment variable KVGATE_POOL_HEADROOM is not read: write KVGATE_POOL__HEADROOM "
        "(two underscores between section and key)",
        f"{p}: line 2: gateway.port: Input should be a valid integer, unable to parse string as an integer "
        "(got 'eighty')",
    ]


def test_legitimate_variables_of_each_kind_still_work(tmp_path):
    p = write(tmp_path, "gateway:\n  port: 8080\n")
    env = {
        "KVGATE_GATEWAY__PORT": "9000",  # a section's key
        "KVGATE_POOL__MAX_STALENESS_SECONDS": "40",  # a key with underscores
        "KVGATE_REDIS_URL": "redis://127.0.0.1:6379/5",  # a top-level key with an underscore
        "KVGATE_STATE_DIR": str(tmp_path / "state"),
        "KVGATE_MODELS": "[{id: m, context_length: 4096}]",  # a list, whole
        **{name: "1" for name in NOT_SETTINGS},  # not settings: accepted, ignored
        "KVGATE_GATEWAY_NOT_A_KEY": "1",  # a section, but no key of it: no setting spelt, ignored
        "KVGATE_": "1",
        "OTHER_GATEWAY_PORT": "1",
    }
    s = load_settings(p, environ=env)
    assert (s.gateway.port, s.pool.max_staleness_seconds, s.redis_url) == (9000, 40.0, "redis://127.0.0.1:6379/5")
    assert (s.state_dir, [m.id for m in s.models]) == (str(tmp_path / "state"), ["m"])
    assert env_name_problems(Settings, env) == []
    assert env_overrides(Settings, {name: "1" for name in NOT_SETTINGS}) == {}


def test_kvgate_serve_refuses_a_misspelt_variable_in_its_environment(tmp_path, capsys, monkeypatch):
    """Through ``kvgate serve`` (``load_settings(args.config)``, the process environment)."""
    from gateway.commands import serve

    for k in [k for k in os.environ if k.startswith("KVGATE_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("KVGATE_GATEWAY_PORT", "9000")
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(["--config", str(DEFAULT_CONFIG), "--tenants", str(tmp_path / "tenants.yaml")])
    assert serve.run(args) == 2
    assert capsys.readouterr().err == (
        f"kvgate serve: {DEFAULT_CONFIG}: gateway.port: environment variable KVGATE_GATEWAY_PORT is not read: "
        "write KVGATE_GATEWAY__PORT (two underscores between section and key)\n"
    )
    monkeypatch.delenv("KVGATE_GATEWAY_PORT")
    monkeypatch.setenv("KVGATE_GATEWAY__PORT", "9000")
    assert load_settings().gateway.port == 9000  # the process environment, as serve reads it


class _Sub(BaseModel):
    b_c: int = 0
    c: int = 0


class _Ambiguous(BaseModel):
    """Names that share words: a section ``a`` with a key ``b_c``, a section ``a_b`` with a key
    ``c``, a top-level key ``a_b_d``, and a section ``x`` with a key ``y`` beside a top-level ``x_y``."""

    a: _Sub = _Sub()
    a_b: _Sub = _Sub()
    a_b_d: int = 0
    x: _Sub = _Sub()
    x_y: int = 0


def test_names_sharing_words_resolve_to_what_is_read_or_name_every_reading():
    # a top-level key is read as itself, never as a section's misspelt key
    assert env_name_problems(_Ambiguous, {"KVGATE_A_B_D": "1", "KVGATE_X_Y": "1"}) == []
    assert env_overrides(_Ambiguous, {"KVGATE_A_B_D": "1", "KVGATE_X_Y": "1"}) == {"a_b_d": 1, "x_y": 1}
    # a_b is a section: KVGATE_A_B__C is read (a_b.c), and so is KVGATE_A__B_C (a.b_c)
    assert env_name_problems(_Ambiguous, {"KVGATE_A_B__C": "1", "KVGATE_A__B_C": "1"}) == []
    # one underscore throughout: both readings are settings, both are named
    assert env_name_problems(_Ambiguous, {"KVGATE_A_B_C": "1"}) == [
        "environment variable KVGATE_A_B_C is not read: write KVGATE_A__B_C (a.b_c) or KVGATE_A_B__C (a_b.c)"
    ]


# ---------------------------------------------------------------- pool: poll before stale
def test_a_poll_interval_not_below_the_staleness_bound_is_refused():
    assert PoolSettings(poll_interval_seconds=4.99, max_staleness_seconds=5).poll_interval_seconds == 4.99
    for poll in (5, 5.01, 60):
        with pytest.raises(ValidationError) as ei:
            PoolSettings(poll_interval_seconds=poll, max_staleness_seconds=5)
        assert ei.value.errors()[0]["msg"] == (
            f"Value error, poll_interval_seconds ({poll}) must be less than max_staleness_seconds (5): {STALE}"
        )
    # the request timeout is not in the rule: a staleness bound below interval + timeout is how a
    # hung pool read fails closed before its timeout
    assert PoolSettings(poll_interval_seconds=1, max_staleness_seconds=2, request_timeout_seconds=10)


@pytest.mark.parametrize(
    ("pool", "line", "values"),
    [
        ("pool:\n  poll_interval_seconds: 30\n", 3, "(30) must be less than max_staleness_seconds (30)"),
        (
            "pool:\n  poll_interval_seconds: 60\n  max_staleness_seconds: 0.5\n",
            3,
            "(60) must be less than max_staleness_seconds (0.5)",
        ),
    ],
)
def test_the_loader_refuses_it_naming_the_file_and_line(tmp_path, pool, line, values):
    p = write(tmp_path, "gateway:\n  port: 8080\n" + pool)
    assert problems(p, {}) == f"{p}: line {line}: pool: poll_interval_seconds {values}: {STALE}"


def test_the_loader_accepts_just_below_and_names_the_variables_that_broke_it(tmp_path):
    p = write(tmp_path, "pool:\n  poll_interval_seconds: 5\n  max_staleness_seconds: 5.5\n")
    assert load_settings(p, environ={}).pool.poll_interval_seconds == 5
    assert problems(p, {"KVGATE_POOL__MAX_STALENESS_SECONDS": "5"}) == (
        f"{p}: pool: poll_interval_seconds (5) must be less than max_staleness_seconds (5): {STALE} "
        "(from environment variable KVGATE_POOL__MAX_STALENESS_SECONDS)"
    )
    env = {"KVGATE_POOL__POLL_INTERVAL_SECONDS": "9", "KVGATE_POOL__MAX_STALENESS_SECONDS": "8"}
    env["KVGATE_POOL__HEADROOM"] = "2"  # not in the rule: not named
    assert problems(p, env) == (
        f"{p}: pool: poll_interval_seconds (9) must be less than max_staleness_seconds (8): {STALE} "
        "(from environment variables KVGATE_POOL__MAX_STALENESS_SECONDS, KVGATE_POOL__POLL_INTERVAL_SECONDS)"
    )


def test_the_shipped_settings_poll_well_before_stale():
    s = load_settings(environ={})
    assert (s.pool.poll_interval_seconds, s.pool.max_staleness_seconds) == (5, 30)
    assert Settings().pool.poll_interval_seconds < Settings().pool.max_staleness_seconds


# ---------------------------------------------------------------- chats counted by SGLang's /v1/tokenize
SGLANG_CHATS = (
    "models[0].tokenizer: model 'llama' serves chats (task: chat), but kind 'engine' with engine_api 'sglang' "
    "asks SGLang's /v1/tokenize, which takes no messages: every chat request would answer 502 "
    "upstream_unavailable. Count it with the model's own tokenizer files (kind: hf, path: a folder with its "
    "tokenizer.json and tokenizer_config.json) or with vLLM's /tokenize (engine_api: vllm, url: a vLLM server "
    "of the model)"
)
SGLANG_MODEL = """\
models:
  - id: llama
    context_length: 8192
    tokenizer:
      kind: engine
      url: http://sglang.llm.svc:30000
      engine_api: sglang
upstreams:
  - name: sglang
    api_url: http://sglang.llm.svc:30000/v1
    pool_source: sglang
    pool_urls: [http://sglang.llm.svc:30000/server_info]
    models: [llama]
"""


@pytest.mark.parametrize(
    "change",
    [
        {},
        {"      engine_api: sglang\n": ""},  # sglang is engine_api's default
        {"    context_length: 8192\n": "    context_length: 8192\n    task: chat\n"},
        # the tokenizer's URL is no upstream's: the model's upstreams say which engine answers
        {"      url: http://sglang.llm.svc:30000\n": "      url: http://sglang-tok.llm.svc:30000\n"},
        # the url's upstream is SGLang, also named by engine rather than pool_source
        {"    pool_source: sglang\n": "    pool_source: static\n    static_pool_tokens: 8192\n    engine: sglang\n"},
    ],
)
def test_a_chat_model_counted_by_sglangs_tokenize_is_refused(tmp_path, change):
    text = SGLANG_MODEL
    for old, new in change.items():
        assert old in text
        text = text.replace(old, new)
    line = text.splitlines().index("    tokenizer:") + 1  # the key path's line
    assert problems(write(tmp_path, text), {}) == f"{tmp_path / 'kvgate.yaml'}: line {line}: {SGLANG_CHATS}"


def test_upstreams_from_the_environment_count_too(tmp_path):
    """The Helm chart passes upstreams with an engine key through ``KVGATE_UPSTREAMS``."""
    p = write(tmp_path, SGLANG_MODEL.replace("pool_source: sglang", "pool_source: vllm"))
    assert load_settings(p, environ={}).models[0].tokenizer.engine_api == "sglang"  # vLLM there: not SGLang's
    ups = '[{"name": "s", "api_url": "http://sglang.llm.svc:30000/v1", "pool_source": "sglang", "pool_urls": ["x"], '
    ups += '"models": ["llama"]}]'
    assert problems(p, {"KVGATE_UPSTREAMS": ups}) == f"{p}: line 4: {SGLANG_CHATS}"


@pytest.mark.parametrize(
    "change",
    [
        # the bundled backend's router takes messages on /v1/tokenize (the Helm chart's backend model)
        {"    pool_source: sglang\n": "    pool_source: kvgate\n"},
        {"engine_api: sglang": "engine_api: vllm"},  # vLLM's /tokenize renders chats
        {
            "      kind: engine\n      url: http://sglang.llm.svc:30000\n      engine_api: sglang\n": (
                "      kind: hf\n      path: /models/llama\n"
            )
        },
        {"    context_length: 8192\n": "    context_length: 8192\n    task: embedding\n"},  # no chats
        # a URL that is no upstream's and a model no SGLang upstream serves: nothing says SGLang
        {
            "      url: http://sglang.llm.svc:30000\n": "      url: http://tok.llm.svc:30000\n",
            "models: [llama]": "models: []",
        },
    ],
)
def test_chats_counted_elsewhere_load(tmp_path, change):
    text = SGLANG_MODEL
    for old, new in change.items():
        assert old in text
        text = text.replace(old, new)
    assert load_settings(write(tmp_path, text), environ={}).models[0].id == "llama"


def test_kvgate_serve_exits_2_naming_it(tmp_path, capsys, monkeypatch):
    """At start, before any request: the pod's log says why, where /readyz used to say 200."""
    from gateway.commands import serve

    for k in [k for k in os.environ if k.startswith("KVGATE_")]:
        monkeypatch.delenv(k)
    p = write(tmp_path, SGLANG_MODEL)
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    assert serve.run(parser.parse_args(["--config", str(p), "--tenants", str(tmp_path / "tenants.yaml")])) == 2
    assert capsys.readouterr().err == f"kvgate serve: {p}: line 4: {SGLANG_CHATS}\n"


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("http://[::1", "Invalid IPv6 URL"),
        ("http://127.0.0.1:99999", "must have a port from 0 to 65535 (or none)"),
        ("http://vllm.llm.svc:8OOO", "must have a port from 0 to 65535 (or none)"),
        ("grpc://vllm.llm.svc:8000", "must be an http:// or https:// URL with a host"),
        ("http://user:secret@vllm.llm.svc:8000", "must not hold credentials: put the engine's key in 'api_key'"),
    ],
)
@pytest.mark.parametrize("where", ["api_url", "tokenizer url"])
def test_an_engine_url_no_request_could_reach_is_refused_naming_its_line(tmp_path, url, problem, where):
    """An upstream's ``api_url`` or an engine tokenizer's ``url`` that is no http(s) URL with a
    host, a port from 0 to 65535 and no credentials is refused at load, naming the key's line.
    Before, a port out of range or not a number, or a tokenizer URL of another scheme, loaded,
    and every request counted or forwarded to it failed."""
    text = SGLANG_MODEL.replace("engine_api: sglang", "engine_api: vllm")
    key = "    api_url: " if where == "api_url" else "      url: "
    old = next(line for line in text.splitlines() if line.startswith(key))
    text = text.replace(old, key + url)
    line = text.splitlines().index(key + url) + 1
    path = "upstreams[0].api_url" if where == "api_url" else "models[0].tokenizer.url"
    got = problems(write(tmp_path, text), {})
    shown = url.replace("user:secret@", "***@")  # the loader never echoes credentials
    assert got == f"{tmp_path / 'kvgate.yaml'}: line {line}: {path}: {problem} (got {shown!r})"
