"""Image rewards: `jpeg_compressibility`, `jpeg_incompressibility`, `saturation`, `clip_score`, `aesthetic`,
`preference`.

- ``jpeg_compressibility`` / ``jpeg_incompressibility`` (DDPO): minus / plus the JPEG size in kB.
- ``saturation``: the mean HSV colour saturation of the image, a reward that is easy to hack (paint
  everything in vivid colours); configs/text_to_image-hacked-tiny.yaml trains on it to show the
  over-optimisation watchdog (docs/overoptimisation.md).
- ``clip_score``: CLIP image-text cosine similarity (x100 by default).
- ``aesthetic``: an MLP on normalised CLIP image embeddings (LAION-aesthetic style).
- ``preference``: PickScore / HPS style, ``logit_scale * cos(image, prompt)`` with a CLIP model.

Every reward reads ``batch.outputs["images"]``, Float[B,3,H,W] in [0, 1]. Models load once, at
construction, from a local folder / file or by hub id (``org/name``, from the Hugging Face cache or
downloaded into it; ``HF_HUB_OFFLINE=1`` loads from the cache only). A missing local path is a
`FileNotFoundError` naming the path that was looked for. A CLIP model whose repository has no tokenizer /
image processor (``yuvalkirstain/PickScore_v1``) takes them from ``processor`` (PickScore's:
``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``); the aesthetic MLP is a local file or ``mlp_path`` (hub id) +
``mlp_file`` (a file of that repository).
The helpers `jpeg_size_kb`, `colour_mask`, `connected_components` and `CLIPEmbedder` are
public so pipelines and tests can use them on their own; the rewards of the synthetic shapes world
(``shapes_compositional``, ``shapes_layout``) measure colour with the pixel helpers and live with that world's
fixtures (`mmalign.tiny.world_rewards`, found through the ``mmalign.rewards`` entry points).
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from .base import Reward, RewardBatch, register_reward

__all__ = [
    "batch_images",
    "batch_prompts",
    "local_path",
    "looks_local",
    "AestheticScore",
    "CLIPEmbedder",
    "ClipScore",
    "JpegCompressibility",
    "JpegIncompressibility",
    "PICKSCORE_MODEL",
    "PICKSCORE_PROCESSOR",
    "PreferenceScore",
    "Saturation",
    "aesthetic_mlp",
    "colour_mask",
    "connected_components",
    "hsv_saturation",
    "jpeg_size_kb",
    "to_pil",
    "weights_file",
]


def batch_images(reward: Reward, batch: RewardBatch) -> Tensor:
    """``outputs["images"]`` of `batch`, checked to be Float[B,3,H,W]; errors name `reward`."""
    if "images" not in batch.outputs:
        raise KeyError(
            f"reward {reward.name!r} needs outputs['images'] (Float[B,3,H,W] in [0,1]); "
            f"outputs: {sorted(batch.outputs) or 'none'}"
        )
    images = batch.outputs["images"]
    if not isinstance(images, Tensor) or images.dim() != 4 or images.shape[1] != 3:
        shape = tuple(images.shape) if isinstance(images, Tensor) else type(images).__name__
        raise ValueError(f"reward {reward.name!r}: images must be Float[B,3,H,W], got {shape}")
    return images


def to_pil(image: Tensor) -> Image.Image:
    """Float[3,H,W] in [0,1] -> an RGB PIL image (values are clamped, then rounded to uint8)."""
    arr = (image.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
    return Image.fromarray(np.ascontiguousarray(arr), mode="RGB")


# =========================================================================== JPEG (DDPO)
def jpeg_size_kb(image: Tensor, quality: int = 95) -> float:
    """Size in kB (1000 bytes, as in DDPO) of `image` (Float[3,H,W] in [0,1]) saved as JPEG at `quality`."""
    buf = io.BytesIO()
    to_pil(image).save(buf, format="JPEG", quality=quality)
    return buf.tell() / 1000.0


class _JpegSize(Reward):
    needs = {"images"}
    sign = 1.0

    def __init__(self, *, quality: int = 95, scale: float = 1.0, device: str | None = None) -> None:
        if not 1 <= int(quality) <= 100:
            raise ValueError(f"reward {self.name!r}: quality must be in [1, 100], got {quality}")
        self.quality = int(quality)
        self.scale = float(scale)
        self.device = device  # JPEG encoding runs on the CPU; kept for a uniform option set

    def __call__(self, batch: RewardBatch) -> Tensor:
        images = batch_images(self, batch)
        with torch.no_grad():
            sizes = [jpeg_size_kb(img, self.quality) for img in images.detach().cpu()]
        return self.sign * self.scale * torch.tensor(sizes, dtype=torch.float32)


@register_reward("jpeg_compressibility")
class JpegCompressibility(_JpegSize):
    """DDPO compressibility: minus the JPEG size of the image in kB (times `scale`)."""

    sign = -1.0


@register_reward("jpeg_incompressibility")
class JpegIncompressibility(_JpegSize):
    """DDPO incompressibility: the JPEG size of the image in kB (times `scale`)."""

    sign = 1.0


# =========================================================================== colour saturation
def hsv_saturation(images: Tensor) -> Tensor:
    """Float[B]: each image's mean HSV saturation, S = (max_c - min_c) / max_c per pixel, 0 where max_c = 0
    (images Float[B,3,H,W], clamped to [0, 1]). Greys (white, black) score 0, pure hues 1."""
    x = images.detach().float().clamp(0, 1)
    hi, lo = x.max(dim=1).values, x.min(dim=1).values
    s = torch.where(hi > 0, (hi - lo) / hi.clamp_min(1e-12), torch.zeros_like(hi))
    return s.flatten(1).mean(1)


@register_reward("saturation")
class Saturation(Reward):
    """Mean HSV colour saturation of the image (`hsv_saturation`), times `scale`: pays for vivid colour
    anywhere in the picture, so a policy can raise it by tinting the background or smearing colour, whatever
    the prompt asked. A deliberately hackable reward for testing over-optimisation detection."""

    needs = {"images"}

    def __init__(self, *, scale: float = 1.0, device: str | None = None) -> None:
        if not math.isfinite(float(scale)):
            raise ValueError(f"reward {self.name!r}: scale must be a finite number, got {scale!r}")
        self.scale = float(scale)
        self.device = device  # a few tensor ops; kept for a uniform option set

    def __call__(self, batch: RewardBatch) -> Tensor:
        with torch.no_grad():
            return self.scale * hsv_saturation(batch_images(self, batch)).cpu()


# =========================================================================== colour blobs
def colour_mask(images: Tensor, colour: Sequence[float], threshold: float = 0.25) -> Tensor:
    """Bool[B,H,W]: pixels within Euclidean distance `threshold` (RGB in [0,1]) of `colour`, an RGB triple
    in [0, 255] (when a value exceeds 1) or in [0, 1]. A colour name is a TypeError: names belong to a palette
    (the shapes world's: `mmalign.tiny.world_rewards.palette_mask`)."""
    if isinstance(colour, str):
        raise TypeError(f"colour_mask: colour must be an RGB triple, got the name {colour!r}")
    c = torch.tensor(colour, dtype=torch.float32, device=images.device)
    if c.max() > 1:
        c = c / 255.0
    return (images.float() - c.view(1, 3, 1, 1)).norm(dim=1) < threshold


def connected_components(mask: Tensor, min_pixels: int = 1) -> tuple[Tensor, list[int]]:
    """4-connected components of Bool[B,H,W]: (labels Long[B,H,W], -1 off the mask; count per image).

    Min-label propagation with pointer jumping, batched in torch (no scipy). Components smaller than
    `min_pixels` are dropped (label -1, not counted).
    """
    b, h, w = mask.shape
    n = b * h * w
    big = n  # larger than every index
    idx = torch.arange(n, device=mask.device).view(b, h, w)
    lab = torch.where(mask, idx, torch.full_like(idx, big))
    while True:
        new = lab.clone()
        new[:, 1:, :] = torch.minimum(new[:, 1:, :], lab[:, :-1, :])
        new[:, :-1, :] = torch.minimum(new[:, :-1, :], lab[:, 1:, :])
        new[:, :, 1:] = torch.minimum(new[:, :, 1:], lab[:, :, :-1])
        new[:, :, :-1] = torch.minimum(new[:, :, :-1], lab[:, :, 1:])
        new = torch.where(mask, new, torch.full_like(new, big))
        flat = new.flatten()
        on = flat < big
        flat[on] = flat[flat[on]]  # pointer jumping: a label's own label is never larger
        new = flat.view(b, h, w)
        if torch.equal(new, lab):
            break
        lab = new
    labels = torch.full_like(lab, -1)
    counts = []
    for i in range(b):
        ids, sizes = torch.unique(lab[i][mask[i]], return_counts=True)
        keep = ids[sizes >= min_pixels]
        counts.append(int(keep.numel()))
        labels[i] = torch.where(torch.isin(lab[i], keep) & mask[i], lab[i], labels[i])
    return labels, counts


# =========================================================================== CLIP
_OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
_OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)

PICKSCORE_MODEL = "yuvalkirstain/PickScore_v1"
"""PickScore's weights (a `CLIPModel` without tokenizer or image processor in its repository)."""
PICKSCORE_PROCESSOR = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
"""The repository whose tokenizer and image processor PickScore uses (its base model's)."""


def looks_local(path: str) -> bool:
    """A filesystem path rather than a hub id ("org/name"): absolute, ./, ../, ~ or with a file suffix."""
    return (
        Path(path).is_absolute()
        or path.startswith((".", "~"))
        or path.count("/") > 1
        or "\\" in path
        or Path(path).suffix in (".pt", ".pth", ".bin", ".safetensors", ".ckpt")
    )


def local_path(path: str | Path, what: str) -> Path:
    """`path` expanded, which must exist (a FileNotFoundError naming `what` otherwise)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"{what}: no such file or folder: {p.resolve()}")
    return p


def _hf_source(name: str | Path, what: str) -> str:
    """What `from_pretrained` gets for `name`: the resolved local folder when `name` exists or looks like a path
    (`FileNotFoundError` naming it when it does not exist), else `name` itself, a hub id."""
    name = str(name)
    if Path(name).expanduser().exists() or looks_local(name):
        return str(local_path(name, what))
    return name


def _has_vocabulary(tokenizer: Any) -> bool:
    """Whether `tokenizer` maps plain words to something other than its unknown token (a CLIP tokenizer
    built from a folder without tokenizer files knows only its special tokens)."""
    ids = tokenizer("a photo of a cat", add_special_tokens=False)["input_ids"]
    return bool(ids) and any(i != tokenizer.unk_token_id for i in ids)


class CLIPEmbedder:
    """A CLIP model loaded once; `encode_images` / `encode_texts` give L2-normalised embeddings.

    Backends:

    - ``"hf"``: `path` is a local folder or a hub id holding a `CLIPModel`. Its tokenizer and image
      processor come from `processor` (a folder or hub id) when given, else from `path`: PickScore is
      ``path="yuvalkirstain/PickScore_v1", processor="laion/CLIP-ViT-H-14-laion2B-s32B-b79K"``, as its
      authors and flow_grpo load it. The image mean / std are the image processor's, the OpenAI CLIP
      statistics when there is none.
    - ``"open_clip"``: ``open_clip.create_model_and_transforms(arch, pretrained=path)`` with `path`
      a local checkpoint file, and ``open_clip.get_tokenizer(arch)``.

    Images (Float[B,3,H,W] in [0,1]) are preprocessed in torch, batched: bicubic resize of the
    shorter side to the model's input size, centre crop, normalisation. Texts are tokenized as they are
    (no template), padded and truncated at the text model's context length (77 for CLIP).
    """

    def __init__(
        self,
        path: str | Path,
        *,
        processor: str | Path | None = None,
        backend: str = "hf",
        arch: str | None = None,
        device: str | None = None,
    ) -> None:
        if backend not in ("hf", "open_clip"):
            raise ValueError(f"unknown CLIP backend {backend!r}; 'hf' or 'open_clip'")
        self.backend = backend
        self.device = torch.device(device or "cpu")
        path = str(path)
        self.path = path
        mean, std = _OPENAI_MEAN, _OPENAI_STD
        if backend == "hf":
            from transformers import AutoImageProcessor, AutoTokenizer, CLIPModel

            source = _hf_source(path, "CLIP model folder")
            proc_source = source if processor is None else _hf_source(processor, "CLIP processor folder")
            self.processor = None if processor is None else str(processor)
            try:
                self.model = CLIPModel.from_pretrained(source)
            except OSError as e:
                if source != path:  # a local folder that exists but is not a CLIP model: the error as is
                    raise
                raise FileNotFoundError(
                    f"CLIP model {path!r}: no such local folder ({Path(path).resolve()}) "
                    f"and it could not be loaded as a hub id: {e}"
                ) from e
            hint = (
                f"CLIP model {path!r} has no tokenizer: set `processor` to the folder or hub id that holds its "
                f"tokenizer and image processor (PickScore: processor: {PICKSCORE_PROCESSOR})"
                if processor is None
                else f"CLIP processor {str(processor)!r} holds no tokenizer"
            )
            try:
                self.tokenizer = AutoTokenizer.from_pretrained(proc_source)
            except (OSError, ValueError, TypeError) as e:
                raise FileNotFoundError(f"{hint} ({type(e).__name__}: {e})") from e
            if not _has_vocabulary(self.tokenizer):  # transformers builds an empty one where no files are
                raise FileNotFoundError(f"{hint}: no tokenizer files in {proc_source}")
            try:
                proc = AutoImageProcessor.from_pretrained(proc_source)
                mean, std = tuple(proc.image_mean), tuple(proc.image_std)
            except Exception:  # no preprocessor_config.json: the OpenAI CLIP statistics
                pass
            size = self.model.config.vision_config.image_size
            self.context_length = self.model.config.text_config.max_position_embeddings
        else:
            import open_clip

            if processor is not None:
                raise ValueError(
                    "`processor` is for the 'hf' backend; open_clip takes its tokenizer from `arch`"
                )
            if arch is None:
                raise ValueError("the open_clip backend needs `arch` (e.g. 'ViT-B-32')")
            ckpt = local_path(path, f"open_clip checkpoint for {arch}")
            self.model, _, _ = open_clip.create_model_and_transforms(arch, pretrained=str(ckpt))
            self.tokenizer = open_clip.get_tokenizer(arch)
            cfg = getattr(self.model.visual, "preprocess_cfg", None) or {}
            mean = tuple(cfg.get("mean", getattr(self.model.visual, "image_mean", None) or mean))
            std = tuple(cfg.get("std", getattr(self.model.visual, "image_std", None) or std))
            size = self.model.visual.image_size
        self.image_size = (size, size) if isinstance(size, int) else tuple(size)
        self.mean = torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1)
        self.model.eval().requires_grad_(False).to(self.device)

    @property
    def logit_scale(self) -> float:
        return float(self.model.logit_scale.exp().item())

    def preprocess(self, images: Tensor) -> Tensor:
        """Float[B,3,H,W] in [0,1] -> normalised Float[B,3,h,w] at the model's input size."""
        x = images.detach().float().to(self.device)
        th, tw = self.image_size
        h, w = x.shape[-2:]
        if (h, w) != (th, tw):
            s = max(th / h, tw / w)
            nh, nw = max(th, round(h * s)), max(tw, round(w * s))
            x = torch.nn.functional.interpolate(
                x, size=(nh, nw), mode="bicubic", align_corners=False, antialias=True
            )
            top, left = (nh - th) // 2, (nw - tw) // 2
            x = x[..., top : top + th, left : left + tw].clamp(0, 1)
        return (x - self.mean.to(self.device)) / self.std.to(self.device)

    @staticmethod
    def _features(out: Any) -> Tensor:
        return out if isinstance(out, Tensor) else out.pooler_output

    def encode_images(self, images: Tensor) -> Tensor:
        """L2-normalised image embeddings Float[B,D]."""
        with torch.no_grad():
            x = self.preprocess(images)
            if self.backend == "hf":
                f = self._features(self.model.get_image_features(pixel_values=x))
            else:
                f = self.model.encode_image(x)
            return torch.nn.functional.normalize(f.float(), dim=-1)

    def encode_texts(self, texts: Sequence[str]) -> Tensor:
        """L2-normalised text embeddings Float[B,D]."""
        with torch.no_grad():
            if self.backend == "hf":
                tok = self.tokenizer(
                    list(texts),
                    padding=True,
                    truncation=True,
                    max_length=self.context_length,
                    return_tensors="pt",
                ).to(self.device)
                f = self._features(
                    self.model.get_text_features(
                        input_ids=tok["input_ids"], attention_mask=tok.get("attention_mask")
                    )
                )
            else:
                f = self.model.encode_text(self.tokenizer(list(texts)).to(self.device))
            return torch.nn.functional.normalize(f.float(), dim=-1)


def batch_prompts(reward: Reward, batch: RewardBatch, column: str | None) -> list[str]:
    """The prompts of `batch`, or its dataset `column` (a KeyError naming the reward and the columns)."""
    if column is None:
        return [str(p) for p in batch.prompts]
    if column not in batch.columns:
        raise KeyError(
            f"reward {reward.name!r}: text column {column!r} is not in the dataset; "
            f"available columns: {sorted(batch.columns) or 'none'}"
        )
    return [str(p) for p in batch.columns[column]]


@register_reward("clip_score")
class ClipScore(Reward):
    """CLIP image-text similarity: cosine(image, prompt), times 100 unless ``raw=True`` (CLIPScore: max(0, .)).

    `path`: a CLIP folder or hub id (``openai/clip-vit-large-patch14``); `processor`: where its tokenizer and
    image processor come from when not from `path` (see `CLIPEmbedder`)."""

    needs = {"images", "prompts"}

    def __init__(
        self,
        *,
        path: str,
        processor: str | None = None,
        backend: str = "hf",
        arch: str | None = None,
        raw: bool = False,
        clamp: bool = False,
        text_column: str | None = None,
        batch_size: int = 64,
        device: str | None = None,
    ) -> None:
        self.clip = CLIPEmbedder(path, processor=processor, backend=backend, arch=arch, device=device)
        self.raw, self.clamp = bool(raw), bool(clamp)
        self.text_column = text_column
        self.batch_size = int(batch_size)

    def cosine(self, images: Tensor, texts: Sequence[str]) -> Tensor:
        outs = []
        for s in range(0, len(texts), self.batch_size):
            im = self.clip.encode_images(images[s : s + self.batch_size])
            tx = self.clip.encode_texts(texts[s : s + self.batch_size])
            outs.append((im * tx).sum(-1))
        return torch.cat(outs).cpu() if outs else torch.zeros(0)

    def __call__(self, batch: RewardBatch) -> Tensor:
        cos = self.cosine(batch_images(self, batch), batch_prompts(self, batch, self.text_column))
        if self.clamp:
            cos = cos.clamp_min(0)
        return cos if self.raw else 100.0 * cos


@register_reward("preference")
class PreferenceScore(ClipScore):
    """PickScore / HPS style preference: logit_scale.exp() * cosine(image, prompt) with a CLIP model.

    PickScore by its two hub ids, as its authors and flow_grpo load it: ``path: yuvalkirstain/PickScore_v1``
    (the weights) and ``processor: laion/CLIP-ViT-H-14-laion2B-s32B-b79K`` (tokenizer and image processor);
    a local folder holding both still works as `path` alone. The prompt is tokenized as is, padded and
    truncated at 77 tokens. flow_grpo divides the score by 26 (a constant: no effect on group-normalised
    advantages)."""

    def __init__(
        self,
        *,
        path: str,
        processor: str | None = None,
        backend: str = "hf",
        arch: str | None = None,
        text_column: str | None = None,
        batch_size: int = 64,
        device: str | None = None,
    ) -> None:
        super().__init__(
            path=path,
            processor=processor,
            backend=backend,
            arch=arch,
            raw=True,
            text_column=text_column,
            batch_size=batch_size,
            device=device,
        )

    def __call__(self, batch: RewardBatch) -> Tensor:
        return self.clip.logit_scale * self.cosine(
            batch_images(self, batch), batch_prompts(self, batch, self.text_column)
        )


# =========================================================================== aesthetic
def aesthetic_mlp(
    dim: int, hidden: Sequence[int] = (1024, 128, 64, 16), dropout: float = 0.0
) -> torch.nn.Sequential:
    """Linear layers dim -> *hidden -> 1, a Dropout after each hidden layer but the last (LAION's layout:
    its checkpoint's keys ``layers.0``, ``layers.2``, ``layers.4``, ``layers.6``, ``layers.7`` load as is)."""
    layers: list[torch.nn.Module] = []
    d = dim
    for k, hsz in enumerate(hidden):
        layers.append(torch.nn.Linear(d, hsz))
        if k < len(hidden) - 1:
            layers.append(torch.nn.Dropout(dropout))
        d = hsz
    layers.append(torch.nn.Linear(d, 1))
    return torch.nn.Sequential(*layers)


def weights_file(path: str, filename: str | None, what: str) -> Path:
    """The local file of a weights option: `path` itself (a file; `filename` None), ``path/filename`` (`path` a
    local folder), or `filename` of the hub repository `path` (``org/name``), from the Hugging Face cache or
    downloaded into it by `huggingface_hub.hf_hub_download` (only the cache with ``HF_HUB_OFFLINE=1``).
    Raises `FileNotFoundError` naming what was looked for and, for a hub file, the ``hf download`` command."""
    p = Path(path).expanduser()
    if filename is None:
        if not p.exists() and not looks_local(path):
            raise FileNotFoundError(
                f"{what}: no such file {p.resolve()}; for a file of the hub repository {path!r} set the file "
                "name too (e.g. mlp_path: trl-lib/ddpo-aesthetic-predictor, mlp_file: aesthetic-model.pth)"
            )
        return local_path(path, what)
    if p.exists() or looks_local(path):
        return local_path(p / filename, what)
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return Path(hf_hub_download(repo_id=path, filename=filename))
    except (OSError, ValueError, EntryNotFoundError) as e:
        first = (str(e).splitlines() or [""])[0][:200]
        raise FileNotFoundError(
            f"{what}: {filename!r} of the hub repository {path!r} is neither a local file nor in the Hugging "
            f"Face cache, and it could not be downloaded ({type(e).__name__}: {first}). Fetch it where the "
            f"hub is reachable: `hf download {path} {filename}`"
        ) from e


@register_reward("aesthetic")
class AestheticScore(Reward):
    """LAION-aesthetic style score: a Linear MLP on the L2-normalised CLIP image embedding.

    `mlp_path`: the MLP's weights (a torch state dict, loaded with ``weights_only=True``, or safetensors),
    a local file, or with `mlp_file` a file of a local folder or of the hub repository `mlp_path`. LAION's
    improved-aesthetic-predictor head on CLIP ViT-L/14, as TRL's DDPO loads it from the hub:
    ``mlp_path: trl-lib/ddpo-aesthetic-predictor, mlp_file: aesthetic-model.pth`` with
    ``path: openai/clip-vit-large-patch14`` (flow_grpo ships LAION's ``sac+logos+ava1-l14-linearMSE.pth`` in
    its repository: a local `mlp_path`). Its keys ``layers.0``, ``layers.2`` ... load as they are."""

    needs = {"images"}

    def __init__(
        self,
        *,
        mlp_path: str,
        path: str,
        mlp_file: str | None = None,
        processor: str | None = None,
        backend: str = "hf",
        arch: str | None = None,
        hidden: Sequence[int] = (1024, 128, 64, 16),
        prefix: str = "",
        scale: float = 1.0,
        batch_size: int = 64,
        device: str | None = None,
    ) -> None:
        wpath = weights_file(mlp_path, mlp_file, f"reward {self.name!r}: aesthetic MLP weights")
        self.clip = CLIPEmbedder(path, processor=processor, backend=backend, arch=arch, device=device)
        if wpath.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(wpath))
        else:
            state = torch.load(str(wpath), map_location="cpu", weights_only=True)
            if isinstance(state, torch.nn.Module):
                state = state.state_dict()
        if prefix:
            state = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
        # LAION's checkpoint names the layers "layers.0", "layers.2", ...
        state = {k.removeprefix("layers."): v for k, v in state.items()}
        if "0.weight" not in state:
            raise ValueError(
                f"reward {self.name!r}: {wpath} has no first Linear layer '0.weight' (keys: {sorted(state)[:6]})"
            )
        dim = state["0.weight"].shape[1]
        self.mlp = aesthetic_mlp(dim, list(hidden))
        try:
            self.mlp.load_state_dict(state)
        except RuntimeError as e:
            raise ValueError(
                f"reward {self.name!r}: {wpath} does not match the MLP {dim} -> {list(hidden)} -> 1 "
                f"(set `hidden`): {e}"
            ) from e
        self.mlp.eval().requires_grad_(False).to(self.clip.device)
        self.scale = float(scale)
        self.batch_size = int(batch_size)

    def __call__(self, batch: RewardBatch) -> Tensor:
        images = batch_images(self, batch)
        outs = []
        with torch.no_grad():
            for s in range(0, images.shape[0], self.batch_size):
                emb = self.clip.encode_images(images[s : s + self.batch_size])
                outs.append(self.mlp(emb).squeeze(-1).float().cpu())
        return self.scale * (torch.cat(outs) if outs else torch.zeros(0))
