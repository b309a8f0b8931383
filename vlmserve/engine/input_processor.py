"""Prompt + media -> Request: tokenize, load and process media, expand placeholders,
compute M-RoPE positions once, attach the block hasher. Everything that can be wrong
with an input is found here, before the engine sees it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vlmserve.multimodal.inputs import MultiModalFeature
from vlmserve.multimodal.media import MediaLoader
from vlmserve.multimodal.processor import MultiModalProcessor, ProcessedMedia
from vlmserve.request import Request
from vlmserve.sampling_params import SamplingParams


@dataclass
class PromptInput:
    """A prompt as the engine takes it: text with one placeholder token per media item
    (as the chat template writes them), or token ids, plus the media in order."""

    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    images: list[Any] = field(default_factory=list)
    image_settings: list[dict[str, Any]] = field(default_factory=list)  # per image, e.g. detail
    mm_processor_kwargs: dict[str, Any] = field(default_factory=dict)  # for every item

    @classmethod
    def parse(cls, prompt: str | dict | PromptInput) -> PromptInput:
        if isinstance(prompt, PromptInput):
            return prompt
        if isinstance(prompt, str):
            return cls(prompt=prompt)
        if isinstance(prompt, dict):
            mm = prompt.get("multi_modal_data") or {}
            unknown = set(mm) - {"image"}
            if unknown:
                raise ValueError(f"unsupported multi_modal_data keys {sorted(unknown)}; supported: image")
            images = mm.get("image", [])
            if not isinstance(images, (list, tuple)):
                images = [images]
            return cls(
                prompt=prompt.get("prompt"),
                prompt_token_ids=prompt.get("prompt_token_ids"),
                images=list(images),
                mm_processor_kwargs=dict(prompt.get("mm_processor_kwargs") or {}),
            )
        raise TypeError(f"a prompt is a str or a dict, got {type(prompt).__name__}")


class InputProcessor:
    def __init__(
        self,
        tokenizer,
        mm_processor: MultiModalProcessor,
        media_loader: MediaLoader,
        model_cls: type,
        hf_config,
        max_model_len: int,
        eos_token_id: int | None,
        block_hasher,
        max_media_tokens: int,
        block_size: int,
    ) -> None:
        self.tokenizer = tokenizer
        self.mm_processor = mm_processor
        self.media_loader = media_loader
        self.model_cls = model_cls
        self.hf_config = hf_config
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id
        self.block_hasher = block_hasher
        self.max_media_tokens = max_media_tokens
        self.block_size = block_size
        message_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.message_end_id = message_end if isinstance(message_end, int) and message_end >= 0 else None

    def process(
        self,
        request_id: str,
        prompt: str | dict | PromptInput,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> Request:
        inp = PromptInput.parse(prompt)
        if inp.prompt_token_ids is not None:
            token_ids = list(inp.prompt_token_ids)
        elif inp.prompt is not None:
            token_ids = self.tokenizer.encode(inp.prompt, add_special_tokens=False)
        else:
            raise ValueError("a prompt needs 'prompt' text or 'prompt_token_ids'")
        media = []
        for i, source in enumerate(inp.images):
            per_image = inp.image_settings[i] if i < len(inp.image_settings) else {}
            media.append(self._process_image(source, {**inp.mm_processor_kwargs, **per_image}, i))
        token_ids, features = self._expand_placeholders(token_ids, media)
        self._check_length(len(token_ids), params)
        positions, delta = self.model_cls.mrope_positions(self.hf_config, token_ids, features)
        request = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            mm_features=features,
            mrope_positions=positions,
            mrope_delta=delta,
            arrival_time=arrival_time,
            priority=priority,
            cache_salt=cache_salt,
            block_hasher=self.block_hasher,
        )
        request.cache_points = self._cache_points(token_ids, features)
        return request

    def _cache_points(self, token_ids: list[int], features: list[MultiModalFeature]) -> list[int]:
        """Block boundaries where a later prompt likely diverges from this one: after each
        media item, after each message, at the end of the prompt (rounded down)."""
        ends = [f.end for f in features] + [len(token_ids) - 1]
        if self.message_end_id is not None:
            ends += [i + 1 for i, t in enumerate(token_ids) if t == self.message_end_id]
        bs = self.block_size
        return sorted({e // bs * bs for e in ends if e // bs * bs > 0})

    def _process_image(self, source: Any, settings: dict[str, Any], index: int) -> ProcessedMedia:
        try:
            loaded = self.media_loader.load_image(source)
            processed = self.mm_processor.process_image(loaded, settings)
        except ValueError as e:
            raise type(e)(f"image {index}: {e}") from None
        if processed.num_tokens > self.max_media_tokens:
            raise ValueError(
                f"image {index} needs {processed.num_tokens} tokens, more than the engine's "
                f"encoder budget of {self.max_media_tokens}; send a smaller image or lower max_pixels"
            )
        return processed

    def _expand_placeholders(
        self, token_ids: list[int], media: list[ProcessedMedia]
    ) -> tuple[list[int], list[MultiModalFeature]]:
        """Each image placeholder token becomes as many tokens as the image has embeddings."""
        image_token = self.mm_processor.image_token_id
        slots = [i for i, t in enumerate(token_ids) if t == image_token]
        if len(slots) != len(media):
            raise ValueError(
                f"the prompt has {len(slots)} image placeholder(s) but {len(media)} image(s) were given"
            )
        out: list[int] = []
        features: list[MultiModalFeature] = []
        prev = 0
        for slot, item in zip(slots, media):
            out.extend(token_ids[prev:slot])
            features.append(MultiModalFeature(item.modality, item.mm_hash, len(out), item.num_tokens, item.data))
            out.extend([image_token] * item.num_tokens)
            prev = slot + 1
        out.extend(token_ids[prev:])
        return out, features

    def _check_length(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        if num_prompt_tokens == 0:
            raise ValueError("the prompt is empty")
        if num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"the prompt is {num_prompt_tokens} tokens (media included), but the model's context "
                f"is {self.max_model_len} tokens and at least one must be left to generate"
            )
