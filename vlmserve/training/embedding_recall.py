"""How well a model's embeddings find pictures of the same shape and colour: recall@1 over
generated one-shape pictures of the shapes world (each picture's nearest other picture,
by cosine, shows the same shape in the same colour). A figure, not a promise.

    python -m vlmserve.training.embedding_recall            # the shipped model
"""

from __future__ import annotations

import argparse
import random

import torch

from vlmserve.training.shapes import COLORS, SHAPES, random_scene, render


def pictures(per_class: int, seed: int) -> tuple[list, list[tuple[str, str]]]:
    """per_class one-shape pictures of every (colour, shape): random size, place, side,
    background; their classes."""
    rng = random.Random(seed)
    images, classes = [], []
    wanted = {(color, kind): per_class for color in COLORS for kind in SHAPES}
    while any(wanted.values()):
        scene = random_scene(rng, num_shapes=1)
        key = (scene.shapes[0].color, scene.shapes[0].kind)
        if wanted[key]:
            wanted[key] -= 1
            images.append(render(scene, rng))
            classes.append(key)
    return images, classes


def recall_at_1(llm, per_class: int = 4, seed: int = 0, question: str = "Describe the image.") -> float:
    """llm: an `LLM` that embeds (runner="pooling")."""
    images, classes = pictures(per_class, seed)
    prompt = llm.engine.render_chat([{"role": "user", "content": [{"type": "image", "image": "x"},
                                                                  {"type": "text", "text": question}]}]).prompt
    outs = llm.embed([{"prompt": prompt, "multi_modal_data": {"image": [img]}} for img in images])
    vectors = torch.nn.functional.normalize(torch.tensor([o.outputs.embedding for o in outs]), dim=-1)
    similarity = vectors @ vectors.T
    similarity.fill_diagonal_(-2.0)
    nearest = similarity.argmax(dim=1).tolist()
    return sum(classes[i] == classes[j] for i, j in enumerate(nearest)) / len(images)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the shipped model")
    ap.add_argument("--per-class", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from vlmserve import LLM

    llm = LLM(args.model, runner="pooling")
    n = args.per_class * len(COLORS) * len(SHAPES)
    print(f"recall@1 (same shape and colour) over {n} one-shape pictures: {recall_at_1(llm, args.per_class, args.seed):.3f}")


if __name__ == "__main__":
    main()
