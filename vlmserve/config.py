"""Engine settings shared by the scheduler, the runner and the entry points."""

from __future__ import annotations

from dataclasses import dataclass

# --kv-cache-dtype (vLLM's names): auto keeps keys and values in the model's dtype; fp8 and
# fp8_e4m3 store them in float8 e4m3fn (core/kv_cache_spec.py)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


@dataclass
class SchedulerConfig:
    """The scheduler's share of the engine's settings (EngineArgs holds their defaults),
    with what the engine core derived from them (the context that fits, chunk caps)."""

    max_num_batched_tokens: int  # token budget of one step
    max_num_seqs: int  # requests running at once
    max_model_len: int  # prompt + output tokens of one request
    enable_chunked_prefill: bool
    # encoder budget of one step, and encoder cache capacity, in embedding tokens
    encoder_compute_budget: int
    encoder_cache_size: int
    # speculative decoding: drafts are checked only while at most this many requests run
    # (None: always); above it a step is compute-bound and checking drafts costs more
    max_running_for_drafts: int | None = None
    # KV slots allocated past a request's step for a draft model to write its guesses into
    num_lookahead_tokens: int = 0
    # prompt tokens one request computes in a step at most (None: the token budget); a
    # small cache with sliding-window layers must hold a lone request's whole chunk
    max_chunk_tokens: int | None = None
    # LoRA adapters running at once (the runner's slots); a request for another waits
    max_loras: int = 0
    # pipeline stages: a request whose token is in flight sits out the steps scheduled
    # meanwhile (its token would not reach the first stage in time), so that steps of other
    # requests fill the stages; else it joins them with a placeholder (async scheduling)
    sit_out_in_flight: bool = False

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


def check_known(cls: type, settings: dict, where: str = "") -> None:
    """ValueError naming the settings a JSON flag gives that the dataclass has no field for."""
    known = set(cls.__dataclass_fields__)
    unknown = set(settings) - known
    if unknown:
        raise ValueError(f"{where}unknown setting(s) {sorted(unknown)}; known: {sorted(known)}")


@dataclass
class SpeculativeConfig:
    """Speculative decoding: a proposer guesses the next tokens of a decoding request,
    and one forward of the model checks them all (vLLM's names for the settings)."""

    # ngram: prompt lookup (the request's own tokens); draft_model: a smaller checkpoint
    # with the same tokenizer (the default when `model` is given)
    method: str = "ngram"
    num_speculative_tokens: int = 4  # draft tokens proposed per request and step, at most
    prompt_lookup_min: int = 2  # ngram: the shortest n-gram looked up
    prompt_lookup_max: int = 4  # ngram: the longest n-gram looked up (longer ones are tried first)
    disable_by_batch_size: int | None = None  # no drafts while more requests than this run
    model: str | None = None  # draft_model: its checkpoint folder or hub id

    @classmethod
    def from_dict(cls, settings: dict) -> SpeculativeConfig | None:
        """None when empty (speculation off); ValueError naming what is wrong."""
        if not settings:
            return None
        check_known(cls, settings, "speculative_config: ")
        if settings.get("model") is not None and "method" not in settings:
            settings = {**settings, "method": "draft_model"}
        config = cls(**settings)
        if config.method not in ("ngram", "draft_model"):
            raise ValueError(f"speculative_config: method {config.method!r} is not supported; use \"ngram\" or "
                             f"\"draft_model\"")
        if config.method == "draft_model" and not isinstance(config.model, str):
            raise ValueError("speculative_config: method \"draft_model\" needs \"model\": the draft's checkpoint "
                             "folder or hub id")
        if config.method == "ngram" and config.model is not None:
            raise ValueError("speculative_config: \"model\" is for method \"draft_model\", not \"ngram\"")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size"):
            value = getattr(config, name)
            if name == "disable_by_batch_size" and value is None:
                continue  # optional
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config: {name} must be a positive integer, got {value!r}")
        if config.prompt_lookup_min > config.prompt_lookup_max:
            raise ValueError("speculative_config: prompt_lookup_min must not exceed prompt_lookup_max")
        return config


MOONCAKE_REQUIRED = ("local_hostname", "metadata_server", "master_server_address")
MOONCAKE_DEFAULTS = {"protocol": "tcp", "device_name": "", "global_segment_size": 3355443200,
                     "local_buffer_size": 1073741824}  # vLLM's Mooncake store connector's


@dataclass
class KVTransferConfig:
    """A KV connector (vLLM's --kv-transfer-config): a store of KV blocks beyond the cache that
    engines share. kv_role: kv_both (loads and saves), kv_producer (saves only), kv_consumer
    (loads only)."""

    kv_connector: str
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict | None = None

    @classmethod
    def from_dict(cls, settings: dict) -> KVTransferConfig | None:
        """None when empty; ValueError naming what is wrong."""
        if not settings:
            return None
        check_known(cls, settings)
        config = cls(**settings)
        if config.kv_connector != "MooncakeStoreConnector":
            raise ValueError(f"kv_connector {config.kv_connector!r}: vlmserve has \"MooncakeStoreConnector\" (and "
                             f"--kv-offloading-size for a host tier)")
        if config.kv_role not in ("kv_both", "kv_producer", "kv_consumer"):
            raise ValueError(f"kv_role {config.kv_role!r}: kv_both, kv_producer or kv_consumer")
        return config

    def mooncake_settings(self, config_file: str | None) -> dict:
        """The pool's settings: config_file's (MOONCAKE_CONFIG_PATH), then the extra config's
        over them; ValueError naming a missing one."""
        import json

        settings = dict(MOONCAKE_DEFAULTS)
        if config_file:
            with open(config_file) as f:
                settings.update(json.load(f))
        settings.update(self.kv_connector_extra_config or {})
        missing = [k for k in MOONCAKE_REQUIRED if not settings.get(k)]
        if missing:
            raise ValueError(f"the Mooncake pool needs {', '.join(missing)} (in kv_connector_extra_config or the "
                             f"JSON file MOONCAKE_CONFIG_PATH names)")
        return settings
