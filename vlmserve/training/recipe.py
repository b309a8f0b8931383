"""What the default model is: its tokenizer, chat template, processor and architecture.

A Qwen3.5 (Gated DeltaNet + gated attention, Qwen3-VL-style vision tower) small enough
to train on a 2-core CPU and to ship inside the package, sized for the shapes world:
pictures are resized to 192 x 192, 12 x 12 patches of 16 px, merged 4 x 4 into 3 x 3
tokens: exactly one language-model token per grid cell; a video's frames each the same. The tower sums up a cell, and
the language model looks up 9 tokens instead of 36 (4 per cell, an object often in
only one of them), which is what its questions ask: what is in which cell.
"""

from __future__ import annotations

import random
from pathlib import Path

from vlmserve.models.qwen_chat import SPECIAL_TOKENS, qwen_chat_template, save_generation_config
from vlmserve.models.qwen_chat import build_tokenizer as byte_level_bpe
from vlmserve.training import shapes

# Qwen-style chat; a video is a bare <|video_pad|>, which the processor expands into
# "<t seconds><|vision_start|>...<|vision_end|>" per pair of frames
CHAT_TEMPLATE = qwen_chat_template(video="<|video_pad|>")

IMAGE_SIDE = 192
# one frame a patch: each video frame is seen as a picture is (a picture is one frame)
FRAMES_PER_TOKEN = 1
PATCH = 16
MERGE = 4

TEXT_CONFIG = dict(
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=6,
    # Gated DeltaNet and full attention alternate: attention reads the image by position,
    # the recurrent layers carry what has been said so far
    layer_types=["linear_attention", "full_attention"] * 3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_conv_kernel_dim=4,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    # half of each head rotates; 16 frequencies interleaved over time, rows and columns
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "mrope_section": [6, 5, 5],
        "mrope_interleaved": True,
    },
    tie_word_embeddings=True,
)

VISION_CONFIG = dict(
    depth=4,
    hidden_size=128,
    intermediate_size=512,
    num_heads=2,
    patch_size=PATCH,
    temporal_patch_size=FRAMES_PER_TOKEN,
    spatial_merge_size=MERGE,
    out_hidden_size=256,
    num_position_embeddings=(IMAGE_SIDE // PATCH) ** 2,
    hidden_act="gelu_pytorch_tanh",
)

# any square picture of 160..320 px comes out at exactly 192 x 192
IMAGE_PROCESSOR = dict(min_pixels=176 * 176, max_pixels=208 * 208, patch_size=PATCH, merge_size=MERGE,
                       temporal_patch_size=FRAMES_PER_TOKEN)
# videos: 4 frames sampled evenly (a straight-line move shows in any 4), each resized to
# 192 x 192 and normalised like a picture: 4 frames x 9 tokens, whatever the clip's length
# and size, each token what a picture of that frame would give
VIDEO_FRAMES = 4
VIDEO_PROCESSOR = dict(
    size={"shortest_edge": VIDEO_FRAMES * 176 * 176, "longest_edge": VIDEO_FRAMES * 208 * 208},
    patch_size=PATCH, merge_size=MERGE, temporal_patch_size=FRAMES_PER_TOKEN,
    fps=2, min_frames=VIDEO_FRAMES, max_frames=VIDEO_FRAMES,
)
VIDEO_SLOTS = VIDEO_FRAMES // FRAMES_PER_TOKEN  # a clip's tokens: VIDEO_SLOTS x 9


def one_frame_patches(weights: dict) -> dict:
    """A model of two-frame patches (the shipped model before its video captions were
    retrained) as one of this recipe's one-frame patches: the two frames' weights summed.
    A picture is its frame twice, so it is seen exactly as before."""
    key = "model.visual.patch_embed.proj.weight"
    w = weights[key]
    if w.shape[2] == FRAMES_PER_TOKEN:
        return weights
    return {**weights, key: w.float().sum(2, keepdim=True).to(w.dtype)}


def tokenizer_corpus(n_scenes: int = 3000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    corpus = ["system user assistant", "You are a helpful assistant."]
    for _ in range(n_scenes):
        scene = shapes.random_scene(rng)
        for qa in shapes.all_questions(scene, rng):
            corpus += [qa.question, qa.answer]
    for _ in range(200):
        corpus.append(shapes.random_video(rng, side=160).question.question)
    corpus += [f"<{t / 2:.1f} seconds>" for t in range(40)]
    corpus += shapes.DIRECTIONS
    return corpus


def build_tokenizer():
    return byte_level_bpe(tokenizer_corpus(), vocab_size=640)


def build_processor(tokenizer):
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    images = Qwen2VLImageProcessor(**IMAGE_PROCESSOR)
    return Qwen3VLProcessor(
        image_processor=images,
        # frames normalised as pictures are
        video_processor=Qwen3VLVideoProcessor(**VIDEO_PROCESSOR, image_mean=images.image_mean, image_std=images.image_std),
        tokenizer=tokenizer,
        chat_template=CHAT_TEMPLATE,
    )


def build_config(tokenizer):
    from transformers import Qwen3_5Config

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    config = Qwen3_5Config(
        text_config=dict(
            TEXT_CONFIG,
            vocab_size=len(tokenizer),
            eos_token_id=ids["<|im_end|>"],
            pad_token_id=ids["<|endoftext|>"],
            bos_token_id=ids["<|endoftext|>"],
        ),
        vision_config=VISION_CONFIG,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    config.architectures = ["Qwen3_5ForConditionalGeneration"]
    return config


def save_skeleton(path: Path, tokenizer, processor) -> None:
    """Everything but the weights: tokenizer, processor, chat template, generation config."""
    path.mkdir(parents=True, exist_ok=True)
    processor.save_pretrained(str(path))
    save_generation_config(path, tokenizer, max_new_tokens=64)
