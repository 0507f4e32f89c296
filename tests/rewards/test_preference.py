"""Preference-model rewards (rewards/preference.py) by hub id, from an offline Hugging Face cache holding tiny
stand-ins in the real repositories' layout (tests/rewards/preference_standins.py).

Each score is checked against a reference written here without the reward, from what the authors' packages do:

- HPSv2: open_clip's own model loading (``create_model_and_transforms(arch, pretrained=file)``, which unwraps the
  checkpoint's "state_dict") and PIL preprocessing, the cosine of the normalised features; for a resize, the
  hpsv2 package's validation transform (ToTensor, then a bicubic Resize of the tensor, CenterCrop, Normalize);
- ImageReward: BLIP's forward as plain tensor operations on the checkpoint's own keys (ViT blocks with norm1 /
  attention / norm2 / MLP, a BERT layer with self-, cross-attention and feed-forward, post-LayerNorms), the
  package's PIL transform and 35-token padding, ``(mlp - 0.16717362830052426) / 1.0333394966054072``;
- HPSv3: the chat text written out by hand, the model assembled by hand from the base config and the
  checkpoint's 4.45-style keys, the ranknet head as plain matmuls with ReLU, mu at ``<|Reward|>``.

The hpsv2 / image-reward / hpsv3 packages themselves cannot be installed next to this stack (they pin pytest 7.2,
timm 0.6.13 + fairscale + OpenAI's clip, transformers 4.45.2 + deepspeed), hence the plain references.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Any

import preference_standins as standins
import pytest
import torch
from PIL import Image

import rewards
from rewards import RewardBatch, load_reward

SIZE = 224
MEAN = (0.48145466, 0.4578275, 0.40821073)
STD = (0.26862954, 0.26130258, 0.27577711)


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("hf")
    standins.write_cache(home)
    standins.register_hps_arch(home / "open_clip_configs")
    return home


@pytest.fixture
def offline(hf_home: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This process reads `hf_home`'s cache only (the environment and huggingface_hub's constants)."""
    from huggingface_hub import constants

    cache = hf_home / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def snap(cache: Path, repo_id: str) -> Path:
    return next((cache / f"models--{repo_id.replace('/', '--')}" / "snapshots").iterdir())


def uint8_images(n: int, h: int = SIZE, w: int = SIZE, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, h, w), generator=g).float() / 255


def pil(image: torch.Tensor) -> Image.Image:
    return Image.fromarray((image * 255).round().byte().permute(1, 2, 0).numpy())


def batch(images: torch.Tensor, prompts: list[str]) -> RewardBatch:
    return RewardBatch(prompts=prompts, outputs={"images": images})


def test_registered_and_listed() -> None:
    from mmalign.app.listing import render

    out, _ = render("rewards")
    for name in ("hpsv2", "image_reward", "hpsv3"):
        cls = rewards.get(name)
        assert cls.needs == {"images", "prompts"}
        summary = (cls.__doc__ or "").strip().splitlines()[0]
        assert any(line.split()[:1] == [name] and summary in line for line in out.splitlines()), name


# =========================================================================== HPSv2
def open_clip_cosine(file: Path, images: list[Image.Image], prompts: list[str]) -> torch.Tensor:
    import open_clip

    model, _, preprocess = open_clip.create_model_and_transforms(standins.HPS_ARCH, pretrained=str(file))
    model.eval()
    tokenizer = open_clip.get_tokenizer(standins.HPS_ARCH)
    with torch.no_grad():
        im, tx, _ = model(torch.stack([preprocess(x) for x in images]), tokenizer(prompts))
    return (im * tx).sum(-1)


@pytest.mark.parametrize(
    "version, file", [("v2.0", "HPS_v2_compressed.pt"), ("v2.1", "HPS_v2.1_compressed.pt")]
)
def test_hpsv2_by_id_is_the_cosine_of_open_clip_features(offline: Path, version: str, file: str) -> None:
    images = uint8_images(3)
    prompts = standins.PROMPTS
    reward = load_reward("hpsv2", version=version, arch=standins.HPS_ARCH, batch_size=2)
    got = reward(batch(images, prompts))
    ref = open_clip_cosine(snap(offline, "xswu/HPSv2") / file, [pil(x) for x in images], prompts)
    assert torch.allclose(got, ref, atol=1e-5), (got, ref)
    assert got.abs().max() <= 1
    # the prompt matters: one image, two prompts
    same = reward(batch(images[[0, 0]], prompts[:2]))
    assert (same[0] - same[1]).abs() > 1e-3


def test_hpsv2_versions_are_different_files(offline: Path) -> None:
    images = uint8_images(2, seed=1)
    v20 = load_reward("hpsv2", version="v2.0", arch=standins.HPS_ARCH)(batch(images, standins.PROMPTS[:2]))
    v21 = load_reward("hpsv2", arch=standins.HPS_ARCH)(batch(images, standins.PROMPTS[:2]))
    assert not torch.allclose(v20, v21, atol=1e-3)
    local = snap(offline, "xswu/HPSv2") / "HPS_v2_compressed.pt"
    by_file = load_reward("hpsv2", checkpoint=str(local), arch=standins.HPS_ARCH)(
        batch(images, standins.PROMPTS[:2])
    )
    assert torch.allclose(by_file, v20, atol=1e-6)


def test_hpsv2_resizes_as_the_hpsv2_package(offline: Path) -> None:
    """A 240 x 300 image: the package's validation transform (ToTensor, tensor Resize(224, bicubic), CenterCrop)."""
    import open_clip
    from torchvision import transforms as T

    images = uint8_images(2, h=240, w=300, seed=2)
    prompts = standins.PROMPTS[:2]
    got = load_reward("hpsv2", version="v2.0", arch=standins.HPS_ARCH)(batch(images, prompts))
    tf = T.Compose(
        [
            T.ToTensor(),
            T.Resize(SIZE, interpolation=T.InterpolationMode.BICUBIC),
            T.CenterCrop(SIZE),
            T.Normalize(MEAN, STD),
        ]
    )
    model, _, _ = open_clip.create_model_and_transforms(
        standins.HPS_ARCH, pretrained=str(snap(offline, "xswu/HPSv2") / "HPS_v2_compressed.pt")
    )
    model.eval()
    with torch.no_grad():
        im, tx, _ = model(
            torch.stack([tf(pil(x)) for x in images]), open_clip.get_tokenizer(standins.HPS_ARCH)(prompts)
        )
    assert torch.allclose(got, (im * tx).sum(-1), atol=1e-5)


def test_hpsv2_errors_name_what_to_do(offline: Path) -> None:
    with pytest.raises(ValueError, match="version must be one of"):
        load_reward("hpsv2", version="v3", arch=standins.HPS_ARCH)
    with pytest.raises(ValueError, match="no model config 'no-such-arch'"):
        load_reward("hpsv2", arch="no-such-arch")
    with pytest.raises(FileNotFoundError, match="hf download org/not-cached HPS_v2.1_compressed.pt"):
        load_reward("hpsv2", checkpoint="org/not-cached", arch=standins.HPS_ARCH)
    with pytest.raises(ValueError, match="does not fit open_clip's 'ViT-B-32'"):
        load_reward("hpsv2", arch="ViT-B-32")


# =========================================================================== ImageReward
def _ln(x: torch.Tensor, sd: dict[str, torch.Tensor], key: str, eps: float) -> torch.Tensor:
    return torch.nn.functional.layer_norm(x, x.shape[-1:], sd[f"{key}.weight"], sd[f"{key}.bias"], eps)


def _lin(x: torch.Tensor, sd: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    return x @ sd[f"{key}.weight"].T + sd[f"{key}.bias"]


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, bias: torch.Tensor | float = 0.0
) -> Any:
    b, n, d = q.shape
    split = lambda t: t.reshape(b, t.shape[1], heads, d // heads).transpose(1, 2)  # noqa: E731
    scores = split(q) @ split(k).transpose(-1, -2) / math.sqrt(d // heads) + bias
    return (scores.softmax(-1) @ split(v)).transpose(1, 2).reshape(b, n, d)


def blip_reference(
    sd: dict[str, torch.Tensor], pixels: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor
) -> Any:
    """ImageReward's score from its state dict, as plain tensor operations (module docstring)."""
    v = {k.removeprefix("blip.visual_encoder."): t.double() for k, t in sd.items() if "visual_encoder." in k}
    w = v["cls_token"].shape[-1]
    heads = w // 64
    x = torch.nn.functional.conv2d(
        pixels.double(), v["patch_embed.proj.weight"], v["patch_embed.proj.bias"], 16
    )
    x = torch.cat([v["cls_token"].expand(x.shape[0], 1, w), x.flatten(2).transpose(1, 2)], 1) + v["pos_embed"]
    for i in range(standins.IR_VISION["depth"]):
        h = _ln(x, v, f"blocks.{i}.norm1", 1e-6)
        q, k, val = _lin(h, v, f"blocks.{i}.attn.qkv").chunk(3, dim=-1)
        x = x + _lin(_attend(q, k, val, heads), v, f"blocks.{i}.attn.proj")
        h = _ln(x, v, f"blocks.{i}.norm2", 1e-6)
        x = x + _lin(torch.nn.functional.gelu(_lin(h, v, f"blocks.{i}.mlp.fc1")), v, f"blocks.{i}.mlp.fc2")
    image = _ln(x, v, "norm", 1e-6)
    t = {k.removeprefix("blip.text_encoder."): s.double() for k, s in sd.items() if "text_encoder." in k}
    heads = standins.IR_TEXT["heads"]
    pos = torch.arange(ids.shape[1])
    y = _ln(
        t["embeddings.word_embeddings.weight"][ids] + t["embeddings.position_embeddings.weight"][pos],
        t,
        "embeddings.LayerNorm",
        1e-12,
    )
    bias = (1.0 - mask.double())[:, None, None, :] * torch.finfo(torch.float64).min
    for i in range(standins.IR_TEXT["layers"]):
        b = f"encoder.layer.{i}"
        for att, kv, att_bias in (("attention", None, bias), ("crossattention", image, 0.0)):
            src = y if kv is None else kv
            a = _attend(
                _lin(y, t, f"{b}.{att}.self.query"),
                _lin(src, t, f"{b}.{att}.self.key"),
                _lin(src, t, f"{b}.{att}.self.value"),
                heads,
                att_bias,
            )
            y = _ln(_lin(a, t, f"{b}.{att}.output.dense") + y, t, f"{b}.{att}.output.LayerNorm", 1e-12)
        f = torch.nn.functional.gelu(_lin(y, t, f"{b}.intermediate.dense"))
        y = _ln(_lin(f, t, f"{b}.output.dense") + y, t, f"{b}.output.LayerNorm", 1e-12)
    r = y[:, 0]
    m = {k: s.double() for k, s in sd.items() if k.startswith("mlp.")}
    for layer in (0, 2, 4, 6, 7):
        r = _lin(r, m, f"mlp.layers.{layer}")
    return ((r.squeeze(-1) - 0.16717362830052426) / 1.0333394966054072).float()


def imagereward_reference(cache: Path, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """The package's transform and tokenisation, then `blip_reference`."""
    from torchvision import transforms as T
    from transformers import BertTokenizer

    tf = T.Compose(
        [
            T.Resize(SIZE, interpolation=T.InterpolationMode.BICUBIC),
            T.CenterCrop(SIZE),
            T.ToTensor(),
            T.Normalize(MEAN, STD),
        ]
    )
    tok = BertTokenizer.from_pretrained(snap(cache, "bert-base-uncased"))
    enc = tok(prompts, padding="max_length", truncation=True, max_length=35, return_tensors="pt")
    assert enc["input_ids"].shape == (len(prompts), 35)
    sd = torch.load(snap(cache, "THUDM/ImageReward") / "ImageReward.pt", weights_only=True)
    return blip_reference(
        sd, torch.stack([tf(pil(x)) for x in images]), enc["input_ids"], enc["attention_mask"]
    )


@pytest.mark.parametrize("h, w", [(SIZE, SIZE), (240, 260)])
def test_image_reward_by_id_matches_blip_by_hand(offline: Path, h: int, w: int) -> None:
    images = uint8_images(3, h=h, w=w, seed=3)
    prompts = standins.PROMPTS
    reward = load_reward("image_reward", batch_size=2)
    got = reward(batch(images, prompts))
    ref = imagereward_reference(offline, images, prompts)
    assert torch.allclose(got, ref, atol=1e-4), (got, ref)
    same = reward(batch(images[[0, 0]], prompts[:2]))
    assert (same[0] - same[1]).abs() > 1e-4


def test_image_reward_from_a_local_folder_and_its_errors(offline: Path, tmp_path: Path) -> None:
    folder = snap(offline, "THUDM/ImageReward")
    images = uint8_images(1, seed=4)
    by_id = load_reward("image_reward")(batch(images, standins.PROMPTS[:1]))
    by_file = load_reward("image_reward", checkpoint=str(folder / "ImageReward.pt"))(
        batch(images, standins.PROMPTS[:1])
    )
    assert torch.allclose(by_id, by_file, atol=1e-6)
    with pytest.raises(FileNotFoundError, match="hf download THUDM/ImageReward other.pt"):
        load_reward("image_reward", checkpoint_file="other.pt")
    broken = tmp_path / "broken.pt"
    torch.save({"mlp.layers.0.weight": torch.zeros(1, 1)}, broken)
    with pytest.raises(ValueError, match="no BLIP vision encoder"):
        load_reward("image_reward", checkpoint=str(broken), med_config=str(folder / "med_config.json"))


# =========================================================================== HPSv3
HPSV3_INSTRUCTION_SHA256 = "f6ee57479d4e9eee76b49c00dc962e1e696a5a2b3cc32cebd9b1fa76fe27502c"
"""sha256 of the hpsv3 package's INSTRUCTION + prompt_with_special_token (hpsv3 1.0.0, data_collator_qwen.py)."""


def test_hpsv3_prompt_is_the_authors() -> None:
    from rewards.preference import HPSV3_INSTRUCTION

    assert hashlib.sha256(HPSV3_INSTRUCTION.encode()).hexdigest() == HPSV3_INSTRUCTION_SHA256
    assert HPSV3_INSTRUCTION.count("{text_prompt}") == 1 and HPSV3_INSTRUCTION.count("<|Reward|>") == 1


def hpsv3_reference(cache: Path, images: torch.Tensor, prompts: list[str], pixels: int) -> torch.Tensor:
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoProcessor, Qwen2VLForConditionalGeneration

    from rewards.preference import HPSV3_INSTRUCTION

    base = snap(cache, "Qwen/Qwen2-VL-7B-Instruct")
    proc = AutoProcessor.from_pretrained(base, padding_side="right")
    proc.tokenizer.add_tokens(["<|Reward|>"], special_tokens=True)
    reward_id = proc.tokenizer.convert_tokens_to_ids("<|Reward|>")
    sd = load_file(str(snap(cache, "MizzenAI/HPSv3") / "HPSv3.safetensors"))
    config = AutoConfig.from_pretrained(base)
    config.get_text_config().vocab_size = len(proc.tokenizer)
    model = Qwen2VLForConditionalGeneration(config).eval()
    renamed = {}
    for k, v in sd.items():
        if k.startswith("visual."):
            renamed["model." + k] = v
        elif k.startswith("model."):
            renamed["model.language_model." + k.removeprefix("model.")] = v
        elif k.startswith("lm_head."):
            renamed[k] = v
    model.load_state_dict(renamed, strict=True)
    chats = [
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
        "<|vision_start|><|image_pad|><|vision_end|>"
        + HPSV3_INSTRUCTION.format(text_prompt=p)
        + "<|im_end|>\n<|im_start|>assistant\n"
        for p in prompts
    ]
    side = round(math.sqrt(pixels) / 28) * 28  # square images: smart_resize gives a square of ~`pixels`
    resized = [pil(x).resize((side, side), Image.BICUBIC) for x in images]
    enc = proc(text=chats, images=resized, padding=True, return_tensors="pt")
    assert (enc["input_ids"] == reward_id).sum(1).tolist() == [1] * len(prompts)
    with torch.no_grad():
        hidden = model.model(**enc).last_hidden_state[enc["input_ids"] == reward_id].double()
    relu = torch.relu
    h = relu(hidden @ sd["rm_head.0.weight"].double().T + sd["rm_head.0.bias"].double())
    h = relu(h @ sd["rm_head.3.weight"].double().T + sd["rm_head.3.bias"].double())
    out = h @ sd["rm_head.5.weight"].double().T + sd["rm_head.5.bias"].double()
    return out[:, 0].float()


def test_hpsv3_by_id_is_mu_at_the_reward_token(offline: Path) -> None:
    images = uint8_images(2, h=64, w=64, seed=5)
    prompts = ["a dog", "two blue circles on the left of a tree " * 3]  # different lengths: right padding
    reward = load_reward("hpsv3", dtype="float32", batch_size=2)
    got = reward(batch(images, prompts))
    ref = hpsv3_reference(offline, images, prompts, pixels=256 * 28 * 28)
    assert torch.allclose(got, ref, atol=1e-4), (got, ref)
    one_by_one = torch.cat([reward(batch(images[i : i + 1], prompts[i : i + 1])) for i in range(2)])
    assert torch.allclose(got, one_by_one, atol=1e-4)
    assert reward.chat("a dog").endswith(
        "Textual prompt - a dog\n\n\n\nPlease provide the overall ratings of this image: <|Reward|>\n\nEND\n<|im_end|>\n<|im_start|>assistant\n"
    )


def test_hpsv3_pixels_and_errors(offline: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(str(snap(offline, "MizzenAI/HPSv3") / "HPSv3.safetensors"))
    state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"][
        :-1
    ].contiguous()  # no <|Reward|> row
    mismatched = tmp_path / "mismatched.safetensors"
    save_file(state, str(mismatched))
    images = uint8_images(1, h=80, w=80, seed=6)
    small = load_reward("hpsv3", dtype="float32", pixels=112 * 112)
    assert small.resize(images[0]).size == (112, 112)
    got = small(batch(images, ["a dog"]))
    assert torch.allclose(got, hpsv3_reference(offline, images, ["a dog"], pixels=112 * 112), atol=1e-4)
    with pytest.raises(ValueError, match="holds no image-text processor"):
        load_reward("hpsv3", base=str(snap(offline, "bert-base-uncased")))
    with pytest.raises(ValueError, match="embeds .* tokens but the tokenizer of base"):
        load_reward("hpsv3", base=str(snap(offline, "Qwen/Qwen2-VL-7B-Instruct")), checkpoint=str(mismatched))
    with pytest.raises(ValueError, match="dtype"):
        load_reward("hpsv3", dtype="int8")
    plain = tmp_path / "plain.safetensors"
    save_file({"model.embed_tokens.weight": torch.zeros(2, 2)}, str(plain))
    with pytest.raises(ValueError, match="no reward head"):
        load_reward("hpsv3", checkpoint=str(plain))
