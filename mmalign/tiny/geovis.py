"""Tiny synthetic remote-sensing maps for GeoViS-style visual search, and a tiny Qwen2-VL warm-started on them.

`write_dataset` writes the maps as grounding rows; `build_geovis` (builder ``geovis``) warm-starts the
tiny Qwen2-VL (`geovis_vlm`); ``python -m mmalign.tiny.geovis [eval MODEL | probe ...]``.

Details: docs/grounding.md, "mmalign.tiny.geovis".
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

from mmalign.tiny import BUILDERS, train_bpe_tokenizer
from mmalign.tiny.vlm import (
    IM_END,
    IM_START,
    VLM_CHAT_TEMPLATE,
    VLM_SPECIALS,
    qwen2_vl_model,
    special_token_ids,
)
from mmalign.tiny.warm_start import fit
from pipelines.grounding.geovis_env import REFUSAL, ZoomEnvironment, replay
from pipelines.grounding.geovis_views import (
    BOX_PROMPT,
    YESNO_PROMPT,
    ZOOM_PROMPT,
    View,
    ViewPixels,
    global_to_view,
    make_view,
    view_image,
)

MAP_SIZE = 224
"""Side of a map in pixels."""
ROOT_PIXELS = 56 * 56
"""View 0's pixel bounds (min = max): the whole map reaches the model as 56x56."""
CROP_PIXELS = 28 * 28
"""A crop's pixel bounds (min = max): every crop reaches the model as 28x28, ONE merged visual token (see the
module docstring for why not more)."""
VIEW_PIXELS = ViewPixels(root=(ROOT_PIXELS, ROOT_PIXELS), crop=(CROP_PIXELS, CROP_PIXELS))
"""The pixel bounds of this task's views (``options.root_*_pixels`` / ``crop_*_pixels`` of
configs/geovis-tiny.yaml)."""

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


def draw_map(rng: random.Random, size: int = MAP_SIZE, near: tuple[int, int] = (1, 2)) -> GeoMap:
    """One map: fields, roads, the lake, the target, a same-colour decoy on another side, other buildings
    (``near`` = the least and most of them drawn 10-24 px from the target)."""
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
    want_near, want = rng.randint(*near), rng.randint(4, 6)
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
CROP_SIDES: tuple[tuple[int, ...], tuple[int, ...]] = ((36, 40, 44), (18, 20, 22, 24))
"""Sides (original pixels) of the warm start's crop requests: the coarse crop of view 0 (9-11 pixels of the
56x56 view; shown at 28x28, 0.64-0.78x) and the fine crop of the coarse one (shown at 28x28, 1.2-1.6x)."""


def _corpus(rng: random.Random) -> list[str]:
    """Texts the tokenizer is trained on: every prompt, expression, action and reply form."""

    texts = []
    for c in BUILDING_COLOURS:
        for s in SIDES:
            e = f"the small {c} building {s} the lake"
            for p in (ZOOM_PROMPT, BOX_PROMPT, YESNO_PROMPT):
                texts.append(f"{IM_START}user\n{p.format(expression=e)}{IM_END}\n{IM_START}assistant\n")
    for _ in range(200):
        b = ",".join(str(rng.randint(0, 224)) for _ in range(4))
        k = rng.randint(1, 4)
        texts += [f"<crop>[{b}]</crop>", f"<crop view={k - 1}>[{b}]</crop>", f"<answer>[{b}]</answer>"]
        texts.append(f"{IM_START}user\nView {k}:{IM_END}\n{IM_START}assistant\n{YES}{IM_END}{NO}")
    texts.append(REFUSAL.format(reason="too small: 3x4 px, each side must be >= 8 px"))
    texts.append(REFUSAL.format(reason="aspect ratio 5 > 4; unknown view 3; empty after clipping"))
    return texts


def geovis_processor(min_pixels: int | None = None, max_pixels: int | None = None) -> Any:
    """A `Qwen2VLProcessor` with an in-process BPE (Qwen2-VL's special tokens, digits one token each); its
    bounds default to those holding both kinds of view (`VIEW_PIXELS.processor`)."""
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    lo, hi = VIEW_PIXELS.processor
    min_pixels = lo if min_pixels is None else min_pixels
    max_pixels = hi if max_pixels is None else max_pixels

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


def zoom_messages(expression: str, turns: Sequence[str], inserted: Sequence[str]) -> list[dict[str, Any]]:
    """A GeoViS conversation: ZOOM_PROMPT + view 0, then the generated `turns` with the user message the
    environment inserted after each of them but the last (`inserted[k]`, each with its view's image)."""

    if len(inserted) != len(turns) - 1:
        raise ValueError(
            f"zoom_messages: {len(turns)} turns need {len(turns) - 1} insertions, got {len(inserted)}"
        )
    messages = [user_message(ZOOM_PROMPT.format(expression=expression), 1)]
    for k, turn in enumerate(turns):
        messages.append({"role": "assistant", "content": turn})
        if k < len(inserted):
            messages.append(user_message(inserted[k], 1))
    return messages


# ----------------------------------------------------------------------------- warm-start examples


def zoom_environment() -> ZoomEnvironment:
    """The GeoViS crop environment at this task's pixel bounds (`VIEW_PIXELS`)."""
    (rlo, rhi), (clo, chi) = VIEW_PIXELS.root, VIEW_PIXELS.crop
    return ZoomEnvironment(
        convention="resized", min_pixels=rlo, max_pixels=rhi, crop_min_pixels=clo, crop_max_pixels=chi
    )


def _map_row(m: GeoMap) -> dict[str, Any]:
    return {"images": [m.image], "image_width": m.image.width, "image_height": m.image.height}


def _label_crop(m: GeoMap, rng: random.Random, view: View, noise: float, sides: Sequence[int]) -> list[int]:
    """A square crop request in `view`'s resized pixels around the target (side drawn from `sides`, original
    pixels; centre + Gaussian `noise` original pixels), shifted inside the view, redrawn until its region
    holds the whole target."""
    sx, sy = view.resized[0] / view.size[0], view.resized[1] / view.size[1]
    ox, oy = view.region[0], view.region[1]
    cx, cy = (m.box[0] + m.box[2]) / 2, (m.box[1] + m.box[3]) / 2
    for _ in range(200):
        side = rng.choice(sides)
        w, h = min(round(side * sx), view.resized[0]), min(round(side * sy), view.resized[1])
        x1 = round((cx + rng.gauss(0, noise) - ox) * sx - w / 2)
        y1 = round((cy + rng.gauss(0, noise) - oy) * sy - h / 2)
        x1, y1 = min(max(x1, 0), view.resized[0] - w), min(max(y1, 0), view.resized[1] - h)
        gx1, gy1, gx2, gy2 = ox + x1 / sx, oy + y1 / sy, ox + (x1 + w) / sx, oy + (y1 + h) / sy
        if gx1 <= m.box[0] and gy1 <= m.box[1] and gx2 >= m.box[2] and gy2 >= m.box[3]:
            return [x1, y1, x1 + w, y1 + h]
    raise RuntimeError("could not place a crop around the target")


def _answer_box(box: Sequence[float], view: Any, rng: random.Random, jitter: float) -> list[int]:

    b = [v + rng.gauss(0, jitter) for v in global_to_view(box, view, "resized")]
    x1, y1, x2, y2 = (round(v) for v in b)
    return [x1, y1, max(x2, x1 + 1), max(y2, y1 + 1)]


def zoom_example(
    processor: Any,
    m: GeoMap,
    rng: random.Random,
    env: Any,
    *,
    noise: tuple[float, float] = (8.0, 1.5),
    jitter: float = 0.3,
) -> dict[str, Any]:
    """(a) The 3-turn zoom conversation of map `m`, rendered (`render_conversation`): a coarse square crop of
    view 0 around the target (`CROP_SIDES[0]`, centre noise ``noise[0]`` original pixels), a fine square crop
    of that crop (`CROP_SIDES[1]`, noise ``noise[1]``), both opened by the environment `env` (a
    `ZoomEnvironment`) exactly as in a rollout, then the target box in the fine crop's resized pixels
    (Gaussian `jitter` resized pixels)."""

    row = _map_row(m)
    state: dict[str, Any] = {}
    root = View.from_dict(env.ensure_views(state, row)[0])
    turns, inserted, images = [], [], [view_image(m.image, root)]
    for level in range(2):
        view = View.from_dict(state["views"][-1])
        crop = box_text(_label_crop(m, rng, view, noise[level], CROP_SIDES[level]), "crop")
        reply = env.step(state, row, level, crop)
        if len(state["views"]) != level + 2:
            raise RuntimeError(f"the warm start's crop {crop} was refused: {reply.text}")
        turns.append(crop)
        inserted.append(reply.text)
        images.extend(reply.images)
    view = View.from_dict(state["views"][-1])
    turns.append(box_text(_answer_box(m.box, view, rng, jitter), "answer"))
    return render_conversation(processor, zoom_messages(m.expression, turns, inserted), images)


def _random_region(
    m: GeoMap, rng: random.Random, contains: bool, size: int
) -> tuple[float, float, float, float]:
    """A crop region of 16-112 original pixels (whole) that holds the whole target (`contains`) or none of
    it (the tree search's grid cells and everything between them)."""
    for _ in range(200):
        w = rng.randint(16, 112)
        h = min(max(round(w * rng.uniform(0.8, 1.25)), 16), size)
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
    """The original-pixel region of a fine crop (`CROP_SIDES[1]`) around the target, as the zoom's second
    crop asks for it."""

    for _ in range(200):
        side = rng.choice(CROP_SIDES[1])
        cx = (m.box[0] + m.box[2]) / 2 + rng.gauss(0, noise)
        cy = (m.box[1] + m.box[3]) / 2 + rng.gauss(0, noise)
        x1 = min(max(round(cx - side / 2), 0), m.image.width - side)
        y1 = min(max(round(cy - side / 2), 0), m.image.height - side)
        if x1 <= m.box[0] and y1 <= m.box[1] and x1 + side >= m.box[2] and y1 + side >= m.box[3]:
            return (float(x1), float(y1), float(x1 + side), float(y1 + side))
    raise RuntimeError("could not place a fine crop around the target")


def box_example(
    processor: Any,
    m: GeoMap,
    rng: random.Random,
    *,
    full: float = 0.15,
    centred: float = 0.45,
    noise: float = 1.5,
) -> dict[str, Any]:
    """(b) ``BOX_PROMPT`` on an image holding the target -> the box in that image's resized pixels. The image
    is the whole map at the root bounds (probability `full`; one-shot answering), else a crop at the crop
    bounds: a fine square around the target as the zoom's second crop would ask for (`centred`, centre
    noise `noise` original pixels) or a random crop of 16-112 px holding the target (`_random_region`)."""

    size = m.image.width
    u = rng.random()
    if u < full:
        view = VIEW_PIXELS.root_view(m.image.size)
    else:
        region = _centred_region(m, rng, noise) if u < full + centred else _random_region(m, rng, True, size)
        clo, chi = VIEW_PIXELS.crop
        view = make_view(region, view_id=1, parent=0, image_size=m.image.size, min_pixels=clo, max_pixels=chi)
    answer = box_text(_answer_box(m.box, view, rng, 0.0), "answer")
    messages = [
        user_message(BOX_PROMPT.format(expression=m.expression), 1),
        {"role": "assistant", "content": answer},
    ]
    return render_conversation(processor, messages, [view_image(m.image, view)])


def yesno_example(processor: Any, m: GeoMap, rng: random.Random) -> dict[str, Any]:
    """(c) ``YESNO_PROMPT`` on a crop (at the crop bounds) with (half the time) or without the target ->
    ``yes`` / ``no``."""

    yes = rng.random() < 0.5
    region = _random_region(m, rng, yes, m.image.width)
    clo, chi = VIEW_PIXELS.crop
    view = make_view(region, view_id=1, parent=0, image_size=m.image.size, min_pixels=clo, max_pixels=chi)
    messages = [
        user_message(YESNO_PROMPT.format(expression=m.expression), 1),
        {"role": "assistant", "content": YES if yes else NO},
    ]
    return render_conversation(processor, messages, [view_image(m.image, view)])


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


@BUILDERS.register("geovis", minutes=12, phases=1)
def build_geovis(
    path: Path,
    steps: int = 2000,
    batch_size: int = 24,
    lr: float = 3e-3,
    num_maps: int = 4000,
    mix: tuple[float, float, float] = (0.5, 0.35, 0.15),
    crop_noise: tuple[float, float] = (8.0, 1.5),
    answer_jitter: float = 0.3,
    seed: int = 0,
) -> None:
    """Tiny Qwen2-VL warm-started on the GeoViS protocol over `num_maps` fresh maps (never the eval maps).

    Each step draws `batch_size` examples from the pools (a) zoom conversations, (b) box, (c) yes/no in
    proportions `mix`; the loss is the mean cross-entropy over assistant tokens. `crop_noise` (the centre
    noise of the coarse and the fine crop, original pixels) and `answer_jitter` (resized pixels) keep the
    warm policy imprecise, so RL has work to do."""

    torch.manual_seed(seed)
    rng = random.Random(seed)
    processor = geovis_processor()
    tok = processor.tokenizer
    model = geovis_vlm(tok)
    env = zoom_environment()
    map_rng = random.Random(seed + 12345)  # a stream disjoint from write_dataset's seeds
    maps = [draw_map(map_rng) for _ in range(num_maps)]
    n = [round(num_maps * 2 * f) for f in mix]  # about two examples per map
    pools = [
        [
            zoom_example(processor, maps[i % num_maps], rng, env, noise=crop_noise, jitter=answer_jitter)
            for i in range(n[0])
        ],
        [box_example(processor, maps[i % num_maps], rng, noise=crop_noise[1]) for i in range(n[1])],
        [yesno_example(processor, maps[i % num_maps], rng) for i in range(n[2])],
    ]
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )

    def loss_at(_: int) -> torch.Tensor:
        kinds = rng.choices(range(3), weights=mix, k=batch_size)
        return model(**collate([rng.choice(pools[k]) for k in kinds], tok.pad_token_id)).loss

    losses = fit(opt, steps, loss_at, "GeoViS warm start", sched=sched, clip_norm=1.0)
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
        "crop_noise": list(crop_noise),
        "answer_jitter": answer_jitter,
        "seed": seed,
        "final_loss": sum(losses[-50:]) / max(1, len(losses[-50:])),
        "root_pixels": list(VIEW_PIXELS.root),
        "crop_pixels": list(VIEW_PIXELS.crop),
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
    from pipelines.grounding.geovis import GeoViSPolicy
    from rewards.boxes import iou

    torch.manual_seed(seed)
    rows = load_rows(jsonl, max_rows)
    env = zoom_environment()
    env_options = {
        "convention": "resized",
        "min_pixels": VIEW_PIXELS.root[0],
        "max_pixels": VIEW_PIXELS.root[1],
        "crop_min_pixels": VIEW_PIXELS.crop[0],
        "crop_max_pixels": VIEW_PIXELS.crop[1],
    }
    common = dict(temperature=temperature, view_pixels=VIEW_PIXELS)
    zoom = GeoViSPolicy.from_pretrained(
        str(model),
        max_new_tokens=24,
        loop="multi_turn",
        loop_kwargs={"max_turns": max_turns},
        environment=env,
        **common,
    )
    one = GeoViSPolicy.from_pretrained(str(model), max_new_tokens=24, **common)
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


def localisation_probe(
    display: int,
    side: int,
    noise: float,
    steps: int,
    *,
    scene: str = "map",
    hidden: int = 128,
    vision_dim: int = 64,
    layers: int = 3,
    vision_depth: int = 2,
    report_every: int = 100,
) -> list[dict[str, float]]:
    """How fast a fresh tiny GeoViS VLM learns WHERE the target is in one view (the measurement behind the
    tiny config's pixel bounds, docs/grounding.md): ``BOX_PROMPT`` on square crops of `side` original pixels
    around the target (centre + Gaussian `noise` px, redrawn until the crop holds it), shown at `display` x
    `display` pixels; 3000 training crops (maps of seed 777), `steps` steps of 24 at lr 3e-3 (50 warm-up
    steps, cosine), scored greedily every `report_every` steps on 96 held-out crops (seed 999): mean IoU,
    Acc@0.5 and the mean |x error| of the box centre (original pixels, over parsed boxes). `scene`: ``map``
    (the task's maps), ``no_near`` (no buildings drawn near the target) or ``plain`` (the target alone on
    a uniform field). Returns the reports (also printed as JSON lines)."""
    from PIL import Image, ImageDraw

    from pipelines.grounding.geovis_views import view_to_global
    from rewards.boxes import iou, parse_box

    pixels = display * display

    def draw(r: random.Random) -> GeoMap:
        m = draw_map(r, near=(0, 0)) if scene == "no_near" else draw_map(r)
        if scene == "plain":
            m.image = Image.new("RGB", m.image.size, (120, 140, 80))
            b = m.box
            ImageDraw.Draw(m.image).rectangle(
                [b[0], b[1], b[2] - 1, b[3] - 1], fill=BUILDING_COLOURS[m.colour]
            )
        return m

    def example(m: GeoMap, r: random.Random) -> tuple[dict[str, Any], View] | None:
        cx, cy = (m.box[0] + m.box[2]) / 2, (m.box[1] + m.box[3]) / 2
        for _ in range(100):
            x1 = min(max(round(cx + r.gauss(0, noise) - side / 2), 0), MAP_SIZE - side)
            y1 = min(max(round(cy + r.gauss(0, noise) - side / 2), 0), MAP_SIZE - side)
            if x1 <= m.box[0] and y1 <= m.box[1] and x1 + side >= m.box[2] and y1 + side >= m.box[3]:
                v = make_view(
                    (x1, y1, x1 + side, y1 + side),
                    view_id=1,
                    parent=0,
                    image_size=m.image.size,
                    min_pixels=pixels,
                    max_pixels=pixels,
                )
                answer = box_text(_answer_box(m.box, v, r, 0.0), "answer")
                messages = [
                    user_message(BOX_PROMPT.format(expression=m.expression), 1),
                    {"role": "assistant", "content": answer},
                ]
                return render_conversation(processor, messages, [view_image(m.image, v)]), v
        return None

    torch.manual_seed(0)
    rng = random.Random(0)
    lo, hi = ViewPixels(root=(ROOT_PIXELS, ROOT_PIXELS), crop=(pixels, pixels)).processor
    processor = geovis_processor(lo, hi)
    tok = processor.tokenizer
    model = geovis_vlm(tok, hidden=hidden, vision_dim=vision_dim, layers=layers, vision_depth=vision_depth)
    map_rng = random.Random(777)
    pool = [e for e in (example(draw(map_rng), rng) for _ in range(3000)) if e is not None]
    for e, _ in pool:
        e["pixel_values"] = e["pixel_values"].half()  # (half the memory; cast back per batch)
    eval_rng, held = random.Random(999), []
    while len(held) < 96:
        m = draw(eval_rng)
        x = example(m, eval_rng)
        if x:
            held.append((m, x))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )

    @torch.no_grad()
    def score() -> tuple[float, float, float]:
        model.eval()
        ious, errs = [], []
        for m, (e, v) in held:
            n = int((e["labels"] != -100).nonzero()[0])
            ids = e["input_ids"][:n][None]
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                mm_token_type_ids=e["mm_token_type_ids"][:n][None],
                pixel_values=e["pixel_values"].float(),
                image_grid_thw=e["image_grid_thw"],
                max_new_tokens=22,
                do_sample=False,
            )
            b = parse_box(tok.decode(out[0, n:], skip_special_tokens=True))
            if b is None:
                ious.append(0.0)
                continue
            g = view_to_global(b, v, "resized")
            ious.append(iou(g, m.box))
            errs.append(abs((g[0] + g[2]) / 2 - (m.box[0] + m.box[2]) / 2))
        model.train()
        return sum(ious) / len(ious), sum(i >= 0.5 for i in ious) / len(ious), sum(errs) / max(1, len(errs))

    reports = []

    def loss_at(_: int) -> torch.Tensor:
        batch = collate([rng.choice(pool)[0] for _ in range(24)], tok.pad_token_id)
        batch["pixel_values"] = batch["pixel_values"].float()
        return model(**batch).loss

    def report(done: int) -> bool:
        mean_iou, acc, err = score()
        reports.append({"step": done, "iou": mean_iou, "acc@0.5": acc, "x_err_px": err})
        print(json.dumps({"display": display, "side": side, "noise": noise, "scene": scene, **reports[-1]}))
        return False

    model.train()
    fit(
        opt,
        steps,
        loss_at,
        "localisation probe",
        sched=sched,
        clip_norm=1.0,
        stop=report,
        check_every=report_every,
        check_at_end=True,
        progress=False,
    )
    return reports


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m mmalign.tiny.geovis [write|eval MODEL|probe ...]``: rewrite ``assets/geovis`` (default),
    print a model's Acc@0.5 (zoom vs one-shot, sampled and best-of-n) on the eval split, or run
    `localisation_probe`."""
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
    q = sub.add_parser("probe", help="how fast a fresh model learns where the target is in one view")
    q.add_argument("--display", type=int, required=True, help="side (pixels) the crop is shown at")
    q.add_argument("--side", type=int, required=True, help="side of the crop (original pixels)")
    q.add_argument("--noise", type=float, required=True, help="std of the crop centre around the target (px)")
    q.add_argument("--steps", type=int, default=500)
    q.add_argument("--scene", choices=["map", "no_near", "plain"], default="map")
    q.add_argument("--hidden", type=int, default=128)
    q.add_argument("--vision-dim", type=int, default=64)
    q.add_argument("--layers", type=int, default=3)
    q.add_argument("--vision-depth", type=int, default=2)
    args = p.parse_args(argv)
    if args.cmd == "probe":
        localisation_probe(
            args.display,
            args.side,
            args.noise,
            args.steps,
            scene=args.scene,
            hidden=args.hidden,
            vision_dim=args.vision_dim,
            layers=args.layers,
            vision_depth=args.vision_depth,
        )
        return 0
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
