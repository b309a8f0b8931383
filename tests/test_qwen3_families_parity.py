"""The Qwen3 families — Qwen3-VL (DeepStack), Qwen3-VL-MoE (a dense layer among the MoE
ones) and Qwen3.5-MoE (hybrid, with a shared expert) — against transformers on tiny
random-weight checkpoints: greedy tokens equal, prompt and sampled logprobs within 1e-4
(fp32), in every scheduling situation; then what each adds. (Video:
tests/test_media.py; Qwen3.5 dense: tests/test_qwen3_5_parity.py.)"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import HFReference
from test_qwen2_5_vl_parity import (CASES, IMG_A, IMG_C, assert_all_free, check, check_mixed_chunked_then_preempted,
                                    greedy, request)
from vlmserve import LLM
from vlmserve.models.moe import Experts as ExpertsLayer
from vlmserve.models.moe import SparseMoE
from vlmserve.models.qwen3_vl import Qwen3VLForConditionalGeneration
from vlmserve.testing.checkpoints import Experts, build_qwen3_5, build_qwen3_vl

FAMILIES = ["qwen3vl", "qwen3vlmoe", "qwen35moe"]


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.getfixturevalue(f"{request.param}_path"), request.getfixturevalue(f"hf_{request.param}")


@pytest.mark.parametrize("case", CASES)
def test_single_request_matches_transformers(family, case):
    path, hf = family
    text, images = CASES[case]
    out = LLM(path, num_kv_blocks=256).generate(request(hf, text, images), greedy(prompt_logprobs=-1))[0]
    check(out, hf, text, images, 16, prompt_logprobs=True)


def test_eight_mixed_requests_under_chunked_prefill_then_preempted(family):
    path, hf = family
    check_mixed_chunked_then_preempted(hf, LLM(path, num_kv_blocks=256, max_num_batched_tokens=24),
                                       LLM(path, num_kv_blocks=24, max_num_seqs=8))


def test_prefix_cache_hit(family):
    path, hf = family
    llm = LLM(path, num_kv_blocks=256)
    text = "Describe the image. " * 3
    llm.generate(request(hf, text, [IMG_A]), greedy())
    second = llm.generate(request(hf, text, [IMG_A]), greedy())[0]
    assert second.num_cached_tokens > 0 and llm.engine.engine_core.runner.encoder_runs == 1
    check(second, hf, text, [IMG_A], 16)
    check(llm.generate(request(hf, text, [IMG_C]), greedy())[0], hf, text, [IMG_C], 16)


def test_chunked_prefill_through_two_pictures(family):
    """Steps of 5 tokens cut each picture (and its DeepStack levels) into pieces."""
    path, hf = family
    llm = LLM(path, num_kv_blocks=256, max_num_batched_tokens=5)
    text, images = CASES["two_images"]
    out = llm.generate(request(hf, text, images), greedy(prompt_logprobs=-1))[0]
    check(out, hf, text, images, 16, prompt_logprobs=True)
    assert llm.engine.engine_core.runner.encoder_runs == 2
    assert_all_free(llm)


# ----------------------------------------------------------------------------- DeepStack
def test_the_encoder_cache_keeps_every_deepstack_level(qwen3vl_path, hf_qwen3vl):
    llm = LLM(qwen3vl_path, num_kv_blocks=256)
    llm.generate(request(hf_qwen3vl, "Describe the image.", [IMG_A]), greedy(2))
    (features,) = llm.engine.engine_core.runner.encoder.cache.values()
    hidden = hf_qwen3vl.model.config.text_config.hidden_size
    levels = 1 + len(hf_qwen3vl.model.config.vision_config.deepstack_visual_indexes)
    assert features.shape[1] == levels * hidden == 3 * hidden


def test_without_deepstack_the_answer_is_not_transformers(qwen3vl_path, hf_qwen3vl, monkeypatch):
    """The parity above depends on DeepStack: with its levels dropped, the logprobs move."""
    text, images = CASES["one_image"]

    def last_level_only(self, embeds, token_index, mm_embeds):
        embeds.index_copy_(0, token_index, mm_embeds[:, : embeds.shape[-1]].to(embeds.dtype))
        return None

    monkeypatch.setattr(Qwen3VLForConditionalGeneration, "merge_multimodal", last_level_only)
    out = LLM(qwen3vl_path, num_kv_blocks=256).generate(request(hf_qwen3vl, text, images), greedy(prompt_logprobs=-1))[0]
    with pytest.raises(AssertionError):
        check(out, hf_qwen3vl, text, images, 16, prompt_logprobs=True)


def test_bf16_runs_and_agrees_with_fp32_on_the_first_token(qwen3vl_path, hf_qwen3vl):
    text, images = CASES["one_image"]
    fp32 = LLM(qwen3vl_path, num_kv_blocks=64).generate(request(hf_qwen3vl, text, images), greedy(1))[0]
    bf16 = LLM(qwen3vl_path, num_kv_blocks=64, dtype="bfloat16").generate(request(hf_qwen3vl, text, images),
                                                                           greedy(1))[0]
    assert torch.isfinite(torch.tensor(bf16.outputs[0].logprobs[0].logprobs)).all()
    assert abs(bf16.outputs[0].logprobs[0].logprobs[0] - fp32.outputs[0].logprobs[0].logprobs[0]) < 0.1


# ----------------------------------------------------------------------------- experts
def test_experts_run_grouped_and_equal_a_per_token_reference():
    """Every token through its own top-k experts, one at a time (the definition) equals
    the grouped computation, for a batch where some experts get no token."""
    torch.manual_seed(0)
    layer = ExpertsLayer(num_experts=6, hidden=16, intermediate=8, act="silu")
    with torch.no_grad():
        layer.gate_up_proj.normal_()
        layer.down_proj.normal_()
    x = torch.randn(9, 16)
    experts = torch.randint(0, 4, (9, 2))  # experts 4 and 5 idle
    weights = torch.rand(9, 2)
    expected = torch.zeros_like(x)
    for t in range(9):
        for slot in range(2):
            e = experts[t, slot]
            gate, up = (layer.gate_up_proj[e] @ x[t]).chunk(2)
            expected[t] += weights[t, slot] * (layer.down_proj[e] @ (torch.nn.functional.silu(gate) * up))
    assert torch.allclose(layer(x, experts, weights), expected, atol=1e-5)


def test_transformers_layout_of_the_experts_loads(qwen3vlmoe_path, hf_qwen3vlmoe, tmp_path):
    """The test checkpoint stores the experts as Qwen's releases do ([experts, in, out]);
    transformers 5 saves them [experts, out, in]. That layout loads to the same model."""
    import shutil

    own = tmp_path / "transformers-layout"
    shutil.copytree(qwen3vlmoe_path, own)
    weights = load_file(str(own / "model.safetensors"))
    gate_up = next(v for k, v in weights.items() if k.endswith(".experts.gate_up_proj"))
    assert gate_up.shape[1:] == (64, 2 * 48)  # released: [experts, hidden, 2 * intermediate]
    moved = {k: (v.transpose(1, 2).contiguous() if ".experts." in k else v) for k, v in weights.items()}
    save_file(moved, str(own / "model.safetensors"), metadata={"format": "pt"})
    text, images = CASES["one_image"]
    out = LLM(str(own), num_kv_blocks=64).generate(request(hf_qwen3vlmoe, text, images), greedy())[0]
    check(out, hf_qwen3vlmoe, text, images, 16)


def test_per_expert_checkpoint_names_load(qwen35moe_path):
    """Qwen3.5-MoE checkpoints name each expert's projections; every one is loaded."""
    index = json.loads(open(f"{qwen35moe_path}/config.json").read())
    assert index["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    names = load_file(f"{qwen35moe_path}/model.safetensors").keys()
    assert any(".experts.7.up_proj.weight" in n for n in names)
    model = LLM(qwen35moe_path, num_kv_blocks=16).engine.engine_core.runner.model
    moe = [m for m in model.modules() if isinstance(m, SparseMoE)]
    assert moe and all(m.shared_expert is not None for m in moe)


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["qwen3-vl-2b", "qwen3-vl-30b-a3b", "qwen3.5-moe"])
def test_released_dimensions(shape, tmp_path):
    """Released models' head sizes, rotary and expert counts with two layers (the MLPs'
    width cut to keep the checkpoints small): Qwen3-VL-2B — 16 query / 8 KV heads of 128,
    sections [24, 20, 20], theta 5e6, vision width 1024 in 16 heads, a 48 x 48 position
    table, three DeepStack levels; Qwen3-VL-30B-A3B — 32 / 4 heads of 128, 128 experts
    top 8, vision width 1152 in 16 heads;
    Qwen3.5-MoE (transformers' defaults) — heads of 256 with a quarter rotary, DeltaNet
    16 / 32 heads of 128, 256 experts top 8 and a shared expert."""
    if shape == "qwen3-vl-2b":
        path = build_qwen3_vl(
            tmp_path / shape, hidden_size=2048, num_layers=2, num_heads=16, num_kv_heads=8, head_dim=128,
            intermediate_size=1024, vision_hidden=1024, vision_depth=3, vision_heads=16, vision_intermediate=1024,
            num_position_embeddings=2304, deepstack_indexes=(0, 1, 2), rope_theta=5e6, mrope_section=[24, 20, 20],
            weight_scale=0.1)
    elif shape == "qwen3-vl-30b-a3b":
        path = build_qwen3_vl(
            tmp_path / shape, hidden_size=2048, num_layers=2, num_heads=32, num_kv_heads=4, head_dim=128,
            intermediate_size=256, vision_hidden=1152, vision_depth=3, vision_heads=16, vision_intermediate=512,
            num_position_embeddings=2304, deepstack_indexes=(0, 1, 2), rope_theta=5e6, mrope_section=[24, 20, 20],
            experts=Experts(128, 8, 32), weight_scale=0.1)
    else:
        path = build_qwen3_5(
            tmp_path / shape, hidden_size=2048, layer_types=("linear_attention", "full_attention"), num_heads=16,
            num_kv_heads=2, head_dim=256, linear_heads=(16, 32), linear_head_dim=128, vision_hidden=1152,
            vision_heads=16, experts=Experts(256, 8, 16, shared_intermediate=64), partial_rotary=0.25,
            weight_scale=0.1)
    hf = HFReference(str(path))
    llm = LLM(str(path), num_kv_blocks=64)
    for text, images in (CASES["one_image"], CASES["two_images"]):
        # without prompt logprobs only the last row leaves the last layer (Qwen3-VL-2B's
        # third DeepStack level lands after it: cut after that)
        check(llm.generate(request(hf, text, images), greedy(8))[0], hf, text, images, 8)
        out = llm.generate(request(hf, text, images), greedy(8, prompt_logprobs=-1))[0]
        check(out, hf, text, images, 8, prompt_logprobs=True)
