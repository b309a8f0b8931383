"""The engine on a GPU against transformers on the same GPU, for every family: the tiny
checkpoints of the parity tests, vlmserve on its Triton kernels (compiled) and
transformers' own model, both on CUDA.

- fp32: greedy tokens equal, the chosen tokens' logprobs within 1e-3, for a prompt with
  a picture and a text-only one decoded together (a batch of two);
- bf16: the first greedy token of each agrees (bf16 rounds differently in every engine:
  later tokens may part);
- CUDA graphs: the decode steps replayed from graphs give the tokens eager steps give;
- the sampling features, a grammar, logprobs, speculative decoding and a LoRA adapter on
  the GPU give the CPU engine's tokens (every tensor of those paths on the right device).

Runs with VLMSERVE_TEST_DEVICE=cuda (benchmarks/gpu_check.py); skipped elsewhere.
"""

from __future__ import annotations

import pytest
import torch

from conftest import TEST_DEVICE, HFReference, make_image
from test_spec_decode import NGRAM
from vlmserve import LLM, LoRARequest, SamplingParams
from vlmserve.sampling_params import StructuredOutputsParams
from vlmserve.testing.lora_adapters import write_lora_adapter

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


def prompt_request(hf: HFReference, text: str, images) -> dict:
    return {"prompt": hf.prompt(text, len(images)), "multi_modal_data": {"image": images}}


def run(llm: LLM, hf: HFReference):
    requests = [prompt_request(hf, text, images) for text, images in PROMPTS]
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


# each decoded greedily (fp32) on the GPU and on the CPU, in one batch
FEATURES = {
    "penalties": dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3),
    "logit bias, bad words, min_tokens": dict(logit_bias={356: -10.0, 7: 0.5}, bad_words=["blu"], min_tokens=4),
    "regex": dict(structured_outputs=StructuredOutputsParams(regex="[a-z]{2,6}( [a-z]{2,6}){1,3}")),
    "logprobs": dict(logprobs=5, prompt_logprobs=3),
}


def feature_run(llm: LLM, hf: HFReference, lora: LoRARequest | None = None):
    request = prompt_request(hf, *PROMPTS[0])
    params = [SamplingParams(temperature=0, max_tokens=8, **kwargs) for kwargs in FEATURES.values()]
    return llm.generate([request] * len(params), params, lora_request=lora)


def test_sampling_features_a_grammar_drafts_and_lora_give_the_cpu_tokens_on_the_gpu(qwen25_path, tmp_path):
    """Penalties, logit bias, bad words, min_tokens, a regex, logprobs and the prompt's
    logprobs in one batch, then the same under a LoRA adapter, then n-gram drafts (greedy:
    the plain tokens; sampled with a seed: the same tokens twice): the GPU engine against
    the CPU engine, both fp32 (the CPU one on pure torch under gpu_check, which builds no
    C++ kernels there). Each path builds tensors of its own (masks, penalty counts, draft
    indices, adapter slots) that must sit on the logits' device."""
    hf = HFReference(qwen25_path)  # for the chat template only
    adapter = write_lora_adapter(qwen25_path, tmp_path / "lora", rank=8, target_modules=["q_proj", "v_proj"], seed=3)
    lora = LoRARequest("a", 1, str(adapter))
    engines = {device: LLM(qwen25_path, dtype="float32", device=device, num_kv_blocks=256, max_num_seqs=8,
                           enable_lora=True, max_lora_rank=8) for device in ("cuda", "cpu")}
    for adapter_request in (None, lora):
        gpu, cpu = (feature_run(engines[d], hf, adapter_request) for d in ("cuda", "cpu"))
        for name, a, b in zip(FEATURES, gpu, cpu):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids, (name, adapter_request)
            if name == "logprobs":
                for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
                    assert x.token_ids == y.token_ids and torch.allclose(torch.tensor(x.logprobs),
                                                                         torch.tensor(y.logprobs), atol=1e-3)
                assert len(a.prompt_logprobs) == len(b.prompt_logprobs) > 0
    drafting = LLM(qwen25_path, dtype="float32", device="cuda", num_kv_blocks=256, speculative_config=NGRAM)
    request = prompt_request(hf, *PROMPTS[0])
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = engines["cuda"].generate([request], greedy)[0].outputs[0].token_ids
    assert drafting.generate([request], greedy)[0].outputs[0].token_ids == plain
    seeded = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02, seed=5, max_tokens=16, ignore_eos=True)
    first, second = (drafting.generate([request], seeded)[0].outputs[0] for _ in range(2))
    assert first.finish_reason == "length" and len(first.token_ids) == 16
    assert first.token_ids == second.token_ids
