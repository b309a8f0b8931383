"""Tensor parallelism on this CPU: two gloo ranks in fp32 give the tokens and logprobs of
one rank (pictures, chunked prefill, preemption, prefix hits; a dense model, the hybrid
Qwen3.5, MoE with experts split and placed by rank); each rank holds half of the split
weights and reads only its part of the checkpoint; the server answers the official client
with two ranks; a rank that dies ends the engine with an error naming it."""

from __future__ import annotations

import multiprocessing
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from test_lora import MIXED, adapters, check_all, greedy, peft_qwen25  # noqa: F401 (fixtures)
from test_qwen2_5_vl_parity import IMG_A, mixed_requests, run_together
from vlmserve import LLM, LoRARequest
from vlmserve.distributed import TensorParallel
from vlmserve.errors import RankFailure

pytestmark = pytest.mark.slow


def outputs_of(llm, prompts, params):
    """Each request's tokens and, per prompt position, {token: logprob} of its top ones."""
    return [(o.outputs[0].token_ids, [dict(zip(e.token_ids[1:], e.logprobs[1:])) for e in o.prompt_logprobs])
            for o in run_together(llm, prompts, params)]


def assert_same(one, two, atol=1e-4):
    for (tokens_1, prompt_1), (tokens_2, prompt_2) in zip(one, two, strict=True):
        assert tokens_2 == tokens_1
        for top_1, top_2 in zip(prompt_1, prompt_2, strict=True):
            assert top_1.keys() == top_2.keys()
            assert max(abs(top_1[t] - top_2[t]) for t in top_1) < atol


def runs(path, hf, settings, repeat=False, **engine):
    """Every setting's outputs with one rank and with two (and once more: prefix hits);
    the pictures rank 0 encoded in all."""
    specs, prompts, params = mixed_requests(hf)
    results, encoded = {}, {}
    for tp in (1, 2):
        results[tp], encoded[tp] = [], 0
        for setting in settings:
            llm = LLM(path, dtype="float32", tensor_parallel_size=tp, **setting, **engine)
            results[tp].append(outputs_of(llm, prompts, params))
            if repeat:
                results[tp].append(outputs_of(llm, prompts, params))
            assert not any(llm.engine.stats().blocks_in_use.values())
            encoded[tp] += llm.engine.engine_core.runner.encoder_runs
            llm.engine.shutdown()
    return results, encoded


# the scheduling cases a split model is checked in (pipeline stages' tests too)
SPLIT_SETTINGS = pytest.mark.parametrize("settings", [
    {"num_kv_blocks": 256},
    {"num_kv_blocks": 24, "max_num_seqs": 8},  # preemption
    {"num_kv_blocks": 256, "max_num_batched_tokens": 40},  # chunked prefill through the pictures
], ids=["roomy", "preempting", "chunked"])


@SPLIT_SETTINGS
def test_qwen2_5_vl_on_two_ranks_gives_one_ranks_outputs(qwen25_path, hf_qwen25, settings):
    results, encoded = runs(qwen25_path, hf_qwen25, [settings], repeat=True)
    for one, two in zip(results[1], results[2]):
        assert_same(one, two)
    # each rank encodes a share of the pictures (--mm-encoder-tp-mode data); a chunked step
    # may hold a single picture, which one rank encodes
    assert 0 < encoded[2] < encoded[1] if "max_num_batched_tokens" not in settings else 0 < encoded[2] <= encoded[1]


@pytest.mark.parametrize("family,engine", [
    ("qwen35", {}),
    ("qwen35moe", {"enable_expert_parallel": True}),
    ("qwen3vlmoe", {}),
], ids=["qwen3.5", "qwen3.5-moe-expert-parallel", "qwen3-vl-moe"])
def test_hybrid_and_moe_models_on_two_ranks(request, family, engine):
    """The Gated DeltaNet hybrid, experts placed by rank (Qwen3.5-MoE) and split inside
    (Qwen3-VL-MoE), with preemption."""
    path, hf = request.getfixturevalue(f"{family}_path"), request.getfixturevalue(f"hf_{family}")
    results, _ = runs(path, hf, [{"num_kv_blocks": 40, "max_num_seqs": 6}], **engine)
    for one, two in zip(results[1], results[2]):
        assert_same(one, two)


def test_each_rank_holds_half_of_the_split_weights(qwen35moe_path):
    """Loaded as rank 0 and rank 1 of two (no group needed until a forward): the language
    model's split weights halve; the vision tower and the norms stay whole."""
    from vlmserve.kernels import kernel_table
    from vlmserve.worker.model_loader import load_model

    kernels = kernel_table("cpu", False)

    def sizes(tp, **kw):
        model = load_model(qwen35moe_path, "float32", kernels, pack_weights=False, tp=tp, **kw)[0]
        decoder = sum(p.numel() for n, p in model.named_parameters() if "language_model" in n and "norm" not in n
                      and "mlp.gate." not in n and "shared_expert_gate" not in n)
        tower = sum(p.numel() for n, p in model.named_parameters() if "visual" in n)
        return decoder, tower

    whole = sizes(TensorParallel())
    for kw in ({}, {"expert_parallel": True}):
        for rank in (0, 1):
            part = sizes(TensorParallel(rank, 2), **kw)
            assert part[0] == whole[0] // 2 and part[1] == whole[1]


READ_PEAK = """
import sys
from pathlib import Path
from vlmserve.distributed import TensorParallel
from vlmserve.kernels import kernel_table
from vlmserve.worker.model_loader import load_model

def status(key):
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(key))
    return int(line.split()[1]) * 1024

kernels = kernel_table("cpu", False)
Path("/proc/self/clear_refs").write_text("5")  # the peak RSS starts again from here
before = status("VmRSS")
size = int(sys.argv[2])
model = load_model(sys.argv[1], "float32", kernels, pack_weights=False, tp=TensorParallel(size - 1, size))
print(status("VmHWM") - before)
"""


def test_a_rank_reads_only_its_part_of_the_checkpoint(tmp_path):
    """A 137 MB checkpoint: the peak memory a rank of two adds while loading is about
    half of what one rank adds (the rest of each tensor is never read from the file)."""
    from vlmserve.testing.checkpoints import build_qwen2_5_vl

    path = build_qwen2_5_vl(tmp_path / "wide", hidden_size=512, intermediate_size=2048, num_layers=8, num_heads=8,
                            num_kv_heads=2, sliding_window=None)
    peak = {size: int(subprocess.run([sys.executable, "-c", READ_PEAK, str(path), str(size)], capture_output=True,
                                     text=True, check=True).stdout.split()[-1]) for size in (1, 2)}
    weights = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    assert peak[1] > 0.8 * weights
    assert peak[2] < 0.65 * peak[1], peak


def rank_processes():
    return [p for p in multiprocessing.active_children() if p.name.startswith("vlmserve-rank-")]


def test_a_rank_that_dies_ends_the_engine_with_an_error(qwen25_path, hf_qwen25):
    specs, prompts, params = mixed_requests(hf_qwen25)
    llm = LLM(qwen25_path, dtype="float32", tensor_parallel_size=2, num_kv_blocks=256)
    llm.generate(prompts[:2], params[:2])
    (rank,) = rank_processes()
    os.kill(rank.pid, signal.SIGKILL)
    rank.join(10)
    start = time.monotonic()
    with pytest.raises(RankFailure, match="rank 1 died"):
        llm.generate(prompts[:2], params[:2])
    assert time.monotonic() - start < 30


def test_a_rank_that_dies_mid_step_ends_the_engine(qwen25_path, hf_qwen25):
    """Killed while the ranks compute a step: rank 0's collective fails at once."""
    specs, prompts, params = mixed_requests(hf_qwen25)
    llm = LLM(qwen25_path, dtype="float32", tensor_parallel_size=2, num_kv_blocks=256)
    (rank,) = rank_processes()
    forward = llm.engine.engine_core.runner.runner.model.forward
    steps = [0]

    def killing_forward(*args, **kwargs):
        steps[0] += 1
        if steps[0] == 3:
            os.kill(rank.pid, signal.SIGKILL)
            rank.join(10)
        return forward(*args, **kwargs)

    llm.engine.engine_core.runner.runner.model.forward = killing_forward
    with pytest.raises(RankFailure, match="rank 1"):
        llm.generate(prompts, params)


def test_the_server_with_two_ranks_answers_the_openai_client(qwen25_path):
    split_server_answers_as_one_rank(qwen25_path, ["--tensor-parallel-size", "2"])


def split_server_answers_as_one_rank(path: str, split: list[str]) -> None:
    """Greedy answers about a picture and a video, streamed and not, are those of one rank
    with the model split (`split`: the flags); a rank killed later ends the server with an
    error."""
    import base64

    from conftest import data_url
    from media_files import video_bytes
    from test_openai_server import Server

    clip = "data:video/mp4;base64," + base64.b64encode(video_bytes("mp4", frames=8, fps=4)).decode()
    messages = [
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(IMG_A)}},
                                      {"type": "text", "text": "Describe the image."}]}],
        [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": clip}},
                                      {"type": "text", "text": "What happens?"}]}],
    ]
    answers = {}
    for flags in ([], split):
        server = Server(path, *flags, "--num-kv-blocks", "256", "--dtype", "float32", "--api-key", "test-key")
        try:
            client = server.client()
            for i, m in enumerate(messages):
                full = client.chat.completions.create(model="tiny", messages=m, max_tokens=12, temperature=0)
                streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
                    model="tiny", messages=m, max_tokens=12, temperature=0, stream=True) if c.choices)
                assert streamed == full.choices[0].message.content
                answers[bool(flags), i] = full.choices[0].message.content
            if flags:
                (pid,) = [int(m.group(1)) for line in server.log if (m := re.search(r"rank 1 is process (\d+)", line))]
                os.kill(pid, signal.SIGKILL)
                with pytest.raises(Exception):
                    client.chat.completions.create(model="tiny", messages=messages[0], max_tokens=4)
                assert server.proc.wait(timeout=30) != 0
                assert any("rank 1 died" in line or "rank 1" in line for line in server.log)
        finally:
            if server.proc.poll() is None:
                server.stop()
    assert all(answers[False, i] == answers[True, i] for i in range(len(messages)))


def test_ranks_as_ray_actors(qwen25_path, hf_qwen25):
    """--distributed-executor-backend ray on a local Ray cluster: one rank's tokens; the
    actor killed, the engine ends with an error naming its rank."""
    import psutil
    import ray

    specs, prompts, params = mixed_requests(hf_qwen25)
    one = outputs_of(LLM(qwen25_path, dtype="float32", num_kv_blocks=256), prompts, params)
    try:
        llm = LLM(qwen25_path, dtype="float32", num_kv_blocks=256, tensor_parallel_size=2,
                  distributed_executor_backend="ray")
        assert_same(one, outputs_of(llm, prompts, params))
        (actor,) = [p for p in psutil.process_iter(["cmdline"]) if "RayRank" in " ".join(p.info["cmdline"] or [])]
        actor.kill()
        actor.wait(10)
        with pytest.raises(RankFailure, match="rank 1"):
            llm.generate(prompts[:2], params[:2])
    finally:
        ray.shutdown()


def test_a_rank_that_cannot_start_fails_the_start(qwen25_path, tmp_path):
    """A script without the `if __name__ == "__main__":` guard that spawned processes need:
    rank 1 dies importing it, and rank 0 says so instead of waiting for it."""
    script = tmp_path / "unguarded.py"
    script.write_text(f"from vlmserve import LLM\nLLM({qwen25_path!r}, tensor_parallel_size=2, num_kv_blocks=64)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "rank 1 died starting" in done.stderr


@pytest.fixture(scope="module")
def wide_checkpoints(tmp_path_factory):
    """Qwen2.5-VL wide enough that each rank's columns hold whole groups of 128 (hidden 256,
    MLP 512), and its AWQ, GPTQ, FP8 and compressed-tensors forms."""
    from vlmserve.testing.checkpoints import build_qwen2_5_vl
    from vlmserve.testing.quantized_checkpoints import write_awq, write_compressed_tensors, write_fp8, write_gptq

    root = tmp_path_factory.mktemp("wide")
    source = build_qwen2_5_vl(root / "source", hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                              num_kv_heads=2)
    return {"source": source, "awq": write_awq(source, root / "awq")[0],
            "gptq": write_gptq(source, root / "gptq", bits=4, group=64)[0],
            "fp8": write_fp8(source, root / "fp8")[0],
            "compressed-tensors": write_compressed_tensors(source, root / "ct", "W8A8")}


@pytest.mark.parametrize("name,quantization", [
    ("source", "int8"), ("source", "int4"), ("awq", None), ("gptq", None), ("fp8", None), ("compressed-tensors", None),
])
def test_quantized_layers_split_as_one_rank_runs_them(wide_checkpoints, hf_qwen25, name, quantization):
    """--quantization int8/int4 (row-parallel layers take their scales from the whole rows)
    and the published formats (split while quantized): two ranks give one rank's tokens, and
    every language layer stays quantized."""
    from vlmserve.models.layers import Linear

    specs, prompts, params = mixed_requests(hf_qwen25)  # the same tokenizer and processor
    tokens = {}
    for tp in (1, 2):
        llm = LLM(str(wide_checkpoints[name]), dtype="float32", num_kv_blocks=256, tensor_parallel_size=tp,
                  quantization=quantization)
        tokens[tp] = [o.outputs[0].token_ids for o in run_together(llm, prompts, params)]
        model = llm.engine.engine_core.runner.model if tp == 1 else llm.engine.engine_core.runner.runner.model
        assert all(m.quantized is not None for m in model.model.language_model.modules() if isinstance(m, Linear))
        llm.engine.shutdown()
    assert tokens[1] == tokens[2]


def test_adapters_split_with_their_layers(qwen25_path, adapters, peft_qwen25, tmp_path):  # noqa: F811
    """LoRA under TP=2: three adapters (attention, MLP, everything with the vision tower)
    and the base model in one chunked batch, two slots for three adapters; each answer is
    PEFT's under its adapter (B split with column-parallel layers, A with row-parallel)."""
    llm = LLM(qwen25_path, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16, num_kv_blocks=256,
              max_num_batched_tokens=24, tensor_parallel_size=2)
    check_all(llm, peft_qwen25, MIXED, adapters)
    # the other ranks take an adapter from rank 0, never from its folder: gone once rank 0
    # has read it, the answers are still the adapter's
    folder = tmp_path / "attn"
    shutil.copytree(adapters["attn"].lora_path, folder)
    lora = LoRARequest("attn-copy", 9, str(folder))
    llm.engine.check_lora(lora)
    llm.engine.engine_core.runner.load_lora(lora)
    shutil.rmtree(folder)
    prompt = {"prompt": peft_qwen25.prompt("Describe the image.", 1), "multi_modal_data": {"image": [IMG_A]}}
    want = llm.generate([prompt], greedy(), lora_request=[adapters["attn"]])[0].outputs[0].token_ids
    assert llm.generate([prompt], greedy(), lora_request=[lora])[0].outputs[0].token_ids == want
    llm.engine.shutdown()
