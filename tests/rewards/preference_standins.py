"""Tiny stand-ins of the preference models of rewards/preference.py, in their hub repositories' real layout, for
an offline Hugging Face cache (`write_cache`, through tests/e2e/hub_standins.py's `write_hub_cache`):

- ``xswu/HPSv2``: ``HPS_v2_compressed.pt`` and ``HPS_v2.1_compressed.pt``, each ``{"state_dict": ...}`` of an
  open_clip model of the tiny config `HPS_ARCH` (`register_hps_arch` adds it to open_clip), different weights;
- ``THUDM/ImageReward``: ``ImageReward.pt`` (keys of the ImageReward package's model: ``blip.visual_encoder.*``
  in BLIP's timm-style ViT layout, ``blip.text_encoder.*`` in BLIP's BERT layout with its ``position_ids``
  buffer, ``blip.vision_proj`` / ``blip.text_proj``, ``mlp.layers.{0,2,4,6,7}``) and ``med_config.json`` (a
  ``BertConfig`` with ``add_cross_attention``);
- ``bert-base-uncased``: a ``BertTokenizer`` (vocab.txt, lower case) whose vocabulary covers `PROMPTS`;
- ``Qwen/Qwen2-VL-7B-Instruct``: a tiny ``Qwen2VLForConditionalGeneration`` (untied LM head, as the 7B) with a
  ``Qwen2VLProcessor`` (Qwen2-VL's special tokens, the chat template with its default system turn);
- ``MizzenAI/HPSv3``: ``HPSv3.safetensors``, the state dict of HPSv3's model as transformers 4.45 names it
  (``visual.*``, ``model.*``, ``lm_head.weight``) for the base's tokenizer plus ``<|Reward|>``, and the "ranknet"
  head ``rm_head.{0,3,5}`` (hidden -> 1024 -> 16 -> 2 in the real model; smaller here).

Weights are random (seeded); what is real is the file names, key names and formats.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
import hub_standins  # noqa: E402

HPS_ARCH = "mmalign-tiny-hpsv2"
HPS_CONFIG: dict[str, Any] = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 224, "layers": 2, "width": 32, "head_width": 16, "patch_size": 14},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2},
}
"""ViT-H-14's config (224 px, patch 14, 77 text tokens, CLIP's vocabulary) at a tiny width and depth."""

PROMPTS = ["a red cat on a sofa", "two blue circles on the left of a tree", "a photo of a dog"]
IR_VISION = {"width": 64, "depth": 2, "mlp": 128, "patch": 16, "size": 224}
IR_TEXT = {"hidden": 32, "layers": 2, "heads": 2, "intermediate": 64}
IR_HIDDEN = (16, 8, 8, 4)  # the ImageReward MLP's 1024, 128, 64, 16
QWEN_SYSTEM_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""Qwen2-VL-Instruct's chat template (a default system turn; images as vision start / pad / end)."""


def register_hps_arch(folder: Path) -> str:
    """Add `HPS_CONFIG` to open_clip's model configs as `HPS_ARCH` (a JSON file in `folder`); returns the name."""
    import open_clip

    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{HPS_ARCH}.json").write_text(json.dumps(HPS_CONFIG))
    open_clip.add_model_config(folder)
    return HPS_ARCH


@hub_standins.standin("xswu/HPSv2")
def hpsv2(path: Path) -> None:
    """HPSv2's two checkpoints: ``{"state_dict": open_clip state dict}`` (v2.0 seed 0, v2.1 seed 1)."""
    import open_clip

    register_hps_arch(path.parent / "open_clip_configs")
    for seed, name in enumerate(("HPS_v2_compressed.pt", "HPS_v2.1_compressed.pt")):
        torch.manual_seed(seed)
        model = open_clip.create_model(HPS_ARCH)
        torch.save({"state_dict": model.state_dict()}, path / name)


def _randn(*shape: int, scale: float | None = None) -> torch.Tensor:
    return torch.randn(*shape) * (scale if scale is not None else shape[-1] ** -0.5)


def _layer_norm(prefix: str, dim: int) -> dict[str, torch.Tensor]:
    return {f"{prefix}.weight": 1 + 0.1 * torch.randn(dim), f"{prefix}.bias": 0.1 * torch.randn(dim)}


def _linear(prefix: str, d_in: int, d_out: int) -> dict[str, torch.Tensor]:
    return {f"{prefix}.weight": _randn(d_out, d_in), f"{prefix}.bias": 0.1 * torch.randn(d_out)}


def imagereward_state(vocab_size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A random ImageReward state dict in the ImageReward package's key layout (module docstring)."""
    torch.manual_seed(seed)
    w, p, n = IR_VISION["width"], IR_VISION["patch"], (IR_VISION["size"] // IR_VISION["patch"]) ** 2
    v = "blip.visual_encoder"
    sd: dict[str, torch.Tensor] = {
        f"{v}.cls_token": _randn(1, 1, w, scale=0.5),
        f"{v}.pos_embed": _randn(1, n + 1, w, scale=0.5),
        f"{v}.patch_embed.proj.weight": _randn(w, 3, p, p, scale=(3 * p * p) ** -0.5),
        f"{v}.patch_embed.proj.bias": 0.1 * torch.randn(w),
        **_layer_norm(f"{v}.norm", w),
    }
    for i in range(IR_VISION["depth"]):
        b = f"{v}.blocks.{i}"
        sd |= _layer_norm(f"{b}.norm1", w) | _layer_norm(f"{b}.norm2", w)
        sd |= _linear(f"{b}.attn.qkv", w, 3 * w) | _linear(f"{b}.attn.proj", w, w)
        sd |= _linear(f"{b}.mlp.fc1", w, IR_VISION["mlp"]) | _linear(f"{b}.mlp.fc2", IR_VISION["mlp"], w)
    h, t = IR_TEXT["hidden"], "blip.text_encoder"
    sd |= {
        f"{t}.embeddings.word_embeddings.weight": _randn(vocab_size, h, scale=0.5),
        f"{t}.embeddings.position_embeddings.weight": _randn(512, h, scale=0.5),
        f"{t}.embeddings.position_ids": torch.arange(512).expand(1, -1).clone(),
        **_layer_norm(f"{t}.embeddings.LayerNorm", h),
    }
    for i in range(IR_TEXT["layers"]):
        b = f"{t}.encoder.layer.{i}"
        for att, d_kv in (("attention", h), ("crossattention", w)):
            sd |= _linear(f"{b}.{att}.self.query", h, h)
            sd |= _linear(f"{b}.{att}.self.key", d_kv, h) | _linear(f"{b}.{att}.self.value", d_kv, h)
            sd |= _linear(f"{b}.{att}.output.dense", h, h) | _layer_norm(f"{b}.{att}.output.LayerNorm", h)
        sd |= _linear(f"{b}.intermediate.dense", h, IR_TEXT["intermediate"])
        sd |= _linear(f"{b}.output.dense", IR_TEXT["intermediate"], h) | _layer_norm(
            f"{b}.output.LayerNorm", h
        )
    sd |= _linear("blip.vision_proj", w, 8) | _linear("blip.text_proj", h, 8)  # unused by the score
    dims = [h, *IR_HIDDEN, 1]
    for layer, (d_in, d_out) in zip((0, 2, 4, 6, 7), zip(dims, dims[1:]), strict=True):
        sd |= _linear(f"mlp.layers.{layer}", d_in, d_out)
    return sd


def bert_vocab() -> list[str]:
    words = sorted({w for p in PROMPTS for w in p.lower().split()} | {"photo", "of", "the"})
    return ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]


@hub_standins.standin("bert-base-uncased")
def bert_base_uncased(path: Path) -> None:
    """bert-base-uncased's tokenizer files (vocab.txt, lower case) over a tiny vocabulary, and a config.json."""
    from transformers import BertConfig, BertTokenizer

    (path / "vocab.txt").write_text("\n".join(bert_vocab()) + "\n")
    BertTokenizer(str(path / "vocab.txt"), do_lower_case=True).save_pretrained(path)
    BertConfig(
        vocab_size=len(bert_vocab()), hidden_size=32, num_hidden_layers=1, num_attention_heads=2
    ).save_pretrained(path)  # the repository's config.json (AutoTokenizer reads the model type from it)


@hub_standins.standin("THUDM/ImageReward")
def image_reward(path: Path) -> None:
    """ImageReward.pt + med_config.json (module docstring); the vocabulary is BERT's plus [DEC] and [ENC]."""
    vocab_size = len(bert_vocab()) + 2
    torch.save(imagereward_state(vocab_size), path / "ImageReward.pt")
    med = {
        "architectures": ["BertModel"],
        "attention_probs_dropout_prob": 0.1,
        "hidden_act": "gelu",
        "hidden_dropout_prob": 0.1,
        "hidden_size": IR_TEXT["hidden"],
        "initializer_range": 0.02,
        "intermediate_size": IR_TEXT["intermediate"],
        "layer_norm_eps": 1e-12,
        "max_position_embeddings": 512,
        "model_type": "bert",
        "num_attention_heads": IR_TEXT["heads"],
        "num_hidden_layers": IR_TEXT["layers"],
        "pad_token_id": 0,
        "type_vocab_size": 2,
        "vocab_size": vocab_size,
        "encoder_width": IR_VISION["width"],
        "add_cross_attention": True,
    }
    (path / "med_config.json").write_text(json.dumps(med, indent=2))


def qwen2_vl_processor() -> Any:
    """A `Qwen2VLProcessor` (`mmalign.tiny.vlm`'s, BPE trained on HPSv3's prompt too) with Qwen2-VL's template."""
    from mmalign.tiny import vlm
    from rewards.preference import HPSV3_INSTRUCTION

    texts = [HPSV3_INSTRUCTION.format(text_prompt=p) for p in PROMPTS] * 3
    proc = vlm.tiny_vlm_processor(texts, min_pixels=56 * 56, max_pixels=28 * 28 * 1280)
    proc.chat_template = QWEN_SYSTEM_TEMPLATE
    proc.tokenizer.chat_template = QWEN_SYSTEM_TEMPLATE
    return proc


def qwen2_vl_model(vocab_size: int, seed: int) -> Any:
    """A tiny `Qwen2VLForConditionalGeneration` for `qwen2_vl_processor`'s tokens, LM head untied (the 7B's)."""
    from mmalign.tiny import vlm

    torch.manual_seed(seed)
    tok = qwen2_vl_processor().tokenizer
    model = vlm.tiny_vlm(tok, vocab_size=vocab_size)
    model.config.tie_word_embeddings = False
    model.config.get_text_config().tie_word_embeddings = False
    fresh = type(model)(model.config)  # rebuilt so that lm_head is a parameter of its own
    fresh.load_state_dict(model.state_dict(), strict=False)
    with torch.no_grad():
        fresh.lm_head.weight.copy_(torch.randn_like(fresh.lm_head.weight) * 0.1)
    return fresh


@hub_standins.standin("Qwen/Qwen2-VL-7B-Instruct")
def qwen2_vl_7b(path: Path) -> None:
    """The base of HPSv3: config.json, weights and the processor files."""
    proc = qwen2_vl_processor()
    qwen2_vl_model(len(proc.tokenizer), seed=0).save_pretrained(path)
    proc.save_pretrained(path)


def hpsv3_state(seed: int = 1) -> dict[str, torch.Tensor]:
    """HPSv3's state dict: the base model resized to the tokenizer plus <|Reward|>, keys as in transformers 4.45
    (``visual.``, ``model.`` for the language model, ``lm_head.``), and the ranknet head ``rm_head.{0,3,5}``."""
    proc = qwen2_vl_processor()
    model = qwen2_vl_model(len(proc.tokenizer) + 1, seed=seed)
    sd = {}
    for k, v in model.state_dict().items():
        k = k.replace("model.visual.", "visual.").replace("model.language_model.", "model.")
        sd[k] = v.contiguous()
    hidden = model.config.get_text_config().hidden_size
    torch.manual_seed(seed + 100)
    for layer, (d_in, d_out) in zip((0, 3, 5), ((hidden, 24), (24, 8), (8, 2)), strict=True):
        sd |= _linear(f"rm_head.{layer}", d_in, d_out)
    return sd


@hub_standins.standin("MizzenAI/HPSv3")
def hpsv3(path: Path) -> None:
    """HPSv3.safetensors (`hpsv3_state`)."""
    from safetensors.torch import save_file

    save_file(hpsv3_state(), str(path / "HPSv3.safetensors"))


REPOS = (
    "xswu/HPSv2",
    "THUDM/ImageReward",
    "bert-base-uncased",
    "Qwen/Qwen2-VL-7B-Instruct",
    "MizzenAI/HPSv3",
)


def write_cache(hf_home: Path) -> dict[str, Path]:
    """Every stand-in of this module in the cache under `hf_home` (``hf_home/hub/models--...``)."""
    return hub_standins.write_hub_cache(hf_home, REPOS)
