"""MedLoc: a synthetic lesion-localisation task and a tiny offline Qwen2-VL warm-started on it.

The task stands in for medical visual grounding (MedLoc-R1: GRPO on box rewards with an IoU-threshold
curriculum, `pipelines.grounding.medloc`). Nothing is downloaded and no patient data is involved.

Pictures (`scan`, our design): 64x64 grey chest "scans", either an axial CT slice (a body ellipse on a dark
background, two dark lungs, the heart, a bright vertebra) or a frontal radiograph (dark lung fields with
rib streaks, a bright mediastinum, a vertical gradient), column ``modality``, with smooth multi-octave tissue
texture, a small random pose change and detector grain. Each holds one small low-contrast lesion: an
axis-aligned soft-edged ellipse of 8-18 px per side, brighter (``polarity`` "bright") or darker ("dark")
than its surroundings by a peak of `CONTRAST` on the 0..1 grey scale (column ``contrast``; the texture's
std is about 0.02), anywhere inside the body. The anatomy matters to the model: the vision tower of
Qwen2-VL has no absolute position embedding (only rotary ones), so the only cue to where an image token lies
is its content. The reference box is the lesion's extent: [x1, y1, x2, y2] integers in pixel EDGES of the
64x64 original; the ellipse is centred in it and its soft rim reaches 0 at its four sides. PNGs are 8-bit
greyscale (a third of RGB's size); the policy loads them with ``convert("RGB")``.

Rows (`write_dataset`) follow the grounding layout of `pipelines.grounding.data`: ``image`` (relative to the
JSONL's folder), ``expression`` ("the bright nodule", "the dark mass", ...), ``boxes`` (one box, absolute
pixels of the original), ``coords`` "absolute", ``image_width`` / ``image_height`` 64, plus ``modality``,
``finding`` ("nodule" if both sides <= `NODULE_MAX` px, else "mass"), ``polarity`` and ``contrast``.
``python -m mmalign.tiny.medloc`` regenerates ``assets/medloc`` (192 train + 64 eval rows, seed 11).

The model's coordinates: the policy's processor resizes every 64x64 picture to 56x56 (``min_pixels =
max_pixels = 3136``: 4x4 patches of 14 px, 2x2 merged image tokens) and the model writes integer pixels of
that 56x56 input, the convention of Qwen2.5-VL (trained on absolute coordinates of its resized input;
"resized", family alias ``qwen2_5_vl`` in `rewards.boxes`). So the tiny config exercises the rescaling the
real Qwen2.5-VL config needs (x_abs = x * 64 / 56 in the rewards), and a config that forgot ``coords``
would score visibly worse. Prompt `PROMPT` (the grounding BOX_PROMPT), answer ``<answer>[x1,y1,x2,y2]</answer>``.

Builder ``medloc`` (`build_medloc`, our design): `medloc_vlm` (a wider language model and a 2-block vision
tower of width 64, about 0.5M parameters) with the tokenizer of `medloc_processor` (`COORD_TOKENS`: one
token per coordinate) trained on fresh pictures (seed ``seed + 1000``): (1) the vision tower alone on an
auxiliary box loss of its merged tokens, (2) the whole model on the exact boxes, (3) on boxes with jittered
corners (`jitter_box`, 3 px), so that sampling at temperature 1 is imprecise: single samples reach IoU >= 0.5
only part of the time (12 % held out), the best of a group of 8 more often (58 %) -- the spread GRPO with
an IoU reward learns from. It takes about 4 minutes on one idle CPU core (localising a small blob from 4
image tokens needs ~1500 optimizer steps; see `build_medloc`).

The jitter sets how much GRPO can gain (issue 36): in 120 steps GRPO turns the sampled boxes into the
model's own best guess (the greedy box) and does not teach it to localise better, so the held-out gain is
bounded by greedy minus sampled mean IoU. With 2 px that gap was 0.49 - 0.33 and GRPO gained 0.07; with 3 px
(held-out, `evaluate`: sampled 0.27, greedy 0.48, best of 8 0.51) and the plain IoU trained on beside the
hit reward (configs/medloc-tiny.yaml) it gains 0.12-0.14 (two seeds).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mmalign.tiny import BUILDERS
from mmalign.tiny.vlm import IM_END, IM_START, save_vlm, tiny_vlm, tiny_vlm_processor
from mmalign.tiny.warm_start import fit

REPO = Path(__file__).resolve().parents[2]
IMAGE_SIZE = 64
"""Side of the original pictures (pixels)."""
RESIZED = 56
"""Side of the picture as the model sees it (the processor's resize with min = max pixels = 56 * 56)."""
PIXELS = RESIZED * RESIZED
PROMPT = "Locate {expression}. Answer with <answer>[x1,y1,x2,y2]</answer>."
MODALITIES = ("CT", "X-ray")
POLARITIES = ("bright", "dark")
MIN_SIDE, MAX_SIDE = 8, 18
"""Lesion box side range (pixels of the 64x64 original)."""
CONTRAST = (0.2, 0.3)
"""Range of the lesion's peak intensity change (0..1 grey scale; the tissue texture's std is about 0.02)."""
NODULE_MAX = 12
"""Largest box side (both sides) still called a "nodule"; bigger lesions are a "mass"."""


def answer_text(box: list[int] | tuple[int, ...]) -> str:
    """The answer the model is trained to write: ``<answer>[x1,y1,x2,y2]</answer>`` (integers)."""
    return "<answer>[" + ",".join(str(int(v)) for v in box) + "]</answer>"


def to_resized(
    box: list[float] | tuple[float, ...], size: int = IMAGE_SIZE, resized: int = RESIZED
) -> list[int]:
    """An absolute box of the `size` x `size` original in integer pixels of the `resized` input
    (x * resized / size, rounded to the nearest integer)."""
    return [int(round(v * resized / size)) for v in box]


# ----------------------------------------------------------------------------- pictures


def _octave_noise(rng: np.random.Generator, size: int, cells: tuple[int, int], amp: float) -> np.ndarray:
    """Gaussian noise on a coarse (cells_y + 1) x (cells_x + 1) grid, bicubically upsampled to size x size."""
    from PIL import Image

    grid = rng.standard_normal((cells[0] + 1, cells[1] + 1)).astype(np.float32)
    up = Image.fromarray(grid, mode="F").resize((size, size), Image.Resampling.BICUBIC)
    return amp * np.asarray(up, dtype=np.float32)


def scan(
    rng: np.random.Generator, size: int = IMAGE_SIZE, contrast: tuple[float, float] = CONTRAST
) -> tuple[np.ndarray, list[int], dict[str, Any]]:
    """One synthetic scan: (uint8 grey picture [size, size], lesion box [x1, y1, x2, y2] in pixel edges
    of the picture, attributes {"modality", "polarity", "finding", "contrast"})."""
    modality = MODALITIES[int(rng.integers(len(MODALITIES)))]
    polarity = POLARITIES[int(rng.integers(len(POLARITIES)))]
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) + 0.5  # pixel centres
    u = rng.uniform(-0.03, 0.03, size=4) * size  # small pose changes of the anatomy

    def blob(cx: float, cy: float, ax: float, ay: float, edge: float = 2.0) -> np.ndarray:
        """A soft-edged ellipse (1 inside, 0 outside, a ramp of `edge` px), sizes as fractions of `size`."""
        rho = np.hypot((xx - cx * size - u[0]) / (ax * size), (yy - cy * size - u[1]) / (ay * size))
        return np.clip((1.0 - rho) * min(ax, ay) * size / edge, 0.0, 1.0)

    texture = _octave_noise(rng, size, (4, 4), 0.018) + _octave_noise(rng, size, (9, 9), 0.01)
    if modality == "CT":  # an axial chest slice: body, two dark lungs, heart, a bright vertebra
        body = blob(0.5, 0.5, 0.46, 0.4)
        lungs = blob(0.3, 0.45, 0.15, 0.24, 3) + blob(0.7, 0.45, 0.15, 0.24, 3)
        img = 0.06 + body * (0.5 + texture - 0.28 * lungs)
        img = img + 0.08 * blob(0.56, 0.55, 0.12, 0.1, 3) + 0.35 * blob(0.5, 0.8, 0.06, 0.06, 1.5)
        margin = 0.16 * size  # keep the lesion inside the body
    else:  # a frontal chest radiograph: dark lung fields, bright mediastinum and diaphragm, ribs
        lungs = blob(0.3, 0.45, 0.17, 0.32, 4) + blob(0.7, 0.45, 0.17, 0.32, 4)
        ribs = 0.035 * np.sin(yy * rng.uniform(0.5, 0.6) + 0.2 * np.abs(xx - size / 2) + rng.uniform(0, 6.3))
        img = 0.62 + 0.1 * (yy / size - 0.5) + texture + lungs * (ribs - 0.22)
        margin = 0.06 * size
    img = img + rng.normal(0.0, 0.012, size=(size, size)).astype(np.float32)  # film / detector grain
    w, h = (int(rng.integers(MIN_SIDE, MAX_SIDE + 1)) for _ in range(2))
    x1 = int(rng.integers(int(margin), int(size - margin - w) + 1))
    y1 = int(rng.integers(int(margin), int(size - margin - h) + 1))
    box = [x1, y1, x1 + w, y1 + h]
    cx, cy = x1 + w / 2, y1 + h / 2
    rho = np.hypot((xx - cx) / (w / 2), (yy - cy) / (h / 2))
    profile = np.clip((1.0 - rho) / 0.45, 0.0, 1.0)  # 1 in the core, a soft rim fading to 0 at the box
    profile = profile * profile * (3 - 2 * profile)  # smoothstep
    peak = float(rng.uniform(*contrast))
    img = img + (1 if polarity == "bright" else -1) * peak * profile
    pixels = np.clip(img * 255.0 + 0.5, 0, 255).astype(np.uint8)
    finding = "nodule" if max(w, h) <= NODULE_MAX else "mass"
    attrs = {"modality": modality, "polarity": polarity, "finding": finding, "contrast": round(peak, 3)}
    return pixels, box, attrs


def expression(attrs: dict[str, Any]) -> str:
    """The referring expression of a lesion: "the bright nodule", "the dark mass", ..."""
    return f"the {attrs['polarity']} {attrs['finding']}"


def scans(
    n: int, seed: int, contrast: tuple[float, float] = CONTRAST
) -> list[tuple[Any, list[int], dict[str, Any]]]:
    """`n` (PIL RGB picture, absolute box, attributes) triples drawn with `seed`."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        pixels, box, attrs = scan(rng, contrast=contrast)
        out.append((Image.fromarray(pixels, mode="L").convert("RGB"), box, attrs))
    return out


def write_dataset(folder: str | Path, n_train: int = 192, n_eval: int = 64, seed: int = 11) -> Path:
    """Write ``images/{train,eval}_NNN.png`` (8-bit grey) and ``train.jsonl`` / ``eval.jsonl`` under
    `folder` in the grounding row layout (see the module docstring); returns the train JSONL's path."""
    from PIL import Image

    folder = Path(folder)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for split, n in (("train", n_train), ("eval", n_eval)):
        lines = []
        for i in range(n):
            pixels, box, attrs = scan(rng)
            rel = f"images/{split}_{i:03d}.png"
            Image.fromarray(pixels, mode="L").save(folder / rel, optimize=True)
            row = {
                "image": rel,
                "expression": expression(attrs),
                "boxes": [box],
                "coords": "absolute",
                "image_width": IMAGE_SIZE,
                "image_height": IMAGE_SIZE,
                **attrs,
            }
            lines.append(json.dumps(row))
        (folder / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    return folder / "train.jsonl"


# ----------------------------------------------------------------------------- model

COORD_TOKENS = [str(i) for i in range(10, 100)]
"""Two-digit numbers added to the tiny tokenizer as whole tokens (our design): the pre-tokenizer splits
digits one by one (as Qwen2's does), so without them every coordinate of 10..56 would take two tokens and
the tiny model would have to learn tens and units separately; one token per coordinate learns much faster."""


def _corpus() -> list[str]:
    texts = []
    for pol in POLARITIES:
        for finding in ("nodule", "mass"):
            prompt = PROMPT.format(expression=f"the {pol} {finding}")
            texts.append(
                f"{IM_START}user\n{prompt}{IM_END}\n{IM_START}assistant\n{answer_text([1, 2, 3, 4])}"
            )
    return texts * 8


def medloc_processor() -> Any:
    """The tiny `Qwen2VLProcessor` (`mmalign.tiny.vlm.tiny_vlm_processor` on the MedLoc prompts, with
    `COORD_TOKENS` added) whose resize bounds are ``min_pixels = max_pixels = 56 * 56``."""
    processor = tiny_vlm_processor(_corpus(), min_pixels=PIXELS, max_pixels=PIXELS)
    processor.tokenizer.add_tokens(COORD_TOKENS)
    return processor


def medloc_vlm(
    tokenizer: Any,
    *,
    hidden_size: int = 96,
    vision_width: int = 64,
    vision_depth: int = 2,
    **text_overrides: Any,
) -> torch.nn.Module:
    """The tiny Qwen2-VL of the medloc builder: `mmalign.tiny.vlm.tiny_vlm` (its tokenizer ids, chat
    conventions and generation settings) with a wider language model (`hidden_size`, head size 16) and a
    vision tower of `vision_depth` blocks of width `vision_width` (``vlm_reasoning``'s has 1 block of width
    32), so the 2x2 merged image tokens can carry where in its 28x28 quadrant a lesion lies."""
    from transformers import Qwen2VLForConditionalGeneration

    text = {
        "hidden_size": hidden_size,
        "intermediate_size": hidden_size * 8 // 3,
        "num_attention_heads": hidden_size // 16,  # head size 16: the M-RoPE sections [2, 3, 3] of tiny_vlm
        **text_overrides,
    }
    base = tiny_vlm(tokenizer, **text)
    config = base.config
    vision = config.vision_config
    vision.embed_dim, vision.depth, vision.num_heads, vision.mlp_ratio = vision_width, vision_depth, 4, 4
    vision.hidden_size = config.text_config.hidden_size
    model = Qwen2VLForConditionalGeneration(config)
    model.generation_config = base.generation_config
    return model


def quadrant(box: list[int] | torch.Tensor, side: int = RESIZED) -> int:
    """Which merged image token (0 top-left, 1 top-right, 2 bottom-left, 3 bottom-right; the order of
    Qwen2-VL's 2x2 patch merging) holds the centre of `box` (pixels of the `side` x `side` input)."""
    cx, cy = (float(box[0]) + float(box[2])) / 2, (float(box[1]) + float(box[3])) / 2
    return int(cy >= side / 2) * 2 + int(cx >= side / 2)


def jitter_box(box: list[int], px: float, rng: random.Random, side: int = RESIZED) -> list[int]:
    """`box` with each of its four coordinates moved by an independent Gaussian offset of standard deviation
    `px` (rounded to whole pixels, clipped to 0..`side`); the box itself when `px` is 0 or the moved box
    is empty (x2 <= x1 or y2 <= y1). The warm start's answer targets in its jittered phase."""
    if px <= 0:
        return list(box)
    moved = [min(max(v + round(rng.gauss(0.0, px)), 0), side) for v in box]
    return moved if moved[2] > moved[0] and moved[3] > moved[1] else list(box)


class _Warmstart:
    """The tensors and helpers of one medloc warm start (see `build_medloc`)."""

    def __init__(self, processor: Any, model: torch.nn.Module, n: int, seed: int, batch_size: int) -> None:
        import torch.nn.functional as F

        self.F = F
        self.processor, self.model, self.batch_size = processor, model, batch_size
        self.tok = tok = processor.tokenizer
        self.rng = random.Random(seed)
        data = scans(n, seed=seed + 1000)
        prompts = [
            tok.apply_chat_template(
                [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image"},
                            {"type": "text", "text": PROMPT.format(expression=expression(a))},
                        ],
                    }
                ],
                tokenize=False,
                add_generation_prompt=True,
            )
            for _, _, a in data
        ]
        tok.padding_side = "left"
        self.enc = processor(images=[d[0] for d in data], text=prompts, return_tensors="pt", padding=True)
        self.n, self.n_prompt = n, self.enc["input_ids"].shape[1]
        self.pixels = self.enc["pixel_values"].view(n, -1, self.enc["pixel_values"].shape[-1])
        self.boxes = torch.tensor([to_resized(b) for _, b, _ in data], dtype=torch.float)
        self.quadrants = torch.tensor([quadrant(b) for b in self.boxes])
        self.im_end = tok.convert_tokens_to_ids(IM_END)
        self.answer_len = len(tok(answer_text([1, 2, 3, 4]))["input_ids"]) + 1
        self.positions = self._positions()
        hidden = model.config.text_config.hidden_size
        self.head = torch.nn.Linear(hidden, 5)  # per image token: lesion-centre logit, box / 56 (discarded)
        self.features: list[torch.Tensor] = []
        model.model.visual.register_forward_hook(self._keep)
        proj = model.model.visual.patch_embed.proj
        # The patch embedding is a Conv3d whose kernel is the whole patch: the same map as a matmul, whose
        # backward is several times faster on CPU. Used while training here only; the saved model is unchanged.
        model.model.visual.patch_embed.forward = lambda x: F.linear(
            x.reshape(-1, proj.weight[0].numel()).to(proj.weight.dtype),
            proj.weight.reshape(proj.out_channels, -1),
        )

    def _keep(self, module: Any, args: Any, out: Any) -> None:
        self.features.append(out.pooler_output if hasattr(out, "pooler_output") else out)

    def finish(self) -> None:
        del self.model.model.visual.patch_embed.forward
        self.model.model.visual._forward_hooks.clear()

    def aux_loss(self, idx: torch.Tensor) -> torch.Tensor:
        """Box supervision of the merged image tokens (our design, speeds up the warm start): the token
        holding the lesion's centre is picked out of the 4 (cross-entropy) and regresses the box / 56."""
        f = self.features.pop()
        self.features.clear()
        out = self.head(f.view(len(idx), -1, f.shape[-1]))
        q = self.quadrants[idx]
        reg = self.F.smooth_l1_loss(out[torch.arange(len(idx)), q, 1:], self.boxes[idx] / RESIZED, beta=0.02)
        return self.F.cross_entropy(out[..., 0], q) + 5.0 * reg

    def vision_step(self, size: int) -> torch.Tensor:
        idx = torch.tensor(self.rng.sample(range(self.n), size))
        self.model.model.visual(
            self.pixels[idx].reshape(-1, self.pixels.shape[-1]), grid_thw=self.enc["image_grid_thw"][idx]
        )
        return self.aux_loss(idx)

    def text_step(self, jitter_px: float, aux: float) -> torch.Tensor:
        """The answer loss on a batch (boxes jittered by `jitter_px`), plus `aux` x `aux_loss`."""
        idx = torch.tensor(self.rng.sample(range(self.n), self.batch_size))
        comps = []
        for i in idx.tolist():
            box = [int(v) for v in self.boxes[i].tolist()]
            comps.append(self.answer_ids(jitter_box(box, jitter_px, self.rng)))
        comp = torch.tensor(comps)
        labels = torch.cat(
            [torch.full((len(idx), 1), -100), comp], dim=1
        )  # the logits kept: last prompt + answer
        loss = self.model(
            input_ids=torch.cat([self.enc["input_ids"][idx], comp], dim=1),
            attention_mask=torch.cat([self.enc["attention_mask"][idx], torch.ones_like(comp)], dim=1),
            position_ids=self.positions[:, idx],
            labels=labels,
            logits_to_keep=labels.shape[1],
            mm_token_type_ids=torch.cat([self.enc["mm_token_type_ids"][idx], torch.zeros_like(comp)], dim=1),
            pixel_values=self.pixels[idx].reshape(-1, self.pixels.shape[-1]),
            image_grid_thw=self.enc["image_grid_thw"][idx],
        ).loss
        return loss + aux * self.aux_loss(idx) if aux else loss

    def answer_ids(self, box: list[int]) -> list[int]:
        """The token ids of ``<answer>[x1,y1,x2,y2]</answer><|im_end|>``: `ANSWER_TOKENS` of them for
        every box of 0..99 (`COORD_TOKENS` makes each coordinate one token)."""
        ids = self.tok(answer_text(box))["input_ids"] + [self.im_end]
        if len(ids) != self.answer_len:
            raise AssertionError(f"answer {answer_text(box)!r} has {len(ids)} tokens, not {self.answer_len}")
        return ids

    def _positions(self) -> torch.Tensor:
        """M-RoPE position ids [3, n, prompt + answer] of every sequence, computed once: all answers have the
        same length, so the ids do not depend on the box (the model would recompute them every step)."""
        dummy = torch.tensor([self.answer_ids([1, 2, 3, 4])] * self.n)
        out = []
        for s in range(0, self.n, 256):
            sl = slice(s, s + 256)
            pos, _ = self.model.model.get_rope_index(
                torch.cat([self.enc["input_ids"][sl], dummy[sl]], dim=1),
                mm_token_type_ids=torch.cat(
                    [self.enc["mm_token_type_ids"][sl], torch.zeros_like(dummy[sl])], 1
                ),
                image_grid_thw=self.enc["image_grid_thw"][sl],
                attention_mask=torch.cat([self.enc["attention_mask"][sl], torch.ones_like(dummy[sl])], dim=1),
            )
            out.append(pos)
        return torch.cat(out, dim=1)


def _train(params: list[torch.nn.Parameter], steps: int, lr: float, what: str, loss_fn: Any) -> None:
    """AdamW with a 20-step warm-up and a linear decay to 5 % of `lr`, gradients clipped to 1."""
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * max(0.05, 1.0 - s / max(steps, 1))
    )
    fit(opt, steps, lambda _: loss_fn(), what, sched=sched, clip_norm=1.0)


@BUILDERS.register("medloc", minutes=4, phases=3)
def build_medloc(
    path: Path,
    vision_steps: int = 700,
    exact_steps: int = 800,
    jitter_steps: int = 150,
    jitter_px: float = 3.0,
    aux_weight: float = 1.0,
    seed: int = 0,
    num_images: int = 2048,
    batch_size: int = 16,
) -> None:
    """Tiny Qwen2-VL warm-started to localise the lesion (our design; see the module docstring).

    Three loops over `num_images` fresh pictures (seed ``seed + 1000``; the bundled data set uses 11):
    (1) `vision_steps` of the vision tower alone (64 pictures a step) on an auxiliary box loss of its merged
    image tokens (`_Warmstart.aux_loss`, a throw-away linear head: the token holding the lesion's centre is
    picked out and regresses the box); (2) `exact_steps` of the whole model on the answer
    ``<answer>[x1,y1,x2,y2]</answer>`` with the exact box in 56x56 pixels (plus `aux_weight` x the
    auxiliary loss); (3) `jitter_steps` on boxes whose four corners move by independent Gaussian offsets of
    standard deviation `jitter_px` (56x56 pixels, rounded), so that sampling at temperature 1 is imprecise
    while the greedy box stays close to phase (2)'s: the headroom GRPO turns into IoU (module docstring).
    """
    torch.manual_seed(seed)
    processor = medloc_processor()
    model = medloc_vlm(processor.tokenizer)
    model.train()
    ws = _Warmstart(processor, model, num_images, seed, batch_size)
    vision = list(model.model.visual.parameters()) + list(ws.head.parameters())
    everything = list(model.parameters()) + list(ws.head.parameters())
    _train(vision, vision_steps, 3e-3, "MedLoc warm start, vision tower", lambda: ws.vision_step(64))
    _train(
        everything, exact_steps, 3e-3, "MedLoc warm start, exact boxes", lambda: ws.text_step(0.0, aux_weight)
    )
    _train(
        everything,
        jitter_steps,
        1e-3,
        "MedLoc warm start, jittered boxes",
        lambda: ws.text_step(jitter_px, aux_weight),
    )
    ws.finish()
    model.eval()
    save_vlm(
        path,
        model,
        processor,
        {
            "builder": "medloc",
            "vision_steps": vision_steps,
            "exact_steps": exact_steps,
            "jitter_steps": jitter_steps,
            "jitter_px": jitter_px,
            "aux_weight": aux_weight,
            "seed": seed,
            "num_images": num_images,
            "batch_size": batch_size,
        },
    )


# ----------------------------------------------------------------------------- measuring a model


@torch.no_grad()
def evaluate(
    model_path: str | Path,
    jsonl: str | Path = REPO / "assets" / "medloc" / "eval.jsonl",
    samples: int = 8,
    seed: int = 0,
    batch: int = 16,
) -> dict[str, float]:
    """How a medloc model answers the rows of `jsonl`: `samples` answers per image at temperature 1 (top-k
    and top-p off) and one greedy answer, each parsed with `rewards.boxes.parse_box`, mapped from the 56x56
    input's pixels to the original ("resized" convention, `rewards.boxes.to_absolute`) and scored by IoU with
    the reference box (an unparsable answer scores 0).

    Returns ``parse_rate`` (share of sampled answers with a box), ``acc@0.5`` / ``acc@0.75`` / ``mean_iou``
    over all sampled answers, ``best_of_N_acc@0.5`` / ``best_of_N_mean_iou`` (the best of each image's N
    samples) and ``greedy_acc@0.5`` / ``greedy_mean_iou``."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from rewards.boxes import iou, parse_box, to_absolute

    jsonl = Path(jsonl)
    processor = AutoProcessor.from_pretrained(model_path)
    processor.tokenizer.padding_side = "left"
    model = AutoModelForImageTextToText.from_pretrained(model_path).eval()
    rows = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    torch.manual_seed(seed)
    sampled: list[list[float]] = []
    greedy: list[float] = []
    parsed = 0

    def score(text: str, row: dict[str, Any], size: tuple[int, int]) -> float | None:
        box = parse_box(text)
        if box is None:
            return None
        original = (row["image_width"], row["image_height"])
        return iou(to_absolute(box, "resized", original, size), row["boxes"][0])

    for start in range(0, len(rows), batch):
        chunk = rows[start : start + batch]
        texts = [
            processor.apply_chat_template(
                [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image"},
                            {"type": "text", "text": PROMPT.format(expression=r["expression"])},
                        ],
                    }
                ],
                tokenize=False,
                add_generation_prompt=True,
            )
            for r in chunk
        ]
        images = [Image.open(jsonl.parent / r["image"]).convert("RGB") for r in chunk]
        enc = processor(images=images, text=texts, return_tensors="pt", padding=True)
        sizes = [(int(w) * 14, int(h) * 14) for _, h, w in enc["image_grid_thw"].tolist()]
        n = enc["input_ids"].shape[1]
        out = model.generate(
            **enc,
            max_new_tokens=16,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            num_return_sequences=samples,
        )
        answers = processor.tokenizer.batch_decode(out[:, n:], skip_special_tokens=True)
        out = model.generate(**enc, max_new_tokens=16, do_sample=False)
        best = processor.tokenizer.batch_decode(out[:, n:], skip_special_tokens=True)
        for j, row in enumerate(chunk):
            values = []
            for text in answers[j * samples : (j + 1) * samples]:
                v = score(text, row, sizes[j])
                parsed += v is not None
                values.append(v or 0.0)
            sampled.append(values)
            greedy.append(score(best[j], row, sizes[j]) or 0.0)
    flat = [v for vs in sampled for v in vs]
    tops = [max(vs) for vs in sampled]

    def acc(xs: list[float], t: float) -> float:
        return sum(x >= t for x in xs) / len(xs)

    return {
        "parse_rate": parsed / len(flat),
        "acc@0.5": acc(flat, 0.5),
        "acc@0.75": acc(flat, 0.75),
        "mean_iou": sum(flat) / len(flat),
        f"best_of_{samples}_acc@0.5": acc(tops, 0.5),
        f"best_of_{samples}_mean_iou": sum(tops) / len(tops),
        "greedy_acc@0.5": acc(greedy, 0.5),
        "greedy_mean_iou": sum(greedy) / len(greedy),
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m mmalign.tiny.medloc``: regenerate assets/medloc; ``... eval MODEL [JSONL]``: `action_stats`."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["eval"] and len(args) in (2, 3):
        torch.set_num_threads(1)
        print(json.dumps({k: round(v, 4) for k, v in evaluate(*args[1:]).items()}))
        return 0
    if args:
        print("usage: python -m mmalign.tiny.medloc [eval MODEL [JSONL]]", file=sys.stderr)
        return 2
    print(write_dataset(REPO / "assets" / "medloc"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
