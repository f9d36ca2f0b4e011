"""One error protocol (docs/design.md, "Error bodies", "Contracts: Errors"): every kvgate error family
carries ``status``, ``code`` and ``to_openai()``; one mapper turns any of them into the OpenAI
shape; every code kvgate sets is a member of ``config.errors.ErrorCode`` (no string literals)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from conftest import ROOT

from config.errors import ErrorCode, ErrorLike, OpenAIError, as_openai_error
from gpu_backend import errors as engine_errors
from tokenizer import errors as tokenizer_errors

PACKAGES = ("config", "tokenizer", "verifier", "gateway", "gpu_backend")


def code_literals(path: Path) -> list[tuple[int, str]]:
    """``(line, value)`` of every string literal given as an error code in ``path``: a
    ``code=...`` keyword, an assignment to a name or attribute ``code``, a ``"code": ...`` dict
    entry, and either branch of a conditional expression in those places."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    values: list[ast.expr] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "code":
            values.append(node.value)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [
                t.id if isinstance(t, ast.Name) else t.attr if isinstance(t, ast.Attribute) else "" for t in targets
            ]
            if "code" in names and node.value is not None:
                values.append(node.value)
        elif isinstance(node, ast.Dict):
            for k, v in zip(node.keys, node.values, strict=True):
                if isinstance(k, ast.Constant) and k.value == "code":
                    values.append(v)
    out = []
    while values:
        v = values.pop()
        if isinstance(v, ast.IfExp):
            values += [v.body, v.orelse]
        elif isinstance(v, ast.Constant) and isinstance(v.value, str):
            out.append((v.lineno, v.value))
    return out


def test_no_error_code_is_a_string_literal():
    members = ErrorCode.members()
    literal, unknown = [], []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for line, value in code_literals(path):
                if value not in members:
                    unknown.append(f"{rel}:{line}: {value!r} is not an ErrorCode value")
                else:
                    literal.append(f"{rel}:{line}: {value!r} spelled as a literal, not ErrorCode")
    assert unknown == [] and literal == []


def test_no_function_takes_an_error_code_positionally():
    """The scan above sees a code passed as ``code=``; a parameter ``code`` that may be passed by
    position would hide a literal from it (the edge's refusals passed theirs so, and six of their
    codes were no ErrorCode member). Every function's ``code`` is keyword-only."""
    positional = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    if "code" in [a.arg for a in node.args.posonlyargs + node.args.args]:
                        positional.append(f"{path.relative_to(ROOT).as_posix()}:{node.lineno} {node.name}")
    assert positional == []


def test_code_scanner_sees_every_spelling(tmp_path):
    """Control: keyword, class attribute, dict entry and conditional spellings are all found;
    ErrorCode members and engine-supplied variables are not literals."""
    src = tmp_path / "m.py"
    src.write_text(
        "class E:\n    code = 'a'\n"
        "x = f(code='b')\n"
        "y = {'code': 'c' if ok else None}\n"
        "z = f(code=ErrorCode.NOT_FOUND)\n"
        "w = f(code=raw_code)\n",
        encoding="utf-8",
    )
    assert sorted(code_literals(src)) == [(2, "a"), (3, "b"), (4, "c")]


def _subclasses(cls: type) -> list[type]:
    out = [cls]
    for sub in cls.__subclasses__():
        out += _subclasses(sub)
    return out


#: how to build an error whose constructor is not ``(message, param)``
SPECIAL = {
    engine_errors.PromptTooLongError: lambda: engine_errors.PromptTooLongError(30, 20),
    tokenizer_errors.InvalidTokenIdError: lambda: tokenizer_errors.InvalidTokenIdError(-1, 10, "prompt[1]"),
    tokenizer_errors.UnknownContentPartError: lambda: tokenizer_errors.UnknownContentPartError("x", "messages[0]"),
    OpenAIError: lambda: OpenAIError(429, "m", code=ErrorCode.RATE_LIMIT_EXCEEDED),
}
FAMILIES = [*_subclasses(engine_errors.EngineError), *_subclasses(tokenizer_errors.TokenizerError), OpenAIError]


@pytest.mark.parametrize("cls", FAMILIES, ids=[c.__name__ for c in FAMILIES])
def test_every_error_family_follows_the_protocol(cls):
    err = SPECIAL[cls]() if cls in SPECIAL else cls("m", param="p")
    assert isinstance(err, ErrorLike)
    assert isinstance(err.status, int) and 400 <= err.status <= 599
    assert err.code in ErrorCode.members()
    o = err.to_openai()
    assert isinstance(o, OpenAIError) and as_openai_error(err) == o
    assert (o.status, o.code, o.message) == (err.status, err.code, err.message)
    body = o.body()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["code"] == err.code
    if err.status >= 500:
        assert body["type"] == "server_error"


def test_tokenizer_errors_map_as_the_gateway_answers():
    e = tokenizer_errors.UnknownContentPartError("input_audio", "messages[0].content[1].type").to_openai()
    assert (e.status, e.code, e.param) == (400, ErrorCode.INVALID_REQUEST, "messages[0].content[1].type")
    e = tokenizer_errors.EngineTokenizeError("engine tokenize answered 500", "messages").to_openai()
    assert (e.status, e.code, e.param) == (502, ErrorCode.UPSTREAM_UNAVAILABLE, None)  # the engine's fault: no field


def test_mapper_leaves_foreign_exceptions_to_the_caller():
    assert as_openai_error(ValueError("x")) is None
    assert as_openai_error(KeyError("x")) is None


def test_gateway_app_answers_every_family_through_the_mapper():
    """An ErrorLike error escaping a route is answered with its own status and OpenAI body (a
    TokenizerError too, e.g. from a route that counts), any other exception with a bare 500."""
    from starlette.testclient import TestClient

    from gateway.app import create_app
    from tests.gateway_harness import SECRETS, closed_port_url, settings_for, tenants, upstream

    app = create_app(
        settings_for([upstream("u1", api_url=closed_port_url(), pool_urls=[closed_port_url() + "/server_info"])]),
        tenants(),
        secrets=SECRETS,
    )
    raised = {
        "/t/engine": tokenizer_errors.EngineTokenizeError("engine tokenize answered 500", "messages"),
        "/t/prompt": tokenizer_errors.InvalidPromptError("'prompt' must be a string", "prompt[3]"),
        "/t/openai": OpenAIError(429, "slow down", code=ErrorCode.RATE_LIMIT_EXCEEDED, headers={"Retry-After": "2"}),
        "/t/bug": KeyError("internal detail"),
    }

    def route_for(exc):
        async def route(request):
            raise exc

        return route

    for path, exc in raised.items():
        app.router.add_route(path, route_for(exc), methods=["GET"])
    with TestClient(app, raise_server_exceptions=False) as c:
        r = c.get("/t/engine")
        assert (r.status_code, r.json()) == (
            502,
            {
                "error": {
                    "message": tokenizer_errors.EngineTokenizeError.CLIENT_MESSAGE,  # the detail is logged
                    "type": "server_error",
                    "param": None,
                    "code": "upstream_unavailable",
                }
            },
        )
        r = c.get("/t/prompt")
        assert (r.status_code, r.json()["error"]["param"], r.json()["error"]["code"]) == (
            400,
            "prompt[3]",
            "invalid_request",
        )
        r = c.get("/t/openai")
        assert (r.status_code, r.headers["retry-after"], r.json()["error"]["code"]) == (429, "2", "rate_limit_exceeded")
        r = c.get("/t/bug")
        assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
        assert "internal detail" not in r.text


def test_a_405_lists_the_allowed_methods_in_one_order():
    """Starlette joins a route's method set into ``Allow``, so the order varied between
    processes (replicas answered ``HEAD, GET`` and ``GET, HEAD``); the handler sorts it."""
    import asyncio

    from starlette.exceptions import HTTPException
    from starlette.requests import Request

    from gateway.ops.errors import handlers

    request = Request({"type": "http", "method": "PUT", "path": "/healthz", "headers": [], "query_string": b""})
    for allow in ("HEAD, GET", "GET, HEAD", "POST,GET, HEAD"):
        exc = HTTPException(405, headers={"Allow": allow})
        r = asyncio.run(handlers()[HTTPException](request, exc))
        assert r.status_code == 405
        assert r.headers["allow"] == ("GET, HEAD, POST" if "POST" in allow else "GET, HEAD")
        assert r.body == (
            b'{"error":{"message":"Method PUT is not allowed for /healthz.","type":"invalid_request_error",'
            b'"param":null,"code":"method_not_allowed"}}'
        )
