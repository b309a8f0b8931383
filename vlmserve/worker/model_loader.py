"""Builds a model from a checkpoint folder: config -> family class -> weights."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig

from vlmserve.distributed import ONE_STAGE, SINGLE, PipelineStage, TensorParallel
from vlmserve.kernels import KernelTable, ops, use_kernels
from vlmserve.kernels.cpu_extension import widens_bf16
from vlmserve.kernels.quantized_linear import tiled_kernels_available
from vlmserve.models import get_model_class
from vlmserve.models.layers import Embedding, Linear
from vlmserve.models.pipeline_parallel import split_stages
from vlmserve.models.quantized_checkpoints import CheckpointQuantization, read_quantized
from vlmserve.models.tensor_parallel import shard_model
from vlmserve.models.weights import iter_safetensors, return_freed_memory

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def _skip_param_init(dtype: torch.dtype):
    """Creates parameters uninitialised, in dtype: the checkpoint overwrites them anyway,
    and random init of a large model costs seconds of startup."""
    saved = {}
    for cls in (nn.Linear, nn.Embedding, nn.LayerNorm, nn.Conv3d):
        saved[cls] = cls.reset_parameters
        cls.reset_parameters = lambda self: None
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old_dtype)
        for cls, fn in saved.items():
            cls.reset_parameters = fn


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@functools.cache
def cpu_bf16_is_faster() -> bool:
    """Whether bf16 matmuls beat fp32 ones on this CPU, timed once per process (a few
    milliseconds). The CPU's flags don't tell: without AVX-512 torch's bf16 gemm is ~50x
    slower than fp32, with AVX-512 bf16 but no AMX it runs at ~0.7x, with AMX several
    times faster (all measured)."""
    try:
        if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return False
    except (AttributeError, RuntimeError):
        return False

    def best_of_3(dtype: torch.dtype) -> float:
        a, b = torch.randn(128, 512, dtype=dtype), torch.randn(512, 1024, dtype=dtype)
        a @ b  # first call: kernel selection
        times = []
        for _ in range(3):
            start = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - start)
        return min(times)

    fp32, bf16 = best_of_3(torch.float32), best_of_3(torch.bfloat16)
    logger.debug("bf16 matmul %.3f ms, fp32 %.3f ms", bf16 * 1e3, fp32 * 1e3)
    return bf16_pays(fp32, bf16)


def bf16_pays(fp32_seconds: float, bf16_seconds: float) -> bool:
    """bf16 is worth its lost precision only when clearly faster."""
    return bf16_seconds < 0.8 * fp32_seconds


def resolve_dtype(name: str, hf_config, device: str = "cpu", quantized: bool = False) -> torch.dtype:
    """'auto' runs the checkpoint's own dtype (a GPU runs it as saved), except that on the
    CPU half precision runs as bfloat16 only where bf16 layers are faster than fp32 ones
    (no CPU here has fast fp16 ones), else as float32. They are: where bf16 matmuls beat
    fp32 ones on this CPU (timed); on CPUs without bf16 arithmetic (AVX2, AVX-512F alone),
    where vlmserve's kernels widen bf16 weights in registers (half fp32's bytes and memory:
    on AVX2 1.5x its tok/s on a batch at Qwen2.5-VL-3B widths, ~3x for one user,
    docs/benchmarks.md); and where the
    language layers run `quantized` on vlmserve's int8/int4 kernels (which take bf16
    layers: in fp32 those layers would be dequantized for every step)."""
    if name != "auto":
        if name not in _DTYPES:
            raise ValueError(f"dtype must be one of {['auto', *_DTYPES]}, got {name!r}")
        return _DTYPES[name]
    saved = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(saved, str):
        saved = _DTYPES.get(saved)
    if torch.device(device).type == "cuda":
        return saved or torch.float32
    half = saved in (torch.bfloat16, torch.float16)
    bf16_pays_here = widens_bf16() or cpu_bf16_is_faster() or quantized and tiled_kernels_available()
    return torch.bfloat16 if half and bf16_pays_here else torch.float32


def pack_linear_weights(model: nn.Module, memory_share: float = 0.25) -> int:
    """Gives every linear layer a prepacked copy of its weight (where its device has such
    a layout: oneDNN's on CPU), unless the copies kept beside the weights would take more
    than `memory_share` of this machine's memory (a copy that takes its weight's place
    counts nothing). Returns the bytes the copies beside the weights take."""
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    extra = sum(m.weight.numel() * m.weight.element_size() for m in linears
                if not ops.packed_copy_replaces_weight(m.weight))
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if extra > memory_share * total:
        logger.info("linear weights not packed: a copy (%.1f GB) would take over %d%% of memory",
                    extra / 1e9, memory_share * 100)
        return 0
    readers: dict[int, list[nn.Module]] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            readers.setdefault(id(p), []).append(module)
    for m in linears:
        # a head tied to the embedding table packs it in place: the table reads its rows there
        tables = [r for r in readers[id(m.weight)] if r is not m]
        in_place = all(isinstance(r, Embedding) for r in tables)
        if m.pack(in_place) and in_place:
            for table in tables:
                table.read_packed(m.packed_weight)
    return extra if any(m.packed_weight is not None for m in linears) else 0


def place_streamed_weights(model: nn.Module) -> None:
    """Gives the weights a decode step reads whole — the linear layers', and the embedding
    table, which a tied output head reads — the memory its device's kernels stream fastest
    (`ops.zeros_streamed`: on the CPU, 2 MB pages); before the checkpoint is read, so that
    it is copied in once. A layer quantized later frees it."""
    for module in model.modules():
        if isinstance(module, (Linear, nn.Embedding)) and module.weight.device.type != "meta":
            weight = module.weight
            module.weight = nn.Parameter(ops.zeros_streamed(tuple(weight.shape), weight.dtype), requires_grad=False)


def quantization_targets(model: nn.Module, method: str, with_head: bool = True) -> dict[Linear, str]:
    """The layers to quantize, with their method: the linear layers of the language model,
    and the output head in int8 under either method (as llama.cpp's Q4/Q8 files keep it at
    6-8 bits); the vision tower and the embeddings keep their dtype. A head tied to the
    embedding table is not here: it is made (an int8 copy; the table stays for lookups)
    once the table is loaded."""
    targets = {m: method for m in model.model.language_model.modules() if isinstance(m, Linear)}
    if with_head and model.lm_head is not None:  # 151,936 x 2048: a third of 3B's bytes at 8 layers
        targets[model.lm_head] = "int8"
    return targets


def quantize_remaining(targets: dict[Linear, str]) -> tuple[int, int]:
    """Quantizes the targets not quantized while loading (a tied head's copy); returns the
    targets' weight bytes in full precision and quantized."""
    before = after = 0
    for module, method in targets.items():
        if module.quantized is None:
            module.quantize(method)
        if module.quantized is not None:
            before += module.in_features * module.out_features * module.weight.element_size()
            after += module.quantized.nbytes
    return before, after


def load_model(
    model_path: str | Path, dtype: str | torch.dtype, kernels: KernelTable, device: str = "cpu",
    pack_weights: bool = True, quantization: str | None = None, embeds: bool = False,
    tp: TensorParallel = SINGLE, expert_parallel: bool = False, stage: PipelineStage = ONE_STAGE,
) -> tuple[nn.Module, object]:
    """The model in dtype on the device, its language layers quantized if asked, its weights
    packed for `kernels` (the engine's kernel table), and its HF config. A model that embeds
    has no head (embedding checkpoints often leave it out). Split across ranks (tp, stage):
    this rank's part, read from the checkpoint alone."""
    start = time.perf_counter()
    hf_config = AutoConfig.from_pretrained(str(model_path))
    published = CheckpointQuantization.from_config(getattr(hf_config, "quantization_config", None))
    if not isinstance(dtype, torch.dtype):
        dtype = resolve_dtype(dtype, hf_config, device, quantized=bool(quantization or published))
    with _skip_param_init(dtype):
        model = get_model_class(getattr(hf_config, "architectures", None) or [])(hf_config)
    if embeds:
        model.lm_head = None  # a head in the checkpoint is skipped
    shard_model(model, tp, expert_parallel)
    split_stages(model, stage)
    with use_kernels(kernels):
        place_streamed_weights(model)
    if published and quantization:
        raise ValueError(f"the checkpoint is already quantized ({published.method}): --quantization is for "
                         f"unquantized ones")
    num_params = sum(p.numel() for p in model.parameters())
    weights = iter_safetensors(model_path)
    # each layer is quantized as soon as it is loaded: its full-precision weight is freed
    # before the next one is read, so loading peaks near the quantized size
    targets = quantization_targets(model, quantization, with_head=not embeds) if quantization else {}
    model.load_weights(read_quantized(weights, published, dtype) if published else weights, targets)
    model = model.to(device=device).eval()  # params were created in dtype; fp32 buffers stay fp32
    model.requires_grad_(False)
    if quantization:
        if not embeds:
            targets.setdefault(model.untied_head(), "int8")  # a tied head's int8 copy
        before, after = quantize_remaining(targets)
        return_freed_memory()
        logger.info("quantized the language layers to %s: %.2f GB of linear weights -> %.2f GB", quantization,
                    before / 1e9, after / 1e9)
    quantized = [m for m in model.modules() if isinstance(m, Linear) and m.quantized is not None]
    with use_kernels(kernels):
        for m in quantized:
            m.prepare_quantized()
            return_freed_memory()  # the layout's temporaries, before the next layer's
    if published:
        logger.info("%s %d-bit checkpoint: %d linear layers run on their quantized weights", published.method,
                    published.bits, len(quantized))
    if pack_weights:
        if not embeds:
            # a head tied to the embedding table gets a packed copy as the layers do (where
            # the bf16 GEMV does not take it: fp32 2-5.6x, bf16 batches 1.3-1.45x at 151,936 x 2048)
            model.untied_head()
        with use_kernels(kernels):
            packed = pack_linear_weights(model)
        return_freed_memory()  # weights whose packed copies took their place
        logger.debug("packed linear weights: %.1f MB", packed / 1e6)
    logger.info("loaded %s (%.1fM parameters%s, %s) in %.2fs", type(model).__name__, num_params / 1e6,
                f" on rank {stage.rank} of {tp.size * stage.size}" if tp.size * stage.size > 1 else "", dtype, time.perf_counter() - start)
    return model, hf_config
