"""A tiny FLUX.1-style pipeline built offline from config kwargs, and the Flux folder loader.

`build_tiny_flux(path)` writes a folder with the layout of a real FLUX.1 (dev / schnell) diffusers folder:

- ``transformer/``: a ``FluxTransformer2DModel`` (one double-stream and one single-stream block, 2 heads of
  16 dims; ``in_channels`` = 4 x the VAE's latent channels, since Flux works on 2x2-packed latents);
- ``vae/``: an ``AutoencoderKL`` with ``scaling_factor`` and ``shift_factor`` set (Flux decodes
  ``z / scaling_factor + shift_factor``);
- ``scheduler/``: a ``FlowMatchEulerDiscreteScheduler`` with ``use_dynamic_shifting=True`` and Flux's
  resolution-dependent shift settings (``base_shift``, ``max_shift``, ``base_image_seq_len``,
  ``max_image_seq_len``);
- ``text_encoder/`` + ``tokenizer/``: a ``CLIPTextModel`` (its ``pooler_output`` is the pooled prompt
  embedding) with the byte-level CLIP tokenizer of `mmalign.tiny_flow`;
- ``text_encoder_2/`` + ``tokenizer_2/``: a ``T5EncoderModel`` (its states are the prompt embeddings)
  with the character T5 tokenizer of `mmalign.tiny_flow`;
- ``model_index.json`` naming ``FluxPipeline``, so diffusers can load the folder as a whole too.

Each part is written with ``save_pretrained`` and `load_flux_components(path)` loads it back with
``from_pretrained`` per component -- the path a real FLUX.1 folder takes. Nothing is downloaded.
`FluxComponents.encode_prompt` reproduces diffusers' ``FluxPipeline.encode_prompt``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mmalign.tiny import BUILDERS
from mmalign.tiny_flow import TOKEN_LENGTH, clip_byte_tokenizer, t5_char_tokenizer

__all__ = [
    "FLUX_T5_MAX_LENGTH",
    "FluxComponents",
    "build_tiny_flux",
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


def build_tiny_flux(
    path: str | Path,
    *,
    guidance_embeds: bool = True,
    image_size: int = 16,
    latent_channels: int = 4,
    clip_hidden: int = 16,
    t5_hidden: int = 32,
    seed: int = 0,
) -> Path:
    """Write a tiny FLUX.1-style folder at `path` (random weights, ~100k parameters); see the module docstring.

    ``guidance_embeds`` True gives a FLUX.1-dev-like transformer (distilled guidance embedding), False a
    schnell-like one. The VAE downsamples by 2, so ``image_size`` pixels give ``image_size / 2`` latents
    (the VAE's ``sample_size``), which must be even for the 2x2 packing.
    """
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    if image_size % 4:
        raise ValueError(
            f"image_size must be a multiple of 4 (even latents after the 2x VAE), got {image_size}"
        )
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=4 * latent_channels,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=t5_hidden,
        pooled_projection_dim=clip_hidden,
        guidance_embeds=guidance_embeds,
        axes_dims_rope=(4, 6, 6),
    )
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(8, 8),
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=4,
        sample_size=image_size,
        scaling_factor=0.3611,
        shift_factor=0.1159,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    tokenizer = clip_byte_tokenizer()
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=clip_hidden,
            intermediate_size=2 * clip_hidden,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=TOKEN_LENGTH,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )
    tokenizer_2 = t5_char_tokenizer()
    text_encoder_2 = T5EncoderModel(
        T5Config(
            vocab_size=len(tokenizer_2),
            d_model=t5_hidden,
            d_kv=8,
            d_ff=2 * t5_hidden,
            num_layers=1,
            num_heads=2,
            relative_attention_num_buckets=8,
            pad_token_id=tokenizer_2.pad_token_id,
            eos_token_id=tokenizer_2.eos_token_id,
            decoder_start_token_id=tokenizer_2.pad_token_id,
        )
    )
    FluxComponents(
        transformer, vae, scheduler, text_encoder, tokenizer, text_encoder_2, tokenizer_2
    ).save_pretrained(path)
    return path


@BUILDERS.register("flux_tiny", minutes=0.05)
def _build_registered(path: Path) -> None:
    build_tiny_flux(path)
