"""Activation checkpointing of the denoisers (``model.gradient_checkpointing``) and the chunked VAE decode
(``options.vae_decode_batch``), for every diffusion family on its tiny offline folder (loaded through the
policy's own `from_pretrained`):

- the log-probs and the parameter gradients of a weighted sum of them are those of the plain path (max abs
  difference <= 1e-6 of the gradient's largest magnitude), while the training forward keeps fewer tensors
  for the backward (counted with ``saved_tensors_hooks``: checkpointing is really on);
- the rollout (no grad) is the same with checkpointing on;
- ``setup`` turns it on from the config (and a `GroupTrainer` step runs with it);
- decoding in chunks gives the pixels of one VAE call, for images and videos.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import Tensor

from mmalign import tiny
from mmalign.config import LoraConfig, config_from_dict
from mmalign.data.batch import Rollout
from mmalign.policies.base import RunInfo
from mmalign.policies.denoising import DenoisingPolicy, SamplerSettings
from rewards import Reward, RewardBatch, RewardSet

REL = 1e-6
"""Gradient tolerance: max |g_ckpt - g_plain| <= REL * max |g_plain| per parameter."""
ROWS = [{"prompt": "a red cat"}, {"prompt": "Two blue dogs, left!"}]
WAN_SIZE = {"num_frames": 9, "height": 32, "width": 32, "max_sequence_length": 16}


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny.build("qwen_image_tiny", tmp_path_factory.mktemp("qwen") / "tiny", announce=False)


@pytest.fixture(scope="module")
def wan_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from mmalign.tiny.wan import build_tiny_wan

    root = tmp_path_factory.mktemp("wan-ckpt")
    return {
        "t2v": build_tiny_wan(root / "t2v"),
        "wan22": build_tiny_wan(root / "wan22", two_experts=True),
        "i2v": build_tiny_wan(root / "i2v", condition="i2v", image_encoder=False),
        "vace": build_tiny_wan(root / "vace", condition="vace"),
    }


@pytest.fixture(scope="module")
def wan_media(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A first frame (PNG) and a 9-frame source clip for the image-to-video and VACE rows."""
    import numpy as np
    from PIL import Image

    root = tmp_path_factory.mktemp("wan-ckpt-media")
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(root / "first.png")
    np.save(root / "clip.npy", rng.integers(0, 256, (9, 32, 32, 3), dtype=np.uint8))
    return root


def _sd3(dirs: dict[str, Any], **kw: Any) -> DenoisingPolicy:
    from mmalign.policies.sd3 import SD3Policy

    return SD3Policy.from_pretrained(
        dirs["sd3"], num_steps=3, seed=0, max_sequence_length=8, guidance_scale=2.0, **kw
    )


def _flux(dirs: dict[str, Any], **kw: Any) -> DenoisingPolicy:
    from mmalign.policies.flux import FluxPolicy

    return FluxPolicy.from_pretrained(dirs["flux"], num_steps=3, seed=0, max_sequence_length=8, **kw)


def _qwen(dirs: dict[str, Any], **kw: Any) -> DenoisingPolicy:
    from mmalign.policies.qwen_image import QwenImagePolicy

    return QwenImagePolicy.from_pretrained(
        dirs["qwen"], num_steps=3, seed=0, latent_size=16, max_sequence_length=24, **kw
    )


def _ddim(dirs: dict[str, Any], **kw: Any) -> DenoisingPolicy:
    from mmalign.policies.ddim import DDIMPolicy

    return DDIMPolicy.from_pretrained(dirs["sd15"], num_steps=3, seed=0, guidance_scale=2.0, **kw)


def _wan(name: str, condition: str = "none") -> Callable[..., DenoisingPolicy]:
    def load(dirs: dict[str, Any], **kw: Any) -> DenoisingPolicy:
        from mmalign.policies.wan import wan_policy_class

        return wan_policy_class(condition).from_pretrained(
            dirs["wan"][name], num_steps=3, seed=0, guidance_scale=2.0, **WAN_SIZE, **kw
        )

    return load


def _rows(name: str, media: Path) -> list[dict[str, Any]]:
    if name == "wan_i2v":
        return [{**r, "image": str(media / "first.png")} for r in ROWS]
    if name == "wan_vace":
        return [{**r, "source_video": str(media / "clip.npy")} for r in ROWS]
    return ROWS


FAMILIES: dict[str, Callable[..., DenoisingPolicy]] = {
    "sd3": _sd3,
    "flux": _flux,
    "qwen_image": _qwen,
    "ddim": _ddim,
    "wan_t2v": _wan("t2v"),
    "wan22": _wan("wan22"),
    "wan_i2v": _wan("i2v", condition="i2v"),
    "wan_vace": _wan("vace", condition="vace"),
}
CASES = [(name, False) for name in FAMILIES] + [("sd3", True), ("wan_t2v", True)]


@pytest.fixture
def dirs(request: pytest.FixtureRequest, wan_dirs: dict[str, Path], qwen_dir: Path) -> dict[str, Any]:
    return {
        "sd3": request.getfixturevalue("tiny_sd3_model_dir"),
        "flux": request.getfixturevalue("tiny_flux_model_dir"),
        "sd15": request.getfixturevalue("tiny_sd15_model_dir"),
        "qwen": qwen_dir,
        "wan": wan_dirs,
    }


def _train_pass(pol: DenoisingPolicy, r: Rollout, weights: Tensor) -> tuple[Tensor, dict[str, Tensor], int]:
    """(log-probs, gradients of sum(weights * logp) by parameter name, bytes the forward saved for the backward
    outside checkpointed regions)."""
    pol.model.zero_grad(set_to_none=True)
    saved = [0]

    def pack(t: Tensor) -> Tensor:
        saved[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp = pol.action_stats(r).logp
    (logp * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in pol.model.named_parameters() if p.grad is not None}
    return logp.detach(), grads, saved[0]


@pytest.mark.parametrize(("name", "lora"), CASES, ids=[f"{n}-{'lora' if lo else 'full'}" for n, lo in CASES])
def test_checkpointed_gradient_equals_the_plain_path(
    name: str, lora: bool, dirs: dict[str, Any], wan_media: Path
) -> None:
    kw = {"lora": LoraConfig(enabled=True, r=4, alpha=8)} if lora else {}
    pol = FAMILIES[name](dirs, **kw)
    rows = _rows(name, wan_media)
    rng = pol.rng_state()
    torch.manual_seed(0)
    r = pol.rollout(rows, 2)
    weights = torch.randn(r.mask.shape, generator=torch.Generator().manual_seed(3))

    assert not pol.gradient_checkpointing
    plain_logp, plain, plain_saved = _train_pass(pol, r, weights)
    pol.set_gradient_checkpointing(True)
    assert pol.gradient_checkpointing and pol.checkpointing_denoisers
    assert all(m.is_gradient_checkpointing for m in pol.checkpointing_denoisers)
    ckpt_logp, ckpt, ckpt_saved = _train_pass(pol, r, weights)

    assert ckpt_saved < plain_saved, (ckpt_saved, plain_saved)  # checkpointing is really on
    torch.testing.assert_close(ckpt_logp, plain_logp, rtol=0, atol=1e-6)
    assert plain.keys() == ckpt.keys() and len(plain) > 0
    worst = 0.0
    for n, g in plain.items():
        scale = float(g.abs().max())
        diff = float((ckpt[n] - g).abs().max())
        assert diff <= REL * scale, (n, diff, scale)
        worst = max(worst, diff / scale if scale else 0.0)
    assert any(float(g.abs().max()) > 0 for g in plain.values())
    print(
        f"{name} ({'LoRA' if lora else 'full'}): {len(plain)} gradients, max |diff| / max |g| = {worst:.1e}; "
        f"saved for backward {plain_saved / 2**20:.2f} -> {ckpt_saved / 2**20:.2f} MiB"
    )

    # the rollout runs without grad: the same samples and log-probs with checkpointing on
    pol.load_rng_state(rng)
    torch.manual_seed(0)
    again = pol.rollout(rows, 2)
    torch.testing.assert_close(again.logp_old, r.logp_old, rtol=0, atol=0)
    torch.testing.assert_close(again.outputs["latents"], r.outputs["latents"], rtol=0, atol=0)

    pol.set_gradient_checkpointing(False)
    assert not any(m.is_gradient_checkpointing for m in pol.checkpointing_denoisers)


def test_two_experts_are_both_checkpointed(dirs: dict[str, Any]) -> None:
    pol = FAMILIES["wan22"](dirs)
    pol.set_gradient_checkpointing(True)
    assert [type(m).__name__ for m in pol.checkpointing_denoisers] == ["WanTransformer3DModel"] * 2
    assert pol.checkpointing_denoisers == [pol.transformer, pol.transformer_2]


def _config(gc: bool, out: Path, **algorithm: Any) -> Any:
    return config_from_dict(
        {
            "pipeline": "checkpointing_test",
            "output_dir": str(out),
            "model": {"gradient_checkpointing": gc},
            "rollout": {"group_size": 2, "prompts_per_step": 2},
            "rewards": [{"name": f"{__name__}:ImageMean", "alias": "mean"}],
            "algorithm": algorithm,
            "trainer": {"steps": 1, "lr": 1e-3, "progress_bar": False, "save_every": 100},
        },
        "test.yaml",
    )


class ImageMean(Reward):
    """Mean pixel value (continuous, different for every sample)."""

    needs = {"images"}

    def __call__(self, batch: RewardBatch) -> Tensor:
        return batch.outputs["images"].float().mean(dim=(1, 2, 3))


def test_setup_applies_the_config_key(dirs: dict[str, Any], tmp_path: Path) -> None:
    pol = FAMILIES["sd3"](dirs)
    pol.setup(RunInfo(cfg=_config(False, tmp_path), accelerator=None))
    assert not pol.gradient_checkpointing
    pol.setup(RunInfo(cfg=_config(True, tmp_path), accelerator=None))
    assert pol.gradient_checkpointing and pol.model.is_gradient_checkpointing
    # the forward-process objectives' setup path too
    other = FAMILIES["flux"](dirs)
    other.setup(
        RunInfo(cfg=_config(True, tmp_path, objective="diffusion_nft", solver="euler"), accelerator=None)
    )
    assert other.objective == "diffusion_nft" and other.model.is_gradient_checkpointing


def test_a_trainer_step_runs_with_checkpointing(dirs: dict[str, Any], tmp_path: Path) -> None:
    from mmalign.training.trainer import GroupTrainer
    from pipelines import TrainingSetup

    pol = FAMILIES["ddim"](dirs)
    before = {n: p.detach().clone() for n, p in pol.model.named_parameters()}
    cfg = _config(True, tmp_path / "run")
    trainer = GroupTrainer(cfg, TrainingSetup(policy=pol, rewards=RewardSet(cfg.rewards), data=list(ROWS)))
    history = trainer.train()
    assert [m["step"] for m in history] == [1]
    assert pol.gradient_checkpointing and pol.model.is_gradient_checkpointing
    assert any(not torch.equal(p, before[n]) for n, p in pol.model.named_parameters())


def test_a_denoiser_without_support_is_refused() -> None:
    class Plain(torch.nn.Module):
        pass

    holder = SimpleNamespace(model=Plain())
    with pytest.raises(ValueError, match="supports gradient checkpointing"):
        DenoisingPolicy.set_gradient_checkpointing(holder, True)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- chunked VAE decode


@pytest.mark.parametrize("name", ["sd3", "flux", "qwen_image", "ddim", "wan_t2v"])
def test_chunked_decode_equals_one_call(name: str, dirs: dict[str, Any]) -> None:
    """Decoding 5 samples in chunks of 2 (and 'auto') gives the pixels of decoding all 5 in one VAE call."""
    pol = FAMILIES[name](dirs)
    torch.manual_seed(0)
    z = torch.randn(5, *pol.latent_shape())
    calls: list[int] = []
    inner = pol.decode_latents

    def counting(x: Tensor) -> Tensor:
        calls.append(x.shape[0])
        return inner(x)

    pol.decode_latents = counting  # type: ignore[method-assign]
    out: dict[Any, Tensor] = {}
    for k in (None, 2, "auto"):
        pol.sampler = pol.sampler.sampler_settings(vae_decode_batch=k)
        r = Rollout(
            group=torch.zeros(5, dtype=torch.long),
            mask=torch.ones(5, 1, dtype=torch.bool),
            prompts=[""] * 5,
            outputs={"latents": z.clone()},
        )
        calls.clear()
        pol.materialize(r, {"images", "videos"})
        kind = "videos" if name.startswith("wan") else "images"
        out[k] = r.outputs[kind]
        expected = {None: [5], 2: [2, 2, 1], "auto": [1] * 5 if kind == "videos" else [5]}[k]
        assert calls == expected, (k, calls)
    assert out[None].shape[0] == 5 and out[None].ndim == (5 if name.startswith("wan") else 4)
    torch.testing.assert_close(out[2], out[None], rtol=0, atol=1e-5)  # fp32: batched convs round differently
    torch.testing.assert_close(out["auto"], out[None], rtol=0, atol=1e-5)


def test_vae_decode_batch_is_validated() -> None:
    assert SamplerSettings().vae_decode_batch == "auto"
    for bad in (0, -1, "all", True, 2.5):
        with pytest.raises(ValueError, match="vae_decode_batch"):
            SamplerSettings(vae_decode_batch=bad)
    assert SamplerSettings(vae_decode_batch=None).vae_decode_batch is None


# ----------------------------------------------------------------------------- rollout in chunks of groups


@pytest.mark.parametrize("name", ["sd3", "wan_t2v"])
def test_rollout_in_chunks_of_groups(name: str, dirs: dict[str, Any], tmp_path: Path) -> None:
    """``rollout.batch_size`` 4 with 3 prompts x 2 samples: the denoiser never sees more than 4 samples (x 2 CFG
    branches) at once, the groups stay whole and numbered 0..2, one window of trained steps serves the whole
    batch, and re-scoring the concatenated rollout gives ratio 1."""
    pol = FAMILIES[name](dirs, window_size=2)
    cfg = _config(False, tmp_path)
    cfg.rollout.batch_size = 4
    pol.setup(RunInfo(cfg=cfg, accelerator=None))
    assert pol.rollout_batch_size == 4
    seen: list[int] = []
    hook = pol.model.register_forward_pre_hook(
        lambda m, args, kw: seen.append(kw["hidden_states"].shape[0]), with_kwargs=True
    )
    rows = [{"prompt": p} for p in ("a red cat", "two blue dogs", "one green bird")]
    r = pol.rollout(rows, 2)
    hook.remove()
    assert max(seen) == 2 * 2 * 2 and len(r) == 6  # chunks of 2 prompts x 2 samples, CFG doubles the rows
    assert r.group.tolist() == [0, 0, 1, 1, 2, 2]
    assert r.prompts == ["a red cat"] * 2 + ["two blue dogs"] * 2 + ["one green bird"] * 2
    assert (r.payload["step_index"] == r.payload["step_index"][0]).all()  # one window for the batch
    with torch.no_grad():
        logp = pol.action_stats(r).logp
    torch.testing.assert_close(logp, r.logp_old, rtol=0, atol=1e-5)
    pol.rollout_batch_size = None
    seen.clear()
    hook = pol.model.register_forward_pre_hook(
        lambda m, args, kw: seen.append(kw["hidden_states"].shape[0]), with_kwargs=True
    )
    whole = pol.rollout(rows, 2)
    hook.remove()
    assert max(seen) == 12 and whole.group.tolist() == r.group.tolist()


def test_objective_rollout_in_chunks_of_groups(dirs: dict[str, Any], tmp_path: Path) -> None:
    """A forward-process objective's clean-latent rollout (DiffusionNFT, Euler solver) is chunked the same way."""
    pol = FAMILIES["flux"](dirs)
    cfg = _config(False, tmp_path, objective="diffusion_nft", solver="euler")
    cfg.rollout.batch_size = 2
    pol.setup(RunInfo(cfg=cfg, accelerator=None))
    seen: list[int] = []
    hook = pol.model.register_forward_pre_hook(
        lambda m, args, kw: seen.append(kw["hidden_states"].shape[0]), with_kwargs=True
    )
    r = pol.rollout([{"prompt": "a"}, {"prompt": "b"}, {"prompt": "c"}], 2)
    hook.remove()
    assert set(seen) == {2} and len(r) == 6 and r.group.tolist() == [0, 0, 1, 1, 2, 2]
    assert r.payload["clean_latents"].shape[0] == 6 and r.prompts == ["a", "a", "b", "b", "c", "c"]
