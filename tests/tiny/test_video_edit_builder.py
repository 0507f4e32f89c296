"""The tiny video editor's builder (`mmalign.tiny.video_edit`) and the VAE fit options it passes to
`mmalign.tiny.wan.fit_video_vae`: the ink-weighted reconstruction loss and the cosine learning rate, whose
defaults (used by every other tiny Wan builder) leave the plain fit unchanged; and the shipped editor's VAE
on the held-out clips of ``assets/video_edit``."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from mmalign.tiny import wan

REPO = Path(__file__).resolve().parents[2]
EDITOR = REPO / "assets" / "models" / "video_edit-tiny"
CLIPS = REPO / "assets" / "video_edit"


def _vae() -> torch.nn.Module:
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    return AutoencoderKLWan(
        base_dim=8,
        z_dim=4,
        dim_mult=[1, 2, 2],
        num_res_blocks=1,
        temperal_downsample=[False, True],
        scale_factor_temporal=2,
        scale_factor_spatial=4,
    )


def _videos() -> torch.Tensor:
    """Three 5-frame white clips, each with one coloured 8x8 square (red, green, dark blue)."""
    v = torch.ones(3, 5, 3, 32, 32)
    for n, colour in enumerate(([1.0, 0.0, 0.0], [0.0, 0.8, 0.0], [0.1, 0.1, 0.5])):
        v[n, :, :, 4 + 6 * n : 12 + 6 * n, 8:16] = torch.tensor(colour)[:, None, None]
    return v


def _captured(monkeypatch: pytest.MonkeyPatch, **kwargs: Any) -> dict[str, Any]:
    """Run `fit_video_vae` with a stand-in for the optimisation loop that records the first loss, the
    schedule and the optimiser (nothing is trained)."""
    seen: dict[str, Any] = {}

    def fake_fit(opt, steps, loss_at, desc, *, sched=None, **_):
        seen.update(opt=opt, sched=sched, steps=steps)
        with torch.no_grad():
            seen["loss"] = float(loss_at(0))
        return [seen["loss"]]

    monkeypatch.setattr(wan, "fit", fake_fit)
    vae = _vae()
    wan.fit_video_vae(vae, _videos(), steps=4, lr=1e-3, batch_size=2, seed=3, progress=False, **kwargs)
    seen["vae"] = vae
    return seen


def _reference_loss(vae: torch.nn.Module, ink_weight: float) -> float:
    """The loss of the first batch written from the formula: the batch the seeded generator draws, the
    squared error of the decoded posterior mode per pixel (values in [-1, 1]), each pixel weighted by
    1 + ink_weight * (1 - its darkest channel in [0, 1]), the weighted mean, plus 1e-6 * mean KL."""
    videos = _videos()
    idx = torch.randint(0, videos.shape[0], (2,), generator=torch.Generator().manual_seed(3))
    batch = videos[idx]  # [B, F, 3, H, W] in [0, 1]
    x = batch.movedim(2, 1) * 2 - 1
    with torch.no_grad():
        post = vae.encode(x).latent_dist
        rec = vae.decode(post.mode(), return_dict=False)[0]
        sq = (rec - x).pow(2).numpy()  # [B, 3, F, H, W]
        kl = float(post.kl().mean())
    darkest = batch.numpy().min(axis=2)  # [B, F, H, W]
    w = 1.0 + ink_weight * (1.0 - darkest)
    w = np.repeat(w[:, None], 3, axis=1)  # one weight per pixel for its three channels
    return float((sq * w).sum() / w.sum()) + 1e-6 * kl


def test_defaults_are_the_plain_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _captured(monkeypatch)
    assert seen["sched"] is None
    assert seen["loss"] == pytest.approx(_reference_loss(seen["vae"], 0.0), rel=1e-5)


def test_ink_weight_weights_pixels_by_how_far_they_are_from_white(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _captured(monkeypatch, ink_weight=10.0)
    weighted = _reference_loss(seen["vae"], 10.0)
    assert seen["loss"] == pytest.approx(weighted, rel=1e-5)
    # the weighting changes the loss (the random decoder's error differs on the squares and the background)
    assert abs(weighted - _reference_loss(seen["vae"], 0.0)) > 1e-4 * weighted


def test_cosine_decays_the_learning_rate_to_five_percent(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _captured(monkeypatch, cosine=True)
    opt, sched = seen["opt"], seen["sched"]
    lrs = [opt.param_groups[0]["lr"]]
    for _ in range(seen["steps"]):
        opt.step()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    # 1e-3 * (0.05 + 0.95 * (1 + cos(pi s / 4)) / 2) for s = 0..4, worked by hand
    expected = [1e-3, 1e-3 * (0.05 + 0.95 * (1 + math.sqrt(0.5)) / 2), 0.525e-3]
    expected += [1e-3 * (0.05 + 0.95 * (1 - math.sqrt(0.5)) / 2), 0.05e-3]
    assert lrs == pytest.approx(expected, rel=1e-9)


def test_the_builder_passes_its_vae_options(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from mmalign.tiny import video_edit

    seen: dict[str, Any] = {}

    class Stop(Exception):
        pass

    def fake(builder, videos, **kwargs):
        seen.update(kwargs, n=len(videos))
        raise Stop

    monkeypatch.setattr(wan, "fitted_tiny_wan", fake)
    with pytest.raises(Stop):
        video_edit.build_video_edit(
            tmp_path, num_clips=4, vae_ink_weight=2.5, vae_cosine=False, progress=False
        )
    assert seen["vae_ink_weight"] == 2.5 and seen["vae_cosine"] is False and seen["n"] == 8


def test_the_shipped_editor_vae_keeps_what_an_ideal_edit_scores() -> None:
    """The shipped editor's frozen VAE bounds every edit GRPO can reach: decoded through it, the 16 held-out
    ideal target clips (never seen by the builder) must keep their instruction faithfulness within 1 point,
    per edit kind. The former fit (plain MSE, 1200 steps) lost 1.8 (recolour) and 2.5 (remove) points here:
    it blurred the small coloured squares that R_IF looks at."""
    from mmalign.policies.wan_components import decode_video, encode_video, load_wan_components
    from rewards.base import RewardBatch
    from rewards.video import InstructionFaithfulness

    rows = [json.loads(line) for line in (CLIPS / "eval.jsonl").read_text().splitlines() if line.strip()]
    clips = [np.load(CLIPS / r["target_video"])["frames"] for r in rows]
    target = torch.from_numpy(np.stack(clips)).float().div(255).permute(0, 1, 4, 2, 3)
    vae = load_wan_components(str(EDITOR)).vae
    with torch.no_grad():
        decoded = decode_video(vae, encode_video(vae, target))
    columns = {k: [r[k] for r in rows] for k in ("source_caption", "target_caption")}
    score = InstructionFaithfulness(path=str(REPO / "assets" / "models" / "clip_shapes-tiny"))
    prompts = [r["prompt"] for r in rows]
    ideal = score(RewardBatch(prompts=prompts, outputs={"videos": target}, columns=columns))
    through = score(RewardBatch(prompts=prompts, outputs={"videos": decoded}, columns=columns))
    for kind in ("recolour", "remove"):
        m = torch.tensor([r["edit"] == kind for r in rows])
        assert m.sum() == 8
        assert float(through[m].mean()) > float(ideal[m].mean()) - 1.0, (kind, ideal[m], through[m])
