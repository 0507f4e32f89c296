"""Adding a flow-matching family: one `FlowMatchingPolicy` subclass, one components loader, one tiny builder.

A real family touches 3 new files and no existing one: ``mmalign/policies/<family>.py`` (the subclass:
`load_components`, `encode_conditioning`, `velocity`), ``mmalign/policies/<family>_components.py`` (the
loader) and ``mmalign/tiny/<family>.py`` (the tiny builder for the tests). Choosing it by folder in the
``text_to_image`` pipeline is one more line (`mmalign.policies.flux.flow_policy_class`).

Here the toy family reuses the tiny SD3 folder's transformer, VAE and scheduler (its builder) but brings its
own components and conditioning: a byte-embedding text encoder instead of SD3's CLIPs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mmalign.policies.flow_matching import FlowMatchingPolicy

SEQ = 8
ROWS = [{"prompt": "a red cat"}, {"prompt": "a blue dog"}]


class ByteTextEncoder(torch.nn.Module):
    """Prompt bytes -> (states [B, SEQ, D], pooled [B, P]): an embedding and a projection of the mean."""

    def __init__(self, dim: int, pooled_dim: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(256, dim)
        self.pool = torch.nn.Linear(dim, pooled_dim)

    def forward(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        ids = torch.zeros((len(prompts), SEQ), dtype=torch.long)
        for i, p in enumerate(prompts):
            b = list(p.encode()[:SEQ])
            ids[i, : len(b)] = torch.tensor(b, dtype=torch.long)
        states = self.embed(ids.to(self.embed.weight.device))
        return states, self.pool(states.mean(dim=1))


@dataclass
class ToyComponents:
    transformer: torch.nn.Module
    vae: torch.nn.Module
    scheduler: Any
    text_encoder: torch.nn.Module
    tokenizer: Any = None

    def text_encoders(self) -> list[torch.nn.Module]:
        return [self.text_encoder]

    def save_pretrained(self, path: str | Path, *, transformer: torch.nn.Module | None = None) -> None:
        raise NotImplementedError


def load_toy_components(path: str | Path, *, dtype: torch.dtype = torch.float32) -> ToyComponents:
    """The components loader: diffusers parts of the folder plus the family's own text encoder."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel

    transformer = SD3Transformer2DModel.from_pretrained(path, subfolder="transformer", torch_dtype=dtype)
    cfg = transformer.config
    return ToyComponents(
        transformer=transformer,
        vae=AutoencoderKL.from_pretrained(path, subfolder="vae", torch_dtype=dtype),
        scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(path, subfolder="scheduler"),
        text_encoder=ByteTextEncoder(int(cfg.joint_attention_dim), int(cfg.pooled_projection_dim)),
    )


class ToyPolicy(FlowMatchingPolicy):
    """The whole family: its loader, its conditioning and its network call."""

    lora_targets = ("to_q", "to_k", "to_v")

    @classmethod
    def load_components(
        cls, name_or_path: str | Path, *, dtype: torch.dtype, **options: Any
    ) -> ToyComponents:
        return load_toy_components(name_or_path, dtype=dtype)

    def encode_conditioning(self, prompts: list[str]) -> dict[str, Tensor]:
        with torch.no_grad():
            pe, po = self.text_encoder(prompts)
        return {"prompt_embeds": pe, "pooled_embeds": po}

    def velocity(
        self, model: torch.nn.Module, latents: Tensor, sched: dict[str, Tensor], cond: dict[str, Tensor]
    ) -> Tensor:
        dtype = next(model.parameters()).dtype
        return model(
            hidden_states=latents.to(dtype),
            encoder_hidden_states=cond["prompt_embeds"].to(dtype),
            pooled_projections=cond["pooled_embeds"].to(dtype),
            timestep=(sched["sigmas"] * 1000).to(dtype),
            return_dict=False,
        )[0]


def test_a_new_family_rolls_out_and_rescores_with_ratio_one(tiny_sd3_model_dir: Path) -> None:
    pol = ToyPolicy.from_pretrained(tiny_sd3_model_dir, num_steps=3, seed=0, guidance_scale=2.0)
    assert isinstance(pol.components, ToyComponents) and not pol.text_encoder.embed.weight.requires_grad
    r = pol.rollout(ROWS, 2, compute_logp=True)
    assert r.logp_old is not None and r.mask.shape == (4, 3) and r.mask.all()
    stats = pol.action_stats(r)
    assert stats.logp.requires_grad
    torch.testing.assert_close(stats.logp.detach()[r.mask], r.logp_old[r.mask], atol=1e-5, rtol=1e-5)
    assert [p for p in pol.trainable_parameters()]  # the transformer trains (no LoRA requested)
