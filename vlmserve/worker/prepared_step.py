"""A step between its host preparation and its device work: everything the device work
reads of the host's batch, taken when the step is prepared (the batch changes under the
next step while this one runs), and what the device work gives back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vlmserve.core.sched_output import SchedulerOutput
from vlmserve.lora.request import LoRARequest
from vlmserve.models.context import ForwardContext
from vlmserve.multimodal.inputs import MultiModalFeature
from vlmserve.outputs import LogprobsEntry
from vlmserve.worker.cuda_graphs import GraphStep
from vlmserve.worker.input_batch import CachedRequestState
from vlmserve.worker.sampler import SamplingBatch
from vlmserve.worker.step_inputs import MergePiece, StepInputs


@dataclass
class SamplingPositions:
    """The requests of a step that sample a token, those that check drafts, and where the
    tokens they read are among the step's (the samplers' first, in order)."""

    sample_idx: list[int]
    verify_idx: list[int]
    positions: list[int]


@dataclass
class VerifyInputs:
    """What checking a step's drafts reads of the batch: each request's drafts, the
    sampling settings of its 1 + drafts logits rows, its recurrent-state slot."""

    drafts: list[list[int]]
    sampling: SamplingBatch
    state_slots: list[int | None]


@dataclass
class PromptLogprobRows:
    """The requests of a step asking for prompt logprobs: (index in the step, first token,
    state, the prompt tokens scored) of those that score some this step, and (request id,
    state) of those whose prompt logprobs go out with the step's output."""

    scored: list[tuple[int, int, CachedRequestState, np.ndarray]]
    done: list[tuple[str, CachedRequestState]]


@dataclass
class PreparedStep:
    """A step as its device work sees it: everything read of the host's batch when it was
    prepared (the batch changes under the next step while this one runs)."""

    so: SchedulerOutput
    step: StepInputs
    read: SamplingPositions
    graph: GraphStep | None  # a CUDA graph replays the step
    ctx: ForwardContext | None  # else: the kernels' metadata
    merge: list[MergePiece]  # ... and the media's embeddings merged in
    encode: list[tuple[LoRARequest | None, list[MultiModalFeature]]]  # media encoded first, by adapter
    encode_loads: dict[str, tuple[bytes, int]]  # media outputs another engine made: (serialized, rows)
    loras: list[LoRARequest | None] | None  # each request's adapter, where LoRA is on
    sample_req_ids: list[str]  # the order of the step's sampled tokens
    pooling: list[tuple[int, CachedRequestState]]  # the embedding requests (their index in the step)
    prompt_logprobs: PromptLogprobRows | None  # the requests that ask for prompt logprobs
    sampling: SamplingBatch | None = None  # of the requests that sample
    verify: VerifyInputs | None = None  # of the requests that check drafts


@dataclass
class DeviceOutput:
    """What a step's device work gives back."""

    pooled: dict[str, torch.Tensor]
    phases: dict[str, float]  # seconds per phase of the device work (when timed)
    hidden: torch.Tensor | None = None  # the final hidden states, until sampled from
    sampled: torch.Tensor | None = None  # a token per sampling request, on the device
    sampled_host: torch.Tensor | None = None  # ... its copy to the host, on a GPU
    ready: Any = None  # ... and the event that says the copy is done
    verified: dict[int, list[int]] = field(default_factory=dict)  # step index -> kept drafts and one more
    logprobs: dict[str, list[LogprobsEntry]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[LogprobsEntry]] = field(default_factory=dict)
