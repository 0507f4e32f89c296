"""WanPolicy on tiny offline Wan folders (`mmalign.tiny.wan`): the folder round trip, prompt encoding and decoding
against diffusers' own Wan pipelines, the VAE factors, ratio 1 on re-scoring for every condition, the concat
payload, SDEdit's truncated schedule and initial latents, the VACE control tensor against
``WanVACEPipeline``, and Wan2.2's two experts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmalign.config import LoraConfig
from mmalign.policies.wan import WanExperts, WanPolicy
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
    return out


def rows(media: dict[str, str]) -> list[dict[str, object]]:
    return [
        {"prompt": "a red  ball &amp; a box", "source_video": media["a"], "edit_mask": media["mask"]},
        {"prompt": "a blue cube", "source_video": media["b"]},
    ]


def make(path, **kw) -> WanPolicy:
    for k, v in {**SIZE, "num_steps": 4, "seed": 0}.items():
        kw.setdefault(k, v)
    return WanPolicy.from_pretrained(path, **kw)


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
    # a real Wan2.2 folder's UniPC scheduler becomes a flow-matching Euler one with shift = flow_shift
    assert type(c.scheduler).__name__ == "FlowMatchEulerDiscreteScheduler" and c.scheduler.config.shift == 3.0


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
    from mmalign.media import read_video

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

    from mmalign.media import read_video

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

    from mmalign.media import read_mask, read_video

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
