"""Regenerates the sample pictures, the sample video and answers.json (fixed seeds).

    python samples/make_samples.py
"""

import json
import random
from pathlib import Path

from vlmserve.training import shapes

HERE = Path(__file__).resolve().parent


def main() -> None:
    rng = random.Random("vlmserve-samples")
    items = []
    for i, (n, side, fmt) in enumerate([(1, 224, "png"), (2, 256, "png"), (3, 288, "jpg"), (3, 200, "png")]):
        scene = shapes.random_scene(rng, num_shapes=n, side=side)
        img = shapes.render(scene, antialias=True)
        name = f"shapes{i + 1}.{fmt}"
        img.save(HERE / name, quality=95) if fmt == "jpg" else img.save(HERE / name)
        for qa in shapes.all_questions(scene, rng):
            items.append({"file": name, "kind": qa.kind, "question": qa.question, "answer": qa.answer})
        items.append({"file": name, "kind": "json", "question": shapes.JSON_QUESTION,
                      "answer": shapes.json_description(scene)})
    video = shapes.random_video(rng, num_frames=6, side=240)
    (HERE / "moving.mp4").write_bytes(shapes.encode_mp4(video.frames))
    for qa in (video.question, video.caption):
        items.append({"file": "moving.mp4", "kind": qa.kind, "question": qa.question, "answer": qa.answer})
    (HERE / "answers.json").write_text(json.dumps(items, indent=1) + "\n")


if __name__ == "__main__":
    main()
