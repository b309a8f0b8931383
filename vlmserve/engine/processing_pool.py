"""The threads that process requests (media, tokens) beside an engine stepping in the
same process.

Their torch ops (a picture's resize and normalisation) run on each thread alone. Why:
torch's CPU ops run on OpenMP, and a second thread that runs a parallel op gets a team of
OpenMP threads of its own. Once a process holds more OpenMP threads than the machine has
cores, the OpenMP runtime (GNU libgomp) stops spinning between parallel regions for every
team: each of the engine's kernel calls then wakes a sleeping thread first. Measured on a
29M-parameter Qwen2.5-VL (2 cores): a one-token decode step 3.2 ms before the first
picture was processed, 9-10 ms after it, for as long as the process lived. (For the same
reason a server's engine is built on the thread that steps it: engine/async_llm.py.)
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch
from threadpoolctl import threadpool_limits


def _single_threaded_torch() -> None:
    # torch sets a thread's OpenMP thread count at its first op: have it set now, so that
    # the limit below is not overwritten by it (the limit is this thread's own setting)
    torch.get_num_threads()
    threadpool_limits(1, user_api="openmp")


def processing_pool(workers: int, name: str) -> ThreadPoolExecutor:
    """A pool of `workers` threads named `name`-N whose torch ops run single-threaded."""
    return ThreadPoolExecutor(workers, thread_name_prefix=name, initializer=_single_threaded_torch)
