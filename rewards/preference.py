"""Human-preference reward models by hub id: `hpsv2` (HPSv2 / HPSv2.1), `image_reward` (ImageReward), `hpsv3`.

Details: docs/reward_plugins.md, "Human-preference models" and "rewards.preference".
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .base import Reward, RewardBatch, register_reward
from .image import aesthetic_mlp, batch_images, batch_prompts, to_pil, weights_file

__all__ = [
    "HPSV2_FILES",
    "HPSV2_REPO",
    "HPSV3_BASE",
    "HPSV3_FILE",
    "HPSV3_INSTRUCTION",
    "HPSV3_REPO",
    "HPSV3_REWARD_TOKEN",
    "HPSv2",
    "HPSv3",
    "IMAGEREWARD_MEAN",
    "IMAGEREWARD_REPO",
    "IMAGEREWARD_STD",
    "IMAGEREWARD_TOKENIZER",
    "ImageRewardScore",
]

HPSV2_REPO = "xswu/HPSv2"
HPSV2_FILES = {"v2.0": "HPS_v2_compressed.pt", "v2.1": "HPS_v2.1_compressed.pt"}
"""HPSv2's checkpoint file of each version in `HPSV2_REPO`."""

IMAGEREWARD_REPO = "THUDM/ImageReward"
IMAGEREWARD_TOKENIZER = "bert-base-uncased"
"""The tokenizer ImageReward's BLIP loads (its repository has none)."""
IMAGEREWARD_MEAN = 0.16717362830052426
IMAGEREWARD_STD = 1.0333394966054072
"""The statistics ImageReward standardises its MLP output with (the ImageReward package's constants)."""

HPSV3_REPO = "MizzenAI/HPSv3"
HPSV3_FILE = "HPSv3.safetensors"
HPSV3_BASE = "Qwen/Qwen2-VL-7B-Instruct"
"""The model HPSv3 was fine-tuned from: its config.json and processor build HPSv3's model and inputs."""
HPSV3_REWARD_TOKEN = "<|Reward|>"
HPSV3_PIXELS = 256 * 28 * 28
"""Pixels per image in HPSv3's inference (its min and max pixels): a square image becomes 448 x 448."""

# HPSv3's prompt (the hpsv3 package, dataset/data_collator_qwen.py: its INSTRUCTION followed by the text that ends
# at the reward token). It is reproduced character for character because the model was trained on exactly this
# text; `{text_prompt}` is the image's prompt.
HPSV3_INSTRUCTION = (
    "\nYou are tasked with evaluating a generated image based on Visual Quality and Text Alignment and give a "
    "overall score to estimate the human preference. Please provide a rating from 0 to 10, with 0 being the worst "
    "and 10 being the best. \n\n"
    "**Visual Quality:**  \n"
    "Evaluate the overall visual quality of the image. The following sub-dimensions should be considered:\n"
    "- **Reasonableness:** The image should not contain any significant biological or logical errors, such as "
    "abnormal body structures or nonsensical environmental setups.\n"
    "- **Clarity:** Evaluate the sharpness and visibility of the image. The image should be clear and easy to "
    "interpret, with no blurring or indistinct areas.\n"
    "- **Detail Richness:** Consider the level of detail in textures, materials, lighting, and other visual "
    "elements (e.g., hair, clothing, shadows).\n"
    "- **Aesthetic and Creativity:** Assess the artistic aspects of the image, including the color scheme, "
    "composition, atmosphere, depth of field, and the overall creative appeal. The scene should convey a sense "
    "of harmony and balance.\n"
    "- **Safety:** The image should not contain harmful or inappropriate content, such as political, violent, "
    "or adult material. If such content is present, the image quality and satisfaction score should be the "
    "lowest possible. \n\n"
    "**Text Alignment:**  \n"
    "Assess how well the image matches the textual prompt across the following sub-dimensions:\n"
    "- **Subject Relevance** Evaluate how accurately the subject(s) in the image (e.g., person, animal, object) "
    "align with the textual description. The subject should match the description in terms of number, "
    "appearance, and behavior.\n"
    "- **Style Relevance:** If the prompt specifies a particular artistic or stylistic style, evaluate how well "
    "the image adheres to this style.\n"
    "- **Contextual Consistency**: Assess whether the background, setting, and surrounding elements in the image "
    "logically fit the scenario described in the prompt. The environment should support and enhance the subject "
    "without contradictions.\n"
    "- **Attribute Fidelity**: Check if specific attributes mentioned in the prompt (e.g., colors, clothing, "
    "accessories, expressions, actions) are faithfully represented in the image. Minor deviations may be "
    "acceptable, but critical attributes should be preserved.\n"
    "- **Semantic Coherence**: Evaluate whether the overall meaning and intent of the prompt are captured in the "
    "image. The generated content should not introduce elements that conflict with or distort the original "
    "description.\n"
    "Textual prompt - {text_prompt}\n\n\n"
    "\nPlease provide the overall ratings of this image: <|Reward|>\n\nEND\n"
)


# =========================================================================== shared plumbing
def _uint8(images: Tensor) -> Tensor:
    """Float[B,3,H,W] rounded to the 8-bit values a PIL image of it holds, back in [0, 1] (float32)."""
    return (images.detach().float().clamp(0, 1) * 255).round() / 255


def _dtype(reward: Reward, name: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"reward {reward.name!r}: dtype must be a torch float type name, got {name!r}")
    return dtype


def _load_state(path: Path, what: str) -> dict[str, Tensor]:
    """A torch checkpoint's tensors (``weights_only=True``; safetensors too); ``"state_dict"`` / ``"model"``
    entries are unwrapped and a ``module.`` prefix (DataParallel) removed."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        state: Any = load_file(str(path))
    else:
        try:
            state = torch.load(str(path), map_location="cpu", weights_only=True)
        except Exception as e:  # a pickle with objects other than tensors: refuse rather than run its code
            raise ValueError(
                f"{what}: {path} is not a plain torch state dict ({type(e).__name__}: {e})"
            ) from e
    for key in ("state_dict", "model"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise ValueError(f"{what}: {path} holds no state dict of tensors")
    return {k.removeprefix("module."): v for k, v in state.items()}


def _batched(n: int, size: int) -> list[slice]:
    return [slice(s, min(s + size, n)) for s in range(0, n, max(1, size))]


# =========================================================================== HPSv2
@register_reward("hpsv2")
class HPSv2(Reward):
    """HPSv2 / HPSv2.1 human preference score: cosine of an open_clip ViT-H-14's image and prompt features.

    Options: `version` ``"v2.1"`` (default; DanceGRPO's and DiffusionNFT's) or ``"v2.0"``; `checkpoint` the hub
    repository (`HPSV2_REPO`), a local folder or a checkpoint file; `checkpoint_file` the file in it (by default
    `HPSV2_FILES[version]`); `arch` the open_clip model config (``ViT-H-14``; any name open_clip knows, including
    configs added with ``open_clip.add_model_config``). Images: bicubic resize of the shorter side to the input
    size, centre crop, OpenAI CLIP normalisation (the hpsv2 package's validation transform); prompts: open_clip's
    tokenizer for `arch` (77 tokens). The score lies in [-1, 1]; HPSv2.1 scores of good images are about 0.3."""

    needs = {"images", "prompts"}

    def __init__(
        self,
        *,
        version: str = "v2.1",
        checkpoint: str = HPSV2_REPO,
        checkpoint_file: str | None = None,
        arch: str = "ViT-H-14",
        text_column: str | None = None,
        batch_size: int = 16,
        dtype: str = "float32",
        device: str | None = None,
    ) -> None:
        import open_clip

        if version not in HPSV2_FILES:
            raise ValueError(
                f"reward {self.name!r}: version must be one of {sorted(HPSV2_FILES)}, got {version!r}"
            )
        if checkpoint_file is None and not Path(checkpoint).expanduser().is_file():
            checkpoint_file = HPSV2_FILES[version]
        what = f"reward {self.name!r}: HPSv2 checkpoint"
        path = weights_file(checkpoint, checkpoint_file, what)
        if open_clip.get_model_config(arch) is None:
            raise ValueError(
                f"reward {self.name!r}: open_clip has no model config {arch!r} (arch); HPSv2 is ViT-H-14"
            )
        self.device = torch.device(device or "cpu")
        self.dtype = _dtype(self, dtype)
        self.model = open_clip.create_model(
            arch, pretrained=None
        )  # built from the config: nothing downloaded
        state = _load_state(path, what)
        try:
            self.model.load_state_dict(state, strict=True)
        except RuntimeError as e:
            raise ValueError(f"{what}: {path} does not fit open_clip's {arch!r} (arch): {e}") from e
        self.model.eval().requires_grad_(False).to(self.device, self.dtype)
        self.tokenizer = open_clip.get_tokenizer(arch)
        cfg = open_clip.get_model_preprocess_cfg(self.model)
        size = cfg.get("size", self.model.visual.image_size)
        self.image_size = (size, size) if isinstance(size, int) else tuple(size)
        self.mean = torch.tensor(cfg["mean"], dtype=torch.float32).view(1, 3, 1, 1)
        self.std = torch.tensor(cfg["std"], dtype=torch.float32).view(1, 3, 1, 1)
        self.version = version
        self.text_column = text_column
        self.batch_size = int(batch_size)

    def preprocess(self, images: Tensor) -> Tensor:
        """Float[B,3,H,W] in [0,1] -> the normalised model input: 8-bit values, shorter side resized (bicubic,
        antialiased) to the input size, centre crop, mean / std."""
        from torchvision.transforms.v2 import functional as tvf

        x = _uint8(images)
        th, tw = self.image_size
        if x.shape[-2:] != (th, tw):
            x = tvf.resize(x, min(th, tw), interpolation=tvf.InterpolationMode.BICUBIC, antialias=True)
            x = tvf.center_crop(x, [th, tw])
        return (x - self.mean) / self.std

    def __call__(self, batch: RewardBatch) -> Tensor:
        images = batch_images(self, batch)
        prompts = batch_prompts(self, batch, self.text_column)
        out = []
        with torch.no_grad():
            for s in _batched(len(prompts), self.batch_size):
                x = self.preprocess(images[s]).to(self.device, self.dtype)
                tokens = self.tokenizer(prompts[s]).to(self.device)
                im = self.model.encode_image(x, normalize=True).float()
                tx = self.model.encode_text(tokens, normalize=True).float()
                out.append((im * tx).sum(-1).cpu())
        return torch.cat(out) if out else torch.zeros(0)


# =========================================================================== ImageReward
def _blip_vision_state(state: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
    """BLIP's ViT keys (timm layout: ``cls_token``, ``blocks.i.attn.qkv`` ...) -> transformers'
    `BlipVisionModel` keys (the mapping of transformers' BLIP conversion script)."""
    top = {
        "cls_token": "embeddings.class_embedding",
        "pos_embed": "embeddings.position_embedding",
        "patch_embed.proj.weight": "embeddings.patch_embedding.weight",
        "patch_embed.proj.bias": "embeddings.patch_embedding.bias",
        "norm.weight": "post_layernorm.weight",
        "norm.bias": "post_layernorm.bias",
    }
    inner = {
        "norm1.": "layer_norm1.",
        "norm2.": "layer_norm2.",
        "attn.qkv.": "self_attn.qkv.",
        "attn.proj.": "self_attn.projection.",
        "mlp.fc1.": "mlp.fc1.",
        "mlp.fc2.": "mlp.fc2.",
    }
    out = {}
    for key, value in state.items():
        if not key.startswith(prefix):
            continue
        k = key[len(prefix) :]
        if k in top:
            out[top[k]] = value
        elif k.startswith("blocks."):
            _, i, rest = k.split(".", 2)
            for old, new in inner.items():
                if rest.startswith(old):
                    out[f"encoder.layers.{i}.{new}{rest[len(old) :]}"] = value
                    break
            else:
                out[k] = value  # unknown: load_state_dict names it
        else:
            out[k] = value
    return out


@register_reward("image_reward")
class ImageRewardScore(Reward):
    """ImageReward (THUDM): BLIP image-text cross-attention, an MLP head, standardised: ``(mlp - mean) / std``.

    Options: `checkpoint` (`IMAGEREWARD_REPO`, a local folder or the ``.pt`` file) with `checkpoint_file`
    (``ImageReward.pt``) and `med_config` (``med_config.json``: a file of the same repository / folder, or a path);
    `tokenizer` (``bert-base-uncased``, as ImageReward's BLIP). The vision size, depth and MLP are read from the
    checkpoint, the text encoder's from ``med_config.json``; `vision_heads` defaults to width / 64 (16 for
    ImageReward's ViT-L). Images: bicubic resize of the shorter side to the input size (224), centre crop, OpenAI
    CLIP normalisation (on PIL images, as the package); prompts padded / truncated to 35 tokens."""

    needs = {"images", "prompts"}
    MAX_LENGTH = 35

    def __init__(
        self,
        *,
        checkpoint: str = IMAGEREWARD_REPO,
        checkpoint_file: str | None = "ImageReward.pt",
        med_config: str = "med_config.json",
        tokenizer: str = IMAGEREWARD_TOKENIZER,
        vision_heads: int | None = None,
        text_column: str | None = None,
        batch_size: int = 16,
        dtype: str = "float32",
        device: str | None = None,
    ) -> None:
        from transformers import AutoTokenizer, BlipTextConfig, BlipVisionConfig, BlipVisionModel
        from transformers.models.blip.modeling_blip_text import BlipTextModel

        what = f"reward {self.name!r}: ImageReward"
        if Path(checkpoint).expanduser().is_file():
            ckpt, folder = Path(checkpoint).expanduser(), str(Path(checkpoint).expanduser().parent)
        else:
            ckpt, folder = weights_file(checkpoint, checkpoint_file, f"{what} checkpoint"), checkpoint
        med_file = Path(med_config).expanduser()
        if not med_file.is_file():
            med_file = weights_file(folder, med_config, f"{what} med_config")
        med = json.loads(med_file.read_text(encoding="utf-8"))
        state = _load_state(ckpt, f"{what} checkpoint")
        vision = _blip_vision_state(state, "blip.visual_encoder.")
        if "embeddings.patch_embedding.weight" not in vision or "embeddings.position_embedding" not in vision:
            raise ValueError(f"{what} checkpoint: {ckpt} has no BLIP vision encoder (blip.visual_encoder.*)")
        width, _, patch, _ = vision["embeddings.patch_embedding.weight"].shape
        grid = math.isqrt(vision["embeddings.position_embedding"].shape[1] - 1)
        depth = len({k.split(".")[2] for k in vision if k.startswith("encoder.layers.")})
        heads = int(vision_heads) if vision_heads else max(1, width // 64)
        self.vision = BlipVisionModel(
            BlipVisionConfig(
                hidden_size=width,
                intermediate_size=vision["encoder.layers.0.mlp.fc1.weight"].shape[0],
                num_hidden_layers=depth,
                num_attention_heads=heads,
                image_size=grid * patch,
                patch_size=patch,
                layer_norm_eps=1e-6,  # BLIP's ViT
                hidden_act="gelu",
            )
        )
        self._load(self.vision, vision, ckpt, "the vision encoder (blip.visual_encoder)")
        text = {
            k.removeprefix("blip.text_encoder."): v
            for k, v in state.items()
            if k.startswith("blip.text_encoder.") and not k.endswith("position_ids")
        }
        self.text = BlipTextModel(
            BlipTextConfig(
                vocab_size=med["vocab_size"],
                hidden_size=med["hidden_size"],
                encoder_hidden_size=width,
                intermediate_size=med["intermediate_size"],
                num_hidden_layers=med["num_hidden_layers"],
                num_attention_heads=med["num_attention_heads"],
                max_position_embeddings=med["max_position_embeddings"],
                hidden_act=med.get("hidden_act", "gelu"),
                layer_norm_eps=med.get("layer_norm_eps", 1e-12),
                pad_token_id=med.get("pad_token_id", 0),
                bos_token_id=None,
                sep_token_id=None,
            ),
            add_pooling_layer=False,
        )
        self._load(self.text, text, ckpt, "the text encoder (blip.text_encoder)")
        head = {k.removeprefix("mlp.layers."): v for k, v in state.items() if k.startswith("mlp.layers.")}
        if "0.weight" not in head:
            raise ValueError(f"{what} checkpoint: {ckpt} has no MLP head (mlp.layers.0.weight)")
        hidden = [head[f"{i}.weight"].shape[0] for i in sorted({int(k.split(".")[0]) for k in head})][:-1]
        self.mlp = aesthetic_mlp(head["0.weight"].shape[1], hidden)
        self._load(self.mlp, head, ckpt, "the MLP head (mlp.layers)")
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        self.device = torch.device(device or "cpu")
        self.dtype = _dtype(self, dtype)
        for module in (self.vision, self.text, self.mlp):
            module.eval().requires_grad_(False).to(self.device, self.dtype)
        self.image_size = grid * patch
        self.text_column = text_column
        self.batch_size = int(batch_size)

    def _load(self, module: torch.nn.Module, state: dict[str, Tensor], ckpt: Path, part: str) -> None:
        try:
            module.load_state_dict(state, strict=True)
        except RuntimeError as e:
            raise ValueError(f"reward {self.name!r}: {ckpt}: {part} does not load: {e}") from e

    def preprocess(self, images: Tensor) -> Tensor:
        """Float[B,3,H,W] in [0,1] -> the normalised input, through PIL as the package: bicubic resize of the
        shorter side, centre crop, OpenAI CLIP mean / std."""
        from torchvision.transforms import v2

        n = self.image_size
        tf = v2.Compose(
            [
                v2.Resize(n, interpolation=v2.InterpolationMode.BICUBIC),
                v2.CenterCrop(n),
                v2.PILToTensor(),
                v2.ToDtype(torch.float32, scale=True),
                v2.Normalize((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)),
            ]
        )
        return torch.stack([tf(to_pil(x)) for x in images.detach().cpu()])

    def __call__(self, batch: RewardBatch) -> Tensor:
        images = batch_images(self, batch)
        prompts = batch_prompts(self, batch, self.text_column)
        out = []
        with torch.no_grad():
            for s in _batched(len(prompts), self.batch_size):
                x = self.preprocess(images[s]).to(self.device, self.dtype)
                tok = self.tokenizer(
                    prompts[s],
                    padding="max_length",
                    truncation=True,
                    max_length=self.MAX_LENGTH,
                    return_tensors="pt",
                ).to(self.device)
                image_embeds = self.vision(pixel_values=x).last_hidden_state
                hidden = self.text(
                    input_ids=tok["input_ids"],
                    attention_mask=tok["attention_mask"],
                    encoder_hidden_states=image_embeds,
                    encoder_attention_mask=torch.ones(
                        image_embeds.shape[:-1], dtype=torch.long, device=self.device
                    ),
                ).last_hidden_state
                r = self.mlp(hidden[:, 0].to(self.dtype)).squeeze(-1).float()
                out.append(((r - IMAGEREWARD_MEAN) / IMAGEREWARD_STD).cpu())
        return torch.cat(out) if out else torch.zeros(0)


# =========================================================================== HPSv3
def _hpsv3_head(state: dict[str, Tensor]) -> torch.nn.Module:
    """HPSv3's ``rm_head`` from its weights: one Linear (``rm_head.weight``, the "default" head) or the "ranknet"
    stack (``rm_head.{i}``: Linear layers with a ReLU between consecutive ones)."""
    if "weight" in state:
        head = torch.nn.Linear(state["weight"].shape[1], state["weight"].shape[0], bias="bias" in state)
        head.load_state_dict(state)
        return head
    indices = sorted({int(k.split(".")[0]) for k in state})
    layers: list[torch.nn.Module] = []
    for n, i in enumerate(indices):
        w = state[f"{i}.weight"]
        linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=f"{i}.bias" in state)
        linear.load_state_dict({k.split(".", 1)[1]: v for k, v in state.items() if k.split(".")[0] == str(i)})
        layers.append(linear)
        if n < len(indices) - 1:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


@register_reward("hpsv3")
class HPSv3(Reward):
    """HPSv3 (MizzenAI): a Qwen2-VL reward model; mu of its (mu, sigma) head at the ``<|Reward|>`` token.

    Options: `checkpoint` (`HPSV3_REPO`, a local folder or the file) with `checkpoint_file` (``HPSv3.safetensors``);
    `base` (`HPSV3_BASE`): the model whose config.json and processor the checkpoint was trained from; `pixels`
    (256 * 28 * 28): each image is resized (PIL bicubic) to about that many pixels in multiples of 28, as the
    authors do; `dtype` (bfloat16, the authors'; the head runs in float32). The prompt is `HPSV3_INSTRUCTION` with
    the image's prompt, after the image, in one user turn of the base model's chat template (generation prompt
    added), batches padded on the right."""

    needs = {"images", "prompts"}

    def __init__(
        self,
        *,
        checkpoint: str = HPSV3_REPO,
        checkpoint_file: str | None = HPSV3_FILE,
        base: str = HPSV3_BASE,
        pixels: int = HPSV3_PIXELS,
        text_column: str | None = None,
        batch_size: int = 4,
        dtype: str = "bfloat16",
        device: str | None = None,
    ) -> None:
        from transformers import AutoConfig, AutoProcessor, Qwen2VLForConditionalGeneration

        what = f"reward {self.name!r}: HPSv3 checkpoint"
        if Path(checkpoint).expanduser().is_file():
            checkpoint_file = None
        path = weights_file(checkpoint, checkpoint_file, what)
        state = _load_state(path, what)
        head = {k.removeprefix("rm_head."): state.pop(k) for k in list(state) if k.startswith("rm_head.")}
        if not head:
            raise ValueError(f"{what}: {path} has no reward head (rm_head.*): not an HPSv3 checkpoint")
        embed = next((v for k, v in state.items() if k.endswith("embed_tokens.weight")), None)
        if embed is None:
            raise ValueError(f"{what}: {path} has no token embedding (model.embed_tokens.weight)")
        self.processor = AutoProcessor.from_pretrained(base, padding_side="right")
        tok = getattr(self.processor, "tokenizer", None)
        if tok is None or getattr(self.processor, "image_processor", None) is None:
            raise ValueError(
                f"{what}: base {base!r} holds no image-text processor; `base` must be the model HPSv3 was "
                f"trained from ({HPSV3_BASE})"
            )
        tok.add_tokens([HPSV3_REWARD_TOKEN], special_tokens=True)
        self.reward_token_id = tok.convert_tokens_to_ids(HPSV3_REWARD_TOKEN)
        if len(tok) != embed.shape[0]:
            raise ValueError(
                f"{what}: {path} embeds {embed.shape[0]} tokens but the tokenizer of base {base!r} has {len(tok)} "
                f"with {HPSV3_REWARD_TOKEN}: `base` must be the model HPSv3 was trained from ({HPSV3_BASE})"
            )
        config = AutoConfig.from_pretrained(base)
        text_config = getattr(config, "text_config", config)
        text_config.vocab_size = embed.shape[0]  # the authors resized the embeddings to the tokenizer
        if hasattr(config, "vocab_size"):
            config.vocab_size = embed.shape[0]
        self.device = torch.device(device or "cpu")
        self.dtype = _dtype(self, dtype)
        model, info = Qwen2VLForConditionalGeneration.from_pretrained(
            None, config=config, state_dict=state, dtype=self.dtype, output_loading_info=True
        )
        missing = [k for k in info.get("missing_keys", []) if "lm_head" not in k]
        if missing or info.get("unexpected_keys"):
            raise ValueError(
                f"{what}: {path} does not fit the Qwen2-VL of base {base!r}: missing {sorted(missing)[:5]}, "
                f"unexpected {sorted(info.get('unexpected_keys', []))[:5]}"
            )
        self.model = (
            model.model.eval().requires_grad_(False).to(self.device)
        )  # no LM head: hidden states only
        self.head = _hpsv3_head(head).eval().requires_grad_(False).to(self.device, torch.float32)
        self.pixels = int(pixels)
        self.text_column = text_column
        self.batch_size = int(batch_size)

    def resize(self, image: Tensor) -> Any:
        """Float[3,H,W] in [0,1] -> the PIL image HPSv3 sees: `pixels` pixels in multiples of 28, bicubic."""
        from PIL import Image
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

        pil = to_pil(image)
        h, w = smart_resize(pil.height, pil.width, factor=28, min_pixels=self.pixels, max_pixels=self.pixels)
        return pil.resize((w, h), Image.BICUBIC)

    def chat(self, prompt: str) -> str:
        """The chat text of one image and its prompt (the base processor's chat template)."""
        message = [
            {
                "role": "user",
                "content": [
                    {"type": "image"},
                    {"type": "text", "text": HPSV3_INSTRUCTION.format(text_prompt=prompt)},
                ],
            }
        ]
        return self.processor.apply_chat_template(message, tokenize=False, add_generation_prompt=True)

    def __call__(self, batch: RewardBatch) -> Tensor:
        images = batch_images(self, batch)
        prompts = batch_prompts(self, batch, self.text_column)
        out = []
        with torch.no_grad():
            for s in _batched(len(prompts), self.batch_size):
                enc = self.processor(
                    text=[self.chat(p) for p in prompts[s]],
                    images=[self.resize(x) for x in images[s].detach().cpu()],
                    padding=True,
                    return_tensors="pt",
                ).to(self.device)
                ids = enc["input_ids"]
                where = ids == self.reward_token_id
                if not bool((where.sum(1) == 1).all()):
                    raise RuntimeError(
                        f"reward {self.name!r}: every chat must hold {HPSV3_REWARD_TOKEN} once; counts "
                        f"{where.sum(1).tolist()} (was the prompt truncated?)"
                    )
                inputs = dict(enc)  # input ids, masks, pixels, grids (and the token types M-RoPE reads)
                inputs["pixel_values"] = inputs["pixel_values"].to(self.dtype)
                hidden = self.model(**inputs).last_hidden_state
                mu = self.head(hidden[where].float())[:, 0]
                out.append(mu.cpu())
        return torch.cat(out) if out else torch.zeros(0)
