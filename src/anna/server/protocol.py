"""OpenAI request bodies as pydantic models (unknown fields ignored, as OpenAI clients expect),
and the error shape ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from fastapi.responses import Response
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from anna.core.sampling_params import MAX_LOGPROBS


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type_: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type = type_ or {401: "authentication_error", 404: "not_found_error",
                              503: "service_unavailable"}.get(status, "invalid_request_error" if status < 500
                                                                      else "server_error")
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def error_response(err: APIError, headers: dict[str, str] | None = None) -> Response:
    """OpenAI's error JSON. ASCII-escaped, so that no text in a message can make it fail to encode."""
    if err.status in (408, 413):  # the rest of the body may still be on its way: do not read it
        headers = {"Connection": "close", **(headers or {})}
    return Response(json.dumps(err.body()), status_code=err.status, media_type="application/json",
                    headers=headers)


class _Lenient(BaseModel):
    # Unknown fields are ignored; numbers must be finite, also when given as strings ("inf").
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Lenient):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk too (with include_usage)


class SamplingFields(_Lenient):
    """Fields shared by chat and completions requests."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    min_tokens: int = Field(default=0, ge=0)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)  # vLLM's extension
    ignore_eos: bool = False
    speculative: bool = True  # Anna's: false opts this request out of speculative decoding
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None  # vLLM's extension
    bad_words: list[str] | None = None  # vLLM's extension
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)  # vLLM's: keep the prompt's last N tokens
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: str | None = None
    # Structured output: OpenAI's response_format, and vLLM's extra fields
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's newer form: {"json": ...} / {"regex": ...} / ...


class FunctionDef(_Lenient):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolDef(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionDef


class ToolCallFunction(_Lenient):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class NamedFunction(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``: call this function."""

    type: Literal["function"] = "function"
    function: NamedFunction


def _check_tool_choice(value: Any) -> Any:
    if isinstance(value, dict) and not (isinstance(value.get("function"), dict)
                                        and isinstance(value["function"].get("name"), str)):
        raise ValueError('a named tool choice is {"type": "function", "function": {"name": "<a tool\'s name>"}}')
    return value


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolDef] | None = None
    tool_choice: Annotated[str | NamedToolChoice | None, BeforeValidator(_check_tool_choice)] = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    # OpenAI's (and vLLM's) default for completions; 0 with echo: the prompt scored, nothing generated
    max_tokens: int | None = Field(default=16, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None  # refused when given: no fill-in-the-middle
    best_of: int | None = Field(default=None, ge=1)  # refused unless 1 or n: every sample is returned


class TokenizeRequest(_Lenient):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDef] | None = None


class DetokenizeRequest(_Lenient):
    model: str | None = None
    tokens: list[int]
