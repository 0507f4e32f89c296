"""A tiny CLIP trained in-process on the synthetic shapes world (tests, the tiny safe-diffusion pipeline).

`build_clip_shapes_tiny(path)` (builder ``clip_shapes_tiny``) writes a `CLIPModel` folder that every CLIP
reward loads with ``from_pretrained`` like a real CLIP id.

Details: docs/architecture.md, "mmalign.tiny.clip".
"""

from __future__ import annotations

import itertools
import json
import math
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mmalign.tiny import BUILDERS
from mmalign.tiny.warm_start import fit

__all__ = [
    "CLIP_COUNTS",
    "CLIP_POSITIONS",
    "build_clip_shapes_tiny",
    "caption_matches",
    "colour_accuracy",
    "heldout_scenes",
    "save_clip_folder",
    "scene_captions",
    "tiny_clip_model",
    "train_tiny_clip",
]

COLOURS = ("red", "green", "blue", "yellow")
CLIP_COUNTS = (1, 2, 3, 4)
CLIP_POSITIONS: tuple[str | None, ...] = ("left", "right", "top", "bottom", "center", None)
TOKEN_LENGTH = 64
OPENAI_MEAN = [0.48145466, 0.4578275, 0.40821073]
OPENAI_STD = [0.26862954, 0.26130258, 0.27577711]

Scene = tuple[str, int, str | None]
Attrs = tuple[str, int | None, str | None]  # what a caption says: colour, count or None, position or None


def _where(position: str | None) -> str:
    from mmalign.tiny.shapes import shapes_caption

    return shapes_caption("red", 1, position)[len("one red square") :].strip()


def scene_captions(colour: str, count: int, position: str | None) -> list[tuple[str, Attrs]]:
    """Captions true of the scene, each with what it asserts ``(colour, count | None, position | None)``.

    The full shapes-world caption (`mmalign.tiny.shapes.shapes_caption`) first, then the count-free,
    position-free and colour-only forms.
    """
    from mmalign.tiny.shapes import shapes_caption

    out: list[tuple[str, Attrs]] = [
        (shapes_caption(colour, count, position), (colour, count, position)),
        (shapes_caption(colour, count, None), (colour, count, None)),
        (colour, (colour, None, None)),
        (f"{colour} squares", (colour, None, None)),
        (f"a {colour} object", (colour, None, None)),
        (f"{colour} objects", (colour, None, None)),
    ]
    if position is not None:
        out.append((f"{colour} squares {_where(position)}", (colour, None, position)))
    if count == 1:
        out.append((f"a {colour} square", (colour, 1, None)))
        if position is not None:
            out.append((f"a {colour} square {_where(position)}", (colour, 1, position)))
    return out


def caption_matches(attrs: Attrs, scene: Scene) -> bool:
    """Whether a caption asserting `attrs` is true of `scene` (None asserts nothing)."""
    colour, count, position = attrs
    return (
        colour == scene[0]
        and (count is None or count == scene[1])
        and (position is None or position == scene[2])
    )


def all_scenes() -> list[Scene]:
    """Every ``(colour, count, position)`` of the world the tiny CLIP knows (96 scenes)."""
    return list(itertools.product(COLOURS, CLIP_COUNTS, CLIP_POSITIONS))


def heldout_scenes(fraction: float = 0.15, seed: int = 0) -> list[Scene]:
    """A seeded `fraction` of `all_scenes()` never shown in training (seeded)."""
    scenes = all_scenes()
    rng = random.Random(seed + 7919)
    order = scenes[:]
    rng.shuffle(order)
    return sorted(order[: round(fraction * len(scenes))], key=scenes.index)


def _augment(images: Tensor, g: torch.Generator, shift: int = 2) -> Tensor:
    """Random shift (white padding) of up to `shift` px, brightness jitter and pixel noise."""
    b, _, h, w = images.shape
    padded = torch.nn.functional.pad(images, (shift, shift, shift, shift), value=1.0)
    dx = torch.randint(0, 2 * shift + 1, (b,), generator=g)
    dy = torch.randint(0, 2 * shift + 1, (b,), generator=g)
    out = torch.stack([padded[i, :, dy[i] : dy[i] + h, dx[i] : dx[i] + w] for i in range(b)])
    out = out * (0.9 + 0.2 * torch.rand(b, 1, 1, 1, generator=g))
    out = out + torch.randn(out.shape, generator=g) * (0.06 * torch.rand(b, 1, 1, 1, generator=g))
    return out.clamp(0, 1)


def tiny_clip_model(
    *, patch_size: int = 8, hidden: int = 64, layers: int = 2, projection_dim: int = 32, seed: int = 0
) -> tuple[Any, Any]:
    """A randomly initialised tiny `CLIPModel` (32 px images, byte-level text) and its `CLIPTokenizer`."""
    from transformers import CLIPConfig, CLIPModel

    from mmalign.tiny.sd3 import clip_byte_tokenizer

    tok = clip_byte_tokenizer(max_length=TOKEN_LENGTH)
    torch.manual_seed(seed)
    config = CLIPConfig(
        text_config=dict(
            vocab_size=len(tok),
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=4,
            max_position_embeddings=TOKEN_LENGTH,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        ),
        vision_config=dict(
            image_size=32,
            patch_size=patch_size,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=4,
        ),
        projection_dim=projection_dim,
    )
    return CLIPModel(config), tok


def train_tiny_clip(
    *,
    steps: int = 600,
    batch_size: int = 64,
    lr: float = 1e-3,
    logit_scale: float | None = 100.0,
    patch_size: int = 8,
    hidden: int = 64,
    layers: int = 2,
    projection_dim: int = 32,
    heldout: Sequence[Scene] | None = None,
    full_caption_prob: float = 0.6,
    same_colour_frac: float = 0.5,
    threads: int | None = 1,
    seed: int = 0,
    progress: bool | None = None,
) -> tuple[Any, Any, dict[str, Any]]:
    """Train a tiny `CLIPModel` on the shapes world; returns ``(model, tokenizer, info)``.

    `heldout` scenes (default `heldout_scenes()`) are never shown. Each step draws `batch_size` scenes
    (`same_colour_frac` of them of one colour: hard negatives that only count and position tell
    apart), augments them and pairs each with one of its `scene_captions` (the full caption with
    probability `full_caption_prob`, otherwise one of the others uniformly). The loss is the symmetric
    contrastive loss with every true (image, caption) pair of the batch a positive (soft targets).

    Details: docs/architecture.md, "mmalign.tiny.clip.train_tiny_clip".
    """
    from mmalign.tiny.world import render_scene

    t0 = time.perf_counter()
    heldout = [tuple(s) for s in (heldout_scenes() if heldout is None else heldout)]
    train = [s for s in all_scenes() if s not in heldout]
    model, tok = tiny_clip_model(
        patch_size=patch_size, hidden=hidden, layers=layers, projection_dim=projection_dim, seed=seed
    )
    if logit_scale is not None:
        with torch.no_grad():
            model.logit_scale.fill_(math.log(logit_scale))
        model.logit_scale.requires_grad_(False)
    images = torch.stack([render_scene(c, k, p, size=32) for c, k, p in train])  # type: ignore[misc]
    mean = torch.tensor(OPENAI_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(OPENAI_STD).view(1, 3, 1, 1)
    caps = [scene_captions(*s) for s in train]
    texts = sorted({t for cs in caps for t, _ in cs})  # every caption once, tokenized once
    text_index = {t: i for i, t in enumerate(texts)}
    attrs_of: dict[str, Attrs] = {t: a for cs in caps for t, a in cs}
    enc = tok(texts, padding=True, return_tensors="pt")
    ids_all, att_all = enc["input_ids"], enc["attention_mask"]
    by_colour = {c: [i for i, s in enumerate(train) if s[0] == c] for c in COLOURS}
    n_same = round(same_colour_frac * batch_size)

    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.01},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},  # biases, norms
        ],
        lr=lr,
    )
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)

    def loss_at(_: int) -> torch.Tensor:
        same = by_colour[COLOURS[int(torch.randint(0, len(COLOURS), (1,), generator=g))]]
        idx = [same[int(j)] for j in torch.randint(0, len(same), (n_same,), generator=g)]
        idx += torch.randint(0, len(train), (batch_size - n_same,), generator=g).tolist()
        chosen = [
            caps[i][0][0] if rng.random() < full_caption_prob else rng.choice(caps[i][1:])[0] for i in idx
        ]
        tid = torch.tensor([text_index[t] for t in chosen])
        width = int(att_all[tid].sum(1).max())  # right padding: cut the batch to its longest caption
        pos = torch.tensor(  # pos[i, j]: caption j is true of image i
            [[caption_matches(attrs_of[t], train[i]) for t in chosen] for i in idx], dtype=torch.float32
        )
        x = (_augment(images[idx], g) - mean) / std
        out = model(input_ids=ids_all[tid, :width], attention_mask=att_all[tid, :width], pixel_values=x)
        logits = out.logits_per_image  # [images, texts]
        loss_i = -(pos / pos.sum(1, keepdim=True) * logits.log_softmax(1)).sum(1).mean()
        loss_t = -(pos.T / pos.T.sum(1, keepdim=True) * logits.T.log_softmax(1)).sum(1).mean()
        return (loss_i + loss_t) / 2

    model.train()
    loss, curve = float("nan"), []
    prev_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        losses = fit(
            opt, steps, loss_at, "CLIP on the shapes world", sched=sched, progress=progress, window=1
        )
        curve = [round(v, 4) for i, v in enumerate(losses) if i % 25 == 0 or i == steps - 1]
        loss = losses[-1] if losses else loss
    finally:
        torch.set_num_threads(prev_threads)
    model.eval()
    info = {
        "loss": loss,
        "loss_curve": curve,
        "seconds": round(time.perf_counter() - t0, 2),
        "heldout": [list(s) for s in heldout],
        "steps": steps,
        "seed": seed,
    }
    return model, tok, info


def save_clip_folder(model: Any, tokenizer: Any, path: str | Path) -> Path:
    """Write `model`, `tokenizer` and a `CLIPImageProcessor` (32 px, OpenAI mean / std) to the folder `path`,
    loadable by ``CLIPModel.from_pretrained`` / `rewards.image.CLIPEmbedder` like a real CLIP id."""
    from transformers import CLIPImageProcessor

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    size = model.config.vision_config.image_size
    CLIPImageProcessor(
        size={"shortest_edge": size},
        crop_size={"height": size, "width": size},
        image_mean=OPENAI_MEAN,
        image_std=OPENAI_STD,
    ).save_pretrained(path)
    return path


def build_clip_shapes_tiny(path: str | Path, **train_kwargs: Any) -> Path:
    """Train the tiny shapes-world CLIP (`train_tiny_clip(**train_kwargs)`) and save it at `path`.

    The folder holds ``config.json`` + weights (`CLIPModel.save_pretrained`), the tokenizer files,
    ``preprocessor_config.json`` (`save_clip_folder`) and ``mmalign_tiny.json`` (the builder, its
    options, the loss curve, the wall time and the held-out scenes).
    """
    model, tok, info = train_tiny_clip(**train_kwargs)
    path = save_clip_folder(model, tok, path)
    meta = {"builder": "clip_shapes_tiny", "options": dict(train_kwargs), **info}
    (path / "mmalign_tiny.json").write_text(json.dumps(meta, indent=1, default=str))
    return path


@BUILDERS.register("clip_shapes_tiny", minutes=1.5, phases=1)
def _build_registered(path: Path) -> None:
    build_clip_shapes_tiny(path)


def colour_accuracy(
    clip: Any, scenes: Sequence[Scene], *, size: int = 32, full_captions: bool = True
) -> float:
    """Share of `scenes` whose true colour's caption ranks first among the 4 colours' captions.

    `clip` is a `rewards.image.CLIPEmbedder` (or a path to load one from). The candidates are the
    scene's full caption with each colour (``full_captions``) or ``"a <colour> square"``.
    """
    from mmalign.tiny.shapes import shapes_caption
    from mmalign.tiny.world import render_scene
    from rewards.image import CLIPEmbedder

    if not isinstance(clip, CLIPEmbedder):
        clip = CLIPEmbedder(clip)
    if not scenes:
        raise ValueError("colour_accuracy needs at least one scene")
    images = torch.stack([render_scene(c, k, p, size=size) for c, k, p in scenes])  # type: ignore[misc]
    zi = clip.encode_images(images)
    candidates = [
        [shapes_caption(c, count, position) if full_captions else f"a {c} square" for c in COLOURS]
        for _, count, position in scenes
    ]
    unique = sorted({t for ts in candidates for t in ts})
    zt = dict(zip(unique, clip.encode_texts(unique), strict=True))
    hits = 0
    for i, (colour, _, _) in enumerate(scenes):
        sims = torch.stack([zt[t] for t in candidates[i]]) @ zi[i]
        hits += int(COLOURS[int(sims.argmax())] == colour)
    return hits / len(scenes)
