"""A tiny channel-concat Wan editing model warm-started on the moving-squares clips (`mmalign.tiny.video_shapes`).

Builder ``video_edit`` (`build_video_edit`), in three phases:

1. **VAE.** The tiny ``AutoencoderKLWan`` of `mmalign.tiny.wan` (2x in time, 4x in space, z_dim 4) is fitted
   to reconstruct clips (`vae_steps` steps, `mmalign.tiny.wan.fit_video_vae`), then frozen; a fit below
   `min_vae_psnr` dB is an error; its ``latents_mean`` / ``latents_std`` are set to the empirical per-channel
   statistics of the training clips' latents, so normalised latents have unit scale as with a real Wan VAE.
   The frozen VAE bounds every edit (GRPO only moves the transformer), so the fit weights the coloured
   squares' pixels `vae_ink_weight` times more than the white background and decays its learning rate
   (`vae_cosine`): decoded through it, ideal edits of the held-out clips keep their R_IF (recolour 15.1,
   remove 14.0 against 14.2 / 13.6 for the clips themselves), where the plain 1200-step MSE fit blurred the
   squares and capped R_IF at 12.4 / 11.1, about where the warm-started editor already was.
2. **Editor.** A ``WanTransformer3DModel`` with ``in_channels = 2 z_dim`` (the noisy latents, then the
   source clip's latents: VIVA's channel concatenation, ``condition: concat`` of `mmalign.policies.wan`) and
   the tiny UMT5 text encoder are trained together with the rectified-flow loss to turn source latents into
   target latents given the instruction, on `num_clips` fresh clips (never the clips of ``assets/video_edit``).
3. **Early stop.** From `min_steps` on, every `check_every` steps, `edit_success` measures the share of
   held-out clips edited correctly when sampled deterministically (Euler, 10 steps); training stops once it
   reaches `target_success`. As for the text-to-image warm start, the result is a promising but imperfect
   editor (edits that are half done, muddy colours, ghosts of removed squares): GRPO has work to do.

The folder has the Wan layout (``transformer/ vae/ scheduler/ text_encoder/ tokenizer/ model_index.json``,
`mmalign.policies.wan_components`) and ``mmalign_tiny.json`` with these arguments and the checks.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mmalign.tiny import BUILDERS
from mmalign.tiny.warm_start import fit

__all__ = ["build_video_edit", "edit_success"]


def _clips(n: int, seed: int) -> list[Any]:
    from mmalign.tiny.video_shapes import EDIT_KINDS, make_edit_clip

    rng = random.Random(seed)
    return [make_edit_clip(rng, EDIT_KINDS[i % len(EDIT_KINDS)]) for i in range(n)]


def _sigmas(u: Tensor, shift: float) -> Tensor:
    """The scheduler's shifted sigma of a uniform draw: shift u / (1 + (shift - 1) u)."""
    return shift * u / (1 + (shift - 1) * u)


def _predict(transformer: torch.nn.Module, x: Tensor, source: Tensor, sigma: Tensor, text: Tensor) -> Tensor:
    return transformer(
        hidden_states=torch.cat([x, source], dim=1),
        timestep=sigma * 1000,
        encoder_hidden_states=text,
        return_dict=False,
    )[0]


@torch.no_grad()
def _sample(
    transformer: torch.nn.Module, source: Tensor, text: Tensor, steps: int, shift: float, seed: int
) -> Tensor:
    """Deterministic Euler sampling from noise to latents (the scheduler's shifted sigmas, 1 -> 0)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(source.shape, generator=g)
    sig = _sigmas(torch.linspace(1, 0, steps + 1), shift)
    for i in range(steps):
        s = sig[i].expand(x.shape[0])
        x = x + _predict(transformer, x, source, s, text) * (sig[i + 1] - sig[i])
    return x


def edit_success(
    videos: Tensor, clips: list[Any], tol: float = 0.25, share: float = 0.75
) -> tuple[float, float]:
    """(share of clips edited correctly, mean PSNR outside the edit mask in dB) of edited `videos`
    Float[N, F, 3, H, W] against `clips` (`EditClip`). A clip counts as edited when at least `share` of its
    salient pixels (not white in the source or in the target: the squares, kept, recoloured or removed) are
    within `tol` (max channel difference) of the target clip, so a blank output does not "remove" a square."""
    ok, psnr = [], []
    for v, c in zip(videos, clips):
        salient = torch.minimum(c.source, c.target).amin(dim=1) < 0.9  # [F, H, W]
        close = (v - c.target).abs().amax(dim=1) < tol
        ok.append(float(close[salient].float().mean()) >= share)
        out = (1 - c.mask)[:, None].expand_as(v).bool()
        mse = (v - c.source)[out].pow(2).mean().clamp_min(1e-10)
        psnr.append(float(10 * torch.log10(1 / mse)))
    return sum(ok) / len(ok), sum(psnr) / len(psnr)


@BUILDERS.register("video_edit", minutes=8, phases=2)
def build_video_edit(
    path: Path,
    *,
    num_clips: int = 768,
    vae_steps: int = 1500,
    vae_lr: float = 1e-3,
    vae_batch_size: int = 4,
    vae_ink_weight: float = 10.0,
    vae_cosine: bool = True,
    min_vae_psnr: float = 18.0,
    steps: int = 3000,
    min_steps: int = 400,
    check_every: int = 100,
    target_success: float | None = 0.4,
    lr: float = 1e-3,
    batch_size: int = 16,
    shift: float = 3.0,
    num_layers: int = 2,
    num_attention_heads: int = 4,
    attention_head_dim: int = 16,
    text_hidden: int = 32,
    seed: int = 0,
    vae_from: str | None = None,
    progress: bool = True,
) -> None:
    """Write the tiny editing model to `path` (see the module docstring for the phases). `vae_from`: a folder
    holding an already fitted tiny Wan VAE (``save_pretrained``) to use instead of phase 1 (experiments)."""
    meta: dict[str, Any] = {
        "builder": "video_edit",
        **{k: v for k, v in locals().items() if k not in ("path", "progress")},
    }
    from mmalign.policies.wan_components import encode_prompt, encode_video
    from mmalign.tiny.wan import fitted_tiny_wan, tiny_wan_transformer

    clips = _clips(num_clips, seed + 1000)
    held = _clips(32, seed + 2000)
    sources = torch.stack([c.source for c in clips])
    targets = torch.stack([c.target for c in clips])
    comp, meta["vae_psnr"] = fitted_tiny_wan(
        "video_edit",
        torch.cat([sources, targets]),
        condition="concat",
        text_hidden=text_hidden,
        vae_steps=vae_steps,
        vae_lr=vae_lr,
        vae_batch_size=vae_batch_size,
        min_vae_psnr=min_vae_psnr,
        seed=seed,
        vae_from=vae_from,
        progress=progress,
        vae_ink_weight=vae_ink_weight,
        vae_cosine=vae_cosine,
    )
    vae = comp.vae
    z_src, z_tgt = encode_video(vae, sources), encode_video(vae, targets)
    h_src = encode_video(vae, torch.stack([c.source for c in held]))
    z = int(vae.config.z_dim)
    transformer = tiny_wan_transformer(
        2 * z,
        z,
        num_layers=num_layers,
        num_attention_heads=num_attention_heads,
        attention_head_dim=attention_head_dim,
        text_hidden=text_hidden,
    )
    text_encoder, tokenizer = comp.text_encoder, comp.tokenizer
    text_encoder.train().requires_grad_(True)
    instructions = [c.instruction for c in clips]
    max_len = max(len(tokenizer(p).input_ids) for p in instructions + [c.instruction for c in held])
    params = list(transformer.parameters()) + list(text_encoder.parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 100))
    g = torch.Generator().manual_seed(seed)
    checks: list[tuple[int, float, float]] = []

    def loss_at(_: int) -> Tensor:
        idx = torch.randint(0, num_clips, (batch_size,), generator=g)
        x0, src = z_tgt[idx], z_src[idx]
        noise = torch.randn(x0.shape, generator=g)
        sigma = _sigmas(torch.rand(batch_size, generator=g), shift)
        s = sigma.view(-1, 1, 1, 1, 1)
        text = encode_prompt(text_encoder, tokenizer, [instructions[i] for i in idx.tolist()], "cpu", max_len)
        pred = _predict(transformer, (1 - s) * x0 + s * noise, src, sigma, text)
        return (pred - (noise - x0)).pow(2).mean()

    def check(done: int) -> bool:
        if done < min_steps:
            return False
        from mmalign.policies.wan_components import decode_video

        text_h = encode_prompt(text_encoder, tokenizer, [c.instruction for c in held], "cpu", max_len)
        videos = decode_video(vae, _sample(transformer, h_src, text_h, 10, shift, seed))
        success, psnr = edit_success(videos, held)
        checks.append((done, round(success, 4), round(psnr, 2)))
        return success >= target_success

    def status() -> dict[str, str]:
        return {"edited": f"{checks[-1][1]:.2f}", "psnr_outside": f"{checks[-1][2]:.1f}"} if checks else {}

    losses = fit(
        opt,
        steps,
        loss_at,
        "video editor warm start, may stop early",
        sched=sched,
        clip_norm=1.0,
        stop=None if target_success is None else check,
        check_every=check_every,
        check_at_end=True,
        progress=progress,
        show=status,
    )
    done, loss_v = len(losses), (losses[-1] if losses else float("nan"))
    text_encoder.eval().requires_grad_(False)
    transformer.eval()
    comp.transformer = transformer
    path = Path(path)
    comp.save_pretrained(path)
    meta.update(steps_done=done, final_loss=loss_v, checks=checks, max_prompt_tokens=max_len)
    (path / "mmalign_tiny.json").write_text(json.dumps(meta, indent=2) + "\n")
    if not math.isfinite(loss_v):
        raise RuntimeError(
            f"video editor warm start diverged (loss {loss_v}); see {path / 'mmalign_tiny.json'}"
        )
