"""Reward models by hub id (rewards/image.py, rewards/video.py, rewards/edit.py), loaded from an offline Hugging
Face cache that holds tiny stand-ins under the real ids, each saved in its repository's real layout:

- ``yuvalkirstain/PickScore_v1``: a `CLIPModel`'s ``config.json`` + ``model.safetensors`` and no tokenizer or
  image processor (PickScore's repository has none);
- ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``: another `CLIPModel` (PickScore's base) with the CLIP tokenizer
  files and an old-style ``preprocessor_config.json`` (PickScore's processor);
- ``openai/clip-vit-large-patch14``: a `CLIPModel` with its tokenizer and image processor;
- ``trl-lib/ddpo-aesthetic-predictor``: ``aesthetic-model.pth``, LAION's aesthetic MLP as a torch state dict
  (``layers.0`` ... ``layers.7``, 1024 / 128 / 64 / 16 hidden units);
- ``Qwen/Qwen2-VL-2B-Instruct`` / ``Qwen/Qwen2.5-VL-7B-Instruct``: a tiny `Qwen2VLForConditionalGeneration` /
  `Qwen2_5_VLForConditionalGeneration` with its processor (tokenizer, image and video processors, chat template).

Each score is checked against a reference computed here without the reward: the model and processor loaded
from the snapshot folder and called as the authors do (flow_grpo's PickScore: the processor with padding,
truncation and max_length 77, ``logit_scale.exp() * cos``; the aesthetic MLP as plain matmuls of the state
dict). Nothing is downloaded: ``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import rewards.edit  # noqa: F401  (registers image_vlm_judge)
from rewards import RewardBatch, load_reward
from rewards.image import PICKSCORE_MODEL, PICKSCORE_PROCESSOR

CLIP_L = "openai/clip-vit-large-patch14"
AESTHETIC_REPO, AESTHETIC_FILE = "trl-lib/ddpo-aesthetic-predictor", "aesthetic-model.pth"
QWEN2_VL, QWEN25_VL = "Qwen/Qwen2-VL-2B-Instruct", "Qwen/Qwen2.5-VL-7B-Instruct"
SIZE = 32  # the stand-in CLIPs' input size
PROMPTS = ["a red cat", "two blue circles on the left of a tree " * 12]  # the second is over 77 tokens


def snapshot(cache: Path, repo_id: str) -> Path:
    """The snapshot folder of `repo_id` in the layout huggingface_hub writes: ``models--org--name/refs/main``
    holds a 40-hex commit naming ``snapshots/<commit>/``, where the repository's files are."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True, exist_ok=True)
    return snap


def clip_tokenizer() -> Any:
    """A `CLIPTokenizer` with CLIP's vocabulary layout: the 256 byte symbols, the same with ``</w>``, a few
    merges, then ``<|startoftext|>`` and ``<|endoftext|>`` (the last two ids, as in CLIP); 77 tokens at most."""
    from tokenizers import pre_tokenizers
    from transformers import CLIPTokenizer

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    merges = [("r", "e"), ("re", "d</w>"), ("c", "a"), ("ca", "t</w>"), ("t", "w"), ("tw", "o</w>")]
    words = alphabet + [a + "</w>" for a in alphabet] + ["".join(m) for m in merges]
    vocab = {t: i for i, t in enumerate([*words, "<|startoftext|>", "<|endoftext|>"])}
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77)


def tiny_clip(vocab_size: int, seed: int) -> Any:
    """A random `CLIPModel` at stand-in size with CLIP's context length (77) and the token ids of the real
    ``config.json`` files (bos 0, eos 2, pad 1: the text model pools at the highest id, ``<|endoftext|>``)."""
    from transformers import CLIPConfig, CLIPModel

    torch.manual_seed(seed)
    config = CLIPConfig(
        text_config=dict(
            vocab_size=vocab_size,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=77,
            bos_token_id=0,
            eos_token_id=2,
            pad_token_id=1,
        ),
        vision_config=dict(
            image_size=SIZE,
            patch_size=8,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
        ),
        projection_dim=16,
    )
    model = CLIPModel(config)
    with torch.no_grad():
        model.logit_scale.fill_(4.6052)  # exp = 100, as the trained CLIPs and PickScore
    return model


def write_clip_processor(folder: Path, tok: Any, mean: list[float], std: list[float]) -> None:
    """The processor files of a CLIP repository on the hub: the tokenizer's files and an old-style
    ``preprocessor_config.json`` (``CLIPFeatureExtractor``, integer size and crop)."""
    tok.save_pretrained(
        folder
    )  # tokenizer.json, tokenizer_config.json (the hub's also has vocab.json, merges.txt)
    preprocessor = {
        "crop_size": SIZE,
        "do_center_crop": True,
        "do_normalize": True,
        "do_resize": True,
        "feature_extractor_type": "CLIPFeatureExtractor",
        "image_mean": mean,
        "image_std": std,
        "resample": 3,
        "size": SIZE,
    }
    (folder / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))


def save_tiny_qwen25_vl(folder: Path) -> None:
    """A random `Qwen2_5_VLForConditionalGeneration` (2 text layers of width 32, one vision block) and a
    `Qwen2_5_VLProcessor` with Qwen2-VL's special tokens and chat template, saved as the hub repository has them."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor

    from mmalign.tiny import vlm

    base = vlm.tiny_vlm_processor(["Was it done? Answer yes or no.", "yes", "no"] * 4)
    tok = base.tokenizer
    ids = vlm.special_token_ids(tok)
    text = dict(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]},
        pad_token_id=tok.pad_token_id,
        eos_token_id=ids[vlm.IM_END],
        bos_token_id=None,
    )
    vision = dict(
        depth=1,
        hidden_size=16,
        intermediate_size=32,
        num_heads=2,
        out_hidden_size=32,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        fullatt_block_indexes=[0],
    )
    config = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids[vlm.IMAGE_PAD],
        video_token_id=ids[vlm.VIDEO_PAD],
        vision_start_token_id=ids[vlm.VISION_START],
        vision_end_token_id=ids[vlm.VISION_END],
        tie_word_embeddings=True,
    )
    torch.manual_seed(5)
    Qwen2_5_VLForConditionalGeneration(config).save_pretrained(folder)
    Qwen2_5_VLProcessor(
        image_processor=base.image_processor,
        tokenizer=tok,
        video_processor=base.video_processor,
        chat_template=base.chat_template,
    ).save_pretrained(folder)


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The offline cache with every stand-in (module docstring). PickScore's processor uses other image
    statistics than OpenAI's, so a reward that ignored `processor` would score differently."""
    from mmalign import tiny

    cache = tmp_path_factory.mktemp("hf") / "hub"
    tok = clip_tokenizer()
    tiny_clip(len(tok), seed=1).save_pretrained(snapshot(cache, PICKSCORE_MODEL))  # weights only
    laion = snapshot(cache, PICKSCORE_PROCESSOR)
    tiny_clip(len(tok), seed=2).save_pretrained(laion)
    write_clip_processor(laion, tok, mean=[0.5, 0.45, 0.4], std=[0.25, 0.3, 0.2])
    clip_l = snapshot(cache, CLIP_L)
    tiny_clip(len(tok), seed=3).save_pretrained(clip_l)
    write_clip_processor(
        clip_l, tok, mean=[0.48145466, 0.4578275, 0.40821073], std=[0.26862954, 0.26130258, 0.27577711]
    )
    torch.manual_seed(4)
    dims = [16, 1024, 128, 64, 16, 1]
    state = {}
    for layer, (d_in, d_out) in zip((0, 2, 4, 6, 7), zip(dims, dims[1:]), strict=True):
        state[f"layers.{layer}.weight"] = torch.randn(d_out, d_in) / d_in**0.5
        state[f"layers.{layer}.bias"] = 0.1 * torch.randn(d_out)
    torch.save(state, snapshot(cache, AESTHETIC_REPO) / AESTHETIC_FILE)
    tiny.build("vlm_random", snapshot(cache, QWEN2_VL), announce=False)
    save_tiny_qwen25_vl(snapshot(cache, QWEN25_VL))
    return cache


@pytest.fixture
def offline(hub_cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This process loads from `hub_cache` only (the environment and huggingface_hub's constants, which it
    read at import)."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return hub_cache


def snap(cache: Path, repo_id: str) -> Path:
    return next((cache / f"models--{repo_id.replace('/', '--')}" / "snapshots").iterdir())


def uint8_images(n: int, seed: int = 0) -> torch.Tensor:
    """Float[n,3,SIZE,SIZE] of uint8 values / 255: the same pixels as the PIL images the authors' processor gets."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, SIZE, SIZE), generator=g).float() / 255


def pil(images: torch.Tensor) -> list[Any]:
    from PIL import Image

    return [Image.fromarray((x * 255).round().byte().permute(1, 2, 0).numpy()) for x in images]


def features(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.pooler_output


def authors_clip_scores(
    model_dir: Path, processor_dir: Path, images: torch.Tensor, prompts: list[str]
) -> tuple:
    """(logit_scale.exp(), cosine Float[B]) as flow_grpo's PickScoreScorer computes them: `CLIPProcessor` on
    PIL images and on the prompts (padding, truncation, max_length 77), raw features, L2 norms by hand."""
    from transformers import CLIPModel, CLIPProcessor

    proc = CLIPProcessor.from_pretrained(processor_dir)
    model = CLIPModel.from_pretrained(model_dir).eval()
    with torch.no_grad():
        image_inputs = proc(images=pil(images), return_tensors="pt")
        text_inputs = proc(text=prompts, padding=True, truncation=True, max_length=77, return_tensors="pt")
        im = features(model.get_image_features(pixel_values=image_inputs["pixel_values"]))
        tx = features(model.get_text_features(**text_inputs))
        im = im / im.norm(p=2, dim=-1, keepdim=True)
        tx = tx / tx.norm(p=2, dim=-1, keepdim=True)
        return model.logit_scale.exp(), (tx @ im.T).diag(), im


def batch(images: torch.Tensor, prompts: list[str]) -> RewardBatch:
    return RewardBatch(prompts=prompts, outputs={"images": images})


# =========================================================================== PickScore
def test_pickscore_by_its_model_and_processor_ids(offline: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(snap(offline, PICKSCORE_PROCESSOR))
    assert len(tok(PROMPTS[1])["input_ids"]) > 77  # the authors' max_length=77 cuts it
    images = uint8_images(2)
    reward = load_reward("preference", path=PICKSCORE_MODEL, processor=PICKSCORE_PROCESSOR)
    got = reward(batch(images, PROMPTS))
    scale, cos, _ = authors_clip_scores(
        snap(offline, PICKSCORE_MODEL), snap(offline, PICKSCORE_PROCESSOR), images, PROMPTS
    )
    assert float(scale) == pytest.approx(100.0, rel=1e-4)
    assert torch.allclose(got, scale * cos, atol=1e-4), (got, scale * cos)
    # the weights are PickScore's, not those of the processor's repository (another model)
    _, base_cos, _ = authors_clip_scores(
        snap(offline, PICKSCORE_PROCESSOR), snap(offline, PICKSCORE_PROCESSOR), images, PROMPTS
    )
    assert not torch.allclose(got, scale * base_cos, atol=1e-2)
    # the text matters: one image, the two prompts
    same_image = reward(batch(images[[0, 0]], PROMPTS))
    assert (same_image[0] - same_image[1]).abs() > 1e-2


def test_pickscore_weights_alone_say_which_option_gives_the_tokenizer(offline: Path) -> None:
    with pytest.raises(FileNotFoundError, match=f"set `processor`.*processor: {PICKSCORE_PROCESSOR}"):
        load_reward("preference", path=PICKSCORE_MODEL)


def test_an_assembled_pickscore_folder_still_works(offline: Path, tmp_path: Path) -> None:
    """The former recipe: PickScore's weights copied next to its processor's files, given as `path` alone."""
    folder = tmp_path / "models" / "pickscore"
    shutil.copytree(snap(offline, PICKSCORE_PROCESSOR), folder)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(snap(offline, PICKSCORE_MODEL) / name, folder / name)
    images = uint8_images(2, seed=1)
    by_ids = load_reward("preference", path=PICKSCORE_MODEL, processor=PICKSCORE_PROCESSOR)(
        batch(images, PROMPTS)
    )
    assert torch.allclose(
        load_reward("preference", path=str(folder))(batch(images, PROMPTS)), by_ids, atol=1e-6
    )


def test_video_preference_by_ids_is_the_mean_over_frames(offline: Path) -> None:
    frames = uint8_images(4, seed=2).reshape(2, 2, 3, SIZE, SIZE)  # 2 videos of 2 frames
    reward = load_reward(
        "video_preference", path=PICKSCORE_MODEL, processor=PICKSCORE_PROCESSOR, frames="all"
    )
    got = reward(RewardBatch(prompts=PROMPTS, outputs={"videos": frames}))
    prompts = [p for p in PROMPTS for _ in range(2)]
    scale, cos, _ = authors_clip_scores(
        snap(offline, PICKSCORE_MODEL), snap(offline, PICKSCORE_PROCESSOR), frames.flatten(0, 1), prompts
    )
    assert torch.allclose(got, (scale * cos).reshape(2, 2).mean(1), atol=1e-4)


# =========================================================================== CLIP score and the aesthetic MLP
def test_clip_score_by_id(offline: Path) -> None:
    images = uint8_images(2, seed=3)
    got = load_reward("clip_score", path=CLIP_L)(batch(images, PROMPTS))
    _, cos, _ = authors_clip_scores(snap(offline, CLIP_L), snap(offline, CLIP_L), images, PROMPTS)
    assert torch.allclose(got, 100 * cos, atol=1e-4)


def test_aesthetic_head_by_id_and_file(offline: Path) -> None:
    """LAION's MLP (Linear layers, no activation; dropout is the identity in eval) as plain matmuls of the
    state dict, on the normalised CLIP image embedding."""
    images = uint8_images(3, seed=4)
    reward = load_reward("aesthetic", path=CLIP_L, mlp_path=AESTHETIC_REPO, mlp_file=AESTHETIC_FILE)
    got = reward(batch(images, [""] * 3))
    _, _, emb = authors_clip_scores(snap(offline, CLIP_L), snap(offline, CLIP_L), images, ["x"])
    state = torch.load(snap(offline, AESTHETIC_REPO) / AESTHETIC_FILE, weights_only=True)
    h = emb.double()
    for layer in (0, 2, 4, 6, 7):
        h = h @ state[f"layers.{layer}.weight"].double().T + state[f"layers.{layer}.bias"].double()
    assert torch.allclose(got.double(), h.squeeze(-1), atol=1e-4)
    frame = load_reward("frame_aesthetic", path=CLIP_L, mlp_path=AESTHETIC_REPO, mlp_file=AESTHETIC_FILE)
    videos = images[:2].unsqueeze(1).expand(2, 3, 3, SIZE, SIZE)  # 3 copies of one frame each
    assert torch.allclose(
        frame(RewardBatch(prompts=["", ""], outputs={"videos": videos})), got[:2], atol=1e-5
    )


def test_missing_ids_and_files_are_named_with_how_to_fetch(offline: Path) -> None:
    with pytest.raises(FileNotFoundError, match=f"hf download {AESTHETIC_REPO} other.pth"):
        load_reward("aesthetic", path=CLIP_L, mlp_path=AESTHETIC_REPO, mlp_file="other.pth")
    with pytest.raises(FileNotFoundError, match="set the file name too.*mlp_file"):
        load_reward("aesthetic", path=CLIP_L, mlp_path=AESTHETIC_REPO)
    with pytest.raises(FileNotFoundError, match="'org/not-cached'"):
        load_reward("clip_score", path="org/not-cached")
    with pytest.raises(FileNotFoundError, match="CLIP processor folder.*no-such-folder"):
        load_reward("preference", path=PICKSCORE_MODEL, processor="./no-such-folder")


# =========================================================================== VLM judges
@pytest.mark.parametrize("repo_id", [QWEN2_VL, QWEN25_VL])
def test_image_vlm_judge_by_id(offline: Path, repo_id: str) -> None:
    """P(yes) of the judge loaded by id equals the model and processor of the snapshot called directly,
    renormalised over the judge's yes / no first-token ids."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    size = 56  # the tiny Qwen2-VL's smallest input
    g = torch.Generator().manual_seed(5)
    edit = torch.randint(0, 256, (2, 3, size, size), generator=g).float() / 255
    question = "Was '{prompt}' done? Answer yes or no."
    prompts = ["make it red", "add a cat"]
    judge = load_reward("image_vlm_judge", path=repo_id, questions=[question], show_source=False)
    got = judge(RewardBatch(prompts=prompts, outputs={"images": edit}))
    folder = snap(offline, repo_id)
    proc = AutoProcessor.from_pretrained(folder)
    model = AutoModelForImageTextToText.from_pretrained(folder).eval()
    yes, no = judge.judge.yes_ids, judge.judge.no_ids
    for i in range(2):
        content = [{"type": "image"}, {"type": "text", "text": question.format(prompt=prompts[i])}]
        chat = proc.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        )
        enc = proc(text=[chat], images=[pil(edit[i : i + 1])], return_tensors="pt")
        with torch.no_grad():
            last = model(**enc).logits[0, -1].float()
        pair = torch.cat([last[yes], last[no]]).log_softmax(0).exp()
        assert got[i].item() == pytest.approx(float(pair[: len(yes)].sum()), abs=1e-5)
    assert type(model).__name__ == type(judge.judge.model).__name__


def test_video_vlm_judge_by_id_equals_its_snapshot_folder(offline: Path) -> None:
    g = torch.Generator().manual_seed(6)
    videos = torch.randint(0, 256, (1, 2, 3, 56, 56), generator=g).float() / 255
    b = RewardBatch(prompts=["make it red"], outputs={"videos": videos})
    by_id = load_reward("vlm_judge", path=QWEN2_VL, questions="Is it {prompt}? yes or no", frames=2)(b)
    by_folder = load_reward(
        "vlm_judge", path=str(snap(offline, QWEN2_VL)), questions="Is it {prompt}? yes or no", frames=2
    )(b)
    assert torch.equal(by_id, by_folder) and 0 <= by_id.item() <= 1


# =========================================================================== configs and the preflight
def test_preflight_checks_every_id_of_a_reward(offline: Path, tmp_path: Path) -> None:
    """The preflight (before any model loads) passes a config whose rewards name cached ids (model, processor,
    hub file) and names the key of one that is not cached."""
    from mmalign.app import preflight
    from mmalign.config import ConfigError, config_from_dict

    policy = tmp_path / "policy"
    policy.mkdir()

    def cfg(aesthetic_file: str) -> Any:
        rewards = [
            {"name": "preference", "kwargs": {"path": PICKSCORE_MODEL, "processor": PICKSCORE_PROCESSOR}},
            {
                "name": "aesthetic",
                "kwargs": {"path": CLIP_L, "mlp_path": AESTHETIC_REPO, "mlp_file": aesthetic_file},
            },
        ]
        data = {
            "pipeline": "text_to_image",
            "output_dir": str(tmp_path / "run"),
            "model": {"name_or_path": str(policy)},
        }
        return config_from_dict({**data, "rewards": rewards}, source="conf.yaml")

    preflight.check_model_paths(cfg(AESTHETIC_FILE))
    with pytest.raises(ConfigError, match=r"rewards\[1\]\.kwargs\.mlp_path"):
        preflight.check_model_paths(cfg("other.pth"))


def test_the_real_video_edit_config_names_pickscore_by_its_two_ids(offline: Path, tmp_path: Path) -> None:
    """configs/video_edit.yaml passes the preflight offline on this cache (the policy swapped for a local
    folder): its CLIP and PickScore ids, the processor's included, are all checked; without PickScore's
    processor in the cache the error names that key."""
    from mmalign.app import preflight
    from mmalign.config import ConfigError, load_config

    root = Path(__file__).resolve().parents[2]
    assert "models/pickscore" not in (root / "configs" / "text_to_image.yaml").read_text()
    policy = tmp_path / "policy"
    policy.mkdir()
    cfg = load_config(root / "configs" / "video_edit.yaml", [f"model.name_or_path={policy}"])
    spec = cfg.rewards[2]
    assert spec.name == "video_preference"
    assert (spec.kwargs["path"], spec.kwargs["processor"]) == (PICKSCORE_MODEL, PICKSCORE_PROCESSOR)
    preflight.check_model_paths(cfg, eval_rewards=True)
    laion = offline / f"models--{PICKSCORE_PROCESSOR.replace('/', '--')}"
    laion.rename(tmp_path / "moved")
    try:
        with pytest.raises(ConfigError, match=r"rewards\[2\]\.kwargs\.processor"):
            preflight.check_model_paths(cfg)
    finally:
        (tmp_path / "moved").rename(laion)


def test_by_id_in_a_fresh_process_with_only_the_environment(offline: Path) -> None:
    """What a user runs: a new process with ``HF_HUB_CACHE`` and ``HF_HUB_OFFLINE=1`` set, nothing patched."""
    images = uint8_images(2, seed=7)
    in_process = load_reward("preference", path=PICKSCORE_MODEL, processor=PICKSCORE_PROCESSOR)(
        batch(images, PROMPTS)
    )
    code = (
        "import json, sys, torch\n"
        "from rewards import RewardBatch, load_reward\n"
        "images = torch.tensor(json.loads(sys.stdin.read()))\n"
        f"r = load_reward('preference', path={PICKSCORE_MODEL!r}, processor={PICKSCORE_PROCESSOR!r})\n"
        f"print(json.dumps(r(RewardBatch(prompts={PROMPTS!r}, outputs={{'images': images}})).tolist()))\n"
    )
    env = {**os.environ, "HF_HUB_CACHE": str(offline), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("HF_HOME", None)
    out = subprocess.run(
        [sys.executable, "-c", code],
        input=json.dumps(images.tolist()),
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert torch.allclose(
        torch.tensor(json.loads(out.stdout.strip().splitlines()[-1])), in_process, atol=1e-5
    )
