"""The shapes world of instruction-based image editing, and a tiny FLUX.1 Kontext editor warm-started on it.

**The edit world.** A scene is one or two squares of the palette (`mmalign.tiny.world.PALETTE`), of distinct
colours, each in one of the five `SLOTS` (left, right, top, bottom, center: fixed boxes of a quarter of the
image side, disjoint) on a white `SIZE` x `SIZE` image. An edit names the square by its colour:

- ``recolour``: "make the red square blue" (the new colour is not in the scene);
- ``move``: "move the red square to the left" (to a free slot);
- ``remove``: "remove the red square" (two-square scenes only: something is left to caption).

`edit_examples` enumerates every (scene, edit) pair (1580); `split_examples` splits them, seeded, into the
warm start's examples, the RL rows and the held-out rows (the last two never seen by the warm start). Each
example knows its target scene, its edit region (the boxes that change, dilated by `MASK_MARGIN` pixels) and
two captions of the edited square in the tiny CLIP's vocabulary (``"one red square on the left"`` ->
``"one blue square on the left"``), the texts of the ``clip_directional`` reward. `write_image_edit_dataset`
writes ``train.jsonl`` / ``eval.jsonl`` and the scene and mask PNGs their rows name
(``assets/image_edit/make_data.py`` calls it).

**The editor** (builder ``image_edit``, `build_image_edit`): a FLUX.1 Kontext-layout folder at toy size,
every part built from config kwargs and written with ``save_pretrained``:

1. a tiny ``AutoencoderKL`` (one 2x downsample, 4 latent channels) fitted to reconstruct edit-world scenes,
   with ``shift_factor`` / ``scaling_factor`` set to the latents' mean and 1 / std;
2. a ``FluxTransformer2DModel`` (``in_channels`` 16: 2x2-packed latents; 2 double- and 2 single-stream
   blocks of 4 x 16 dims, guidance embedding), the one-layer T5 encoder of `mmalign.tiny.sd3` with a T5
   tokenizer that has one piece per instruction word (`edit_t5_tokenizer`) and a byte-level CLIP text
   encoder, trained together with the rectified-flow loss on the target latents, the source
   latents packed and appended to the sequence with position ids whose first coordinate is 1 (what
   `mmalign.policies.flux_kontext.FluxKontextPolicy` and diffusers' ``FluxKontextPipeline`` run);
3. early stop: from `min_steps` on, every `check_every` steps, `edit_accuracy` of RL rows (not trained on)
   sampled deterministically (Euler, 8 steps) is measured, with `kept_accuracy` (is the square the instruction
   does not name left as it was); training stops once `patience` checks in a row reach `target_accuracy`
   (one lucky check does not stop it), so the editor is promising but imperfect and GRPO has work to do.

The folder (``transformer/ vae/ scheduler/ text_encoder/ tokenizer/ text_encoder_2/ tokenizer_2/``,
``model_index.json`` naming ``FluxKontextPipeline``) loads with `FluxKontextPolicy.from_pretrained` and with
diffusers' ``FluxKontextPipeline.from_pretrained``; ``mmalign_tiny.json`` records the arguments and checks.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mmalign.tiny import BUILDERS
from mmalign.tiny.warm_start import fit

__all__ = [
    "ASSETS",
    "COLOURS",
    "EDIT_KINDS",
    "MASK_MARGIN",
    "SIZE",
    "SLOTS",
    "EditExample",
    "Square",
    "build_image_edit",
    "draw_scene",
    "edit_accuracy",
    "edit_examples",
    "example_row",
    "kept_accuracy",
    "scene_name",
    "slot_box",
    "split_examples",
    "write_image_edit_dataset",
]

SIZE = 32
"""Side of an edit-world image in pixels (the tiny CLIP's input size)."""
COLOURS = ("red", "green", "blue", "yellow")
SLOTS: dict[str, tuple[float, float]] = {
    "left": (1 / 6, 1 / 2),
    "right": (5 / 6, 1 / 2),
    "top": (1 / 2, 1 / 6),
    "bottom": (1 / 2, 5 / 6),
    "center": (1 / 2, 1 / 2),
}
"""Where a square may sit: the centre (x, y) of its box as fractions of the image side."""
SIDE = 0.25
"""A square's side as a fraction of the image side."""
MASK_MARGIN = 1
"""Pixels the edit region extends beyond the boxes that change."""
EDIT_KINDS = ("recolour", "move", "remove")
ASSETS = Path(__file__).resolve().parents[2] / "assets" / "image_edit"
_WHERE = {"left": "on the left", "right": "on the right", "top": "at the top", "bottom": "at the bottom"}
_WHERE["center"] = "in the center"
_TO = {"left": "to the left", "right": "to the right", "top": "to the top", "bottom": "to the bottom"}
_TO["center"] = "to the center"


@dataclass(frozen=True)
class Square:
    """One square of a scene: a palette colour in a slot."""

    colour: str
    slot: str

    def caption(self) -> str:
        """``"one red square on the left"`` (the tiny CLIP's caption of a lone square)."""
        return f"one {self.colour} square {_WHERE[self.slot]}"


def slot_box(slot: str, size: int = SIZE) -> tuple[int, int, int, int]:
    """The pixel box (x0, y0, x1, y1), end exclusive, of a square in `slot` of a `size`-pixel image."""
    if slot not in SLOTS:
        raise ValueError(f"unknown slot {slot!r}; one of {', '.join(SLOTS)}")
    cx, cy = SLOTS[slot]
    half = SIDE * size / 2
    return round(cx * size - half), round(cy * size - half), round(cx * size + half), round(cy * size + half)


def box_fractions(slot: str, size: int = SIZE) -> list[float]:
    """`slot_box` as fractions of the image side (what the data rows store: resolution-free)."""
    return [v / size for v in slot_box(slot, size)]


def draw_scene(squares: Sequence[Square], size: int = SIZE) -> Tensor:
    """Float[3, size, size] in [0, 1]: white with each square's box filled with its palette colour."""
    from mmalign.tiny.world import check_colour

    img = torch.ones(3, size, size)
    for sq in squares:
        x0, y0, x1, y1 = slot_box(sq.slot, size)
        img[:, y0:y1, x0:x1] = torch.tensor(check_colour(sq.colour), dtype=torch.float32).view(3, 1, 1) / 255
    return img


@dataclass(frozen=True)
class EditExample:
    """One edit: the source scene, the instruction and what it should give."""

    source: tuple[Square, ...]
    target: tuple[Square, ...]
    edit: str
    """One of `EDIT_KINDS`."""
    before: Square
    """The square the instruction names, as it is in the source."""
    after: Square | None
    """That square in the target (None: removed)."""
    instruction: str

    def changed_slots(self) -> list[str]:
        """The slots whose pixels change (the edit region)."""
        return sorted({self.before.slot} | ({self.after.slot} if self.after is not None else set()))

    def captions(self) -> tuple[str, str]:
        """(source caption, target caption): the edited square before and after; for a removal the square
        that is left (the tiny CLIP has no words for an empty image or for two squares at once)."""
        if self.after is not None:
            return self.before.caption(), self.after.caption()
        (kept,) = self.target
        return self.before.caption(), kept.caption()

    def mask(self, size: int = SIZE) -> Tensor:
        """Float[size, size]: 1 on the edit region (the changed boxes, dilated by `MASK_MARGIN`)."""
        m = torch.zeros(size, size)
        for slot in self.changed_slots():
            x0, y0, x1, y1 = slot_box(slot, size)
            m[max(0, y0 - MASK_MARGIN) : y1 + MASK_MARGIN, max(0, x0 - MASK_MARGIN) : x1 + MASK_MARGIN] = 1
        return m


def _edits_of(scene: tuple[Square, ...]) -> list[EditExample]:
    used_colours = {s.colour for s in scene}
    used_slots = {s.slot for s in scene}
    out = []
    for sq in scene:
        rest = tuple(s for s in scene if s != sq)
        for c in COLOURS:
            if c not in used_colours:
                new = Square(c, sq.slot)
                text = f"make the {sq.colour} square {c}"
                out.append(EditExample(scene, (*rest, new), "recolour", sq, new, text))
        for slot in SLOTS:
            if slot not in used_slots:
                new = Square(sq.colour, slot)
                text = f"move the {sq.colour} square {_TO[slot]}"
                out.append(EditExample(scene, (*rest, new), "move", sq, new, text))
        if rest:
            out.append(EditExample(scene, rest, "remove", sq, None, f"remove the {sq.colour} square"))
    return out


def edit_examples() -> list[EditExample]:
    """Every (scene, edit) of the world, in a fixed order: 20 one-square scenes (recolour 3, move 4 each) and
    120 two-square scenes (per square: recolour 2, move 3, remove 1); 1580 examples."""
    scenes: list[tuple[Square, ...]] = [(Square(c, s),) for c in COLOURS for s in SLOTS]
    for (s1, s2), (c1, c2) in itertools.product(
        itertools.combinations(SLOTS, 2), itertools.permutations(COLOURS, 2)
    ):
        scenes.append((Square(c1, s1), Square(c2, s2)))
    return [e for scene in scenes for e in _edits_of(scene)]


def split_examples(
    n_train: int = 384, n_eval: int = 16, seed: int = 0
) -> tuple[list[EditExample], list[EditExample], list[EditExample]]:
    """(warm-start examples, RL training examples, held-out examples), disjoint and seeded: after one shuffle,
    the first `n_eval` of each edit kind are held out (``eval.jsonl``), the next `n_train` (whatever their kind,
    so the kinds keep their shares) are the RL rows (``train.jsonl``), and the warm start trains on the rest
    only: RL and evaluation both see edits the warm start never did, and RL sees too many to memorise them."""
    rng = random.Random(seed)
    examples = edit_examples()
    rng.shuffle(examples)
    held: list[EditExample] = []
    for kind in EDIT_KINDS:
        held += [e for e in examples if e.edit == kind][:n_eval]
    chosen = set(held)
    train = [e for e in examples if e not in chosen][:n_train]
    chosen |= set(train)
    return [e for e in examples if e not in chosen], train, held


def scene_name(squares: Sequence[Square]) -> str:
    """A scene's file stem: its squares as ``colour-slot`` in slot order, joined by ``_`` (``red-left_blue-top``)."""
    order = list(SLOTS)
    return "_".join(f"{s.colour}-{s.slot}" for s in sorted(squares, key=lambda s: order.index(s.slot)))


def example_row(example: EditExample) -> dict[str, Any]:
    """The JSONL row of `example`. Its images are named after what they show, so rows share them:
    ``scenes/<scene_name>.png`` (source and target) and ``masks/<changed slots>.png``."""
    src_caption, tgt_caption = example.captions()
    return {
        "prompt": example.instruction,
        "edit": example.edit,
        "source_image": f"scenes/{scene_name(example.source)}.png",
        "target_image": f"scenes/{scene_name(example.target)}.png",
        "edit_mask": f"masks/{'_'.join(example.changed_slots())}.png",
        "edit_bbox": [box_fractions(s) for s in example.changed_slots()],
        "source_caption": src_caption,
        "target_caption": tgt_caption,
        "target_objects": [{"colour": s.colour, "box": box_fractions(s.slot)} for s in example.target],
    }


def write_image_edit_dataset(
    folder: str | Path = ASSETS, n_train: int = 384, n_eval: int = 16, seed: int = 0
) -> dict[str, Path]:
    """Write ``train.jsonl`` (the `n_train` RL examples of `split_examples`) and
    ``eval.jsonl`` (its `n_eval` held-out examples of each kind) under `folder`, with the PNGs their rows name
    (``scenes/``: sources and targets, ``masks/``: edit regions; each written once); returns the JSONL paths."""
    from mmalign.data.media import save_image

    folder = Path(folder)
    _, train, held = split_examples(n_train, n_eval, seed)
    out: dict[str, Path] = {}
    written: set[str] = set()
    for split, examples in (("train", train), ("eval", held)):
        lines = []
        for ex in examples:
            row = example_row(ex)
            images = {
                row["source_image"]: draw_scene(ex.source),
                row["target_image"]: draw_scene(ex.target),
                row["edit_mask"]: ex.mask().expand(3, -1, -1),
            }
            for rel, image in images.items():
                if rel not in written:
                    save_image(image, folder / rel)
                    written.add(rel)
            lines.append(json.dumps(row))
        path = folder / f"{split}.jsonl"
        path.write_text("\n".join(lines) + "\n")
        out[split] = path
    return out


# ============================================================================ the tiny editor
WORDS = tuple("make the square move to remove".split() + list(COLOURS) + list(SLOTS))
"""Whole-word pieces of the editor's T5 tokenizer (every other text falls back to characters)."""


def edit_t5_tokenizer() -> Any:
    """The character T5 tokenizer of `mmalign.tiny.sd3` plus one piece per word of the instructions (`WORDS`,
    with the word-start marker, scored above any split into characters): "make the red square blue" is 5
    tokens and ``</s>``. A `T5TokenizerFast` (Unigram), saved and loaded like the real one."""
    import string

    from transformers import T5TokenizerFast

    chars = list(string.ascii_letters + string.digits + string.punctuation)
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    vocab += [("\u2581" + c, -3.0) for c in chars] + [(c, -4.0) for c in chars]
    vocab += [("\u2581" + w, -1.0) for w in WORDS]
    return T5TokenizerFast(vocab=vocab, extra_ids=0, model_max_length=512)


def edit_accuracy(images: Tensor, examples: Sequence[EditExample], *, strict: bool = True) -> float:
    """Mean ``shapes_edit_accuracy`` (`mmalign.tiny.world_rewards.ShapesEditAccuracy`, default options) of
    edited `images` Float[N,3,H,W] against `examples`' target scenes; with `strict` the share edited exactly right."""
    from mmalign.tiny.world_rewards import ShapesEditAccuracy
    from rewards import RewardBatch

    objects = [example_row(e)["target_objects"] for e in examples]
    batch = RewardBatch(prompts=[e.instruction for e in examples], outputs={"images": images}, columns={})
    batch.columns["target_objects"] = objects
    return float(ShapesEditAccuracy(mode="exact" if strict else "checks")(batch).mean())


def kept_accuracy(images: Tensor, examples: Sequence[EditExample], *, min_fill: float = 0.6) -> float:
    """The share of the squares the instruction does not name (two-square scenes) that edited `images`
    Float[N,3,H,W] keep: at least `min_fill` of their box within 0.25 (RGB distance in [0, 1]) of their colour,
    as ``shapes_edit_accuracy`` checks a square. NaN when no example has such a square."""
    from mmalign.tiny.world import check_colour

    kept, total = 0, 0
    for image, example in zip(images, examples, strict=True):
        for sq in example.source:
            if sq == example.before:
                continue
            size = image.shape[-1]
            x0, y0, x1, y1 = slot_box(sq.slot, size)
            rgb = torch.tensor(check_colour(sq.colour), dtype=image.dtype).view(3, 1, 1) / 255
            close = (image[:, y0:y1, x0:x1] - rgb).norm(dim=0) < 0.25
            kept += int(float(close.float().mean()) >= min_fill)
            total += 1
    return kept / total if total else math.nan


def _fit_vae(
    vae: torch.nn.Module, images: Tensor, *, steps: int, batch_size: int, lr: float, seed: int, progress: bool
) -> float:
    """Fit `vae` to reconstruct `images` ([-1, 1]) from its posterior mean; set ``shift_factor`` /
    ``scaling_factor`` to the latents' mean and 1 / std. Returns the last reconstruction MSE."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(vae.parameters(), lr=lr)
    vae.train()

    def loss_at(_: int) -> Tensor:
        x = images[torch.randint(0, len(images), (batch_size,), generator=g)]
        post = vae.encode(x).latent_dist
        return torch.nn.functional.mse_loss(vae.decode(post.mean).sample, x) + 1e-6 * post.kl().mean()

    losses = fit(opt, steps, loss_at, "VAE", progress=progress, window=1)
    vae.eval().requires_grad_(False)
    with torch.no_grad():
        z = vae.encode(images).latent_dist.mean
    vae.register_to_config(shift_factor=float(z.mean()), scaling_factor=1.0 / max(float(z.std()), 1e-6))
    return losses[-1] if losses else float("nan")


@BUILDERS.register("image_edit", minutes=10, phases=2)
def build_image_edit(
    path: Path,
    *,
    vae_steps: int = 500,
    vae_batch_size: int = 16,
    vae_lr: float = 3e-3,
    steps: int = 2000,
    min_steps: int = 300,
    check_every: int = 50,
    target_accuracy: float | None = 0.45,
    num_checks: int = 16,
    patience: int = 2,
    lr: float = 2e-3,
    batch_size: int = 32,
    num_layers: int = 2,
    num_single_layers: int = 2,
    num_attention_heads: int = 4,
    attention_head_dim: int = 16,
    text_hidden: int = 32,
    max_sequence_length: int = 12,
    guidance: float = 2.5,
    check_steps: int = 8,
    seed: int = 0,
    progress: bool = True,
) -> None:
    """Write the tiny FLUX.1 Kontext editor to `path` (see the module docstring for the phases).

    The warm start trains on the warm-start split of `split_examples` only (never on the RL rows of
    ``train.jsonl`` nor the held-out rows of ``eval.jsonl``); the check set is the first `num_checks` RL rows of
    each kind: the check samples them with `check_steps` Euler steps from seeded noise and stops once the strict
    `edit_accuracy` reaches `target_accuracy` at `patience` checks in a row (null: train all `steps`); each
    check records (step, exact, graded, `kept_accuracy`) in ``mmalign_tiny.json``'s ``checks``. The
    instruction is encoded as the policy encodes it: T5 states padded to `max_sequence_length` tokens (the tiny config's
    ``options.max_sequence_length``), the CLIP pooled output, and the distilled guidance input `guidance`."""
    if patience < 1:
        raise ValueError(
            f"image_edit builder: patience must be >= 1 (checks in a row at the target), got {patience}"
        )
    meta: dict[str, Any] = {
        "builder": "image_edit",
        **{k: v for k, v in locals().items() if k not in ("path", "progress")},
    }
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel

    from mmalign.policies.flow_matching import calculate_mu
    from mmalign.policies.flux import latent_image_ids, pack_latents, unpack_latents
    from mmalign.policies.flux_components import FluxComponents
    from mmalign.policies.flux_kontext import kontext_image_ids, mark_kontext_folder
    from mmalign.tiny.sd3 import clip_byte_tokenizer, tiny_t5_encoder
    from mmalign.tiny.shapes import TOKEN_LENGTH

    torch.manual_seed(seed)
    train, rl_rows, _ = split_examples(seed=seed)
    checks = [e for k in EDIT_KINDS for e in [r for r in rl_rows if r.edit == k][:num_checks]]

    # 1. the VAE, fitted on every scene of the world
    scenes = sorted({e.source for e in edit_examples()} | {e.target for e in edit_examples()}, key=str)
    index = {s: i for i, s in enumerate(scenes)}
    pixels = torch.stack([draw_scene(s) for s in scenes]) * 2 - 1
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 16),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=SIZE,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    meta["vae_mse"] = _fit_vae(
        vae, pixels, steps=vae_steps, batch_size=vae_batch_size, lr=vae_lr, seed=seed, progress=progress
    )
    cfg = vae.config
    with torch.no_grad():
        z_all = (vae.encode(pixels).latent_dist.mode() - cfg.shift_factor) * cfg.scaling_factor

    def decode(z: Tensor) -> Tensor:
        with torch.no_grad():
            return (vae.decode(z / cfg.scaling_factor + cfg.shift_factor).sample / 2 + 0.5).clamp(0, 1)

    # 2. the editor: transformer and both text encoders, rectified flow on Kontext's packed sequence
    tokenizer = clip_byte_tokenizer(TOKEN_LENGTH)
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=text_hidden,
            intermediate_size=2 * text_hidden,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=TOKEN_LENGTH,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )
    tokenizer_2 = edit_t5_tokenizer()
    text_encoder_2 = tiny_t5_encoder(tokenizer_2, text_hidden)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=4 * 4,
        num_layers=num_layers,
        num_single_layers=num_single_layers,
        attention_head_dim=attention_head_dim,
        num_attention_heads=num_attention_heads,
        joint_attention_dim=text_hidden,
        pooled_projection_dim=text_hidden,
        guidance_embeds=True,
        axes_dims_rope=(attention_head_dim - 12, 6, 6),
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )

    def token_ids(texts: list[str]) -> tuple[Tensor, Tensor]:
        clip = tokenizer(
            texts, padding="max_length", max_length=TOKEN_LENGTH, truncation=True, return_tensors="pt"
        )
        t5 = tokenizer_2(
            texts, padding="max_length", max_length=max_sequence_length, truncation=True, return_tensors="pt"
        )
        return clip.input_ids, t5.input_ids

    side = SIZE // 2  # latent side
    n_tokens = (side // 2) ** 2
    img_ids = torch.cat([latent_image_ids(side // 2, side // 2), kontext_image_ids(side // 2, side // 2)])
    txt_ids = torch.zeros(max_sequence_length, 3)

    def velocity(x: Tensor, src: Tensor, sigma: Tensor, clip_ids: Tensor, t5_ids: Tensor) -> Tensor:
        out = transformer(
            hidden_states=torch.cat([pack_latents(x), pack_latents(src)], dim=1),
            timestep=sigma,
            guidance=torch.full((x.shape[0],), guidance),
            pooled_projections=text_encoder(clip_ids).pooler_output,
            encoder_hidden_states=text_encoder_2(t5_ids)[0],
            txt_ids=txt_ids,
            img_ids=img_ids,
            return_dict=False,
        )[0]
        return unpack_latents(out[:, :n_tokens], side, side)

    # the sigmas of the scheduler's dynamic shift for these images: sigma = e^mu t / (e^mu t + 1 - t)
    shift = math.exp(calculate_mu(n_tokens, scheduler.config))

    def shifted(t: Tensor) -> Tensor:
        return shift * t / (1 + (shift - 1) * t)

    @torch.no_grad()
    def sample(src: Tensor, clip_ids: Tensor, t5_ids: Tensor) -> Tensor:
        x = torch.randn(src.shape, generator=torch.Generator().manual_seed(seed))
        base = torch.linspace(1, 1 / check_steps, check_steps)
        sig = torch.cat([shifted(base), torch.zeros(1)])
        for i in range(check_steps):
            x = x + velocity(x, src, sig[i].expand(x.shape[0]), clip_ids, t5_ids) * (sig[i + 1] - sig[i])
        return x

    src_idx = torch.tensor([index[e.source] for e in train])
    tgt_idx = torch.tensor([index[e.target] for e in train])
    clip_ids, t5_ids = token_ids([e.instruction for e in train])
    check_src = z_all[[index[e.source] for e in checks]]
    check_clip, check_t5 = token_ids([e.instruction for e in checks])
    modules = (transformer, text_encoder, text_encoder_2)
    params = [p for m in modules for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    history: list[tuple[int, float, float, float]] = []

    def loss_at(_: int) -> Tensor:
        for m in modules:
            m.train()
        idx = torch.randint(0, len(train), (batch_size,), generator=g)
        x0, src = z_all[tgt_idx[idx]], z_all[src_idx[idx]]
        noise = torch.randn(x0.shape, generator=g)
        sigma = shifted(torch.rand(batch_size, generator=g))
        s = sigma.view(-1, 1, 1, 1)
        v = velocity((1 - s) * x0 + s * noise, src, sigma, clip_ids[idx], t5_ids[idx])
        return torch.nn.functional.mse_loss(v, noise - x0)

    def check(done: int) -> bool:
        if done < min_steps:
            return False
        for m in modules:
            m.eval()
        images = decode(sample(check_src, check_clip, check_t5))
        exact, graded = edit_accuracy(images, checks), edit_accuracy(images, checks, strict=False)
        history.append((done, round(exact, 4), round(graded, 4), round(kept_accuracy(images, checks), 4)))
        recent = [h[1] for h in history[-patience:]]
        return len(recent) == patience and min(recent) >= target_accuracy

    losses = fit(
        opt,
        steps,
        loss_at,
        "editor" + (", may stop early" if target_accuracy is not None else ""),
        clip_norm=1.0,
        stop=None if target_accuracy is None else check,
        check_every=check_every,
        check_at_end=True,
        show=lambda: {"exact": f"{history[-1][1]:.2f}", "kept": f"{history[-1][3]:.2f}"} if history else {},
    )
    done, recent = len(losses), losses[-50:]
    for m in modules:
        m.eval().requires_grad_(False)
    path = Path(path)
    FluxComponents(
        transformer, vae, scheduler, text_encoder, tokenizer, text_encoder_2, tokenizer_2
    ).save_pretrained(path)
    mark_kontext_folder(path)
    meta.update(steps_done=done, final_loss=sum(recent) / max(1, len(recent)), checks=history)
    (path / "mmalign_tiny.json").write_text(json.dumps(meta, indent=2) + "\n")
    if not math.isfinite(meta["final_loss"]):
        raise RuntimeError(f"image editor warm start diverged; see {path / 'mmalign_tiny.json'}")
