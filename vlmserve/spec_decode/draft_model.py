"""A draft model: a smaller checkpoint with the target's tokenizer guesses the next k
tokens of each decoding request greedily; the target checks them all in one forward.

Each step, after the target's tokens are known, the draft model computes the tokens the
target kept (so its cache holds what the target's holds: prompt chunks, pictures through
its own encoder, accepted drafts), then k one-token forwards from each request's new
token make the guesses (`DraftModelProposer.propose`).

Its memory follows the target's, so the scheduler manages one set of ids for both:
its attention layers have KV tensors of their own on the block ids of the target's
full-attention group (a prefix hit, a preemption, a free covers both; the scheduler
allocates k lookahead slots per request for the guesses), and its recurrent layers, if
any, keep their states in the target's state slots (prefix-cache snapshots and restores
cover both) plus a scratch slot per batch row, where the guesses run without moving
the live state. Guessing greedily keeps verification exact for sampled requests too:
a deterministic draft is a one-hot proposal. The checkpoint is checked against the
target's before anything loads (engine/model_source.draft_checkpoint).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from vlmserve.core.kv_cache_spec import (AttentionSpec, FullAttentionSpec, KVCacheConfig, KVCacheGroup, MambaSpec,
                                         SlidingWindowSpec, group_layers)
from vlmserve.core.sched_output import SchedulerOutput
from vlmserve.errors import ConfigError
from vlmserve.kernels.attention import kv_cache_shapes
from vlmserve.multimodal.inputs import MultiModalFeature
from vlmserve.worker.input_batch import InputBatch
from vlmserve.worker.proposer import Proposer
from vlmserve.worker.step_inputs import LayerPlan, StepInputBuilder, StepInputs

logger = logging.getLogger(__name__)

def check_draft_model(model: torch.nn.Module, target_groups: list[KVCacheGroup], block_size: int,
                      dtype: torch.dtype) -> list[KVCacheGroup]:
    """The draft model's KV cache groups (for the memory budget); ConfigError if its layers
    cannot live in the target's memory."""
    groups = group_layers(model.kv_cache_specs(block_size, dtype))
    has_recurrent = any(isinstance(g.spec, MambaSpec) for g in groups)
    if has_recurrent and not any(isinstance(g.spec, MambaSpec) for g in target_groups):
        raise ConfigError("--speculative-config model: a draft model with recurrent layers needs a target that "
                          "has them too (their states live in the target's state slots)")
    has_attention = any(not isinstance(g.spec, MambaSpec) for g in groups)
    if has_attention and not any(type(g.spec) is FullAttentionSpec for g in target_groups):
        raise ConfigError("--speculative-config model: the target has no full-attention layers whose blocks the "
                          "draft's attention could use")
    return groups


class DraftModelProposer(Proposer):
    def __init__(self, model: torch.nn.Module, num_tokens: int, kv_cache_config: KVCacheConfig,
                 max_num_seqs: int, max_model_len: int) -> None:
        self.model = model
        self.num_tokens = num_tokens  # guesses per request and step
        self.kv_cache_config = kv_cache_config
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.encoder_cache: dict[str, torch.Tensor] = {}
        self.scratch_slot_base = kv_cache_config.num_state_slots  # batch row r guesses in slot base + r

    def bind(self, batch: InputBatch, inputs: StepInputBuilder) -> None:
        super().bind(batch, inputs)
        self.plan = self._layer_plan(self.kv_cache_config, self.max_num_seqs)

    def _layer_plan(self, kv_cache_config: KVCacheConfig, max_num_seqs: int) -> LayerPlan:
        """Its own KV tensors, on the block ids of the target's first full-attention group,
        and its recurrent states on the target's state slots plus a scratch slot per row."""
        attention_groups = [g for g in kv_cache_config.groups if isinstance(g.spec, AttentionSpec)]
        full = [a for a, g in enumerate(attention_groups) if type(g.spec) is FullAttentionSpec]
        device, block_size = self.inputs.device, self.inputs.block_size
        caches, attention, recurrent = {}, {}, []
        for layer, spec in self.model.kv_cache_specs(block_size, next(self.model.parameters()).dtype).items():
            if isinstance(spec, MambaSpec):
                n = self.scratch_slot_base + max_num_seqs
                caches[layer] = (torch.zeros(n, *spec.conv_shape, dtype=spec.dtype, device=device),
                                 torch.zeros(n, *spec.ssm_shape, dtype=torch.float32, device=device))
                recurrent.append(layer)
                continue
            shapes = kv_cache_shapes(kv_cache_config.num_blocks, block_size, spec.num_kv_heads, spec.head_size)
            caches[layer] = tuple(torch.zeros(shape, dtype=spec.dtype, device=device) for shape in shapes)
            window = spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
            attention.setdefault(window, []).append(layer)
        return LayerPlan("draft", caches, [(tuple(ids), full[0], w) for w, ids in attention.items()], recurrent)

    # -- pictures: read with its own encoder ------------------------------------------------------
    def encode(self, features: list[MultiModalFeature]) -> None:
        for feature, out in zip(features, self.model.embed_multimodal(features)):
            self.encoder_cache[feature.mm_hash] = out

    def free_encoder_outputs(self, mm_hashes) -> None:
        for mm_hash in mm_hashes:
            self.encoder_cache.pop(mm_hash, None)

    def clear_encoder_cache(self) -> None:
        self.encoder_cache.clear()

    # -- the step -----------------------------------------------------------------------------------
    def propose(self, so: SchedulerOutput, step: StepInputs, kept: list[int], proposing: list[int]
                ) -> dict[str, list[int]]:
        self._catch_up(so, step, kept)
        return self._guesses(step, proposing) if proposing else {}

    def _catch_up(self, so: SchedulerOutput, step: StepInputs, kept: list[int]) -> None:
        """Computes the tokens the target kept this step, so that its cache holds what the
        target's holds (with the same prefix-cache restores and snapshots)."""
        starts = np.cumsum([0] + step.query_lens[:-1])
        order = sorted(range(len(kept)), key=lambda i: kept[i] != 1)  # one-token queries first
        index = np.concatenate([np.arange(starts[i], starts[i] + kept[i]) for i in order])
        index_t = torch.from_numpy(index).to(self.inputs.device)
        catch_up = StepInputs(
            req_ids=[step.req_ids[i] for i in order],
            rows=[step.rows[i] for i in order],
            num_computed=[step.num_computed[i] for i in order],
            query_lens=[kept[i] for i in order],
            num_drafts=[0] * len(order),
            checkpoints=[[] for _ in order],
            propose_drafts=False,
            input_ids=step.input_ids[index_t],
            positions=step.positions[:, index_t],
        )
        # nothing reads its output: the cache is what it is for
        embeds, ctx = self.inputs.model_inputs(self.model, self.plan, catch_up, self.encoder_cache, output_rows=[])
        self.inputs.copy_states(so.state_restores, self.plan)
        self.model.forward(embeds, catch_up.positions, ctx)
        self.inputs.copy_states(so.state_saves, self.plan)

    def _guesses(self, step: StepInputs, proposing: list[int]) -> dict[str, list[int]]:
        """k greedy guesses after each new token of the requests that take drafts, one
        batched one-token forward per guess."""
        batch, staging = self.inputs.batch, self.inputs.staging
        rows = [step.rows[i] for i in proposing]
        rows_np = np.asarray(rows, dtype=np.int64)
        first = batch.num_tokens[rows_np] - 1  # each request's new token, guessed from
        deltas = np.asarray([batch.states[r].mrope_delta for r in rows], dtype=np.int64)
        scratch = [self.scratch_slot_base + r for r in rows]
        # the guesses move the recurrent state: they start from a copy of it
        self.inputs.copy_states([(batch.states[r].state_slot, s) for r, s in zip(rows, scratch)], self.plan)
        tokens = batch.token_ids[rows_np, first]
        drafts: list[list[int]] = [[] for _ in rows]
        for j in range(self.num_tokens):
            sel = np.flatnonzero(first + j < self.max_model_len)  # a guess needs a KV slot inside the context
            if not sel.size:
                break
            pos = first[sel] + j
            guess_step = StepInputs(
                req_ids=[step.req_ids[proposing[s]] for s in sel], rows=[rows[s] for s in sel],
                num_computed=pos.tolist(), query_lens=[1] * len(sel), num_drafts=[0] * len(sel),
                checkpoints=[[] for _ in sel], propose_drafts=False,
                input_ids=staging.upload(f"draft{j}.input_ids", tokens[sel]),
                positions=staging.upload(f"draft{j}.positions", pos + deltas[sel]).expand(3, -1),
            )
            ctx = self.inputs.forward_context(guess_step, self.plan, [scratch[s] for s in sel], name=f"draft{j}")
            embeds = self.model.embed_input_ids(guess_step.input_ids)
            hidden = self.model.forward(embeds, guess_step.positions, ctx)
            new = self.model.compute_logits(hidden).argmax(dim=-1).cpu().numpy()
            tokens[sel] = new
            for s, token in zip(sel, new.tolist()):
                drafts[s].append(token)
        return {step.req_ids[i]: drafts[s] for s, i in enumerate(proposing)}
