"""vlmserve: a serving stack for vision-language models."""

import logging

from vlmserve.sampling_params import SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"
__all__ = ["LLM", "LoRARequest", "PoolingParams", "SamplingParams", "StructuredOutputsParams", "EngineArgs", "RequestOutput", "CompletionOutput", "__version__"]

# imported when first used: a helper process (a grammar compile worker) that imports one
# light module of the package does not pay for the engine's imports
_LAZY = {"LLM": "vlmserve.entrypoints.llm", "EngineArgs": "vlmserve.engine.args", "LoRARequest": "vlmserve.lora.request",
         "PoolingParams": "vlmserve.pooling_params",
         "RequestOutput": "vlmserve.outputs", "CompletionOutput": "vlmserve.outputs"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'vlmserve' has no attribute {name!r}")

logging.getLogger(__name__).addHandler(logging.NullHandler())
