"""The engine's process holds one team of OpenMP threads: the engine's.

torch's CPU ops run on OpenMP, and every other thread that runs a parallel op (a picture
processed in the request pool, weights loaded on the caller's thread of a server) gets a
team of its own. With more OpenMP threads than cores, GNU libgomp stops spinning between
parallel regions for every team: each of the engine's kernel calls of every later step
then waits for a sleeping thread to wake (a one-token step of the benchmark's 29M
Qwen2.5-VL: 3-4 ms with one team, 9-10 ms with two). No timing here: each probe counts the
process's threads that Python did not start, in a process of its own (no other test's
threads), with the tokenizers library's own thread pool off.
"""

import os
import subprocess
import sys

import pytest

PREAMBLE = """
import asyncio, os, sys, threading
import torch
from PIL import Image
from vlmserve import LLM, SamplingParams
from vlmserve.engine.args import EngineArgs
from vlmserve.engine.async_llm import AsyncLLM
torch.set_num_threads(2)
def native_threads():
    return len(os.listdir("/proc/self/task")) - threading.active_count()
params = SamplingParams(temperature=0, max_tokens=2)
pictures = [Image.new("RGB", size, (40 * i, 90, 200)) for i, size in enumerate([(640, 480), (512, 512)])]
"""

LLM_PROBE = PREAMBLE + """
llm = LLM(sys.argv[1], num_kv_blocks=256)
llm.generate("Hello", params)  # the engine's team exists
before = native_threads()
for picture in pictures:
    llm.chat([{"role": "user", "content": [{"type": "image", "image": picture}, {"type": "text", "text": "Describe."}]}],
             params)
print(before, native_threads())
"""

SERVER_ENGINE_PROBE = PREAMBLE + """
engine = AsyncLLM(EngineArgs.from_kwargs(model=sys.argv[1], num_kv_blocks=256))
before = native_threads()  # the weights are loaded: the engine's team exists
async def ask(i, prompt):
    async for _ in engine.generate(f"r{i}", prompt, params):
        pass
asyncio.run(ask(0, "Hello"))
for i, picture in enumerate(pictures):
    asyncio.run(ask(i + 1, {"prompt": "<|vision_start|><|image_pad|><|vision_end|>Describe.",
                            "multi_modal_data": {"image": [picture]}}))
print(before, native_threads())
engine.shutdown()
"""


@pytest.mark.parametrize("probe", [LLM_PROBE, SERVER_ENGINE_PROBE], ids=["LLM", "AsyncLLM"])
def test_serving_pictures_starts_no_second_openmp_team(qwen25_path, probe):
    if not os.path.isdir("/proc/self/task"):
        pytest.skip("counts threads in /proc (Linux)")
    run = subprocess.run([sys.executable, "-c", probe, qwen25_path], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    assert run.returncode == 0, run.stderr[-2000:]
    before, after = map(int, run.stdout.split()[-2:])
    assert after == before, f"{after - before} threads more, not started by Python, after the requests"
