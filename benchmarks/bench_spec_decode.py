"""Speculative decoding (n-gram prompt lookup, and a draft model) on the shipped model:
output tok/s with and without it, one stream at a time and several at once, on three
workloads:

- json: "Describe the image as JSON." — the answer repeats its own keys (copy-heavy);
- repeat: a second turn asking for the same description as the first turn's answer,
  which is in the prompt (copy-heavy: the model transcribes text it was given);
- plain: the shapes questions mixed (short answers; little to copy).

Engines alternate (off, each setting of --drafts, the last of them with
disable_by_batch_size, and with --draft-layers a draft model made of some of the shipped
model's layers: no smaller trained checkpoint of it exists), medians of --repeats runs after a
warm-up, caches emptied before each run, greedy decoding. Printed per run: tok/s, the
ratio to off, the acceptance rate (kept over checked drafts) and the mean acceptance
length (tokens per decoding step of a request with drafts), and the share of checks that
kept the draft at each position (vLLM's spec_decode_num_accepted_tokens_per_pos over
spec_decode_num_drafts). Every setting's tokens must
equal off's. The peer: transformers `generate` one stream at a time, with and without its
own prompt lookup (`prompt_lookup_num_tokens`), when its model supports it.

    python benchmarks/bench_spec_decode.py [--requests 48] [--streams 1,8,32] [--repeats 5] [--drafts 2,4]
        [--draft-layers 0,1,4,5 --draft-k 3]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from safetensors.torch import load_file, save_file

from common import cpu_flags
from vlmserve import LLM, SamplingParams
from vlmserve.engine.model_source import SHIPPED_MODEL
from vlmserve.training import shapes

MAX_TOKENS = 96


def workloads(n: int, seed: int = 0) -> dict[str, list[dict]]:
    """Chat messages per workload (the pictures are PIL images)."""
    rng = random.Random(seed)
    scenes = [shapes.random_scene(rng) for _ in range(n)]
    pictures = [shapes.render(s, rng) for s in scenes]

    def ask(picture, question, history=()):
        return [*history, {"role": "user", "content": [{"type": "image", "image": picture},
                                                          {"type": "text", "text": question}]}]

    plain = []
    for scene, picture in zip(scenes, pictures):
        qa = rng.choice(shapes.all_questions(scene, rng))
        plain.append(ask(picture, qa.question))
    repeat = [ask(picture, "Describe the image.", history=[
        {"role": "user", "content": [{"type": "image", "image": picture}, {"type": "text", "text": "Describe the image."}]},
        {"role": "assistant", "content": shapes.caption(scene)}]) for scene, picture in zip(scenes, pictures)]
    return {"json": [ask(p, shapes.JSON_QUESTION) for p in pictures], "repeat": repeat, "plain": plain}


def layer_cut(keep: list[int], folder: Path) -> str:
    """A draft model made of some layers of the shipped model (its embeddings, vision
    tower and tokenizer with them): the draft there is without training one."""
    shutil.copytree(SHIPPED_MODEL, folder)
    config = json.loads((folder / "config.json").read_text())
    text = config["text_config"]
    text["layer_types"] = [text["layer_types"][i] for i in keep]
    text["num_hidden_layers"] = len(keep)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    weights = {}
    for name, w in load_file(str(folder / "model.safetensors")).items():
        if "language_model.layers." in name:
            layer = int(name.split(".layers.")[1].split(".")[0])
            if layer not in keep:
                continue
            name = name.replace(f".layers.{layer}.", f".layers.{keep.index(layer)}.")
        weights[name] = w
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return str(folder)


def run(llm: LLM, chats: list, batch: int) -> dict:
    """The chats through the engine, `batch` at a time; tokens and the draft counters."""
    if not llm.engine.reset_caches():
        raise RuntimeError("requests still running")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    before = llm.engine.stats()
    start = time.perf_counter()
    outs = []
    for i in range(0, len(chats), batch):
        outs += llm.chat(chats[i : i + batch], params)
    seconds = time.perf_counter() - start
    after = llm.engine.stats()
    tokens = [o.outputs[0].token_ids for o in outs]
    drafts = after.num_drafts - before.num_drafts
    checked = after.num_draft_tokens - before.num_draft_tokens
    kept = after.num_accepted_tokens - before.num_accepted_tokens
    per_position = [n - (before.num_accepted_per_position[i] if i < len(before.num_accepted_per_position) else 0)
                    for i, n in enumerate(after.num_accepted_per_position)]
    return {"tok_s": sum(map(len, tokens)) / seconds, "tokens": tokens,
            "acceptance": kept / checked if checked else float("nan"),
            "mean_length": 1 + kept / drafts if drafts else float("nan"),
            "by_position": [n / drafts for n in per_position] if drafts else []}


def transformers_peer(chats: list, drafts: int, repeats: int) -> dict[str, float] | str:
    """transformers generate, one stream: tok/s without and with prompt lookup."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(SHIPPED_MODEL)
    model = AutoModelForImageTextToText.from_pretrained(SHIPPED_MODEL, dtype=torch.bfloat16).eval()

    def once(lookup: int | None) -> float:
        tokens, start = 0, time.perf_counter()
        for chat in chats:
            inputs = processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                                   return_dict=True, return_tensors="pt")
            extra = {"prompt_lookup_num_tokens": lookup} if lookup else {}
            with torch.inference_mode():
                out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, **extra)
            tokens += out.shape[1] - inputs["input_ids"].shape[1]
        return tokens / (time.perf_counter() - start)

    results = {}
    for lookup in (None, drafts):
        name = f"lookup {lookup}" if lookup else "off"
        try:
            once(lookup)  # warm-up
            results[name] = statistics.median(once(lookup) for _ in range(repeats))
        except Exception as e:  # a model whose cache cannot be cropped
            results[name] = f"not supported ({type(e).__name__}: {str(e)[:80]})"
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=48, help="requests per workload")
    ap.add_argument("--streams", default="1,8,32", help="requests at once (the engine's max_num_seqs)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--drafts", default="2,4", help="num_speculative_tokens settings to compare with off")
    ap.add_argument("--disable-by-batch-size", type=int, default=8,
                    help="also the last --drafts setting with this disable_by_batch_size (0: not)")
    ap.add_argument("--draft-layers", default=None,
                    help="also a draft model made of these layers of the shipped model, e.g. 0,1,4,5")
    ap.add_argument("--draft-k", type=int, default=3, help="num_speculative_tokens of the draft model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-transformers", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_flags()}, {args.threads} threads; model: the shipped {SHIPPED_MODEL.name}, bf16; "
          f"greedy, max {MAX_TOKENS} tokens; medians of {args.repeats}")
    ngram = {f"ngram k={k}": {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
                              "prompt_lookup_max": 4} for k in map(int, args.drafts.split(","))}
    settings = {"off": {}} | ngram
    if args.disable_by_batch_size:
        name, config = list(ngram.items())[-1]
        settings[f"{name}, off above {args.disable_by_batch_size} running"] = {
            **config, "disable_by_batch_size": args.disable_by_batch_size}
    if args.draft_layers:
        keep = [int(i) for i in args.draft_layers.split(",")]
        draft = layer_cut(keep, Path(tempfile.mkdtemp()) / "draft")
        settings[f"draft model (layers {args.draft_layers}) k={args.draft_k}"] = {
            "model": draft, "num_speculative_tokens": args.draft_k}
    engines = {name: LLM(speculative_config=config, max_num_seqs=max(map(int, args.streams.split(","))),
                         dtype="bfloat16")
               for name, config in settings.items()}
    work = workloads(args.requests)
    print("\n| workload | streams | setting | tok/s (min-max) | vs off | acceptance | mean length | kept at each "
          "position |\n|---|---|---|---|---|---|---|---|")
    for workload, chats in work.items():
        for batch in map(int, args.streams.split(",")):
            for llm in engines.values():
                run(llm, chats[:batch], batch)  # warm-up
            runs = {name: [] for name in engines}
            for _ in range(args.repeats):
                for name, llm in engines.items():
                    runs[name].append(run(llm, chats, batch))
            base = statistics.median(r["tok_s"] for r in runs["off"])
            for name, results in runs.items():
                speeds = [r["tok_s"] for r in results]
                tok_s = statistics.median(speeds)
                last = results[-1]
                if last["tokens"] != runs["off"][-1]["tokens"]:
                    raise SystemExit(f"{name} on {workload}: tokens differ from off")
                print(f"| {workload} | {batch} | {name} | {tok_s:,.0f} ({min(speeds):,.0f}-{max(speeds):,.0f}) | "
                      f"{tok_s / base:.2f}x | "
                      f"{last['acceptance']:.0%} | {last['mean_length']:.2f} | "
                      f"{' '.join(f'{p:.0%}' for p in last['by_position']) or '-'} |")
    if not args.no_transformers:
        print("\ntransformers generate, one stream, bf16 (tok/s):")
        for workload in ("json", "plain"):
            k = max(map(int, args.drafts.split(",")))
            peer = transformers_peer(work[workload][: max(4, args.requests // 4)], k, args.repeats)
            print(f"  {workload}: " + ", ".join(f"{n} {v:,.0f}" if isinstance(v, float) else f"{n} {v}"
                                                for n, v in peer.items()))


if __name__ == "__main__":
    main()
