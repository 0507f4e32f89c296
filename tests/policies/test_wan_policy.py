"""WanPolicy on tiny offline Wan folders (`mmalign.tiny.wan`): the folder round trip, prompt encoding and decoding
against diffusers' own Wan pipelines, the VAE factors, ratio 1 on re-scoring for every condition, the concat
payload, SDEdit's truncated schedule and initial latents, the VACE control tensor against
``WanVACEPipeline``, Wan2.2's two experts, deterministic sampling with the folder's UniPC scheduler against
``WanPipeline``, and image to video against ``WanImageToVideoPipeline`` (conditioning, CLIP states, the whole
ODE sampler)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mmalign.config import LoraConfig
from mmalign.policies.wan import (
    CONDITIONS,
    WanConcatPolicy,
    WanExperts,
    WanImageToVideoPolicy,
    WanPolicy,
    WanSDEditPolicy,
    WanVACEPolicy,
    wan_policy_class,
)
from mmalign.policies.wan_components import (
    encode_video,
    load_wan_components,
    vace_control_tensor,
    vae_factors,
)
from mmalign.tiny.wan import build_tiny_wan

SIZE = {"num_frames": 9, "height": 32, "width": 32, "max_sequence_length": 16}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("wan")
    return {
        "t2v": build_tiny_wan(root / "t2v"),
        "concat": build_tiny_wan(root / "concat", condition="concat"),
        "vace": build_tiny_wan(root / "vace", condition="vace"),
        "wan22": build_tiny_wan(root / "wan22", two_experts=True),
        "t2v_unipc": build_tiny_wan(root / "t2v_unipc", scheduler="unipc"),
        "i2v": build_tiny_wan(root / "i2v", condition="i2v"),
        "i2v_noclip": build_tiny_wan(root / "i2v_noclip", condition="i2v", image_encoder=False),
    }


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Two 9-frame 32x32 source clips, an edit mask and a 16x24 reference image, as .npy files."""
    root = tmp_path_factory.mktemp("wan_media")
    rng = np.random.default_rng(0)
    out = {}
    for name in ("a", "b"):
        out[name] = str(root / f"{name}.npy")
        np.save(out[name], rng.integers(0, 256, (9, 32, 32, 3), dtype=np.uint8))
    mask = np.zeros((9, 32, 32), np.uint8)
    mask[:, 8:24, 4:20] = 255
    out["mask"] = str(root / "mask.npy")
    np.save(out["mask"], mask)
    out["ref"] = str(root / "ref.npy")
    np.save(out["ref"], rng.integers(0, 256, (1, 16, 24, 3), dtype=np.uint8))
    from PIL import Image

    for name in ("first", "second"):  # first frames for image to video, as PNG files
        out[name] = str(root / f"{name}.png")
        Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(out[name])
    return out


def rows(media: dict[str, str]) -> list[dict[str, object]]:
    return [
        {"prompt": "a red  ball &amp; a box", "source_video": media["a"], "edit_mask": media["mask"]},
        {"prompt": "a blue cube", "source_video": media["b"]},
    ]


def make(path, condition: str = "none", **kw) -> WanPolicy:
    """The policy class of `condition` (as the pipelines pick it) loaded from `path` at the tiny size."""
    for k, v in {**SIZE, "num_steps": 4, "seed": 0}.items():
        kw.setdefault(k, v)
    return wan_policy_class(condition).from_pretrained(path, **kw)


# ----------------------------------------------------------------------------- folders, factors, prompts


def test_builders_registered_and_folder_layout(folders):
    from mmalign import tiny

    names = tiny.load_builders()
    assert {"wan_t2v_tiny", "wan_concat_tiny", "wan_vace_tiny", "wan22_tiny"} <= set(names)
    for sub in ("transformer", "vae", "scheduler", "text_encoder", "tokenizer", "model_index.json"):
        assert (folders["t2v"] / sub).exists()
    assert (folders["wan22"] / "transformer_2").is_dir()
    c = load_wan_components(folders["wan22"])
    assert c.boundary_ratio == 0.875 and c.transformer_2 is not None
    # a real Wan2.2 folder's UniPC scheduler becomes a flow-matching Euler one with shift = flow_shift for the
    # SDE, and is kept for deterministic sampling
    assert type(c.scheduler).__name__ == "FlowMatchEulerDiscreteScheduler" and c.scheduler.config.shift == 3.0
    assert type(c.ode_scheduler).__name__ == "UniPCMultistepScheduler"
    assert load_wan_components(folders["t2v"]).ode_scheduler is None  # Euler folder: one scheduler
    assert "wan_i2v_tiny" in names
    i2v = load_wan_components(folders["i2v"])
    assert i2v.is_i2v and type(i2v.image_encoder).__name__ == "CLIPVisionModel"
    assert (
        json.loads((folders["i2v"] / "model_index.json").read_text())["_class_name"]
        == "WanImageToVideoPipeline"
    )
    assert load_wan_components(folders["i2v_noclip"]).image_encoder is None


def test_vae_factors_read_from_config():
    from diffusers import AutoencoderKLWan

    def vae(down, **kw):
        return AutoencoderKLWan(
            base_dim=8, z_dim=4, dim_mult=[1] * (len(down) + 1), num_res_blocks=1, temperal_downsample=down,
            latents_mean=[0.0] * 4, latents_std=[1.0] * 4, **kw,
        )  # fmt: skip

    assert vae_factors(vae([False, True], scale_factor_temporal=2, scale_factor_spatial=4)) == (2, 4)
    assert vae_factors(vae([False, True, True])) == (4, 8)  # the real Wan 2.1 VAE's factors
    assert vae_factors(vae([True, True, False], scale_factor_temporal=4, scale_factor_spatial=8)) == (4, 8)
    with pytest.raises(ValueError, match="scale_factor_spatial"):
        vae_factors(vae([False, True], scale_factor_temporal=2))  # default spatial 8 disagrees with 4


def test_round_trip_save_and_from_pretrained(folders, tmp_path):
    from diffusers import WanPipeline

    pol = make(folders["t2v"])
    with torch.no_grad():
        for p in pol.trainable_parameters():
            p.add_(0.01)
    pol.save(tmp_path / "saved")
    again = make(tmp_path / "saved")
    for (n, p), (_, q) in zip(pol.model.named_parameters(), again.model.named_parameters(), strict=True):
        assert torch.equal(p, q), n
    pipe = WanPipeline.from_pretrained(tmp_path / "saved")
    assert torch.equal(pipe.transformer.patch_embedding.weight, pol.model.patch_embedding.weight)

    lora = make(folders["t2v"], lora=LoraConfig(enabled=True, r=2, alpha=4))
    assert all("lora" in n for n, p in lora.model.named_parameters() if p.requires_grad)
    lora.save(tmp_path / "lora")
    assert (tmp_path / "lora" / "transformer_lora").is_dir()


def test_prompt_embeds_equal_wan_pipeline(folders):
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(folders["t2v"])
    pol = make(folders["t2v"])
    prompts = ["a red  ball &amp; a box", "", "x" * 40]
    ours = pol.encode_prompt(prompts)
    with torch.no_grad():  # as WanPipeline.__call__ runs it (grad mode changes the attention kernel)
        theirs, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False, max_sequence_length=16)
    assert ours.shape == (3, 16, 16)
    torch.testing.assert_close(ours, theirs.float(), rtol=0, atol=0)
    assert float(ours[1, 1:].abs().sum()) == 0.0  # zeros past the prompt's own tokens ("" is one </s>)


def test_latent_shape_and_size_checks(folders):
    pol = make(folders["t2v"])
    assert pol.latent_shape() == (4, 5, 8, 8)  # (9 - 1) // 2 + 1 frames, 32 / 4 pixels
    with pytest.raises(
        ValueError, match="num_frames must be 1 \\+ a multiple of the VAE's temporal factor 2"
    ):
        make(folders["t2v"], num_frames=8)
    with pytest.raises(ValueError, match="multiples of 8"):
        make(folders["t2v"], height=36)
    with pytest.raises(ValueError, match="in_channels"):
        make(folders["t2v"], condition="concat")
    with pytest.raises(ValueError, match="WanVACETransformer3DModel"):
        make(folders["vace"], condition="concat")
    with pytest.raises(ValueError, match="two-expert"):
        make(folders["t2v"], train_expert="high")


# ----------------------------------------------------------------------------- conditions as classes


def test_every_condition_name_has_its_class():
    classes = {
        "none": WanPolicy,
        "concat": WanConcatPolicy,
        "sdedit": WanSDEditPolicy,
        "vace": WanVACEPolicy,
        "i2v": WanImageToVideoPolicy,
    }
    assert CONDITIONS == tuple(classes)
    for name, cls in classes.items():
        assert wan_policy_class(name) is cls and cls.condition == name
    with pytest.raises(
        ValueError, match="condition must be one of none, concat, sdedit, vace, i2v; got 'blur'"
    ):
        wan_policy_class("blur")


def test_condition_hooks_set_channels_keys_and_schedule(folders):
    t2v, concat, i2v = (
        make(folders["t2v"]),
        make(folders["concat"], "concat"),
        make(folders["i2v_noclip"], "i2v"),
    )
    vace = make(folders["vace"], "vace")
    sdedit = make(folders["t2v"], "sdedit", sdedit_strength=0.6, num_steps=10)
    # the transformers' own in_channels (mmalign.tiny.wan) with the VAE's z_dim 4 and temporal factor 2
    assert [p.extra_in_channels(4) for p in (t2v, concat, i2v, vace, sdedit)] == [0, 4, 6, 0, 0]
    assert int(concat.transformer.config.in_channels) == 8 and int(i2v.transformer.config.in_channels) == 10
    assert [p.row_conditioning_keys for p in (t2v, concat, i2v, vace, sdedit)] == [
        (),
        ("source_latents",),
        ("image_latents",),
        ("control_latents",),
        (),
    ]
    full = make(folders["t2v"], num_steps=10).sigmas()  # the same folder as text to video: the whole schedule
    torch.testing.assert_close(sdedit.sigmas(), torch.cat([torch.tensor([0.6]), full[full < 0.6 - 1e-3]]))
    # a deterministic sampler on a folder with UniPC: the folder's scheduler, but never for SDEdit (Euler)
    assert make(folders["t2v_unipc"], noise_level=0.0).uses_ode_scheduler() is True
    assert make(folders["t2v_unipc"], "sdedit", noise_level=0.0).uses_ode_scheduler() is False
    # an option belongs to its condition's class only
    with pytest.raises(TypeError, match="sdedit_strength"):
        make(folders["t2v"], sdedit_strength=0.6)
    with pytest.raises(TypeError, match="num_reference_frames"):
        make(folders["concat"], "concat", num_reference_frames=1)
    with pytest.raises(ValueError, match="num_reference_frames must be >= 0"):
        make(folders["vace"], "vace", num_reference_frames=-1)


# ----------------------------------------------------------------------------- rollout and scoring


@pytest.mark.parametrize(
    "name,condition,kind",
    [
        ("t2v", "none", "flow_sde"),
        ("t2v", "none", "cps"),
        ("t2v", "sdedit", "flow_sde"),
        ("concat", "concat", "flow_sde"),
        ("concat", "concat", "cps"),
        ("vace", "vace", "flow_sde"),
    ],
)
def test_ratio_is_one_on_rescoring(folders, media, name, condition, kind):
    pol = make(
        folders[name], condition=condition, sde_kind=kind, noise_level=0.5, window_size=2, guidance_scale=2.0
    )
    r = pol.rollout(rows(media), 2)
    assert r.num_actions == 2 and r.outputs["latents"].shape == (4, 4, 5, 8, 8)
    stats = pol.action_stats(r)
    torch.testing.assert_close(torch.exp(stats.logp - r.logp_old), torch.ones(4, 2), rtol=0, atol=1e-5)
    stats.logp.sum().backward()  # batch 4 forward + backward (the VACE blocks included)
    grads = [p.grad for p in pol.trainable_parameters()]
    assert all(g is not None for g in grads) and any(float(g.abs().sum()) > 0 for g in grads)
    assert r.outputs["source_videos"].shape == (4, 9, 3, 32, 32)
    masks = r.outputs["edit_masks"]
    assert masks.shape == (4, 9, 32, 32) and float(masks[2:].min()) == 1.0  # the second row has no mask


def test_decode_equals_wan_pipeline(folders):
    """The policy's decode of latents z equals WanPipeline's own decode path (its callback hands it z)."""
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(folders["t2v"])
    pol = make(folders["t2v"])
    z = torch.randn(2, 4, 5, 8, 8, generator=torch.Generator().manual_seed(1))
    ours = pol.decode_latents(z)
    out = pipe(
        prompt=["a", "b"],
        num_frames=9,
        height=32,
        width=32,
        num_inference_steps=1,
        guidance_scale=1.0,
        max_sequence_length=16,
        output_type="pt",
        callback_on_step_end=lambda p, i, t, kw: {"latents": z},
    ).frames
    assert ours.shape == (2, 9, 3, 32, 32) and out.shape == ours.shape
    torch.testing.assert_close(ours, out.float(), rtol=0, atol=1e-6)


def test_concat_source_latents_are_stored_and_used(folders, media):
    from mmalign.data.media import read_video

    pol = make(folders["concat"], condition="concat")
    r = pol.rollout(rows(media), 2)
    src = r.payload["source_latents"]
    assert src.shape == (4, 4, 5, 8, 8)
    expected = encode_video(pol.vae, read_video(media["b"], num_frames=9, size=(32, 32))[None])[0]
    torch.testing.assert_close(src[3], expected, rtol=0, atol=0)
    with torch.no_grad():
        base = pol.action_stats(r).logp
        r.payload["source_latents"] = src + 1.0
        changed = pol.action_stats(r).logp
    assert not torch.allclose(base, changed)


def test_sdedit_actions_and_initial_latents(folders, media):
    from diffusers import FlowMatchEulerDiscreteScheduler

    from mmalign.data.media import read_video

    pol = make(folders["t2v"], condition="sdedit", sdedit_strength=0.6, num_steps=10)
    sched = FlowMatchEulerDiscreteScheduler.from_pretrained(folders["t2v"], subfolder="scheduler")
    sched.set_timesteps(10)
    below = sched.sigmas[sched.sigmas < 0.6 - 1e-3]  # the schedule's sigmas below the strength, 0 included
    assert 2 <= len(below) - 1 < 10
    assert pol.num_denoising_steps() == len(below)  # 0.6 -> below[0], then the steps between them
    r = pol.rollout(rows(media), 1)
    assert r.num_actions == len(below) and r.payload["step_index"][0].tolist() == list(range(len(below)))
    torch.testing.assert_close(r.payload["sigmas"][0], torch.cat([torch.tensor([0.6]), below[:-1]]))
    torch.testing.assert_close(r.payload["sigmas_next"][0], below)
    near = make(
        folders["t2v"], condition="sdedit", sdedit_strength=float(sched.sigmas[6]) + 5e-4, num_steps=10
    )
    assert float(near.sigmas()[1]) == float(sched.sigmas[7])  # no near-zero first step
    full = make(folders["t2v"], condition="sdedit", sdedit_strength=1.0, num_steps=10)
    torch.testing.assert_close(full.sigmas(), sched.sigmas)  # strength 1: the text-to-video schedule

    # the initial latents by hand: (1 - s) z_src + s eps, z_src the normalised VAE posterior mode
    pol.generator.manual_seed(5)
    got = pol.initial_latents(torch.arange(2), {}, {"source_video": [media["a"], media["b"]]})
    eps = torch.randn((2, 4, 5, 8, 8), generator=torch.Generator().manual_seed(5))
    vae = pol.vae
    mean = torch.tensor(vae.config.latents_mean).view(1, 4, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, 4, 1, 1, 1)
    zs = []
    for path in (media["a"], media["b"]):
        pix = read_video(path, num_frames=9, size=(32, 32)).permute(1, 0, 2, 3)[None] * 2 - 1
        zs.append((vae.encode(pix).latent_dist.mode() - mean) / std)
    z = torch.cat(zs)
    torch.testing.assert_close(got, 0.4 * z + 0.6 * eps, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- VACE


def _pipe_control(pipe, video: torch.Tensor, mask: torch.Tensor, refs: list[torch.Tensor]) -> torch.Tensor:
    """WanVACEPipeline's own control tensor of one video [F, 3, H, W] in [0, 1] and mask [F, H, W]."""
    v = video.permute(1, 0, 2, 3)[None] * 2 - 1  # [1, 3, F, H, W] in [-1, 1], as preprocess_video gives
    m = mask[None, None].expand(1, 3, -1, -1, -1)
    lat = pipe.prepare_video_latents(v, m, [refs])
    masks = pipe.prepare_masks(m, [refs])
    return torch.cat([lat.float(), masks.float()], dim=1)[0]


def test_vace_control_tensor_equals_pipeline(folders, media):
    from diffusers import WanVACEPipeline
    from PIL import Image

    from mmalign.data.media import read_mask, read_video

    pipe = WanVACEPipeline.from_pretrained(folders["vace"])
    videos = torch.stack([read_video(media[k], num_frames=9, size=(32, 32)) for k in ("a", "b")])
    masks = torch.stack([read_mask(media["mask"], num_frames=9, size=(32, 32)), torch.ones(9, 32, 32)])
    patch = int(pipe.transformer.config.patch_size[1])
    both = vace_control_tensor(pipe.vae, videos, masks, patch_size=patch)
    assert both.shape == (2, 4 + 4 + 16, 5, 8, 8)  # 2 z_dim + (spatial factor 4)^2
    for i in range(2):
        one = vace_control_tensor(pipe.vae, videos[i : i + 1], masks[i : i + 1], patch_size=patch)[0]
        torch.testing.assert_close(both[i], one, rtol=0, atol=1e-6)
        torch.testing.assert_close(one, _pipe_control(pipe, videos[i], masks[i], []), rtol=0, atol=1e-5)

    # a reference image of another size, letterboxed on white as the pipeline's preprocess_conditions does
    ref = read_video(media["ref"])[0]
    ref_pil = Image.fromarray((ref.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8))
    frames = [
        Image.fromarray(f) for f in (videos[0].permute(0, 2, 3, 1).numpy() * 255).round().astype(np.uint8)
    ]
    _, _, refs = pipe.preprocess_conditions(frames, None, ref_pil, 1, 32, 32, 9, torch.float32, "cpu")
    ours = vace_control_tensor(pipe.vae, videos[:1], masks[:1], patch_size=patch, reference_frames=[[ref]])[0]
    assert ours.shape == (24, 6, 8, 8)
    torch.testing.assert_close(ours, _pipe_control(pipe, videos[0], masks[0], refs[0]), rtol=0, atol=1e-5)


def test_vace_reference_frames_in_rollout(folders, media):
    pol = make(folders["vace"], condition="vace", num_reference_frames=1, window_size=2)
    assert pol.latent_shape() == (4, 6, 8, 8)
    rr = [dict(r, reference_frames=media["ref"]) for r in rows(media)]
    r = pol.rollout(rr, 1)
    assert r.payload["control_latents"].shape == (2, 24, 6, 8, 8)
    stats = pol.action_stats(r)
    torch.testing.assert_close(stats.logp, r.logp_old, rtol=0, atol=1e-5)
    assert pol.decode(r).shape == (2, 9, 3, 32, 32)  # the reference frame is dropped before decoding
    with pytest.raises(ValueError, match="num_reference_frames"):
        pol.rollout(rows(media), 1)


# ----------------------------------------------------------------------------- two experts


def test_two_experts_follow_wan_pipeline_rule(folders):
    """The expert of every step equals the one WanPipeline calls (hooks on both experts record it)."""
    from diffusers import WanPipeline

    pol = make(folders["wan22"], num_steps=10)
    pipe = WanPipeline.from_pretrained(folders["wan22"])
    pipe.scheduler = pol.scheduler  # the flow-matching scheduler the policy samples with
    calls: list[int] = []
    pipe.transformer.register_forward_hook(lambda *a: calls.append(0))
    pipe.transformer_2.register_forward_hook(lambda *a: calls.append(1))
    pipe("a", num_frames=9, height=32, width=32, num_inference_steps=10, guidance_scale=1.0,
         max_sequence_length=16, output_type="latent")  # fmt: skip
    assert pol.step_experts.tolist() == calls
    assert 0 < sum(calls) < 10  # both experts are used


@pytest.mark.parametrize("train_expert", ["high", "low", "both"])
def test_two_experts_ratio_and_grads(folders, media, train_expert):
    pol = make(
        folders["wan22"], num_steps=6, train_expert=train_expert, train_fraction=0.5, guidance_scale=2.0
    )
    assert isinstance(pol.model, WanExperts)
    r = pol.rollout(rows(media), 2)
    experts = r.payload["expert"]
    assert torch.equal(experts, pol.step_experts[r.payload["step_index"]])
    if train_expert != "both":
        assert (experts == (0 if train_expert == "high" else 1)).all()
    stats = pol.action_stats(r)
    torch.testing.assert_close(
        torch.exp(stats.logp - r.logp_old), torch.ones_like(r.logp_old), rtol=0, atol=1e-5
    )
    stats.logp.sum().backward()
    for name, module in (("high", pol.transformer), ("low", pol.transformer_2)):
        trained = train_expert in (name, "both")
        assert all(p.requires_grad == trained for p in module.parameters())
        if trained:
            assert any(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in module.parameters())
        else:
            assert all(p.grad is None for p in module.parameters())
    shares = pol.rollout_stats(r)
    torch.testing.assert_close(shares["expert_high_share"] + shares["expert_low_share"], torch.ones(4))


def test_two_experts_lora_on_both(folders, media, tmp_path):
    pol = make(folders["wan22"], lora=LoraConfig(enabled=True, r=2, alpha=4), need_reference=True)
    trainable = [n for n, p in pol.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora" in n for n in trainable)
    assert any(n.startswith("high.") for n in trainable) and any(n.startswith("low.") for n in trainable)
    r = pol.rollout(rows(media), 1)
    stats = pol.action_stats(r)
    torch.testing.assert_close(pol.reference_logprobs(r), r.logp_old, rtol=0, atol=1e-5)
    assert float(stats.kl.detach().abs().max()) < 1e-8
    pol.save(tmp_path / "saved")
    assert (tmp_path / "saved" / "transformer_lora").is_dir() and (
        tmp_path / "saved" / "transformer_2_lora"
    ).is_dir()
    again = make(tmp_path / "saved")
    assert again.boundary_ratio == 0.875 and isinstance(again.model, WanExperts)


def test_frozen_expert_is_shared_with_the_reference(folders, media):
    pol = make(folders["wan22"], num_steps=6, train_expert="high", need_reference=True)
    assert pol.ref_model.low is pol.transformer_2 and pol.ref_model.high is not pol.transformer
    r = pol.rollout(rows(media), 1)
    stats = pol.action_stats(r)
    assert float(stats.kl.detach().abs().max()) < 1e-8
    assert (r.payload["step_index"] < int((pol.step_experts == 0).sum())).all()  # the high-noise prefix


def test_edit_mask_in_some_rows_only(folders, media):
    pol = make(folders["t2v"])
    r = pol.rollout([{"prompt": "a", "source_video": media["a"]}, rows(media)[0]], 1)
    masks = r.outputs["edit_masks"]
    assert float(masks[0].min()) == 1.0 and float(masks[1].mean()) < 1.0


def test_editing_needs_a_source_video(folders, media):
    pol = make(folders["concat"], condition="concat")
    with pytest.raises(ValueError, match="condition 'concat' needs a source_video in every row"):
        pol.rollout([{"prompt": "a"}, {"prompt": "b", "source_video": media["a"]}], 1)
    with pytest.raises(ValueError, match="reference_frames"):
        pol.rollout([dict(r, reference_frames=media["ref"]) for r in rows(media)], 1)
    with pytest.raises(ValueError, match="sdedit_strength"):
        make(folders["t2v"], condition="sdedit", sdedit_strength=0.0)


# ----------------------------------------------------------------------------- UniPC for deterministic sampling


def _pipe_latents(pipe, noise: torch.Tensor, cfg: float, steps: int, **kw) -> torch.Tensor:
    b = noise.shape[0]
    return pipe(
        prompt=["a red  ball &amp; a box"] * b,
        negative_prompt=[""] * b,
        guidance_scale=cfg,
        num_frames=9,
        height=32,
        width=32,
        num_inference_steps=steps,
        latents=noise,
        max_sequence_length=kw.pop("max_sequence_length", 16),
        output_type="latent",
        **kw,
    ).frames.float()


def _ode(pol: WanPolicy, rows_: list[dict], seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """(initial noise, final latents) of the policy's deterministic sampler, one sample per row."""
    assert pol.sampler.deterministic
    pol.generator.manual_seed(seed)
    noise = pol._initial_noise(torch.arange(len(rows_)))
    pol.generator.manual_seed(seed)
    r = pol.rollout(rows_, 1, compute_logp=False)
    assert r.num_actions == 0
    return noise, r.outputs["latents"]


@pytest.mark.parametrize("name", ["t2v_unipc", "wan22", "t2v"])
def test_ode_sampler_equals_wan_pipeline(folders, name):
    """noise_level 0: the folder's own scheduler (UniPC's multistep updates and integer timesteps; the Euler one
    for an Euler folder) from the same initial noise gives WanPipeline's latents; two experts switch as it does."""
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(folders[name])
    pol = make(folders[name], num_steps=6, noise_level=0.0, guidance_scale=3.0)
    assert pol.uses_ode_scheduler() == (name != "t2v")
    assert type(pipe.scheduler).__name__ == (
        "FlowMatchEulerDiscreteScheduler" if name == "t2v" else "UniPCMultistepScheduler"
    )
    noise, ours = _ode(pol, [{"prompt": "a red  ball &amp; a box"}] * 2)
    theirs = _pipe_latents(pipe, noise, 3.0, 6)
    rel = float((ours - theirs).abs().max() / theirs.abs().max())
    print(f"Wan ODE parity ({name}, {type(pipe.scheduler).__name__}): max relative difference {rel:.2e}")
    assert rel < 1e-5
    if name == "t2v_unipc":  # and UniPC really differs from Euler at these steps
        euler = make(folders["t2v"], num_steps=6, noise_level=0.0, guidance_scale=3.0)
        euler.model.load_state_dict(pol.model.state_dict())
        assert float((_ode(euler, [{"prompt": "a red  ball &amp; a box"}] * 2)[1] - ours).abs().max()) > 1e-3


def test_training_keeps_the_euler_schedule_and_save_keeps_unipc(folders, tmp_path):
    pol = make(folders["t2v_unipc"], num_steps=6, noise_level=0.7)
    assert not pol.uses_ode_scheduler() and "timesteps" not in pol.schedule_keys
    from diffusers import FlowMatchEulerDiscreteScheduler

    euler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    euler.set_timesteps(6)
    torch.testing.assert_close(pol.sigmas(), euler.sigmas)
    with pol.evaluation_sampler():  # eval_noise_level 0: the ODE with UniPC, restored afterwards
        assert pol.uses_ode_scheduler() and pol.schedule()["timesteps"].tolist()[0] == 999.0
    assert not pol.uses_ode_scheduler()
    pol.save(tmp_path / "saved")
    cfg = json.loads((tmp_path / "saved" / "scheduler" / "scheduler_config.json").read_text())
    assert cfg["_class_name"] == "UniPCMultistepScheduler" and cfg["flow_shift"] == 3.0
    again = make(tmp_path / "saved", noise_level=0.0)
    assert again.uses_ode_scheduler()


# ----------------------------------------------------------------------------- image to video


def _i2v_pipe(folder):
    from diffusers import WanImageToVideoPipeline

    return WanImageToVideoPipeline.from_pretrained(folder)


def test_i2v_condition_and_image_states_equal_the_pipeline(folders, media):
    from PIL import Image

    from mmalign.policies.wan_components import encode_image, i2v_condition

    pipe = _i2v_pipe(folders["i2v"])
    img = Image.open(media["first"]).convert("RGB")
    frame = torch.from_numpy(np.array(img)).permute(2, 0, 1).float()[None] / 255
    pixels = pipe.video_processor.preprocess(img, height=32, width=32).float()
    _, theirs = pipe.prepare_latents(pixels, 1, 4, 32, 32, 9, torch.float32, "cpu", None)
    ours = i2v_condition(pipe.vae, frame, 9)
    assert ours.shape == (1, 2 + 4, 5, 8, 8)  # temporal-factor mask channels, then z_dim latents
    assert ours[0, :2, 0].min() == 1 and ours[0, :2, 1:].max() == 0  # only the first latent frame is given
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    with torch.no_grad():
        states = pipe.encode_image(img, "cpu")
    torch.testing.assert_close(
        encode_image(pipe.image_encoder, pipe.image_processor, frame), states, rtol=0, atol=0
    )


@pytest.mark.parametrize("name", ["i2v", "i2v_noclip"])
def test_i2v_ode_sampler_equals_the_pipeline(folders, media, name):
    """Image to video from the same initial noise, CFG 3, UniPC: the policy's latents are
    WanImageToVideoPipeline's (with the CLIP image states for the Wan2.1-style folder)."""
    from PIL import Image

    pipe = _i2v_pipe(folders[name])
    seq = (
        512 if name == "i2v" else 16
    )  # diffusers' Wan attention assumes 512 text tokens next to image states
    pol = make(folders[name], condition="i2v", num_steps=6, noise_level=0.0, guidance_scale=3.0,
               max_sequence_length=seq)  # fmt: skip
    noise, ours = _ode(pol, [{"prompt": "a red  ball &amp; a box", "image": media["first"]}] * 2)
    img = Image.open(media["first"]).convert("RGB")
    theirs = _pipe_latents(pipe, noise, 3.0, 6, image=img, max_sequence_length=seq)
    rel = float((ours - theirs).abs().max() / theirs.abs().max())
    print(f"Wan I2V ODE parity ({name}): max relative difference {rel:.2e}")
    assert rel < 1e-5


def test_i2v_rollout_rescoring_and_errors(folders, media):
    pol = make(folders["i2v"], condition="i2v", max_sequence_length=512, guidance_scale=2.0, window_size=2)
    assert pol.row_conditioning_keys == ("image_latents", "image_embeds")
    rr = [{"prompt": "a", "image": media["first"]}, {"prompt": "b", "image": media["second"]}]
    r = pol.rollout(rr, 2)
    assert r.payload["image_latents"].shape == (4, 6, 5, 8, 8) and r.payload["image_embeds"].shape == (
        4,
        17,
        16,
    )
    assert not torch.equal(r.payload["image_latents"][0], r.payload["image_latents"][2])
    stats = pol.action_stats(r)
    torch.testing.assert_close(torch.exp(stats.logp - r.logp_old), torch.ones(4, 2), rtol=0, atol=1e-5)
    with torch.no_grad():
        r.payload["image_latents"] = r.payload["image_latents"] + 1.0  # re-scoring reads the stored condition
        assert not torch.allclose(pol.action_stats(r).logp, stats.logp.detach())
    assert not any(p.requires_grad for p in pol.image_encoder.parameters())
    with pytest.raises(ValueError, match="needs an image in every row"):
        pol.rollout([{"prompt": "a"}], 1)
    with pytest.raises(ValueError, match="max_sequence_length must be 512"):
        make(folders["i2v"], condition="i2v")
    with pytest.raises(ValueError, match="in_channels"):
        make(folders["t2v"], condition="i2v")
    noclip = make(folders["i2v_noclip"], condition="i2v")  # Wan2.2 I2V style: latents only, any text length
    assert noclip.row_conditioning_keys == ("image_latents",)
