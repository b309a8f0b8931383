"""vlmserve: a serving stack for vision-language models."""

import logging
import os

# The Triton kernels on CPU tensors (VLMSERVE_USE_TRITON=1: the GPU path, run by Triton's
# interpreter) need the interpreter on before triton is first imported, which importing
# torchvision or transformers does: so here, before anything else.
if os.environ.get("VLMSERVE_USE_TRITON") == "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")

from vlmserve.engine.args import EngineArgs
from vlmserve.entrypoints.llm import LLM
from vlmserve.outputs import CompletionOutput, RequestOutput
from vlmserve.sampling_params import SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "EngineArgs", "RequestOutput", "CompletionOutput", "__version__"]

logging.getLogger(__name__).addHandler(logging.NullHandler())
