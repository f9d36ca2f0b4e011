"""The values an engine serving the model refuses only after kvgate admitted the request
(:func:`check_engine_refusals`, for ``/v1/completions``, ``/v1/chat/completions`` and
``/v1/responses``; :func:`check_image_parts` for image content parts on chat and Responses;
:func:`check_embedding_dimensions` for ``/v1/embeddings``).

An engine's 400 came after the prompt had been counted, reserved and charged
(``gateway/relay/finish.py``: an engine's error is settled at the prompt x its sequences), so these
are the gateway's own 400 naming the field, before anything is counted. Every engine in
``engines`` may get the request, so each one's refusals apply; ``openai`` upstreams are left to
OpenAI. Checked after the field policy (:mod:`gateway.admission.fields`), so a field it already
refuses keeps that error.

Sources: vLLM ``vllm/sampling_params.py@00388f65`` (``SamplingParams._verify_args``,
``_verify_greedy_sampling``, ``__post_init__``), ``vllm/entrypoints/openai/chat_completion/
protocol.py@002032ee`` (``ChatCompletionRequest.check_logprobs``), ``vllm/pooling_params.py@0235532e``
(``PoolingParams._set_default_parameters``); SGLang ``python/sglang/srt/sampling/
sampling_params.py@00c17caf`` (``SamplingParams.__post_init__``, ``verify``); the bundled backend's
``gpu_backend/openai_api.py`` (``_UNSUPPORTED``, ``_check_unsupported``, ``_sampling``,
``_prompt_ids``) and ``gpu_backend/responses_api.py`` (``parse_responses``).
"""

from __future__ import annotations

from typing import Any

from config.errors import ErrorCode, OpenAIError
from gateway.admission.checks import bad_value
from tokenizer.chat import IMAGE_PART_TYPES
from tokenizer.responses import IMAGE_PARTS as RESPONSES_IMAGE_PARTS

#: SGLang reads a temperature in [0, this) as greedy and sets ``top_k`` to 1 before ``verify``
#: (``_SAMPLING_EPS``, ``SamplingParams.__post_init__``)
SGLANG_GREEDY_BELOW = 1e-6

#: The bundled backend (``kvgate``), per route: an OpenAI field of that route -> the values it
#: takes; any other is its 400 ("'<field>' is not supported by this backend."; ``n``: "Only 'n' =
#: 1 is supported"). ``_check_unsupported`` reads the same ``_UNSUPPORTED`` table on every route;
#: only the fields each route's table validates are listed (chat ``logprobs`` is a boolean,
#: completions' a count). Its other entries are refused by the field policy already: the engine
#: extension fields (``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens`` but 0) are
#: outside its table (:data:`gateway.admission.fields.ENGINE_EXTENSIONS`), ``response_format``,
#: ``text.format`` and ``tool_choice`` are :func:`gateway.admission.fields.check_output_constraints`.
BUNDLED_NEUTRAL: dict[str, dict[str, tuple[Any, ...]]] = {
    "completions": {
        "n": (1,),
        "best_of": (1,),
        "echo": (False,),
        "logprobs": (0,),
        "logit_bias": ({},),
        "frequency_penalty": (0,),
        "presence_penalty": (0,),
    },
    "chat": {
        "n": (1,),
        "logprobs": (False,),
        "top_logprobs": (0,),
        "logit_bias": ({},),
        "frequency_penalty": (0,),
        "presence_penalty": (0,),
    },
    "responses": {"top_logprobs": (0,)},
}


def _refused(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, message, code=ErrorCode.INVALID_REQUEST, param=param)


def _unsupported(key: str) -> OpenAIError:
    return _refused(key, f"'{key}' is not supported by the engines serving this model.")


def _check_sampling(body: dict[str, Any], engines: frozenset[str]) -> None:
    """Every route's sampling fields:

    - ``top_p`` 0: vLLM ``_verify_args`` ("top_p must be in (0, 1]", checked before the greedy
      reset), SGLang ``verify`` (the same words), the bundled backend's ``_sampling``
      (``_num(..., lo_open=True)``);
    - ``top_k`` 0 on SGLang (``verify``: "top_k must be -1 (disable) or at least 1"), unless the
      temperature is below :data:`SGLANG_GREEDY_BELOW` (SGLang then sets ``top_k`` 1 first;
      absent, the engine's default is not greedy); vLLM reads 0 as off;
    - ``n`` > 1 with ``temperature`` 0 on vLLM (``_verify_greedy_sampling``: "n must be 1 when
      using greedy sampling"; a temperature in (0, 0.01) is raised to 0.01 first, so only 0 is
      greedy). The Responses API has no ``n``."""
    top_p = body.get("top_p")
    if top_p is not None and top_p <= 0:
        raise bad_value("top_p", "must be > 0 and <= 1 (the engines serving this model refuse 0)")
    temperature = body.get("temperature")
    if "sglang" in engines and body.get("top_k") == 0:
        if temperature is None or temperature >= SGLANG_GREEDY_BELOW:
            raise bad_value("top_k", "must be -1 (off) or at least 1 for the engines serving this model (SGLang)")
    if "vllm" in engines and temperature == 0 and (body.get("n") or 1) > 1:
        raise bad_value("n", "must be 1 when 'temperature' is 0 (greedy sampling) for the engines serving this model")


def _check_vllm_chat(body: dict[str, Any], engines: frozenset[str]) -> None:
    """vLLM's chat request model: ``top_logprobs`` above 0 without ``logprobs: true``
    (``ChatCompletionRequest.check_logprobs``: "when using `top_logprobs`, `logprobs` must be set
    to true"). SGLang ignores ``top_logprobs`` there."""
    top = body.get("top_logprobs")
    if "vllm" in engines and top is not None and top > 0 and body.get("logprobs") is not True:
        raise bad_value("top_logprobs", "must be 0 unless 'logprobs' is true, for the engines serving this model")


def _check_bundled(body: dict[str, Any], route: str) -> None:
    """The bundled backend: on completions more than one prompt ("Batched prompts are not
    supported by this backend", ``_prompt_ids``), and on every route the fields of
    :data:`BUNDLED_NEUTRAL` at any other value."""
    prompt = body.get("prompt") if route == "completions" else None
    if isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], (str, list)):  # a batch
        raise _refused(
            "prompt",
            f"'prompt' holds {len(prompt)} prompts; the engines serving this model take one prompt per request.",
        )
    for key, neutral in BUNDLED_NEUTRAL[route].items():
        value = body.get(key)
        if value is not None and value not in neutral:  # validated: no bool poses as a number here
            raise _unsupported(key)


#: engines that take no image content parts: the bundled backend encodes its prompt as text only
#: (``tokenizer/chat.py`` ``chatml_token_ids``, ``tokenizer/hf_counter.py`` ``encode_chat``:
#: ``ImagesNotSupportedError``, its 400 "This model does not accept image content parts.")
NO_IMAGES = frozenset({"kvgate"})

#: per route, where a validated body holds content parts: chat ``messages[i].content`` (any role;
#: ``image_url`` and vLLM's ``input_image``, as the counters read them), Responses ``input[i].content``
#: and a ``function_call_output``'s ``input[i].output``
_IMAGE_PARTS: dict[str, tuple[str, tuple[str, ...], frozenset[str]]] = {
    "chat": ("messages", ("content",), frozenset(IMAGE_PART_TYPES)),
    "responses": ("input", ("content", "output"), frozenset(RESPONSES_IMAGE_PARTS)),
}


def check_image_parts(body: dict[str, Any], engines: frozenset[str], route: str) -> None:
    """Refuse an image content part where an engine in ``engines`` takes no images
    (:data:`NO_IMAGES`: the bundled backend, alone or beside other engines: any of them may get the
    request), on ``route`` (``chat`` or ``responses``): 400 naming the part
    (``messages[0].content[1]``, ``input[0].content[1]``, ``input[1].output[0]``), where the
    engine's 400 came after the image had been counted, reserved and charged. Called before the
    model's image URL policy (:func:`gateway.admission.fields.check_chat_request`,
    :func:`gateway.routes.responses.count_responses`): no URL makes such an image acceptable."""
    if not engines & NO_IMAGES or route not in _IMAGE_PARTS:
        return
    key, holders, types = _IMAGE_PARTS[route]
    items = body.get(key)
    for i, item in enumerate(items if isinstance(items, list) else ()):
        if not isinstance(item, dict):
            continue
        for holder in holders:
            parts = item.get(holder)
            for j, part in enumerate(parts if isinstance(parts, list) else ()):
                if isinstance(part, dict) and part.get("type") in types:
                    param = f"{key}[{i}].{holder}[{j}]"
                    raise _refused(
                        param,
                        f"'{param}' is an image, but the engines serving this model take no images "
                        "(they read text only); send text parts only.",
                    )


def check_engine_refusals(body: dict[str, Any], engines: frozenset[str], route: str) -> None:
    """Refuse (400 naming the field) what an engine in ``engines`` refuses only after admission, on
    ``route`` (``completions``, ``chat`` or ``responses``, whose validated ``body`` this is):
    :func:`_check_sampling` on every route, :func:`_check_vllm_chat` on chat, the bundled
    backend's :func:`_check_bundled`. Nothing for a model served only by ``openai`` upstreams."""
    if not engines or engines <= {"openai"}:
        return
    _check_sampling(body, engines)
    if route == "chat":
        _check_vllm_chat(body, engines)
    if "kvgate" in engines:
        _check_bundled(body, route)


def check_embedding_dimensions(body: dict[str, Any], engines: frozenset[str], matryoshka: bool | list[int]) -> None:
    """``/v1/embeddings`` ``dimensions`` (validated: an integer >= 1) for a model with the
    ``matryoshka`` setting of its config (:class:`config.models.ModelConfig`). vLLM refuses it
    for a model that is not a Matryoshka model ("does not support matryoshka representation") and,
    for one whose config lists ``matryoshka_dimensions``, any value outside the list
    (``PoolingParams._set_default_parameters``; any other value >= 1 it takes: it keeps that many
    leading values of the vector). kvgate cannot read the engine's model config, so the model's
    ``matryoshka`` says it: ``false`` (the default): refused; ``true``: any; a list: those.
    Nothing for a model served only by ``openai`` upstreams (OpenAI's own rule applies)."""
    dims = body.get("dimensions")
    if dims is None or not engines or engines <= {"openai"} or matryoshka is True:
        return
    if matryoshka is False:
        raise _unsupported("dimensions")
    if dims not in matryoshka:
        raise bad_value("dimensions", f"must be one of {', '.join(map(str, matryoshka))} for this model")
