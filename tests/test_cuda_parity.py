"""The engine on a GPU against transformers on the same GPU, for every family: the tiny
checkpoints of the parity tests, vlmserve on its Triton kernels (compiled) and
transformers' own model, both on CUDA.

- fp32: greedy tokens equal, the chosen tokens' logprobs within 1e-3, for a prompt with
  a picture and a text-only one decoded together (a batch of two);
- bf16: the first greedy token of each agrees (bf16 rounds differently in every engine:
  later tokens may part);
- CUDA graphs: the decode steps replayed from graphs give the tokens eager steps give.

Runs with VLMSERVE_TEST_DEVICE=cuda (benchmarks/gpu_check.py); skipped elsewhere.
"""

from __future__ import annotations

import pytest
import torch

from conftest import TEST_DEVICE, HFReference, make_image
from vlmserve import LLM, SamplingParams

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(TEST_DEVICE != "cuda" or not torch.cuda.is_available(),
                                 reason="runs on a GPU (VLMSERVE_TEST_DEVICE=cuda)")]

# fixture of each family's tiny checkpoint (conftest)
FAMILIES = {
    "qwen2_vl": "qwen2vl_path",
    "qwen2_5_vl": "qwen25_path",
    "qwen3_vl": "qwen3vl_path",
    "qwen3_vl_moe": "qwen3vlmoe_path",
    "qwen3_5": "qwen35_path",
    "qwen3_5_moe": "qwen35moe_path",
    "gemma3": "gemma3_path",
}
ENGINE = dict(device="cuda", num_kv_blocks=256, max_num_seqs=8)  # graphs for batches of 1, 2, 4, 8
PROMPTS = [("Describe the image. " * 3, [make_image(130, 100, seed=1)]), ("Tell me a story about a fox.", [])]
MAX_TOKENS = 12


class CudaReference(HFReference):
    """transformers' model and processor on the GPU, in a given dtype."""

    def __init__(self, path: str, dtype: torch.dtype) -> None:
        from transformers import AutoModelForImageTextToText, AutoProcessor

        self.processor = AutoProcessor.from_pretrained(path)
        self.processor_kwargs = {}
        self.model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype).to("cuda").eval()
        self._cache: dict = {}

    def inputs(self, prompt: str, images):
        return super().inputs(prompt, images).to("cuda")


@pytest.fixture(autouse=True)
def no_tf32():
    """fp32 means fp32 on both sides (torch's default for matmuls already; cuDNN's
    convolutions default to tf32)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def run(llm: LLM, hf: HFReference):
    requests = [{"prompt": hf.prompt(text, len(images)), "multi_modal_data": {"image": images}}
                for text, images in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=1, ignore_eos=True)
    return [out.outputs[0] for out in llm.generate(requests, params)]


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_greedy_tokens_equal_transformers_on_the_gpu(family, request):
    path = request.getfixturevalue(FAMILIES[family])
    hf = CudaReference(path, torch.float32)
    llm = LLM(path, dtype="float32", **ENGINE)
    for (text, images), got in zip(PROMPTS, run(llm, hf)):
        tokens, logprobs = hf.generate(hf.prompt(text, len(images)), images, MAX_TOKENS)
        assert got.token_ids == tokens, family
        chosen = torch.tensor([entry.logprobs[0] for entry in got.logprobs])
        expected = logprobs[torch.arange(len(tokens)), torch.tensor(tokens)].cpu()
        assert torch.allclose(chosen, expected, atol=1e-3), (family, (chosen - expected).abs().max())


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_first_tokens_agree_with_transformers_on_the_gpu(family, request):
    path = request.getfixturevalue(FAMILIES[family])
    hf = CudaReference(path, torch.bfloat16)
    llm = LLM(path, dtype="bfloat16", **ENGINE)
    for (text, images), got in zip(PROMPTS, run(llm, hf)):
        tokens, _ = hf.generate(hf.prompt(text, len(images)), images, MAX_TOKENS)
        assert got.token_ids[:1] == tokens[:1], family


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_5"])
def test_cuda_graph_decode_gives_the_eager_tokens(family, request):
    """Graphs replayed for the decode steps (full, sliding-window and Gated DeltaNet
    layers): the eager engine's tokens."""
    path = request.getfixturevalue(FAMILIES[family])
    hf = CudaReference(path, torch.float32)  # for the prompts' chat template only
    graphs = LLM(path, dtype="float32", **ENGINE)
    eager = LLM(path, dtype="float32", enforce_eager=True, **ENGINE)
    assert graphs.engine.engine_core.runner.cuda_graphs is not None
    assert eager.engine.engine_core.runner.cuda_graphs is None
    assert [o.token_ids for o in run(graphs, hf)] == [o.token_ids for o in run(eager, hf)]
    assert graphs.engine.engine_core.runner.cuda_graphs.replays > 0
