"""FluxKontextPolicy on tiny offline FLUX.1 folders: the transformer call and a whole ODE sample against diffusers'
FluxKontextPipeline (same components, same initial noise), the source latents as row conditioning (stored,
re-scored with ratio 1, each distinct image encoded once), errors, LoRA and saving a Kontext folder."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from mmalign import tiny
from mmalign.config import LoraConfig
from mmalign.data.media import load_rgb, save_image
from mmalign.data.rows import DataError
from mmalign.policies.flux import FluxPolicy, latent_image_ids, pack_latents, unpack_latents
from mmalign.policies.flux_kontext import FluxKontextPolicy, kontext_image_ids, load_source_pixels

SEQ = 8
"""T5 length used in the tests (small: fast)."""
SIZE = 16
"""Pixels of the tiny Flux's images (latents 4 x 8 x 8)."""


@pytest.fixture(scope="module")
def flux_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random FLUX.1-dev-like folder (guidance embedding): Kontext has FLUX.1's architecture."""
    return tiny.build("flux_tiny", tmp_path_factory.mktemp("kontext") / "dev", announce=False)


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Three source images: two 16 px, one 24 px (resized by the policy)."""
    folder = tmp_path_factory.mktemp("sources")
    g = torch.Generator().manual_seed(0)
    out = []
    for i, side in enumerate((SIZE, SIZE, 24)):
        x = torch.rand(3, side, side, generator=g)
        x[:, 2:8, 3:9] = torch.tensor([0.9, 0.1, 0.1]).view(3, 1, 1)
        out.append(str(save_image(x, folder / f"src{i}.png")))
    return out


def make(path: Path, **kw) -> FluxKontextPolicy:
    kw.setdefault("num_steps", 3)
    kw.setdefault("seed", 0)
    kw.setdefault("max_sequence_length", SEQ)
    return FluxKontextPolicy.from_pretrained(path, **kw)


def kontext_pipe(pol: FluxKontextPolicy):
    from diffusers import FluxKontextPipeline

    return FluxKontextPipeline(
        scheduler=copy.deepcopy(pol.scheduler),
        vae=pol.vae,
        text_encoder=pol.text_encoder,
        tokenizer=pol.tokenizer,
        text_encoder_2=pol.text_encoder_2,
        tokenizer_2=pol.tokenizer_2,
        transformer=pol.model,
    )


def run_pipe(pol: FluxKontextPolicy, prompts: list[str], paths: list[str], steps: int, **kw):
    """The diffusers pipeline at the policy's size (no Kontext auto-resize, max_area = the image)."""
    side = pol.pixel_size()
    return kontext_pipe(pol)(
        image=[load_rgb(p) for p in paths],
        prompt=prompts,
        height=side,
        width=side,
        max_area=side * side,
        _auto_resize=False,
        num_inference_steps=steps,
        guidance_scale=pol.guidance_scale,
        max_sequence_length=SEQ,
        **kw,
    )


def rows(paths: list[str]) -> list[dict]:
    return [
        {"prompt": "make the red square blue", "source_image": paths[0]},
        {"prompt": "move it left", "source_image": paths[1]},
    ]


# ----------------------------------------------------------------------------- diffusers parity


def test_source_ids_and_pixels() -> None:
    from diffusers import FluxKontextPipeline

    ids = kontext_image_ids(4, 3)
    want = FluxKontextPipeline._prepare_latent_image_ids(1, 4, 3, "cpu", torch.float32)
    want[..., 0] = 1
    assert torch.equal(ids, want) and torch.equal(ids[:, 1:], latent_image_ids(4, 3)[:, 1:])
    img = Image.new("RGB", (5, 3), (255, 0, 128))
    px = load_source_pixels(img, 3, 5)
    assert px.shape == (3, 3, 5) and px[0].eq(1).all() and px[1].eq(-1).all()
    assert load_source_pixels(img, 6, 10).shape == (3, 6, 10)


def test_transformer_call_matches_the_kontext_pipeline(flux_dir: Path, images: list[str]) -> None:
    """Record the pipeline's first transformer call and feed the policy the same noisy state: every input
    (the noisy tokens, the source tokens appended, the ids, guidance, timestep) and the velocity agree."""
    pol = make(flux_dir, guidance_scale=2.5)
    calls: list[tuple[dict, torch.Tensor]] = []
    hook = pol.model.register_forward_hook(
        lambda m, a, kw, out: calls.append((dict(kw), out[0])), with_kwargs=True
    )
    try:
        run_pipe(pol, ["make the red square blue"], images[:1], 2, output_type="latent")
        assert len(calls) == 2
        kw, v_pipe = calls[0]
        n = (pol.latent_size // 2) ** 2
        x = unpack_latents(kw["hidden_states"][:, :n], 8, 8)
        with torch.no_grad():
            cond = pol.conditioning(["make the red square blue"])
            cond.update(pol.row_conditioning({"source_image": images[:1]}, torch.zeros(1, dtype=torch.long)))
            v, v_c = pol.predict(pol.model, x, {"sigmas": kw["timestep"]}, cond)
    finally:
        hook.remove()
    mine = calls[2][0]
    assert kw["hidden_states"].shape == (1, 2 * n, 16)  # noisy tokens, then the source's
    for key in ("timestep", "encoder_hidden_states", "pooled_projections", "txt_ids", "img_ids"):
        torch.testing.assert_close(mine[key], kw[key], atol=0, rtol=0, msg=key)
    assert torch.equal(mine["hidden_states"][:, :n], kw["hidden_states"][:, :n])
    # the source tokens agree to float32 rounding: the pipeline's image tensor comes from NumPy channels-last
    # (strides (768, 1, 48, 3)), so the VAE's convolutions round differently (~1e-7) than on a contiguous one
    torch.testing.assert_close(mine["hidden_states"][:, n:], kw["hidden_states"][:, n:], atol=1e-6, rtol=1e-5)
    assert torch.equal(mine["guidance"], kw["guidance"]) and float(kw["guidance"][0]) == 2.5
    torch.testing.assert_close(v, unpack_latents(v_pipe[:, :n], 8, 8), atol=1e-5, rtol=1e-5)
    assert v_c is v


def test_ode_sample_matches_the_kontext_pipeline(flux_dir: Path, images: list[str]) -> None:
    """Euler sampling through the policy's own hooks (prompt and row conditioning, schedule, predict, ode_step)
    from the pipeline's initial noise gives the pipeline's latents and image; so does a rollout whose SDE
    noise is negligible (flow_sde at noise level 1e-7)."""
    steps = 4
    pol = make(flux_dir, num_steps=steps, guidance_scale=3.0)
    prompts = ["make the red square blue", "move it left"]
    paths = [images[0], images[2]]  # the second is 24 px: diffusers resizes a list to its first image's size
    noise = torch.randn((2, 4, 8, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = run_pipe(pol, prompts, paths, steps, latents=pack_latents(noise), output_type="latent").images
        want_img = run_pipe(pol, prompts, paths, steps, latents=pack_latents(noise), output_type="pt").images
        want = unpack_latents(want, 8, 8)
        cond = pol.conditioning(prompts)
        cond.update(pol.row_conditioning({"source_image": paths}, torch.arange(2)))
        table = pol.schedule()
        x = noise.clone()
        for i in range(steps):
            sched = {k: (v[i] if v.ndim else v).expand(2) for k, v in table.items()}
            x = pol.ode_step(pol.predict(pol.model, x, sched, cond)[0], x, sched)
        img = pol.decode_latents(x)
    rel = float((x - want).abs().max() / want.abs().max())
    print(
        f"random FLUX.1 folder: max relative difference to FluxKontextPipeline after {steps} steps: {rel:.2e}"
    )
    assert rel < 1e-5, rel
    torch.testing.assert_close(img, want_img.float(), atol=1e-5, rtol=0)

    # the rollout path (rows -> source latents -> SDE steps) with negligible step noise
    quiet = make(flux_dir, num_steps=steps, guidance_scale=3.0, noise_level=1e-7)
    state = quiet.generator.get_state()
    first = torch.randn((2, 4, 8, 8), generator=torch.Generator().set_state(state))  # the noise it will draw
    with torch.no_grad():
        ref = unpack_latents(
            run_pipe(quiet, prompts, paths, steps, latents=pack_latents(first), output_type="latent").images,
            8,
            8,
        )
    r = quiet.rollout([{"prompt": p, "source_image": s} for p, s in zip(prompts, paths)], 1)
    rel_rollout = float((r.outputs["latents"] - ref).abs().max() / ref.abs().max())
    assert rel_rollout < 1e-4, rel_rollout


def test_ode_sample_of_the_shipped_editor_matches_the_kontext_pipeline() -> None:
    """The same parity on the shipped tiny editor (assets/models/image_edit-tiny, loaded with from_pretrained:
    its word-level T5 tokenizer, its fitted VAE) on two held-out edits of assets/image_edit/eval.jsonl, with the
    tiny config's sampler (8 steps, guidance 2.5, 12 T5 tokens): max relative difference of the final latents
    below 1e-5 (measured: 3.5e-6; float32 rounding of the source's VAE encoding, see above)."""
    from mmalign.tiny.image_edit import ASSETS as EDIT_ASSETS

    folder = Path(__file__).resolve().parents[2] / "assets" / "models" / "image_edit-tiny"
    if not (folder / "model_index.json").exists():
        pytest.skip(
            "assets/models/image_edit-tiny is not shipped in this checkout (mmalign tiny build image_edit)"
        )
    steps, seq = 8, 12
    pol = FluxKontextPolicy.from_pretrained(
        folder, num_steps=steps, guidance_scale=2.5, max_sequence_length=seq, seed=0
    )
    lines = (EDIT_ASSETS / "eval.jsonl").read_text().splitlines()
    picked = [json.loads(lines[i]) for i in (0, 20)]
    prompts = [r["prompt"] for r in picked]
    paths = [str(EDIT_ASSETS / r["source_image"]) for r in picked]
    side = pol.pixel_size()
    noise = torch.randn((2, 4, side // 2, side // 2), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = kontext_pipe(pol)(
            image=[load_rgb(p) for p in paths],
            prompt=prompts,
            height=side,
            width=side,
            max_area=side * side,
            _auto_resize=False,
            num_inference_steps=steps,
            guidance_scale=2.5,
            max_sequence_length=seq,
            latents=pack_latents(noise),
            output_type="latent",
        ).images
        want = unpack_latents(want, side // 2, side // 2)
        cond = pol.conditioning(prompts)
        cond.update(pol.row_conditioning({"source_image": paths}, torch.arange(2)))
        table = pol.schedule()
        x = noise.clone()
        for i in range(steps):
            sched = {k: (v[i] if v.ndim else v).expand(2) for k, v in table.items()}
            x = pol.ode_step(pol.predict(pol.model, x, sched, cond)[0], x, sched)
    rel = float((x - want).abs().max() / want.abs().max())
    print(f"shipped editor: max relative difference to FluxKontextPipeline after {steps} steps: {rel:.2e}")
    assert rel < 1e-5, rel


# ----------------------------------------------------------------------------- policy behaviour


def test_rollout_stores_the_source_and_rescores_with_ratio_one(flux_dir: Path, images: list[str]) -> None:
    pol = make(flux_dir)
    encoded: list[int] = []
    encode = pol.encode_source
    pol.encode_source = lambda px: (encoded.append(px.shape[0]), encode(px))[1]  # type: ignore[method-assign]
    r = pol.rollout(rows(images), 2)
    assert encoded == [2]  # two distinct images for four samples, encoded once
    lat = r.payload["image_latents"]
    assert lat.shape == (4, 4, 8, 8) and torch.equal(lat[0], lat[1]) and not torch.equal(lat[0], lat[2])
    with torch.no_grad():
        px = torch.stack([load_source_pixels(images[0], SIZE, SIZE)])
        z = pol.vae.encode(px).latent_dist.mode()
        cfg = pol.vae.config
    torch.testing.assert_close(lat[0], ((z - cfg.shift_factor) * cfg.scaling_factor)[0], atol=1e-6, rtol=0)
    stats = pol.action_stats(r)
    torch.testing.assert_close(stats.logp.detach(), r.logp_old, atol=1e-5, rtol=0)
    # the source matters: the same noisy state with another source gives another velocity
    x = torch.randn(1, 4, 8, 8)
    cond = {k: r.payload[k][:1] for k in ("prompt_embeds", "pooled_embeds", "image_latents")}
    other = dict(cond, image_latents=r.payload["image_latents"][2:3])
    sched = {"sigmas": torch.tensor([0.6])}
    with torch.no_grad():
        assert not torch.allclose(
            pol.predict(pol.model, x, sched, cond)[0], pol.predict(pol.model, x, sched, other)[0]
        )
    # a subset of the rollout re-scores with its own sources
    sub = r[torch.tensor([3, 0])]
    torch.testing.assert_close(pol.action_stats(sub).logp.detach(), r.logp_old[[3, 0]], atol=1e-5, rtol=0)


def test_missing_sources_are_data_errors(flux_dir: Path, images: list[str], tmp_path: Path) -> None:
    pol = make(flux_dir)
    with pytest.raises(DataError, match="source_image"):
        pol.rollout([{"prompt": "a"}], 1)
    with pytest.raises(DataError, match="sample 1"):
        pol.rollout([{"prompt": "a", "source_image": images[0]}, {"prompt": "b", "source_image": None}], 1)
    with pytest.raises(DataError, match="source_image"):
        pol.rollout([{"prompt": "a", "source_image": str(tmp_path / "nope.png")}], 1)
    other = make(flux_dir, image_column="before")
    assert other.rollout([{"prompt": "a", "before": Image.open(images[0])}], 1).payload[
        "image_latents"
    ].shape == (
        1,
        4,
        8,
        8,
    )


def test_lora_save_and_reload_as_a_kontext_folder(flux_dir: Path, images: list[str], tmp_path: Path) -> None:
    from diffusers import FluxKontextPipeline

    pol = make(flux_dir, need_reference=True, lora=LoraConfig(enabled=True, r=4, target_modules="all-linear"))
    assert isinstance(pol, FluxPolicy)
    names = [n for n, p in pol.model.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    r = pol.rollout(rows(images), 2)
    with torch.no_grad():
        for n, p in pol.model.named_parameters():
            if "lora_B" in n:
                p.add_(0.3)
    stats = pol.action_stats(r)
    assert (stats.kl.detach() > 0).any()
    torch.testing.assert_close(pol.reference_logprobs(r), r.logp_old, atol=1e-5, rtol=0)
    pol.save(tmp_path / "out")
    assert (
        json.loads((tmp_path / "out" / "model_index.json").read_text())["_class_name"]
        == "FluxKontextPipeline"
    )
    again = make(tmp_path / "out")
    torch.testing.assert_close(again.action_stats(r).logp.detach(), stats.logp.detach(), atol=1e-5, rtol=0)
    pipe = FluxKontextPipeline.from_pretrained(tmp_path / "out")
    assert type(pipe).__name__ == "FluxKontextPipeline" and pipe.transformer.config.guidance_embeds
