"""vlmserve: a serving stack for vision-language models."""

import logging

from vlmserve.engine.args import EngineArgs
from vlmserve.entrypoints.llm import LLM
from vlmserve.outputs import CompletionOutput, RequestOutput
from vlmserve.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "EngineArgs", "RequestOutput", "CompletionOutput", "__version__"]

logging.getLogger(__name__).addHandler(logging.NullHandler())
