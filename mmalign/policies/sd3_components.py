"""The SD3 / SD3.5 folder loader: `SD3Components`, `load_sd3_components` and SD3's prompt encoding.

Details: docs/extending.md, "mmalign.policies.sd3_components".
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
    "SD3Components",
    "encode_prompt",
    "load_sd3_components",
]

T5_MAX_LENGTH = 256
"""diffusers' default ``max_sequence_length`` for SD3's T5 prompt embeddings."""

EXTRA_COMPONENTS = ("text_encoder_2", "tokenizer_2", "text_encoder_3", "tokenizer_3")


@dataclass
class SD3Components:
    """The loaded pieces of an SD3-style folder.

    ``text_encoder``/``tokenizer`` always; the SD3 layout adds ``text_encoder_2``/``tokenizer_2`` (the
    second CLIP) and, optionally, ``text_encoder_3``/``tokenizer_3`` (T5). The tiny single-encoder
    layout leaves those four None.
    """

    transformer: torch.nn.Module
    vae: torch.nn.Module
    scheduler: Any
    text_encoder: torch.nn.Module
    tokenizer: Any
    text_encoder_2: torch.nn.Module | None = None
    tokenizer_2: Any = None
    text_encoder_3: torch.nn.Module | None = None
    tokenizer_3: Any = None

    def __post_init__(self) -> None:
        if (self.text_encoder_2 is None) != (self.tokenizer_2 is None):
            raise ValueError("text_encoder_2 and tokenizer_2 must be given together")
        if (self.text_encoder_3 is None) != (self.tokenizer_3 is None):
            raise ValueError("text_encoder_3 and tokenizer_3 must be given together")
        if self.text_encoder_3 is not None and self.text_encoder_2 is None:
            raise ValueError(
                "a T5 text_encoder_3 needs the second CLIP (text_encoder_2) too (the SD3 layout)"
            )

    @property
    def is_sd3_layout(self) -> bool:
        """True for the real SD3 layout (two CLIPs, optional T5), False for the tiny single CLIP."""
        return self.text_encoder_2 is not None

    def text_encoders(self) -> list[torch.nn.Module]:
        """Every text encoder present, in order."""
        return [m for m in (self.text_encoder, self.text_encoder_2, self.text_encoder_3) if m is not None]

    def encode_prompt(
        self,
        prompts: list[str],
        device: torch.device | str = "cpu",
        *,
        max_sequence_length: int = T5_MAX_LENGTH,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(prompt_embeds [B, L, D], pooled [B, P]) of `prompts`; see `encode_prompt`."""
        return encode_prompt(
            self.text_encoder,
            self.tokenizer,
            prompts,
            device,
            text_encoder_2=self.text_encoder_2,
            tokenizer_2=self.tokenizer_2,
            text_encoder_3=self.text_encoder_3,
            tokenizer_3=self.tokenizer_3,
            max_sequence_length=max_sequence_length,
            joint_attention_dim=int(self.transformer.config.joint_attention_dim),
        )

    def save_pretrained(self, path: str | Path, *, transformer: torch.nn.Module | None = None) -> None:
        """Write every component to its subfolder of `path` (``transformer`` overrides the one saved,
        e.g. a merged LoRA copy); the SD3 layout also gets a diffusers ``model_index.json`` (absent T5 as
        ``[null, null]``) so ``StableDiffusion3Pipeline.from_pretrained(path)`` loads the folder too."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (transformer or self.transformer).save_pretrained(path / "transformer")
        self.vae.save_pretrained(path / "vae")
        self.scheduler.save_pretrained(path / "scheduler")
        self.text_encoder.save_pretrained(path / "text_encoder")
        self.tokenizer.save_pretrained(path / "tokenizer")
        for name in EXTRA_COMPONENTS:
            part = getattr(self, name)
            if part is not None:
                part.save_pretrained(path / name)
        if self.is_sd3_layout:
            import diffusers

            index: dict[str, Any] = {
                "_class_name": "StableDiffusion3Pipeline",
                "_diffusers_version": diffusers.__version__,
            }
            for name in ("transformer", "vae", "scheduler", "text_encoder", "tokenizer", *EXTRA_COMPONENTS):
                part = (
                    transformer if name == "transformer" and transformer is not None else getattr(self, name)
                )
                if part is None:
                    index[name] = [None, None]
                else:
                    lib = "diffusers" if type(part).__module__.startswith("diffusers") else "transformers"
                    index[name] = [lib, type(part).__name__]
            (path / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")


def _present(path: str | Path) -> set[str]:
    """Names of the components a pipeline folder (or hub id, via its model_index.json) holds."""
    p = Path(path)
    if p.is_dir():
        return {d.name for d in p.iterdir() if d.is_dir()}
    from diffusers import DiffusionPipeline

    index = DiffusionPipeline.load_config(str(path))
    return {
        k
        for k, v in index.items()
        if not k.startswith("_") and isinstance(v, list | tuple) and v[0] is not None
    }


def load_sd3_components(
    path: str | Path, *, dtype: torch.dtype = torch.float32, load_t5: bool = True
) -> SD3Components:
    """Load each component with its own ``from_pretrained`` from the pipeline folder (or hub id) `path`.

    Loads ``text_encoder_2``/``tokenizer_2`` (second CLIP) and ``text_encoder_3``/``tokenizer_3`` (T5,
    skipped with ``load_t5=False``, as diffusers' ``text_encoder_3=None``) where the folder has them.
    """
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from transformers import CLIPTextModelWithProjection, CLIPTokenizer

    present = _present(path)
    path = str(path)
    extra: dict[str, Any] = {}
    if "text_encoder_2" in present:
        extra["text_encoder_2"] = CLIPTextModelWithProjection.from_pretrained(
            path, subfolder="text_encoder_2", dtype=dtype
        )
        extra["tokenizer_2"] = CLIPTokenizer.from_pretrained(path, subfolder="tokenizer_2")
        if load_t5 and "text_encoder_3" in present:
            from transformers import T5EncoderModel, T5TokenizerFast

            extra["text_encoder_3"] = T5EncoderModel.from_pretrained(
                path, subfolder="text_encoder_3", dtype=dtype
            )
            extra["tokenizer_3"] = T5TokenizerFast.from_pretrained(path, subfolder="tokenizer_3")
    return SD3Components(
        transformer=SD3Transformer2DModel.from_pretrained(path, subfolder="transformer", torch_dtype=dtype),
        vae=AutoencoderKL.from_pretrained(path, subfolder="vae", torch_dtype=dtype),
        scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(path, subfolder="scheduler"),
        text_encoder=CLIPTextModelWithProjection.from_pretrained(path, subfolder="text_encoder", dtype=dtype),
        tokenizer=CLIPTokenizer.from_pretrained(path, subfolder="tokenizer"),
        **extra,
    )


def _clip_embeds(
    text_encoder: torch.nn.Module,
    tokenizer: Any,
    prompts: list[str],
    max_length: int,
    device: torch.device | str,
) -> tuple[torch.Tensor, torch.Tensor]:
    tok = tokenizer(
        list(prompts), padding="max_length", max_length=max_length, truncation=True, return_tensors="pt"
    )
    out = text_encoder(tok.input_ids.to(device), output_hidden_states=True)
    return out.hidden_states[-2], out.text_embeds


@torch.no_grad()
def encode_prompt(
    text_encoder: torch.nn.Module,
    tokenizer: Any,
    prompts: list[str],
    device: torch.device | str = "cpu",
    *,
    text_encoder_2: torch.nn.Module | None = None,
    tokenizer_2: Any = None,
    text_encoder_3: torch.nn.Module | None = None,
    tokenizer_3: Any = None,
    max_sequence_length: int = T5_MAX_LENGTH,
    joint_attention_dim: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt_embeds [B, L, D], pooled [B, P]) as SD3's transformer takes them.

    One CLIP (``text_encoder_2`` None): its penultimate hidden states and its text projection; prompts
    are padded/truncated to the tokenizer's max length.

    Two CLIPs (+ optional T5): exactly diffusers' ``StableDiffusion3Pipeline.encode_prompt`` with
    ``clip_skip=None`` (see the module docstring): L = CLIP length + ``max_sequence_length``,
    D = T5 width (or ``joint_attention_dim``, required when there is no T5), P = sum of both CLIP
    projection dims. Dtypes follow diffusers: CLIP states in ``text_encoder``'s dtype, T5 states in
    ``text_encoder_3``'s.
    """
    prompts = list(prompts)
    if text_encoder_2 is None:
        return _clip_embeds(text_encoder, tokenizer, prompts, tokenizer.model_max_length, device)
    clip_len = tokenizer.model_max_length  # diffusers uses the first tokenizer's length for both CLIPs
    dtype = text_encoder.dtype
    h1, pooled1 = _clip_embeds(text_encoder, tokenizer, prompts, clip_len, device)
    h2, pooled2 = _clip_embeds(text_encoder_2, tokenizer_2, prompts, clip_len, device)
    clip = torch.cat([h1.to(dtype), h2.to(dtype)], dim=-1)
    if text_encoder_3 is None:
        if joint_attention_dim is None:
            raise ValueError(
                "without a T5 text_encoder_3, encode_prompt needs joint_attention_dim (its zeros' width)"
            )
        t5 = torch.zeros((len(prompts), max_sequence_length, joint_attention_dim), device=device, dtype=dtype)
    else:
        ids = tokenizer_3(
            prompts,
            padding="max_length",
            max_length=max_sequence_length,
            truncation=True,
            add_special_tokens=True,
            return_tensors="pt",
        ).input_ids
        t5 = text_encoder_3(ids.to(device))[0].to(dtype=text_encoder_3.dtype, device=device)
    if clip.shape[-1] > t5.shape[-1]:
        raise ValueError(
            f"the CLIP states ({clip.shape[-1]} wide) are wider than the T5 states ({t5.shape[-1]})"
        )
    clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
    return torch.cat([clip, t5], dim=-2), torch.cat([pooled1, pooled2], dim=-1)
