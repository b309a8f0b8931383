"""The text phases' batches: questions about generated pictures and clips, in the chat
format, with labels on the answer tokens and look-up targets (where the model has to look
to answer). Each batch is a pure function of (seed, phase, step), so a resumed run sees
exactly the data an uninterrupted one would."""

from __future__ import annotations

import dataclasses
import random

import torch

from vlmserve.training import recipe, shapes
from vlmserve.training.visual_labels import VIDEO_KWARGS, clip_view, sample_video

VIDEO_KINDS = ("video", "video_moving", "video_caption")
SHORT_QUESTIONS_PER_PICTURE = 5  # all that question_set gives for 3 objects


def sample_image_qas(rng: random.Random, kind: str, per_picture: int) -> tuple[object, list[shapes.QA]]:
    scene = shapes.random_scene(rng)
    image = shapes.through_file(shapes.render(scene, rng), rng)
    if kind == "caption":
        return image, [shapes.all_questions(scene, rng)[0]]
    if kind == "json":
        cells = tuple(sorted(s.cell for s in scene.shapes))
        return image, [shapes.QA("json", shapes.JSON_QUESTION, shapes.json_description(scene), cells)]
    return image, shapes.question_set(scene, rng, per_picture)


def make_batch(processor, rng: random.Random, kind: str, size: int, per_picture: int = 1) -> tuple[dict, list[str]]:
    """A batch of one kind. With per_picture > 1, a short-answer sequence asks several
    questions about its picture, one after another (the first right after the picture,
    exactly as in evaluation; the others are extra supervision for the same look-up)."""
    texts, images, videos, metas, kinds, questions = [], [], [], [], [], []
    for _ in range(size):
        if kind in VIDEO_KINDS:
            pixels, meta, video = sample_video(rng, moving=kind != "video")
            videos.append(pixels)
            metas.append(meta)
            tokens = clip_view(video, meta.total_num_frames).tokens
            if kind == "video_caption":
                qa = dataclasses.replace(video.caption, cells=tuple(t for move in tokens for t in move))
            else:
                i = rng.randrange(len(video.moves)) if kind == "video_moving" else 0
                qa = dataclasses.replace(video.direction_question(i), cells=tokens[i])
            qas, part = [qa], {"type": "video"}
        else:
            image, qas = sample_image_qas(rng, kind, per_picture)
            images.append(image)
            part = {"type": "image"}
        messages = [{"role": "user", "content": [part, {"type": "text", "text": qas[0].question}]},
                    {"role": "assistant", "content": qas[0].answer}]
        for qa in qas[1:]:
            messages += [{"role": "user", "content": qa.question}, {"role": "assistant", "content": qa.answer}]
        texts.append(processor.apply_chat_template(messages, add_generation_prompt=False))
        kinds.append(qas[0].kind)
        questions.append(qas)
    kwargs = {}
    if videos:
        kwargs = dict(videos=videos, videos_kwargs={"video_metadata": metas, **VIDEO_KWARGS})
    inputs = processor(text=texts, images=images or None, return_tensors="pt", padding=True, **kwargs)
    inputs["labels"], inputs["lookup"] = answer_labels(processor.tokenizer, inputs["input_ids"], questions)
    return dict(inputs), kinds


def answer_spans(ids: list[int], header: list[int], im_end: int) -> list[tuple[int, int]]:
    """[start, end) of every assistant answer, up to and including its <|im_end|>."""
    spans = []
    for i in range(len(ids) - len(header) + 1):
        if ids[i : i + len(header)] == header:
            start = i + len(header)
            spans.append((start, ids.index(im_end, start) + 1))
    return spans


def answer_labels(tokenizer, input_ids: torch.Tensor, questions: list[list[shapes.QA]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels = every assistant answer with its <|im_end|>; the rest -100. And the look-up
    targets, (row, query position, visual token: a picture's cell, or a clip's slot x 9 +
    cell): for an answer about one object, the position that predicts the answer's first
    token; for a caption, each position that predicts an object's size word ("a| small red
    circle ..."), with that object's cell; for a clip, the shape's token in each slot,
    from the positions that predict its direction (and in a caption its size word too)."""
    header = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    size_words = set(tokenizer.convert_tokens_to_ids([f"\u0120{z}" for z in shapes.SIZES]))
    labels = torch.full_like(input_ids, -100)
    targets = []
    for row, qas in enumerate(questions):
        ids = input_ids[row].tolist()
        spans = answer_spans(ids, header, im_end)
        assert len(spans) == len(qas)
        for (start, end), qa in zip(spans, qas):
            labels[row, start:end] = input_ids[row, start:end]
            if qa.kind == "caption":
                sizes = [i for i in range(start, end) if ids[i] in size_words]
                assert len(sizes) == len(qa.cells)
                targets += [(row, i - 1, cell) for i, cell in zip(sizes, qa.cells)]
            elif qa.kind == "video_caption":
                sizes = [i for i in range(start, end) if ids[i] in size_words]
                moves = positions_after(tokenizer, ids, start, end, "moving ")
                slots = recipe.VIDEO_SLOTS
                assert len(sizes) == len(moves) == len(qa.cells) // slots
                for k, (size, move) in enumerate(zip(sizes, moves)):
                    targets += [(row, at - 1, token) for at in (size, move)
                                for token in qa.cells[slots * k : slots * (k + 1)]]
            elif qa.kind == "direction":
                targets += [(row, start - 1, token) for token in qa.cells]
            elif qa.kind == "json":
                targets += [(row, i - 1, cell) for i, cell in json_value_positions(tokenizer, ids, start, end, qa.cells)]
            elif qa.cells:
                targets.append((row, start - 1, qa.cells[0]))
    return labels, torch.tensor(targets, dtype=torch.long).reshape(-1, 3)


def json_value_positions(tokenizer, ids: list[int], start: int, end: int,
                         cells: tuple[int, ...]) -> list[tuple[int, int]]:
    """In a JSON description, the first token of each shape's colour and shape value, with
    that shape's cell: where the model has to look at the picture."""
    return [(token, cell) for key in ('"color":"', '"shape":"')
            for token, cell in zip(positions_after(tokenizer, ids, start, end, key), cells)]


def positions_after(tokenizer, ids: list[int], start: int, end: int, key: str) -> list[int]:
    """The first token of the text right after each occurrence of key in the answer
    ids[start:end] (the small vocabulary splits words, so this goes by characters)."""
    text, ends = "", []
    for i in range(start, end):  # the text's length after each token
        text = tokenizer.decode(ids[start : i + 1])
        ends.append(len(text))
    found, at = [], text.find(key)
    while at >= 0:
        found.append(start + next(i for i, n in enumerate(ends) if n > at + len(key)))
        at = text.find(key, at + 1)
    return found


class BatchStream(torch.utils.data.IterableDataset):
    """Batches for steps start, start+1, ...; each a pure function of (seed, phase, step)."""

    def __init__(self, processor, seed: str, start: int, batch_size: int, mix: dict[str, float]) -> None:
        self.processor, self.seed, self.start, self.batch_size, self.mix = processor, seed, start, batch_size, mix

    def __iter__(self):
        step = self.start
        while True:
            rng = random.Random(f"{self.seed}-{step}")
            kind = rng.choices(list(self.mix), weights=list(self.mix.values()))[0]
            inputs, kinds = make_batch(self.processor, rng, kind, self.batch_size, SHORT_QUESTIONS_PER_PICTURE)
            yield step, kind, inputs, kinds
            step += 1
