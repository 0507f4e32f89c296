"""The synthetic shapes world used by the offline (tiny) image pipelines, tests and benchmarks, and the
tiny diffusion models warm-started on it.

Prompts and scenes (`shapes_rows`, `shapes_images`), the warm-start helpers (`train_vae_on_shapes`,
`train_denoiser`) and the builders ``text_to_image`` and ``safe_diffusion``.

Details: docs/architecture.md, "mmalign.tiny.shapes".
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mmalign.tiny import BUILDERS
from mmalign.tiny.warm_start import fit

__all__ = [
    "COLOURS",
    "COUNT_WORDS",
    "IMAGE_SIZE",
    "POSITIONS",
    "TOKEN_LENGTH",
    "ShapesLatents",
    "build_safe_diffusion",
    "build_text_to_image",
    "encode_shapes",
    "epsilon_loss",
    "flow_matching_loss",
    "shapes_caption",
    "shapes_images",
    "shapes_rows",
    "sampled_shapes_reward",
    "shapes_tokenizer",
    "tiny_clip_text_encoder",
    "tiny_shapes_vae",
    "train_denoiser",
    "train_vae_on_shapes",
]

COLOURS = ("red", "green", "blue", "yellow")
POSITIONS = ("left", "right", "top", "bottom")
COUNT_WORDS = {1: "one", 2: "two", 3: "three", 4: "four"}


def shapes_caption(colour: str, count: int, position: str | None, shape: str = "square") -> str:
    """``"one red square on the left"``, ``"two blue squares at the top"``, ``"three green squares"``."""
    if count not in COUNT_WORDS:
        raise ValueError(f"count must be one of {sorted(COUNT_WORDS)}, got {count}")
    noun = shape if count == 1 else shape + "s"
    text = f"{COUNT_WORDS[count]} {colour} {noun}"
    if position in ("left", "right", "center"):
        text += f" on the {position}" if position != "center" else " in the center"
    elif position in ("top", "bottom"):
        text += f" at the {position}"
    elif position is not None:
        raise ValueError(f"unknown position {position!r}")
    return text


def shapes_rows(
    n: int | None = None,
    *,
    colours: tuple[str, ...] = COLOURS,
    counts: tuple[int, ...] = (1, 2),
    positions: tuple[str | None, ...] = POSITIONS,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Rows ``{"prompt", "colour", "count", "position"}`` over the product of the given values, shuffled
    with `seed`; `n` rows (cycling through the product when n is larger), or all of them when None."""
    combos = list(itertools.product(colours, counts, positions))
    random.Random(seed).shuffle(combos)
    if n is not None:
        combos = [combos[i % len(combos)] for i in range(n)]
    return [{"prompt": shapes_caption(c, k, p), "colour": c, "count": k, "position": p} for c, k, p in combos]


def shapes_images(rows: list[dict[str, Any]], size: int = 32) -> torch.Tensor:
    """Float[N,3,size,size] in [0, 1]: the scene each row describes."""
    from mmalign.tiny.world import render_scene

    return torch.stack(
        [render_scene(r["colour"], int(r["count"]), r["position"], size=size) for r in rows]  # type: ignore[misc]
    )


def train_vae_on_shapes(
    vae: torch.nn.Module,
    *,
    size: int = 32,
    steps: int = 300,
    batch_size: int = 32,
    lr: float = 3e-3,
    kl_weight: float = 1e-6,
    seed: int = 0,
    progress: bool = True,
) -> float:
    """Fit `vae` (an `AutoencoderKL`) to reconstruct rendered scenes in [-1, 1]; returns the final MSE.

    The latent distribution's mean is decoded (plus a tiny KL term that keeps latents near unit scale);
    afterwards ``vae.config.scaling_factor`` is set to 1/std of the latents of the training scenes, as
    diffusion models expect unit-variance latents.
    """
    g = torch.Generator().manual_seed(seed)
    rows = shapes_rows(None, counts=(1, 2, 3), positions=(*POSITIONS, None), seed=seed)
    images = shapes_images(rows, size) * 2 - 1
    opt = torch.optim.Adam(vae.parameters(), lr=lr)
    vae.train()

    def loss_at(_: int) -> Tensor:
        x = images[torch.randint(0, len(images), (batch_size,), generator=g)]
        post = vae.encode(x).latent_dist
        return torch.nn.functional.mse_loss(vae.decode(post.mean).sample, x) + kl_weight * post.kl().mean()

    losses = fit(opt, steps, loss_at, "VAE warm start", progress=progress, window=1)
    vae.eval()
    with torch.no_grad():
        z = vae.encode(images[:256]).latent_dist.mean
        shift = float(getattr(vae.config, "shift_factor", None) or 0.0)
        std = float((z - shift).std())
    vae.register_to_config(scaling_factor=1.0 / max(std, 1e-6))
    return losses[-1] if losses else 0.0


# ============================================================================ tiny diffusion models
IMAGE_SIZE = 32
"""Side of the tiny models' images (pixels); their latents are 4 x IMAGE_SIZE/2 x IMAGE_SIZE/2."""
TOKEN_LENGTH = 40
"""Tokens per prompt of the tiny models' byte-level tokenizer: the longest shapes caption fits."""


def shapes_tokenizer(max_length: int = TOKEN_LENGTH) -> Any:
    """The byte-level `CLIPTokenizer` of `mmalign.tiny.sd3`, long enough for a whole shapes caption."""
    from mmalign.tiny.sd3 import clip_byte_tokenizer

    return clip_byte_tokenizer(max_length)


def tiny_shapes_vae(size: int = IMAGE_SIZE, latent_channels: int = 4) -> torch.nn.Module:
    """An untrained `AutoencoderKL` with one 2x downsample: Float[B,3,S,S] <-> latents [B,4,S/2,S/2]."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(16, 32),
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=8,
        sample_size=size,
    )


def tiny_clip_text_encoder(
    tokenizer: Any, *, hidden: int = 32, layers: int = 2, projection_dim: int | None = None
) -> torch.nn.Module:
    """A tiny CLIP text encoder over `tokenizer`'s vocabulary: a `CLIPTextModelWithProjection` when
    `projection_dim` is given (SD3: penultimate states + pooled projection), else a `CLIPTextModel`
    (SD1.5: last hidden states)."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        max_position_embeddings=tokenizer.model_max_length,
        projection_dim=projection_dim or hidden,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return CLIPTextModelWithProjection(config) if projection_dim else CLIPTextModel(config)


@dataclass
class ShapesLatents:
    """The warm-start data: each scene's caption tokens and the latents of its render."""

    rows: list[dict[str, Any]]
    """The scenes (``prompt``, ``colour``, ``count``, ``position``), one per caption."""
    latents: Tensor
    """Float[N, C, h, w]: scaled VAE latents of each scene's render."""
    tokens: Tensor
    """Long[N, L]: each caption's token ids (padded to the tokenizer's max length)."""
    empty: Tensor
    """Long[L]: the empty prompt's ids (the unconditional caption of classifier-free guidance)."""


def _tokens(tokenizer: Any, texts: list[str]) -> Tensor:
    return tokenizer(
        texts,
        padding="max_length",
        max_length=tokenizer.model_max_length,
        truncation=True,
        return_tensors="pt",
    ).input_ids


@torch.no_grad()
def encode_shapes(
    vae: torch.nn.Module, tokenizer: Any, rows: list[dict[str, Any]], *, size: int = IMAGE_SIZE
) -> ShapesLatents:
    """Render every row's scene and encode it with `vae` into scaled latents
    ``(mean - shift_factor) * scaling_factor``; tokenize the captions."""
    images = shapes_images(rows, size) * 2 - 1
    cfg = vae.config
    was_training = vae.training
    vae.eval()
    z = torch.cat([vae.encode(images[i : i + 256]).latent_dist.mean for i in range(0, len(images), 256)])
    vae.train(was_training)
    return ShapesLatents(
        rows=rows,
        latents=(z - float(cfg.shift_factor or 0.0)) * float(cfg.scaling_factor),
        tokens=_tokens(tokenizer, [str(r["prompt"]) for r in rows]),
        empty=_tokens(tokenizer, [""])[0],
    )


DenoiserLoss = Callable[[Tensor, Tensor, torch.Generator], Tensor]
"""``loss(latents [B,C,h,w], token_ids [B,L], generator) -> scalar``: one denoising loss on a batch."""


def flow_matching_loss(
    transformer: torch.nn.Module,
    text_encoder: torch.nn.Module,
    *,
    shift: float = 3.0,
    num_train_timesteps: int = 1000,
) -> DenoiserLoss:
    """Rectified flow (SD3): x_sigma = (1 - sigma) x0 + sigma noise, target v = noise - x0, MSE.

    sigma = shift u / (1 + (shift - 1) u) with u ~ U(0, 1): the distribution of the scheduler's
    (shifted) sampling sigmas. Prompt embeddings as `mmalign.policies.sd3_components.encode_prompt` makes
    them (penultimate hidden states and the pooled projection), with grad, so the text encoder trains too.
    """

    def loss(z0: Tensor, ids: Tensor, g: torch.Generator) -> Tensor:
        out = text_encoder(ids, output_hidden_states=True)
        u = torch.rand(z0.shape[0], generator=g)
        sigma = shift * u / (1 + (shift - 1) * u)
        noise = torch.randn(z0.shape, generator=g)
        s = sigma.view(-1, 1, 1, 1)
        v = transformer(
            hidden_states=(1 - s) * z0 + s * noise,
            encoder_hidden_states=out.hidden_states[-2],
            pooled_projections=out.text_embeds,
            timestep=sigma * num_train_timesteps,
            return_dict=False,
        )[0]
        return torch.nn.functional.mse_loss(v, noise - z0)

    return loss


def epsilon_loss(
    unet: torch.nn.Module, text_encoder: torch.nn.Module, scheduler: Any, *, max_weight: float | None = 20.0
) -> DenoiserLoss:
    """DDPM epsilon prediction (SD1.x): x_t = sqrt(abar_t) x0 + sqrt(1 - abar_t) noise with t uniform over
    the scheduler's training timesteps; the UNet, conditioned on the text encoder's last hidden states
    (with grad), predicts the noise.

    The squared error is weighted per sample by 1 / abar_t clipped at `max_weight` (None: unweighted,
    DDPM's "simple" loss). 1 / abar_t is the weight under which the epsilon error equals the
    v-prediction error; without it the noisiest steps, where only the prompt tells where the objects
    go, carry almost no gradient, and a tiny UNet learns colours but places objects wherever the noise
    puts them.
    """
    n = int(scheduler.config.num_train_timesteps)
    abar = scheduler.alphas_cumprod.float()

    def loss(z0: Tensor, ids: Tensor, g: torch.Generator) -> Tensor:
        hidden = text_encoder(ids).last_hidden_state
        t = torch.randint(0, n, (z0.shape[0],), generator=g)
        noise = torch.randn(z0.shape, generator=g)
        eps = unet(scheduler.add_noise(z0, noise, t), t, encoder_hidden_states=hidden, return_dict=False)[0]
        err = (eps - noise).pow(2).mean(dim=tuple(range(1, eps.ndim)))
        if max_weight is None:
            return err.mean()
        return (err * (1 / abar[t]).clamp(max=max_weight)).mean()

    return loss


def train_denoiser(
    modules: Sequence[torch.nn.Module],
    loss_fn: DenoiserLoss,
    data: ShapesLatents,
    *,
    steps: int,
    lr: float = 1e-3,
    final_lr_fraction: float = 0.1,
    batch_size: int = 32,
    p_uncond: float = 0.1,
    stop: Callable[[int], bool] | None = None,
    check_every: int = 50,
    seed: int = 0,
    progress: bool = True,
    desc: str = "denoiser warm start",
) -> tuple[float, int]:
    """Train `modules` (the denoiser and the text encoder) with `loss_fn` on `data` for up to `steps`
    steps: AdamW, learning rate `lr` cosine-decayed to `final_lr_fraction` of it at `steps`, gradients
    clipped to norm 1. A batch draws `batch_size` captions uniformly with their scenes' latents and
    replaces a caption by the empty prompt with probability `p_uncond` (so classifier-free guidance
    works). Every `check_every` steps ``stop(steps_done)`` (if given) may end training early.
    Deterministic for `seed`; returns (mean loss of the last 50 steps, steps done)."""
    g = torch.Generator().manual_seed(seed)
    params = [p for m in modules for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    for m in modules:
        m.train()

    def loss_at(step: int) -> Tensor:
        cosine = 0.5 * (1 + math.cos(math.pi * step / max(1, steps - 1)))
        for group in opt.param_groups:
            group["lr"] = lr * (final_lr_fraction + (1 - final_lr_fraction) * cosine)
        idx = torch.randint(0, len(data.rows), (batch_size,), generator=g)
        ids = data.tokens[idx].clone()
        ids[torch.rand(batch_size, generator=g) < p_uncond] = data.empty
        return loss_fn(data.latents[idx], ids, g)

    def check(done: int) -> bool:
        halt = stop(done)
        for m in modules:  # the check may have switched them to inference
            m.train().requires_grad_(True)
        return halt

    losses = fit(
        opt,
        steps,
        loss_at,
        desc,
        clip_norm=1.0,
        stop=None if stop is None else check,
        check_every=check_every,
        progress=progress,
    )
    recent, done = losses[-50:], len(losses)
    for m in modules:
        m.eval()
    return sum(recent) / max(1, len(recent)), done


def sampled_shapes_reward(
    transformer: torch.nn.Module,
    vae: torch.nn.Module,
    scheduler: Any,
    text_encoder: torch.nn.Module,
    tokenizer: Any,
    rows: list[dict[str, Any]] | None = None,
    *,
    group_size: int = 4,
    num_steps: int = 10,
    noise_level: float = 0.7,
    seed: int = 0,
) -> float:
    """Mean ``shapes_compositional`` reward of `group_size` samples per row (default: the 32 scenes of
    `shapes_rows`) drawn by `SD3Policy` with the Flow-GRPO sampler (`num_steps` SDE steps at
    `noise_level`, no guidance), as the text_to_image pipeline's rollouts draw them."""
    from mmalign.policies.sd3 import SD3Policy
    from rewards import RewardSet

    policy = SD3Policy(
        transformer,
        vae,
        scheduler,
        text_encoder,
        tokenizer,
        num_steps=num_steps,
        noise_level=noise_level,
        seed=seed,
    )
    rollout = policy.rollout(rows or shapes_rows(None), group_size, compute_logp=False)
    policy.decode(rollout)
    return float(RewardSet(["shapes_compositional"])(rollout)[:, 0].nanmean())


def _shapes_vae_and_data(
    tokenizer: Any, *, vae_steps: int, seed: int, progress: bool
) -> tuple[Any, ShapesLatents]:
    """The frozen tiny VAE fitted to the shapes world, and the latents of `shapes_rows`' 32 scenes."""
    vae = tiny_shapes_vae()
    train_vae_on_shapes(vae, size=IMAGE_SIZE, steps=vae_steps, seed=seed, progress=progress)
    vae.requires_grad_(False)
    return vae, encode_shapes(vae, tokenizer, shapes_rows(None, seed=seed))


def _save(path: Path, components: dict[str, Any], meta: dict[str, Any]) -> None:
    for name, obj in components.items():
        obj.save_pretrained(path / name)
    (path / "mmalign_tiny.json").write_text(json.dumps(meta))


@BUILDERS.register("text_to_image", minutes=12, phases=2)
def build_text_to_image(
    path: Path,
    *,
    vae_steps: int = 300,
    steps: int = 2000,
    target_reward: float | None = 0.45,
    check_every: int = 50,
    min_steps: int = 500,
    lr: float = 1e-3,
    batch_size: int = 32,
    shift: float = 3.0,
    p_uncond: float = 0.1,
    num_layers: int = 2,
    num_attention_heads: int = 4,
    attention_head_dim: int = 16,
    text_hidden: int = 32,
    seed: int = 0,
    progress: bool = True,
) -> None:
    """A tiny SD3-style text-to-image model of the shapes world, stopped early so that GRPO has work to do.

    Writes ``transformer/ vae/ scheduler/ text_encoder/ tokenizer/`` with ``save_pretrained`` (the
    layout of `mmalign.policies.sd3_components.load_sd3_components`) and ``mmalign_tiny.json`` (these
    arguments, the steps done and the reward checks).

    Details: docs/architecture.md, "mmalign.tiny.shapes.build_text_to_image".
    """
    meta = {
        "builder": "text_to_image",
        **{k: v for k, v in locals().items() if k not in ("path", "progress")},
    }
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel

    torch.manual_seed(seed)
    tokenizer = shapes_tokenizer()
    vae, data = _shapes_vae_and_data(tokenizer, vae_steps=vae_steps, seed=seed, progress=progress)
    text_encoder = tiny_clip_text_encoder(tokenizer, hidden=text_hidden, projection_dim=text_hidden)
    latent = IMAGE_SIZE // 2
    transformer = SD3Transformer2DModel(
        sample_size=latent,
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_layers=num_layers,
        attention_head_dim=attention_head_dim,
        num_attention_heads=num_attention_heads,
        joint_attention_dim=text_hidden,
        caption_projection_dim=num_attention_heads * attention_head_dim,
        pooled_projection_dim=text_hidden,
        pos_embed_max_size=latent,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)
    checks: list[tuple[int, float]] = []

    def reached_target(step: int) -> bool:
        if step < min_steps:
            return False
        checks.append(
            (step, sampled_shapes_reward(transformer, vae, scheduler, text_encoder, tokenizer, seed=seed))
        )
        return target_reward is not None and checks[-1][1] >= target_reward

    loss, done = train_denoiser(
        [transformer, text_encoder],
        flow_matching_loss(transformer, text_encoder, shift=shift),
        data,
        steps=steps,
        lr=lr,
        batch_size=batch_size,
        p_uncond=p_uncond,
        seed=seed,
        progress=progress,
        stop=reached_target if target_reward is not None else None,
        check_every=check_every,
        desc="transformer warm start" + (", may stop early" if target_reward is not None else ""),
    )
    meta.update(steps_done=done, final_loss=loss, reward_checks=checks)
    _save(
        Path(path),
        {
            "transformer": transformer,
            "vae": vae,
            "scheduler": scheduler,
            "text_encoder": text_encoder,
            "tokenizer": tokenizer,
        },
        meta,
    )


@BUILDERS.register("safe_diffusion", minutes=25, phases=2)
def build_safe_diffusion(
    path: Path,
    *,
    vae_steps: int = 800,
    steps: int = 1500,
    lr: float = 1e-3,
    batch_size: int = 32,
    p_uncond: float = 0.1,
    block_out_channels: tuple[int, ...] = (16, 32, 64),
    cross_attention_dim: int = 32,
    seed: int = 0,
    progress: bool = True,
) -> None:
    """A tiny SD 1.5-style (DDIM, epsilon prediction) model that draws the shapes world well, the base
    model of the offline safe-diffusion pipeline (which teaches it not to draw the "unsafe" colour red).

    Writes ``unet/ vae/ scheduler/ text_encoder/ tokenizer/`` with ``save_pretrained`` (the layout of
    `mmalign.policies.sd15_components.load_sd15_components` and `DDIMPolicy.from_pretrained`; the
    scheduler is a `DDIMScheduler` with SD 1.5's config) and ``mmalign_tiny.json`` (these arguments).

    Details: docs/architecture.md, "mmalign.tiny.shapes.build_safe_diffusion".
    """
    meta = {
        "builder": "safe_diffusion",
        **{k: v for k, v in locals().items() if k not in ("path", "progress")},
    }
    from diffusers import DDIMScheduler, UNet2DConditionModel

    from mmalign.tiny.sd15 import SD15_SCHEDULER

    torch.manual_seed(seed)
    tokenizer = shapes_tokenizer()
    vae, data = _shapes_vae_and_data(tokenizer, vae_steps=vae_steps, seed=seed, progress=progress)
    text_encoder = tiny_clip_text_encoder(tokenizer, hidden=cross_attention_dim)
    n = len(block_out_channels)
    unet = UNet2DConditionModel(
        sample_size=IMAGE_SIZE // 2,
        in_channels=4,
        out_channels=4,
        down_block_types=("DownBlock2D",) + ("CrossAttnDownBlock2D",) * (n - 1),
        up_block_types=("CrossAttnUpBlock2D",) * (n - 1) + ("UpBlock2D",),
        block_out_channels=tuple(block_out_channels),
        layers_per_block=1,
        cross_attention_dim=cross_attention_dim,
        attention_head_dim=8,
        norm_num_groups=8,
    )
    scheduler = DDIMScheduler(**SD15_SCHEDULER)
    loss, done = train_denoiser(
        [unet, text_encoder],
        epsilon_loss(unet, text_encoder, scheduler),
        data,
        steps=steps,
        lr=lr,
        batch_size=batch_size,
        p_uncond=p_uncond,
        seed=seed,
        progress=progress,
        desc="UNet warm start",
    )
    meta.update(steps_done=done, final_loss=loss)
    _save(
        Path(path),
        {
            "unet": unet,
            "vae": vae,
            "scheduler": scheduler,
            "text_encoder": text_encoder,
            "tokenizer": tokenizer,
        },
        meta,
    )
