"""How far quantized weights move the model's log-probabilities: the shipped model's
greedy answers to the sample questions (fp32, unquantized) are scored again, token by
token, with the language layers quantized at load (int8, int4) and through each published
format's checkpoint of it; printed: the largest and mean |logprob difference| over the
answer tokens, and how many greedy answers stay the same.

    python benchmarks/quantization_drift.py
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from vlmserve import LLM, SamplingParams  # noqa: E402
from vlmserve.engine.model_source import SHIPPED_MODEL  # noqa: E402
from vlmserve.testing.quantized_checkpoints import write_awq, write_fp8, write_gptq  # noqa: E402

SAMPLES = REPO / "samples"


def chats() -> list[list[dict]]:
    out = []
    for item in json.loads((SAMPLES / "answers.json").read_text()):
        kind = "video_url" if item["file"].endswith(".mp4") else "image_url"
        out.append([{"role": "user", "content": [{"type": kind, kind: {"url": str(SAMPLES / item["file"])}},
                                                 {"type": "text", "text": item["question"]}]}])
    return out


def answer_logprobs(llm: LLM, conversations: list, answers: list[list[int]] | None):
    """Greedy answers (as long as the given ones, when given) with their tokens' logprobs."""
    params = [SamplingParams(temperature=0, max_tokens=len(a) if answers else 64, logprobs=0)
              for a in (answers or [None] * len(conversations))]
    outs = llm.chat(conversations, params)
    return [o.outputs[0].token_ids for o in outs], [[e.logprobs[0] for e in o.outputs[0].logprobs] for o in outs]


def main() -> None:
    conversations = chats()
    base = LLM(str(SHIPPED_MODEL), dtype="float32", allowed_local_media_path=str(SAMPLES))
    tokens, reference = answer_logprobs(base, conversations, None)
    del base
    print(f"{len(conversations)} sample questions, {sum(map(len, tokens))} answer tokens; the shipped model "
          f"unquantized in fp32 is the reference; bf16 activations below unless noted")
    print(f"{'weights':<34}{'same answers':>14}{'max |dlogprob|':>16}{'mean |dlogprob|':>17}")
    with tempfile.TemporaryDirectory() as tmp:
        variants = [("unquantized (bf16)", str(SHIPPED_MODEL), None),
                    ("int8 at load", str(SHIPPED_MODEL), "int8"), ("int4 at load", str(SHIPPED_MODEL), "int4")]
        for name, writer in (("AWQ 4-bit", write_awq), ("GPTQ 4-bit", lambda s, d: write_gptq(s, d, bits=4)),
                             ("GPTQ 8-bit", lambda s, d: write_gptq(s, d, bits=8)), ("FP8 block 128", write_fp8)):
            path, _ = writer(SHIPPED_MODEL, Path(tmp) / name.replace(" ", "-"))
            variants.append((f"{name} checkpoint", str(path), None))
        for name, path, method in variants:
            llm = LLM(path, dtype="bfloat16", quantization=method, allowed_local_media_path=str(SAMPLES))
            got_tokens, got = answer_logprobs(llm, conversations, tokens)
            del llm
            same = sum(a == b for a, b in zip(got_tokens, tokens))
            diffs = [abs(a - b) for answer, mine_tokens, ref, mine in zip(tokens, got_tokens, reference, got)
                     if answer == mine_tokens for a, b in zip(ref, mine)]  # over the answers that stayed the same
            print(f"{name:<34}{same:>7}/{len(tokens):<6}{max(diffs):>16.4f}{statistics.mean(diffs):>17.4f}")


if __name__ == "__main__":
    main()
