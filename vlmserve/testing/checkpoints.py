"""Small checkpoints built offline from a family's config: random weights, a byte-level
BPE tokenizer trained on the spot, the family's HF processor and a Qwen-style chat
template. `save_pretrained` writes the real weight names, so loading them exercises
the same code as a released checkpoint."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from vlmserve.models.qwen_chat import SPECIAL_TOKENS, build_tokenizer, qwen_chat_template, save_generation_config

@dataclass(frozen=True)
class Experts:
    """A mixture-of-experts feed-forward for the builders below."""

    num_experts: int = 8
    top_k: int = 2
    intermediate: int = 48
    shared_intermediate: int = 0  # Qwen3.5-MoE's shared expert
    dense_layers: tuple[int, ...] = field(default=())  # Qwen3-VL-MoE's mlp_only_layers

    def text_config(self) -> dict:
        # norm_topk_prob as released checkpoints write it (transformers always renormalises; vLLM reads it)
        out = dict(num_experts=self.num_experts, num_experts_per_tok=self.top_k, moe_intermediate_size=self.intermediate,
                   norm_topk_prob=True)
        if self.shared_intermediate:
            out["shared_expert_intermediate_size"] = self.shared_intermediate
        if self.dense_layers:
            out["mlp_only_layers"] = list(self.dense_layers)
        return out


CHAT_TEMPLATE = qwen_chat_template()

DEFAULT_CORPUS = [
    "Describe the image. What is in this picture? How many shapes are there?",
    "a small red circle in the top left and a large blue square in the center.",
    "The quick brown fox jumps over the lazy dog. Hello world, this is a test.",
    "system user assistant You are a helpful assistant. Answer the question.",
]


def random_model(model_cls: type, config, seed: int, scale: float = 1.0) -> torch.nn.Module:
    """A model of the config with random weights (randomize_weights), named as the config
    says its checkpoints are."""
    config.architectures = [model_cls.__name__]
    torch.manual_seed(seed)
    model = model_cls(config)
    randomize_weights(model, seed, scale=scale)
    return model


def randomize_weights(model: torch.nn.Module, seed: int, scale: float = 1.0) -> None:
    """Weights with enough spread that greedy choices are not near-ties (HF's default
    init at std 0.02 makes all logits nearly equal in a tiny model)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                if "norm" in name or "ln_" in name:
                    p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
                else:  # biases
                    p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:
                fan_in = p[0].numel()
                p.copy_(scale * torch.randn(p.shape, generator=gen) / fan_in**0.5)


def save_qwen2_family(path: Path, model_cls: type, processor_cls: type, config, tokenizer, seed: int,
                      min_pixels: int, max_pixels: int) -> Path:
    """Random weights for a Qwen2-VL or Qwen2.5-VL config, saved with the generation
    config, the family's processor and the tokenizer."""
    from transformers import Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    model = random_model(model_cls, config, seed)
    model.save_pretrained(str(path))
    save_generation_config(path, tokenizer)
    pixels = {"min_pixels": min_pixels, "max_pixels": max_pixels}
    processor = processor_cls(
        image_processor=Qwen2VLImageProcessor(**pixels),
        video_processor=Qwen2VLVideoProcessor(**pixels),
        tokenizer=tokenizer,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(str(path))
    return path


def new_checkpoint(path: str | Path, corpus: list[str] | None, vocab_size: int) -> tuple[Path, object, dict[str, int]]:
    """The checkpoint's folder, its tokenizer, and the ids of the special tokens."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(corpus or DEFAULT_CORPUS, vocab_size)
    return path, tokenizer, {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}


def media_token_ids(ids: dict[str, int]) -> dict[str, int]:
    """The config fields naming the media placeholder tokens."""
    return {"image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
            "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"]}


def qwen2_text_config(vocab_size: int, ids: dict[str, int], *, hidden_size: int = 64, intermediate_size: int = 128,
                      num_layers: int = 3, num_heads: int = 4, num_kv_heads: int = 2, sliding_window: int | None = None,
                      max_window_layers: int | None = None, max_position_embeddings: int = 4096,
                      tie_word_embeddings: bool = False) -> dict:
    """The language model of Qwen2-VL and Qwen2.5-VL (the same one); the tiny test sizes
    by default. Layers from max_window_layers on use the sliding window."""
    max_window_layers = num_layers if max_window_layers is None else max_window_layers
    head_dim = hidden_size // num_heads
    # M-RoPE sections over head_dim/2 frequencies, in Qwen's 1:1.5:1.5 proportion
    quarter = head_dim // 2 // 4
    mrope_section = [quarter, (head_dim // 2 - quarter) // 2, head_dim // 2 - quarter - (head_dim // 2 - quarter) // 2]
    return dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        use_sliding_window=sliding_window is not None,
        sliding_window=sliding_window or 4096,
        max_window_layers=max_window_layers,
        max_position_embeddings=max_position_embeddings,
        rope_parameters={"rope_type": "default", "mrope_section": mrope_section, "rope_theta": 10000.0},
        eos_token_id=ids["<|im_end|>"],
        bos_token_id=ids["<|endoftext|>"],
        pad_token_id=ids["<|endoftext|>"],
        tie_word_embeddings=tie_word_embeddings,
    )


def build_qwen2_vl(
    path: str | Path,
    *,
    vision_embed: int = 32,
    vision_depth: int = 2,
    vision_heads: int = 2,
    max_pixels: int = 28 * 28 * 64,
    min_pixels: int = 28 * 28 * 4,
    vocab_size: int = 512,
    seed: int = 0,
    **text_sizes,
) -> Path:
    """A tiny Qwen2-VL (full attention in every layer, as the released checkpoints);
    text_sizes: qwen2_text_config's (hidden_size, num_layers, ...)."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLProcessor

    path, tokenizer, ids = new_checkpoint(path, None, vocab_size)
    config = Qwen2VLConfig(
        text_config=(text := qwen2_text_config(len(tokenizer), ids, **text_sizes)),
        vision_config=dict(
            depth=vision_depth,
            embed_dim=vision_embed,
            hidden_size=text["hidden_size"],  # the merger's output: the language model's width
            mlp_ratio=2,
            num_heads=vision_heads,
            hidden_act="quick_gelu",
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
        ),
        **media_token_ids(ids),
    )
    return save_qwen2_family(path, Qwen2VLForConditionalGeneration, Qwen2VLProcessor, config, tokenizer, seed,
                             min_pixels, max_pixels)


def build_qwen2_5_vl(
    path: str | Path,
    *,
    sliding_window: int | None = 32,
    max_window_layers: int = 2,
    vision_hidden: int = 32,
    vision_depth: int = 2,
    vision_heads: int = 2,
    max_pixels: int = 28 * 28 * 64,
    min_pixels: int = 28 * 28 * 4,
    vocab_size: int = 512,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    corpus: list[str] | None = None,
    **text_sizes,
) -> Path:
    """A tiny Qwen2.5-VL; layers >= max_window_layers use sliding-window attention;
    text_sizes: qwen2_text_config's (hidden_size, num_layers, ...)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor

    path, tokenizer, ids = new_checkpoint(path, corpus, vocab_size)
    config = Qwen2_5_VLConfig(
        text_config=(text := qwen2_text_config(len(tokenizer), ids, sliding_window=sliding_window,
                                               max_window_layers=max_window_layers,
                                               tie_word_embeddings=tie_word_embeddings, **text_sizes)),
        vision_config=dict(
            depth=vision_depth,
            hidden_size=vision_hidden,
            intermediate_size=2 * vision_hidden,
            num_heads=vision_heads,
            out_hidden_size=text["hidden_size"],
            window_size=56,  # 2x2 merged units per window: several windows per test image
            fullatt_block_indexes=[vision_depth - 1],
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            tokens_per_second=2,
        ),
        **media_token_ids(ids),
        tie_word_embeddings=tie_word_embeddings,
    )
    return save_qwen2_family(path, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor, config, tokenizer, seed,
                             min_pixels, max_pixels)


def build_qwen3_5(
    path: str | Path,
    *,
    hidden_size: int = 64,
    layer_types: tuple[str, ...] = ("linear_attention", "full_attention", "linear_attention", "full_attention"),
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 128,
    linear_heads: tuple[int, int] = (2, 4),  # key heads, value heads
    linear_head_dim: int = 16,
    vision_hidden: int = 32,
    vision_depth: int = 2,
    vision_heads: int = 2,
    max_pixels: int = 32 * 32 * 36,
    min_pixels: int = 32 * 32 * 4,
    vocab_size: int = 512,
    seed: int = 0,
    weight_scale: float = 0.4,
    corpus: list[str] | None = None,
    experts: Experts | None = None,
    partial_rotary: float = 0.5,
) -> Path:
    """A tiny Qwen3.5: Gated DeltaNet and gated-attention layers (with experts:
    Qwen3.5-MoE), Qwen3-VL vision tower."""
    import transformers

    family = "Qwen3_5Moe" if experts else "Qwen3_5"
    model_cls = getattr(transformers, f"{family}ForConditionalGeneration")

    path, tokenizer, ids = new_checkpoint(path, corpus, vocab_size)
    config = _qwen3_5_config(len(tokenizer), ids, hidden_size, layer_types, num_heads, num_kv_heads, head_dim,
                             intermediate_size, linear_heads, linear_head_dim, vision_hidden, vision_depth, vision_heads,
                             experts, partial_rotary)
    model = random_model(model_cls, config, seed, weight_scale)
    with torch.no_grad():  # decay rates of a trained model: exp(A_log) in (0, 16)
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.01, 4).log())
    model.save_pretrained(str(path))
    save_qwen3_files(path, tokenizer, min_pixels, max_pixels)
    return path


def build_qwen3_vl(
    path: str | Path,
    *,
    hidden_size: int = 64,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 128,
    vision_hidden: int = 32,
    vision_depth: int = 3,
    vision_heads: int = 2,
    vision_intermediate: int | None = None,
    num_position_embeddings: int = 64,
    deepstack_indexes: tuple[int, ...] = (0, 1),
    rope_theta: float = 10000.0,
    mrope_section: list[int] | None = None,
    experts: Experts | None = None,
    max_pixels: int = 32 * 32 * 36,
    min_pixels: int = 32 * 32 * 4,
    vocab_size: int = 512,
    seed: int = 0,
    weight_scale: float = 0.4,
    corpus: list[str] | None = None,
) -> Path:
    """A tiny Qwen3-VL: Qwen3 decoder (with experts: Qwen3-VL-MoE), vision tower with
    DeepStack levels taken after the given blocks."""
    import transformers

    family = "Qwen3VLMoe" if experts else "Qwen3VL"
    config_cls = getattr(transformers, f"{family}Config")
    model_cls = getattr(transformers, f"{family}ForConditionalGeneration")

    path, tokenizer, ids = new_checkpoint(path, corpus, vocab_size)
    freqs = head_dim // 2
    text = dict(
        **(experts.text_config() if experts else {}),
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        head_dim=head_dim, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta, "mrope_interleaved": True,
                         "mrope_section": mrope_section or [freqs - 2 * (freqs // 3), freqs // 3, freqs // 3]},
        eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"], tie_word_embeddings=False,
    )
    vision = dict(
        depth=vision_depth, hidden_size=vision_hidden, intermediate_size=vision_intermediate or 2 * vision_hidden,
        num_heads=vision_heads, patch_size=16, temporal_patch_size=2, spatial_merge_size=2,
        out_hidden_size=hidden_size, num_position_embeddings=num_position_embeddings,
        hidden_act="gelu_pytorch_tanh", deepstack_visual_indexes=list(deepstack_indexes),
    )
    config = config_cls(text_config=text, vision_config=vision, **media_token_ids(ids), tie_word_embeddings=False)
    model = random_model(model_cls, config, seed, weight_scale)
    model.save_pretrained(str(path))
    if experts:
        _experts_as_released(path)
    save_qwen3_files(path, tokenizer, min_pixels, max_pixels)
    return path


def save_qwen3_files(path: Path, tokenizer, min_pixels: int, max_pixels: int) -> None:
    """The generation config and the Qwen3-VL processor (Qwen3.5 uses it too)."""
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    save_generation_config(path, tokenizer)
    Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(min_pixels=min_pixels, max_pixels=max_pixels, patch_size=16,
                                              merge_size=2),
        video_processor=Qwen3VLVideoProcessor(patch_size=16, merge_size=2),
        tokenizer=tokenizer,
        chat_template=CHAT_TEMPLATE,
    ).save_pretrained(str(path))


def _experts_as_released(path: Path) -> None:
    """Qwen3-VL-MoE's experts as Qwen's checkpoints store them, [experts, in, out]
    (transformers 5 writes [experts, out, in]; it and vLLM read the released layout)."""
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    weights = load_file(str(file))
    save_file({k: v.transpose(1, 2).contiguous() if ".experts." in k else v for k, v in weights.items()}, str(file),
              metadata={"format": "pt"})


def _rename_weights(path: Path, prefix: str, new_prefix: str) -> None:
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    weights = load_file(str(file))
    save_file({(new_prefix + k[len(prefix):] if k.startswith(prefix) else k): v for k, v in weights.items()},
              str(file), metadata={"format": "pt"})


def _qwen3_5_config(vocab_size, ids, hidden_size, layer_types, num_heads, num_kv_heads, head_dim, intermediate_size,
                    linear_heads, linear_head_dim, vision_hidden, vision_depth, vision_heads, experts=None,
                    partial_rotary=0.5):
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig

    rotary = int(head_dim * partial_rotary)
    freqs = rotary // 2
    section = [freqs - 2 * (freqs // 3), freqs // 3, freqs // 3]
    config = (Qwen3_5MoeConfig if experts else Qwen3_5Config)(
        text_config=dict(
            **(experts.text_config() if experts else {}),
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=len(layer_types),
            layer_types=list(layer_types),
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            linear_num_key_heads=linear_heads[0],
            linear_num_value_heads=linear_heads[1],
            linear_key_head_dim=linear_head_dim,
            linear_value_head_dim=linear_head_dim,
            linear_conv_kernel_dim=4,
            max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": partial_rotary,
                             "mrope_section": section, "mrope_interleaved": True},
            eos_token_id=ids["<|im_end|>"],
            pad_token_id=ids["<|endoftext|>"],
            tie_word_embeddings=False,
        ),
        vision_config=dict(
            depth=vision_depth, hidden_size=vision_hidden, intermediate_size=2 * vision_hidden,
            num_heads=vision_heads, patch_size=16, temporal_patch_size=2, spatial_merge_size=2,
            out_hidden_size=hidden_size, num_position_embeddings=64, hidden_act="gelu_pytorch_tanh",
        ),
        **media_token_ids(ids),
        tie_word_embeddings=False,
    )
    return config


GEMMA_SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>",
                        "<end_of_image>", "<image_soft_token>"]


def gemma_chat_template() -> str:
    """Gemma's turns: <start_of_turn>user\n...<end_of_turn>\n, the assistant as `model`;
    a picture is <start_of_image> (the processor expands it); a system message opens the
    first user turn."""
    return (
        "{{- bos_token }}"
        "{%- for message in messages %}"
        "{%- set role = 'model' if message['role'] == 'assistant' else 'user' %}"
        "{%- if not (message['role'] == 'system' or (loop.index0 == 1 and messages[0]['role'] == 'system')) %}"
        "{{- '<start_of_turn>' + role + '\n' }}"
        "{%- elif message['role'] == 'system' %}{{- '<start_of_turn>user\n' }}"
        "{%- endif %}"
        "{%- if message['content'] is string %}{{- message['content'] }}"
        "{%- else %}"
        "{%- for part in message['content'] %}"
        "{%- if part['type'] == 'image' or part['type'] == 'image_url' %}{{- '<start_of_image>' }}"
        "{%- elif part['type'] == 'text' %}{{- part['text'] }}"
        "{%- endif %}"
        "{%- endfor %}"
        "{%- endif %}"
        "{%- if message['role'] == 'system' %}{{- '\n\n' }}{%- else %}{{- '<end_of_turn>\n' }}{%- endif %}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<start_of_turn>model\n' }}{%- endif %}"
    )


def save_gemma3_files(path: Path, tokenizer, ids: dict[str, int], image_size: int, mm_tokens_per_image: int) -> None:
    from transformers import Gemma3ImageProcessor, Gemma3Processor, GenerationConfig

    GenerationConfig(eos_token_id=[ids["<eos>"], ids["<end_of_turn>"]], pad_token_id=ids["<pad>"],
                     bos_token_id=ids["<bos>"], do_sample=False).save_pretrained(str(path))
    Gemma3Processor(
        image_processor=Gemma3ImageProcessor(size={"height": image_size, "width": image_size}),
        tokenizer=tokenizer, chat_template=gemma_chat_template(), image_seq_length=mm_tokens_per_image,
    ).save_pretrained(str(path))


def gemma_tokenizer(corpus: list[str] | None, vocab_size: int):
    tokenizer = build_tokenizer(
        corpus or DEFAULT_CORPUS, vocab_size, GEMMA_SPECIAL_TOKENS, bos_token="<bos>", eos_token="<eos>",
        pad_token="<pad>", extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                                 "image_token": "<image_soft_token>"})
    tokenizer.add_tokens(["\n", "\n\n", "\n\n\n", "\n\n\n\n"])  # single tokens in Gemma's vocabulary (vLLM relies on it)
    return tokenizer


def build_gemma3(
    path: str | Path,
    *,
    hidden_size: int = 64,
    num_layers: int = 4,
    sliding_pattern: int = 2,
    sliding_window: int = 24,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 128,
    vision_hidden: int = 32,
    vision_depth: int = 2,
    vision_heads: int = 2,
    image_size: int = 64,
    patch_size: int = 8,
    mm_tokens_per_image: int = 16,
    rope_scaling_factor: float = 8.0,
    vocab_size: int = 512,
    seed: int = 0,
    weight_scale: float = 0.4,
    corpus: list[str] | None = None,
) -> Path:
    """A tiny Gemma 3: every `sliding_pattern`-th layer global, the others a sliding
    window (the released models: 6, 1024); SigLIP tower pooled to mm_tokens_per_image.
    Pan-and-scan is set as released: off unless asked for, then with the processor's
    defaults (crops of 256 px or more, for pictures over 1.2:1)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = gemma_tokenizer(corpus, vocab_size)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in GEMMA_SPECIAL_TOKENS}
    layer_types = ["full_attention" if (i + 1) % sliding_pattern == 0 else "sliding_attention" for i in range(num_layers)]
    text = dict(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        head_dim=head_dim, query_pre_attn_scalar=head_dim, sliding_window=sliding_window, layer_types=layer_types,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": rope_scaling_factor, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
        max_position_embeddings=4096, eos_token_id=[ids["<eos>"], ids["<end_of_turn>"]],
        bos_token_id=ids["<bos>"], pad_token_id=ids["<pad>"],
    )
    vision = dict(hidden_size=vision_hidden, intermediate_size=2 * vision_hidden, num_hidden_layers=vision_depth,
                  num_attention_heads=vision_heads, image_size=image_size, patch_size=patch_size, vision_use_head=False)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=mm_tokens_per_image,
                          boi_token_index=ids["<start_of_image>"], eoi_token_index=ids["<end_of_image>"],
                          image_token_index=ids["<image_soft_token>"])
    model = random_model(Gemma3ForConditionalGeneration, config, seed, weight_scale)
    with torch.no_grad():  # the decoder's and projector's (1 + weight) norms: near zero, as trained ones are
        for name, p in model.named_parameters():
            if "norm" in name and ("language_model" in name or "soft_emb_norm" in name):
                p.sub_(1.0)
    model.save_pretrained(str(path))
    _rename_weights(path, "vision_tower.", "vision_tower.vision_model.")  # as Google's releases name them
    save_gemma3_files(path, tokenizer, ids, image_size, mm_tokens_per_image)
    return path
