"""FluxPolicy on tiny offline FLUX.1-style folders: diffusers parity (prompt embeddings, packing, ids, sigmas,
the transformer call), guidance, LoRA save/load, and the text_to_image pipeline choosing it (what every
denoising policy shares, ratio = 1 and gradients included, is in test_denoising_policies.py)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from mmalign import tiny
from mmalign.config import LoraConfig
from mmalign.policies.flux import FluxPolicy, calculate_mu, latent_image_ids, pack_latents, unpack_latents
from mmalign.policies.flux_components import is_flux_folder
from mmalign.tiny.flux import build_tiny_flux

ROWS = [{"prompt": "a red cat", "label": 1}, {"prompt": "Two blue dogs, left!", "label": 2}]
SEQ = 8
"""T5 length used in the tests (small: fast)."""


@pytest.fixture(scope="module")
def dev_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """FLUX.1-dev-like (guidance embedding), built through the registered ``flux_tiny`` builder."""
    return tiny.build("flux_tiny", tmp_path_factory.mktemp("flux") / "dev")


@pytest.fixture(scope="module")
def schnell_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_flux(tmp_path_factory.mktemp("flux") / "schnell", guidance_embeds=False)


def make(path: Path, **kw) -> FluxPolicy:
    kw.setdefault("num_steps", 3)
    kw.setdefault("seed", 0)
    kw.setdefault("max_sequence_length", SEQ)
    return FluxPolicy.from_pretrained(path, **kw)


def flux_pipe(pol: FluxPolicy):
    from diffusers import FluxPipeline

    return FluxPipeline(
        scheduler=copy.deepcopy(pol.scheduler),
        vae=pol.vae,
        text_encoder=pol.text_encoder,
        tokenizer=pol.tokenizer,
        text_encoder_2=pol.text_encoder_2,
        tokenizer_2=pol.tokenizer_2,
        transformer=pol.model,
    )


# ----------------------------------------------------------------------------- diffusers parity


def test_folder_layout_and_prompt_embeds_match_diffusers(dev_dir: Path) -> None:
    for sub in (
        "transformer",
        "vae",
        "scheduler",
        "text_encoder",
        "tokenizer",
        "text_encoder_2",
        "tokenizer_2",
    ):
        assert (dev_dir / sub).is_dir(), sub
    assert json.loads((dev_dir / "model_index.json").read_text())["_class_name"] == "FluxPipeline"
    pol = make(dev_dir)
    assert pol.model.config.guidance_embeds and pol.latent_size == 8 and pol.model.config.in_channels == 16
    pipe = flux_pipe(pol)
    prompts = ["a red cat", "", "Two blue dogs, left! and a much longer tail of words"]
    for max_len in (SEQ, 512):
        with torch.no_grad():
            pe, po, text_ids = pipe.encode_prompt(prompts, prompts, device="cpu", max_sequence_length=max_len)
            ours_pe, ours_po = pol.components.encode_prompt(prompts, max_sequence_length=max_len)
        assert ours_pe.shape == (3, max_len, 32) and ours_po.shape == (3, 16)
        assert (
            torch.equal(ours_pe, pe)
            and torch.equal(ours_po, po)
            and torch.equal(text_ids, torch.zeros(max_len, 3))
        )
    # the policy's cached encoding: the same values, each distinct prompt encoded once
    calls: list[list[str]] = []
    encode = pol.components.encode_prompt
    pol.components.encode_prompt = lambda p, *a, **k: (calls.append(list(p)), encode(p, *a, **k))[1]  # type: ignore[method-assign]
    with torch.no_grad():
        pe, po, _ = pipe.encode_prompt(prompts, device="cpu", max_sequence_length=SEQ)
    got_pe, got_po = pol.encode_prompt([prompts[0], prompts[1], prompts[0], prompts[2]])
    assert torch.equal(got_pe, pe[[0, 1, 0, 2]]) and torch.equal(got_po, po[[0, 1, 0, 2]])
    pol.encode_prompt(prompts)
    assert calls == [prompts]


def test_packing_and_ids_match_diffusers() -> None:
    from diffusers import FluxPipeline

    x = torch.randn(2, 4, 8, 6)
    packed = pack_latents(x)
    assert packed.shape == (2, 12, 16)
    assert torch.equal(packed, FluxPipeline._pack_latents(x, 2, 4, 8, 6))
    assert torch.equal(unpack_latents(packed, 8, 6), x)
    assert torch.equal(FluxPipeline._unpack_latents(packed, 16, 12, 2), x)  # pixels / vae_scale_factor 2
    assert torch.equal(
        latent_image_ids(4, 3), FluxPipeline._prepare_latent_image_ids(2, 4, 3, "cpu", torch.float32)
    )
    with pytest.raises(ValueError, match="even"):
        pack_latents(torch.randn(1, 4, 7, 8))


def test_sigmas_match_flux_pipeline(dev_dir: Path) -> None:
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps

    pol = make(dev_dir)
    cfg = pol.scheduler.config
    assert cfg.use_dynamic_shifting
    seen = []
    for latent_size, steps in ((8, 3), (8, 10), (64, 4), (128, 10)):
        pol.latent_size, pol.num_steps = latent_size, steps
        ours = pol.sigmas()
        seq = (latent_size // 2) ** 2
        mu = calculate_shift(
            seq,
            cfg.get("base_image_seq_len", 256),
            cfg.get("max_image_seq_len", 4096),
            cfg.get("base_shift", 0.5),
            cfg.get("max_shift", 1.15),
        )
        assert calculate_mu(seq, cfg) == mu
        sched = copy.deepcopy(pol.scheduler)
        retrieve_timesteps(sched, steps, "cpu", sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
        assert torch.equal(ours, sched.sigmas.float()) and ours[0] == 1 and ours[-1] == 0
        seen.append(ours)
    assert not torch.equal(
        seen[0], make(dev_dir, num_steps=3, latent_size=16).sigmas()
    )  # resolution-dependent
    pol.latent_size = 7
    with pytest.raises(ValueError, match="even"):
        pol.sigmas()


@pytest.mark.parametrize("which", ["dev", "schnell"])
def test_velocity_matches_the_flux_pipeline_transformer_call(
    which: str, dev_dir: Path, schnell_dir: Path
) -> None:
    """Run diffusers' FluxPipeline, record its first transformer call, and feed `_forward` the same state
    (unpacked): every input it builds (packed latents, ids, guidance, timestep) and the velocity agree."""
    pol = make(dev_dir if which == "dev" else schnell_dir, guidance_scale=3.5)
    calls: list[tuple[dict, torch.Tensor]] = []
    hook = pol.model.register_forward_hook(
        lambda m, a, kw, out: calls.append((dict(kw), out[0])), with_kwargs=True
    )
    try:
        latents = flux_pipe(pol)(
            prompt=["a red cat"],
            height=16,
            width=16,
            num_inference_steps=2,
            guidance_scale=3.5,
            output_type="latent",
            max_sequence_length=SEQ,
            generator=torch.Generator().manual_seed(0),
        ).images
        assert latents.shape == (1, 16, 16) and len(calls) == 2
        kw, v_pipe = calls[0]
        x = unpack_latents(kw["hidden_states"], 8, 8)
        with torch.no_grad():
            pe, po = pol.encode_prompt(["a red cat"])
            cond = {"prompt_embeds": pe, "pooled_embeds": po}
            v, v_c = pol.predict(pol.model, x, {"sigmas": kw["timestep"]}, cond)
    finally:
        hook.remove()
    mine = calls[2][0]
    for key in (
        "hidden_states",
        "timestep",
        "encoder_hidden_states",
        "pooled_projections",
        "txt_ids",
        "img_ids",
    ):
        assert torch.equal(mine[key], kw[key]), key
    if which == "dev":
        assert torch.equal(mine["guidance"], kw["guidance"]) and float(kw["guidance"][0]) == 3.5
    else:
        assert mine["guidance"] is None and kw["guidance"] is None
    torch.testing.assert_close(v, unpack_latents(v_pipe, 8, 8), atol=0, rtol=0)
    assert v_c is v
    # the pipeline's timestep / 1000 is our first sigma; the whole schedule is the same
    torch.testing.assert_close(kw["timestep"], pol.sigmas()[:1], atol=1e-6, rtol=0)


# ----------------------------------------------------------------------------- policy behaviour


def test_guidance_and_noise(dev_dir: Path) -> None:
    a, b = make(dev_dir, guidance_scale=1.0), make(dev_dir, guidance_scale=5.0, train_guidance=False)
    assert b.train_guidance  # no CFG branches for Flux: ignored
    x, sched = torch.randn(1, 4, 8, 8), {"sigmas": torch.tensor([0.7])}
    pe, po = a.encode_prompt(["a red cat"])
    cond = {"prompt_embeds": pe, "pooled_embeds": po}
    with torch.no_grad():
        assert not torch.allclose(
            a.predict(a.model, x, sched, cond)[0], b.predict(b.model, x, sched, cond)[0]
        )
    pol = make(dev_dir, same_initial_noise=True)
    noise = pol._initial_noise(torch.tensor([0, 0, 1]))
    assert (
        noise.shape == (3, 4, 8, 8)
        and torch.equal(noise[0], noise[1])
        and not torch.equal(noise[0], noise[2])
    )
    with pytest.raises(ValueError, match="even"):
        make(dev_dir, latent_size=5)


def test_lora_save_and_reload(dev_dir: Path, tmp_path: Path) -> None:
    pol = make(dev_dir, need_reference=True, lora=LoraConfig(enabled=True, r=4, target_modules="all-linear"))
    names = [n for n, p in pol.model.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    assert any("add_q_proj" in n for n in names) and any("to_add_out" in n for n in names)
    r = pol.rollout(ROWS, 2)
    with torch.no_grad():
        for n, p in pol.model.named_parameters():
            if "lora_B" in n:
                p.add_(0.3)
    stats = pol.action_stats(r)
    assert (stats.kl.detach() > 0).any()
    torch.testing.assert_close(pol.reference_logprobs(r), r.logp_old, atol=1e-5, rtol=0)  # adapter off = base
    pol.save(tmp_path / "out")
    assert (tmp_path / "out" / "transformer_lora").is_dir() and (tmp_path / "out" / "text_encoder_2").is_dir()
    again = make(tmp_path / "out")
    assert not again.lora
    torch.testing.assert_close(again.action_stats(r).logp.detach(), stats.logp.detach(), atol=1e-5, rtol=0)
    assert not torch.allclose(make(dev_dir).action_stats(r).logp.detach(), stats.logp.detach(), atol=1e-6)
    from diffusers import FluxPipeline

    assert FluxPipeline.from_pretrained(tmp_path / "out").transformer.config.guidance_embeds


# ----------------------------------------------------------------------------- text_to_image pipeline


def test_flux_detection(dev_dir: Path, tmp_path: Path) -> None:
    from mmalign.tiny.sd3 import build_tiny_sd3

    assert is_flux_folder(dev_dir) and not is_flux_folder(build_tiny_sd3(tmp_path / "sd3"))
    assert is_flux_folder("black-forest-labs/FLUX.1-dev") and not is_flux_folder(
        "stabilityai/stable-diffusion-3.5-medium"
    )


def test_text_to_image_pipeline_trains_a_flux_step(dev_dir: Path, tmp_path: Path) -> None:
    import pipelines
    from mmalign.config import load_config
    from mmalign.training.trainer import GroupTrainer

    repo = Path(__file__).resolve().parents[2]
    assets = repo / "assets" / "text_to_image"

    def cfg_with(*extra: str):
        return load_config(
            repo / "configs" / "text_to_image-tiny.yaml",
            [
                f"model.name_or_path={dev_dir}",
                f"output_dir={tmp_path / 'run'}",
                "trainer.progress_bar=false",
                f"data.train={assets / 'train.jsonl'}",
                f"data.eval={assets / 'eval.jsonl'}",
                "options.num_steps=3",
                "rollout.group_size=2",
                "rollout.prompts_per_step=2",
                "trainer.steps=1",
                "algorithm.kl_coef=0.01",
                f"options.max_sequence_length={SEQ}",
                "options.guidance_scale=3.5",
                "options.resolution=16",
                "rewards.0.name=jpeg_incompressibility",
                *extra,
            ],
        )

    cfg = cfg_with()
    comps = pipelines.get("text_to_image")(cfg)
    pol = comps.policy
    assert isinstance(pol, FluxPolicy) and pol.num_steps == 3 and pol.need_reference and pol.lora
    assert pol.latent_size == 8 and pol.guidance_scale == 3.5 and pol.max_sequence_length == SEQ
    before = {k: v.clone() for k, v in pol.trainable_state_dict().items()}
    history = GroupTrainer(cfg, comps).train()
    assert history[-1]["reward/jpeg_incompressibility/std"] > 0
    after = pol.trainable_state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    with pytest.raises(ValueError, match=r"options\.resolution.*even"):
        pipelines.get("text_to_image")(cfg_with("options.resolution=10"))
