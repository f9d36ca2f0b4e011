"""The ASGI scope extensions the server layer (:mod:`gateway.edge.protocol`) gives the app
(``scope["extensions"]``, ASGI spec "Extensions"): whether a request has been received whole, and
the refusal the server layer itself answered a request with. Under another server they are absent
and the app assumes nothing."""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from typing import Any

#: ``scope["extensions"][REQUEST_COMPLETE]``: a zero-argument callable, true once the request's
#: head and its whole body are in the server's memory (its ``receive()`` would not wait)
REQUEST_COMPLETE = "kvgate.request_complete"


#: ``scope["extensions"][SERVER_REFUSED]``: ``(status, code)`` of the refusal the server layer
#: answered a request with while its app ran (a body too slow: 408 ``request_timeout``; a chunked
#: body past ``max_body_bytes`` with its framing: 413 ``request_too_large``), set before the app's
#: ``receive()`` reports the disconnect that follows (the connection is closed)
SERVER_REFUSED = "kvgate.server_refused"


def mark_complete_when(scope: MutableMapping[str, Any], complete: Callable[[], bool]) -> None:
    """Give ``scope`` the :data:`REQUEST_COMPLETE` extension, answered by ``complete``."""
    extensions = scope.get("extensions")
    if extensions is None:
        scope["extensions"] = extensions = {}
    extensions[REQUEST_COMPLETE] = complete


def completion_of(scope: MutableMapping[str, Any]) -> Callable[[], bool] | None:
    """The server's "is the whole request in?" (:data:`REQUEST_COMPLETE`), or ``None`` when the
    server says nothing about it."""
    extensions = scope.get("extensions")
    return extensions.get(REQUEST_COMPLETE) if extensions else None


def mark_refused(scope: MutableMapping[str, Any], status: int, *, code: str) -> None:
    """Give ``scope`` the :data:`SERVER_REFUSED` extension: the server answered it ``status``."""
    extensions = scope.get("extensions")
    if extensions is None:
        scope["extensions"] = extensions = {}
    extensions[SERVER_REFUSED] = (status, code)


def refusal_of(scope: MutableMapping[str, Any]) -> tuple[int, str] | None:
    """``(status, code)`` the server layer answered the request with (:data:`SERVER_REFUSED`), or
    ``None``: it answered nothing, or says nothing (another server)."""
    extensions = scope.get("extensions")
    return extensions.get(SERVER_REFUSED) if extensions else None
