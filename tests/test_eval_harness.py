"""lm-evaluation-harness end to end against a real `vlmserve serve`: `local-completions`
scores log-likelihoods (echo + logprobs on token-id prompts, several per request) and
generates until a stop; `local-chat-completions` generates through the chat template.
The tasks are defined here from local files; the log-likelihoods it reports are checked
against transformers, its generations against the engine's own greedy answers."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_openai_server import Server
from vlmserve import LLM, SamplingParams

pytestmark = pytest.mark.slow

MC_DOCS = [
    {"question": "A small red circle is", "choices": ["in the top left", "moving up", "blue"], "label": 0},
    {"question": "How many shapes are there?", "choices": ["one", "two", "three"], "label": 1},
    {"question": "Which way does the square move?", "choices": ["up", "down"], "label": 0},
]
GEN_DOCS = [{"question": "Describe the image:", "answer": "a red circle"},
            {"question": "The color of the sky is", "answer": "blue"}]

MC_TASK = """task: shapes_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
"""
GEN_TASK = """task: shapes_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: answer
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def server(short_context_server):
    return short_context_server


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tasks")
    for name, docs, template in (("mc", MC_DOCS, MC_TASK), ("gen", GEN_DOCS, GEN_TASK)):
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        (root / f"shapes_{name}.yaml").write_text(template.format(data=data))
    return root


def run_lm_eval(server: Server, tasks: Path, out: Path, model: str, endpoint: str, task_names: str,
                *extra: str, model_args: str = "") -> list[dict]:
    """The lm_eval command as a user types it; its logged samples, all tasks together."""
    args = f"model=tiny,base_url={server.base}{endpoint},num_concurrent=1,max_retries=1,{model_args}".rstrip(",")
    cmd = [sys.executable, "-m", "lm_eval", "--model", model, "--model_args", args, "--tasks", task_names,
           "--include_path", str(tasks), "--output_path", str(out), "--log_samples", *extra]
    env = {**os.environ, "OPENAI_API_KEY": "unused", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    samples = []
    for f in sorted(out.rglob("samples_*.jsonl")):
        samples += [json.loads(line) | {"task": f.name.split("_", 1)[1].rsplit("_", 1)[0]}
                    for line in f.read_text().splitlines()]
    return samples


def test_local_completions_log_likelihoods_and_generation(server, tasks, tmp_path, qwen25_path, hf_qwen25):
    # two requests at once (lm-eval batches them: several token-id prompts in one request)
    samples = run_lm_eval(server, tasks, tmp_path, "local-completions", "/v1/completions", "shapes_mc,shapes_gen",
                          "--batch_size", "2", model_args=f"tokenizer_backend=huggingface,tokenizer={qwen25_path}")
    tokenizer = hf_qwen25.processor.tokenizer
    scored = [s for s in samples if s["task"] == "shapes_mc"]
    assert len(scored) == len(MC_DOCS)
    for s in scored:
        doc = s["doc"]
        for choice, resp in zip(doc["choices"], s["resps"]):
            loglikelihood = resp[0][0]
            # as lm-eval splits it: the whole text encoded, the context's tokens first (its
            # task separates the two by a space)
            context = tokenizer.encode(doc["question"], add_special_tokens=False)
            continuation = tokenizer.encode(doc["question"] + " " + choice, add_special_tokens=False)[len(context):]
            with torch.no_grad():
                logits = hf_qwen25.model(input_ids=torch.tensor([context + continuation])).logits[0].float()
            logprobs = torch.log_softmax(logits, -1)
            want = sum(logprobs[len(context) + i - 1, t].item() for i, t in enumerate(continuation))
            assert math.isclose(float(loglikelihood), want, abs_tol=2e-3), (doc, choice, loglikelihood, want)

    generated = [s for s in samples if s["task"] == "shapes_gen"]
    assert len(generated) == len(GEN_DOCS)
    llm = LLM(qwen25_path, num_kv_blocks=128, max_model_len=1024)
    for s in generated:
        want = llm.generate([s["doc"]["question"]], SamplingParams(max_tokens=6, temperature=0, stop=["\n"]))[0]
        assert s["resps"][0][0] == want.outputs[0].text


def test_local_chat_completions_generation(server, tasks, tmp_path, qwen25_path):
    samples = run_lm_eval(server, tasks, tmp_path, "local-chat-completions", "/v1/chat/completions", "shapes_gen",
                          "--apply_chat_template")
    assert len(samples) == len(GEN_DOCS)
    llm = LLM(qwen25_path, num_kv_blocks=128, max_model_len=1024)
    for s in samples:
        messages = [{"role": "user", "content": s["doc"]["question"]}]
        want = llm.chat(messages, SamplingParams(max_tokens=6, temperature=0, stop=["\n"]))[0]
        assert s["resps"][0][0] == want.outputs[0].text
