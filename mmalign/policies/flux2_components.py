"""The FLUX.2 folder loader and prompt encoding: `Flux2Components`, `load_flux2_components`, `FLUX2_PIPELINES`.

Details: docs/extending.md, "mmalign.policies.flux2_components".
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mmalign.policies.diffusers_notices import quiet_diffusers_fp32_notice

quiet_diffusers_fp32_notice()

__all__ = [
    "DEV_PIPELINE",
    "DEV_TEXT_LAYERS",
    "FLUX2_PIPELINES",
    "KLEIN_PIPELINE",
    "KLEIN_TEXT_LAYERS",
    "Flux2Components",
    "flux2_pipeline_of",
    "load_flux2_components",
    "stack_hidden_layers",
]

DEV_PIPELINE = "Flux2Pipeline"
KLEIN_PIPELINE = "Flux2KleinPipeline"
FLUX2_PIPELINES = (DEV_PIPELINE, KLEIN_PIPELINE)
DEV_TEXT_LAYERS = (10, 20, 30)
"""``Flux2Pipeline.__call__``'s default ``text_encoder_out_layers``."""
KLEIN_TEXT_LAYERS = (9, 18, 27)
"""``Flux2KleinPipeline.__call__``'s default ``text_encoder_out_layers``."""
PARTS = ("transformer", "vae", "scheduler", "text_encoder", "tokenizer")


def stack_hidden_layers(hidden_states: tuple[Tensor, ...], layers: tuple[int, ...]) -> Tensor:
    """Float[B, L, len(layers) * D]: the hidden states of `layers` (indices into the encoder's
    ``hidden_states``, 0 = the embeddings), each token's vectors concatenated in the order of `layers`."""
    out = torch.stack([hidden_states[k] for k in layers], dim=1)  # [B, K, L, D]
    b, k, n, d = out.shape
    return out.permute(0, 2, 1, 3).reshape(b, n, k * d)


@dataclass
class Flux2Components:
    """The loaded parts of a FLUX.2 folder; `pipeline` is the ``model_index.json`` class (`DEV_PIPELINE` or
    `KLEIN_PIPELINE`), `is_distilled` the [klein] index's flag."""

    transformer: torch.nn.Module
    vae: torch.nn.Module
    scheduler: Any
    text_encoder: torch.nn.Module
    tokenizer: Any
    pipeline: str = DEV_PIPELINE
    is_distilled: bool = False

    @property
    def is_klein(self) -> bool:
        return self.pipeline == KLEIN_PIPELINE

    def text_encoders(self) -> list[torch.nn.Module]:
        return [self.text_encoder]

    def default_layers(self) -> tuple[int, ...]:
        """The pipeline's default ``text_encoder_out_layers``."""
        return KLEIN_TEXT_LAYERS if self.is_klein else DEV_TEXT_LAYERS

    def prompt_tokens(self, prompts: list[str], max_sequence_length: int) -> tuple[Tensor, Tensor]:
        """(input ids, attention mask) Long[B, max_sequence_length] as the pipeline tokenizes `prompts`."""
        prompts = list(prompts)
        if self.is_klein:
            texts = [
                self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": p}],
                    tokenize=False,
                    add_generation_prompt=True,
                    enable_thinking=False,
                )
                for p in prompts
            ]
            enc = self.tokenizer(
                texts,
                return_tensors="pt",
                padding="max_length",
                truncation=True,
                max_length=max_sequence_length,
            )
        else:
            from diffusers.pipelines.flux2.pipeline_flux2 import format_input
            from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

            enc = self.tokenizer.apply_chat_template(
                format_input(prompts=prompts, system_message=SYSTEM_MESSAGE),
                add_generation_prompt=False,
                tokenize=True,
                return_dict=True,
                return_tensors="pt",
                padding="max_length",
                truncation=True,
                max_length=max_sequence_length,
            )
        return enc["input_ids"], enc["attention_mask"]

    @torch.no_grad()
    def encode_prompt(
        self,
        prompts: list[str],
        device: torch.device | str = "cpu",
        *,
        max_sequence_length: int = 512,
        hidden_layers: tuple[int, ...] | None = None,
    ) -> Tensor:
        """Float[B, max_sequence_length, K x hidden] in the text encoder's dtype: `stack_hidden_layers` of the
        encoder's run on `prompt_tokens` (with their attention mask), as the pipeline's ``encode_prompt``."""
        layers = tuple(hidden_layers or self.default_layers())
        ids, mask = self.prompt_tokens(prompts, max_sequence_length)
        dev = next(self.text_encoder.parameters()).device
        out = self.text_encoder(
            input_ids=ids.to(dev), attention_mask=mask.to(dev), output_hidden_states=True, use_cache=False
        )
        return stack_hidden_layers(out.hidden_states, layers).to(device=device, dtype=self.text_encoder.dtype)

    def save_pretrained(self, path: str | Path, *, transformer: torch.nn.Module | None = None) -> None:
        """Write every part to its subfolder of `path` (``transformer`` overrides the one saved, e.g. a merged
        LoRA copy) and the ``model_index.json`` diffusers' `pipeline` class loads."""
        import diffusers

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        index: dict[str, Any] = {"_class_name": self.pipeline, "_diffusers_version": diffusers.__version__}
        if self.is_klein:
            index["is_distilled"] = bool(self.is_distilled)
        for name in PARTS:
            part = transformer if name == "transformer" and transformer is not None else getattr(self, name)
            part.save_pretrained(path / name)
            lib = "diffusers" if type(part).__module__.startswith("diffusers") else "transformers"
            index[name] = [lib, type(part).__name__]
        (path / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")


def flux2_pipeline_of(name_or_path: str | Path) -> tuple[str, bool]:
    """(pipeline class, is_distilled) of a FLUX.2 folder or hub id: its ``model_index.json`` (a local folder or
    the hub cache's copy), else the name (``klein`` in it: [klein], distilled unless it names ``base``)."""
    from mmalign.policies.families import pipeline_class

    pipe = pipeline_class(name_or_path)
    if pipe in FLUX2_PIPELINES:
        distilled = False
        p = Path(name_or_path)
        if pipe == KLEIN_PIPELINE and p.is_dir():
            distilled = bool(json.loads((p / "model_index.json").read_text()).get("is_distilled", False))
        elif pipe == KLEIN_PIPELINE:
            distilled = "base" not in str(name_or_path).lower()
        return pipe, distilled
    name = str(name_or_path).lower()
    if "klein" in name:
        return KLEIN_PIPELINE, "base" not in name
    return DEV_PIPELINE, False


def load_flux2_components(name_or_path: str | Path, *, dtype: torch.dtype = torch.float32) -> Flux2Components:
    """Load each part of the FLUX.2 folder (or hub id) `name_or_path` with its own ``from_pretrained``; the text
    encoder and tokenizer classes follow the pipeline (`flux2_pipeline_of`). The VAE stays in fp32."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel

    pipe, distilled = flux2_pipeline_of(name_or_path)
    path = str(name_or_path)
    if pipe == KLEIN_PIPELINE:
        from transformers import PreTrainedTokenizerFast, Qwen3ForCausalLM

        text_encoder = Qwen3ForCausalLM.from_pretrained(path, subfolder="text_encoder", dtype=dtype)
        # by its class: AutoTokenizer also looks for tokenizer/config.json, which a downloaded snapshot lacks, and
        # fails offline although everything is cached
        tokenizer = PreTrainedTokenizerFast.from_pretrained(path, subfolder="tokenizer")
    else:
        from transformers import AutoProcessor, Mistral3ForConditionalGeneration

        text_encoder = Mistral3ForConditionalGeneration.from_pretrained(
            path, subfolder="text_encoder", dtype=dtype
        )
        tokenizer = AutoProcessor.from_pretrained(path, subfolder="tokenizer")
    return Flux2Components(
        transformer=Flux2Transformer2DModel.from_pretrained(path, subfolder="transformer", torch_dtype=dtype),
        vae=AutoencoderKLFlux2.from_pretrained(path, subfolder="vae", torch_dtype=torch.float32),
        scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(path, subfolder="scheduler"),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        pipeline=pipe,
        is_distilled=distilled,
    )
