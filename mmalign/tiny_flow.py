"""A tiny SD3-style flow-matching pipeline built offline from config kwargs, and the SD3 folder loader.

`build_tiny_sd3(path)` writes a folder with the same layout as a real Stable Diffusion 3 folder
(``transformer/``, ``vae/``, ``scheduler/``, ``text_encoder/``, ``tokenizer/``; with
``text_encoders=3`` also ``text_encoder_2/``, ``tokenizer_2/``, ``text_encoder_3/``, ``tokenizer_3/``
and a ``model_index.json``), each saved with ``save_pretrained``; `load_sd3_components(path)` loads it
back with ``from_pretrained`` per component -- the very path a real SD3 / SD3.5 folder takes. Nothing
is downloaded.

Text encoders, two layouts (`load_sd3_components` detects which from the folder):

- **SD3 / SD3.5** (``text_encoder_2/`` present): two ``CLIPTextModelWithProjection`` and an optional
  ``T5EncoderModel`` (``text_encoder_3/``; SD3 runs without it too). `encode_prompt` reproduces
  diffusers' ``StableDiffusion3Pipeline.encode_prompt`` exactly (``clip_skip=None``): each CLIP's
  penultimate hidden states (``hidden_states[-2]``, both tokenized to the *first* tokenizer's
  ``model_max_length``, no attention mask) are concatenated on the feature dim and zero-padded to the
  T5 width, then concatenated along the sequence with T5's ``last_hidden_state`` (tokenized to
  ``max_sequence_length``, default 256); without T5 its part is zeros [B, max_sequence_length,
  joint_attention_dim]. The pooled embedding is the concatenation of both CLIPs' ``text_embeds``.
- **tiny single-encoder** (no ``text_encoder_2/``): one ``CLIPTextModelWithProjection``; prompt
  embeddings are its penultimate hidden states [B, L, joint_attention_dim] and the pooled embedding its
  projection [B, pooled_projection_dim].
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mmalign.tiny import BUILDERS

__all__ = [
    "SD3Components",
    "build_tiny_sd3",
    "clip_byte_tokenizer",
    "encode_prompt",
    "load_sd3_components",
    "t5_char_tokenizer",
]

TOKEN_LENGTH = 16
T5_MAX_LENGTH = 256
"""diffusers' default ``max_sequence_length`` for SD3's T5 prompt embeddings."""

EXTRA_COMPONENTS = ("text_encoder_2", "tokenizer_2", "text_encoder_3", "tokenizer_3")


def _bytes_to_unicode() -> list[str]:
    """GPT-2/CLIP byte-to-unicode table (the 256 symbols of a byte-level BPE)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


def clip_byte_tokenizer(max_length: int = TOKEN_LENGTH) -> Any:
    """A `CLIPTokenizer` with a byte-level vocab and no merges (every byte is a token; 514 ids)."""
    from transformers import CLIPTokenizer

    chars = _bytes_to_unicode()
    vocab: dict[str, int] = {}
    for c in chars:
        vocab[c] = len(vocab)
    for c in chars:
        vocab[c + "</w>"] = len(vocab)
    for s in ("<|startoftext|>", "<|endoftext|>"):
        vocab[s] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=max_length)


def t5_char_tokenizer(model_max_length: int = 512) -> Any:
    """A `T5TokenizerFast` (Unigram, like the real one) over single characters: ``<pad>`` 0, ``</s>`` 1,
    ``<unk>`` 2, then the word-start marker and printable ASCII characters with and without it."""
    from transformers import T5TokenizerFast

    chars = list(string.ascii_letters + string.digits + string.punctuation)
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    vocab += [("▁" + c, -3.0) for c in chars] + [(c, -4.0) for c in chars]
    return T5TokenizerFast(vocab=vocab, extra_ids=0, model_max_length=model_max_length)


def _tiny_clip(tokenizer: Any, hidden: int, projection: int) -> torch.nn.Module:
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    return CLIPTextModelWithProjection(
        CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=TOKEN_LENGTH,
            projection_dim=projection,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )


def build_tiny_sd3(
    path: str | Path,
    *,
    sample_size: int = 8,
    latent_channels: int = 4,
    num_layers: int = 1,
    text_hidden: int = 32,
    pooled_dim: int = 16,
    seed: int = 0,
    text_encoders: int = 1,
) -> Path:
    """Write a tiny SD3-style pipeline folder at `path` (random weights, ~100k parameters).

    ``text_encoders``: 1 = one CLIP (hidden ``text_hidden``, projection ``pooled_dim``); 3 = the real
    SD3 layout: CLIP-1 (hidden ``text_hidden // 4``), CLIP-2 (hidden ``text_hidden // 2``), each with a
    ``pooled_dim // 2`` projection, and a T5 encoder of width ``text_hidden`` (= the transformer's
    ``joint_attention_dim``); 2 = the same without the T5 (``text_encoder_3``/``tokenizer_3`` absent).
    """
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel

    if text_encoders not in (1, 2, 3):
        raise ValueError(f"text_encoders must be 1, 2 or 3, got {text_encoders}")
    if text_encoders > 1 and (text_hidden % 8 or pooled_dim % 2):
        raise ValueError("with 2 or 3 text encoders text_hidden must be a multiple of 8 and pooled_dim even")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    transformer = SD3Transformer2DModel(
        sample_size=sample_size,
        patch_size=2,
        in_channels=latent_channels,
        out_channels=latent_channels,
        num_layers=num_layers,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=text_hidden,
        caption_projection_dim=16,
        pooled_projection_dim=pooled_dim,
        pos_embed_max_size=sample_size,
    )
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",),
        up_block_types=("UpDecoderBlock2D",),
        block_out_channels=(8,),
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=4,
        sample_size=sample_size,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    tokenizer = clip_byte_tokenizer()
    extra: dict[str, Any] = {}
    if text_encoders == 1:
        text_encoder = _tiny_clip(tokenizer, text_hidden, pooled_dim)
    else:
        text_encoder = _tiny_clip(tokenizer, text_hidden // 4, pooled_dim // 2)
        extra["tokenizer_2"] = clip_byte_tokenizer()
        extra["text_encoder_2"] = _tiny_clip(
            extra["tokenizer_2"], text_hidden // 2, pooled_dim - pooled_dim // 2
        )
    if text_encoders == 3:
        from transformers import T5Config, T5EncoderModel

        tok3 = t5_char_tokenizer()
        extra["tokenizer_3"] = tok3
        extra["text_encoder_3"] = T5EncoderModel(
            T5Config(
                vocab_size=len(tok3),
                d_model=text_hidden,
                d_kv=8,
                d_ff=2 * text_hidden,
                num_layers=1,
                num_heads=2,
                relative_attention_num_buckets=8,
                pad_token_id=tok3.pad_token_id,
                eos_token_id=tok3.eos_token_id,
                decoder_start_token_id=tok3.pad_token_id,
            )
        )
    c = SD3Components(transformer, vae, scheduler, text_encoder, tokenizer, **extra)
    c.save_pretrained(path)
    return path


@BUILDERS.register("flow_sd3_tiny", minutes=0.05)
def _build_registered(path: Path) -> None:
    build_tiny_sd3(path)


@BUILDERS.register("flow_sd3_tiny_3enc", minutes=0.05)
def _build_registered_3enc(path: Path) -> None:
    build_tiny_sd3(path, text_encoders=3)


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
