"""The shapes world (docs/shapes-world.md): pictures of coloured shapes on a 3x3 grid,
the five kinds of questions about them, and short videos of shapes moving in a straight
line (which way one moves; a caption of what moves where).

Everything is drawn from the full ranges of the spec (picture side, background, sizes,
placement, colour jitter, anti-aliasing, PNG/JPEG, MP4/frames), so a model trained on
it answers for any picture drawn by the rules, not only for this generator's.
"""

from __future__ import annotations

import io
import random
from dataclasses import dataclass, field

from PIL import Image, ImageDraw

POSITIONS = [
    "top left", "top middle", "top right",
    "middle left", "center", "middle right",
    "bottom left", "bottom middle", "bottom right",
]
SHAPES = ["circle", "square", "triangle"]
SIZES = {"small": (0.35, 0.50), "large": (0.70, 0.90)}
COLORS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 200, 40),
    "purple": (140, 60, 180),
    "orange": (245, 140, 30),
}
NUMBERS = ["zero", "one", "two", "three"]
DIRECTIONS = ["left", "right", "up", "down"]
COLOR_JITTER = 15


@dataclass
class Shape:
    kind: str  # circle | square | triangle
    color: str
    size: str  # small | large
    cell: int  # 0..8, row by row
    rgb: tuple[int, int, int] = (0, 0, 0)
    box: tuple[float, float, float] = (0.0, 0.0, 0.0)  # x0, y0, side in pixels

    def phrase(self) -> str:
        return f"a {self.size} {self.color} {self.kind} in the {POSITIONS[self.cell]}"


@dataclass
class Scene:
    side: int
    background: tuple[int, int, int]
    shapes: list[Shape] = field(default_factory=list)


# -- answers -------------------------------------------------------------------------
def caption(scene: Scene) -> str:
    parts = [s.phrase() for s in sorted(scene.shapes, key=lambda s: s.cell)]
    if len(parts) == 1:
        return parts[0] + "."
    return ", ".join(parts[:-1]) + " and " + parts[-1] + "."


JSON_QUESTION = "Describe the image as JSON."


def json_description(scene: Scene) -> str:
    """The caption's content as compact JSON: {"count", "shapes": [{"color", "shape",
    "where"}]}, shapes in the caption's order."""
    import json

    shapes = [{"color": s.color, "shape": s.kind, "where": POSITIONS[s.cell]}
              for s in sorted(scene.shapes, key=lambda s: s.cell)]
    return json.dumps({"count": len(shapes), "shapes": shapes}, separators=(",", ":"))


@dataclass
class QA:
    kind: str  # caption | json | count | color | exists | where | direction
    question: str
    answer: str
    cells: tuple[int, ...] = ()  # grid cells of the objects the answer is about, in the order it names them


def all_questions(scene: Scene, rng: random.Random) -> list[QA]:
    """One question of every kind that applies to the scene (exists: yes or no, 50/50)."""
    qas = [
        QA("caption", "Describe the image.", caption(scene), tuple(sorted(s.cell for s in scene.shapes))),
        QA("count", "How many shapes are there?", NUMBERS[len(scene.shapes)]),
    ]
    kinds = [s.kind for s in scene.shapes]
    unique = [s for s in scene.shapes if kinds.count(s.kind) == 1]
    if unique:
        s = rng.choice(unique)
        qas.append(QA("color", f"What color is the {s.kind}?", s.color, (s.cell,)))
    present = {(s.color, s.kind) for s in scene.shapes}
    if rng.random() < 0.5:
        s = rng.choice(sorted(scene.shapes, key=lambda s: (s.color, s.kind)))
        qas.append(QA("exists", f"Is there a {s.color} {s.kind}?", "yes", (s.cell,)))
    else:
        # hard negatives: often a present colour or a present shape, in a new pairing
        absent = [(c, k) for c in COLORS for k in SHAPES if (c, k) not in present]
        near = [(c, k) for c, k in absent if c in {p[0] for p in present} or k in kinds]
        color, kind = rng.choice(near if near and rng.random() < 0.7 else absent)
        qas.append(QA("exists", f"Is there a {color} {kind}?", "no"))
    s = rng.choice(scene.shapes)
    qas.append(QA("where", f"Where is the {s.color} {s.kind}?", f"in the {POSITIONS[s.cell]}", (s.cell,)))
    return qas


def question_set(scene: Scene, rng: random.Random, k: int) -> list[QA]:
    """Up to k short questions about one picture that give nothing away to each other:
    the count, at most one question per object (its colour, place, or that it is there),
    and a "no" to a colour-shape pair that is absent. Shuffled."""
    qas = [QA("count", "How many shapes are there?", NUMBERS[len(scene.shapes)])]
    kinds = [s.kind for s in scene.shapes]
    for s in rng.sample(scene.shapes, len(scene.shapes)):
        options = ["where", "exists"] + (["color"] if kinds.count(s.kind) == 1 else [])
        choice = rng.choice(options)
        if choice == "where":
            qas.append(QA("where", f"Where is the {s.color} {s.kind}?", f"in the {POSITIONS[s.cell]}", (s.cell,)))
        elif choice == "exists":
            qas.append(QA("exists", f"Is there a {s.color} {s.kind}?", "yes", (s.cell,)))
        else:
            qas.append(QA("color", f"What color is the {s.kind}?", s.color, (s.cell,)))
    present = {(s.color, s.kind) for s in scene.shapes}
    absent = [(c, kd) for c in COLORS for kd in SHAPES if (c, kd) not in present]
    near = [(c, kd) for c, kd in absent if c in {p[0] for p in present} or kd in kinds]
    color, kind = rng.choice(near if near and rng.random() < 0.7 else absent)
    qas.append(QA("exists", f"Is there a {color} {kind}?", "no"))
    rng.shuffle(qas)
    return qas[:k]


def normalize_answer(text: str) -> str:
    """Scoring rule of the spec: lower case, trimmed, one trailing period dropped."""
    text = text.strip().lower()
    return text[:-1] if text.endswith(".") else text


# -- scenes ----------------------------------------------------------------------------
def _jitter(rgb: tuple[int, int, int], rng: random.Random) -> tuple[int, int, int]:
    return tuple(min(255, max(0, c + rng.randint(-COLOR_JITTER, COLOR_JITTER))) for c in rgb)


def _place(cell: int, side_px: float, cell_px: float, rng: random.Random) -> tuple[float, float]:
    row, col = divmod(cell, 3)
    x0 = col * cell_px + rng.uniform(0, cell_px - side_px)
    y0 = row * cell_px + rng.uniform(0, cell_px - side_px)
    return x0, y0


def random_scene(rng: random.Random, num_shapes: int | None = None, side: int | None = None) -> Scene:
    side = side or rng.randint(160, 320)
    scene = Scene(side, tuple(rng.randint(225, 255) for _ in range(3)))
    n = num_shapes or rng.randint(1, 3)
    cells = rng.sample(range(9), n)
    used: set[tuple[str, str]] = set()
    cell_px = side / 3
    for cell in cells:
        while True:
            kind, color = rng.choice(SHAPES), rng.choice(list(COLORS))
            if (color, kind) not in used:
                break
        used.add((color, kind))
        size = rng.choice(list(SIZES))
        lo, hi = SIZES[size]
        side_px = rng.uniform(lo, hi) * cell_px
        x0, y0 = _place(cell, side_px, cell_px, rng)
        scene.shapes.append(Shape(kind, color, size, cell, _jitter(COLORS[color], rng), (x0, y0, side_px)))
    return scene


def render(scene: Scene, rng: random.Random | None = None, antialias: bool | None = None) -> Image.Image:
    """Draws the scene; anti-aliased (each pixel's coverage by 4 x 4 subsamples) or not."""
    if antialias is None:
        antialias = rng.random() < 0.5 if rng else True
    img = Image.new("RGB", (scene.side, scene.side), scene.background)
    for s in scene.shapes:
        if not antialias:
            _draw_shape(ImageDraw.Draw(img), s.kind, *s.box, fill=s.rgb)
            continue
        # a 4x coverage mask over the shape's own pixels only (not a 4x canvas): fast
        x0, y0, d = s.box
        left, top = int(x0), int(y0)
        w, h = int(x0 + d) - left + 2, int(y0 + d) - top + 2
        mask = Image.new("L", (4 * w, 4 * h), 0)
        _draw_shape(ImageDraw.Draw(mask), s.kind, 4 * (x0 - left), 4 * (y0 - top), 4 * d, fill=255)
        img.paste(s.rgb, (left, top), mask.reduce(4))
    return img


def _draw_shape(draw: ImageDraw.ImageDraw, kind: str, x0: float, y0: float, d: float, fill) -> None:
    if kind == "circle":
        draw.ellipse([x0, y0, x0 + d, y0 + d], fill=fill)
    elif kind == "square":
        draw.rectangle([x0, y0, x0 + d, y0 + d], fill=fill)
    else:  # isosceles, apex up
        draw.polygon([(x0 + d / 2, y0), (x0, y0 + d), (x0 + d, y0 + d)], fill=fill)


def encode_image(img: Image.Image, rng: random.Random) -> bytes:
    """PNG, or JPEG at quality 85..100 (the spec's range)."""
    buf = io.BytesIO()
    if rng.random() < 0.5:
        img.save(buf, format="PNG")
    else:
        img.save(buf, format="JPEG", quality=rng.randint(85, 100))
    return buf.getvalue()


def through_file(img: Image.Image, rng: random.Random) -> Image.Image:
    """The picture as a model would receive it after PNG/JPEG encoding."""
    return Image.open(io.BytesIO(encode_image(img, rng))).convert("RGB")


# -- videos -----------------------------------------------------------------------------
VIDEO_CAPTION_QUESTION = "Describe the video."
_STEPS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}


@dataclass
class Movement:
    shape: Shape  # as in the first frame
    direction: str
    distance: float  # pixels, over the whole clip

    def phrase(self) -> str:
        s = self.shape
        return f"a {s.size} {s.color} {s.kind} moving {self.direction}"

    def at(self, t: float) -> Shape:
        """The shape at time t in [0, 1] of the clip (its cell: where its centre is)."""
        x0, y0, side_px = self.shape.box
        dx, dy = _STEPS[self.direction]
        x, y = x0 + dx * self.distance * t, y0 + dy * self.distance * t
        return Shape(self.shape.kind, self.shape.color, self.shape.size, _cell_at(x, y, side_px, self._cell_px),
                     self.shape.rgb, (x, y, side_px))

    _cell_px: float = 0.0


@dataclass
class Video:
    frames: list[Image.Image]
    moves: list[Movement]  # in position order of their first frames' cells

    @property
    def question(self) -> QA:
        """Which way the first shape moves (the clips of the direction question have one)."""
        return self.direction_question(0)

    def direction_question(self, i: int) -> QA:
        s = self.moves[i].shape
        return QA("direction", f"Which way does the {s.color} {s.kind} move?", self.moves[i].direction)

    @property
    def caption(self) -> QA:
        """Every shape and the way it moves, in position order of where it starts."""
        parts = [m.phrase() for m in self.moves]
        text = parts[0] + "." if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1] + "."
        return QA("video_caption", VIDEO_CAPTION_QUESTION, text)


def _cell_at(x: float, y: float, side_px: float, cell_px: float) -> int:
    return min(int((y + side_px / 2) // cell_px), 2) * 3 + min(int((x + side_px / 2) // cell_px), 2)


def random_video(rng: random.Random, num_frames: int | None = None, side: int | None = None) -> Video:
    """One shape moving 1 to 2 cells in a straight line, 4 to 8 frames at 2 fps."""
    n = num_frames or rng.randint(4, 8)
    side = side or rng.randint(160, 320)
    cell_px = side / 3
    move = _random_movement(rng, side, cell_px)
    background = tuple(rng.randint(225, 255) for _ in range(3))
    return _clip(side, background, [move], n, antialias=rng.random() < 0.5)


def random_moving_video(rng: random.Random, num_shapes: int | None = None, num_frames: int | None = None,
                        side: int | None = None) -> Video:
    """1 to 3 shapes (no two of one colour and kind), each moving 1 to 2 cells in a
    straight line of its own direction, never overlapping another; 4 to 8 frames at 2 fps."""
    n = num_frames or rng.randint(4, 8)
    side = side or rng.randint(160, 320)
    cell_px = side / 3
    wanted = num_shapes or rng.randint(1, 3)
    moves: list[Movement] = []
    used: set[tuple[str, str]] = set()
    for _ in range(200 * wanted):  # rejection: paths that cross another shape's are drawn again
        if len(moves) == wanted:
            break
        move = _random_movement(rng, side, cell_px)
        kind, color = move.shape.kind, move.shape.color
        if (color, kind) in used or any(_collide(move, other) for other in moves):
            continue
        used.add((color, kind))
        moves.append(move)
    background = tuple(rng.randint(225, 255) for _ in range(3))
    return _clip(side, background, moves, n, antialias=rng.random() < 0.5)


def _random_movement(rng: random.Random, side: float, cell_px: float) -> Movement:
    """One shape of any kind, colour and size moving 1 to 2 cells one way, its whole path
    inside the picture."""
    direction = rng.choice(DIRECTIONS)
    dx, dy = _STEPS[direction]
    distance = rng.uniform(1.0, 2.0) * cell_px
    size = rng.choice(list(SIZES))
    lo, hi = SIZES[size]
    side_px = rng.uniform(lo, hi) * cell_px
    x0, y0 = _start(rng, side, side_px, dx, dy, distance)
    kind, color = rng.choice(SHAPES), rng.choice(list(COLORS))
    return _movement(kind, color, size, _jitter(COLORS[color], rng), (x0, y0, side_px), direction, distance, cell_px)


def _start(rng: random.Random, side: float, side_px: float, dx: int, dy: int, distance: float) -> tuple[float, float]:
    """A start anywhere the whole path stays inside the picture."""
    span_x = (0, side - side_px) if dx == 0 else ((distance, side - side_px) if dx < 0 else (0, side - side_px - distance))
    span_y = (0, side - side_px) if dy == 0 else ((distance, side - side_px) if dy < 0 else (0, side - side_px - distance))
    return rng.uniform(*span_x), rng.uniform(*span_y)


def _movement(kind, color, size, rgb, box, direction, distance, cell_px) -> Movement:
    move = Movement(Shape(kind, color, size, _cell_at(box[0], box[1], box[2], cell_px), rgb, box), direction, distance)
    move._cell_px = cell_px
    return move


def _collide(a: Movement, b: Movement, samples: int = 16) -> bool:
    """Whether two moving shapes' boxes (with a margin) ever overlap, or start in one cell."""
    if a.shape.cell == b.shape.cell:
        return True
    for k in range(samples + 1):
        (ax, ay, aside), (bx, by, bside) = a.at(k / samples).box, b.at(k / samples).box
        margin = 2.0
        if ax < bx + bside + margin and bx < ax + aside + margin and ay < by + bside + margin and by < ay + aside + margin:
            return True
    return False


def _clip(side: int, background, moves: list[Movement], n: int, antialias: bool) -> Video:
    frames = [render(Scene(side, background, [m.at(i / (n - 1)) for m in moves]), antialias=antialias)
              for i in range(n)]
    return Video(frames, sorted(moves, key=lambda m: m.shape.cell))


def encode_mp4(frames: list[Image.Image], fps: int = 2) -> bytes:
    """H.264 MP4 (yuv420p), as a user would upload it."""
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        w, h = frames[0].size
        stream.width, stream.height = w - w % 2, h - h % 2
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": "18"}
        for img in frames:
            frame = av.VideoFrame.from_image(img.crop((0, 0, stream.width, stream.height)))
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def decode_video(data: bytes) -> list[Image.Image]:
    import av

    with av.open(io.BytesIO(data)) as container:
        return [f.to_image() for f in container.decode(video=0)]
