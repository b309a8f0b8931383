"""Request bodies of the OpenAI API that vlmserve serves, and how they map to SamplingParams."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from vlmserve.sampling_params import ParamError, SamplingParams, StructuredOutputsParams


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


class JsonSchemaFormat(BaseModel):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the schema is always enforced as written


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("response_format of type json_schema needs json_schema.schema")
        return self


class FunctionDefinition(BaseModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedToolChoice(BaseModel):
    class Function(BaseModel):
        name: str

    type: Literal["function"] = "function"
    function: Function


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
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_p: float | None = None
    bad_words: list[str] | None = None
    response_format: ResponseFormat | None = None
    # vLLM's ways to ask for structured output, under its names
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
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

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The one constraint the request asks for, from whichever field it used."""
        found: dict[str, StructuredOutputsParams] = {}
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            found["response_format"] = StructuredOutputsParams(json_object=True)
        elif fmt is not None and fmt.type == "json_schema":
            found["response_format"] = StructuredOutputsParams(json=fmt.json_schema.schema_)
        if self.structured_outputs:
            fields = {"json", "json_object", "regex", "choice", "grammar"}
            unknown = set(self.structured_outputs) - fields
            if unknown:
                raise ParamError("structured_outputs", f"structured_outputs takes {sorted(fields)}, not {sorted(unknown)}")
            found["structured_outputs"] = StructuredOutputsParams(**self.structured_outputs)
        guided = {"json": self.guided_json, "regex": self.guided_regex, "choice": self.guided_choice,
                  "grammar": self.guided_grammar}
        for key, value in guided.items():
            if value is not None:
                found[f"guided_{key}"] = StructuredOutputsParams(**{key: value})
        if len(found) > 1:
            raise ParamError(sorted(found)[1], f"ask for one structured output at a time, got {sorted(found)}")
        return next(iter(found.values()), None)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, default_max: int | None,
                        defaults: dict[str, Any] | None = None) -> SamplingParams:
        """The request's params; a field it leaves unset takes the checkpoint's default
        (`defaults`, from generation_config.json), else vlmserve's."""
        defaults = defaults or {}

        def pick(value, name, fallback):
            return value if value is not None else defaults.get(name, fallback)

        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            if not key.lstrip("-").isdigit():
                raise ParamError("logit_bias", f"logit_bias keys must be token ids, got {key!r}")
            bias[int(key)] = value
        return SamplingParams(
            n=self.n,
            temperature=pick(self.temperature, "temperature", 1.0),
            top_p=pick(self.top_p, "top_p", 1.0),
            top_k=pick(self.top_k, "top_k", 0),
            seed=self.seed,
            max_tokens=pick(max_tokens, "max_tokens", default_max),
            min_tokens=self.min_tokens,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=pick(self.repetition_penalty, "repetition_penalty", 1.0),
            logit_bias=bias,
            min_p=pick(self.min_p, "min_p", 0.0),
            bad_words=list(self.bad_words or []),
            structured_outputs=self.structured_outputs_params(),
        )


class ChatCompletionRequest(SamplingRequest):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _tool_choice_needs_tools(self):
        choice = self.tool_choice
        if choice is not None and choice != "none" and not self.tools:
            raise ValueError("tool_choice needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in self.tools}:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not among the tools")
        return self

    @property
    def uses_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

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


FinishReason = Literal["stop", "length", "abort", "error", "tool_calls"]
