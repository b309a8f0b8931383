"""The body of POST /v1/responses (OpenAI's Responses API), with vLLM's extra sampling
fields; how it maps to sampling params."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from vlmserve.entrypoints.openai.protocol import SamplingRequest
from vlmserve.sampling_params import StructuredOutputsParams


class TextFormat(BaseModel):
    type: Literal["text", "json_schema", "json_object"] = "text"
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("text.format of type json_schema needs a schema")
        return self


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="allow")

    format: TextFormat | None = None
    verbosity: str | None = None


class FunctionChoice(BaseModel):
    type: Literal["function"]
    name: str


class ReasoningOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    effort: str | None = None
    summary: str | None = None


class ResponsesRequest(SamplingRequest):
    """OpenAI's fields (those that do not apply to a local model are accepted and ignored,
    as vLLM does: service_tier, prompt_cache_key, ...), plus vLLM's sampling extensions
    and chat_template_kwargs."""

    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    store: bool = True
    background: bool = False
    text: TextConfig | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning: ReasoningOptions | None = None
    metadata: dict[str, str] | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _some_input(self):
        if isinstance(self.input, list) and not self.input and not self.previous_response_id:
            raise ValueError("input must not be empty")
        return self

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """text.format's schema (or vLLM's structured_outputs fields)."""
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_schema":
            return StructuredOutputsParams(json=fmt.schema_)
        if fmt is not None and fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        return super().structured_outputs_params()

    @property
    def function_tools(self) -> list[dict[str, Any]]:
        return [t for t in self.tools or [] if t.get("type") == "function"]
