"""CUDA graphs for decode steps, the parts a machine without a GPU can check: which batch
sizes are captured and the padding to them, which steps replay, the --enforce-eager
plumbing, and the graph's static inputs (slot mappings, block tables, state slots, inert
padding rows) giving the eager tokens when each "replay" runs the forward over them
eagerly (the Triton kernels under the interpreter). Capture and replay themselves run on
a GPU: tests/test_cuda_parity.py in benchmarks/gpu_check.py."""

from __future__ import annotations

import pytest

from conftest import make_image
from vlmserve import LLM, EngineArgs, SamplingParams
from vlmserve.entrypoints.cli import build_parser
from vlmserve.worker.cuda_graphs import CudaGraphs, capture_sizes, is_decode_only, padded_size


def test_capture_sizes_and_padding():
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 64]
    assert capture_sizes(48) == [1, 2, 4, 8, 16, 32, 48]
    assert capture_sizes(1) == [1]
    assert capture_sizes(5000)[-2:] == [256, 512]
    sizes = capture_sizes(48)
    assert [padded_size(n, sizes) for n in (1, 3, 4, 5, 33, 48, 49)] == [1, 4, 4, 8, 48, 48, None]


def test_a_model_split_across_ranks_runs_eagerly(caplog):
    """Under tensor parallelism nothing is captured (a capture failing on one rank alone
    would leave the others in a collective), and the log says why."""
    from types import SimpleNamespace

    import torch

    from vlmserve.distributed import TensorParallel

    model = torch.nn.Linear(2, 2)
    model.tp = TensorParallel(0, 2)
    with caplog.at_level("INFO", logger="vlmserve.worker.cuda_graphs"):
        assert CudaGraphs.capture(SimpleNamespace(model=model), 8) is None
    assert "split across ranks" in caplog.text


def test_only_steps_of_generated_single_tokens_replay():
    assert is_decode_only([1, 1], [0, 0], [10, 12], [10, 5])
    assert not is_decode_only([1, 3], [0, 0], [10, 12], [10, 5])  # a prompt chunk
    assert not is_decode_only([1, 1], [0, 0], [9, 12], [10, 5])  # a prompt's last token (maybe a picture's)
    assert not is_decode_only([1, 4], [0, 3], [10, 12], [10, 5])  # drafts to check


def test_enforce_eager_is_an_engine_flag_and_the_cpu_has_no_graphs(qwen25_path):
    assert EngineArgs().enforce_eager is False
    serve = build_parser().parse_args(["serve", "--enforce-eager"])
    assert serve.enforce_eager is True
    llm = LLM(qwen25_path, num_kv_blocks=64, enforce_eager=True)
    assert llm.engine.engine_core.runner.cuda_graphs is None
    assert LLM(qwen25_path, num_kv_blocks=64).engine.engine_core.runner.cuda_graphs is None  # CPU: eager


class EagerReplay:
    """Stands in for a captured graph: "replaying" runs the forward over the static
    buffers, so the buffers' contents decide the outputs as they would on a GPU."""

    def __init__(self, graphs: CudaGraphs, buffers) -> None:
        self.graphs, self.buffers = graphs, buffers

    def replay(self) -> None:
        self.buffers.hidden = self.graphs._forward(self.buffers)


@pytest.mark.slow
def test_the_static_inputs_give_the_eager_tokens(qwen35_path, hf_qwen35):
    """Qwen3.5 (attention and Gated DeltaNet layers) on the Triton kernels: three requests
    prefilled in one step, then decoding together, padded to the captured size 4, then two, then one: the tokens of
    the eager engine."""
    prompts = [{"prompt": hf_qwen35.prompt(text, len(images)), "multi_modal_data": {"image": images}}
               for text, images in (("Describe the image.", [make_image(90, 60, seed=4)]),
                                    ("Tell me a story about a fox.", []), ("Hello", []))]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (6, 4, 3)]
    settings = dict(dtype="float32", use_triton=True, num_kv_blocks=128, max_num_seqs=4)
    want = [o.outputs[0].token_ids for o in LLM(qwen35_path, **settings).generate(prompts, params)]
    llm = LLM(qwen35_path, **settings)
    runner = llm.engine.engine_core.runner
    graphs = CudaGraphs(runner, 4)
    for size in graphs.sizes:
        buffers = graphs._buffers(size)
        buffers.graph = EagerReplay(graphs, buffers)
        graphs.buffers[size] = buffers
    runner.cuda_graphs = graphs
    # every request enters before the first step (LLM.generate admits each as soon as its
    # pictures are processed, which would make the steps' make-up depend on timing)
    for i, (prompt, param) in enumerate(zip(prompts, params)):
        llm.engine.add_request(str(i), prompt, param)
    finished = {}
    while llm.engine.has_unfinished_requests():
        finished.update((o.request_id, o.outputs[0].token_ids) for o in llm.engine.step() if o.finished)
    assert [finished[str(i)] for i in range(3)] == want
    assert graphs.replays == 5  # one prefill step, then five decode-only steps (6 tokens)
