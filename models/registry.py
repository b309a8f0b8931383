"""HF `architectures` name -> vlmserve model class (imported on first use)."""

from __future__ import annotations

import importlib

_MODELS = {
    "Gemma3ForConditionalGeneration": ("gemma3", "Gemma3ForConditionalGeneration"),
    "Qwen2VLForConditionalGeneration": ("qwen2_vl", "Qwen2VLForConditionalGeneration"),
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
    "Qwen3VLForConditionalGeneration": ("qwen3_vl", "Qwen3VLForConditionalGeneration"),
    "Qwen3VLMoeForConditionalGeneration": ("qwen3_vl", "Qwen3VLForConditionalGeneration"),  # experts by config
    "Qwen3_5ForConditionalGeneration": ("qwen3_5", "Qwen3_5ForConditionalGeneration"),
    "Qwen3_5MoeForConditionalGeneration": ("qwen3_5", "Qwen3_5ForConditionalGeneration"),
}
# the bare models (no output head), as sentence-transformers saves an embedder: the same classes
_MODELS.update({
    "Gemma3Model": _MODELS["Gemma3ForConditionalGeneration"],
    "Qwen2VLModel": _MODELS["Qwen2VLForConditionalGeneration"],
    "Qwen2_5_VLModel": _MODELS["Qwen2_5_VLForConditionalGeneration"],
    "Qwen3VLModel": _MODELS["Qwen3VLForConditionalGeneration"],
    "Qwen3VLMoeModel": _MODELS["Qwen3VLMoeForConditionalGeneration"],
    "Qwen3_5Model": _MODELS["Qwen3_5ForConditionalGeneration"],
    "Qwen3_5MoeModel": _MODELS["Qwen3_5MoeForConditionalGeneration"],
})


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architectures: list[str]) -> type:
    for arch in architectures or []:
        if arch in _MODELS:
            module, cls = _MODELS[arch]
            return getattr(importlib.import_module(f"vlmserve.models.{module}"), cls)
    raise ValueError(
        f"unsupported model architecture {architectures}; vlmserve supports {supported_architectures()}"
    )
