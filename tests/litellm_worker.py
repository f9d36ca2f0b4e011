"""LiteLLM's SDK as a client of kvgate, run by the LiteLLM virtualenv's Python, not by the test's.

LiteLLM cannot share kvgate's environment (it needs ``huggingface-hub<2``; kvgate's pinned
``transformers`` needs ``>=2.4``), so scripts/ensure_tools.sh installs it into ``.venv-litellm``
and tests/test_client_litellm.py starts this file there once per module. Standard library and
``litellm`` only.

Protocol: one JSON object per line on stdin, ``{"call": NAME, "kwargs": {...}}``, NAME one of
``completion``, ``acompletion``, ``stream``, ``astream`` (``completion``/``acompletion`` with
``stream=True``), ``embedding``, ``router`` (``kwargs["router"]`` builds a fresh ``litellm.Router``,
the rest goes to its ``completion``). Each is answered by one JSON line on stdout:
``{"ok": <the response's model_dump()>}`` (streams: the list of the chunks' ``model_dump()``), or
``{"error": {...}}``: the raised exception's ``class``, its classes (``bases``, the MRO),
``message``, ``status_code``, ``body`` and ``headers``, the upstream answer's headers that LiteLLM
keeps as ``litellm_response_headers`` (``litellm/litellm_core_utils/exception_mapping_utils.py``
``exception_type``). Whatever else writes to stdout is sent to stderr, so it cannot corrupt the
answers.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

PROTOCOL = os.fdopen(os.dup(1), "w", encoding="utf-8")
os.dup2(2, 1)  # whatever else writes to stdout (LiteLLM's "Give Feedback" banner) goes to stderr
sys.stdout = sys.stderr

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of the price list at import

import litellm  # noqa: E402  (after the environment above)

litellm.suppress_debug_info = True
litellm.telemetry = False

LOOP = asyncio.new_event_loop()  # one loop for every async call: LiteLLM caches its clients per loop


def _dump(obj: Any) -> Any:
    return obj.model_dump() if hasattr(obj, "model_dump") else obj


def _error(e: BaseException) -> dict[str, Any]:
    headers = getattr(e, "litellm_response_headers", None)  # the upstream's headers (exception_type sets it)
    return {
        "class": type(e).__name__,
        "bases": [c.__module__ + "." + c.__name__ for c in type(e).__mro__],
        "message": str(getattr(e, "message", e)),
        "status_code": getattr(e, "status_code", None),
        "headers": dict(headers.items()) if headers is not None else None,
        "body": getattr(e, "body", None),
    }


async def _astream(kwargs: dict[str, Any]) -> list[Any]:
    return [_dump(c) async for c in await litellm.acompletion(stream=True, **kwargs)]


def call(name: str, kwargs: dict[str, Any]) -> Any:
    """Run one LiteLLM call; returns what the answer line's ``ok`` carries."""
    if name == "completion":
        return _dump(litellm.completion(**kwargs))
    if name == "acompletion":
        return _dump(LOOP.run_until_complete(litellm.acompletion(**kwargs)))
    if name == "stream":
        return [_dump(c) for c in litellm.completion(stream=True, **kwargs)]
    if name == "astream":
        return LOOP.run_until_complete(_astream(kwargs))
    if name == "embedding":
        return _dump(litellm.embedding(**kwargs))
    if name == "router":  # a fresh litellm.Router (what LiteLLM's proxy routes with) per call
        return _dump(litellm.Router(**kwargs.pop("router")).completion(**kwargs))
    raise ValueError(f"unknown call {name!r}")


def _ready() -> dict[str, Any]:
    """The first line: LiteLLM's version, and whether ``tenacity`` (which LiteLLM's per-call
    ``num_retries`` imports, and does not install) is there."""
    from importlib.metadata import version
    from importlib.util import find_spec

    return {"ready": "litellm", "version": version("litellm"), "tenacity": find_spec("tenacity") is not None}


def main() -> None:
    PROTOCOL.write(json.dumps(_ready()) + "\n")
    PROTOCOL.flush()
    for line in sys.stdin:
        request = json.loads(line)
        try:
            answer: dict[str, Any] = {"ok": call(request["call"], request["kwargs"])}
        except Exception as e:  # every LiteLLM exception goes back to the test to judge
            answer = {"error": _error(e)}
        PROTOCOL.write(json.dumps(answer, default=str) + "\n")
        PROTOCOL.flush()


if __name__ == "__main__":
    main()
