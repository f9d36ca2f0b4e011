"""The ASGI scope extension the server layer (:mod:`gateway.edge.protocol`) gives the app
(``scope["extensions"]``, ASGI spec "Extensions"): whether a request has been received whole.
Under another server the extension is absent and the app assumes nothing."""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from typing import Any

#: ``scope["extensions"][REQUEST_COMPLETE]``: a zero-argument callable, true once the request's
#: head and its whole body are in the server's memory (its ``receive()`` would not wait)
REQUEST_COMPLETE = "kvgate.request_complete"


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
