"""One user's decode step through the decoder's layers in one C++ call
(kernels/decode_layers.py): the same numbers as the layers' own forward, op by op."""

from __future__ import annotations

import pytest

from conftest import make_image
from vlmserve import LLM, LoRARequest, SamplingParams
from vlmserve.kernels import cpu_extension
from vlmserve.models.base import MRoPEDecoder
from vlmserve.testing.checkpoints import build_qwen2_5_vl, build_qwen3_vl
from vlmserve.testing.lora_adapters import write_lora_adapter

pytestmark = pytest.mark.skipif(not cpu_extension.available(), reason="needs vlmserve's CPU kernels")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """128 wide (int4's groups of 128 fit), one KV cache group (no sliding-window layer);
    Qwen3-VL's layers norm each head's queries and keys."""
    root = tmp_path_factory.mktemp("decode_layers")
    return {
        "qwen2_5_vl": str(build_qwen2_5_vl(root / "qwen25", hidden_size=128, intermediate_size=256, num_layers=2,
                                           sliding_window=None)),
        "qwen3_vl": str(build_qwen3_vl(root / "qwen3vl", hidden_size=128, head_dim=32, intermediate_size=256)),
    }


@pytest.fixture
def plans(monkeypatch):
    """The plans the decoders ran on, step by step (None: op by op)."""
    made = []
    planned = MRoPEDecoder.decode_plan

    def record(self):
        made.append(planned(self))
        return made[-1]

    monkeypatch.setattr(MRoPEDecoder, "decode_plan", record)
    return made


def answer(llm: LLM, image, lora: LoRARequest | None = None) -> tuple[list[int], list]:
    prompt = {"prompt": "<|vision_start|><|image_pad|><|vision_end|>Describe it.", "multi_modal_data": {"image": image}}
    out = llm.generate(prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=3),
                       lora_request=lora)[0].outputs[0]
    return out.token_ids, list(out.logprobs)


def op_by_op(monkeypatch, llm: LLM, image, lora: LoRARequest | None = None) -> tuple[list[int], list]:
    with monkeypatch.context() as m:
        m.setattr(MRoPEDecoder, "decode_plan", lambda self: None)
        return answer(llm, image, lora)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
def test_one_call_gives_the_logprobs_of_the_layers_op_by_op(checkpoints, plans, monkeypatch, family, quantization):
    llm = LLM(checkpoints[family], dtype="bfloat16", quantization=quantization, num_kv_blocks=64)
    image = make_image(96, 72, seed=3)
    fused = answer(llm, image)
    assert plans and all(plan is not None for plan in plans)  # every decode step ran in one call
    assert fused == op_by_op(monkeypatch, llm, image)


def test_layers_given_lora_slots_go_back_to_op_by_op(checkpoints, plans, monkeypatch, tmp_path):
    base = checkpoints["qwen2_5_vl"]
    adapter = LoRARequest("a", 1, str(write_lora_adapter(base, tmp_path / "a", rank=4, seed=0,
                                                         target_modules=["q_proj", "down_proj"])))
    llm = LLM(base, dtype="bfloat16", enable_lora=True, max_lora_rank=8, num_kv_blocks=64)
    image = make_image(96, 72, seed=4)
    answer(llm, image)  # the base model first: its steps run in one call
    assert plans and plans[-1] is not None
    adapted = answer(llm, image, adapter)
    assert plans[-1] is None  # the adapter's layers add their products in Python
    assert adapted == op_by_op(monkeypatch, llm, image, adapter)
    assert adapted != answer(llm, image)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_one_call_over_an_fp8_kv_cache_gives_the_logprobs_of_the_layers_op_by_op(checkpoints, plans, monkeypatch,
                                                                                 family):
    """An FP8 KV cache with scales of its own in each layer (as a checkpoint gives them):
    the one call writes and reads each layer's cache with that layer's scales, bit for bit
    as the layers' own forward does."""
    from vlmserve.models.layers import PagedAttention

    llm = LLM(checkpoints[family], dtype="bfloat16", num_kv_blocks=64, kv_cache_dtype="fp8")
    layers = [m for m in llm.engine.core.core.runner.model.modules() if isinstance(m, PagedAttention)]
    for i, layer in enumerate(layers):
        layer.k_scale, layer.v_scale = 0.3 + 0.1 * i, 1.7 - 0.2 * i
    image = make_image(96, 72, seed=3)
    fused = answer(llm, image)
    assert plans and all(plan is not None for plan in plans)
    assert fused == op_by_op(monkeypatch, llm, image)
    for layer in layers:  # the scales made a difference
        layer.k_scale, layer.v_scale = 1.0, 1.0
    assert op_by_op(monkeypatch, llm, image)[1] != fused[1]
