"""`vlmserve eval`: scores a model through vlmserve on a freshly generated held-out set of
the shapes world (a seed training never uses) and prints accuracy per question kind;
optionally checks that transformers gives the same greedy answers.

    vlmserve eval [--model PATH] [--pictures 500] [--videos 100] [--video-captions 200] [--compare-transformers 50]
                  [--quantization int8|int4] [--kv-cache-dtype fp8]
"""

from __future__ import annotations

import argparse
import io
import random
import sys
import time
from collections import defaultdict
from dataclasses import dataclass

from vlmserve.training import shapes

HELD_OUT_SEED = "held-out-2026"
MAX_TOKENS = 256  # a JSON description of three shapes is about 180 tokens  # training uses "<seed>-<step>", "<seed>-vision-<step>", "validation-<seed>"


@dataclass
class Item:
    kind: str
    media: object  # PNG/JPEG bytes, MP4 bytes, or a list of frames
    modality: str
    question: str
    answer: str
    picture: int  # index of the picture / video it is about


def held_out_set(pictures: int, videos: int, seed: str = HELD_OUT_SEED, video_captions: int = 0) -> list[Item]:
    """Pictures with every question kind, clips of one shape with the direction question,
    and (their own stream of the seed, so the others stay the same) clips of 1 to 3 moving
    shapes to describe."""
    rng = random.Random(seed)
    items = []
    for i in range(pictures):
        scene = shapes.random_scene(rng)
        data = shapes.encode_image(shapes.render(scene, rng), rng)
        for qa in shapes.all_questions(scene, rng):
            items.append(Item(qa.kind, data, "image", qa.question, qa.answer, i))
        items.append(Item("json", data, "image", shapes.JSON_QUESTION, shapes.json_description(scene), i))
    for i in range(videos):
        video = shapes.random_video(rng)
        media = shapes.encode_mp4(video.frames) if i % 2 == 0 else video.frames  # MP4 or a list of frames
        qa = video.question
        items.append(Item(qa.kind, media, "video", qa.question, qa.answer, pictures + i))
    rng = random.Random(f"{seed}-video-captions")
    for i in range(video_captions):
        video = shapes.random_moving_video(rng)
        media = shapes.encode_mp4(video.frames) if i % 2 == 0 else video.frames
        qa = video.caption
        items.append(Item(qa.kind, media, "video", qa.question, qa.answer, pictures + videos + i))
    return items


def chat_for(item: Item) -> list[dict]:
    part = {"type": "image", "image": item.media} if item.modality == "image" else {"type": "video", "video": item.media}
    return [{"role": "user", "content": [part, {"type": "text", "text": item.question}]}]


def score(items: list[Item], answers: list[str]) -> dict[str, tuple[int, int]]:
    by_kind: dict[str, list[bool]] = defaultdict(list)
    for item, answer in zip(items, answers):
        by_kind[item.kind].append(shapes.normalize_answer(answer) == shapes.normalize_answer(item.answer))
    return {k: (sum(v), len(v)) for k, v in sorted(by_kind.items())}


def table(results: dict[str, tuple[int, int]]) -> str:
    lines = ["| question kind | correct | accuracy |", "| --- | --- | --- |"]
    for kind, (good, total) in results.items():
        lines.append(f"| {kind} | {good}/{total} | {100 * good / total:.1f}% |")
    return "\n".join(lines)


def run_vlmserve(model: str | None, items: list[Item], dtype: str, quantization: str | None = None,
                 kv_cache_dtype: str = "auto") -> tuple[list[str], float]:
    from vlmserve import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, quantization=quantization, kv_cache_dtype=kv_cache_dtype)
    start = time.time()
    outs = llm.chat([chat_for(i) for i in items], SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    return [o.outputs[0].text for o in outs], time.time() - start


def run_transformers(model_path: str, items: list[Item]) -> list[str]:
    import numpy as np
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from transformers.video_utils import VideoMetadata

    processor = AutoProcessor.from_pretrained(model_path)
    model = AutoModelForImageTextToText.from_pretrained(model_path, dtype=torch.float32).eval()
    answers = []
    for item in items:
        prompt = processor.apply_chat_template(
            [{"role": "user", "content": [{"type": item.modality}, {"type": "text", "text": item.question}]}],
            add_generation_prompt=True,
        )
        if item.modality == "image":
            media = dict(images=[Image.open(io.BytesIO(item.media)).convert("RGB")])
        else:  # the frames at 2 fps (an MP4 decoded by PyAV, as vlmserve does), sampled by the processor
            frames = shapes.decode_video(item.media) if isinstance(item.media, bytes) else item.media
            n = len(frames)
            meta = VideoMetadata(total_num_frames=n, fps=2, width=frames[0].width, height=frames[0].height,
                                 duration=n / 2, frames_indices=list(range(n)))
            pixels = torch.from_numpy(np.stack([np.asarray(f.convert("RGB")) for f in frames])).permute(0, 3, 1, 2)
            media = dict(videos=[pixels], video_metadata=[meta], do_sample_frames=True)
        inputs = processor(text=[prompt], return_tensors="pt", **media)
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
        answers.append(processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
    return answers


def add_eval_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint folder (default: the shipped shapes model)")
    p.add_argument("--pictures", type=int, default=500)
    p.add_argument("--videos", type=int, default=100, help="clips of one shape: which way it moves")
    p.add_argument("--video-captions", type=int, default=200, help="clips of 1 to 3 moving shapes to describe")
    p.add_argument("--seed", default=HELD_OUT_SEED)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", choices=["int8", "int4"], default=None,
                   help="quantize the language layers at load (as serve's --quantization)")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8", "fp8_e4m3"], default="auto",
                   help="the KV cache's dtype (as serve's --kv-cache-dtype)")
    p.add_argument("--compare-transformers", type=int, default=0, metavar="N",
                   help="also answer the first N pictures and N videos of each kind with transformers (fp32) and compare")


def run_eval(args: argparse.Namespace) -> int:
    from vlmserve.engine.model_source import resolve_model_path

    model = resolve_model_path(args.model)
    items = held_out_set(args.pictures, args.videos, args.seed, args.video_captions)
    answers, seconds = run_vlmserve(model, items, args.dtype, args.quantization, args.kv_cache_dtype)
    results = score(items, answers)
    print(f"held-out set (seed {args.seed!r}): {args.pictures} pictures, {args.videos + args.video_captions} videos, "
          f"{len(items)} questions, answered in {seconds:.1f}s through vlmserve"
          + (f" ({args.quantization} weights)" if args.quantization else "")
          + (f" ({args.kv_cache_dtype} KV cache)" if args.kv_cache_dtype != "auto" else ""))
    print(table(results))
    wrong = [(i, a) for i, a in zip(items, answers)
             if shapes.normalize_answer(a) != shapes.normalize_answer(i.answer)]
    for item, answer in wrong[:10]:
        print(f"  wrong ({item.kind}, #{item.picture}): {item.question!r} -> {answer!r}, expected {item.answer!r}",
              file=sys.stderr)
    if args.compare_transformers:
        n = args.compare_transformers
        videos_by_kind: dict[str, list[Item]] = defaultdict(list)
        for item in items:
            if item.modality == "video" and len(videos_by_kind[item.kind]) < n:
                videos_by_kind[item.kind].append(item)
        subset = [i for i in items if i.modality == "image" and i.picture < n] + sum(videos_by_kind.values(), [])
        ours, _ = run_vlmserve(model, subset, "float32")
        theirs = run_transformers(model, subset)
        same = sum(a == b for a, b in zip(ours, theirs))
        videos = sum(i.modality == "video" for i in subset)
        print(f"transformers vs vlmserve (fp32, greedy) on {n} pictures and {videos} videos: "
              f"{same}/{len(subset)} answers identical")
        if same != len(subset):
            return 1
    return 0
