"""The server layer (gateway/edge/protocol.py) under a hostile client, on the request-target (RFC 9112
section 3.2): percent-encoded route paths, ``*``, fragments, absolute-form and authority-form,
characters a URI cannot hold, dot segments and duplicate slashes, an overlong target. Real sockets
against the gateway app, exact bytes."""

from __future__ import annotations

import json
import time

import pytest

from gateway.edge import protocol
from tests.gateway_harness import KEY_A, MODEL, chat
from tests.test_hostile_edge import NOT_HTTP, mock_gateway_edge, read_all, refusal, undated
from tests.test_hostile_edge_framing import MOCK_ANSWER, split_response

pytestmark = pytest.mark.timeout(60)

AUTH = f"authorization: Bearer {KEY_A}\r\n".encode()
BODY = json.dumps(chat(max_tokens=4)).encode()


@pytest.fixture(scope="module")
def served():
    with mock_gateway_edge() as srv:
        yield srv


@pytest.fixture
def edge(served):
    """The module's gateway, its live pool read (an unread pool is a 503 ``pool_size_unknown``)."""
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        s = served.connect()
        s.sendall(b"GET /readyz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        if read_all(s).startswith(b"HTTP/1.1 200 "):
            break
        time.sleep(0.1)
    return served


def post(target: bytes) -> bytes:
    return (
        b"POST " + target + b" HTTP/1.1\r\nhost: x\r\n" + AUTH + b"content-type: application/json\r\n"
        b"content-length: %d\r\nconnection: close\r\n\r\n" % len(BODY) + BODY
    )


def get(target: bytes, method: bytes = b"GET") -> bytes:
    return method + b" " + target + b" HTTP/1.1\r\nhost: x\r\n" + AUTH + b"connection: close\r\n\r\n"


def exchange(edge, raw: bytes) -> bytes:
    s = edge.connect()
    s.sendall(raw)
    try:
        return read_all(s)
    finally:
        s.close()


def app_error(message: str, code: str, param: str | None = None) -> bytes:
    return json.dumps(
        {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}},
        separators=(",", ":"),
    ).encode()


def assert_unknown_url(answer: bytes, method: str, path: str) -> None:
    status, headers, body, rest = split_response(answer)
    assert (status, body, rest) == (
        b"HTTP/1.1 404 Not Found",
        app_error(f"Unknown request URL: {method} {path}. Please check the URL.", "not_found"),
        b"",
    )


def bad_request(message: str) -> bytes:
    return refusal(400, "Bad Request", message, "invalid_request")


FRAGMENT = bad_request("A request target cannot carry a fragment ('#'); send the path and query alone.")
NOT_A_PATH = bad_request("The request target is not a valid absolute path.")
STAR = bad_request("The request target * is for OPTIONS only; send a path.")
NOT_A_HOST = bad_request("The request target's authority is not a host.")
TOO_LONG = refusal(414, "URI Too Long", "The request target is longer than 8192 bytes.", "uri_too_long")


# ---------------------------------------------------------------- percent-encoding in a route's path
@pytest.mark.parametrize(
    "target",
    [
        "/v1%2Fchat%2Fcompletions",
        "/v1/chat%2Fcompletions",
        "/v1/chat%2fcompletions",
        "/v1/%63hat/completions",
        "/%76%31/chat/completions",
    ],
)
def test_a_percent_encoded_route_path_names_no_route(edge, target):
    """uvicorn decodes the path before the app routes it: an encoded slash (or letter) in a route's
    fixed path reached the route (200, the engine asked), past any rule in front that matches the
    bytes sent (an ingress allowing or denying ``/v1/chat/completions`` by path; Envoy decodes no
    ``%2F`` and normalizes no path by default). An encoded "/" is data, not a separator (RFC 3986
    section 2.2): the path names no route, 404 with the path as sent, nothing forwarded."""
    before = len(edge.engine.state.requests)
    assert_unknown_url(exchange(edge, post(target.encode())), "POST", target)
    assert len(edge.engine.state.requests) == before


@pytest.mark.parametrize("target", ["/%6Detrics", "/v1%2Fmodels", "/v1/models%2F", "/heal%74hz"])
def test_a_percent_encoded_ops_or_models_path_names_no_route(edge, target):
    """``/%6Detrics`` was ``/metrics`` (the Prometheus text: an ingress that keeps ``/metrics``
    private by its path let it through), ``/v1%2Fmodels`` the model list."""
    assert_unknown_url(exchange(edge, get(target.encode())), "GET", target)


@pytest.mark.parametrize(
    "target, model",
    [("kvgate%2Dtiny", None), ("kvgate-tiny%2Fx", "kvgate-tiny/x"), ("..%2F..%2Fmetrics", "../../metrics")],
)
def test_a_model_id_is_percent_decoded(edge, target, model):
    """A path parameter is data: the openai SDKs send a model id with "/" as ``%2F``
    (``models.retrieve("org/name")``), and the id is the decoded one (an encoded ``-`` too)."""
    status, headers, body, rest = split_response(exchange(edge, get(b"/v1/models/" + target.encode())))
    if model is None:
        assert status == b"HTTP/1.1 200 OK" and json.loads(body)["id"] == MODEL
        return
    message = f"The model `{model}` does not exist or you do not have access to it."
    assert (status, body) == (b"HTTP/1.1 404 Not Found", app_error(message, "model_not_found", "model"))


def test_every_path_parameter_is_under_a_decoded_prefix_and_every_method_is_allowed(edge):
    """The edge's two copies of the route table stay the app's: each route with a path parameter
    starts with one of ``PARAMETER_PREFIXES`` (else its parameter would stay encoded, or a fixed
    path be decoded), and ``OPTIONS *``'s ``allow`` lists exactly the methods the routes serve."""
    routes = edge.server.config.app.routes
    parameterised = {r.path.split("{")[0] for r in routes if "{" in r.path}
    assert parameterised == {p.decode() for p in protocol.PARAMETER_PREFIXES}
    methods = set().union(*(r.methods for r in routes)) | {"OPTIONS"}
    assert set(protocol.SERVER_METHODS.decode().split(", ")) == methods


@pytest.mark.parametrize(
    "target, reported",
    [
        ("/v1/../v1/models", "/v1/../v1/models"),
        ("/v1/./models", "/v1/./models"),
        ("/v1/%2e%2e/v1/models", "/v1/%2e%2e/v1/models"),
        ("//v1/models", "//v1/models"),
        ("/v1//models", "/v1//models"),
    ],
)
def test_dot_segments_and_duplicate_slashes_are_not_normalised(edge, target, reported):
    """The path is routed as sent (as uvicorn does, unlike nginx, which removes dot segments and
    merges slashes before matching a location): a rule in front that matched these bytes and the
    gateway agree. ``%2e%2e`` was decoded to ``..`` (still 404), now reported as sent."""
    assert_unknown_url(exchange(edge, get(target.encode())), "GET", reported)


# ---------------------------------------------------------------- "*"
def test_options_star_is_answered_for_the_server_and_the_connection_kept(edge):
    """RFC 9110 section 9.3.7 / RFC 9112 section 3.2.4: a server-wide OPTIONS gets 200 with
    ``allow`` and ``content-length: 0``; it was the app's 404 ``Unknown request URL: OPTIONS /*``."""
    s = edge.connect()
    s.sendall(b"OPTIONS * HTTP/1.1\r\nhost: x\r\n\r\n")
    answer = b""
    s.settimeout(5)
    while b"\r\n\r\n" not in answer:
        answer += s.recv(65536)
    assert undated(answer) == b"HTTP/1.1 200 OK\r\nallow: GET, HEAD, POST, OPTIONS\r\ncontent-length: 0\r\n\r\n"
    s.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    status, headers, body, rest = split_response(read_all(s))
    assert (status, body, rest) == (b"HTTP/1.1 200 OK", b'{"status":"ok"}', b"")
    s.close()


def test_options_of_an_http_uri_without_a_path_is_options_star(edge):
    """RFC 9112 section 3.2.4: ``OPTIONS http://host`` (absolute-form, empty path) is the server's OPTIONS."""
    answer = exchange(edge, b"OPTIONS http://x HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    assert undated(answer) == (
        b"HTTP/1.1 200 OK\r\nallow: GET, HEAD, POST, OPTIONS\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
    )


@pytest.mark.parametrize("raw", [get(b"*"), get(b"*", b"HEAD"), post(b"*")], ids=["GET", "HEAD", "POST"])
def test_star_with_another_method_is_a_400(edge, raw):
    """RFC 9112 section 3.2.4: asterisk-form is OPTIONS' only; ``GET *`` was a 404."""
    before = len(edge.engine.state.requests)
    assert undated(exchange(edge, raw)) == STAR
    assert len(edge.engine.state.requests) == before


# ---------------------------------------------------------------- fragments
@pytest.mark.parametrize(
    "raw",
    [get(b"/v1/models#x"), get(b"/healthz?a=1#b"), get(b"/healthz#"), post(b"/v1/chat/completions#x")],
    ids=["path", "query", "empty", "post"],
)
def test_a_fragment_is_a_400(edge, raw):
    """RFC 9112 section 3.2: no "#" in a request-target. uvicorn dropped the fragment and served
    the request (200; the chat request was forwarded); Envoy refuses it, since a rule in front may
    read the path differently."""
    before = len(edge.engine.state.requests)
    assert undated(exchange(edge, raw)) == FRAGMENT
    assert len(edge.engine.state.requests) == before


# ---------------------------------------------------------------- absolute-form, authority-form
@pytest.mark.parametrize(
    "target",
    [b"http://x/v1/models", b"HTTPS://other.example:8443/v1/models", b"http://[::1]:8080/v1/models?a=1"],
)
def test_absolute_form_is_routed_by_its_path(edge, target):
    """RFC 9112 section 3.2.2: a server MUST accept absolute-form, and takes the host from it (the
    Host header, which it then ignores, is read by nothing in the gateway)."""
    status, headers, body, rest = split_response(exchange(edge, get(target)))
    assert status == b"HTTP/1.1 200 OK" and [m["id"] for m in json.loads(body)["data"]] == [MODEL]


def test_an_absolute_form_chat_request_is_served(edge):
    before = len(edge.engine.state.requests)
    status, headers, body, rest = split_response(exchange(edge, post(b"http://x/v1/chat/completions")))
    assert (status, json.loads(body), rest) == (b"HTTP/1.1 200 OK", MOCK_ANSWER, b"")
    assert len(edge.engine.state.requests) == before + 1


def test_absolute_form_without_a_path_is_the_root(edge):
    """RFC 9110 section 4.2.3: an empty path is "/" (no route: 404); it was a 400 "not valid
    HTTP/1.1" (uvicorn took the missing path for an error)."""
    assert_unknown_url(exchange(edge, get(b"http://x")), "GET", "/")


def test_absolute_form_keeps_percent_encoding_in_the_path(edge):
    assert_unknown_url(exchange(edge, get(b"http://x/v1%2Fmodels")), "GET", "/v1%2Fmodels")


@pytest.mark.parametrize(
    "target, answer",
    [
        (b"http://user:pw@x/v1/models", NOT_A_HOST),  # RFC 9110 section 4.2.4: userinfo is an error
        (b"http:///v1/models", NOT_A_HOST),  # RFC 9110 section 4.2.1: an empty host is invalid
        (b"http://:80/v1/models", NOT_A_HOST),
        (b"ftp://x/v1/models", NOT_A_PATH),  # not an http(s) URI, not a path
    ],
    ids=["userinfo", "empty-host", "port-only", "ftp"],
)
def test_absolute_form_that_is_not_an_http_uri_of_a_host_is_a_400(edge, target, answer):
    """These were served as ``GET /v1/models`` (uvicorn took the path alone)."""
    assert undated(exchange(edge, get(target))) == answer


@pytest.mark.parametrize(
    "raw",
    [
        b"CONNECT x:443 HTTP/1.1\r\nhost: x:443\r\n\r\n",
        get(b"x:443"),
        get(b"v1/models"),
        get(b"/v1/mo\x01dels"),
        get(b"/v1/mo\x7fdels"),
        get(b"/v1/mo dels"),
        get(b"/v1/mod\xc3\xa9ls"),
    ],
    ids=["connect", "authority-form-get", "no-slash", "ctl", "del", "space", "raw-utf8"],
)
def test_targets_httptools_refuses_stay_a_400(edge, raw):
    """Authority-form (RFC 9112 section 3.2.3; the gateway opens no tunnel), a target not starting
    with "/", control characters, a space, raw non-ASCII bytes: the OpenAI-shaped 400 of bytes that
    are not HTTP/1.1, connection closed."""
    assert undated(exchange(edge, raw)) == NOT_HTTP


@pytest.mark.parametrize(
    "target",
    [b"/v1\\models", b"/v1/<x>", b'/v1/"x"', b"/v1/{x}", b"/v1/[x]", b"/v1/|", b"/v1/models/%zz", b"/v1/models/%4"],
)
def test_a_path_a_uri_cannot_hold_is_a_400(edge, target):
    """RFC 3986 section 3.3 (pchar) and 2.1 (``%`` HEXDIG HEXDIG): these were routed (a 404, or a
    model id ``%zz``); nginx answers 400 to a bad percent-encoding."""
    assert undated(exchange(edge, get(target))) == NOT_A_PATH


# ---------------------------------------------------------------- an overlong target
def test_a_target_over_8_kib_is_a_414(edge):
    """RFC 9112 section 3: a target longer than the server parses is 414 URI Too Long (it was a 431
    about header fields). RFC 9110 section 4.1's recommended 8000 octets pass."""
    status, headers, body, rest = split_response(exchange(edge, get(b"/healthz?" + b"a" * 7990)))
    assert (status, body) == (b"HTTP/1.1 200 OK", b'{"status":"ok"}')
    assert undated(exchange(edge, get(b"/healthz?" + b"a" * 9000))) == TOO_LONG


def test_a_target_trickled_past_the_limit_is_a_414_before_its_end(edge):
    """Counted as it arrives: a target sent 1 KiB at a time gets its 414 once 8 KiB are in, before
    it ends; it was a 431 ``request_header_fields_too_large``."""
    s = edge.connect()
    s.sendall(b"GET /healthz?")
    for _ in range(9):
        s.sendall(b"a" * 1024)
        time.sleep(0.01)
    assert undated(read_all(s)) == TOO_LONG  # the target has not ended: nothing after it was sent
    s.close()


def test_an_overlong_target_pipelined_behind_a_request_is_refused_after_its_answer(edge):
    s = edge.connect()
    s.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n" + get(b"/healthz?" + b"a" * 9000))
    status, headers, body, rest = split_response(read_all(s))
    assert (status, body) == (b"HTTP/1.1 200 OK", b'{"status":"ok"}')
    assert undated(rest) == TOO_LONG
    s.close()
