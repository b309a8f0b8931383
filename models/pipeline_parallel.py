"""Splitting a built model into pipeline stages, as vLLM splits the same checkpoints: each
stage holds a run of consecutive decoder layers (an equal share, the first stages one more
where they do not divide); the first stage also holds the vision tower and feeds the
layers the step's embeddings; every stage holds the embedding table and the output head,
since every rank samples (distributed.PipelineStage). A layer another stage holds keeps no
weights here, and the loader skips its tensors in the checkpoint."""

from __future__ import annotations

from torch import nn

from vlmserve.distributed import PipelineStage
from vlmserve.errors import ConfigError
from vlmserve.models.base import MRoPEDecoder


def stage_layers(num_layers: int, stage: PipelineStage) -> range:
    """The decoder layers a stage holds."""
    share, extra = divmod(num_layers, stage.size)
    start = stage.stage * share + min(stage.stage, extra)
    return range(start, start + share + (stage.stage < extra))


class HeldElsewhere(nn.Module):
    """A module another stage holds: no weights here. What is read of its shape (a layer's
    kind, its recurrent state's size: what the KV cache's plan reads) comes from a copy on
    the meta device, which takes no memory."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.__dict__["shape_of"] = module.to("meta")  # not a submodule: its parameters are not the model's

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["shape_of"], name)

    def forward(self, *args, **kwargs):
        raise RuntimeError("this module is held by another pipeline stage")


def split_stages(model: nn.Module, stage: PipelineStage) -> None:
    """Keeps the stage's decoder layers (and, on the first, the vision tower); the rest
    become HeldElsewhere."""
    if stage.size == 1:
        return
    decoder = model.model.language_model
    if not isinstance(decoder, MRoPEDecoder):
        raise ConfigError(f"--pipeline-parallel-size: {type(model).__name__} is not split into stages (the Qwen "
                          f"families are); use --tensor-parallel-size")
    num_layers = len(decoder.layers)
    if num_layers < stage.size:
        raise ConfigError(f"--pipeline-parallel-size {stage.size}: the model has {num_layers} decoder layers, fewer "
                          f"than the stages")
    levels = len(getattr(model.config.vision_config, "deepstack_visual_indexes", None) or [])
    first = stage_layers(num_layers, PipelineStage(0, stage.size))
    if levels > len(first):
        raise ConfigError(f"--pipeline-parallel-size {stage.size}: the first stage would hold {len(first)} layers, "
                          f"fewer than the {levels} the pictures' DeepStack features are added to")
    held = stage_layers(num_layers, stage)
    skipped = []
    for i in range(num_layers):
        if i not in held:
            decoder.layers[i] = HeldElsewhere(decoder.layers[i])
            skipped.append(f"model.language_model.layers.{i}.")
    if not stage.is_first:
        setattr(model.model, model.vision_name, HeldElsewhere(getattr(model.model, model.vision_name)))
        skipped.append(f"model.{model.vision_name}.")
    model.stage = decoder.stage = stage
    decoder.held = held
    model.held_elsewhere = tuple(skipped)
