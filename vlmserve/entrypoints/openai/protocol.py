"""Request bodies of the OpenAI API that vlmserve serves, and how they map to SamplingParams."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator

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


MAX_LOGPROBS = 20  # vLLM's --max-logprobs default


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # every chunk carries its choice's running usage (with include_usage)


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

    # unknown fields are kept (and logged once per name as ignored, as vLLM does): a client's
    # typo is visible
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
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
    # vLLM's extensions
    prompt_logprobs: int | None = None  # logprobs of the prompt's tokens (-1: the whole vocabulary)
    return_token_ids: bool = False  # the prompt's and the answer's token ids in the response
    return_tokens_as_token_ids: bool = False  # logprob tokens as "token_id:N"
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last N tokens (-1: as many as fit)
    thinking_token_budget: int | None = None  # a thinking model's reasoning tokens before it is closed for it

    @property
    def ignored_fields(self) -> set[str]:
        return set(self.model_extra or {})

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @model_validator(mode="after")
    def _prompt_logprobs_range(self):
        p = self.prompt_logprobs
        if p is not None and p < -1:
            raise ValueError("`prompt_logprobs` must be a positive value or -1.")
        if p is not None and p > MAX_LOGPROBS:
            raise ValueError(f"Requested prompt logprobs of {p}, which is greater than max allowed: {MAX_LOGPROBS}")
        if p is not None and p != 0 and self.stream:
            raise ValueError("`prompt_logprobs` are not available when `stream=True`.")
        t = self.truncate_prompt_tokens
        if t is not None and t < 1 and t != -1:
            raise ValueError(f"truncate_prompt_tokens must be an integer >= 1 or -1, got {t}")
        return self

    def include_usage(self) -> tuple[bool, bool]:
        """Whether a stream ends with the usage, and whether every chunk carries it."""
        options = self.stream_options
        if options is None or not options.include_usage:
            return False, False
        return True, options.continuous_usage_stats

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
            prompt_logprobs=self.prompt_logprobs,
            thinking_token_budget=self.thinking_token_budget,
        )


class ChatCompletionRequest(SamplingRequest):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the answer continues the last (assistant) message
    echo: bool = False  # the answer starts with the last message, if it is in the answer's role
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    include_reasoning: bool = True  # vLLM's: false leaves a thinking model's reasoning out of the answer

    @model_validator(mode="after")
    def _tool_choice_needs_tools(self):
        choice = self.tool_choice
        if choice is not None and choice != "none" and not self.tools:
            raise ValueError("tool_choice needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in self.tools}:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not among the tools")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        return self

    @property
    def uses_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forces_tool_call(self) -> bool:
        return self.uses_tools and (self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice))

    @property
    def response_role(self) -> str:
        """The role of the answer: the assistant's, or, continuing the last message, its role."""
        return "assistant" if self.add_generation_prompt else str(self.messages[-1].get("role", "assistant"))

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_range(cls, v: int | None) -> int | None:
        if v is not None and not 0 <= v <= MAX_LOGPROBS:
            raise ValueError(f"top_logprobs must be between 0 and {MAX_LOGPROBS}")
        return v


class CompletionRequest(SamplingRequest):
    # one prompt or several, as text or as token ids; a choice per prompt and sample
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    logprobs: int | None = None
    echo: bool = False  # the answer starts with the prompt (and its logprobs with the prompt's)

    @field_validator("logprobs")
    @classmethod
    def _logprobs_range(cls, v: int | None) -> int | None:
        if v is not None and not 0 <= v <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be between 0 and {MAX_LOGPROBS}")
        return v

    @field_validator("prompt")
    @classmethod
    def _some_prompt(cls, v):
        if isinstance(v, list) and (not v or any(isinstance(p, list) and not p for p in v)):
            raise ValueError("You must pass at least one prompt")
        if isinstance(v, list) and any(isinstance(t, int) and t < 0 for p in v for t in (p if isinstance(p, list)
                                                                                              else [p])):
            raise ValueError("token ids must be non-negative")
        return v


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a text prompt, or chat messages as the template renders them."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_form(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send either prompt or messages")
        return self


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[StrictInt]


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's /v1/load_lora_adapter body."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str


FinishReason = Literal["stop", "length", "abort", "error", "tool_calls"]


class PoolingRequest(BaseModel):
    """What the pooling endpoints share (vLLM's fields): use_activation (embeddings:
    normalised; a reranker: its score through a sigmoid; default: the model's setting),
    template settings, truncation, priority."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    use_activation: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    truncate_prompt_tokens: int | None = None
    priority: int = 0
    cache_salt: str | None = None

    @property
    def ignored_fields(self) -> set[str]:
        return set(self.model_extra or {})


class EmbeddingRequest(PoolingRequest):
    """/v1/embeddings: OpenAI's `input` (text, texts, token ids, lists of token ids), or
    vLLM's multimodal form, chat `messages` rendered by the template (pictures and videos
    as in chat completions)."""

    input: str | list[str] | list[StrictInt] | list[list[StrictInt]] | None = None
    messages: list[dict[str, Any]] | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # Matryoshka: the first this many, normalised after the cut
    user: str | None = None
    # vLLM's extensions
    normalize: bool | None = None  # vLLM's older name for use_activation
    add_generation_prompt: bool = False  # messages: as vLLM renders them for embeddings
    continue_final_message: bool = False

    @model_validator(mode="after")
    def _one_form(self):
        if (self.input is None) == (self.messages is None):
            raise ValueError("send either input or messages")
        if self.input is not None and not self.input and self.input != 0:
            raise ValueError("input must not be empty")
        return self


ScoreInput = str | dict[str, Any]  # a string, or {"content": [text / image_url / video_url parts]}


class ScoringRequest(PoolingRequest):
    """What /v1/score and /v1/rerank share: the reranker's task (`instruction`, or
    chat_template_kwargs' "instruction")."""

    instruction: str | None = None

    @property
    def task_instruction(self) -> str | None:
        return (self.chat_template_kwargs or {}).get("instruction", self.instruction)


class ScoreRequest(ScoringRequest):
    """/v1/score: queries against documents, one against each or one for all; under any of
    vLLM's field pairs (queries/documents, text_1/text_2, queries/items, data_1/data_2)."""

    queries: ScoreInput | list[ScoreInput] | None = None
    documents: ScoreInput | list[ScoreInput] | None = None
    items: ScoreInput | list[ScoreInput] | None = None
    text_1: ScoreInput | list[ScoreInput] | None = None
    text_2: ScoreInput | list[ScoreInput] | None = None
    data_1: ScoreInput | list[ScoreInput] | None = None
    data_2: ScoreInput | list[ScoreInput] | None = None

    @model_validator(mode="after")
    def _one_pair_of_fields(self):
        self.sides()
        return self

    def sides(self) -> tuple[Any, Any, tuple[str, str]]:
        """The queries, the documents, and the names they came under."""
        for names in (("queries", "documents"), ("text_1", "text_2"), ("queries", "items"), ("data_1", "data_2")):
            first, second = getattr(self, names[0]), getattr(self, names[1])
            if first is not None and second is not None:
                return first, second, names
        raise ValueError("send the pairs to score as queries and documents (or text_1 and text_2)")


class RerankRequest(ScoringRequest):
    """/v1/rerank (Jina's and Cohere's form): one query, documents sorted by relevance,
    the first top_n of them (0: all)."""

    query: ScoreInput
    documents: list[ScoreInput]
    top_n: int = Field(default=0, ge=0)
    return_documents: bool = True
