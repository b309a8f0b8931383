"""Where a model's files are: the shipped model, a local checkpoint folder, or a hub id
found in the Hugging Face cache (or downloaded into it: only the files the engine reads)."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from vlmserve import envs
from vlmserve.config import SpeculativeConfig
from vlmserve.errors import ConfigError
from vlmserve.pooling_params import PoolerConfig

logger = logging.getLogger(__name__)

SHIPPED_MODEL = Path(__file__).resolve().parent.parent / "assets" / "shapes-qwen3.5"
# what the engine reads from a checkpoint: configs, weights, tokenizer, processor, template
ENGINE_FILES = [
    "config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
    "special_tokens_map.json", "added_tokens.json", "preprocessor_config.json",
    "video_preprocessor_config.json", "processor_config.json", "chat_template.json", "chat_template.jinja",
]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_hub_id(model: str) -> bool:
    return bool(_HUB_ID.match(model)) and not Path(model).expanduser().exists()


def resolve_model_path(model: str | None, revision: str | None = None, download_dir: str | None = None) -> str:
    """The checkpoint folder of `model`: None is the shipped model; a folder is used as
    it is; `org/name` is looked up in the Hugging Face cache (HF_HOME, or download_dir)
    and fetched unless HF_HUB_OFFLINE is set. ConfigError (one line: what is missing and
    how to get it) when there is none."""
    if model is None:
        return str(SHIPPED_MODEL)
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"--model {model}: the folder has no config.json; point it at a checkpoint folder "
                              f"(config.json, *.safetensors, tokenizer and processor files) or a hub id (org/name)")
        return str(path)
    if not is_hub_id(model):
        raise ConfigError(f"--model {model}: no such folder, and not a hub id (org/name)")
    return _from_hub(model, revision, download_dir)


def _from_hub(repo_id: str, revision: str | None, download_dir: str | None) -> str:
    from huggingface_hub import constants, snapshot_download

    offline = constants.HF_HUB_OFFLINE or envs.HF_HUB_OFFLINE
    where = download_dir or constants.HF_HUB_CACHE
    try:
        path = snapshot_download(repo_id, revision=revision, cache_dir=download_dir, allow_patterns=ENGINE_FILES,
                                 local_files_only=offline)
    except Exception as e:  # not cached offline, unknown repo or revision, gated, no network
        at = f"@{revision}" if revision else ""
        if offline:
            raise ConfigError(f"--model {repo_id}{at}: not in the Hugging Face cache at {where} and HF_HUB_OFFLINE is "
                              f"set; fetch it where there is network (huggingface-cli download {repo_id}"
                              f"{f' --revision {revision}' if revision else ''}) or pass its folder") from None
        raise ConfigError(f"--model {repo_id}{at}: could not be fetched from the Hugging Face hub into {where} "
                          f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    if not (Path(path) / "config.json").is_file():
        raise ConfigError(f"--model {repo_id}: the repository has no config.json: not a transformers checkpoint")
    logger.info("model %s%s from %s", repo_id, f"@{revision}" if revision else "", path)
    return path


def served_name(model: str | None, path: str) -> str:
    """The name a model is served under unless told otherwise: a hub id as it was given,
    else the folder's name."""
    return model if model is not None and is_hub_id(model) else Path(path).name


# generation_config.json's sampling keys -> SamplingParams fields
_SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                  "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def sampling_defaults(path: str) -> dict[str, float | int]:
    """The sampling settings a checkpoint ships in generation_config.json (only those it
    sets), as SamplingParams fields: the defaults of requests that leave them unset."""
    import json

    file = Path(path) / "generation_config.json"
    if not file.is_file():
        return {}
    config = json.loads(file.read_text())
    return {field: config[key] for key, field in _SAMPLING_KEYS.items() if config.get(key) is not None}


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
    from transformers import AutoConfig, AutoTokenizer

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


RUNNERS = ("auto", "generate", "pooling")


def resolve_pooler(runner: str, pooler_config: dict, path: str) -> PoolerConfig | None:
    """How the model pools (None: it generates). `auto` pools where the checkpoint says so:
    a sentence-transformers model (modules.json with a Pooling module: its pooling mode, and
    normalisation where a Normalize module follows), or a reranker (config.json's
    `classifier_from_token`, as vLLM's hf_overrides for Qwen3-Reranker write it); `pooling`
    pools anyway (LAST and normalised unless the checkpoint or --pooler-config says
    otherwise)."""
    if runner not in RUNNERS:
        raise ConfigError(f"--runner {runner}: one of {', '.join(RUNNERS)}")
    own = sentence_transformers_pooler(path) or reranker_pooler(path)
    if runner == "generate" or (runner == "auto" and own is None):
        if pooler_config:
            raise ConfigError("--pooler-config is for a model that embeds or scores: add --runner pooling")
        return None
    try:
        return PoolerConfig.from_dict({**(own or {}), **pooler_config})
    except ValueError as e:
        raise ConfigError(f"--pooler-config: {e}") from None


def reranker_pooler(path: str) -> dict | None:
    """A generative checkpoint saved as a reranker: its config.json names the two tokens
    whose logits make the score (None otherwise)."""
    config_file = Path(path) / "config.json"
    tokens = json.loads(config_file.read_text()).get("classifier_from_token") if config_file.is_file() else None
    return None if tokens is None else {"classifier_from_token": tokens}


def classifier_token_ids(tokenizer, tokens: tuple[str, str]) -> tuple[int, int]:
    """The ids of a reranker's (no, yes) tokens; ConfigError where one is not a single
    token of the vocabulary."""
    ids = []
    for token in tokens:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id is None or token_id == tokenizer.unk_token_id:
            raise ConfigError(f"classifier_from_token: {token!r} is not a token of this checkpoint's vocabulary")
        ids.append(token_id)
    return ids[0], ids[1]


def sentence_transformers_pooler(path: str) -> dict | None:
    """The pooling settings of a sentence-transformers checkpoint (None if it is not one):
    its Pooling module's mode (`pooling_mode` as v5+ writes it, or the older
    `pooling_mode_*` flags), normalised where a Normalize module follows."""
    modules_file = Path(path) / "modules.json"
    if not modules_file.is_file():
        return None
    modules = json.loads(modules_file.read_text())
    kinds = {m.get("type", "").rsplit(".", 1)[-1]: m for m in modules}
    if "Pooling" not in kinds:
        return None
    config_file = Path(path) / kinds["Pooling"].get("path", "") / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    mode = config.get("pooling_mode") or next(
        (key.removeprefix("pooling_mode_") for key, on in config.items() if key.startswith("pooling_mode_") and on),
        "lasttoken")
    kinds_of = {"lasttoken": "LAST", "mean_tokens": "MEAN", "mean": "MEAN", "cls_token": "CLS", "cls": "CLS"}
    if mode not in kinds_of:
        raise ConfigError(f"{path}: sentence-transformers pooling {mode!r}; vlmserve pools lasttoken, mean or cls")
    return {"pooling_type": kinds_of[mode], "normalize": "Normalize" in kinds}
