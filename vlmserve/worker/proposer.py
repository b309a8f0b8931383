"""What the runner asks of a way to guess tokens (speculative decoding): after a step has
sampled, drafts for the requests that will decode next step, which that step checks in
one forward of the target model. The ways live in spec_decode/ — prompt lookup reads the
requests' own tokens, a draft model runs a smaller model of its own — and are built by the
engine; the runner hands each its batch and input builder (`bind`), all they see of it."""

from __future__ import annotations

from vlmserve.core.sched_output import SchedulerOutput
from vlmserve.multimodal.inputs import MultiModalFeature
from vlmserve.worker.input_batch import InputBatch
from vlmserve.worker.step_inputs import StepInputBuilder, StepInputs


class Proposer:
    def bind(self, batch: InputBatch, inputs: StepInputBuilder) -> None:
        """The runner's persistent batch (the requests' tokens) and its input builder
        (staging, device, how a step's model inputs are made), once, when it takes this."""
        self.batch, self.inputs = batch, inputs

    def propose(self, so: SchedulerOutput, step: StepInputs, kept: list[int], proposing: list[int]
                ) -> dict[str, list[int]]:
        """Drafts (request id -> tokens) for step.req_ids[i], i in `proposing`, whose new
        tokens are already in the batch; kept[i]: how many of request i's query tokens
        this step put in the cache (its query less the refused drafts)."""
        raise NotImplementedError

    # a proposer with a vision encoder of its own reads the pictures the target encodes
    def encode(self, features: list[MultiModalFeature]) -> None:
        pass

    def free_encoder_outputs(self, mm_hashes: set[str] | list[str]) -> None:
        pass

    def clear_encoder_cache(self) -> None:
        pass


def token_history(batch: InputBatch, row: int):
    """A batch row's tokens so far (prompt and output)."""
    return batch.token_ids[row, : batch.num_tokens[row]]
