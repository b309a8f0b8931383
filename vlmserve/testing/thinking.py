"""A tiny Qwen3-VL that thinks, then answers: Qwen3's thinking conventions (`<think>` and
`</think>` as added, non-special tokens, a chat template that opens the reasoning in the
generation prompt and closes it at once with `enable_thinking: false`), with weights
trained for a few seconds to overfit a handful of conversations. Tests of the reasoning
parser, the thinking budget and grammars after the reasoning run on it through the
real engine."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from vlmserve.models.qwen_chat import (
    SPECIAL_TOKENS,
    build_tokenizer,
    save_generation_config,
)
from vlmserve.testing.checkpoints import media_token_ids, random_model

logger = logging.getLogger(__name__)

THINK_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]  # Qwen3's added tokens (not special)

# tools are listed as Qwen3's template lists them; the generation prompt opens the reasoning
# (Qwen3.5, Qwen3-VL-Thinking), or, with enable_thinking false, closes it at once
THINKING_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\n# Tools\n\n<tools>' }}"
    "{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\n</tools>\n\nCall a function inside <tool_call></tool_call> tags.<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\n<tool_response>\n' + message['content'] + '\n</tool_response><|im_end|>\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\n' }}"
    "{%- if message['content'] is string %}"
    "{%- set text = message['content'] %}"
    "{%- if message['role'] == 'assistant' and '</think>' in text %}"
    "{%- set text = text.split('</think>')[-1].lstrip('\n') %}"
    "{%- endif %}"
    "{{- text }}"
    "{%- else %}"
    "{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'video' %}{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}"
    "{%- endif %}"
    "{%- for call in message.get('tool_calls') or [] %}"
    "{{- '<tool_call>\n{\"name\":\"' + call['function']['name'] + '\",\"arguments\":' "
    "+ (call['function']['arguments'] | tojson) + '}\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\n\n</think>\n\n' }}"
    "{%- else %}{{- '<think>\n' }}{%- endif %}"
    "{%- endif %}"
)

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@dataclass(frozen=True)
class Lesson:
    """A conversation the model learns: the user's question (and tools), its reasoning
    (None: asked with enable_thinking false), its answer, and what comes between the
    closing tag and the answer (none where a grammar will constrain the answer: it starts
    at once after the reasoning)."""

    question: str
    reasoning: str | None
    answer: str
    tools: bool = False
    gap: str = "\n\n"


LESSONS = [
    Lesson("What is two plus two?", "Two plus two means adding two to two. Counting up from two gives three, "
           "then four. So the sum is four.", "The answer is four."),
    Lesson("What is two plus two?", None, "Four."),
    Lesson("Plan a trip to Paris as JSON.", "The city is Paris and a short trip lasts three days. I will write "
           "the city and the number of days.", '{"city":"Paris","days":3}', gap=""),
    Lesson("Is the sky blue? Say yes or no.", "On a clear day the sky looks blue because air scatters blue "
           "light the most.", "yes", gap=""),
    Lesson("What is the weather in Paris?", "The user wants the weather in Paris. I should call the weather "
           "tool with the city.", '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>',
           tools=True, gap=""),
    Lesson("What is the weather in Rome?", "The user wants the weather in Rome. I will call the tool in XML.",
           "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>",
           tools=True, gap=""),
]

CORPUS = [lesson.question + " " + (lesson.reasoning or "") + " " + lesson.answer for lesson in LESSONS]


def thinking_tokenizer(vocab_size: int = 640):
    """A byte-level BPE tokenizer with Qwen's special tokens and Qwen3's reasoning and
    tool-call tokens as added (non-special) tokens: the detokenized answer keeps them."""
    tokenizer = build_tokenizer(CORPUS, vocab_size)
    tokenizer.add_tokens(THINK_TOKENS)
    return tokenizer


def build_qwen3_thinking(path: str | Path, *, steps: int = 400, seed: int = 0) -> Path:
    """The checkpoint, trained `steps` steps (a few seconds on a CPU) until it answers its
    lessons greedily, word for word."""
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = thinking_tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_interleaved": True,
                                 "mrope_section": [4, 2, 2]},
                eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"], tie_word_embeddings=False)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, temporal_patch_size=2,
                  spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=64,
                  hidden_act="gelu_pytorch_tanh", deepstack_visual_indexes=[0])
    config = transformers.Qwen3VLConfig(text_config=text, vision_config=vision, **media_token_ids(ids),
                                        tie_word_embeddings=False)
    model = random_model(transformers.Qwen3VLForConditionalGeneration, config, seed, 0.4)
    train(model, training_rows(tokenizer), steps)
    model.save_pretrained(str(path))
    save_processor(path, tokenizer)
    return path


def save_processor(path: Path, tokenizer) -> None:
    from transformers import (
        Qwen2VLImageProcessor,
        Qwen3VLProcessor,
        Qwen3VLVideoProcessor,
    )

    save_generation_config(path, tokenizer)
    Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(min_pixels=32 * 32 * 4, max_pixels=32 * 32 * 36, patch_size=16,
                                              merge_size=2),
        video_processor=Qwen3VLVideoProcessor(patch_size=16, merge_size=2),
        tokenizer=tokenizer, chat_template=THINKING_TEMPLATE,
    ).save_pretrained(str(path))


def render(tokenizer, lesson: Lesson) -> str:
    """The lesson's prompt as the chat template writes it."""
    kwargs = {} if lesson.reasoning is not None else {"enable_thinking": False}
    return tokenizer.apply_chat_template([{"role": "user", "content": lesson.question}], chat_template=THINKING_TEMPLATE,
                                         tools=[WEATHER_TOOL] if lesson.tools else None, add_generation_prompt=True,
                                         tokenize=False, **kwargs)


def training_rows(tokenizer) -> list[tuple[list[int], list[int]]]:
    """(tokens, labels) per row: each lesson whole, and the first one with its reasoning
    cut after a few tokens and closed (as a thinking budget closes it), so that its answer
    follows a forced `</think>` too. Labels are -100 on the prompt and on a forced
    `</think>`."""
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    rows = []
    for i, lesson in enumerate(LESSONS):
        prompt = tokenizer.encode(render(tokenizer, lesson), add_special_tokens=False)
        answer = tokenizer.encode(lesson.answer, add_special_tokens=False) + [end]
        if lesson.reasoning is None:
            rows.append((prompt + answer, [-100] * len(prompt) + answer))
            continue
        thought = tokenizer.encode(lesson.reasoning, add_special_tokens=False)
        close = tokenizer.encode("\n</think>" + lesson.gap, add_special_tokens=False)
        rows.append((prompt + thought + close + answer, [-100] * len(prompt) + thought + close + answer))
        for cut in range(1, len(thought), 2) if i == 0 else ():  # a budget spent after `cut` tokens
            forced = [tokenizer.convert_tokens_to_ids("</think>")]
            tail = tokenizer.encode("\n\n", add_special_tokens=False) + answer
            rows.append((prompt + thought[:cut] + forced + tail, [-100] * (len(prompt) + cut + 1) + tail))
    return rows


def _batches(rows: list[tuple[list[int], list[int]]], size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rows of similar lengths together, padded at the end (causal attention never reads
    the padding): (tokens, next-token targets)."""
    rows = sorted(rows, key=lambda row: len(row[0]))
    out = []
    for start in range(0, len(rows), size):
        group = rows[start : start + size]
        width = max(len(tokens) for tokens, _ in group)
        tokens = torch.zeros(len(group), width, dtype=torch.long)
        labels = torch.full((len(group), width), -100, dtype=torch.long)
        for i, (t, lab) in enumerate(group):
            tokens[i, : len(t)], labels[i, : len(lab)] = torch.tensor(t), torch.tensor(lab)
        out.append((tokens, labels[:, 1:].reshape(-1)))
    return out


def train(model: torch.nn.Module, rows: list[tuple[list[int], list[int]]], steps: int) -> None:
    """Plain next-token training on every row each step, through the language model alone
    (positions are plain text ones), Adam, until memorized."""
    batches = _batches(rows, 8)
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-2)
    model.train()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # ops this small gain nothing from a second thread, and wait for it on a busy machine
    try:
        step, total = _steps(model, batches, optimizer, steps, len(rows))
    finally:
        torch.set_num_threads(threads)
    logger.info("thinking checkpoint trained %d steps, loss %.4f", step + 1, total)
    model.eval()


def _steps(model: torch.nn.Module, batches, optimizer, steps: int, num_rows: int) -> tuple[int, float]:
    for step in range(steps):
        optimizer.zero_grad()
        total = 0.0
        for tokens, targets in batches:
            hidden = model.model.language_model(input_ids=tokens, use_cache=False).last_hidden_state
            logits = model.lm_head(hidden[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets,
                                                     reduction="sum") / num_rows
            loss.backward()
            total += loss.item()
        optimizer.step()
        if total < 1e-2:
            break
    return step, total
