"""Published quantized formats (AWQ, GPTQ 4/8-bit with and without desc_act, block-wise
FP8, compressed-tensors W4A16 and W8A8): vlmserve's greedy tokens equal transformers' on
the weights each format stands for; the int4/int8/fp8 ones stay quantized in memory and
answer in the default dtype; each loader's formats load through `serve` for the official
openai client; what is not loaded is named."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import HFReference, assert_greedy_like_transformers, make_image
from vlmserve import LLM, SamplingParams
from vlmserve.models.layers import Linear
from vlmserve.testing.checkpoints import build_qwen2_5_vl
from vlmserve.testing.quantized_checkpoints import write_awq, write_compressed_tensors, write_fp8, write_gptq

FORMATS = {
    # name: (writer, layers expected to stay quantized)
    "awq": (lambda src, dst: write_awq(src, dst), True),
    "gptq-int4": (lambda src, dst: write_gptq(src, dst, bits=4, group=64), True),
    "gptq-int4-desc-act": (lambda src, dst: write_gptq(src, dst, bits=4, group=64, desc_act=True), False),
    "gptq-int4-sym": (lambda src, dst: write_gptq(src, dst, bits=4, group=64, symmetric=True), True),
    "gptq-int8": (lambda src, dst: write_gptq(src, dst, bits=8), False),
    "fp8-block": (lambda src, dst: write_fp8(src, dst), True),
    "compressed-tensors-w4a16": (lambda src, dst: (p := write_compressed_tensors(src, dst, "W4A16"), p), True),
    "compressed-tensors-w8a8": (lambda src, dst: (p := write_compressed_tensors(src, dst, "W8A8"), p), True),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Each format's checkpoint and its reference (what transformers runs), built once."""
    root = tmp_path_factory.mktemp("published")
    source = build_qwen2_5_vl(root / "source", hidden_size=128, intermediate_size=256, num_layers=2)
    return {name: writer(source, root / name) for name, (writer, _) in FORMATS.items()}


def reference(path) -> HFReference:
    from transformers.utils.quantization_config import CompressedTensorsConfig

    config = json.loads((path / "config.json").read_text()).get("quantization_config")
    if not config:
        return HFReference(str(path))
    ref = HFReference.__new__(HFReference)  # compressed-tensors: transformers decompresses it on the CPU
    from transformers import AutoModelForImageTextToText, AutoProcessor

    ref.processor, ref.processor_kwargs, ref._cache = AutoProcessor.from_pretrained(path), {}, {}
    ref.model = AutoModelForImageTextToText.from_pretrained(
        path, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
    return ref


@pytest.mark.parametrize("name", FORMATS)
def test_greedy_tokens_equal_transformers_on_the_formats_weights(checkpoints, name):
    quantized, ref_path = checkpoints[name]
    hf = reference(ref_path)
    llm = LLM(str(quantized), dtype="float32", num_kv_blocks=128)
    assert_greedy_like_transformers(llm, hf, make_image(120, 90, seed=3))


def test_a_fused_layer_of_quantized_and_plain_parts_loads(tmp_path):
    """Qwen3.5's Gated DeltaNet input projection is fused from four: two the packer
    quantizes and two too narrow to (4 outputs), which the checkpoint keeps plain. The
    quantized parts are dequantized into the fused weight; tokens equal transformers'."""
    from vlmserve.testing.checkpoints import build_qwen3_5

    source = build_qwen3_5(tmp_path / "source", hidden_size=128, intermediate_size=256, linear_head_dim=32,
                           head_dim=32)
    quantized, ref_path = write_awq(source, tmp_path / "awq")
    hf = HFReference(str(ref_path))
    llm = LLM(str(quantized), dtype="float32", num_kv_blocks=128)
    prompt = hf.prompt("Describe the image. " * 2, 1)
    image = make_image(100, 90, seed=4)
    tokens, _ = hf.generate(prompt, [image], 10)
    out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": [image]}},
                       SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0].outputs[0]
    assert out.token_ids == tokens


@pytest.mark.parametrize("name", FORMATS)
def test_int4_int8_and_fp8_formats_stay_quantized_in_memory_and_answer(checkpoints, name):
    llm = LLM(str(checkpoints[name][0]), num_kv_blocks=64)  # the default dtype: bf16 on this CPU
    out = llm.generate("Tell me a story about a fox.", SamplingParams(temperature=0, max_tokens=5))[0]
    assert out.outputs[0].text
    model = llm.engine.engine_core.runner.model
    language = [m for m in model.model.language_model.modules() if isinstance(m, Linear)]
    stays_quantized = FORMATS[name][1]
    assert all((m.quantized is not None) == stays_quantized for m in language)
    assert all(m.weight.numel() == 0 for m in language if m.quantized is not None)
    if name.startswith("fp8"):  # one byte a weight
        assert all(m.quantized.data.dtype == torch.float8_e4m3fn for m in language)


def test_serve_loads_each_loaders_format_for_the_openai_client(checkpoints):
    from test_openai_server import Server

    # one format of each loader (its variants differ in the layers the test above checks,
    # not in what serve does)
    for name in ("awq", "gptq-int4-desc-act", "fp8-block", "compressed-tensors-w8a8"):
        server = Server(str(checkpoints[name][0]))
        try:
            out = server.client().chat.completions.create(
                model="tiny", max_tokens=5, temperature=0, stream=True,
                messages=[{"role": "user", "content": "Tell me a story about a fox."}])
            assert "".join(c.choices[0].delta.content or "" for c in out if c.choices), name
        finally:
            server.stop()


@pytest.mark.parametrize("config,named", [
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "gptq 3-bit (vlmserve loads 4 and 8 bits)"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "bitsandbytes"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "awq gemv 4-bit"),
])
def test_what_is_not_loaded_is_one_line_and_exit_code_2(checkpoints, tmp_path, config, named):
    path = tmp_path / "unsupported"
    shutil.copytree(checkpoints["awq"][0], path)
    full = json.loads((path / "config.json").read_text())
    full["quantization_config"] = config
    (path / "config.json").write_text(json.dumps(full))
    result = subprocess.run([sys.executable, "-m", "vlmserve.entrypoints.cli", "caption", str(path / "config.json"),
                             "--out", str(tmp_path / "c.jsonl"), "--model", str(path)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert f"the checkpoint is quantized with {named}" in result.stderr
    assert "Traceback" not in result.stderr


def test_quantizing_an_already_quantized_checkpoint_is_refused(checkpoints):
    from vlmserve.errors import ConfigError

    with pytest.raises(ConfigError, match=r"--quantization int8: the checkpoint is already quantized \(awq, 4-bit\)"):
        LLM(str(checkpoints["awq"][0]), quantization="int8")
