"""Weight-only int8/int4 quantization at load: the kernels against the dequantized weight,
greedy tokens against transformers on a checkpoint holding the dequantized weights, the
shipped model's answers, and the flag on every entry point."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from conftest import HFReference, assert_greedy_like_transformers, make_image
from vlmserve import LLM, SamplingParams
from vlmserve.kernels import kernel_table
from vlmserve.kernels.cpu_extension import cpu_kernels
from vlmserve.kernels.quantized_linear import (
    METHODS,
    QuantizedWeight,
    dequantize,
    int4_values,
    int8_values,
    own_kernels_available,
    tiled_kernels_available,
    prepare_quantized_weight_cpu,
    quantizable,
    quantize,
    quantized_linear_cpu,
    torch_cpu_layout,
    torch_int4_layout_fits,
)
from vlmserve.models.layers import Linear
from vlmserve.models.quantized_checkpoints import CheckpointQuantization, read_quantized
from vlmserve.testing.checkpoints import build_qwen2_5_vl, build_qwen3_5
from vlmserve.testing.quantized_checkpoints import fp8_blocks
from vlmserve.training.shapes import normalize_answer
from vlmserve.worker.model_loader import load_model

REPO = Path(__file__).resolve().parent.parent
SAMPLES = REPO / "samples"


@pytest.mark.parametrize("method", METHODS)
def test_rounding_error_is_at_most_half_a_step(method):
    w = torch.randn(96, 256) * torch.linspace(0.1, 3, 96)[:, None]  # rows of different ranges
    qw = quantize(w, method)
    error = (dequantize(qw) - w).abs()
    if method == "int8":
        assert qw.data.dtype == torch.int8 and qw.data.shape == w.shape
        assert (error <= qw.scales[:, None] / 2 + 1e-6).all()
    else:
        assert qw.data.dtype == torch.uint8 and qw.data.shape == (96, 128)  # two values a byte
        assert (error.view(96, 2, 128) <= qw.scales[..., None] / 2 + 1e-6).all()


@pytest.mark.parametrize("method", [*METHODS, "int4 in torch's layout"])
@pytest.mark.parametrize("out_features", [128, 80])  # 80: not whole blocks of torch's int4 layout
@pytest.mark.parametrize("rows", [1, 3, 8, 40, 200])  # the packed-weight kernels, and dequantized matmuls
def test_cpu_kernel_computes_the_dequantized_product(method, out_features, rows):
    torch.manual_seed(rows)
    w = torch.randn(out_features, 256, dtype=torch.bfloat16)
    bias = torch.randn(out_features, dtype=torch.bfloat16)
    plain = quantize(w, method.split()[0])
    if method == "int4":  # vlmserve's kernel where this CPU has it (AVX512-BF16 and VNNI), the same bytes
        prepared = prepare_quantized_weight_cpu(quantize(w, method))
        torch_layout = torch_int4_layout_fits(plain)
        assert prepared.layout == ("gemv" if tiled_kernels_available() else "cpu_blocked" if torch_layout else "plain")
        assert torch.equal(int4_values(prepared), int4_values(plain)) or prepared.layout == "cpu_blocked"
    elif method == "int8":  # vlmserve's tiled layout where this CPU has its kernels
        prepared = prepare_quantized_weight_cpu(quantize(w, method))
        assert prepared.layout == ("gemv" if tiled_kernels_available() else "plain")
        assert torch.equal(int8_values(prepared), plain.data)
    else:  # where the extension is not built: torch's kernel, on whole blocks of 64 outputs (AVX-512 CPUs)
        prepared = torch_cpu_layout(plain) if torch_int4_layout_fits(plain) else plain
        assert prepared.layout == "plain" or prepared.nbytes < plain.nbytes + plain.data.numel() // 8
    # the CPU layout holds the same values (its zero point is rounded to bf16 once more)
    assert torch.allclose(dequantize(prepared).float(), dequantize(plain).float(), atol=0.05)
    x = torch.randn(1, rows, 256, dtype=torch.bfloat16)
    got = quantized_linear_cpu(x, prepared, bias).float()
    expected = F.linear(x.float(), dequantize(prepared).float(), bias.float())
    assert got.shape == expected.shape
    assert (got - expected).abs().max() <= 0.02 * expected.abs().max()


@pytest.mark.skipif(not tiled_kernels_available(), reason="vlmserve's int8/int4 kernels are not built here")
@pytest.mark.parametrize("method", METHODS)
def test_tiles_hold_each_row_and_dequantize_exactly(method):
    """The kernels' tiled layout (16 rows a tile) keeps every value, scale and zero point of
    its row: its C++ dequantization equals the plain weight's (fp32, up to one rounding)."""
    torch.manual_seed(0)
    w = torch.randn(48, 384, dtype=torch.bfloat16) * torch.linspace(0.1, 3, 48, dtype=torch.bfloat16)[:, None]
    plain = quantize(w, method)
    tiled = prepare_quantized_weight_cpu(plain)
    assert tiled.layout == "gemv" and tiled.nbytes == plain.nbytes
    out = torch.empty(48, 384)
    if method == "int4":
        assert tiled.scales.shape == (3, 3, 16) and torch.equal(int4_values(tiled), int4_values(plain))
        cpu_kernels().int4_dequantize(tiled.data, tiled.scales, tiled.zeros, out)
        expected = (int4_values(plain).float().view(48, 3, 128) * plain.scales.float()[..., None]
                    + plain.zeros.float()[..., None]).view(48, 384)
    else:
        assert tiled.data.dtype == torch.uint8 and torch.equal(int8_values(tiled), plain.data)
        cpu_kernels().int8_tiled_dequantize(tiled.data, tiled.scales, out)
        expected = plain.data.float() * plain.scales.float()[:, None]
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-6)
    x = torch.zeros(1, 384, dtype=torch.bfloat16)
    x[0, 200] = 1.0  # one input: the GEMV picks out (nearly: x is quantized to 8 bits) that column
    got = quantized_linear_cpu(x, tiled, None).float()[0]
    torch.testing.assert_close(got, expected[:, 200].to(torch.bfloat16).float(), atol=0.02, rtol=0.01)


@pytest.mark.skipif(not tiled_kernels_available(), reason="vlmserve's int8/int4 kernels are not built here")
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("tiles", [37, 64, 3])  # per thread: streams and a remainder, whole streams, fewer than one
def test_few_rows_read_in_streams_equal_the_one_stream_kernel(method, tiles, gemv_streams):
    """Where the GEMVs read in streams, up to four rows of x read each thread's tiles in
    several streams at once (the band's last tiles one at a time); otherwise, and at five
    rows, in one stream. Each row's outputs are the same either way (the integer sums are
    exact, the fp32 sums in the same order) and near the dequantized product."""
    torch.manual_seed(tiles)
    w = torch.randn(16 * tiles, 256, dtype=torch.bfloat16)
    tiled = prepare_quantized_weight_cpu(quantize(w, method))
    assert tiled.layout == "gemv"
    x = torch.randn(5, 256, dtype=torch.bfloat16)
    one_stream = quantized_linear_cpu(x, tiled, None)
    for rows in (1, 2, 3, 4):
        assert torch.equal(quantized_linear_cpu(x[:rows], tiled, None), one_stream[:rows])
    expected = F.linear(x.float(), dequantize(tiled).float())
    assert (one_stream.float() - expected).abs().max() <= 0.02 * expected.abs().max()


@pytest.mark.skipif(not tiled_kernels_available(), reason="vlmserve's int8/int4 kernels are not built here")
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("rows", [1, 5])
def test_tiled_kernels_stay_exact_at_the_ends_of_the_range(method, rows):
    """Every weight at an end of its range (int8 -128 or 127, int4 0 or 15) against x whose
    every value is its group's largest in magnitude (int8 +-127): AVX2's products sum pairs
    in int16 (maddubs), which a stored w + 128 times x would overflow; the sums stay exact."""
    torch.manual_seed(rows)
    n, k = 32, 256
    ends = torch.rand(n, k) < 0.5
    scales = torch.full((n, k // 128), 1 / 64, dtype=torch.bfloat16)  # powers of two: the reference is exact
    if method == "int8":
        plain = QuantizedWeight("int8", (n, k), torch.bfloat16, torch.where(ends, -128, 127).to(torch.int8),
                                scales[:, 0].contiguous())
    else:
        q = torch.where(ends, 0, 15).to(torch.uint8)
        plain = QuantizedWeight("int4", (n, k), torch.bfloat16, q[:, 0::2] | (q[:, 1::2] << 4), scales,
                                torch.full_like(scales, -0.25))
    tiled = prepare_quantized_weight_cpu(plain)
    assert tiled.layout == "gemv"
    x = torch.where(torch.rand(rows, k) < 0.5, -1.0, 1.0).to(torch.bfloat16)
    got = quantized_linear_cpu(x, tiled, None).float()
    expected = F.linear(x.float(), dequantize(plain).float())
    assert (got - expected).abs().max() <= 0.01 * expected.abs().max()


def test_the_dequantization_buffer_is_reused_inside_and_outside_inference_mode():
    """A prompt's dequantized matmul writes one buffer reused by every layer: made inside an
    engine's step (inference mode), it is written again by a plain forward outside it."""
    qw = quantize(torch.randn(88, 256, dtype=torch.bfloat16), "int8")  # 88 rows: no tiles, dequantized
    x = torch.randn(300, 256, dtype=torch.bfloat16)
    with torch.inference_mode():
        inside = quantized_linear_cpu(x, qw, None)
    outside = quantized_linear_cpu(x, qw, None)
    assert torch.equal(inside, outside)


def fp8_weight(w: torch.Tensor, dtype: torch.dtype) -> QuantizedWeight:
    """w as an FP8 checkpoint holds it (128 x 128 block scales), read by the loader."""
    fp8, scale = fp8_blocks(w)
    quant = CheckpointQuantization.from_config({"quant_method": "fp8", "weight_block_size": [128, 128]})
    [(_, qw)] = read_quantized([("layer.weight", fp8), ("layer.weight_scale_inv", scale)], quant, dtype)
    return qw


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("out_features", [256, 80])  # 80: a part of a block of rows
@pytest.mark.parametrize("rows", [1, 3, 8, 16, 40])  # vlmserve's fp8 kernel, then dequantized matmuls
def test_fp8_weights_stay_8_bit_and_compute_the_dequantized_product(dtype, out_features, rows):
    torch.manual_seed(rows)
    w = torch.randn(out_features, 384) * torch.logspace(-3, 1, 384)  # blocks of different scales
    qw = prepare_quantized_weight_cpu(fp8_weight(w, dtype))
    assert qw.method == "fp8" and qw.data.dtype == torch.float8_e4m3fn and qw.scales.shape == (out_features, 3)
    bias = torch.randn(out_features, dtype=dtype)
    x = torch.randn(2, rows, 384, dtype=dtype)
    got = quantized_linear_cpu(x, qw, bias).float()
    expected = F.linear(x.float(), dequantize(qw).float(), bias.float())
    assert got.dtype == torch.float32 and got.shape == expected.shape
    tolerance = 0.01 if dtype == torch.bfloat16 else 1e-5
    assert (got - expected).abs().max() <= tolerance * expected.abs().max()


def test_fp8_block_scales_of_the_wrong_shape_are_refused_at_load():
    fp8, scale = fp8_blocks(torch.randn(256, 384))
    quant = CheckpointQuantization.from_config({"quant_method": "fp8", "weight_block_size": [128, 128]})
    with pytest.raises(ValueError, match=r"layer.weight_scale_inv: shape \(2, 2\).*has \(2, 3\)"):
        list(read_quantized([("layer.weight", fp8), ("layer.weight_scale_inv", scale[:, :2])], quant, torch.float32))


@pytest.mark.skipif(not own_kernels_available(), reason="vlmserve's CPU kernels (AVX512-BF16) are not built here")
def test_the_fp8_conversion_is_exact_for_every_code():
    """All 254 finite e4m3 values (subnormals, zeros, the largest) converted by the C++
    kernels equal torch's float8 conversion, times each row's scale."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    data = codes.repeat(4, 2)[:, :384].contiguous()  # [4, 384]: three groups a row
    scales = torch.tensor([[1.0, 2.0, 0.5], [3.0, 1e-3, 1.0], [1.0, 1.0, 1.0], [0.25, 8.0, 1.0]])
    want = data.view(torch.float8_e4m3fn).float() * scales.repeat_interleave(128, 1)
    out = torch.empty(4, 384)
    cpu_kernels().fp8_dequantize(data, scales, out)
    assert torch.equal(out, want)
    x = torch.zeros(1, 384)
    for k in (0, 5, 130, 383):  # one input at a time: the GEMV picks out one column exactly
        x.zero_()
        x[0, k] = 1.0
        assert torch.equal(cpu_kernels().fp8_gemv(x, data, scales, None)[0], want[:, k])


def dequantized_checkpoint(source: str, method: str, dest: Path) -> Path:
    """A copy of a checkpoint whose language layers' linear weights are what `method`
    makes of them (its untied head what int8 does): transformers running it is the
    reference for vlmserve quantizing the original (per output row, so fused projections
    quantize the same)."""
    import shutil

    shutil.copytree(source, dest)
    tensors = load_file(str(dest / "model.safetensors"))
    changed = 0
    for name, tensor in tensors.items():
        language_layer = ".layers." in name and "visual" not in name  # both families' names of them
        if language_layer and name.endswith(".weight") and tensor.dim() == 2 and quantizable(tensor, method):
            tensors[name] = dequantize(quantize(tensor, method)).to(tensor.dtype)
            changed += 1
        elif name == "lm_head.weight":  # the head: int8 under either method
            tensors[name] = dequantize(quantize(tensor, "int8")).to(tensor.dtype)
    assert changed
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


@pytest.fixture(scope="module")
def wide_checkpoints(tmp_path_factory):
    """Tiny checkpoints 128 wide, so that int4's groups of 128 inputs fit their layers."""
    root = tmp_path_factory.mktemp("quant")
    return {
        "qwen2_5_vl": str(build_qwen2_5_vl(root / "qwen25", hidden_size=128, intermediate_size=256, num_layers=2)),
        "qwen3_5": str(build_qwen3_5(root / "qwen35", hidden_size=128, intermediate_size=256,
                                     linear_head_dim=32, head_dim=32)),
    }


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_5"])
@pytest.mark.parametrize("method", METHODS)
def test_greedy_tokens_equal_transformers_on_the_dequantized_weights(wide_checkpoints, family, method, tmp_path):
    source = wide_checkpoints[family]
    hf = HFReference(str(dequantized_checkpoint(source, method, tmp_path / "dequantized")))
    llm = LLM(source, dtype="float32", quantization=method, num_kv_blocks=128)
    assert_greedy_like_transformers(llm, hf, make_image(120, 90, seed=7))


@pytest.mark.parametrize("method", METHODS)
def test_the_language_layers_keep_only_their_quantized_weights(wide_checkpoints, method):
    model, _ = load_model(wide_checkpoints["qwen2_5_vl"], "bfloat16", kernel_table("cpu"), quantization=method)
    language = [m for m in model.model.language_model.modules() if isinstance(m, Linear)]
    assert language and all(m.quantized is not None and m.weight.numel() == 0 and m.packed_weight is None
                            for m in language)
    bits = {"int8": 8, "int4": 4}[method]
    for m in language:
        out_features, in_features = m.quantized.shape
        assert m.quantized.data.numel() * 8 == out_features * in_features * bits
    assert model.lm_head.quantized.method == "int8"  # the head, under either method
    vision = [m for m in model.model.visual.modules() if isinstance(m, Linear)]
    # the tower stays bf16: its plain weights, or packed copies in their place (AVX-512F without AVX512-BF16)
    assert vision and all(m.quantized is None and (m.weight.numel() > 0 or m.packed_weight is not None)
                          for m in vision)


PEAK_RSS = """
import sys
from vlmserve.kernels import kernel_table
from vlmserve.kernels.cpu_extension import cpu_kernels
from vlmserve.worker.model_loader import load_model

def kb(field):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field + ":"))

before = kb("VmRSS")
model, _ = load_model(sys.argv[1], "bfloat16", kernel_table("cpu"), pack_weights=False, quantization=sys.argv[2])
print(before, kb("VmHWM"), kb("VmRSS"))
"""


@pytest.mark.parametrize("method", METHODS)
def test_loading_peaks_near_the_quantized_size(method, tmp_path):
    """Each layer is quantized as it loads and the checkpoint file is mapped a tensor at a
    time: the process never holds the language layers' bf16 weights (192 MB here) at once."""
    path = build_qwen2_5_vl(tmp_path / "ckpt", hidden_size=1024, intermediate_size=4096, num_layers=6,
                            num_heads=8, num_kv_heads=2, tie_word_embeddings=True)
    bf16_layers = 6 * 2 * (1024 * (1024 + 2 * 256) + 1024 * 1024 + 3 * 1024 * 4096)
    out = subprocess.run([sys.executable, "-c", PEAK_RSS, str(path), method], capture_output=True, text=True,
                         check=True).stdout.split()
    before, peak, after = (int(v) * 1024 for v in out)
    assert after - before < 0.8 * bf16_layers, (before, peak, after)  # int8 is half, int4 a quarter
    assert peak - before < bf16_layers, (before, peak, after)  # all at once, and the file mapped: 3x


def test_auto_dtype_runs_quantized_layers_on_the_kernels_where_they_exist():
    """'auto' with --quantization: bf16 (the checkpoint's own) where vlmserve's int8/int4
    kernels run, so its layers take their tiled layout instead of being dequantized each step."""
    from vlmserve.engine.model_source import SHIPPED_MODEL

    model, _ = load_model(SHIPPED_MODEL, "auto", kernel_table("cpu"), quantization="int4")
    layers = [m for m in model.model.language_model.modules() if isinstance(m, Linear) and m.quantized is not None]
    assert layers
    if tiled_kernels_available():
        assert all(m.quantized.dtype == torch.bfloat16 for m in layers)
        whole_tiles = [m for m in layers if m.quantized.shape[0] % 16 == 0]  # (a fused qkv of 776 rows is not)
        assert whole_tiles and all(m.quantized.layout == "gemv" for m in whole_tiles)


ANSWERS = json.loads((SAMPLES / "answers.json").read_text())


@pytest.mark.parametrize("method", METHODS)
def test_the_shipped_model_quantized_answers_every_sample_question(method):
    llm = LLM(quantization=method, dtype="bfloat16", allowed_local_media_path=str(SAMPLES))
    chats = []
    for item in ANSWERS:
        kind = "video_url" if item["file"].endswith(".mp4") else "image_url"
        chats.append([{"role": "user", "content": [{"type": kind, kind: {"url": str(SAMPLES / item["file"])}},
                                                   {"type": "text", "text": item["question"]}]}])
    outs = llm.chat(chats, SamplingParams(temperature=0, max_tokens=256))
    wrong = [(item["file"], item["question"], out.outputs[0].text) for item, out in zip(ANSWERS, outs)
             if normalize_answer(out.outputs[0].text) != normalize_answer(item["answer"])]
    assert not wrong


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vlmserve.entrypoints.cli", *args], capture_output=True, text=True,
                          timeout=300)


def test_caption_takes_the_flag(tmp_path):
    out = tmp_path / "captions.jsonl"
    result = run_cli("caption", str(SAMPLES / "shapes1.png"), "--out", str(out), "--quantization", "int4")
    assert result.returncode == 0, result.stderr[-2000:]
    caption = json.loads(out.read_text())["caption"]
    expected = next(i["answer"] for i in ANSWERS if i["file"] == "shapes1.png" and i["kind"] == "caption")
    assert normalize_answer(caption) == normalize_answer(expected)


@pytest.mark.parametrize("method", METHODS)
def test_serve_quantized_answers_the_openai_client_streaming_about_a_picture(method):
    import base64

    from test_openai_server import Server

    item = next(i for i in ANSWERS if i["file"] == "shapes3.jpg" and i["kind"] == "caption")
    url = "data:image/jpeg;base64," + base64.b64encode((SAMPLES / item["file"]).read_bytes()).decode()
    server = Server(None, "--quantization", method, "--dtype", "bfloat16")
    try:
        stream = server.client().chat.completions.create(
            model="tiny", temperature=0, max_tokens=64, stream=True,
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                   {"type": "text", "text": item["question"]}]}])
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        assert normalize_answer(text) == normalize_answer(item["answer"])
        assert any(f"quantized the language layers to {method}" in line for line in server.log)
    finally:
        server.stop()


def test_an_unknown_method_is_one_line_and_exit_code_2(tmp_path):
    result = run_cli("caption", str(SAMPLES / "shapes1.png"), "--out", str(tmp_path / "c.jsonl"),
                     "--quantization", "int3")
    assert result.returncode == 2
    assert "--quantization int3: vlmserve quantizes to int8 or int4" in result.stderr
    assert "Traceback" not in result.stderr
