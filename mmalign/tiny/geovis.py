"""Tiny synthetic remote-sensing maps for GeoViS-style visual search, and a tiny Qwen2-VL warm-started on them.

The task (`write_dataset`): a 224x224 map of fields and roads with one large landmark (a blue lake) and a
handful of tiny (5-8 px) buildings in four colours. The referring expression names a colour and a side of
the lake ("the small red building left of the lake"); one other building of the SAME colour sits on
another side of the lake, so the relation matters, and buildings of other colours stand near the target.
Rows follow the grounding layout (`pipelines.grounding.data`): ``image``, ``expression``, ``boxes`` (absolute
pixels of the original image), ``coords: absolute``, ``image_width`` / ``image_height``, plus ``object``
("red building"), ``relation`` ("left of the lake") and ``landmark`` ("lake").

With the policy's pixel bounds at ``min_pixels = max_pixels = 3136`` the whole map reaches the model as
56x56 pixels (a building is 1-2 pixels there, and a box written in those pixels is quantised to 4 original
pixels): answering in one shot cannot be precise. A crop of ~1/4 of the map side reaches the model at
about its own resolution and shows the target.

Builder ``geovis`` (`build_geovis`): a tiny Qwen2-VL warm-started on the exact token sequences the
policy produces under the GeoViS protocol (`pipelines.grounding.geovis_env`, `pipelines.grounding.geovis_views`):

(a) a 2-turn zoom conversation ``ZOOM_PROMPT`` + view 0 -> ``<crop>[..]</crop>`` (a coarse, noisy
    square around the target, in view 0's resized pixels), then the inserted user message ``View 1:`` +
    the crop -> ``<answer>[..]</answer>`` (the target box in the crop's resized pixels, jittered), trained
    as ONE sequence with the loss on both assistant turns only;
(b) ``BOX_PROMPT`` on crops that contain the target (and sometimes the whole map) -> the box;
(c) ``YESNO_PROMPT`` on crops with / without the target -> ``yes`` / ``no``.

The model (`geovis_vlm`, ~0.74M parameters) is `mmalign.tiny.vlm`'s layout, widened: 3 text layers of
width 128, a 2-block vision tower of width 64, and M-RoPE with ``rope_theta = 3`` (our design: with the
usual 10000 and a 32-wide head, the rotary frequencies given to the height / width sections are so low
that the 2x2 image tokens of a 56x56 view get nearly the same positions). Warm-start numbers (eval.jsonl,
64 maps x 8 samples, Acc@0.5): zoom 1.6% sampled / 10.9% best-of-8 at temperature 1 (3.3% / 25% at 0.5),
one-shot 0% / 0%; 95% of the sampled crops hold the whole target. The crops are good, the answer inside
the crop is the weak part (mostly the crop's middle): that is what RL has to improve.

Sequences are rendered with the processor's own chat template (`render_conversation`); the test suite
checks that they equal, token for token, what the VLM policy's multi_turn rollout holds for the same
turns. ``python -m mmalign.tiny.geovis`` rewrites ``assets/geovis``; ``python -m mmalign.tiny.geovis eval
MODEL`` prints the zoom and one-shot Acc@0.5 of a model (sampled and best-of-8).
"""

from __future__ import annotations

import argparse
import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mmalign.tiny import BUILDERS, progress_bar, train_bpe_tokenizer
from mmalign.tiny.vlm import (
    IM_END,
    IM_START,
    VLM_CHAT_TEMPLATE,
    VLM_SPECIALS,
    qwen2_vl_model,
    special_token_ids,
)
from pipelines.grounding.geovis_env import REFUSAL, ZoomEnvironment, replay
from pipelines.grounding.geovis_views import (
    BOX_PROMPT,
    YESNO_PROMPT,
    ZOOM_PROMPT,
    View,
    crop_image,
    global_to_view,
    make_view,
)

MAP_SIZE = 224
"""Side of a map in pixels."""
PIXELS = 56 * 56
"""The policy's pixel bounds for this task (min = max): the whole map reaches the model as 56x56."""

BUILDING_COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (225, 35, 35),
    "yellow": (245, 215, 30),
    "white": (250, 250, 250),
    "purple": (150, 40, 200),
}
SIDES: dict[str, tuple[int, int]] = {
    "left of": (-1, 0),
    "right of": (1, 0),
    "above": (0, -1),
    "below": (0, 1),
}
"""Relation words -> the direction (dx, dy) from the landmark to the target (image y points down)."""
BUILDING_PX = (5, 8)
"""Smallest and largest side of a building (original pixels, drawn uniformly)."""
LAKE = (45, 85, 175)
ROAD = (168, 162, 150)
FIELDS = [(112, 140, 72), (138, 150, 82), (158, 142, 92), (120, 112, 72), (92, 122, 62), (146, 128, 84)]

REPO = Path(__file__).resolve().parents[2]
ASSETS = REPO / "assets" / "geovis"


# ----------------------------------------------------------------------------- maps


@dataclass
class GeoMap:
    """One synthetic map: the picture and what it holds (boxes in original pixels, x2/y2 exclusive)."""

    image: Any
    colour: str
    side: str
    box: list[float]
    """The target building."""
    lake: list[float]
    """Bounding box of the lake."""
    buildings: list[tuple[str, list[float]]]
    """Every building (colour, box), the target first."""

    @property
    def expression(self) -> str:
        return f"the small {self.colour} building {self.side} the lake"


def _overlaps(a: Sequence[float], b: Sequence[float], margin: float = 0.0) -> bool:
    return not (
        a[2] + margin <= b[0] or b[2] + margin <= a[0] or a[3] + margin <= b[1] or b[3] + margin <= a[1]
    )


def _draw_background(rng: random.Random, size: int) -> Any:
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (size, size), rng.choice(FIELDS))
    d = ImageDraw.Draw(img)
    xs = sorted({0, size, *(rng.randint(20, size - 20) for _ in range(rng.randint(2, 4)))})
    ys = sorted({0, size, *(rng.randint(20, size - 20) for _ in range(rng.randint(2, 4)))})
    for x0, x1 in zip(xs, xs[1:], strict=False):
        for y0, y1 in zip(ys, ys[1:], strict=False):
            d.rectangle([x0, y0, x1 - 1, y1 - 1], fill=rng.choice(FIELDS))
    for _ in range(rng.randint(1, 2)):  # straight roads
        if rng.random() < 0.5:
            y = rng.randint(10, size - 10)
            d.line([(0, y), (size, y + rng.randint(-30, 30))], fill=ROAD, width=3)
        else:
            x = rng.randint(10, size - 10)
            d.line([(x, 0), (x + rng.randint(-30, 30), size)], fill=ROAD, width=3)
    return img


def _draw_lake(img: Any, rng: random.Random) -> list[float]:
    """A blob of overlapping ellipses near the middle; returns its bounding box."""
    from PIL import Image, ImageDraw

    size = img.width
    mask = Image.new("L", img.size, 0)
    d = ImageDraw.Draw(mask)
    cx, cy = rng.uniform(0.4, 0.6) * size, rng.uniform(0.4, 0.6) * size
    r = rng.uniform(0.08, 0.12) * size
    d.ellipse([cx - r * rng.uniform(0.8, 1.2), cy - r * rng.uniform(0.8, 1.2), cx + r, cy + r], fill=255)
    for _ in range(2):
        ox, oy, rr = rng.uniform(-r, r) * 0.5, rng.uniform(-r, r) * 0.5, r * rng.uniform(0.4, 0.7)
        d.ellipse([cx + ox - rr, cy + oy - rr, cx + ox + rr, cy + oy + rr], fill=255)
    img.paste(Image.new("RGB", img.size, LAKE), (0, 0), mask)
    x1, y1, x2, y2 = mask.getbbox()
    return [float(x1), float(y1), float(x2), float(y2)]


def _beside(lake: Sequence[float], side: str, rng: random.Random, size: int) -> list[float]:
    """A building (`BUILDING_PX`, 5-8 px) 5-10 px beyond the lake's bounding box on `side`, within 6 px of the lake's middle
    line (so its place follows from the lake's, which view 0 shows, up to a few pixels)."""
    s = rng.randint(*BUILDING_PX)
    dx, dy = SIDES[side]
    cx, cy = (lake[0] + lake[2]) / 2, (lake[1] + lake[3]) / 2
    gap = rng.randint(5, 10)
    if dx:
        x = lake[0] - gap - s if dx < 0 else lake[2] + gap
        y = cy + rng.uniform(-6, 6) - s / 2
    else:
        y = lake[1] - gap - s if dy < 0 else lake[3] + gap
        x = cx + rng.uniform(-6, 6) - s / 2
    x, y = round(min(max(x, 2), size - s - 2)), round(min(max(y, 2), size - s - 2))
    return [float(x), float(y), float(x + s), float(y + s)]


def draw_map(rng: random.Random, size: int = MAP_SIZE) -> GeoMap:
    """One map: fields, roads, the lake, the target, a same-colour decoy on another side, other buildings."""
    from PIL import ImageDraw

    img = _draw_background(rng, size)
    lake = _draw_lake(img, rng)
    colour = rng.choice(list(BUILDING_COLOURS))
    side = rng.choice(list(SIDES))
    target = _beside(lake, side, rng, size)
    decoy = _beside(lake, rng.choice([s for s in SIDES if s != side]), rng, size)
    buildings: list[tuple[str, list[float]]] = [(colour, target), (colour, decoy)]
    others = [c for c in BUILDING_COLOURS if c != colour]
    tcx, tcy = (target[0] + target[2]) / 2, (target[1] + target[3]) / 2
    want_near, want = rng.randint(1, 2), rng.randint(4, 6)
    tries = 0
    while len(buildings) < 2 + want and tries < 500:
        tries += 1
        s = rng.randint(*BUILDING_PX)
        if len(buildings) < 2 + want_near:  # near the target: inside the crop that finds it
            ang, dist = rng.uniform(0, 2 * math.pi), rng.uniform(10, 24)
            x, y = tcx + dist * math.cos(ang) - s / 2, tcy + dist * math.sin(ang) - s / 2
        else:
            x, y = rng.uniform(2, size - s - 2), rng.uniform(2, size - s - 2)
        x, y = round(x), round(y)
        box = [float(x), float(y), float(x + s), float(y + s)]
        if x < 2 or y < 2 or x + s > size - 2 or y + s > size - 2:
            continue
        if _overlaps(box, lake, 2) or any(_overlaps(box, b, 3) for _, b in buildings):
            continue
        buildings.append((rng.choice(others), box))
    d = ImageDraw.Draw(img)
    for c, b in buildings:
        d.rectangle([b[0], b[1], b[2] - 1, b[3] - 1], fill=BUILDING_COLOURS[c])
    return GeoMap(image=img, colour=colour, side=side, box=target, lake=lake, buildings=buildings)


def map_row(m: GeoMap, rel: str) -> dict[str, Any]:
    """The grounding row of map `m` saved at `rel` (relative to the JSONL's folder)."""
    return {
        "image": rel,
        "expression": m.expression,
        "boxes": [m.box],
        "coords": "absolute",
        "image_width": m.image.width,
        "image_height": m.image.height,
        "object": f"{m.colour} building",
        "relation": f"{m.side} the lake",
        "landmark": "lake",
    }


def write_dataset(
    folder: str | Path = ASSETS, n_train: int = 192, n_eval: int = 64, seed: int = 10
) -> dict[str, Path]:
    """Write ``images/*.png``, ``train.jsonl`` and ``eval.jsonl`` under `folder`; returns the two JSONL paths.

    Train and eval maps come from disjoint random streams (seeds ``seed`` and ``seed + 1``)."""
    folder = Path(folder)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    out: dict[str, Path] = {}
    for split, n, s in (("train", n_train, seed), ("eval", n_eval, seed + 1)):
        rng = random.Random(s)
        lines = []
        for i in range(n):
            m = draw_map(rng)
            rel = f"images/{split}_{i:03d}.png"
            m.image.save(folder / rel, optimize=True)
            lines.append(json.dumps(map_row(m, rel)))
        path = folder / f"{split}.jsonl"
        path.write_text("\n".join(lines) + "\n")
        out[split] = path
    return out


# ----------------------------------------------------------------------------- model + processor

YES, NO = "yes", "no"
LABEL_SIDES = (48, 52, 56, 60, 64, 68)
"""Sides (original pixels) of the warm start's crops: each reaches the model as 56x56 under `PIXELS`
(``smart_resize`` maps 72 and 96 to 28x28, so those are avoided)."""


def _corpus(rng: random.Random) -> list[str]:
    """Texts the tokenizer is trained on: every prompt, expression, action and reply form."""

    texts = []
    for c in BUILDING_COLOURS:
        for s in SIDES:
            e = f"the small {c} building {s} the lake"
            for p in (ZOOM_PROMPT, BOX_PROMPT, YESNO_PROMPT):
                texts.append(f"{IM_START}user\n{p.format(expression=e)}{IM_END}\n{IM_START}assistant\n")
    for _ in range(200):
        b = ",".join(str(rng.randint(0, 60)) for _ in range(4))
        k = rng.randint(1, 4)
        texts += [f"<crop>[{b}]</crop>", f"<crop view={k - 1}>[{b}]</crop>", f"<answer>[{b}]</answer>"]
        texts.append(f"{IM_START}user\nView {k}:{IM_END}\n{IM_START}assistant\n{YES}{IM_END}{NO}")
    texts.append(REFUSAL.format(reason="too small: 3x4 px, each side must be >= 8 px"))
    texts.append(REFUSAL.format(reason="aspect ratio 5 > 4; unknown view 3; empty after clipping"))
    return texts


def geovis_processor(min_pixels: int = PIXELS, max_pixels: int = PIXELS) -> Any:
    """A `Qwen2VLProcessor` with an in-process BPE (Qwen2-VL's special tokens, digits one token each)."""
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    tokenizer = train_bpe_tokenizer(_corpus(random.Random(0)), vocab_size=420, extra_special=VLM_SPECIALS)
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    return Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(min_pixels=min_pixels, max_pixels=max_pixels),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(min_pixels=min_pixels, max_pixels=max_pixels * 4),
        chat_template=VLM_CHAT_TEMPLATE,
    )


def geovis_vlm(
    tokenizer: Any,
    *,
    hidden: int = 128,
    layers: int = 3,
    vision_dim: int = 64,
    vision_depth: int = 2,
    vision_mlp_ratio: int = 2,
    rope_theta: float = 3.0,
) -> torch.nn.Module:
    """A tiny Qwen2-VL (about 1M parameters): `layers` text layers of width `hidden` (4 heads), a vision
    tower of `vision_depth` blocks of width `vision_dim`; the same token ids as `mmalign.tiny.vlm.tiny_vlm`."""
    ids = special_token_ids(tokenizer)
    half = hidden // 4 // 2  # head_dim / 2 rotary pairs, split over (t, h, w), highest frequencies first
    section = [half - 2 * (7 * half // 16), 7 * half // 16, 7 * half // 16]
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta, "mrope_section": section},
        eos_token_id=ids[IM_END],
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    vision = dict(
        depth=vision_depth,
        embed_dim=vision_dim,
        hidden_size=hidden,
        num_heads=4,
        mlp_ratio=vision_mlp_ratio,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
    )
    return qwen2_vl_model(tokenizer, text, vision)


@BUILDERS.register("geovis_random", minutes=0.05)
def build_geovis_random(path: Path, seed: int = 0) -> None:
    """The GeoViS processor and tiny Qwen2-VL with random weights (instant; tests of shapes and plumbing)."""
    torch.manual_seed(seed)
    processor = geovis_processor()
    geovis_vlm(processor.tokenizer).save_pretrained(path)
    processor.save_pretrained(path)
    (path / "mmalign_tiny.json").write_text(json.dumps({"builder": "geovis_random", "seed": seed}))


# ----------------------------------------------------------------------------- rendering


def user_message(text: str, num_images: int) -> dict[str, Any]:
    """A user message as `VLMPolicy` writes one: its image parts first, then the text."""
    return {
        "role": "user",
        "content": [*({"type": "image"} for _ in range(num_images)), {"type": "text", "text": text}],
    }


def render_conversation(
    processor: Any, messages: list[dict[str, Any]], images: Sequence[Any]
) -> dict[str, Any]:
    """One training sequence: `messages` (user / assistant, ending with an assistant turn) rendered by the
    processor's chat template, cut after the last assistant turn's ``<|im_end|>`` (the policy's EOS),
    encoded with `images` (PIL, in order).

    Returns ``input_ids`` / ``mm_token_type_ids`` / ``labels`` (Long[L]; labels = the ids on every
    assistant turn's tokens up to and including its ``<|im_end|>``, -100 elsewhere: the loss covers the
    assistant turns only), ``pixel_values`` and ``image_grid_thw``."""
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    text = text[: text.rindex(IM_END) + len(IM_END)]
    enc = processor(text=[text], images=list(images) or None, return_tensors="pt")
    ids = enc["input_ids"][0]
    tok = processor.tokenizer
    im_start, im_end = tok.convert_tokens_to_ids(IM_START), tok.convert_tokens_to_ids(IM_END)
    header = tok("assistant\n", add_special_tokens=False)["input_ids"]
    labels = torch.full_like(ids, -100)
    seq = ids.tolist()
    n_assistant = 0
    for p, t in enumerate(seq):
        if t != im_start or seq[p + 1 : p + 1 + len(header)] != header:
            continue
        start = p + 1 + len(header)
        end = seq.index(im_end, start) + 1
        labels[start:end] = ids[start:end]
        n_assistant += 1
    expected = sum(m["role"] == "assistant" for m in messages)
    if n_assistant != expected:
        raise RuntimeError(f"render_conversation: found {n_assistant} assistant turns, expected {expected}")
    out = {
        "input_ids": ids,
        "mm_token_type_ids": enc["mm_token_type_ids"][0]
        if "mm_token_type_ids" in enc
        else torch.zeros_like(ids),
        "labels": labels,
        "pixel_values": enc.get("pixel_values"),
        "image_grid_thw": enc.get("image_grid_thw"),
    }
    return out


def box_text(box: Sequence[float], tag: str, view: int | None = None) -> str:
    """``<tag>[x1,y1,x2,y2]</tag>`` with whole numbers (``<crop view=K>`` when `view` is given)."""
    inner = ",".join(str(int(round(v))) for v in box)
    opening = f"<{tag}>" if view is None else f"<{tag} view={view}>"
    return f"{opening}[{inner}]</{tag}>"


def zoom_messages(expression: str, crop: str, inserted: str, answer: str) -> list[dict[str, Any]]:
    """The GeoViS 2-turn conversation: ZOOM_PROMPT + view 0, the crop turn, the inserted view, the answer."""

    return [
        user_message(ZOOM_PROMPT.format(expression=expression), 1),
        {"role": "assistant", "content": crop},
        user_message(inserted, 1),
        {"role": "assistant", "content": answer},
    ]


# ----------------------------------------------------------------------------- warm-start examples


def _map_row(m: GeoMap) -> dict[str, Any]:
    return {"images": [m.image], "image_width": m.image.width, "image_height": m.image.height}


def _label_crop(m: GeoMap, rng: random.Random, root: Any, noise: float) -> list[int]:
    """A square crop request in view 0's resized pixels around the target (centre + Gaussian `noise`
    original pixels), shifted inside the view, redrawn until its region holds the whole target."""
    sx, sy = root.resized[0] / root.size[0], root.resized[1] / root.size[1]
    cx, cy = (m.box[0] + m.box[2]) / 2, (m.box[1] + m.box[3]) / 2
    for _ in range(100):
        side = rng.choice(LABEL_SIDES)
        w, h = round(side * sx), round(side * sy)
        x1 = round((cx + rng.gauss(0, noise)) * sx - w / 2)
        y1 = round((cy + rng.gauss(0, noise)) * sy - h / 2)
        x1, y1 = min(max(x1, 0), root.resized[0] - w), min(max(y1, 0), root.resized[1] - h)
        gx1, gy1, gx2, gy2 = x1 / sx, y1 / sy, (x1 + w) / sx, (y1 + h) / sy
        if gx1 <= m.box[0] and gy1 <= m.box[1] and gx2 >= m.box[2] and gy2 >= m.box[3]:
            return [x1, y1, x1 + w, y1 + h]
    raise RuntimeError("could not place a crop around the target")


def _answer_box(box: Sequence[float], view: Any, rng: random.Random, jitter: float) -> list[int]:

    b = [v + rng.gauss(0, jitter) for v in global_to_view(box, view, "resized")]
    x1, y1, x2, y2 = (round(v) for v in b)
    return [x1, y1, max(x2, x1 + 1), max(y2, y1 + 1)]


def zoom_example(
    processor: Any, m: GeoMap, rng: random.Random, env: Any, *, noise: float = 6.0, jitter: float = 0.5
) -> dict[str, Any]:
    """(a) The 2-turn zoom conversation of map `m`, rendered (`render_conversation`): the crop turn is a
    coarse square around the target (`_label_crop`), the environment `env` (a `ZoomEnvironment`) opens it
    exactly as in a rollout, the answer is the target box in the crop's resized pixels, jittered."""

    row = _map_row(m)
    state: dict[str, Any] = {}
    root = View.from_dict(env.ensure_views(state, row)[0])
    crop = box_text(_label_crop(m, rng, root, noise), "crop")
    inserted = env.step(state, row, 0, crop)
    view = View.from_dict(state["views"][-1])
    answer = box_text(_answer_box(m.box, view, rng, jitter), "answer")
    messages = zoom_messages(m.expression, crop, inserted.text, answer)
    return render_conversation(processor, messages, [m.image, *inserted.images])


def _random_region(
    m: GeoMap, rng: random.Random, contains: bool, size: int
) -> tuple[float, float, float, float]:
    """A crop region (original pixels, whole) that holds the whole target (`contains`) or none of it."""
    for _ in range(200):
        w = rng.randint(40, 112)
        h = min(max(round(w * rng.uniform(0.8, 1.25)), 40), size)
        if contains:
            x1 = rng.randint(max(0, int(m.box[2]) - w), min(size - w, int(m.box[0])))
            y1 = rng.randint(max(0, int(m.box[3]) - h), min(size - h, int(m.box[1])))
        else:
            x1, y1 = rng.randint(0, size - w), rng.randint(0, size - h)
        region = (float(x1), float(y1), float(x1 + w), float(y1 + h))
        inside = not (
            region[2] <= m.box[0] or m.box[2] <= region[0] or region[3] <= m.box[1] or m.box[3] <= region[1]
        )
        if inside == contains:
            return region
    raise RuntimeError("could not place a crop region")


def _centred_region(m: GeoMap, rng: random.Random, noise: float) -> tuple[float, float, float, float]:
    """The original-pixel region of a `_label_crop` (a square around the target, as the zoom turn asks)."""

    root = View.root(m.image.size, PIXELS, PIXELS)
    x1, y1, x2, y2 = _label_crop(m, rng, root, noise)
    sx, sy = root.resized[0] / root.size[0], root.resized[1] / root.size[1]
    return (x1 / sx, y1 / sy, x2 / sx, y2 / sy)


def box_example(
    processor: Any,
    m: GeoMap,
    rng: random.Random,
    *,
    full: float = 0.2,
    centred: float = 0.6,
    noise: float = 6.0,
) -> dict[str, Any]:
    """(b) ``BOX_PROMPT`` on an image holding the target -> the box in that image's resized pixels. The image
    is the whole map (probability `full`), a square around the target as a zoom turn would ask for
    (`centred`, centre noise `noise` original pixels), else a random crop of 40-112 px holding the target."""

    size = m.image.width
    u = rng.random()
    if u < full:
        region = (0.0, 0.0, float(size), float(size))
    elif u < full + centred:
        region = _centred_region(m, rng, noise)
    else:
        region = _random_region(m, rng, True, size)
    view = make_view(
        region, view_id=1, parent=0, image_size=m.image.size, min_pixels=PIXELS, max_pixels=PIXELS
    )
    answer = box_text(_answer_box(m.box, view, rng, 0.0), "answer")
    messages = [
        user_message(BOX_PROMPT.format(expression=m.expression), 1),
        {"role": "assistant", "content": answer},
    ]
    return render_conversation(processor, messages, [crop_image(m.image, view.region)])


def yesno_example(processor: Any, m: GeoMap, rng: random.Random) -> dict[str, Any]:
    """(c) ``YESNO_PROMPT`` on a crop with (half the time) or without the target -> ``yes`` / ``no``."""

    yes = rng.random() < 0.5
    region = _random_region(m, rng, yes, m.image.width)
    messages = [
        user_message(YESNO_PROMPT.format(expression=m.expression), 1),
        {"role": "assistant", "content": YES if yes else NO},
    ]
    return render_conversation(processor, messages, [crop_image(m.image, region)])


def collate(examples: list[dict[str, Any]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded model inputs (labels -100 on padding) with the vision tensors concatenated."""
    width = max(e["input_ids"].shape[0] for e in examples)
    n = len(examples)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    labels = torch.full((n, width), -100, dtype=torch.long)
    att = torch.zeros((n, width), dtype=torch.long)
    types = torch.zeros((n, width), dtype=torch.long)
    for i, e in enumerate(examples):
        k = e["input_ids"].shape[0]
        ids[i, :k], labels[i, :k], types[i, :k] = e["input_ids"], e["labels"], e["mm_token_type_ids"]
        att[i, :k] = 1
    return {
        "input_ids": ids,
        "attention_mask": att,
        "labels": labels,
        "mm_token_type_ids": types,
        "pixel_values": torch.cat([e["pixel_values"] for e in examples]),
        "image_grid_thw": torch.cat([e["image_grid_thw"] for e in examples]),
    }


@BUILDERS.register("geovis", minutes=6, phases=1)
def build_geovis(
    path: Path,
    steps: int = 700,
    batch_size: int = 24,
    lr: float = 3e-3,
    num_maps: int = 2000,
    mix: tuple[float, float, float] = (0.5, 0.35, 0.15),
    crop_noise: float = 3.0,
    answer_jitter: float = 0.5,
    seed: int = 0,
) -> None:
    """Tiny Qwen2-VL warm-started on the GeoViS protocol over `num_maps` fresh maps (never the eval maps).

    Each step draws `batch_size` examples from the pools (a) zoom conversations, (b) box, (c) yes/no in
    proportions `mix`; the loss is the mean cross-entropy over assistant tokens. `crop_noise` (original
    pixels) and `answer_jitter` (resized pixels) keep the warm policy imprecise, so RL has work to do."""

    torch.manual_seed(seed)
    rng = random.Random(seed)
    processor = geovis_processor()
    tok = processor.tokenizer
    model = geovis_vlm(tok)
    env = ZoomEnvironment(convention="resized", min_pixels=PIXELS, max_pixels=PIXELS)
    map_rng = random.Random(seed + 12345)  # a stream disjoint from write_dataset's seeds
    maps = [draw_map(map_rng) for _ in range(num_maps)]
    n = [round(num_maps * 2 * f) for f in mix]  # about two examples per map
    pools = [
        [
            zoom_example(processor, maps[i % num_maps], rng, env, noise=crop_noise, jitter=answer_jitter)
            for i in range(n[0])
        ],
        [box_example(processor, maps[i % num_maps], rng, noise=crop_noise) for i in range(n[1])],
        [yesno_example(processor, maps[i % num_maps], rng) for i in range(n[2])],
    ]
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    losses: list[float] = []
    for _ in progress_bar(range(steps), "GeoViS warm start"):
        kinds = rng.choices(range(3), weights=mix, k=batch_size)
        batch = collate([rng.choice(pools[k]) for k in kinds], tok.pad_token_id)
        loss = model(**batch).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss))
    model.eval()
    model.save_pretrained(path)
    processor.save_pretrained(path)
    meta = {
        "builder": "geovis",
        "steps": steps,
        "batch_size": batch_size,
        "lr": lr,
        "num_maps": num_maps,
        "mix": list(mix),
        "crop_noise": crop_noise,
        "answer_jitter": answer_jitter,
        "seed": seed,
        "final_loss": sum(losses[-50:]) / max(1, len(losses[-50:])),
        "min_pixels": PIXELS,
        "max_pixels": PIXELS,
    }
    (path / "mmalign_tiny.json").write_text(json.dumps(meta))


# ----------------------------------------------------------------------------- evaluation


def load_rows(jsonl: str | Path, max_rows: int | None = None) -> list[dict[str, Any]]:
    """The rows of a GeoViS JSONL (as `write_dataset` writes them) with ``images`` = [absolute path]."""
    jsonl = Path(jsonl)
    rows = []
    for line in jsonl.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        row["images"] = [str((jsonl.parent / row.pop("image")).resolve())]
        rows.append(row)
        if max_rows is not None and len(rows) >= max_rows:
            break
    return rows


def evaluate(
    model: str | Path,
    jsonl: str | Path = ASSETS / "eval.jsonl",
    *,
    n_samples: int = 8,
    max_rows: int | None = None,
    temperature: float = 1.0,
    max_turns: int = 3,
    threshold: float = 0.5,
    rows_per_batch: int = 8,
    seed: int = 0,
) -> dict[str, float]:
    """Acc@`threshold` of `model` on `jsonl`: the zoom policy (``ZOOM_PROMPT``, multi_turn with
    `ZoomEnvironment`, at most `max_turns` turns) and one-shot answering (``BOX_PROMPT`` on view 0), each
    sampled `n_samples` times per row at `temperature`. ``*_sampled``: the mean over all samples;
    ``*_best_of_n``: the share of rows with at least one hit. The zoom answers are mapped to original
    pixels by `pipelines.grounding.geovis_env.replay` on the generated turns (the same state the environment kept).
    Also: the mean number of turns, the share of samples with an accepted crop, the share of accepted
    crops that hold the whole target."""
    from mmalign.policies.vlm import VLMPolicy
    from rewards.boxes import iou

    torch.manual_seed(seed)
    rows = load_rows(jsonl, max_rows)
    env_options = {"convention": "resized", "min_pixels": PIXELS, "max_pixels": PIXELS}
    common = dict(temperature=temperature, min_pixels=PIXELS, max_pixels=PIXELS)
    zoom = VLMPolicy.from_pretrained(
        str(model),
        max_new_tokens=24,
        loop="multi_turn",
        loop_kwargs={"max_turns": max_turns},
        environment=ZoomEnvironment(**env_options),
        **common,
    )
    one = VLMPolicy.from_pretrained(str(model), max_new_tokens=24, **common)
    hits: dict[str, list[list[bool]]] = {"zoom": [], "oneshot": []}
    turns_used, crops, kept, accepted = [], 0, 0, 0
    for start in range(0, len(rows), rows_per_batch):
        chunk = rows[start : start + rows_per_batch]
        for name, policy, template in (("zoom", zoom, ZOOM_PROMPT), ("oneshot", one, BOX_PROMPT)):
            batch = [{**r, "prompt": template.format(expression=r["expression"])} for r in chunk]
            ro = policy.rollout(batch, n_samples, compute_logp=False)
            turns = ro.outputs.get("turns") or [[t] for t in ro.outputs["texts"]]
            for i, sample_turns in enumerate(turns):
                row = chunk[i // n_samples]
                state = replay(row, sample_turns, **env_options)
                box = state.get("answer_box")
                hit = box is not None and max(iou(box, b) for b in row["boxes"]) >= threshold
                if i % n_samples == 0:
                    hits[name].append([])
                hits[name][-1].append(bool(hit))
                if name == "zoom":
                    turns_used.append(len(sample_turns))
                    ok = [c for c in state["crops"] if c["accepted"]]
                    crops += bool(ok)
                    for c in ok:
                        region = state["views"][c["view"]]["region"]
                        b = row["boxes"][0]
                        accepted += 1
                        kept += (
                            region[0] <= b[0]
                            and region[1] <= b[1]
                            and region[2] >= b[2]
                            and region[3] >= b[3]
                        )
    out: dict[str, float] = {"rows": float(len(rows)), "n_samples": float(n_samples)}
    for name, h in hits.items():
        out[f"{name}_sampled"] = sum(map(sum, h)) / max(1, sum(map(len, h)))
        out[f"{name}_best_of_n"] = sum(any(x) for x in h) / max(1, len(h))
    out["zoom_turns_mean"] = sum(turns_used) / max(1, len(turns_used))
    out["zoom_crop_rate"] = crops / max(1, len(turns_used))
    out["zoom_crop_keeps_target"] = kept / max(1, accepted)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m mmalign.tiny.geovis [write|eval MODEL]``: rewrite ``assets/geovis`` (default) or print a
    model's Acc@0.5 (zoom vs one-shot, sampled and best-of-n) on the eval split."""
    p = argparse.ArgumentParser(prog="python -m mmalign.tiny.geovis")
    sub = p.add_subparsers(dest="cmd")
    w = sub.add_parser("write", help="write the data set (assets/geovis)")
    w.add_argument("--folder", default=str(ASSETS))
    e = sub.add_parser("eval", help="Acc@0.5 of a model on eval.jsonl")
    e.add_argument("model")
    e.add_argument("--data", default=str(ASSETS / "eval.jsonl"))
    e.add_argument("--n", type=int, default=8)
    e.add_argument("--max-rows", type=int, default=None)
    e.add_argument("--temperature", type=float, default=1.0)
    args = p.parse_args(argv)
    if args.cmd == "eval":
        res = evaluate(
            args.model, args.data, n_samples=args.n, max_rows=args.max_rows, temperature=args.temperature
        )
        print(json.dumps(res, indent=1))
        return 0
    paths = write_dataset(getattr(args, "folder", ASSETS))
    print("\n".join(str(v) for v in paths.values()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
