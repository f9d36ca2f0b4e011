"""How a route reads a whole (not streamed) JSON answer (:func:`gateway.relay.proxy.read_whole`):
the route values (:mod:`gateway.routes`) answer ``whole_answer`` with one of these two readers.

- :func:`read_choices_answer` (chat, completions, embeddings): an engine error object
  (:func:`verifier.engine_response.is_error_payload`) is the engine's error, else its choices
  are read (:func:`verifier.engine_response.parse_body`);
- :func:`read_response_answer` (``/v1/responses``): a ``response`` object
  (:func:`verifier.engine_response.parse_response_body`), whose ``error`` is the engine's error.
"""

from __future__ import annotations

from typing import Any

from verifier.engine_response import EngineOutput, engine_error, is_error_payload, parse_body, parse_response_body


def read_choices_answer(data: Any) -> EngineOutput:
    """What a decoded chat/completions/embeddings answer carries. Raises
    :class:`~config.errors.OpenAIError` (the engine's status mapped, 200 here) for an error object."""
    if is_error_payload(data):
        raise engine_error(200, data)
    return parse_body(data)


def read_response_answer(data: Any) -> EngineOutput:
    """What a decoded ``/v1/responses`` answer carries. Raises :class:`~config.errors.OpenAIError`
    for a ``response`` that is an error."""
    answer = parse_response_body(data)
    if answer.kind == "error":
        raise engine_error(200, {"error": answer.error})
    return answer
