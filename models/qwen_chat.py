"""The Qwen family's chat conventions as the checkpoints built here carry them (the test
checkpoints, the shipped model): its special tokens, its chat template with pictures,
videos and tools, a generation config that ends on <|im_end|>, and a byte-level BPE
tokenizer trained on the spot with those special tokens."""

from __future__ import annotations

from pathlib import Path

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]


def qwen_chat_template(video: str = "<|vision_start|><|video_pad|><|vision_end|>") -> str:
    """Qwen-style: <|im_start|>role\n...<|im_end|>\n; a picture is
    <|vision_start|><|image_pad|><|vision_end|>, a video the given markup (Qwen3-style
    processors expand a bare <|video_pad|> into timestamped frame groups themselves).
    Tools as Qwen3's template writes them: listed in a system block, an assistant's calls
    as <tool_call> JSON blocks, a tool's result as a <tool_response> in a user turn."""
    return (
        "{%- if tools %}"
        "{{- '<|im_start|>system\n' }}"
        "{%- if messages[0]['role'] == 'system' and messages[0]['content'] is string %}"
        "{{- messages[0]['content'] + '\n\n' }}"
        "{%- endif %}"
        "{{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}"
        "{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}"
        "{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
        "\"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n' }}"
        "{%- endif %}"
        "{%- for message in messages %}"
        "{%- if tools and loop.first and message['role'] == 'system' and message['content'] is string %}"
        "{%- elif message['role'] == 'tool' %}"
        "{{- '<|im_start|>user\n<tool_response>\n' + message['content'] + '\n</tool_response><|im_end|>\n' }}"
        "{%- else %}"
        "{{- '<|im_start|>' + message['role'] + '\n' }}"
        "{%- if message['content'] is string %}"
        "{{- message['content'] }}"
        "{%- else %}"
        "{%- for part in message['content'] %}"
        "{%- if part['type'] == 'image' or part['type'] == 'image_url' %}"
        "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
        "{%- elif part['type'] == 'video' or part['type'] == 'video_url' %}"
        "{{- '" + video + "' }}"
        "{%- elif part['type'] == 'text' %}"
        "{{- part['text'] }}"
        "{%- endif %}"
        "{%- endfor %}"
        "{%- endif %}"
        "{%- for call in message.get('tool_calls') or [] %}"
        "{%- if loop.first and message['content'] %}{{- '\n' }}{%- endif %}"
        "{%- if not loop.first %}{{- '\n' }}{%- endif %}"
        "{{- '<tool_call>\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' "
        "+ (call['function']['arguments'] | tojson) + '}\n</tool_call>' }}"
        "{%- endfor %}"
        "{{- '<|im_end|>\n' }}"
        "{%- endif %}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}"
        "{{- '<|im_start|>assistant\n' }}"
        "{%- endif %}"
    )


def save_generation_config(path: Path, tokenizer, **extra) -> None:
    from transformers import GenerationConfig

    GenerationConfig(eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                     pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"), do_sample=False,
                     **extra).save_pretrained(str(path))


def build_tokenizer(corpus: list[str], vocab_size: int = 512,
                    special_tokens: list[str] = SPECIAL_TOKENS, **named_tokens):
    """A byte-level BPE tokenizer (any text encodes) with a family's special tokens (Qwen's
    by default) and their roles (eos_token=..., extra_special_tokens=...)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus * 4, trainer)
    roles = named_tokens or dict(eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None)
    return PreTrainedTokenizerFast(tokenizer_object=tok, **roles)
