"""QwenImageEditPlusPolicy on a tiny offline Qwen-Image-Edit-Plus folder (`mmalign.tiny.qwen_image_edit_plus`): the
folder round trip through diffusers' ``QwenImageEditPlusPipeline`` and the family registry, the prompt states
(instruction + several pictures through Qwen2.5-VL) and the sources' latents against the pipeline's, a whole
Euler ODE sample with and without true CFG against the pipeline from the same initial noise (rows of two
sources, one resized), ratio 1 on re-scoring, each distinct source / pair encoded once, LoRA with save / reload
as a Plus folder, and the data errors.

The pipeline resizes each source to ~1 MP for the VAE and ~384 x 384 for the VLM (``VAE_IMAGE_SIZE``,
``CONDITION_IMAGE_SIZE``); the tests patch those two areas to the tiny model's sizes (the policy's output side
and its ``condition_pixels``). Everything else is the pipeline's own code."""

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
from mmalign.policies.families import family_for, policy_class_for
from mmalign.policies.flux import pack_latents, unpack_latents
from mmalign.policies.qwen_image_components import (
    EDIT_PLUS_PROMPT_TEMPLATE,
    EDIT_PROMPT_DROP,
    condition_size,
    load_qwen_image_edit_plus_components,
)
from mmalign.policies.qwen_image_edit import QwenImageEditPolicy
from mmalign.policies.qwen_image_edit_plus import QwenImageEditPlusPolicy

SEQ = 40
"""Instruction states after the pictures' vision tokens in the tests."""
SIDE = 32
"""Pixels of the tiny model's edits (16 x 16 latents)."""
COND = 32 * 32
"""The VLM pictures' area in the tests (the tiny processor makes each 56 x 56 pixels: 4 vision tokens)."""
PROMPTS = ["put the square of picture 2 into picture 1", "make the red square blue"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny.build("qwen_image_edit_plus_tiny", tmp_path_factory.mktemp("qplus") / "tiny", announce=False)


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Three sources: two 32 px, one 48 px (resized by the policy and the pipeline alike)."""
    root = tmp_path_factory.mktemp("qplus-sources")
    g = torch.Generator().manual_seed(0)
    out = []
    for i, side in enumerate((SIDE, SIDE, 48)):
        x = torch.rand(3, side, side, generator=g)
        x[:, 4:12, 6:14] = torch.tensor([0.9, 0.1, 0.1]).view(3, 1, 1)
        out.append(str(save_image(x, root / f"src{i}.png")))
    return out


@pytest.fixture
def pipeline_at_test_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pipeline's VAE and VLM resizes target the test's sizes (see the module docstring)."""
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus as mod

    monkeypatch.setattr(mod, "VAE_IMAGE_SIZE", SIDE * SIDE)
    monkeypatch.setattr(mod, "CONDITION_IMAGE_SIZE", COND)


def make(path: Path, **kw) -> QwenImageEditPlusPolicy:
    for k, v in {
        "num_steps": 4,
        "seed": 0,
        "latent_size": SIDE // 2,
        "max_sequence_length": SEQ,
        "condition_pixels": COND,
    }.items():
        kw.setdefault(k, v)
    return QwenImageEditPlusPolicy.from_pretrained(path, **kw)


def plus_pipe(pol: QwenImageEditPlusPolicy):
    from diffusers import QwenImageEditPlusPipeline

    return QwenImageEditPlusPipeline(
        scheduler=copy.deepcopy(pol.scheduler),
        vae=pol.vae,
        text_encoder=pol.text_encoder,
        tokenizer=pol.tokenizer,
        processor=pol.processor,
        transformer=pol.model,
    )


def cond_of(pol: QwenImageEditPlusPolicy, sources: list, prompts: list[str] = PROMPTS) -> dict:
    columns = {"prompt": prompts, "source_image": sources}
    return pol.row_conditioning(columns, torch.arange(len(sources)))


# ----------------------------------------------------------------------------- folder and inputs


def test_folder_loads_in_diffusers_and_the_registry_picks_the_policy(folder: Path) -> None:
    from diffusers import QwenImageEditPlusPipeline

    assert "qwen_image_edit_plus_tiny" in tiny.load_builders()
    pipe = QwenImageEditPlusPipeline.from_pretrained(folder)
    assert pipe.prompt_template_encode == EDIT_PLUS_PROMPT_TEMPLATE
    assert pipe.prompt_template_encode_start_idx == EDIT_PROMPT_DROP
    c = load_qwen_image_edit_plus_components(folder)
    assert type(c.processor).__name__ == "Qwen2VLProcessor"
    assert policy_class_for(folder, "image_edit") is QwenImageEditPlusPolicy
    for hub_id in ("Qwen/Qwen-Image-Edit-2509", "Qwen/Qwen-Image-Edit-2511"):
        assert family_for(hub_id, "image_edit").name == "qwen_image_edit_plus"
    assert family_for("Qwen/Qwen-Image-Edit", "image_edit").name == "qwen_image_edit"
    # each policy refuses the other's folder
    with pytest.raises(ValueError, match="QwenImageEditPlusPipeline"):
        QwenImageEditPolicy.from_pretrained(folder)
    edit = tiny.build("qwen_image_edit_tiny", folder.parent / "edit", announce=False)
    with pytest.raises(ValueError, match="names 'QwenImageEditPipeline'.*Qwen-Image-Edit-Plus"):
        QwenImageEditPlusPolicy.from_pretrained(edit)


def test_condition_size_is_the_pipelines() -> None:
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_dimensions

    for w, h in [(384, 384), (1024, 512), (300, 777), (48, 32), (1920, 1080)]:
        for area in (384 * 384, 1024 * 1024, COND):
            assert condition_size(w, h, area) == calculate_dimensions(area, w / h)


def test_prompt_states_and_source_latents_equal_the_pipeline(
    folder: Path, images: list[str], pipeline_at_test_size: None
) -> None:
    """The instruction read with both pictures by the VLM, and both sources' latents, as the pipeline makes them."""
    pol = make(folder)
    pipe = plus_pipe(pol)
    sources = [[images[0], images[2]], [images[1], images[0]]]
    cond = cond_of(pol, sources)
    labels = len(pol.tokenizer("Picture 1: <|vision_start|><|image_pad|><|vision_end|>Picture 2: ").input_ids)
    labels += len(pol.tokenizer("<|vision_start|><|image_pad|><|vision_end|>").input_ids)
    # the two pictures' labels and vision tokens (4 each, one <|image_pad|> in the text) + the instruction's SEQ
    assert cond["prompt_embeds"].shape[1] == labels - 2 + 2 * 4 + SEQ
    assert cond["image_latents"].shape == (2, 2, 4, 16, 16)
    for i in range(2):
        pics = [load_rgb(p) for p in sources[i]]
        conds = [pipe.image_processor.resize(p, 32, 32) for p in pics]
        with torch.no_grad():
            theirs, their_mask = pipe.encode_prompt(PROMPTS[i], image=conds, device="cpu")
            pixels = [pipe.image_processor.preprocess(p, SIDE, SIDE).unsqueeze(2) for p in pics]
            _, their_src = pipe.prepare_latents(pixels, 1, 4, SIDE, SIDE, torch.float32, "cpu", None)
        n = theirs.shape[1]
        assert their_mask is None and int(cond["prompt_mask"][i].sum()) == n
        torch.testing.assert_close(cond["prompt_embeds"][i, :n], theirs[0], rtol=1e-5, atol=1e-6)
        ours_src = torch.cat([pack_latents(cond["image_latents"][i : i + 1, j]) for j in range(2)], dim=1)
        torch.testing.assert_close(ours_src, their_src, rtol=0, atol=1e-6)
    # the order of the pictures matters to the states
    swapped = cond_of(pol, [[images[2], images[0]], sources[1]])
    assert not torch.allclose(swapped["prompt_embeds"][0], cond["prompt_embeds"][0])


# ----------------------------------------------------------------------------- sampler parity


@pytest.mark.parametrize("cfg", [1.0, 3.0])
def test_ode_sample_equals_qwen_image_edit_plus_pipeline(
    folder: Path, images: list[str], cfg: float, pipeline_at_test_size: None
) -> None:
    """A deterministic rollout (noise_level 0: every step the Euler ODE step) of two rows of two sources each (one
    48 px, resized by both) equals the pipeline run on each row from the same initial noise; with true CFG the
    negative prompt " " is read with the row's pictures on both sides (max relative difference printed;
    measured ~1e-7, fp32)."""
    pol = make(folder, guidance_scale=cfg, negative_prompt=" ", noise_level=0.0)
    sources = [[images[0], images[2]], [images[2], images[1]]]
    pol.generator.manual_seed(7)
    noise = pol._initial_noise(torch.arange(2))
    pol.generator.manual_seed(7)
    rows = [{"prompt": p, "source_image": s} for p, s in zip(PROMPTS, sources, strict=True)]
    r = pol.rollout(rows, 1, compute_logp=False)
    assert r.num_actions == 0 and ("negative_prompt_embeds" in r.payload) == (cfg > 1)
    kw = {"negative_prompt": " ", "true_cfg_scale": cfg} if cfg > 1 else {"true_cfg_scale": 1.0}
    pipe = plus_pipe(pol)
    theirs = []
    for i in range(2):
        with torch.no_grad():
            out = pipe(
                image=[load_rgb(p) for p in sources[i]],
                prompt=PROMPTS[i],
                height=SIDE,
                width=SIDE,
                num_inference_steps=4,
                latents=pack_latents(noise[i : i + 1]),
                output_type="latent",
                **kw,
            ).images
        theirs.append(unpack_latents(out.float(), SIDE // 2, SIDE // 2))
    want = torch.cat(theirs)
    rel = float((r.outputs["latents"] - want).abs().max() / want.abs().max())
    print(f"Qwen-Image-Edit-Plus ODE parity (true CFG {cfg}): max relative difference {rel:.2e}")
    assert rel < 1e-5, rel


# ----------------------------------------------------------------------------- training


def test_rollout_rescores_with_ratio_one_and_encodes_each_source_once(
    folder: Path, images: list[str]
) -> None:
    pol = make(folder, guidance_scale=2.0, negative_prompt=" ", noise_level=0.5, window_size=2)
    calls: list[int] = []
    encode = pol.components.encode_edit_plus_prompt
    pol.components.encode_edit_plus_prompt = lambda p, im, *a, **k: (  # type: ignore[method-assign]
        calls.append(len(p)),
        encode(p, im, *a, **k),
    )[1]
    vae_calls: list[int] = []
    vae_encode = pol.vae.encode
    pol.vae.encode = lambda x: (vae_calls.append(x.shape[0]), vae_encode(x))[1]  # type: ignore[method-assign]
    rows = [
        {"prompt": PROMPTS[0], "source_image": [images[0], images[1]]},
        {"prompt": PROMPTS[1], "source_image": [images[0], images[1]]},
    ]
    r = pol.rollout(rows, 2)
    # two (instruction, pictures) pairs for four samples, then one negative for the one list of pictures
    assert calls == [2, 1] and vae_calls == [2]  # two distinct sources, encoded once
    p = r.payload
    assert r.num_actions == 2 and p["image_latents"].shape == (4, 2, 4, 16, 16)
    assert torch.equal(p["image_latents"][0], p["image_latents"][3])
    stats = pol.action_stats(r)
    torch.testing.assert_close(torch.exp(stats.logp - r.logp_old), torch.ones(4, 2), rtol=0, atol=1e-5)
    stats.logp.sum().backward()
    assert pol.model.img_in.weight.grad is not None and pol.model.proj_out.weight.grad is not None
    assert not any(q.requires_grad for q in pol.text_encoder.parameters())
    sub = r[torch.tensor([3, 0])]
    torch.testing.assert_close(pol.action_stats(sub).logp.detach(), r.logp_old[[3, 0]], atol=1e-5, rtol=0)
    pol.decode(r)
    assert r.outputs["images"].shape == (4, 3, SIDE, SIDE)


def test_the_second_source_changes_the_velocity(folder: Path, images: list[str]) -> None:
    """The appended sources reach the network: replacing the second source changes the velocity."""
    pol = make(folder)
    x = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(3))
    sched = {"sigmas": torch.tensor([0.6])}
    a = cond_of(pol, [[images[0], images[1]]], PROMPTS[:1])
    b = cond_of(pol, [[images[0], images[2]]], PROMPTS[:1])
    b["prompt_embeds"], b["prompt_mask"] = a["prompt_embeds"], a["prompt_mask"]  # only the latents differ
    with torch.no_grad():
        va, vb = pol.velocity(pol.model, x, sched, a), pol.velocity(pol.model, x, sched, b)
    assert not torch.allclose(va, vb)


def test_lora_reference_and_save_reload_as_a_plus_folder(
    folder: Path, images: list[str], tmp_path: Path
) -> None:
    from diffusers import QwenImageEditPlusPipeline

    pol = make(folder, lora=LoraConfig(enabled=True, r=2, alpha=4), need_reference=True, noise_level=0.5)
    trainable = [n for n, p in pol.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora" in n for n in trainable)
    rows = [{"prompt": PROMPTS[0], "source_image": [images[0], images[2]]}]
    r = pol.rollout(rows, 2)
    torch.testing.assert_close(pol.reference_logprobs(r), r.logp_old, rtol=0, atol=1e-5)
    with torch.no_grad():
        for n, p in pol.model.named_parameters():
            if "lora_B" in n:
                p.add_(0.05)
    stats = pol.action_stats(r)
    assert (stats.kl.detach() > 0).any()
    pol.save(tmp_path / "saved")
    index = json.loads((tmp_path / "saved" / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImageEditPlusPipeline" and index["processor"][1] == "Qwen2VLProcessor"
    again = make(tmp_path / "saved", noise_level=0.5)
    torch.testing.assert_close(again.action_stats(r).logp.detach(), stats.logp.detach(), atol=1e-5, rtol=0)
    assert isinstance(
        QwenImageEditPlusPipeline.from_pretrained(tmp_path / "saved"), QwenImageEditPlusPipeline
    )


def test_sources_are_checked(folder: Path, images: list[str], tmp_path: Path) -> None:
    pol = make(folder)
    with pytest.raises(DataError, match="source_image"):
        pol.rollout([{"prompt": "a"}], 1)
    with pytest.raises(DataError, match="same number of source images"):
        pol.rollout(
            [
                {"prompt": "a", "source_image": [images[0], images[1]]},
                {"prompt": "b", "source_image": images[0]},
            ],
            1,
        )
    with pytest.raises(DataError, match="sample 0"):
        pol.rollout([{"prompt": "a", "source_image": []}], 1)
    with pytest.raises(DataError, match="source_image"):
        pol.rollout([{"prompt": "a", "source_image": [images[0], str(tmp_path / "nope.png")]}], 1)
    # one source as a plain value (a path or an in-memory image) is a list of one
    r = pol.rollout([{"prompt": "a", "source_image": Image.open(images[0])}], 1)
    assert r.payload["image_latents"].shape == (1, 1, 4, 16, 16)
    with pytest.raises(ValueError, match="condition_pixels"):
        make(folder, condition_pixels=16)
