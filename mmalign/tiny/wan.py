"""Tiny Wan video pipelines built offline from config kwargs (random weights, a few hundred thousand
parameters, built in about a second).

`build_tiny_wan(path)` writes a folder with the layout of a real Wan 2.1 / 2.2 folder (``model_index.json``,
``transformer/``, optional ``transformer_2/``, ``vae/``, ``scheduler/``, ``text_encoder/`` (a one-layer
``UMT5EncoderModel``), ``tokenizer/`` (the character-level T5 tokenizer of `mmalign.tiny.sd3`)) through
`mmalign.policies.wan_components.WanComponents.save_pretrained`; `load_wan_components` and diffusers'
``WanPipeline.from_pretrained`` load it back with ``from_pretrained`` per component.

The tiny VAE downsamples less than the real one (``temperal_downsample=[False, True]``: 2x in time, 4x in
space; its config's ``scale_factor_temporal`` / ``scale_factor_spatial`` say the same, so diffusers' pipelines
agree), with ``z_dim`` 4 and made-up ``latents_mean`` / ``latents_std`` (so the normalisation is exercised).
The target size is 9 frames of 32 x 32 pixels: 5 latent frames of 8 x 8, patches (1, 2, 2).

Builders registered in `mmalign.tiny.BUILDERS`:

- ``wan_t2v_tiny``: text to video (``WanTransformer3DModel``, in_channels = z_dim).
- ``wan_concat_tiny``: channel-concat editing (VIVA's scheme): in_channels = 2 z_dim (noisy latents, then
  the source video's latents), out_channels = z_dim.
- ``wan_vace_tiny``: ``WanVACETransformer3DModel`` with VACE blocks at layers 0 and 1 and
  ``vace_in_channels`` = 2 z_dim + s^2 (s = the VAE's spatial factor: 4 + 4 + 16 = 24).
- ``wan22_tiny``: Wan2.2 A14B style: two experts (``transformer`` high noise, ``transformer_2`` low noise,
  ``boundary_ratio`` 0.875) and, like the real folders, a ``UniPCMultistepScheduler`` with ``flow_shift``
  (which the loader turns into a flow-matching Euler scheduler for the SDE, keeping UniPC for the ODE).
- ``wan_i2v_tiny``: Wan2.1 I2V style image to video: in_channels = 2 z_dim + 2 (noisy latents, the 2-channel
  first-frame mask of the temporal factor 2, the image latents), a tiny ``CLIPVisionModel`` (2 layers of width
  16 on 32 x 32 images, patch 8) with its ``CLIPImageProcessor`` whose penultimate states the transformer takes
  (``image_dim`` 16, ``added_kv_proj_dim`` its width), and a UniPC scheduler as the real folder ships.

`build_tiny_wan`'s ``scheduler`` chooses ``euler`` (``FlowMatchEulerDiscreteScheduler``, shift 3) or ``unipc``
(``UniPCMultistepScheduler`` with flow sigmas and ``flow_shift`` 3, as real Wan folders); the default is UniPC for
two experts and image to video, Euler otherwise.

`fit_video_vae` fits the tiny VAE to a set of clips (the builders of `mmalign.tiny.video_edit` and
`mmalign.tiny.video_geometry` start from a random one) and `set_latent_stats` sets its ``latents_mean`` /
``latents_std`` to the clips' latent statistics.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mmalign.policies.wan_components import WanComponents
from mmalign.tiny import BUILDERS
from mmalign.tiny.warm_start import fit

__all__ = [
    "CONDITIONS",
    "SCHEDULERS",
    "build_tiny_wan",
    "fit_video_vae",
    "fitted_tiny_wan",
    "set_latent_stats",
    "tiny_clip_vision",
    "tiny_umt5",
    "tiny_wan_transformer",
]

CONDITIONS = ("none", "concat", "vace", "i2v")
"""What the tiny transformer is built for (``none``: text to video, also what SDEdit uses)."""
SCHEDULERS = ("euler", "unipc")


def tiny_umt5(
    tokenizer: Any, hidden: int, *, num_layers: int = 1, num_heads: int = 2, d_kv: int = 8, buckets: int = 8
) -> torch.nn.Module:
    """A random ``UMT5EncoderModel`` of width `hidden` for `tokenizer` (Wan's text encoder, tiny)."""
    from transformers import UMT5Config, UMT5EncoderModel

    return UMT5EncoderModel(
        UMT5Config(
            vocab_size=len(tokenizer),
            d_model=hidden,
            d_kv=d_kv,
            d_ff=2 * hidden,
            num_layers=num_layers,
            num_heads=num_heads,
            relative_attention_num_buckets=buckets,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            decoder_start_token_id=tokenizer.pad_token_id,
        )
    )


def tiny_clip_vision(hidden: int = 16, image_size: int = 32, patch: int = 8) -> tuple[Any, Any]:
    """(a random two-layer ``CLIPVisionModel`` of width `hidden`, its ``CLIPImageProcessor`` at `image_size`)."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    model = CLIPVisionModel(
        CLIPVisionConfig(
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=image_size,
            patch_size=patch,
            projection_dim=hidden,
        )
    )
    processor = CLIPImageProcessor(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
    )
    return model, processor


def build_tiny_wan(
    path: str | Path,
    *,
    condition: str = "none",
    two_experts: bool = False,
    boundary_ratio: float = 0.875,
    z_dim: int = 4,
    text_hidden: int = 16,
    num_layers: int = 2,
    scheduler: str | None = None,
    image_encoder: bool = True,
    seed: int = 0,
) -> Path:
    """Write a tiny Wan folder at `path` (see the module docstring). `condition`: ``none``, ``concat``
    (in_channels doubled), ``vace`` (a VACE transformer) or ``i2v`` (image to video: in_channels 2 z_dim + 2,
    with a CLIP image encoder unless `image_encoder` is False, as Wan2.2 I2V); `two_experts`: add
    ``transformer_2`` (same architecture, other weights) and ``boundary_ratio``; `scheduler`: ``euler`` or
    ``unipc`` (None: UniPC for two experts and ``i2v``, as the real folders ship, else Euler)."""
    from diffusers import (
        AutoencoderKLWan,
        FlowMatchEulerDiscreteScheduler,
        UniPCMultistepScheduler,
        WanTransformer3DModel,
        WanVACETransformer3DModel,
    )

    from mmalign.tiny.sd3 import t5_char_tokenizer

    if condition not in CONDITIONS:
        raise ValueError(f"condition must be one of {', '.join(CONDITIONS)}; got {condition!r}")
    if scheduler is None:
        scheduler = "unipc" if two_experts or condition == "i2v" else "euler"
    if scheduler not in SCHEDULERS:
        raise ValueError(f"scheduler must be one of {', '.join(SCHEDULERS)}; got {scheduler!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    down = [False, True]  # 2x in time, 4x in space
    temporal, spatial = 2 ** sum(down), 2 ** len(down)
    vae = AutoencoderKLWan(
        base_dim=8,
        z_dim=z_dim,
        dim_mult=[1, 2, 2],
        num_res_blocks=1,
        temperal_downsample=down,
        latents_mean=[round(0.1 * (i - z_dim / 2), 3) for i in range(z_dim)],
        latents_std=[round(0.8 + 0.3 * i, 3) for i in range(z_dim)],
        scale_factor_temporal=temporal,
        scale_factor_spatial=spatial,
    )
    extra_channels = {"concat": z_dim, "i2v": z_dim + temporal}.get(condition, 0)
    arch: dict[str, Any] = dict(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=z_dim + extra_channels,
        out_channels=z_dim,
        text_dim=text_hidden,
        freq_dim=16,
        ffn_dim=32,
        num_layers=num_layers,
        rope_max_seq_len=32,
    )
    clip = clip_processor = None
    if condition == "i2v" and image_encoder:
        clip, clip_processor = tiny_clip_vision()
        arch.update(image_dim=int(clip.config.hidden_size), added_kv_proj_dim=2 * 8)

    def transformer() -> torch.nn.Module:
        if condition == "vace":
            return WanVACETransformer3DModel(
                **arch, vace_layers=list(range(num_layers)), vace_in_channels=2 * z_dim + spatial**2
            )
        return WanTransformer3DModel(**arch)

    high = transformer()
    low = transformer() if two_experts else None
    euler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    unipc = None
    if scheduler == "unipc":
        unipc = UniPCMultistepScheduler(
            num_train_timesteps=1000, use_flow_sigmas=True, flow_shift=3.0, prediction_type="flow_prediction"
        )
    tokenizer = t5_char_tokenizer()
    components = WanComponents(
        high,
        vae,
        euler,
        tiny_umt5(tokenizer, text_hidden),
        tokenizer,
        transformer_2=low,
        boundary_ratio=boundary_ratio if two_experts else None,
        ode_scheduler=unipc,
        image_encoder=clip,
        image_processor=clip_processor,
    )
    components.save_pretrained(path)
    return path


@BUILDERS.register("wan_t2v_tiny", minutes=0.05)
def _build_t2v(path: Path) -> None:
    build_tiny_wan(path)


@BUILDERS.register("wan_concat_tiny", minutes=0.05)
def _build_concat(path: Path) -> None:
    build_tiny_wan(path, condition="concat")


@BUILDERS.register("wan_vace_tiny", minutes=0.05)
def _build_vace(path: Path) -> None:
    build_tiny_wan(path, condition="vace")


@BUILDERS.register("wan22_tiny", minutes=0.05)
def _build_wan22(path: Path) -> None:
    build_tiny_wan(path, two_experts=True)


@BUILDERS.register("wan_i2v_tiny", minutes=0.05)
def _build_i2v(path: Path) -> None:
    build_tiny_wan(path, condition="i2v")


def fit_video_vae(
    vae: torch.nn.Module,
    videos: Tensor,
    *,
    steps: int,
    lr: float = 1e-3,
    batch_size: int = 4,
    seed: int = 0,
    progress: bool = True,
    ink_weight: float = 0.0,
    cosine: bool = False,
) -> float:
    """Fit ``AutoencoderKLWan`` `vae` to reconstruct `videos` Float[N, F, 3, H, W] in [0, 1] (the posterior's mode
    decoded, MSE in [-1, 1] plus a tiny KL, AdamW), then freeze it; returns the reconstruction PSNR (dB, pixels
    in [0, 1]) of the first 16 clips.

    ``AutoencoderKLWan.decode`` clamps its output to [-1, 1], and the clamp passes no gradient where the output
    lies outside: a decoder whose outputs all overshoot (all white) gets no gradient at all and stays blank. The
    tiny VAE fell into that state at learning rates of 1e-3 and above (11.8 dB). While fitting, a forward hook
    on the decoder therefore returns the clamped value with the gradient of the unclamped one (straight-through;
    the forward values are those of the real decoder), so an overshooting pixel is pulled back; with it the same
    fit reaches 20.5 dB.

    `ink_weight` > 0 weights each pixel's squared error by ``1 + ink_weight * (1 - min over RGB)`` (normalised
    by the mean weight): pixels far from white, the drawn content on the clips' white background, count more,
    so the fit leaves the all-background solution sooner. `cosine` decays the learning rate along a cosine
    from `lr` to 5 % of it over the `steps`. The defaults (0.0, False) are the plain fit."""
    g = torch.Generator().manual_seed(seed)
    vae.train().requires_grad_(True)
    decoder = vae.decoder  # type: ignore[union-attr]
    hook = decoder.register_forward_hook(lambda m, i, out: out.clamp(-1, 1) + (out - out.detach()))
    opt = torch.optim.AdamW(vae.parameters(), lr=lr, weight_decay=0.0)

    def loss_at(_: int) -> Tensor:
        idx = torch.randint(0, videos.shape[0], (batch_size,), generator=g)
        x = videos[idx].movedim(2, 1) * 2 - 1
        post = vae.encode(x).latent_dist  # type: ignore[operator]
        rec = vae.decode(post.mode(), return_dict=False)[0]  # type: ignore[operator]
        if ink_weight > 0:  # x is in [-1, 1]: (x.amin + 1) / 2 is the darkest channel in [0, 1]
            w = 1 + ink_weight * (1 - (x.amin(dim=1, keepdim=True) + 1) / 2)
            err = ((rec - x).pow(2) * w).mean() / w.mean()
        else:
            err = (rec - x).pow(2).mean()
        return err + 1e-6 * post.kl().mean()

    sched = None
    if cosine:
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(s, steps) / max(steps, 1)))
        )
    try:
        fit(opt, steps, loss_at, "video VAE", sched=sched, progress=progress)
    finally:
        hook.remove()
    vae.eval().requires_grad_(False)
    with torch.no_grad():
        x = videos[:16].movedim(2, 1) * 2 - 1
        rec = vae.decode(vae.encode(x).latent_dist.mode(), return_dict=False)[0].clamp(-1, 1)  # type: ignore[operator]
        mse = ((rec - x) / 2).pow(2).mean()
    return float(10 * torch.log10(1 / mse))


def set_latent_stats(vae: torch.nn.Module, videos: Tensor) -> None:
    """Set the VAE config's ``latents_mean`` / ``latents_std`` to the per-channel statistics of the latents of
    `videos` Float[N, F, 3, H, W] in [0, 1], so that normalised latents have unit scale as with a real Wan VAE."""
    with torch.no_grad():
        z = torch.cat(
            [
                vae.encode(videos[i : i + 16].movedim(2, 1) * 2 - 1).latent_dist.mode()  # type: ignore[operator]
                for i in range(0, len(videos), 16)
            ]
        )
    dims = (0, 2, 3, 4)
    vae.register_to_config(  # type: ignore[operator]
        latents_mean=[round(float(v), 4) for v in z.mean(dims)],
        latents_std=[round(float(v), 4) for v in z.std(dims).clamp_min(1e-3)],
    )


def fitted_tiny_wan(
    builder: str,
    videos: Tensor,
    *,
    condition: str = "none",
    text_hidden: int = 32,
    vae_steps: int,
    vae_lr: float,
    vae_batch_size: int,
    min_vae_psnr: float,
    seed: int,
    vae_from: str | None = None,
    progress: bool = True,
    vae_ink_weight: float = 0.0,
    vae_cosine: bool = False,
) -> tuple[Any, float]:
    """The first phase of the warm-started tiny Wan builders (`builder` names one in errors): a random tiny
    Wan folder's components (`build_tiny_wan` with `condition`, `text_hidden`, `seed`; seeds torch with `seed`
    first) whose VAE is fitted to `videos` Float[N, F, 3, H, W] (`fit_video_vae`; `vae_from`: load an already
    fitted one instead; `vae_ink_weight`, `vae_cosine`: `fit_video_vae`'s `ink_weight`, `cosine`) and given their
    latent statistics (`set_latent_stats`). Returns (components, PSNR of
    the fit); a PSNR below `min_vae_psnr` is a RuntimeError and nothing is written."""
    import tempfile

    from mmalign.policies.wan_components import load_wan_components

    torch.manual_seed(seed)
    with tempfile.TemporaryDirectory() as tmp:
        build_tiny_wan(tmp, condition=condition, text_hidden=text_hidden, seed=seed)
        comp = load_wan_components(tmp)
    if vae_from is not None:
        from diffusers import AutoencoderKLWan

        comp.vae = AutoencoderKLWan.from_pretrained(vae_from).eval().requires_grad_(False)
        vae_steps = 0
    psnr = fit_video_vae(
        comp.vae,
        videos,
        steps=vae_steps,
        lr=vae_lr,
        batch_size=vae_batch_size,
        seed=seed,
        progress=progress,
        ink_weight=vae_ink_weight,
        cosine=vae_cosine,
    )
    if psnr < min_vae_psnr:
        raise RuntimeError(
            f"{builder} builder: the tiny Wan VAE reconstructs the clips at {psnr:.1f} dB, below "
            f"min_vae_psnr={min_vae_psnr}: the fit has not converged (the defaults reach about 20 dB). Nothing "
            "was written; retry with more vae_steps or another seed."
        )
    set_latent_stats(comp.vae, videos)
    return comp, psnr


def tiny_wan_transformer(
    in_channels: int,
    out_channels: int,
    *,
    num_layers: int = 2,
    num_attention_heads: int = 4,
    attention_head_dim: int = 16,
    text_hidden: int = 32,
) -> torch.nn.Module:
    """A small ``WanTransformer3DModel`` (patches (1, 2, 2), 4x feed-forward) for the warm-started tiny models."""
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=num_attention_heads,
        attention_head_dim=attention_head_dim,
        in_channels=in_channels,
        out_channels=out_channels,
        text_dim=text_hidden,
        freq_dim=32,
        ffn_dim=4 * num_attention_heads * attention_head_dim,
        num_layers=num_layers,
        rope_max_seq_len=32,
    )
