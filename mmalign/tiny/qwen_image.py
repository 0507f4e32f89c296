"""Tiny Qwen-Image pipelines built offline from config kwargs (`mmalign.policies.qwen_image`).

Builders ``qwen_image_tiny`` (`build_tiny_qwen_image`, random weights) and ``qwen_image``
(`build_qwen_image`, warm-started on the shapes world); the folder has ``Qwen/Qwen-Image``'s layout.

Details: docs/architecture.md, "mmalign.tiny.qwen_image".
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mmalign.policies.qwen_image_components import PROMPT_DROP, PROMPT_TEMPLATE, QwenImageComponents
from mmalign.tiny import BUILDERS, train_bpe_tokenizer

__all__ = [
    "QWEN_SCHEDULER",
    "build_qwen_image",
    "build_tiny_qwen_image",
    "qwen_flow_loss",
    "sampled_reward",
    "shift_sigma",
    "tiny_qwen_image_components",
    "tiny_qwen_tokenizer",
    "tiny_qwen_transformer",
    "tiny_qwen_vae",
    "tiny_qwen_vl",
]

QWEN_SCHEDULER: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 0.9,
    "base_image_seq_len": 256,
    "max_image_seq_len": 8192,
    "shift_terminal": 0.02,
    "time_shift_type": "exponential",
}
"""The scheduler settings of ``Qwen/Qwen-Image``'s ``scheduler_config.json``."""
SPECIALS = ["<|im_start|>", "<|im_end|>"]


def shape_captions() -> list[str]:
    from mmalign.tiny.shapes import shapes_rows

    rows = shapes_rows(None, counts=(1, 2, 3, 4), positions=("left", "right", "top", "bottom", None))
    return [str(r["prompt"]) for r in rows]


def tiny_qwen_tokenizer(vocab_size: int = 512) -> Any:
    """A ``Qwen2Tokenizer`` (BPE trained on templated shapes captions); raises if the template's system part is
    not the `PROMPT_DROP` tokens ``QwenImagePipeline`` drops."""
    from transformers import Qwen2Tokenizer

    texts = [PROMPT_TEMPLATE.format(c) for c in shape_captions()] * 4
    fast = train_bpe_tokenizer(texts, vocab_size=vocab_size, extra_special=SPECIALS)
    with tempfile.TemporaryDirectory() as tmp:
        fast.save_pretrained(tmp)
        tok = Qwen2Tokenizer.from_pretrained(tmp)
    prefix = PROMPT_TEMPLATE.split("{}")[0]
    n = len(tok(prefix).input_ids)
    if n != PROMPT_DROP:
        raise RuntimeError(
            f"the tiny Qwen tokenizer splits the prompt template's system part into {n} tokens; the pipeline "
            f"drops {PROMPT_DROP} (raise vocab_size)"
        )
    return tok


def tiny_qwen_vl(tokenizer: Any, hidden: int = 32, layers: int = 2) -> torch.nn.Module:
    """A random ``Qwen2_5_VLForConditionalGeneration``: `layers` text layers of width `hidden` (2 heads, M-RoPE
    sections summing to the head's half width) and a one-block vision tower of width 16."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    head = hidden // 2
    quarter = head // 2
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [quarter - 2 * (quarter // 3), quarter // 3, quarter // 3],
        },
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        bos_token_id=None,
    )
    vision = dict(
        depth=1,
        hidden_size=16,
        intermediate_size=32,
        num_heads=2,
        out_hidden_size=hidden,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        fullatt_block_indexes=[0],
    )
    return Qwen2_5_VLForConditionalGeneration(
        Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True)
    )


def tiny_qwen_vae(z_dim: int = 4, base_dim: int = 8) -> torch.nn.Module:
    """A random ``AutoencoderKLQwenImage`` with one 2x spatial downsample and made-up latent statistics."""
    from diffusers import AutoencoderKLQwenImage

    return AutoencoderKLQwenImage(
        base_dim=base_dim,
        z_dim=z_dim,
        dim_mult=[1, 2],
        num_res_blocks=1,
        temperal_downsample=[False],
        latents_mean=[round(0.1 * (i - z_dim / 2), 3) for i in range(z_dim)],
        latents_std=[round(0.8 + 0.3 * i, 3) for i in range(z_dim)],
    )


def tiny_qwen_transformer(
    z_dim: int = 4,
    text_hidden: int = 32,
    *,
    num_layers: int = 2,
    num_attention_heads: int = 2,
    attention_head_dim: int = 16,
) -> torch.nn.Module:
    """A random ``QwenImageTransformer2DModel`` (patch 2, ``in_channels`` 4 z_dim, RoPE axes summing to the
    head width)."""
    from diffusers import QwenImageTransformer2DModel

    rest = attention_head_dim // 4
    axes = (attention_head_dim - 2 * 2 * (rest // 2), 2 * (rest // 2), 2 * (rest // 2))
    return QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=4 * z_dim,
        out_channels=z_dim,
        num_layers=num_layers,
        attention_head_dim=attention_head_dim,
        num_attention_heads=num_attention_heads,
        joint_attention_dim=text_hidden,
        axes_dims_rope=axes,
    )


def tiny_qwen_image_components(
    *, z_dim: int = 4, text_hidden: int = 32, num_layers: int = 2, seed: int = 0
) -> QwenImageComponents:
    """Random tiny Qwen-Image components (see the module docstring), deterministic for `seed`."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    torch.manual_seed(seed)
    tokenizer = tiny_qwen_tokenizer()
    return QwenImageComponents(
        transformer=tiny_qwen_transformer(z_dim, text_hidden, num_layers=num_layers),
        vae=tiny_qwen_vae(z_dim),
        scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_SCHEDULER),
        text_encoder=tiny_qwen_vl(tokenizer, text_hidden),
        tokenizer=tokenizer,
    )


def build_tiny_qwen_image(
    path: str | Path, *, z_dim: int = 4, text_hidden: int = 32, num_layers: int = 2, seed: int = 0
) -> Path:
    """Write a random tiny Qwen-Image folder at `path` (`tiny_qwen_image_components`); returns `path`."""
    path = Path(path)
    tiny_qwen_image_components(
        z_dim=z_dim, text_hidden=text_hidden, num_layers=num_layers, seed=seed
    ).save_pretrained(path)
    return path


@BUILDERS.register("qwen_image_tiny", minutes=0.05)
def _build_random(path: Path) -> None:
    build_tiny_qwen_image(path)


# ----------------------------------------------------------------------------- the warm-started model


def _shapes_video_set(seed: int) -> Tensor:
    """Float[N, 1, 3, 32, 32]: the shapes scenes the VAE is fitted to (1-3 squares, every position), as
    one-frame videos."""
    from mmalign.tiny.shapes import POSITIONS, shapes_images, shapes_rows

    rows = shapes_rows(None, counts=(1, 2, 3), positions=(*POSITIONS, None), seed=seed)
    return shapes_images(rows)[:, None]


def shift_sigma(u: Tensor, mu: float) -> Tensor:
    """The exponential time shift of ``FlowMatchEulerDiscreteScheduler`` (``time_shift_type: exponential``):
    e^mu / (e^mu + 1 / u - 1), the distribution of the scheduler's sigmas for a uniform `u` in (0, 1]."""
    return math.exp(mu) / (math.exp(mu) + (1 / u - 1))


def qwen_flow_loss(
    transformer: torch.nn.Module,
    text_encoder: torch.nn.Module,
    pad_id: int,
    *,
    mu: float,
    max_sequence_length: int,
) -> Any:
    """The rectified-flow loss of the Qwen-Image warm start (a `mmalign.tiny.shapes.DenoiserLoss`): prompt
    states of the templated token ids with grad (`prompt_states`, mask = ids != `pad_id`), sigma =
    `shift_sigma` of a uniform draw, x = (1 - sigma) x0 + sigma noise, MSE of `qwen_image_velocity` against
    noise - x0."""
    from mmalign.policies.qwen_image import qwen_image_velocity
    from mmalign.policies.qwen_image_components import prompt_states

    def loss(z0: Tensor, ids: Tensor, g: torch.Generator) -> Tensor:
        mask = (ids != pad_id).long()
        embeds, valid = prompt_states(text_encoder, ids, mask, max_sequence_length)
        sigma = shift_sigma(torch.rand(z0.shape[0], generator=g).clamp_min(1e-4), mu)
        noise = torch.randn(z0.shape, generator=g)
        s = sigma.view(-1, 1, 1, 1)
        v = qwen_image_velocity(transformer, (1 - s) * z0 + s * noise, sigma, embeds, valid, 1000)
        return torch.nn.functional.mse_loss(v, noise - z0)

    return loss


def sampled_reward(
    components: QwenImageComponents,
    rows: list[dict[str, Any]],
    *,
    latent_size: int,
    max_sequence_length: int,
    group_size: int = 4,
    seed: int = 0,
) -> float:
    """Mean ``shapes_compositional`` reward of `group_size` samples per row drawn by `QwenImagePolicy` with the
    Flow-GRPO sampler (10 SDE steps at noise level 0.7, no guidance), as the text_to_image pipeline's rollouts
    draw them."""
    from mmalign.policies.qwen_image import QwenImagePolicy
    from rewards import RewardSet

    c = components
    policy = QwenImagePolicy(
        c.transformer,
        c.vae,
        c.scheduler,
        c.text_encoder,
        c.tokenizer,
        latent_size=latent_size,
        max_sequence_length=max_sequence_length,
        num_steps=10,
        noise_level=0.7,
        guidance_scale=1.0,
        seed=seed,
    )
    rollout = policy.rollout(rows, group_size, compute_logp=False)
    policy.decode(rollout)
    return float(RewardSet(["shapes_compositional"])(rollout)[:, 0].nanmean())


@BUILDERS.register("qwen_image", minutes=12, phases=2)
def build_qwen_image(
    path: Path,
    *,
    vae_steps: int = 1200,
    vae_lr: float = 1e-3,
    vae_batch_size: int = 16,
    min_vae_psnr: float = 28.0,
    steps: int = 1500,
    target_reward: float | None = 0.45,
    check_every: int = 50,
    min_steps: int = 300,
    lr: float = 1e-3,
    batch_size: int = 32,
    p_uncond: float = 0.1,
    num_layers: int = 2,
    num_attention_heads: int = 4,
    attention_head_dim: int = 16,
    text_hidden: int = 32,
    max_sequence_length: int = 32,
    seed: int = 0,
    progress: bool = True,
) -> None:
    """A tiny Qwen-Image model of the shapes world (32 x 32 images), stopped early so that GRPO has work to do.

    Writes the Qwen-Image folder (`QwenImageComponents.save_pretrained`) and ``mmalign_tiny.json`` (these
    arguments, the VAE's PSNR, the steps done and the reward checks).

    Details: docs/architecture.md, "mmalign.tiny.qwen_image.build_qwen_image".
    """
    meta: dict[str, Any] = {
        "builder": "qwen_image",
        **{k: v for k, v in locals().items() if k not in ("path", "progress")},
    }
    from diffusers import FlowMatchEulerDiscreteScheduler

    from mmalign.policies.flow_matching import calculate_mu
    from mmalign.policies.qwen_image_components import prompt_tokens
    from mmalign.policies.wan_components import encode_video
    from mmalign.tiny.shapes import IMAGE_SIZE, ShapesLatents, shapes_rows, train_denoiser
    from mmalign.tiny.wan import fit_video_vae, set_latent_stats

    torch.manual_seed(seed)
    tokenizer = tiny_qwen_tokenizer()
    vae = tiny_qwen_vae()
    scenes = _shapes_video_set(seed)
    meta["vae_psnr"] = psnr = fit_video_vae(
        vae, scenes, steps=vae_steps, lr=vae_lr, batch_size=vae_batch_size, seed=seed, progress=progress
    )
    if psnr < min_vae_psnr:
        raise RuntimeError(
            f"qwen_image builder: the tiny Qwen VAE reconstructs the scenes at {psnr:.1f} dB, below "
            f"min_vae_psnr={min_vae_psnr}; nothing was written (retry with more vae_steps or another seed)"
        )
    set_latent_stats(vae, scenes)
    rows = shapes_rows(None, seed=seed)
    from mmalign.tiny.shapes import shapes_images

    latents = encode_video(vae, shapes_images(rows)[:, None])[:, :, 0]
    ids, _ = prompt_tokens(tokenizer, [str(r["prompt"]) for r in rows] + [""])
    data = ShapesLatents(rows=rows, latents=latents, tokens=ids[:-1], empty=ids[-1])
    scheduler = FlowMatchEulerDiscreteScheduler(**QWEN_SCHEDULER)
    latent_size = IMAGE_SIZE // 2
    mu = calculate_mu((latent_size // 2) ** 2, scheduler.config, default_max_shift=1.15)
    transformer = tiny_qwen_transformer(
        int(vae.config.z_dim),
        text_hidden,
        num_layers=num_layers,
        num_attention_heads=num_attention_heads,
        attention_head_dim=attention_head_dim,
    )
    text_encoder = tiny_qwen_vl(tokenizer, text_hidden)
    components = QwenImageComponents(transformer, vae, scheduler, text_encoder, tokenizer)
    checks: list[tuple[int, float]] = []

    def reached_target(step: int) -> bool:
        if step < min_steps:
            return False
        reward = sampled_reward(
            components, rows, latent_size=latent_size, max_sequence_length=max_sequence_length, seed=seed
        )
        checks.append((step, round(reward, 4)))
        return target_reward is not None and reward >= target_reward

    loss, done = train_denoiser(
        [transformer, text_encoder],
        qwen_flow_loss(
            transformer, text_encoder, tokenizer.pad_token_id, mu=mu, max_sequence_length=max_sequence_length
        ),
        data,
        steps=steps,
        lr=lr,
        batch_size=batch_size,
        p_uncond=p_uncond,
        seed=seed,
        progress=progress,
        stop=reached_target if target_reward is not None else None,
        check_every=check_every,
        desc="Qwen-Image warm start" + (", may stop early" if target_reward is not None else ""),
    )
    text_encoder.requires_grad_(False)
    path = Path(path)
    components.save_pretrained(path)
    meta.update(steps_done=done, final_loss=loss, reward_checks=checks)
    (path / "mmalign_tiny.json").write_text(json.dumps(meta, indent=2) + "\n")
