"""How the next tokens of one request are chosen and when generation stops."""

from __future__ import annotations

import enum
import functools
import math
from dataclasses import dataclass, field, replace

# Below this temperature sampling is greedy (argmax), as in vLLM and OpenAI's API.
_GREEDY_EPS = 1e-5
SEED_MIN, SEED_END = -(1 << 63), 1 << 64  # what a torch.Generator takes
MAX_TOP_K = (1 << 31) - 1  # larger is no filtering anyway


class ParamError(ValueError):
    """A sampling parameter out of range; `param` names it (the API's error field)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self):  # pickled whole (an engine replica raises it to the ingress)
        return type(self), (self.param, str(self))


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ParamError(message.split(" ", 1)[0], message)  # every message starts with the field's name


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What the answer must match: exactly one of a JSON schema, any JSON object, a regex,
    a list of choices, or a grammar (EBNF as xgrammar reads it, or Lark). The names are
    vLLM's, so its clients work unchanged."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    # with json: the JSON is written between these two texts (a forced tool call in the
    # model's own format, e.g. <tool_call> ... </tool_call>)
    tool_call_tags: tuple[str, str] | None = None
    # with json: the calls of `json` (anyOf one {"name", "arguments"} schema per tool) are
    # written in Qwen's XML form (<tool_call><function=...><parameter=...>)
    tool_call_xml: bool = False

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        _check(len(given) == 1, "structured_outputs must set exactly one of json, json_object, regex, choice "
               f"and grammar, got {given or 'none'}")
        _check(self.json is None or isinstance(self.json, (dict, str)), "structured_outputs.json must be a schema")
        _check(self.regex is None or (isinstance(self.regex, str) and self.regex),
               "structured_outputs.regex must be a non-empty string")
        _check(self.grammar is None or (isinstance(self.grammar, str) and self.grammar),
               "structured_outputs.grammar must be a non-empty string")
        _check(self.choice is None or (self.choice and all(isinstance(c, str) and c for c in self.choice)),
               "structured_outputs.choice must be a non-empty list of non-empty strings")
        _check(self.tool_call_tags is None or self.json is not None, "structured_outputs.tool_call_tags needs json")
        _check(not self.tool_call_xml or isinstance(self.json, dict), "structured_outputs.tool_call_xml needs json")

    @functools.cached_property
    def key(self) -> tuple[str, str]:
        """What the compiled grammar depends on: the cache key."""
        import json

        if self.json is not None:
            # property order is kept: the answer writes properties in the order the schema lists them
            schema = self.json if isinstance(self.json, str) else json.dumps(self.json)
            if self.tool_call_xml:
                return "json", json.dumps([schema, "xml"])
            return "json", schema if self.tool_call_tags is None else json.dumps([schema, *self.tool_call_tags])
        if self.json_object:
            return "json_object", ""
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", json.dumps(self.choice)
        return "grammar", self.grammar

    @property
    def name(self) -> str:
        """What error messages call the constraint."""
        return {"json": "JSON schema", "json_object": "JSON object", "regex": "regex", "choice": "choice list",
                "grammar": "grammar"}[self.key[0]]


class RequestOutputKind(enum.IntEnum):
    """What a request's outputs carry as it runs (vLLM's names): the text and tokens so far
    at every step, only the new ones, or nothing until the end (the offline LLM and
    non-streaming requests: no output is made for them step by step)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k filtering
    seed: int | None = None
    max_tokens: int | None = 16  # None: until the context is full
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # top-k logprobs per sampled token (0: only the sampled one)
    prompt_logprobs: int | None = None  # same for prompt positions; -1: the whole vocabulary
    skip_special_tokens: bool = True
    # applied in this order, as vLLM does: the grammar's mask; min_tokens, bad_words and
    # logit_bias; the penalties; temperature; min_p; top_k and top_p
    structured_outputs: StructuredOutputsParams | None = None
    bad_words: list[str] = field(default_factory=list)  # never generated (every tokenization)
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence among the generated tokens
    repetition_penalty: float = 1.0  # divides (>0) or multiplies (<0) logits of prompt and output tokens
    min_p: float = 0.0  # drops tokens below min_p times the most likely token's probability
    # bad_words as token-id sequences, set by the engine with its tokenizer
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # vLLM's: reasoning tokens a thinking model may write before its closing tag is forced
    # (an engine with a reasoning parser); None: no limit
    thinking_token_budget: int | None = None

    def __post_init__(self) -> None:
        """Range checks that need no model; `verify` adds the model's. Each failure is a
        ValueError naming the field, so a bad request is refused before it is queued."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        _check(_is_int(self.n) and self.n >= 1, f"n must be an integer of at least 1, got {self.n!r}")
        _check(_is_number(self.temperature) and self.temperature >= 0,
               f"temperature must be a finite number >= 0, got {self.temperature!r}")
        _check(_is_number(self.top_p) and 0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(_is_int(self.top_k) and -1 <= self.top_k <= MAX_TOP_K,
               f"top_k must be -1 or 0 (disabled) or at most {MAX_TOP_K}, got {self.top_k!r}")
        _check(self.seed is None or (_is_int(self.seed) and SEED_MIN <= self.seed < SEED_END),
               f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}")
        _check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
               f"max_tokens must be at least 1, got {self.max_tokens!r}")
        _check(_is_int(self.min_tokens) and self.min_tokens >= 0,
               f"min_tokens must be non-negative, got {self.min_tokens!r}")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens,
               f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        _check(self.logprobs is None or (_is_int(self.logprobs) and self.logprobs >= 0),
               f"logprobs must be non-negative, got {self.logprobs!r}")
        _check(self.prompt_logprobs is None or (_is_int(self.prompt_logprobs) and self.prompt_logprobs >= -1),
               f"prompt_logprobs must be -1 or non-negative, got {self.prompt_logprobs!r}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings")
        _check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
               f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        self.bad_words = list(self.bad_words or [])
        self.logit_bias = dict(self.logit_bias or {})
        _check(all(isinstance(w, str) and w.strip() for w in self.bad_words), "bad_words must be non-empty strings")
        _check(all(_is_int(t) and t >= 0 and _is_number(b) and -100 <= b <= 100 for t, b in self.logit_bias.items()),
               "logit_bias must map token ids to numbers in [-100, 100]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -2 <= value <= 2, f"{name} must be in [-2, 2], got {value!r}")
        _check(_is_number(self.repetition_penalty) and self.repetition_penalty > 0,
               f"repetition_penalty must be a number > 0, got {self.repetition_penalty!r}")
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p!r}")
        _check(self.thinking_token_budget is None or (_is_int(self.thinking_token_budget)
                                                        and self.thinking_token_budget >= 0),
               f"thinking_token_budget must be a non-negative integer, got {self.thinking_token_budget!r}")
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.top_k == -1:
            self.top_k = 0

    def verify(self, vocab_size: int, max_n: int | None = None) -> None:
        """The checks that need the model: token ids within its vocabulary, and n within
        the engine's bound."""
        _check(max_n is None or self.n <= max_n, f"n is {self.n}, over this server's limit of {max_n} (--max-n)")
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        _check(not bad, f"stop_token_ids holds {bad[:1]}, not a token id of this model (0 to {vocab_size - 1})")
        bad = [t for t in self.logit_bias if t >= vocab_size]
        _check(not bad, f"logit_bias holds {bad[:1]}, not a token id of this model (0 to {vocab_size - 1})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or value <= vocab_size, f"{name} is {value}, over the vocabulary of {vocab_size}")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def with_stop_token_ids(self, token_ids: list[int]) -> SamplingParams:
        extra = [t for t in token_ids if t not in self.stop_token_ids]
        return replace(self, stop_token_ids=self.stop_token_ids + extra)

    def for_child(self, index: int) -> SamplingParams:
        """Params of the index-th of n samples: n=1, and a distinct seed when seeded."""
        seed = None if self.seed is None else (self.seed + index) % SEED_END  # stays a valid seed
        return replace(self, n=1, seed=seed)
