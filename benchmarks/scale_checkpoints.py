"""Benchmark checkpoints at published widths, built offline with random weights:

- `qwen2_5_vl_3b`: Qwen2.5-VL-3B's widths (text hidden 2048, 36 layers, 16 / 2 heads of
  128, MLP 11008, vocabulary 151,936, tied embeddings; vision 32 blocks 1280 wide, 16
  heads, MLP 3420, windows of 112 px with full attention in blocks 7, 15, 23, 31);
- `qwen3_5`: Qwen3.5 at transformers' `Qwen3_5Config()` widths (text hidden 4096, 32
  layers, three Gated DeltaNet layers (16 key / 32 value heads of 128) to one gated
  attention layer (16 / 4 heads of 256), MLP 12288, vocabulary 248,320; vision 27 blocks
  1152 wide, 16 heads, MLP 4304, patches of 16).

`--layers N` cuts the text model to its first N layers and the tower to as many blocks
(keeping a full-attention block), so that a run fits a few minutes here; full depth by
default. The tokenizer is the small test one, but the vocabulary is the real size: the
rows of the output matrix past the tokenizer are zero, so greedy answers stay inside it
while every engine pays for the whole head.

The weights are drawn tensor by tensor straight into bf16 safetensors shards (a 9B
checkpoint never sits in memory in fp32):

    python benchmarks/scale_checkpoints.py qwen2_5_vl_3b --layers 8     # prints the folder
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import CACHE  # noqa: E402

FAMILIES = ("qwen2_5_vl_3b", "qwen3_5")
SHARD_BYTES = 2 << 30
TOKENIZER_VOCAB = 4096  # the test tokenizer's size; the model's vocabulary is the published one


def qwen2_5_vl_3b_config(ids: dict[str, int], layers: int | None):
    from transformers import Qwen2_5_VLConfig

    from vlmserve.testing.checkpoints import media_token_ids

    text_layers, vision_depth = (36, 32) if layers is None else (layers, layers)
    full = [i for i in (7, 15, 23, 31) if i < vision_depth] or [vision_depth - 1]
    text = dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=text_layers,
                num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=128000,
                rope_parameters={"rope_type": "default", "mrope_section": [16, 24, 24], "rope_theta": 1e6},
                use_sliding_window=False, sliding_window=32768, max_window_layers=text_layers, rms_norm_eps=1e-6,
                eos_token_id=ids["<|im_end|>"], bos_token_id=ids["<|endoftext|>"], pad_token_id=ids["<|endoftext|>"],
                tie_word_embeddings=True, hidden_act="silu")
    vision = dict(depth=vision_depth, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                  window_size=112, fullatt_block_indexes=full, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2, tokens_per_second=2, hidden_act="silu", in_chans=3)
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, **media_token_ids(ids), tie_word_embeddings=True)


def qwen3_5_config(ids: dict[str, int], layers: int | None):
    from transformers import Qwen3_5Config

    from vlmserve.testing.checkpoints import media_token_ids

    released = Qwen3_5Config()
    text, vision = released.text_config.to_dict(), released.vision_config.to_dict()
    if layers is not None:
        text.update(num_hidden_layers=layers, layer_types=text["layer_types"][:layers])
        vision.update(depth=layers)
    text.update(eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"], bos_token_id=None)
    vision.update(out_hidden_size=text["hidden_size"])
    return Qwen3_5Config(text_config=text, vision_config=vision, **media_token_ids(ids),
                         tie_word_embeddings=released.tie_word_embeddings)


def build(family: str, layers: int | None, out: Path | None = None, seed: int = 0, device: str = "cpu") -> Path:
    """The checkpoint folder (built once, then reused). `device` draws the random weights
    there (a GPU draws a 9B checkpoint in seconds; the draws differ from the CPU's, so
    the folder's name says where they were made)."""
    import transformers

    from vlmserve.models.qwen_chat import save_generation_config
    from vlmserve.testing.checkpoints import CHAT_TEMPLATE, new_checkpoint, save_qwen3_files

    where = "" if device == "cpu" else f"-{torch.device(device).type}"
    out = out or CACHE / f"scale-{family}-{'full' if layers is None else f'{layers}l'}{where}-v2"
    if (out / "model.safetensors.index.json").exists():
        return out
    out, tokenizer, ids = new_checkpoint(out, None, TOKENIZER_VOCAB)
    if family == "qwen2_5_vl_3b":
        config, model_cls = qwen2_5_vl_3b_config(ids, layers), transformers.Qwen2_5_VLForConditionalGeneration
    elif family == "qwen3_5":
        config, model_cls = qwen3_5_config(ids, layers), transformers.Qwen3_5ForConditionalGeneration
    else:
        raise ValueError(f"unknown family {family!r}; one of {FAMILIES}")
    config.architectures = [model_cls.__name__]
    config.dtype = torch.bfloat16  # as published: `--dtype auto` runs it in bf16 where bf16 pays
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in model_cls(config).state_dict().items()}
    tied = config.tie_word_embeddings
    if tied:
        shapes.pop("lm_head.weight", None)
    write_random_shards(out, shapes, len(tokenizer), seed, device)
    config.save_pretrained(str(out))
    if family == "qwen2_5_vl_3b":
        from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor

        save_generation_config(out, tokenizer)
        pixels = {"min_pixels": 56 * 56, "max_pixels": 1024 * 1024}
        Qwen2_5_VLProcessor(image_processor=Qwen2VLImageProcessor(**pixels), video_processor=Qwen2VLVideoProcessor(),
                            tokenizer=tokenizer, chat_template=CHAT_TEMPLATE).save_pretrained(str(out))
    else:
        save_qwen3_files(out, tokenizer, 64 * 64, 1024 * 1024)
    return out


def write_random_shards(out: Path, shapes: dict[str, torch.Size], tokenizer_size: int, seed: int,
                        device: str = "cpu") -> None:
    """Random bf16 weights (as the test checkpoints draw them: norms near 1, small biases,
    matrices of unit-variance outputs), shard by shard, drawn on `device`; the output
    matrix's rows (tied: the embedding's) past the tokenizer are zero."""
    from safetensors.torch import save_file

    gen = torch.Generator(device=device).manual_seed(seed)
    shard: dict[str, torch.Tensor] = {}
    index: dict[str, str] = {}
    size, count, total = 0, 0, 0

    def flush() -> None:
        nonlocal shard, size, count
        name = f"model-{count:05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        index.update({k: name for k in shard})
        shard, size, count = {}, 0, count + 1

    for name, shape in shapes.items():
        t = torch.empty(shape, dtype=torch.bfloat16)
        if len(shape) == 1:
            base = 1.0 if "norm" in name else 0.0
            t.copy_(base + 0.1 * torch.randn(shape, generator=gen, device=device))
            if name.endswith("A_log"):  # decay rates of a trained model: exp(A_log) in (0, 16)
                t.copy_(torch.empty(shape, device=device).uniform_(0.01, 4, generator=gen).log())
        else:
            fan_in = shape[1:].numel()
            for rows in torch.arange(shape[0]).split(4096):  # row blocks: no fp32 copy of a whole matrix
                block = torch.randn((len(rows), *shape[1:]), generator=gen, device=device) / fan_in**0.5
                t[rows[0] : rows[-1] + 1] = block.to(torch.bfloat16)
            if name in ("lm_head.weight", "model.language_model.embed_tokens.weight") and shape[0] > tokenizer_size:
                if name == "lm_head.weight" or "lm_head.weight" not in shapes:
                    t[tokenizer_size:] = 0
        shard[name] = t
        size += t.numel() * 2
        total += t.numel() * 2
        if size >= SHARD_BYTES:
            flush()
    if shard:
        flush()
    # a single shard keeps the index form too: one way to read every checkpoint here
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": index}, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("family", choices=FAMILIES)
    ap.add_argument("--layers", type=int, default=None, help="cut text model and tower to this many layers")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--device", default="cpu", help="where the random weights are drawn (cuda: in seconds)")
    args = ap.parse_args()
    print(build(args.family, args.layers, args.out, device=args.device))


if __name__ == "__main__":
    main()
