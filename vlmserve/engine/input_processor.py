"""Prompt + media -> Request: load and process media, expand placeholders exactly as the
model's HF processor does, tokenize, compute M-RoPE positions once, attach the block
hasher. Everything that can be wrong with an input is found here, before the engine
sees it. Thread-safe: entry points run it in a pool, off the engine's step loop."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from vlmserve.lora.request import LoRARequest
from vlmserve.multimodal.inputs import MultiModalFeature
from vlmserve.multimodal.processor import MultiModalProcessor, ProcessedMedia, normalize_settings
from vlmserve.pooling_params import PoolingParams
from vlmserve.request import Request
from vlmserve.sampling_params import SamplingParams

MODALITIES = ("image", "video")


@dataclass
class PromptInput:
    """A prompt as the engine takes it: text with one placeholder token per media item (as
    chat templates write them: <|image_pad|>, <|video_pad|>), or token ids, plus the
    media of each modality in order, and per-item processing settings."""

    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    media: dict[str, list[Any]] = field(default_factory=dict)  # modality -> sources
    media_settings: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # per item, e.g. detail
    mm_processor_kwargs: dict[str, Any] = field(default_factory=dict)  # for every item
    truncate_prompt_tokens: int | None = None  # keep only the last N tokens (media wholly before the cut dropped)

    @classmethod
    def parse(cls, prompt: str | dict | PromptInput) -> PromptInput:
        if isinstance(prompt, PromptInput):
            return prompt
        if isinstance(prompt, str):
            return cls(prompt=prompt)
        if isinstance(prompt, dict):
            mm = prompt.get("multi_modal_data") or {}
            unknown = set(mm) - set(MODALITIES)
            if unknown:
                raise ValueError(f"unsupported multi_modal_data keys {sorted(unknown)}; supported: {list(MODALITIES)}")
            media = {modality: _as_items(modality, items) for modality, items in mm.items()}
            return cls(
                prompt=prompt.get("prompt"),
                prompt_token_ids=prompt.get("prompt_token_ids"),
                media=media,
                mm_processor_kwargs=dict(prompt.get("mm_processor_kwargs") or {}),
            )
        raise TypeError(f"a prompt is a str or a dict, got {type(prompt).__name__}")

    def settings_for(self, modality: str, index: int) -> dict[str, Any]:
        per_item = self.media_settings.get(modality, [])
        return {**self.mm_processor_kwargs, **(per_item[index] if index < len(per_item) else {})}


def _as_items(modality: str, value: Any) -> list[Any]:
    """One item or a list of them. A video may itself be a list of frames (PIL images or
    H x W x C arrays): such a list is one video, not several."""
    if not isinstance(value, (list, tuple)):
        return [value]
    if modality == "video" and value and _is_frame(value[0]):
        return [list(value)]
    return list(value)


def _is_frame(x: Any) -> bool:
    from PIL import Image

    return isinstance(x, Image.Image) or (hasattr(x, "ndim") and x.ndim == 3)


def max_chars_per_token(tokenizer) -> int:
    """No token covers more characters than its longest entry in the vocabulary: a text
    longer than that many characters per token of context cannot fit, whatever it says."""
    return max((len(t) for t in tokenizer.get_vocab()), default=1)


def check_prompt_text(text: str, max_model_len: int, chars_per_token: int) -> None:
    """Cheap refusals before tokenizing: text that is not valid Unicode, or longer than the
    context at the most characters a token can cover."""
    if not isinstance(text, str):
        raise ValueError(f"the prompt must be text, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"the prompt is not valid Unicode text (a lone surrogate {text[e.start]!r} at "
                         f"character {e.start})") from None
    if len(text) > max_model_len * chars_per_token:
        raise ValueError(f"the prompt is {len(text)} characters, more than the model's context of "
                         f"{max_model_len} tokens can hold")


class InputProcessor:
    def __init__(
        self,
        tokenizer,
        mm_processor: MultiModalProcessor,
        model_cls: type,
        hf_config,
        max_model_len: int,
        eos_token_id: int | None,
        block_hasher,
        max_media_tokens: int,
        block_size: int,
        limit_mm_per_prompt: dict[str, int],
        default_mm_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.mm = mm_processor
        self.model_cls = model_cls
        self.hf_config = hf_config
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id
        self.block_hasher = block_hasher
        self.max_media_tokens = max_media_tokens
        self.block_size = block_size
        self.limits = limit_mm_per_prompt
        self.default_mm_kwargs = dict(default_mm_kwargs or {})
        self.placeholder = {"image": mm_processor.image_token, "video": mm_processor.video_token}
        self.pad_id = {"image": mm_processor.image_token_id, "video": mm_processor.video_token_id}
        # Qwen's placeholder is its pad token; Gemma 3's is <start_of_image>, which its replacement repeats
        self.placeholder_id = {m: tokenizer.convert_tokens_to_ids(p) for m, p in self.placeholder.items() if p}
        self.bidirectional_media = getattr(model_cls, "bidirectional_media", False)
        self.chars_per_token = max_chars_per_token(tokenizer)
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
        lora_request: LoRARequest | None = None,
        lora_adapts_vision: bool = False,
        pooling_params: PoolingParams | None = None,
    ) -> Request:
        """The request of a prompt; its media's hashes name the adapter where the adapter
        changes how pictures are encoded (the encoder cache keeps them apart)."""
        inp = PromptInput.parse(prompt)
        if inp.prompt is None and inp.prompt_token_ids is None:
            raise ValueError("a prompt needs 'prompt' text or 'prompt_token_ids'")
        if inp.prompt is not None:
            check_prompt_text(inp.prompt, self.max_model_len, self.chars_per_token)
        normalize_settings(inp.mm_processor_kwargs)  # checked even when the prompt has no media
        for modality, items in inp.media.items():
            limit = self.limits.get(modality, 0)
            if len(items) > limit:
                raise ValueError(f"{len(items)} {modality}(s) in one prompt, over the limit of {limit} "
                                 f"(--limit-mm-per-prompt {modality}={limit})")
        media = {
            m: [self._process_item(m, src, {**self.default_mm_kwargs, **inp.settings_for(m, i)}, i)
                for i, src in enumerate(items)]
            for m, items in inp.media.items()
        }
        token_ids = self._expand(inp, media)
        if inp.truncate_prompt_tokens is not None:
            token_ids, media = self._truncate(token_ids, media, inp.truncate_prompt_tokens)
        self._check_length(len(token_ids))
        features = self._features(token_ids, media)
        if lora_adapts_vision:
            features = [dataclasses.replace(f, mm_hash=f"{f.mm_hash}@{lora_request.cache_key}") for f in features]
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
            lora_request=lora_request,
            pooling_params=pooling_params,
        )
        request.cache_points = self._cache_points(token_ids, features)
        return request

    def _process_item(self, modality: str, source: Any, settings: dict[str, Any], index: int) -> ProcessedMedia:
        try:
            item = self.mm.process(source, modality, settings)
        except ValueError as e:
            raise type(e)(f"{modality} {index}: {e}") from None
        tokens = item.num_tokens
        if tokens > self.max_media_tokens:
            raise ValueError(
                f"{modality} {index} needs {tokens} tokens, more than the engine's budget of "
                f"{self.max_media_tokens} for one item (encoder budget and cache; for models whose picture tokens "
                f"see each other, also the step's token budget); send a smaller {modality} or lower max_pixels"
            )
        return item

    def _expand(self, inp: PromptInput, media: dict[str, list[ProcessedMedia]]) -> list[int]:
        """Each placeholder becomes the HF processor's replacement for its item (pads, and
        for Qwen3-style videos the frame timestamps), then the text is tokenized whole —
        so the ids are exactly transformers'."""
        if inp.prompt is not None:
            return self.tokenizer.encode(self._expand_text(inp.prompt, media), add_special_tokens=False)
        vocab = getattr(getattr(self.hf_config, "text_config", self.hf_config), "vocab_size", None)
        bad = [t for t in inp.prompt_token_ids if not isinstance(t, int) or t < 0 or (vocab and t >= vocab)]
        if bad:
            span = f" (0 to {vocab - 1})" if vocab else ""
            raise ValueError(f"prompt_token_ids holds {bad[0]!r}, not a token id of this model{span}")
        out, counters = [], dict.fromkeys(MODALITIES, 0)
        by_id = {i: m for m, i in self.placeholder_id.items() if i is not None}
        for token in inp.prompt_token_ids:
            modality = by_id.get(token)
            if modality is None:
                out.append(token)
                continue
            items = media.get(modality, [])
            if counters[modality] >= len(items):
                counters[modality] += 1
                continue
            out += self.tokenizer.encode(items[counters[modality]].replacement, add_special_tokens=False)
            counters[modality] += 1
        self._check_counts(counters, media)
        return out

    def _expand_text(self, text: str, media: dict[str, list[ProcessedMedia]]) -> str:
        counters = dict.fromkeys(MODALITIES, 0)
        parts, i = [], 0
        marks = {self.placeholder[m]: m for m in MODALITIES if self.placeholder[m]}
        while True:
            found = [(text.find(mark, i), mark) for mark in marks if text.find(mark, i) >= 0]
            if not found:
                parts.append(text[i:])
                break
            at, mark = min(found)
            modality = marks[mark]
            parts.append(text[i:at])
            items = media.get(modality, [])
            if counters[modality] < len(items):
                parts.append(items[counters[modality]].replacement)
            counters[modality] += 1
            i = at + len(mark)
        self._check_counts(counters, media)
        return "".join(parts)

    def _truncate(self, token_ids: list[int], media: dict[str, list[ProcessedMedia]],
                  keep: int) -> tuple[list[int], dict[str, list[ProcessedMedia]]]:
        """The last `keep` tokens, and the media whose placeholders are in them: an item
        wholly before the cut goes with it; one the cut would split is refused."""
        cut = max(len(token_ids) - keep, 0)
        if cut == 0:
            return token_ids, media
        by_id = {self.pad_id[m]: m for m in MODALITIES if self.pad_id[m] is not None}
        dropped = dict.fromkeys(MODALITIES, 0)
        covered = dict.fromkeys(MODALITIES, 0)  # placeholder tokens before the cut, per modality
        for token in token_ids[:cut]:
            modality = by_id.get(token)
            if modality is not None:
                covered[modality] += 1
        for modality in MODALITIES:
            for item in media.get(modality, []):
                if covered[modality] <= 0:
                    break
                if covered[modality] < item.num_tokens:
                    raise ValueError(f"truncate_prompt_tokens={keep} would cut through {modality} {dropped[modality]}: "
                                     f"keep more tokens, or fewer")
                covered[modality] -= item.num_tokens
                dropped[modality] += 1
        return token_ids[cut:], {m: items[dropped[m]:] for m, items in media.items()}

    @staticmethod
    def _check_counts(counters: dict[str, int], media: dict[str, list[ProcessedMedia]]) -> None:
        for modality in MODALITIES:
            given = len(media.get(modality, []))
            if counters[modality] != given:
                raise ValueError(
                    f"the prompt has {counters[modality]} {modality} placeholder(s) but {given} {modality}(s) were given"
                )

    def _features(self, token_ids: list[int], media: dict[str, list[ProcessedMedia]]) -> list[MultiModalFeature]:
        """One feature per run of pad tokens. A video whose frame groups are separated by
        timestamps (Qwen3.5) becomes one feature per group, each a grid of t = 1."""
        runs: dict[str, list[tuple[int, int]]] = {m: [] for m in MODALITIES}
        by_id = {self.pad_id[m]: m for m in MODALITIES if self.pad_id[m] is not None}
        i = 0
        while i < len(token_ids):
            modality = by_id.get(token_ids[i])
            if modality is None:
                i += 1
                continue
            j = i
            while j < len(token_ids) and token_ids[j] == token_ids[i]:
                j += 1
            runs[modality].append((i, j - i))
            i = j
        features = []
        for modality in MODALITIES:
            pending = list(runs[modality])
            for item in media.get(modality, []):
                features += self._split(item, pending)
        return sorted(features, key=lambda f: f.offset)

    def _split(self, item: ProcessedMedia, runs: list[tuple[int, int]]) -> list[MultiModalFeature]:
        """The item's feature, or one per run of pad tokens it spans (a video's frame
        groups, a picture's pan-and-scan crops), each with its share of the pixel rows."""
        mine, covered = [], 0
        while covered < item.num_tokens:
            offset, length = runs.pop(0)
            mine.append((offset, length))
            covered += length
        both_ways = self.bidirectional_media
        if len(mine) == 1:
            offset, length = mine[0]
            return [MultiModalFeature(item.modality, item.mm_hash, offset, length, item.data, bidirectional=both_ways)]
        pixels = item.data["pixel_values"]
        features, start = [], 0
        for k, (offset, length) in enumerate(mine):
            lo, hi = start * len(pixels) // covered, (start + length) * len(pixels) // covered
            data = dict(item.data, pixel_values=pixels[lo:hi])
            if "grid_thw" in data:  # frame groups of a video
                _, h, w = data["grid_thw"]
                data["grid_thw"] = ((hi - lo) // (h * w), h, w)
            features.append(MultiModalFeature(item.modality, f"{item.mm_hash}.{k}", offset, length, data, piece=k,
                                              bidirectional=both_ways))
            start += length
        return features

    def _cache_points(self, token_ids: list[int], features: list[MultiModalFeature]) -> list[int]:
        """Block boundaries where a later prompt likely diverges from this one: after each
        media item, after each message, at the end of the prompt (rounded down)."""
        ends = [f.end for f in features] + [len(token_ids) - 1]
        if self.message_end_id is not None:
            ends += [i + 1 for i, t in enumerate(token_ids) if t == self.message_end_id]
        bs = self.block_size
        return sorted({e // bs * bs for e in ends if e // bs * bs > 0})

    def _check_length(self, num_prompt_tokens: int) -> None:
        if num_prompt_tokens == 0:
            raise ValueError("the prompt is empty")
        if num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"the prompt is {num_prompt_tokens} tokens (media included), but the model's context "
                f"is {self.max_model_len} tokens and at least one must be left to generate"
            )
