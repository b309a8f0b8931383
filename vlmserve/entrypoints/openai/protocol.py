"""Request bodies of the OpenAI API that vlmserve serves, and how they map to SamplingParams."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from vlmserve.sampling_params import SamplingParams


class OpenAIError(Exception):
    """An error answered in OpenAI's format: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             413: "invalid_request_error", 429: "rate_limit_error", 500: "internal_server_error",
             503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class ResponseFormat(BaseModel):
    type: str


class SamplingRequest(BaseModel):
    """Fields shared by chat and text completions (vLLM-style extensions included).
    Ranges are checked by SamplingParams, in one place for the API and `LLM`."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int = 0
    cache_salt: str | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    user: str | None = None

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalties(cls, v: float) -> float:
        if v:
            raise ValueError("presence/frequency penalties are not supported")
        return v

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, default_max: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            seed=self.seed,
            max_tokens=default_max if max_tokens is None else max_tokens,
            min_tokens=self.min_tokens,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
        )


class ChatCompletionRequest(SamplingRequest):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, v: ResponseFormat | None) -> ResponseFormat | None:
        if v is not None and v.type != "text":
            raise ValueError(f"response_format type {v.type!r} is not supported (only 'text')")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_range(cls, v: int | None) -> int | None:
        if v is not None and not 0 <= v <= 20:
            raise ValueError("top_logprobs must be between 0 and 20")
        return v


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int]
    logprobs: int | None = None
    echo: bool = False

    @field_validator("logprobs")
    @classmethod
    def _logprobs_range(cls, v: int | None) -> int | None:
        if v is not None and not 0 <= v <= 20:
            raise ValueError("logprobs must be between 0 and 20")
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v


FinishReason = Literal["stop", "length", "abort", "error"]
