"""vlmserve vs transformers on a tiny random-weight Qwen2-VL: greedy tokens equal, prompt
and sampled logprobs within 1e-4 (fp32), alone, batched and under preemption. (The
video case, whose M-RoPE time axis differs from Qwen2.5-VL's, is in test_media.)"""

import pytest

from test_qwen2_5_vl_parity import CASES, check, greedy, mixed_requests, request, run_together
from vlmserve import LLM


@pytest.fixture(scope="module")
def llm(qwen2vl_path):
    return LLM(qwen2vl_path, num_kv_blocks=256)


@pytest.mark.parametrize("case", CASES)
def test_single_request_matches_transformers(llm, hf_qwen2vl, case):
    text, images = CASES[case]
    out = llm.generate(request(hf_qwen2vl, text, images), greedy(prompt_logprobs=-1))[0]
    check(out, hf_qwen2vl, text, images, 16, prompt_logprobs=True)


def test_mixed_requests_under_preemption(qwen2vl_path, hf_qwen2vl):
    llm = LLM(qwen2vl_path, num_kv_blocks=24, max_num_seqs=8)
    specs, prompts, params = mixed_requests(hf_qwen2vl)
    outs = run_together(llm, prompts, params)
    assert llm.engine.stats().num_preemptions > 0
    for out, (text, images, n) in zip(outs, specs):
        check(out, hf_qwen2vl, text, images, n, prompt_logprobs=True)
    assert not any(llm.engine.stats().blocks_in_use.values())


def test_a_repeated_picture_hits_the_prefix_cache(llm, hf_qwen2vl):
    text, images = CASES["one_image"]
    llm.generate(request(hf_qwen2vl, text, images), greedy())
    runs = llm.engine.engine_core.runner.encoder_runs
    again = llm.generate(request(hf_qwen2vl, text, images), greedy())[0]
    assert again.num_cached_tokens > 0 and llm.engine.engine_core.runner.encoder_runs == runs
    check(again, hf_qwen2vl, text, images, 16)
