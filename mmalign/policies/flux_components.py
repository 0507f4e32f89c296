"""The FLUX.1 folder loader: `FluxComponents`, `load_flux_components`, `is_flux_folder`.

Details: docs/extending.md, "mmalign.policies.flux_components".
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mmalign.policies.diffusers_notices import quiet_diffusers_fp32_notice

quiet_diffusers_fp32_notice()  # diffusers' empty "should be kept in float32: []" notice (LoRA saves)

__all__ = [
    "FLUX_T5_MAX_LENGTH",
    "FluxComponents",
    "is_flux_folder",
    "load_flux_components",
]

FLUX_T5_MAX_LENGTH = 512
"""diffusers' default ``max_sequence_length`` for Flux's T5 prompt states (FLUX.1-schnell was trained with 256)."""

PARTS = ("transformer", "vae", "scheduler", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")


@dataclass
class FluxComponents:
    """The loaded pieces of a FLUX.1 folder: CLIP (``text_encoder``/``tokenizer``) and T5
    (``text_encoder_2``/``tokenizer_2``) text encoders, the transformer, the VAE and the scheduler."""

    transformer: torch.nn.Module
    vae: torch.nn.Module
    scheduler: Any
    text_encoder: torch.nn.Module
    tokenizer: Any
    text_encoder_2: torch.nn.Module
    tokenizer_2: Any

    def text_encoders(self) -> list[torch.nn.Module]:
        """Both text encoders (CLIP, then T5)."""
        return [self.text_encoder, self.text_encoder_2]

    @torch.no_grad()
    def encode_prompt(
        self,
        prompts: list[str],
        device: torch.device | str = "cpu",
        *,
        max_sequence_length: int = FLUX_T5_MAX_LENGTH,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(prompt_embeds [B, max_sequence_length, T5 width], pooled [B, CLIP width]) as diffusers'
        ``FluxPipeline.encode_prompt`` computes them (one prompt for both encoders, no attention masks):
        the T5 ``last_hidden_state`` of the prompt padded/truncated to ``max_sequence_length`` tokens, and
        the CLIP ``pooler_output`` of the prompt padded/truncated to the CLIP tokenizer's
        ``model_max_length``. Each is cast to its encoder's dtype."""
        prompts = list(prompts)
        clip_ids = self.tokenizer(
            prompts,
            padding="max_length",
            max_length=self.tokenizer.model_max_length,
            truncation=True,
            return_tensors="pt",
        ).input_ids
        pooled = self.text_encoder(clip_ids.to(device), output_hidden_states=False).pooler_output
        t5_ids = self.tokenizer_2(
            prompts,
            padding="max_length",
            max_length=max_sequence_length,
            truncation=True,
            return_tensors="pt",
        ).input_ids
        states = self.text_encoder_2(t5_ids.to(device), output_hidden_states=False)[0]
        return (
            states.to(device=device, dtype=self.text_encoder_2.dtype),
            pooled.to(device=device, dtype=self.text_encoder.dtype),
        )

    def save_pretrained(self, path: str | Path, *, transformer: torch.nn.Module | None = None) -> None:
        """Write every component to its subfolder of `path` (``transformer`` overrides the one saved, e.g. a
        merged LoRA copy) and a ``model_index.json`` for diffusers' ``FluxPipeline.from_pretrained``."""
        import diffusers

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        index: dict[str, Any] = {"_class_name": "FluxPipeline", "_diffusers_version": diffusers.__version__}
        for name in PARTS:
            part = transformer if name == "transformer" and transformer is not None else getattr(self, name)
            part.save_pretrained(path / name)
            lib = "diffusers" if type(part).__module__.startswith("diffusers") else "transformers"
            index[name] = [lib, type(part).__name__]
        (path / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")


def is_flux_folder(name_or_path: str | Path) -> bool:
    """Whether `name_or_path` is a FLUX.1 model: for a local folder, its ``transformer/config.json`` names
    ``FluxTransformer2DModel``; for anything else (a hub id, nothing is fetched to decide) whether the
    name contains "flux" (case-insensitive)."""
    p = Path(name_or_path)
    if p.is_dir():
        cfg = p / "transformer" / "config.json"
        return cfg.is_file() and json.loads(cfg.read_text()).get("_class_name") == "FluxTransformer2DModel"
    return "flux" in str(name_or_path).lower()


def load_flux_components(path: str | Path, *, dtype: torch.dtype = torch.float32) -> FluxComponents:
    """Load each component of the FLUX.1 folder (or hub id) `path` with its own ``from_pretrained``."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5TokenizerFast

    path = str(path)
    return FluxComponents(
        transformer=FluxTransformer2DModel.from_pretrained(path, subfolder="transformer", torch_dtype=dtype),
        vae=AutoencoderKL.from_pretrained(path, subfolder="vae", torch_dtype=dtype),
        scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(path, subfolder="scheduler"),
        text_encoder=CLIPTextModel.from_pretrained(path, subfolder="text_encoder", dtype=dtype),
        tokenizer=CLIPTokenizer.from_pretrained(path, subfolder="tokenizer"),
        text_encoder_2=T5EncoderModel.from_pretrained(path, subfolder="text_encoder_2", dtype=dtype),
        tokenizer_2=T5TokenizerFast.from_pretrained(path, subfolder="tokenizer_2"),
    )
