"""The engines' own request models for ``tools``, as their source declares them, for the test
oracles: both engines validate ``tools`` into pydantic models and hand the chat template
``[tool.model_dump() for tool in request.tools]``.

- vLLM (``vllm/entrypoints/openai/engine/protocol.py``): ``OpenAIBaseModel`` has
  ``extra="allow"``; ``FunctionDefinition(name, description=None, parameters=None)``,
  ``ChatCompletionToolsParam(type="function", function)``; declared fields first, then the extra
  keys in the order sent.
- SGLang (``python/sglang/srt/entrypoints/openai/serving_chat.py@002897c2`` ``_process_messages``:
  ``tools = [item.model_dump() for item in request.tools]``; ``protocol.py``, pydantic's default
  ``extra="ignore"``): ``Function(description=None, name, parameters=None, strict=False,
  defer_loading=None, popped when None)``, ``Tool(type="function", function, defer_loading=None)``.

Built with pydantic here, never from kvgate's own rendering code.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, model_serializer


class _VllmBase(BaseModel):
    model_config = ConfigDict(extra="allow")


class VllmFunctionDefinition(_VllmBase):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class VllmTool(_VllmBase):
    type: Literal["function"] = "function"
    function: VllmFunctionDefinition


class SglFunction(BaseModel):
    description: str | None = None
    name: str
    parameters: object | None = None
    strict: bool = False
    defer_loading: bool | None = None

    @model_serializer(mode="wrap")
    def _serialize(self, handler):
        data = handler(self)
        if self.defer_loading is None:
            data.pop("defer_loading", None)
        return data


class SglTool(BaseModel):
    type: str = "function"
    function: SglFunction
    defer_loading: bool | None = None


def vllm_tools(tools: list[dict]) -> list[dict]:
    """vLLM's ``[tool.model_dump() for tool in request.tools]``."""
    return [VllmTool.model_validate(t).model_dump() for t in tools]


def sglang_tools(tools: list[dict]) -> list[dict]:
    """SGLang's ``[item.model_dump() for item in request.tools]``."""
    return [SglTool.model_validate(t).model_dump() for t in tools]


def tools_as_templated(engine: str | None, tools: Any) -> Any:
    """``tools`` as ``engine`` hands them to the chat template (as sent for any other engine)."""
    if not tools or engine not in ("vllm", "sglang"):
        return tools
    return vllm_tools(tools) if engine == "vllm" else sglang_tools(tools)
