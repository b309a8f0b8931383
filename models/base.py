"""What every model family shares: the runner-facing interface of a vision-language model
(embed, encode media, forward, logits, load weights) and the M-RoPE decoder stack."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from vlmserve.distributed import ONE_STAGE, SINGLE, PipelineStage, TensorParallel
from vlmserve.kernels import ops
from vlmserve.kernels.decode_layers import DecodePlan
from vlmserve.kernels.quantized_linear import QuantizedWeight, dequantize
from vlmserve.models.context import DeepStackInputs, ForwardContext
from vlmserve.models.kv_scales import load_kv_scale
from vlmserve.models.layers import Embedding, FusedLinear, Linear, kept, mrope_cos_sin, rope_inv_freq
from vlmserve.models.moe import load_expert_weight
from vlmserve.models.weights import FUSED_PROJECTIONS, WeightLoader
from vlmserve.multimodal.inputs import MultiModalFeature


class MRoPEDecoder(nn.Module):
    """Embeddings, decoder layers, final norm; cos/sin of the M-RoPE positions are made
    once per step and shared by every layer. One token (one user decoding) goes through
    the layers in one call where the kernels have it (ops.decode_layers)."""

    # (its planner, Linear.lora_generation, the plan): made on first use, again when either changes
    _decode_plan: tuple[Callable, int, DecodePlan | None] | None = None
    # split into pipeline stages (models/pipeline_parallel.py): this rank's stage, and the layers it holds
    stage: PipelineStage = ONE_STAGE
    held: range | None = None  # None: all

    def __init__(self, cfg, make_layer: Callable[[Any, int], nn.Module], norm_cls: type[nn.Module], rotary_dim: int,
                 default_section: list[int], default_theta: float, interleaved: bool = False) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([make_layer(cfg, i) for i in range(cfg.num_hidden_layers)])
        self.norm = norm_cls(cfg.hidden_size, cfg.rms_norm_eps)
        rope = cfg.rope_parameters or {}
        self.mrope_section = list(rope.get("mrope_section", default_section))
        self.interleaved = bool(rope.get("mrope_interleaved", interleaved))
        self.register_buffer("inv_freq", rope_inv_freq(rotary_dim, rope.get("rope_theta", default_theta)),
                             persistent=False)

    def forward(self, embeds: torch.Tensor | None, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The final hidden states of the rows read (ctx.output_rows). Split into pipeline
        stages, a stage after the first takes the hidden state from the one before it
        (embeds: None), and every stage returns the last one's output."""
        stage = self.stage
        rows, (width,), dtype = positions.shape[-1], self.norm.weight.shape, self.norm.weight.dtype
        x = embeds if stage.is_first else stage.receive((rows, width), dtype, positions.device)
        cos, sin = mrope_cos_sin(positions, self.inv_freq, self.mrope_section, self.interleaved)
        x, delta = self._layers(x, cos.to(x.dtype), sin.to(x.dtype), ctx)
        if not stage.is_last:
            stage.send_on(x if delta is None else x + delta)  # the next stage's layers start from the sum
            out = None
        else:
            out = self.norm.add_and_norm(x, delta)[1]
        rows_read = rows if ctx.output_rows is None else len(ctx.output_rows)
        return stage.share_output(out, (rows_read, width), dtype, positions.device)

    def _layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The hidden state (x, delta) after the layers this rank holds."""
        one_token = x.shape[0] == 1 and ctx.deepstack is None and ctx.output_rows is None
        plan = self.decode_plan() if one_token else None
        meta = plan.shared_metadata(ctx.attn_metadata) if plan is not None else None
        if meta is not None:
            return ops.decode_layers(plan, x, None, cos, sin, ctx.kv_caches, meta)
        delta, deep, last = None, ctx.deepstack, len(self.layers) - 1
        levels = 0 if deep is None else deep.features.shape[1]  # on the first stage, which holds those layers
        for i in self.held or range(len(self.layers)):
            # the last layer cuts the rows to those read, unless DeepStack adds to all of them after it
            x, delta = self.layers[i](x, delta, cos, sin, ctx, ctx.output_rows if i == last and i >= levels else None)
            if i < levels:
                x, delta = (x + delta).index_add(0, deep.token_index, deep.features[:, i]), None
        if levels > last:
            x = kept(ctx.output_rows, x)[0]
        return x, delta

    def decode_plan(self) -> DecodePlan | None:
        """The layers this rank holds as ops.decode_layers runs them on this device (None:
        op by op), made at the first step (the weights loaded, quantized and packed), again
        once a layer gets LoRA slots."""
        if self.embed_tokens.vocab_part is not None:
            return None  # split across ranks: the layers' sums over the ranks run op by op
        planner, generation = ops.plan_decode_layers, Linear.lora_generation
        if self._decode_plan is None or self._decode_plan[:2] != (planner, generation):
            layers = [self.layers[i].decode_weights() for i in self.held or range(len(self.layers))]
            self._decode_plan = (planner, generation, planner(layers))
        return self._decode_plan[2]


class VisionLanguageModel(nn.Module):
    """A vision tower and a decoder under the HF checkpoint's module names
    (`model.visual`, `model.language_model`, `lm_head`). Families add kv_cache_specs()
    and mrope_positions(), and name their towers."""

    vision_cls: type[nn.Module]
    vision_name = "visual"  # the tower's module name in the checkpoint
    decoder_cls: type[nn.Module]
    bidirectional_media = False  # a picture's tokens attend to each other both ways (Gemma 3)
    # checkpoint name fragment -> (fused module fragment, shard index), beyond q/k/v and gate/up
    extra_fused: dict[str, tuple[str, int]] = {}
    tp: TensorParallel = SINGLE  # the ranks its language model is split across (models/tensor_parallel.py)
    # split into pipeline stages (models/pipeline_parallel.py): this rank's stage, and the
    # checkpoint names (prefixes) of what other stages hold
    stage: PipelineStage = ONE_STAGE
    held_elsewhere: tuple[str, ...] = ()

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.text_config = config.text_config
        self.model = nn.Module()
        setattr(self.model, self.vision_name, self.vision_cls(config.vision_config))
        self.model.language_model = self.decoder_cls(self.text_config)
        tied = getattr(config, "tie_word_embeddings", False) or getattr(self.text_config, "tie_word_embeddings", False)
        self.lm_head = None if tied else Linear(self.text_config.hidden_size, self.text_config.vocab_size, bias=False)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.language_model.embed_tokens(input_ids)

    def embed_multimodal(self, features: list[MultiModalFeature]) -> list[torch.Tensor]:
        """Runs the vision tower once over all given items; one [length, hidden] each
        ([length, levels * hidden] where the tower gives several levels: the encoder cache
        keeps them all under the item's hash)."""
        device = self.model.language_model.embed_tokens.weight.device
        pixels = torch.cat([f.data["pixel_values"] for f in features]).to(device)
        grids = [tuple(int(x) for x in f.data["grid_thw"]) for f in features]
        return list(self.model.visual(pixels, grids).split([f.length for f in features]))

    def merge_multimodal(self, embeds: torch.Tensor, token_index: torch.Tensor,
                         mm_embeds: torch.Tensor) -> DeepStackInputs | None:
        """Puts the items' embeddings (rows of embed_multimodal's outputs) at their
        placeholder tokens; returns what the forward adds later (none here)."""
        embeds.index_copy_(0, token_index, mm_embeds.to(embeds.dtype))
        return None

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.model.language_model(embeds, positions, ctx)

    def untied_head(self) -> Linear:
        """The output head as a Linear of its own: with tied embeddings, one sharing the
        embedding table's weight (so that it can be quantized while lookups keep the table)."""
        if self.lm_head is None:
            embed = self.model.language_model.embed_tokens.weight
            self.lm_head = Linear(embed.shape[1], embed.shape[0], bias=False, device="meta")
            self.lm_head.weight = embed
        return self.lm_head

    def layers_held(self) -> set[int]:
        """The decoder layers (ids) this rank holds: all, unless split into pipeline stages."""
        decoder = self.model.language_model
        return set(getattr(decoder, "held", None) or range(len(decoder.layers)))

    def kv_heads_per_rank(self) -> int:
        """Key/value heads each rank's attention layers hold (all of them on one rank)."""
        heads = self.text_config.num_key_value_heads
        return heads // self.tp.size if heads % self.tp.size == 0 else 1

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is not None:
            logits = self.lm_head(hidden)  # its own Linear: packed or quantized as loaded
        else:
            logits = ops.linear(hidden, self.model.language_model.embed_tokens.weight, None)
        if self.tp.size == 1:
            return logits
        return self.tp.all_gather(logits)[..., : self.text_config.vocab_size]  # each rank's share of the vocabulary

    def lora_layers(self) -> dict[str, tuple[Linear, int]]:
        """What a LoRA adapter can adapt, by checkpoint name: every linear layer of the
        decoder and the vision tower (not the output head), a fused one under each
        projection it fuses, with the projection's shard index in it; the patch embedding
        under its convolution's name (a convolution whose stride is its kernel is this
        linear layer on flattened patches)."""
        fused: dict[str, list[tuple[int, str]]] = {}
        for part, (target, index) in {**self.extra_fused, **FUSED_PROJECTIONS}.items():
            fused.setdefault(target, []).append((index, part))
        layers = {}
        for name, module in self.named_modules():
            if not isinstance(module, Linear) or module is self.lm_head:
                continue
            if name.endswith(".patch_embed"):
                name += ".proj"
            target = next((t for t in fused if t in name + "."), None) if isinstance(module, FusedLinear) else None
            if target is None:
                layers[name] = (module, 0)
            else:
                layers.update({(name + ".").replace(target, part)[:-1]: (module, index) for index, part in fused[target]})
        return layers

    @staticmethod
    def is_vision_layer(name: str) -> bool:
        """Whether a layer (checkpoint name) works on pictures: the vision tower's and the
        projector's, everything outside the decoder."""
        return not name.startswith("model.language_model.")

    @staticmethod
    def canonical_name(name: str) -> str:
        """Maps older checkpoint layouts (`visual.*`, `model.layers.*`) and the bare model's
        (`language_model.*`: what sentence-transformers saves of an embedder) to the
        current one."""
        if name.startswith(("visual.", "language_model.")):
            return "model." + name
        if name.startswith("model.") and not name.startswith(("model.visual.", "model.language_model.")):
            return "model.language_model." + name[len("model.") :]
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     quantize: dict[Linear, str] | None = None) -> None:
        """Loads the checkpoint's tensors; the layers in `quantize` (layer -> method) are
        quantized as each one's weight is complete."""
        loader = WeightLoader(self, quantize)
        fused = {**self.extra_fused, **FUSED_PROJECTIONS}
        for name, tensor in weights:
            if name.startswith("mtp."):
                continue  # multi-token-prediction head: not used
            name = self.canonical_name(name)
            if name.startswith(self.held_elsewhere) or name == "lm_head.weight" and self.lm_head is None:
                continue
            if load_kv_scale(self, name, tensor):  # an FP8 KV cache's, kept by the attention layer
                continue
            if isinstance(tensor, QuantizedWeight) and (".experts." in name or ".patch_embed." in name):
                tensor = dequantize(tensor)  # stacked experts and the patch embedding run in the model's dtype
            if load_expert_weight(loader, name, tensor):
                continue
            if ".patch_embed.proj." in name:
                # the Conv3d patch embedding is loaded as the equivalent Linear
                loader.copy(name.replace("patch_embed.proj.", "patch_embed."), tensor.reshape(tensor.shape[0], -1)
                            if tensor.dim() > 1 else tensor)
                continue
            for part, (target, index) in fused.items():
                if part in name:
                    loader.copy_shard(name.replace(part, target), tensor, index)
                    break
            else:
                loader.copy(name, tensor)
        loader.check_all_loaded()
