"""QwenImageEditPolicy on a tiny offline Qwen-Image-Edit folder (`mmalign.tiny.qwen_image_edit`): the folder
round trip through diffusers' ``QwenImageEditPipeline``, the prompt states (instruction + source image through
Qwen2.5-VL) and the source latents against the pipeline's, a whole Euler ODE sample with and without true CFG
against the pipeline from the same initial noise, the negative branch read with the row's image, ratio 1 on
re-scoring, each distinct source / pair encoded once, LoRA with save / reload as an edit folder, and errors.

The pipeline resizes every source to ~1 MP (`calculate_dimensions(1024 * 1024, ratio)`); the tests patch that
target area to the tiny model's 32 x 32 output, so that the pipeline's source has the policy's size. Everything
else is the pipeline's own code."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image

from mmalign import tiny
from mmalign.config import LoraConfig
from mmalign.data.media import load_rgb, save_image
from mmalign.data.rows import DataError
from mmalign.policies.flux import pack_latents, unpack_latents
from mmalign.policies.qwen_image import QwenImagePolicy
from mmalign.policies.qwen_image_components import (
    EDIT_PROMPT_DROP,
    EDIT_PROMPT_TEMPLATE,
    is_qwen_image_edit_folder,
    load_qwen_image_edit_components,
)
from mmalign.policies.qwen_image_edit import QwenImageEditPolicy

SEQ = 24
"""Instruction states after the image's vision tokens in the tests."""
SIDE = 32
"""Pixels of the tiny model's edits (16 x 16 latents)."""
PROMPTS = ["make the red square blue", "remove the green square"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny.build("qwen_image_edit_tiny", tmp_path_factory.mktemp("qedit") / "tiny", announce=False)


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Three sources: two 32 px, one 48 px (resized by the policy and the pipeline alike)."""
    root = tmp_path_factory.mktemp("qedit-sources")
    g = torch.Generator().manual_seed(0)
    out = []
    for i, side in enumerate((SIDE, SIDE, 48)):
        x = torch.rand(3, side, side, generator=g)
        x[:, 4:12, 6:14] = torch.tensor([0.9, 0.1, 0.1]).view(3, 1, 1)
        out.append(str(save_image(x, root / f"src{i}.png")))
    return out


@pytest.fixture
def pipeline_at_test_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pipeline's source resize targets SIDE x SIDE pixels instead of 1 MP (see the module docstring)."""
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit as mod

    original = mod.calculate_dimensions
    monkeypatch.setattr(mod, "calculate_dimensions", lambda area, ratio: original(SIDE * SIDE, ratio))


def make(path: Path, **kw) -> QwenImageEditPolicy:
    for k, v in {"num_steps": 4, "seed": 0, "latent_size": SIDE // 2, "max_sequence_length": SEQ}.items():
        kw.setdefault(k, v)
    return QwenImageEditPolicy.from_pretrained(path, **kw)


def edit_pipe(pol: QwenImageEditPolicy):
    from diffusers import QwenImageEditPipeline

    return QwenImageEditPipeline(
        scheduler=copy.deepcopy(pol.scheduler),
        vae=pol.vae,
        text_encoder=pol.text_encoder,
        tokenizer=pol.tokenizer,
        processor=pol.processor,
        transformer=pol.model,
    )


def rows(paths: list[str]) -> list[dict]:
    return [{"prompt": p, "source_image": s} for p, s in zip(PROMPTS, paths, strict=True)]


def cond_of(pol: QwenImageEditPolicy, paths: list[str], prompts: list[str] = PROMPTS) -> dict:
    columns = {"prompt": prompts, "source_image": paths}
    cond = pol.conditioning(prompts)
    cond.update(pol.row_conditioning(columns, torch.arange(len(paths))))
    return cond


# ----------------------------------------------------------------------------- folder and inputs


def test_folder_loads_in_diffusers_and_matches_the_pipeline_template(folder: Path) -> None:
    from diffusers import QwenImageEditPipeline

    assert "qwen_image_edit_tiny" in tiny.load_builders()
    pipe = QwenImageEditPipeline.from_pretrained(folder)
    assert pipe.prompt_template_encode == EDIT_PROMPT_TEMPLATE
    assert pipe.prompt_template_encode_start_idx == EDIT_PROMPT_DROP
    # the tiny tokenizer splits the template's part before the image into exactly the tokens the pipeline drops
    prefix = EDIT_PROMPT_TEMPLATE.split("<|vision_start|>")[0]
    assert len(pipe.processor.tokenizer(prefix).input_ids) == EDIT_PROMPT_DROP
    c = load_qwen_image_edit_components(folder)
    assert type(c.processor).__name__ == "Qwen2VLProcessor"
    assert c.text_encoder.config.image_token_id == c.processor.tokenizer.convert_tokens_to_ids(
        "<|image_pad|>"
    )
    assert is_qwen_image_edit_folder(folder) and is_qwen_image_edit_folder("Qwen/Qwen-Image-Edit")
    assert not is_qwen_image_edit_folder("Qwen/Qwen-Image")
    assert not is_qwen_image_edit_folder(folder / "transformer")


def test_other_qwen_pipelines_are_refused(folder: Path, tmp_path: Path) -> None:
    plus = tmp_path / "plus"
    shutil.copytree(folder, plus)
    index = json.loads((plus / "model_index.json").read_text())
    (plus / "model_index.json").write_text(json.dumps({**index, "_class_name": "QwenImageEditPlusPipeline"}))
    with pytest.raises(ValueError, match="QwenImageEditPlusPipeline"):
        QwenImageEditPolicy.from_pretrained(plus)


def test_prompt_states_and_source_latents_equal_the_pipeline(
    folder: Path, images: list[str], pipeline_at_test_size: None
) -> None:
    """The instruction read with its source by the VLM, and the source's latents, as the pipeline makes them."""
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit as mod

    pol = make(folder)
    pipe = edit_pipe(pol)
    cond = cond_of(pol, images[:2])
    for i in range(2):
        src = pipe.image_processor.resize(load_rgb(images[i]), SIDE, SIDE)
        with torch.no_grad():
            theirs, their_mask = pipe.encode_prompt(PROMPTS[i], image=src, device="cpu")
            pixels = pipe.image_processor.preprocess(src, SIDE, SIDE).unsqueeze(2)
            _, their_src = pipe.prepare_latents(pixels, 1, 4, SIDE, SIDE, torch.float32, "cpu", None)
        n = theirs.shape[1]  # one prompt: the pipeline's states are unpadded (mask None)
        assert their_mask is None and int(cond["prompt_mask"][i].sum()) == n
        assert cond["prompt_embeds"].shape[1] == 4 + SEQ  # the image's 4 vision tokens + SEQ
        torch.testing.assert_close(cond["prompt_embeds"][i, :n], theirs[0], rtol=1e-5, atol=1e-6)
        assert float(cond["prompt_embeds"][i, n:].abs().sum()) == 0
        torch.testing.assert_close(
            pack_latents(cond["image_latents"][i : i + 1]), their_src, rtol=0, atol=1e-6
        )
    assert mod.calculate_dimensions(1024 * 1024, 1.0)[:2] == (SIDE, SIDE)
    # the states depend on the image: the same instruction with another source reads differently
    other = cond_of(pol, [images[1], images[1]])
    assert not torch.allclose(other["prompt_embeds"][0], cond["prompt_embeds"][0])


# ----------------------------------------------------------------------------- sampler parity


@pytest.mark.parametrize("cfg", [1.0, 3.0])
def test_ode_sample_equals_qwen_image_edit_pipeline(
    folder: Path, images: list[str], cfg: float, pipeline_at_test_size: None
) -> None:
    """A deterministic rollout (noise_level 0: every step the Euler ODE step) of two rows, one with a 48 px source
    resized by both, equals the pipeline run on each row from the same initial noise; with true CFG the
    negative prompt " " is read with the row's image on both sides (max relative difference printed; measured
    1.3e-7 without CFG and 1.9e-7 with it, fp32)."""
    pol = make(folder, guidance_scale=cfg, negative_prompt=" ", noise_level=0.0)
    paths = [images[0], images[2]]
    pol.generator.manual_seed(7)
    noise = pol._initial_noise(torch.arange(2))
    pol.generator.manual_seed(7)
    r = pol.rollout(rows(paths), 1, compute_logp=False)
    assert r.num_actions == 0 and ("negative_prompt_embeds" in r.payload) == (cfg > 1)
    ours = r.outputs["latents"]
    kw = {"negative_prompt": " ", "true_cfg_scale": cfg} if cfg > 1 else {"true_cfg_scale": 1.0}
    theirs = []
    pipe = edit_pipe(pol)
    for i in range(2):
        with torch.no_grad():
            out = pipe(
                image=load_rgb(paths[i]),
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
    rel = float((ours - want).abs().max() / want.abs().max())
    print(f"Qwen-Image-Edit ODE parity (true CFG {cfg}): max relative difference {rel:.2e}")
    assert rel < 1e-5, rel


def test_negative_branch_is_the_negative_prompt_read_with_the_rows_image(
    folder: Path, images: list[str], pipeline_at_test_size: None
) -> None:
    pol = make(folder, guidance_scale=3.0, negative_prompt=" ")
    cond = cond_of(pol, images[:2])
    neg = pol._negative_inputs(cond, 2)
    assert torch.equal(neg["prompt_embeds"], cond["negative_prompt_embeds"])
    assert torch.equal(neg["image_latents"], cond["image_latents"])
    pipe = edit_pipe(pol)
    for i in range(2):
        src = pipe.image_processor.resize(load_rgb(images[i]), SIDE, SIDE)
        with torch.no_grad():
            theirs, _ = pipe.encode_prompt(" ", image=src, device="cpu")
        n = theirs.shape[1]
        torch.testing.assert_close(neg["prompt_embeds"][i, :n], theirs[0], rtol=1e-5, atol=1e-6)
    # one negative per image: the two rows' negatives differ
    assert not torch.allclose(neg["prompt_embeds"][0], neg["prompt_embeds"][1])
    # without CFG nothing negative is encoded or stored
    assert "negative_prompt_embeds" not in make(folder, guidance_scale=1.0).row_conditioning_keys


# ----------------------------------------------------------------------------- training


def test_rollout_rescores_with_ratio_one_and_encodes_each_source_once(
    folder: Path, images: list[str]
) -> None:
    pol = make(folder, guidance_scale=2.0, noise_level=0.5, window_size=2)
    calls: list[int] = []
    encode = pol.components.encode_edit_prompt
    pol.components.encode_edit_prompt = lambda p, im, *a, **k: (calls.append(len(p)), encode(p, im, *a, **k))[
        1
    ]  # type: ignore[method-assign]
    r = pol.rollout(rows(images[:2]), 2)
    assert calls == [2, 2]  # two distinct (instruction, source) pairs for four samples, then their negatives
    p = r.payload
    assert r.num_actions == 2 and set(pol.row_conditioning_keys) <= set(p)
    assert p["prompt_embeds"].shape == (4, 4 + SEQ, 32) and p["image_latents"].shape == (4, 4, 16, 16)
    assert torch.equal(p["image_latents"][0], p["image_latents"][1])
    assert not torch.equal(p["image_latents"][0], p["image_latents"][2])
    stats = pol.action_stats(r)
    torch.testing.assert_close(torch.exp(stats.logp - r.logp_old), torch.ones(4, 2), rtol=0, atol=1e-5)
    stats.logp.sum().backward()
    assert pol.model.img_in.weight.grad is not None and pol.model.proj_out.weight.grad is not None
    assert not any(q.requires_grad for q in pol.text_encoder.parameters())
    # a subset re-scores with its own stored states and sources
    sub = r[torch.tensor([3, 0])]
    torch.testing.assert_close(pol.action_stats(sub).logp.detach(), r.logp_old[[3, 0]], atol=1e-5, rtol=0)
    pol.decode(r)
    assert r.outputs["images"].shape == (4, 3, SIDE, SIDE)


def test_lora_reference_and_save_reload_as_an_edit_folder(
    folder: Path, images: list[str], tmp_path: Path
) -> None:
    from diffusers import QwenImageEditPipeline

    pol = make(folder, lora=LoraConfig(enabled=True, r=2, alpha=4), need_reference=True, noise_level=0.5)
    assert isinstance(pol, QwenImagePolicy)
    trainable = [n for n, p in pol.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora" in n for n in trainable)
    r = pol.rollout(rows(images[:2]), 1)
    torch.testing.assert_close(pol.reference_logprobs(r), r.logp_old, rtol=0, atol=1e-5)
    with torch.no_grad():
        for n, p in pol.model.named_parameters():
            if "lora_B" in n:
                p.add_(0.05)
    stats = pol.action_stats(r)
    assert (stats.kl.detach() > 0).any()
    pol.save(tmp_path / "saved")
    index = json.loads((tmp_path / "saved" / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImageEditPipeline" and index["processor"][1] == "Qwen2VLProcessor"
    again = make(tmp_path / "saved", noise_level=0.5)
    torch.testing.assert_close(again.action_stats(r).logp.detach(), stats.logp.detach(), atol=1e-5, rtol=0)
    assert isinstance(QwenImageEditPipeline.from_pretrained(tmp_path / "saved"), QwenImageEditPipeline)


def test_missing_sources_are_data_errors(folder: Path, images: list[str], tmp_path: Path) -> None:
    pol = make(folder)
    with pytest.raises(DataError, match="source_image"):
        pol.rollout([{"prompt": "a"}], 1)
    with pytest.raises(DataError, match="sample 1"):
        pol.rollout([{"prompt": "a", "source_image": images[0]}, {"prompt": "b", "source_image": None}], 1)
    with pytest.raises(DataError, match="source_image"):
        pol.rollout([{"prompt": "a", "source_image": str(tmp_path / "nope.png")}], 1)
    other = make(folder, image_column="before")
    r = other.rollout([{"prompt": "a", "before": Image.open(images[0])}], 1)
    assert r.payload["image_latents"].shape == (1, 4, 16, 16)
