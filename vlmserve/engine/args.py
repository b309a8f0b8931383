"""Every knob of an engine, in one place, shared by the LLM class, the server and the CLI."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any

from vlmserve import envs
from vlmserve.config import KV_CACHE_DTYPES, KVTransferConfig, SpeculativeConfig
from vlmserve.errors import ConfigError
from vlmserve.multimodal.media import MediaLimits
from vlmserve.structured_output.schema import GrammarLimits


@dataclass
class EngineArgs:
    """Every field is also a flag of `vlmserve serve`, `ui` and `caption` (cli.py makes them
    from the fields): its type, its default, and its comment as the help."""

    # a checkpoint folder or a hub id (org/name, from the Hugging Face cache; fetched unless
    # HF_HUB_OFFLINE is set); default: the shipped shapes model
    model: str | None = None
    revision: str | None = None  # of a hub id: a branch, tag or commit
    # auto: the sampling settings of the checkpoint's generation_config.json are the
    # defaults of requests that leave them unset; vlmserve: vlmserve's own defaults
    generation_config: str = "auto"
    download_dir: str | None = None  # the Hugging Face cache to use (default: HF_HOME's)
    # float32, bfloat16, float16, or auto: the checkpoint's, half precision as bf16 where
    # this CPU has fast bf16 matmuls, else fp32
    dtype: str = "auto"
    # cpu, or cuda (the Triton kernels)
    device: str = "cpu"
    # run the Triton kernels even on CPU tensors, in Triton's interpreter (slow: for checking
    # the GPU path without a GPU); default: on with VLMSERVE_USE_TRITON=1
    use_triton: bool = field(default_factory=lambda: envs.VLMSERVE_USE_TRITON)
    # cuda: run every step eagerly (by default decode-only steps replay CUDA graphs
    # captured at start for batches of 1, 2, 4, 8, 16, 32, ...)
    enforce_eager: bool = False
    seed: int = 0
    # keep a prepacked copy of each linear weight (oneDNN's layout on CPU): faster batched
    # matmuls; taken only when the copies fit in a quarter of the machine's memory
    pack_weights: bool = True
    # int8 or int4: quantize the language layers' linear weights as they load (weight-only:
    # int8 per output channel, int4 in groups of 128 inputs); decoding reads 1/2 or 1/4
    # of the bytes. The vision tower, embeddings and output head stay in --dtype
    quantization: str | None = None
    # generate, or pooling: embed (one vector per prompt, /v1/embeddings); auto: pooling for
    # a sentence-transformers checkpoint (modules.json), else generate
    runner: str = "auto"
    # JSON, as vLLM takes it: {"pooling_type": "LAST" | "MEAN" | "CLS", "normalize": true}
    # (default: the checkpoint's sentence-transformers settings, else LAST and normalised)
    pooler_config: dict[str, Any] = field(default_factory=dict)
    # serve LoRA adapters (PEFT's format) named per request (serve --lora-modules, LLM's
    # lora_request): each request runs under its own, in one batch with the others
    enable_lora: bool = False
    max_loras: int = 1  # adapters in use at once (a slot each); a request for another waits for a free slot
    max_lora_rank: int = 16  # the largest rank an adapter may have
    max_cpu_loras: int | None = None  # adapters kept read in memory besides the slots (default: max_loras)
    max_model_len: int | None = None  # context length (default: the model's, capped by the KV cache)
    # requests running at once (default: 64, or as many as half of --kv-cache-memory-gb holds
    # where a hybrid model's recurrent states would take more: ~49 MB a request at Qwen3.5's
    # released size)
    max_num_seqs: int | None = None
    max_num_batched_tokens: int = 2048  # tokens one step computes at most
    max_n: int = 16  # completions one request may ask for (n); each counts as a request in flight
    # split long prompts across steps (off: max_model_len is at most what one step computes for
    # a request, as in vLLM, or a long prompt would never be scheduled)
    chunked_prefill: bool = True
    block_size: int = 16  # tokens per KV block
    kv_cache_memory_gb: float = 0.5  # memory for the KV cache and the recurrent states
    # auto: keys and values in the model's dtype; fp8 (or fp8_e4m3, vLLM's names): float8
    # e4m3fn with a scale per layer for each (1.0 unless the checkpoint gives k_scale and
    # v_scale), twice the blocks in the same memory (docs/quantization.md: an FP8 KV cache)
    kv_cache_dtype: str = "auto"
    num_kv_blocks: int | None = None  # overrides --kv-cache-memory-gb for attention blocks
    # GiB of host memory for KV blocks the cache evicts (vLLM's name; with tensor parallelism,
    # summed over the ranks): a later request whose prefix they hold, a picture's for one,
    # copies them back instead of computing it again. Full-attention models (a hybrid's
    # recurrent states and a sliding window's let-go blocks are not kept); on the CPU a second,
    # larger pool below the first (docs/kv_offloading.md)
    kv_offloading_size: float | None = None
    # JSON, as vLLM takes it: {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both",
    # "kv_connector_extra_config": {...}}: KV blocks shared through a Mooncake pool by every
    # engine on it (its settings there or in the JSON file MOONCAKE_CONFIG_PATH names;
    # docs/kv_offloading.md); full-attention models, one rank
    kv_transfer_config: dict[str, Any] = field(default_factory=dict)
    prefix_caching: bool = True  # reuse the KV cache (and recurrent states) of shared prefixes
    # hybrid models: recurrent-state snapshots kept for prefix caching (default: up to a
    # quarter of the KV memory, at most 8 per running request)
    num_state_snapshots: int | None = None
    encoder_compute_budget: int = 8192  # vision-encoder embedding tokens one step computes at most
    encoder_cache_size: int = 16384  # vision-encoder outputs kept, in embedding tokens (DeepStack: all levels each)
    allowed_local_media_path: str | None = None  # local files are served only from under this folder
    allowed_media_domains: list[str] = field(default_factory=list)  # hosts http(s) media may come from
    # media per prompt, e.g. image=4,video=1 (a modality left out is refused)
    limit_mm_per_prompt: dict[str, int] = field(default_factory=lambda: {"image": 16, "video": 2})
    max_image_mb: float = 20.0  # larger pictures are refused
    max_image_pixels: int = 64 << 20  # larger pictures are refused from their header, before decoding
    max_video_mb: float = 200.0  # larger videos are refused
    media_fetch_timeout: float = 10.0  # seconds for a whole http(s) fetch
    # memory the media decodes in flight may hold together, counted from each item's header
    # (a picture 20 bytes a pixel, a video 6 bytes a pixel of each kept frame): an item
    # needing more alone is refused; others wait for their share, for up to
    # --media-decode-wait seconds, then get a 503
    media_decode_memory_gb: float = 2.0
    media_decode_wait: float = 60.0
    image_background: tuple[int, int, int] = (255, 255, 255)  # R,G,B under transparent pixels
    processor_cache_gb: float = 0.25  # decoded and resized media kept for repeats
    mm_processor_kwargs: dict[str, Any] = field(default_factory=dict)  # JSON: defaults for every media item
    processing_threads: int = 4  # threads that decode and process media and tokenize
    # run the engine core in a process of its own (its step loop never waits for the
    # front end's HTTP, media and detokenizing; on 2 cores it measured slower)
    engine_process: bool = False
    time_steps: bool = False  # accumulate wall seconds per phase of each step (LLMEngine.timer)
    # schedule and prepare the next step while the device computes the last one (one step in
    # flight; on the CPU the forward runs on a thread of its own): the same tokens as without.
    # Default: on with a GPU, and on a CPU with a core to spare beside the forward's threads
    # (VLMSERVE_ASYNC_SCHEDULING=1 or 0 sets the default)
    async_scheduling: bool | None = None

    # JSON, as vLLM takes it: {"method": "ngram", "num_speculative_tokens": 4,
    # "prompt_lookup_min": 2, "prompt_lookup_max": 4}, or a draft model: {"model":
    # "<folder or org/name>", "num_speculative_tokens": 3}; empty: no speculative decoding
    speculative_config: dict[str, Any] = field(default_factory=dict)
    # structured output: what one request may ask the grammar compiler to do (a 400 names
    # the limit a request is over)
    max_grammar_bytes: int = 65536  # a schema's JSON, a regex, a grammar or a choice list
    max_schema_depth: int = 32  # subschemas nested in a JSON schema
    max_schema_properties: int = 512  # object properties across a JSON schema
    max_regex_chars: int = 4096  # a regex, or one pattern of a JSON schema
    grammar_compile_timeout: float = 10.0  # seconds a grammar may take to compile before its request is refused
    grammar_compile_workers: int = 2  # processes that compile grammars, each one grammar at a time
    # thinking models: split each answer's reasoning from its content (vLLM's names: qwen3 for
    # Qwen3-VL, Qwen3-VL-Thinking and Qwen3.5; deepseek_r1); structured output and forced tool
    # calls then start after the reasoning, and requests may set thinking_token_budget
    reasoning_parser: str | None = None
    # a chat template replacing the checkpoint's: a file (.jinja, or a .json with
    # "chat_template"), or the Jinja text itself
    chat_template: str | None = None
    # how a message's content reaches the template: auto (read from the template), string
    # (its text parts joined), or openai (a list of parts)
    chat_template_content_format: str = "auto"
    # split the model across this many ranks (tensor parallelism: each rank holds a share of
    # every layer's heads and widths and of the vocabulary; the vision tower whole): the
    # checkpoints one device cannot hold. --kv-cache-memory-gb is each rank's; on the CPU the
    # ranks share its cores (each gets 1/N of the compute threads)
    tensor_parallel_size: int = 1
    # split the model's decoder layers into this many stages, one after another (each stage
    # tensor_parallel_size ranks wide): for machines without a fast link between them. The
    # first stage holds the vision tower; every stage the embeddings and the output head.
    # The Qwen families; not with LoRA or a KV connector yet
    pipeline_parallel_size: int = 1
    # mixture-of-experts layers: whole experts by rank, not each expert split across the ranks
    enable_expert_parallel: bool = False
    # where ranks 1..N-1 run: mp (processes of this machine) or ray (actors anywhere in the
    # Ray cluster RAY_ADDRESS names, else a local one)
    distributed_executor_backend: str = "mp"
    # the vision tower under tensor parallelism: data (every rank holds it whole and encodes a
    # share of each step's media, the outputs gathered); its weights are not split
    mm_encoder_tp_mode: str = "data"

    def overlaps_steps(self) -> bool:
        """Whether steps are scheduled asynchronously (async_scheduling, or its default)."""
        import torch

        if self.async_scheduling is not None:
            return self.async_scheduling
        if envs.VLMSERVE_ASYNC_SCHEDULING is not None:
            return envs.VLMSERVE_ASYNC_SCHEDULING
        # on 2 cores the host's thread slows the forward's more than overlapping gains
        # (docs/benchmarks.md, the host's share of a step)
        return torch.device(self.device).type == "cuda" or (os.cpu_count() or 1) > torch.get_num_threads()

    def check_device(self) -> None:
        """A device this machine has, and on the CPU Triton only under its interpreter
        (checked before anything is loaded)."""
        import torch

        kind = self.device.split(":")[0]
        if kind not in ("cpu", "cuda"):
            raise ConfigError(f"--device {self.device}: vlmserve runs on cpu or cuda")
        if kind == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"--device {self.device}: no CUDA device on this machine (torch.cuda.is_available() "
                              f"is False); use --device cpu")
        gpus = torch.cuda.device_count() if kind == "cuda" else 0
        if kind == "cuda" and self.distributed_executor_backend == "mp" and self.world_size() > gpus:
            raise ConfigError(f"--tensor-parallel-size {self.tensor_parallel_size} x --pipeline-parallel-size "
                              f"{self.pipeline_parallel_size}: this machine has {gpus} GPU(s), one a rank "
                              f"(--distributed-executor-backend ray places ranks across machines)")
        if kind == "cuda" and self.kv_cache_dtype != "auto" and torch.cuda.get_device_capability(self.device) < (8, 9):
            major, minor = torch.cuda.get_device_capability(self.device)
            name = torch.cuda.get_device_name(self.device)
            raise ConfigError(f"--kv-cache-dtype {self.kv_cache_dtype}: this GPU ({name}, "
                              f"compute capability {major}.{minor}) has no FP8 conversions, which the Triton kernels "
                              f"read an FP8 KV cache with (8.9 and later: Ada, Hopper, Blackwell); use "
                              f"--kv-cache-dtype auto")

    def check_quantization(self, hf_config: Any) -> None:
        """A method vlmserve has, and a checkpoint quantized in a format it loads (checked
        before anything is loaded: one line naming what is not)."""
        from vlmserve.kernels.quantized_linear import METHODS
        from vlmserve.models.quantized_checkpoints import CheckpointQuantization, UnsupportedQuantization

        if self.quantization is not None and self.quantization not in METHODS:
            raise ConfigError(f"--quantization {self.quantization}: vlmserve quantizes to {' or '.join(METHODS)}")
        try:
            published = CheckpointQuantization.from_config(getattr(hf_config, "quantization_config", None))
        except UnsupportedQuantization as e:
            raise ConfigError(f"the checkpoint is quantized with {e}, a format vlmserve does not load") from None
        if published and self.quantization:
            raise ConfigError(f"--quantization {self.quantization}: the checkpoint is already quantized "
                              f"({published.method}, {published.bits}-bit)")

    def check_settings(self) -> None:
        """The settings that need nothing loaded (not even torch): LoRA's sizes, the
        speculative decoding settings, the sampling defaults' source."""
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ConfigError(f"--max-loras {self.max_loras} and --max-lora-rank {self.max_lora_rank} must be positive")
        self.speculative()
        if self.generation_config not in ("auto", "vlmserve"):
            raise ConfigError(f"--generation-config {self.generation_config}: auto or vlmserve")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"--kv-cache-dtype {self.kv_cache_dtype}: {' or '.join(KV_CACHE_DTYPES)} (fp8 is float8 "
                              f"e4m3fn; vLLM's fp8_e5m2 is not supported)")
        self.check_parallel()
        if self.kv_offloading_size is not None and self.kv_offloading_size <= 0:
            raise ConfigError(f"--kv-offloading-size {self.kv_offloading_size}: GiB of host memory, more than 0")
        if self.kv_transfer() and not self.prefix_caching:
            raise ConfigError("--kv-transfer-config shares blocks for prefix-cache hits: it needs prefix caching on")
        if self.kv_offloading_size and not self.prefix_caching:
            raise ConfigError("--kv-offloading-size keeps blocks for prefix-cache hits: it needs prefix caching on")
        from vlmserve.reasoning.parsers import REASONING_PARSERS

        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ConfigError(f"--reasoning-parser {self.reasoning_parser}: vlmserve has {', '.join(REASONING_PARSERS)}")

    def world_size(self) -> int:
        """The ranks the model is split across."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def check_parallel(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"--tensor-parallel-size {self.tensor_parallel_size}: at least 1")
        if self.pipeline_parallel_size < 1:
            raise ConfigError(f"--pipeline-parallel-size {self.pipeline_parallel_size}: at least 1")
        if self.pipeline_parallel_size > 1 and self.enable_lora:
            raise ConfigError("--pipeline-parallel-size with --enable-lora: adapters are not split into pipeline "
                              "stages yet; use --tensor-parallel-size")
        if self.pipeline_parallel_size > 1 and (self.kv_offloading_size or self.kv_transfer_config):
            raise ConfigError("--pipeline-parallel-size with a KV connector (--kv-offloading-size, "
                              "--kv-transfer-config): not yet; use --tensor-parallel-size")
        if self.distributed_executor_backend not in ("mp", "ray"):
            raise ConfigError(f"--distributed-executor-backend {self.distributed_executor_backend}: mp or ray")
        if self.mm_encoder_tp_mode != "data":
            raise ConfigError(f"--mm-encoder-tp-mode {self.mm_encoder_tp_mode}: data (each rank encodes a share of "
                              f"the media with the whole tower) is the mode vlmserve has")

    def kv_transfer(self) -> KVTransferConfig | None:
        """The KV connector's settings (None: none), checked."""
        try:
            return KVTransferConfig.from_dict(self.kv_transfer_config)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"--kv-transfer-config: {e}") from None

    def speculative(self) -> SpeculativeConfig | None:
        """The speculative decoding settings (None: off), checked."""
        try:
            return SpeculativeConfig.from_dict(self.speculative_config)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"--speculative-config: {e}") from None

    def media_limits(self) -> MediaLimits:
        """The size and source checks every reader of this engine's media applies."""
        return MediaLimits(
            max_image_bytes=int(self.max_image_mb * (1 << 20)),
            max_image_pixels=self.max_image_pixels,
            max_video_bytes=int(self.max_video_mb * (1 << 20)),
            allowed_local_media_path=self.allowed_local_media_path,
            allowed_media_domains=list(self.allowed_media_domains),
            fetch_timeout=self.media_fetch_timeout,
            background=tuple(self.image_background),
            decode_memory_bytes=int(self.media_decode_memory_gb * (1 << 30)),
            decode_wait_seconds=self.media_decode_wait,
        )

    def grammar_limits(self) -> GrammarLimits:
        return GrammarLimits(max_bytes=self.max_grammar_bytes, max_schema_depth=self.max_schema_depth,
                             max_schema_properties=self.max_schema_properties, max_regex_chars=self.max_regex_chars)

    @classmethod
    def from_namespace(cls, args: Any) -> EngineArgs:
        """From parsed command-line flags (every field is one: entrypoints/cli.py)."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        known = {f.name for f in fields(cls)}
        unknown = set(kwargs) - known
        if unknown:
            raise TypeError(f"unknown engine argument(s): {sorted(unknown)}")
        return cls(**kwargs)
