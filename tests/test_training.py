"""The training script end to end on a few steps: it stops on Ctrl-C with its state saved,
the same command resumes through every phase, and what it exports loads in vlmserve and
in transformers."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from vlmserve import LLM, SamplingParams

pytestmark = pytest.mark.slow


def test_training_stops_resumes_and_exports(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "vlmserve.training.train", "--out", str(out), "--vision-steps", "60",
           "--vision-batch-size", "2", "--steps", "4", "--batch-size", "2", "--lookup-steps", "2",
           "--caption-steps", "2", "--json-steps", "2", "--warmup", "2", "--val-size", "2", "--threads", "1"]
    first = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    log = []
    deadline = time.time() + 300
    for line in first.stderr:  # interrupt once the vision phase is under way
        log.append(line)
        if "vision step 20 " in line:
            first.send_signal(signal.SIGINT)
            break
        assert time.time() < deadline, "".join(log)
    rest = first.communicate(timeout=120)[1]
    assert first.returncode == 0 and "stopped at vision step" in rest, "".join(log) + rest
    assert (out / "train_state.pt").exists() and not (out / "model").exists()

    try:
        second = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired as e:  # where it stopped, whole
        pytest.fail(f"the resumed run did not end: {e.stderr}")
    assert second.returncode == 0, second.stderr
    assert "resumed: vision phase, step 2" in second.stderr  # not from scratch
    for phase in ("vlm", "lookup", "caption", "json"):
        assert f"{phase} step" in second.stderr and "exact match" in second.stderr
    lines = (out / "train_log.jsonl").read_text().splitlines()
    assert len(lines) == 60 + 4 + 2 + 2 + 2  # every step once, across the interruption

    # the exported model is a real checkpoint: transformers and vlmserve answer alike
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(out / "model")
    prompt = processor.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "How many shapes?"}]}],
                                           add_generation_prompt=True)
    ids = processor(text=[prompt], return_tensors="pt")["input_ids"]
    model = AutoModelForImageTextToText.from_pretrained(out / "model", dtype=torch.float32)
    expected = model.generate(input_ids=ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)[0, ids.shape[1]:]
    reply = LLM(model=str(out / "model"), dtype="float32").generate(
        [prompt], SamplingParams(temperature=0, max_tokens=4, min_tokens=4))[0]  # EOS banned, as min_new_tokens does
    assert reply.outputs[0].token_ids == expected.tolist()


def test_lookup_targets_point_at_the_object_each_answer_names():
    """The look-up loss pulls attention from a query position to a grid cell; check each
    target against the answer's own words (a caption names each object's place)."""
    import random

    import torch

    from vlmserve.training import recipe, shapes
    from vlmserve.training.batches import make_batch
    from vlmserve.training.lookup import lookup_loss
    from vlmserve.training.visual_labels import token_cells

    tokenizer = recipe.build_tokenizer()
    processor = recipe.build_processor(tokenizer)
    for kind in ("caption", "short"):
        inputs, _ = make_batch(processor, random.Random(kind), kind, 8, 4)
        ids, labels = inputs["input_ids"], inputs["labels"]
        assert len(inputs["lookup"])
        for row, query, cell in inputs["lookup"].tolist():
            assert labels[row, query + 1] != -100  # the query predicts an answer token
            rest = tokenizer.decode(ids[row, query + 1 :])
            phrase = rest.split(" and ")[0].split(",")[0].split("<|im_end|>")[0]
            if kind == "caption":
                assert phrase.split()[0] in shapes.SIZES
            if " in the " in phrase or phrase.startswith("in the "):
                assert phrase.rstrip(".").endswith(shapes.POSITIONS[cell]), (phrase, cell)

    # a clip's targets: the moving shape's token in each frame (one a slot), the last one on its way
    steps = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
    for kind in ("video_caption", "video_moving"):
        clips, _ = make_batch(processor, random.Random(kind), kind, 8)
        found: dict[tuple[int, int], list[int]] = {}
        for row, query, token in clips["lookup"].tolist():
            assert clips["labels"][row, query + 1] != -100
            found.setdefault((row, query), []).append(token)
        for (row, query), tokens in found.items():
            tokens = sorted(tokens)
            assert [t // 9 for t in tokens] == list(range(recipe.VIDEO_SLOTS))
            first, last = tokens[0], tokens[-1]
            answer = tokenizer.decode(clips["input_ids"][row, query + 1 :]).split("<|im_end|>")[0]
            words = answer.replace(",", " ").replace(".", " ").split()
            direction = words[0] if words[0] in steps else words[words.index("moving") + 1]
            dx, dy = steps[direction]
            (r0, c0), (r1, c1) = divmod(first, 3), divmod(last % 9, 3)
            assert (c1 - c0) * dx >= 0 and (r1 - r0) * dy >= 0 and (c1 - c0 if dx == 0 else r1 - r0) == 0

    # attention all on the right cell costs nothing; spread evenly, it costs
    image_token_id = recipe.build_config(tokenizer).image_token_id
    cells = torch.full_like(ids, -1)
    cells[ids == image_token_id] = token_cells().repeat(len(ids))
    targets = inputs["lookup"]
    right = torch.zeros(len(ids), 4, ids.shape[1], ids.shape[1])
    for row, query, cell in targets.tolist():
        in_cell = (cells[row] == cell).float()
        right[row, 0, query] = in_cell / in_cell.sum()
    assert lookup_loss([right], ids, targets, (image_token_id,)).item() < 1e-5
    even = torch.full_like(right, 1 / ids.shape[1])
    assert lookup_loss([even], ids, targets, (image_token_id,)).item() > 1.0


def test_one_frame_patches_see_a_picture_as_two_frame_patches_did():
    """A picture is its frame twice: the two-frame patch embedding's product equals the
    converted one-frame embedding's on the single frame (and a one-frame model is kept)."""
    import torch

    from vlmserve.training import recipe

    key = "model.visual.patch_embed.proj.weight"
    torch.manual_seed(0)
    two = torch.randn(8, 3, 2, 16, 16)
    frame = torch.randn(5, 3, 1, 16, 16)
    converted = recipe.one_frame_patches({key: two, "other": torch.ones(1)})
    assert converted[key].shape == (8, 3, 1, 16, 16) and torch.equal(converted["other"], torch.ones(1))
    as_two = torch.nn.functional.conv3d(frame.repeat(1, 1, 2, 1, 1), two)
    as_one = torch.nn.functional.conv3d(frame, converted[key])
    torch.testing.assert_close(as_one, as_two, rtol=1e-5, atol=1e-4)
    assert recipe.one_frame_patches(converted) is converted
