"""A draft model: a smaller checkpoint with the target's tokenizer guesses the next k
tokens of each decoding request greedily; the target checks them all in one forward.

The runner drives it (`ModelRunner._run_drafter`); each step, after the target's tokens
are known, the draft model computes the tokens the target kept (so its cache holds
what the target's holds: prompt chunks, pictures through its own encoder, accepted
drafts), then k one-token forwards from each request's new token make the guesses.

Its memory follows the target's, so the scheduler manages one set of ids for both:
its attention layers have KV tensors of their own on the block ids of the target's
full-attention group (a prefix hit, a preemption, a free covers both; the scheduler
allocates k lookahead slots per request for the guesses), and its recurrent layers, if
any, keep their states in the target's state slots (prefix-cache snapshots and restores
cover both) plus a scratch slot per batch row, where the guesses run without moving
the live state. Guessing greedily keeps verification exact for sampled requests too:
a deterministic draft is a one-hot proposal.
"""

from __future__ import annotations

import logging

import torch
from transformers import AutoConfig, AutoTokenizer

from vlmserve.config import SpeculativeConfig
from vlmserve.core.kv_cache_spec import FullAttentionSpec, KVCacheGroup, MambaSpec, group_layers
from vlmserve.engine.args import ConfigError
from vlmserve.engine.model_source import resolve_model_path
from vlmserve.worker.model_loader import load_model

logger = logging.getLogger(__name__)

# vision settings that decide how many placeholder tokens (and which M-RoPE positions) a
# picture gets: the draft must read the target's prompts token for token
_VISION_KEYS = ("patch_size", "spatial_merge_size", "temporal_patch_size", "mm_tokens_per_image")


def draft_checkpoint(config: SpeculativeConfig, target_path: str, download_dir: str | None = None) -> str:
    """The draft's checkpoint folder, checked against the target's: same tokenizer, same
    family, same picture tokens. ConfigError saying what differs."""
    try:
        path = resolve_model_path(config.model, download_dir=download_dir)
    except ConfigError as e:  # "--model X: why" -> the draft's setting and why
        raise ConfigError(f"--speculative-config model {config.model}: {str(e).split(': ', 1)[-1]}") from None
    draft, target = AutoConfig.from_pretrained(path), AutoConfig.from_pretrained(target_path)
    why = _incompatibility(draft, target)
    if why is None and AutoTokenizer.from_pretrained(path).get_vocab() != AutoTokenizer.from_pretrained(
            target_path).get_vocab():
        why = "its tokenizer's vocabulary differs from the target's"
    if why:
        raise ConfigError(f"--speculative-config model {config.model}: cannot draft for this model: {why}")
    return path


def _incompatibility(draft, target) -> str | None:
    text_d, text_t = getattr(draft, "text_config", draft), getattr(target, "text_config", target)
    if text_d.vocab_size != text_t.vocab_size:
        return f"vocab_size {text_d.vocab_size} != the target's {text_t.vocab_size}"
    vision_t = getattr(target, "vision_config", None)
    if vision_t is None:
        return None
    if draft.model_type != target.model_type:
        return f"model_type {draft.model_type!r} != the target's {target.model_type!r} (pictures must become the same tokens)"
    vision_d = getattr(draft, "vision_config", None)
    for key in _VISION_KEYS:
        mine, theirs = getattr(vision_d, key, None), getattr(vision_t, key, None)
        if mine != theirs:
            return f"vision_config.{key} {mine} != the target's {theirs}"
    return None


def load_draft_model(path: str, target_groups: list[KVCacheGroup], dtype: torch.dtype, device: str,
                     pack_weights: bool, use_triton: bool, block_size: int) -> tuple[torch.nn.Module, list[KVCacheGroup]]:
    """The draft model in the target's dtype, and its layers' KV cache groups (for the
    memory budget). ConfigError if its layers cannot live in the target's memory."""
    model, _ = load_model(path, dtype, device, pack_weights, use_triton)
    groups = group_layers(model.kv_cache_specs(block_size, dtype))
    has_recurrent = any(isinstance(g.spec, MambaSpec) for g in groups)
    if has_recurrent and not any(isinstance(g.spec, MambaSpec) for g in target_groups):
        raise ConfigError("--speculative-config model: a draft model with recurrent layers needs a target that "
                          "has them too (their states live in the target's state slots)")
    has_attention = any(not isinstance(g.spec, MambaSpec) for g in groups)
    if has_attention and not any(type(g.spec) is FullAttentionSpec for g in target_groups):
        raise ConfigError("--speculative-config model: the target has no full-attention layers whose blocks the "
                          "draft's attention could use")
    return model, groups
