"""Flux2Policy / Flux2KleinPolicy on tiny offline FLUX.2 folders (`mmalign.tiny.flux2`): the folders load in
diffusers' ``Flux2Pipeline`` / ``Flux2KleinPipeline``, the prompt states are the pipelines', the deterministic
sampler (noise_level 0) reproduces the pipelines' latents from the same initial noise (distilled guidance for
[dev]; CFG, no CFG and the step-distilled flag for [klein]), decoding is the pipeline's, re-scoring the sampled
SDE steps gives ratio 1, LoRA (reference = adapter off, save / reload), and the family registry choosing them."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from torch import Tensor

from mmalign import tiny
from mmalign.config import LoraConfig
from mmalign.policies.families import family_for
from mmalign.policies.flux2 import (
    Flux2KleinPolicy,
    Flux2Policy,
    pack_grid,
    patchify,
    unpack_grid,
    unpatchify,
)

PROMPTS = ["two red squares on the left", "one blue square at the top"]
ROWS = [{"prompt": p} for p in PROMPTS]
SEQ = 48
"""Prompt tokens in the tests (the system message and caption fit)."""


@pytest.fixture(scope="module")
def dev_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny.build("flux2_tiny", tmp_path_factory.mktemp("flux2") / "dev", announce=False)


@pytest.fixture(scope="module")
def klein_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny.build("flux2_klein_tiny", tmp_path_factory.mktemp("flux2") / "klein", announce=False)


def make(cls, path: Path, **kw):
    for k, v in {"num_steps": 4, "seed": 0, "latent_size": 16, "max_sequence_length": SEQ}.items():
        kw.setdefault(k, v)
    return cls.from_pretrained(path, **kw)


def pipe_of(pol):
    from diffusers import Flux2KleinPipeline, Flux2Pipeline

    parts = dict(
        scheduler=copy.deepcopy(pol.scheduler),
        vae=pol.vae,
        text_encoder=pol.text_encoder,
        tokenizer=pol.tokenizer,
        transformer=pol.model,
    )
    if isinstance(pol, Flux2KleinPolicy):
        return Flux2KleinPipeline(**parts, is_distilled=pol.components.is_distilled)
    return Flux2Pipeline(**parts)


def ode_rollout(pol) -> tuple[Tensor, Tensor]:
    """(initial noise, final latents) of the policy's deterministic sampler on ROWS."""
    pol.noise_level = 0.0
    assert pol.sampler.deterministic
    pol.generator.manual_seed(7)
    noise = pol._initial_noise(torch.arange(len(ROWS)))
    pol.generator.manual_seed(7)
    r = pol.rollout(ROWS, 1, compute_logp=False)
    assert r.num_actions == 0
    return noise, r.outputs["latents"]


def bn_unnormalise(vae, z: Tensor) -> Tensor:
    """The pipelines' latent un-normalisation, written out: z sqrt(var + eps) + mean, then un-patchified."""
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
    return unpatchify(z * std + vae.bn.running_mean.view(1, -1, 1, 1))


# ----------------------------------------------------------------------------- folders and prompts


def test_folders_load_in_diffusers_with_the_published_layout(dev_dir: Path, klein_dir: Path) -> None:
    from diffusers import Flux2KleinPipeline, Flux2Pipeline

    assert {"flux2_tiny", "flux2_klein_tiny"} <= set(tiny.load_builders())
    for folder, cls in ((dev_dir, Flux2Pipeline), (klein_dir, Flux2KleinPipeline)):
        index = json.loads((folder / "model_index.json").read_text())
        assert index["_class_name"] == cls.__name__
        assert {"transformer", "vae", "scheduler", "text_encoder", "tokenizer"} <= set(index)
        assert isinstance(cls.from_pretrained(folder), cls)
    assert json.loads((dev_dir / "model_index.json").read_text())["text_encoder"][1] == (
        "Mistral3ForConditionalGeneration"
    )
    klein_index = json.loads((klein_dir / "model_index.json").read_text())
    assert klein_index["text_encoder"][1] == "Qwen3ForCausalLM" and klein_index["is_distilled"] is False
    assert family_for(dev_dir, "text_to_image").name == "flux2"
    assert family_for(klein_dir, "text_to_image").name == "flux2_klein"
    assert family_for("black-forest-labs/FLUX.2-dev", "text_to_image").name == "flux2"
    assert family_for("black-forest-labs/FLUX.2-klein-4B", "text_to_image").name == "flux2_klein"
    assert family_for("black-forest-labs/FLUX.1-dev", "text_to_image").name == "flux"


@pytest.mark.parametrize("which", ["dev", "klein"])
def test_prompt_states_equal_the_pipeline(which: str, dev_dir: Path, klein_dir: Path) -> None:
    cls, folder = (Flux2Policy, dev_dir) if which == "dev" else (Flux2KleinPolicy, klein_dir)
    pol = make(cls, folder)
    prompts = [*PROMPTS, ""]
    ours = pol.encode_prompt(prompts)
    with torch.no_grad():
        theirs, ids = pipe_of(pol).encode_prompt(prompts, device="cpu", max_sequence_length=SEQ)
    width = 3 * pol.text_encoder.config.get_text_config().hidden_size
    assert ours.shape == (3, SEQ, width) == theirs.shape
    torch.testing.assert_close(ours, theirs.float(), rtol=0, atol=0)
    assert not torch.equal(ours[0], ours[2])  # the prompt reaches the states


def test_grid_packing_matches_the_pipeline() -> None:
    from diffusers import Flux2Pipeline

    z = torch.randn(2, 3, 8, 6)
    torch.testing.assert_close(patchify(z), Flux2Pipeline._patchify_latents(z), rtol=0, atol=0)
    torch.testing.assert_close(unpatchify(patchify(z)), z, rtol=0, atol=0)
    x = torch.randn(2, 12, 4, 3)
    tokens = pack_grid(x)
    torch.testing.assert_close(tokens, Flux2Pipeline._pack_latents(x), rtol=0, atol=0)
    ids = Flux2Pipeline._prepare_latent_ids(x)
    torch.testing.assert_close(unpack_grid(tokens, 4, 3), Flux2Pipeline._unpack_latents_with_ids(tokens, ids))


# ----------------------------------------------------------------------------- sampler parity


def test_dev_ode_sampler_equals_flux2_pipeline(dev_dir: Path) -> None:
    """Same initial noise, 4 steps, distilled guidance 4.0: the policy's final latents are the pipeline's
    (output_type latent: the packed grid). Measured relative difference 0 in fp32; asserted below 1e-5."""
    pol = make(Flux2Policy, dev_dir, guidance_scale=4.0)
    noise, ours = ode_rollout(pol)
    theirs = pipe_of(pol)(
        prompt=PROMPTS,
        height=32,
        width=32,
        num_inference_steps=4,
        guidance_scale=4.0,
        latents=noise.clone(),
        max_sequence_length=SEQ,
        output_type="latent",
    ).images
    theirs = unpack_grid(theirs.float(), 8, 8)
    rel = float((ours - theirs).abs().max() / theirs.abs().max())
    print(f"FLUX.2 [dev] ODE parity: max relative difference {rel:.2e}")
    assert rel < 1e-5
    # the guidance input matters (the tiny transformer has a guidance embedding)
    other = make(Flux2Policy, dev_dir, guidance_scale=1.5)
    assert not torch.allclose(ode_rollout(other)[1], ours, atol=1e-4)


@pytest.mark.parametrize("cfg,distilled", [(1.0, False), (3.0, False), (3.0, True)])
def test_klein_ode_sampler_equals_flux2_klein_pipeline(klein_dir: Path, cfg: float, distilled: bool) -> None:
    """Same initial noise, 4 steps; CFG against the empty prompt (off at 1 and for a step-distilled checkpoint,
    whose pipeline ignores the scale). The pipeline's latent output is un-normalised and un-patchified, so the
    policy's grid goes through the same transform. Measured relative difference ~3e-7; asserted below 1e-5."""
    pol = make(Flux2KleinPolicy, klein_dir, guidance_scale=cfg)
    pol.components.is_distilled = distilled
    noise, ours = ode_rollout(pol)
    theirs = pipe_of(pol)(
        prompt=PROMPTS,
        height=32,
        width=32,
        num_inference_steps=4,
        guidance_scale=cfg,
        latents=noise.clone(),
        max_sequence_length=SEQ,
        output_type="latent",
    ).images.float()
    mine = bn_unnormalise(pol.vae, ours)
    rel = float((mine - theirs).abs().max() / theirs.abs().max())
    print(
        f"FLUX.2 [klein] ODE parity (guidance {cfg}, distilled {distilled}): max relative difference {rel:.2e}"
    )
    assert rel < 1e-5


def test_decode_equals_the_pipeline(dev_dir: Path) -> None:
    pol = make(Flux2Policy, dev_dir)
    z = torch.randn(2, 16, 8, 8, generator=torch.Generator().manual_seed(2))
    ours = pol.decode_latents(z)
    theirs = pipe_of(pol)(
        prompt=PROMPTS,
        height=32,
        width=32,
        num_inference_steps=1,
        max_sequence_length=SEQ,
        output_type="pt",
        callback_on_step_end=lambda p, i, t, kw: {"latents": pack_grid(z)},
    ).images
    assert ours.shape == (2, 3, 32, 32)
    torch.testing.assert_close(ours, theirs.float(), rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- training


@pytest.mark.parametrize(
    "which,kind", [("dev", "flow_sde"), ("dev", "cps"), ("klein", "flow_sde"), ("klein", "cps")]
)
def test_ratio_is_one_and_gradients_reach_the_transformer(
    which: str, kind: str, dev_dir: Path, klein_dir: Path
) -> None:
    cls, folder = (Flux2Policy, dev_dir) if which == "dev" else (Flux2KleinPolicy, klein_dir)
    pol = make(cls, folder, sde_kind=kind, noise_level=0.7, guidance_scale=2.0, window_size=2)
    r = pol.rollout(ROWS, 2)
    assert r.num_actions == 2
    stats = pol.action_stats(r)
    torch.testing.assert_close(torch.exp(stats.logp - r.logp_old), torch.ones(4, 2), rtol=0, atol=1e-5)
    stats.logp.sum().backward()
    grads = {n: p.grad for n, p in pol.model.named_parameters() if p.requires_grad}
    assert all(g is not None for n, g in grads.items() if n.startswith(("x_embedder", "proj_out")))
    assert not any(p.requires_grad for p in pol.text_encoder.parameters())
    pol.decode(r)
    assert r.outputs["images"].shape == (4, 3, 32, 32)


def test_lora_reference_and_save_reload(klein_dir: Path, tmp_path: Path) -> None:
    from diffusers import Flux2KleinPipeline

    pol = make(Flux2KleinPolicy, klein_dir, lora=LoraConfig(enabled=True, r=2, alpha=4), need_reference=True)
    trainable = [n for n, p in pol.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora" in n for n in trainable)
    assert any("to_qkv_mlp_proj" in n for n in trainable) and any("add_q_proj" in n for n in trainable)
    r = pol.rollout(ROWS, 1)
    torch.testing.assert_close(pol.reference_logprobs(r), r.logp_old, rtol=0, atol=1e-5)
    with torch.no_grad():
        for p in pol.trainable_parameters():
            p.add_(0.05)
    pol.save(tmp_path / "saved")
    assert (tmp_path / "saved" / "transformer_lora").is_dir()
    again = make(Flux2KleinPolicy, tmp_path / "saved")
    x = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(3))
    sched, cond = {"sigmas": torch.tensor([0.5])}, pol.conditioning(["a"])
    with torch.no_grad():
        torch.testing.assert_close(
            again.velocity(again.model, x, sched, cond),
            pol.velocity(pol.model, x, sched, cond),
            atol=1e-5,
            rtol=0,
        )
    assert isinstance(Flux2KleinPipeline.from_pretrained(tmp_path / "saved"), Flux2KleinPipeline)


def test_settings_are_checked(dev_dir: Path) -> None:
    with pytest.raises(ValueError, match="latent_size .* must be even"):
        make(Flux2Policy, dev_dir, latent_size=15)
    with pytest.raises(ValueError, match="text_encoder_out_layers"):
        make(Flux2Policy, dev_dir, text_encoder_out_layers=[10, 20, 31])
    with pytest.raises(ValueError, match="true CFG"):
        make(Flux2Policy, dev_dir, true_cfg_scale=2.0)
    assert make(Flux2Policy, dev_dir, latent_size=None).latent_size == 512  # 1024 px over the tiny VAE's 2
    pol = make(Flux2Policy, dev_dir, text_encoder_out_layers=[1, 2, 3])
    assert pol.encode_prompt(PROMPTS).shape == (2, SEQ, 48)


def test_all_linear_adapts_the_single_blocks_output(klein_dir: Path) -> None:
    """``all-linear`` on FLUX.2 adapts every single block's ``attn.to_out`` Linear (a module list of the same
    suffix in the double blocks is left out, its ``to_out.0`` adapted instead), counted independently here."""
    pol = make(
        Flux2KleinPolicy, klein_dir, lora=LoraConfig(enabled=True, r=2, alpha=4, target_modules="all-linear")
    )
    adapted = {n.removesuffix(".lora_A") for n, _ in pol.model.named_modules() if n.endswith(".lora_A")}
    adapted = {n.removesuffix(".base_layer") for n in adapted}
    singles = pol.model.config.num_single_layers
    doubles = pol.model.config.num_layers
    assert {f"single_transformer_blocks.{i}.attn.to_out" for i in range(singles)} <= adapted
    assert {f"single_transformer_blocks.{i}.attn.to_qkv_mlp_proj" for i in range(singles)} <= adapted
    assert {f"transformer_blocks.{i}.attn.to_out.0" for i in range(doubles)} <= adapted
    assert not any(n.endswith("attn.to_out") and n.startswith("transformer_blocks") for n in adapted)


def test_adaptable_targets_keeps_plain_suffixes_and_resolves_containers() -> None:
    from mmalign.policies.denoising import adaptable_targets

    class Block(torch.nn.Module):
        def __init__(self, listed: bool) -> None:
            super().__init__()
            self.to_out = torch.nn.ModuleList([torch.nn.Linear(2, 2)]) if listed else torch.nn.Linear(2, 2)
            self.to_q = torch.nn.Linear(2, 2)

    model = torch.nn.ModuleDict({"joint": Block(True), "solo": Block(False)})
    assert adaptable_targets(model, ["to_q", "to_out.0"]) == ["to_q", "to_out.0"]  # all layers: as given
    assert adaptable_targets(model, ["to_q", "to_out"]) == ["joint.to_q", "solo.to_out", "solo.to_q"]
