"""Pipeline parallelism on this CPU: the decoder's layers in two stages (two gloo ranks,
fp32) give the tokens and logprobs of one rank (pictures, chunked prefill, preemption,
prefix hits; the dense Qwen2.5-VL, the hybrid Qwen3.5, and stages of two tensor-parallel
ranks each); each stage holds only its layers' weights and KV cache; the server answers
the official client with two stages; a stage that dies ends the engine with an error."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from test_qwen2_5_vl_parity import mixed_requests
from test_tensor_parallel import SPLIT_SETTINGS, assert_same, outputs_of, split_server_answers_as_one_rank
from vlmserve import LLM
from vlmserve.errors import ConfigError, RankFailure


def runs(path, hf, settings, splits, repeat=False):
    """Every split's outputs (each a (tensor_parallel_size, pipeline_parallel_size)), the
    engine's blocks all free at the end."""
    _, prompts, params = mixed_requests(hf)
    results = {}
    for tp, pp in splits:
        llm = LLM(path, dtype="float32", tensor_parallel_size=tp, pipeline_parallel_size=pp, **settings)
        runner = llm.engine.engine_core.runner
        runner = getattr(runner, "runner", runner)  # rank 0's
        assert set(runner.kv_caches) == runner.model.layers_held()  # the KV cache of its own layers alone
        results[tp, pp] = [outputs_of(llm, prompts, params)]
        if repeat:  # prefix hits, pictures from the encoder cache
            results[tp, pp].append(outputs_of(llm, prompts, params))
        assert not any(llm.engine.stats().blocks_in_use.values())
        llm.engine.shutdown()
    return results


@pytest.mark.slow
@SPLIT_SETTINGS
def test_qwen2_5_vl_in_two_stages_gives_one_ranks_outputs(qwen25_path, hf_qwen25, settings):
    results = runs(qwen25_path, hf_qwen25, settings, [(1, 1), (1, 2)], repeat=True)
    for one, two in zip(results[1, 1], results[1, 2], strict=True):
        assert_same(one, two)


@pytest.mark.slow
def test_two_stages_compute_two_steps_of_different_requests_at_once(qwen25_path):
    """With two stages, the first takes the next step while the last computes the one
    before: two steps in flight, neither holding a request whose token the other is making;
    the tokens are one rank's."""
    from vlmserve import SamplingParams

    prompts = [f"Tell me a story about {i}" for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(qwen25_path, dtype="float32", num_kv_blocks=128).generate(prompts,
                                                                                                          params)]
    llm = LLM(qwen25_path, dtype="float32", pipeline_parallel_size=2, num_kv_blocks=128)
    core = llm.engine.engine_core
    submit, overlaps = core.runner.submit, []

    def recorded_submit(so, grammar=None):
        for flight in core.in_flight:  # the steps this one joins in the pipeline
            overlaps.append(set(so.num_scheduled_tokens) & flight.so.sampling_req_ids)
        return submit(so, grammar)

    core.runner.submit = recorded_submit
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    finally:
        llm.engine.shutdown()
    assert got == want
    assert len(overlaps) > 5 and not any(overlaps)


@pytest.mark.slow
def test_the_hybrid_qwen3_5_in_two_stages_of_two_ranks(qwen35_path, hf_qwen35):
    """Gated DeltaNet layers and attention layers in both stages, each stage split across
    two tensor-parallel ranks (four ranks), with preemption."""
    results = runs(qwen35_path, hf_qwen35, {"num_kv_blocks": 40, "max_num_seqs": 6}, [(1, 1), (1, 2), (2, 2)])
    assert_same(results[1, 1][0], results[1, 2][0])
    assert_same(results[1, 1][0], results[2, 2][0])


def test_a_stage_holds_only_its_layers(qwen35_path):
    """Loaded as each stage of two (no group needed until a forward): the decoder's layer
    weights split between the stages, the vision tower on the first alone; the other
    layers keep their shape (the KV cache's plan reads it) and no weights."""
    from vlmserve.distributed import PipelineStage
    from vlmserve.kernels import kernel_table
    from vlmserve.models.pipeline_parallel import HeldElsewhere
    from vlmserve.worker.model_loader import load_model

    kernels = kernel_table("cpu", False)

    def part(stage):
        model = load_model(qwen35_path, "float32", kernels, pack_weights=False, stage=stage)[0]
        layers = sum(p.numel() for n, p in model.named_parameters() if ".layers." in n and "language_model" in n)
        tower = sum(p.numel() for n, p in model.named_parameters() if "visual" in n)
        return model, layers, tower

    whole, layers, tower = part(PipelineStage())
    first, first_layers, first_tower = part(PipelineStage(0, 2))
    last, last_layers, last_tower = part(PipelineStage(1, 2, 1))
    assert first_layers + last_layers == layers and 0 < first_layers < layers
    assert first_tower == tower and last_tower == 0
    assert first.layers_held() == {0, 1} and last.layers_held() == {2, 3}
    assert isinstance(last.model.language_model.layers[0], HeldElsewhere)
    assert last.kv_cache_specs(16, torch.float32) == whole.kv_cache_specs(16, torch.float32)


@pytest.mark.slow
def test_the_server_in_two_stages_answers_the_openai_client(qwen25_path):
    split_server_answers_as_one_rank(qwen25_path, ["--pipeline-parallel-size", "2"])


@pytest.mark.slow
def test_a_stage_that_dies_ends_the_engine_with_an_error(qwen25_path, hf_qwen25):
    _, prompts, params = mixed_requests(hf_qwen25)
    llm = LLM(qwen25_path, dtype="float32", pipeline_parallel_size=2, num_kv_blocks=64)
    try:
        other = llm.engine.engine_core.runner.ranks.others[0]
        os.kill(other.process.pid, signal.SIGKILL)
        with pytest.raises(RankFailure, match="rank 1 died"):
            llm.generate(prompts[:1], params[0])
    finally:
        llm.engine.shutdown()


def test_the_fullest_stage_sizes_the_blocks_of_every_stage():
    """Each rank's KV budget holds blocks for its own layers: two even stages hold twice
    the blocks of one rank, an uneven split as many as its fuller stage holds."""
    from vlmserve.core.kv_cache_spec import FullAttentionSpec, group_layers
    from vlmserve.engine.args import EngineArgs
    from vlmserve.engine.engine_core import kv_cache_config

    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32)
    groups = group_layers({i: spec for i in range(4)})
    args = EngineArgs(model="unused", kv_cache_memory_gb=0.25)

    def blocks(stages):
        return kv_cache_config(args, groups, 8, stages=stages).num_blocks

    assert blocks([range(0, 2), range(2, 4)]) == 2 * blocks(None)
    assert blocks([range(0, 3), range(3, 4)]) == 4 * blocks(None) // 3


@pytest.mark.parametrize("engine,message", [
    ({"pipeline_parallel_size": 2, "enable_lora": True}, "adapters are not split"),
    ({"pipeline_parallel_size": 2, "kv_offloading_size": 1}, "KV connector"),
    ({"pipeline_parallel_size": 0}, "at least 1"),
])
def test_what_pipeline_stages_do_not_take_is_refused(qwen25_path, engine, message):
    with pytest.raises(ConfigError, match=message):
        LLM(qwen25_path, dtype="float32", **engine)
