"""Safety rewards (rewards/safety.py) and the tiny shapes-world CLIP (mmalign/tiny/clip.py).

Formula checks use a randomly initialised tiny CLIP and compare against embeddings computed by hand
with transformers; the behaviour checks (colour recognition, steering away from red) use the tiny
CLIP trained once per module by the ``clip_shapes_tiny`` builder. Nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import rewards
from mmalign.tiny import clip as tiny_clip
from mmalign.tiny.shapes import shapes_caption
from mmalign.tiny.world import PALETTE, render_scene
from rewards import RewardBatch, RewardSet, load_reward
from rewards.image import CLIPEmbedder
from rewards.safety import steering_direction

COLOURS = ("red", "green", "blue", "yellow")
SAFE = ["a green square", "a blue square", "a yellow square"]
UNSAFE = ["a red square"]


def image_batch(images: torch.Tensor, prompts: list[str] | None = None, **columns: list[Any]) -> RewardBatch:
    n = images.shape[0]
    return RewardBatch(prompts=prompts or [""] * n, outputs={"images": images}, columns=dict(columns))


def split_point(x: torch.Tensor) -> float:
    """A cut halfway between the two middle values of `x`: about half above it, none within rounding of it."""
    v = x.sort().values
    return float(v[len(v) // 2 - 1] + v[len(v) // 2]) / 2


def scenes(spec: list[tuple[str, int, str | None]], size: int = 32) -> torch.Tensor:
    return torch.stack([render_scene(c, k, p, size=size) for c, k, p in spec])  # type: ignore[misc]


@pytest.fixture(scope="module")
def random_clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny CLIP with random weights, saved like the trained one (byte tokenizer, image processor)."""
    model, tok = tiny_clip.tiny_clip_model(hidden=32, projection_dim=16, seed=3)
    return tiny_clip.save_clip_folder(model, tok, tmp_path_factory.mktemp("clip") / "random-clip")


@pytest.fixture(scope="module")
def trained_clip(shapes_clip_dir: Path) -> Path:
    """The tiny CLIP trained on the shapes world, built through the tiny-builder registry (conftest)."""
    return shapes_clip_dir


def by_hand(path: Path, images: torch.Tensor, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalised image / text embeddings straight from transformers (images already 32 px)."""
    from transformers import AutoTokenizer, CLIPModel

    model = CLIPModel.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    mean = torch.tensor([0.48145466, 0.4578275, 0.40821073]).view(1, 3, 1, 1)
    std = torch.tensor([0.26862954, 0.26130258, 0.27577711]).view(1, 3, 1, 1)
    with torch.no_grad():
        im = model.get_image_features(pixel_values=(images - mean) / std)
        ids = tok(texts, padding=True, return_tensors="pt")
        tx = model.get_text_features(input_ids=ids["input_ids"], attention_mask=ids["attention_mask"])
    im = im if isinstance(im, torch.Tensor) else im.pooler_output
    tx = tx if isinstance(tx, torch.Tensor) else tx.pooler_output
    return torch.nn.functional.normalize(im, dim=-1), torch.nn.functional.normalize(tx, dim=-1)


# =========================================================================== registry
def test_registered_with_summaries() -> None:
    for name, needs in (
        ("clip_steering", {"images", "prompts"}),
        ("clip_concept_flag", {"images"}),
        ("colour_present", {"images"}),  # through its entry point (mmalign.tiny.world_rewards)
        ("classifier_flag", {"images"}),
    ):
        cls = rewards.resolve(name)
        assert name in rewards.names()
        assert cls.name == name and cls.needs == needs
        doc = (cls.__doc__ or "").strip()
        assert doc and len(doc.splitlines()[0]) > 10


def test_tiny_builder_registered() -> None:
    from mmalign.tiny import BUILDERS

    assert "clip_shapes_tiny" in BUILDERS.names()


# =========================================================================== clip_steering
class TestSteeringFormula:
    def test_matches_independent_computation(self, random_clip: Path) -> None:
        g = torch.Generator().manual_seed(0)
        images = torch.rand(5, 3, 32, 32, generator=g)
        prompts = ["one red square on the left", "two blue squares", "one red square on the left", "x", "x"]
        safe, unsafe = ["a green square", "a blue square"], ["a red square", "red"]
        im, tx = by_hand(random_clip, images, prompts + safe + unsafe)
        zp, zs, zu = tx[:5], tx[5:7], tx[7:]
        v = torch.nn.functional.normalize(zs.mean(0) - zu.mean(0), dim=0)
        for alpha in (0.5, 1.7):
            target = torch.nn.functional.normalize(zp + alpha * v, dim=-1)
            expected = (im * target).sum(-1)
            r = load_reward(
                "clip_steering",
                path=str(random_clip),
                safe_anchors=safe,
                unsafe_anchors=unsafe,
                alpha=alpha,
                batch_size=2,
            )
            assert torch.allclose(r.v_safe, v, atol=1e-5)
            out = r(image_batch(images, prompts=prompts))
            assert out.shape == (5,) and out.dtype == torch.float32
            assert torch.allclose(out, expected, atol=1e-5)
        assert r.alpha == 1.7 and r.needs == {"images", "prompts"}

    def test_default_alpha_prompt_column_and_alpha_zero(self, random_clip: Path) -> None:
        images = torch.rand(3, 3, 32, 32)
        prompts = ["a", "b", "c"]
        captions = ["one red square on the left", "red", "two green squares at the top"]
        r = load_reward("clip_steering", path=str(random_clip), safe_anchors=SAFE, unsafe_anchors=UNSAFE)
        assert r.alpha == 0.5
        by_column = load_reward(
            "clip_steering",
            path=str(random_clip),
            safe_anchors=SAFE,
            unsafe_anchors=UNSAFE,
            prompt_column="caption",
        )(image_batch(images, prompts=prompts, caption=captions))
        assert torch.allclose(by_column, r(image_batch(images, prompts=captions)), atol=1e-6)
        # alpha = 0: plain CLIP cosine, the clip_score reward with raw=True
        plain = load_reward(
            "clip_steering", path=str(random_clip), safe_anchors=SAFE, unsafe_anchors=UNSAFE, alpha=0.0
        )(image_batch(images, prompts=captions))
        cos = load_reward("clip_score", path=str(random_clip), raw=True)(
            image_batch(images, prompts=captions)
        )
        assert torch.allclose(plain, cos, atol=1e-6)
        # images at another size go through the embedder's resize, in a RewardSet under no_grad
        rs = RewardSet(
            [
                {
                    "name": "clip_steering",
                    "kwargs": {"path": str(random_clip), "safe_anchors": SAFE, "unsafe_anchors": UNSAFE},
                }
            ]
        )
        out = rs(image_batch(torch.rand(2, 3, 48, 40), prompts=captions[:2]))
        assert out.shape == (2, 1) and torch.isfinite(out).all()

    def test_steering_direction(self) -> None:
        safe = torch.nn.functional.normalize(torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]), dim=-1)
        unsafe = torch.tensor([[0.0, 0.0, 1.0]])
        v = steering_direction(safe, unsafe)
        assert torch.allclose(v, torch.tensor([0.5, 0.5, -1.0]) / 1.5**0.5)
        with pytest.raises(ValueError, match="same mean"):
            steering_direction(unsafe, unsafe)

    def test_errors(self, random_clip: Path, tmp_path: Path) -> None:
        path = str(random_clip)
        with pytest.raises(TypeError, match="'clip_steering' needs the option\\(s\\) 'safe_anchors'"):
            load_reward("clip_steering", path=path, unsafe_anchors=UNSAFE)
        with pytest.raises(TypeError, match="'clip_steering' needs the option\\(s\\) 'unsafe_anchors'"):
            load_reward("clip_steering", path=path, safe_anchors=SAFE)
        with pytest.raises(
            ValueError, match="reward 'clip_steering': option `safe_anchors` must be a non-empty list"
        ):
            load_reward("clip_steering", path=path, safe_anchors=[], unsafe_anchors=UNSAFE)
        with pytest.raises(ValueError, match="option 'unsafe_anchors' must be list, got str 'a red square'"):
            load_reward("clip_steering", path=path, safe_anchors=SAFE, unsafe_anchors="a red square")
        with pytest.raises(ValueError, match="`unsafe_anchors` must hold non-empty strings"):
            load_reward("clip_steering", path=path, safe_anchors=SAFE, unsafe_anchors=["red", ""])
        with pytest.raises(ValueError, match="'clip_steering'.*same mean"):
            load_reward("clip_steering", path=path, safe_anchors=UNSAFE, unsafe_anchors=UNSAFE)
        missing = tmp_path / "no-such-clip"
        with pytest.raises(FileNotFoundError, match=str(missing)):
            load_reward("clip_steering", path=str(missing), safe_anchors=SAFE, unsafe_anchors=UNSAFE)
        with pytest.raises(KeyError, match="text column 'caption'"):
            load_reward(
                "clip_steering", path=path, safe_anchors=SAFE, unsafe_anchors=UNSAFE, prompt_column="caption"
            )(image_batch(torch.rand(1, 3, 32, 32)))


# =========================================================================== clip_concept_flag
class TestConceptFlagFormula:
    def test_margin_and_threshold_rules(self, random_clip: Path) -> None:
        g = torch.Generator().manual_seed(1)
        images = torch.rand(8, 3, 32, 32, generator=g)
        unsafe, safe = ["red", "a red square"], ["green", "blue", "a yellow object"]
        im, tx = by_hand(random_clip, images, unsafe + safe)
        su = (im @ tx[:2].T).amax(-1)
        ss = (im @ tx[2:].T).amax(-1)
        batch = image_batch(images)
        r = load_reward(
            "clip_concept_flag", path=str(random_clip), unsafe_concepts=unsafe, safe_concepts=safe
        )
        assert torch.allclose(r.scores(images), su - ss, atol=1e-5)
        assert torch.equal(r(batch), (su - ss > 0).float())
        margin = split_point(su - ss)  # about half the images flagged
        r = load_reward(
            "clip_concept_flag",
            path=str(random_clip),
            unsafe_concepts=unsafe,
            safe_concepts=safe,
            margin=margin,
        )
        assert torch.equal(r(batch), (su - ss > margin).float())
        threshold = split_point(su)
        r = load_reward(
            "clip_concept_flag", path=str(random_clip), unsafe_concepts=unsafe, threshold=threshold
        )
        out = r(batch)
        assert torch.equal(out, (su > threshold).float()) and 0 < out.sum() < 8

    def test_errors(self, random_clip: Path, tmp_path: Path) -> None:
        path = str(random_clip)
        with pytest.raises(
            ValueError, match="'clip_concept_flag': option `safe_concepts` must be a non-empty"
        ):
            load_reward("clip_concept_flag", path=path, unsafe_concepts=["red"])
        with pytest.raises(ValueError, match="either `safe_concepts`.*or `threshold`"):
            load_reward(
                "clip_concept_flag", path=path, unsafe_concepts=["red"], safe_concepts=["x"], threshold=0.2
            )
        with pytest.raises(ValueError, match="option `unsafe_concepts` must be a non-empty"):
            load_reward("clip_concept_flag", path=path, unsafe_concepts=[], threshold=0.2)
        missing = tmp_path / "nope"
        with pytest.raises(FileNotFoundError, match=str(missing)):
            load_reward("clip_concept_flag", path=str(missing), unsafe_concepts=["red"], threshold=0.2)


# =========================================================================== colour_present
class TestColourPresent:
    def test_rendered_scenes(self) -> None:
        spec = [
            ("red", 1, "left"),
            ("green", 1, "left"),
            ("red", 4, "center"),
            ("blue", 2, None),
            ("yellow", 3, "top"),
            ("red", 2, "bottom"),
        ]
        for size in (32, 64):
            batch = image_batch(scenes(spec, size))
            assert load_reward("colour_present", colour="red")(batch).tolist() == [
                1.0,
                0.0,
                1.0,
                0.0,
                0.0,
                1.0,
            ]
            assert load_reward("colour_present", colour="yellow")(batch).tolist() == [0, 0, 0, 0, 1.0, 0]
        blank = image_batch(torch.ones(1, 3, 32, 32))
        assert load_reward("colour_present", colour="red")(blank).tolist() == [0.0]

    def test_min_pixels_and_threshold(self) -> None:
        white = torch.ones(3, 20, 20)
        red = torch.tensor(PALETTE["red"]).float().view(3, 1, 1) / 255
        a = white.clone()
        a[:, 2:5, 2:5] = red  # a 3x3 blob: 9 pixels
        b = white.clone()
        b[:, 2:4, 2:4] = red  # 4 pixels ...
        b[:, 10:12, 10:12] = red  # ... twice, not connected
        c = white.clone()
        c[:, 5:10, 5:10] = torch.tensor([0.8, 0.25, 0.2]).view(3, 1, 1)  # off-palette red (distance ~0.24)
        batch = image_batch(torch.stack([a, b, c]))
        assert load_reward("colour_present", colour="red")(batch).tolist() == [1.0, 1.0, 1.0]
        assert load_reward("colour_present", colour="red", min_pixels=5)(batch).tolist() == [1.0, 0.0, 1.0]
        assert load_reward("colour_present", colour="red", min_pixels=10)(batch).tolist() == [0.0, 0.0, 1.0]
        assert load_reward("colour_present", colour="red", threshold=0.1)(batch).tolist() == [1.0, 1.0, 0.0]

    def test_errors_and_reward_set(self) -> None:
        with pytest.raises(ValueError, match="'colour_present': unknown colour 'purple'"):
            load_reward("colour_present", colour="purple")
        with pytest.raises(TypeError, match="'colour_present' needs the option\\(s\\) 'colour'"):
            load_reward("colour_present")
        rs = RewardSet([{"name": "colour_present", "kwargs": {"colour": "red"}, "alias": "red_share"}])
        out = rs(image_batch(scenes([("red", 1, "left"), ("blue", 1, "left")])))
        assert rs.names == ["red_share"] and out[:, 0].tolist() == [1.0, 0.0]
        assert rs.stats(out)["reward/red_share/mean"] == 0.5  # the share of flagged images


# =========================================================================== classifier_flag
@pytest.fixture(scope="module")
def tiny_classifier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor

    torch.manual_seed(0)
    config = ViTConfig(
        image_size=32,
        patch_size=8,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_labels=3,
        id2label={0: "normal", 1: "nsfw", 2: "gore"},
        label2id={"normal": 0, "nsfw": 1, "gore": 2},
    )
    model = ViTForImageClassification(config)
    with torch.no_grad():  # big enough weights that the probabilities differ from image to image
        model.classifier.weight.normal_(0, 2.0)
    path = tmp_path_factory.mktemp("classifier") / "tiny-vit"
    model.save_pretrained(path)
    ViTImageProcessor(
        size={"height": 32, "width": 32}, image_mean=[0.5] * 3, image_std=[0.5] * 3
    ).save_pretrained(path)
    return path


class TestClassifierFlag:
    def manual_probs(self, path: Path, images: torch.Tensor) -> torch.Tensor:
        from transformers import ViTForImageClassification

        model = ViTForImageClassification.from_pretrained(path).eval()
        pixels = ((images * 255).round() / 255 - 0.5) / 0.5  # what the processor does to the uint8 image
        with torch.no_grad():
            return model(pixel_values=pixels).logits.softmax(-1)

    def test_matches_manual(self, tiny_classifier: Path) -> None:
        images = torch.cat(
            [scenes([(c, k, "left") for c in COLOURS for k in (1, 2)]), torch.rand(4, 3, 32, 32)]
        )
        p = self.manual_probs(tiny_classifier, images)
        r = load_reward("classifier_flag", path=str(tiny_classifier), flag_labels=["nsfw"], batch_size=5)
        assert torch.allclose(r.probabilities(images), p, atol=1e-5)
        thr = split_point(p[:, 1])
        r = load_reward("classifier_flag", path=str(tiny_classifier), flag_labels=["nsfw"], threshold=thr)
        out = r(image_batch(images))
        assert torch.equal(out, (p[:, 1] >= thr).float()) and 0 < out.sum() < len(images)
        both = load_reward(
            "classifier_flag", path=str(tiny_classifier), flag_labels=["nsfw", "gore"], threshold=thr
        )(image_batch(images))
        assert torch.equal(both, (p[:, 1:].amax(-1) >= thr).float())

    def test_exact_flags_with_a_constant_classifier(self, tiny_classifier: Path, tmp_path: Path) -> None:
        from transformers import ViTForImageClassification

        model = ViTForImageClassification.from_pretrained(tiny_classifier)
        with torch.no_grad():
            model.classifier.weight.zero_()
            model.classifier.bias.copy_(torch.tensor([0.0, 1.0, -1.0]).log_softmax(0))
        path = tmp_path / "constant"
        model.save_pretrained(path)
        (path / "preprocessor_config.json").write_text(
            (tiny_classifier / "preprocessor_config.json").read_text()
        )
        images = scenes([("red", 1, "left"), ("blue", 2, None)])
        p_nsfw = float(torch.tensor([0.0, 1.0, -1.0]).softmax(0)[1])  # 0.665
        for thr, flag in ((0.5, 1.0), (p_nsfw - 1e-4, 1.0), (0.7, 0.0)):
            r = load_reward("classifier_flag", path=str(path), flag_labels=["nsfw"], threshold=thr)
            assert r(image_batch(images)).tolist() == [flag, flag]

    def test_errors(self, tiny_classifier: Path, tmp_path: Path) -> None:
        missing = tmp_path / "no-such-detector"
        with pytest.raises(FileNotFoundError, match=str(missing)):
            load_reward("classifier_flag", path=str(missing), flag_labels=["nsfw"])
        with pytest.raises(
            ValueError, match="flag_labels \\['porn'\\] are not labels.*'normal', 'nsfw', 'gore'"
        ):
            load_reward("classifier_flag", path=str(tiny_classifier), flag_labels=["porn"])
        with pytest.raises(
            ValueError, match="'classifier_flag': option 'flag_labels' must be list, got str 'nsfw'"
        ):
            load_reward("classifier_flag", path=str(tiny_classifier), flag_labels="nsfw")


# =========================================================================== the trained tiny CLIP
class TestTrainedTinyClip:
    def test_folder_loads_like_a_clip_id(self, trained_clip: Path) -> None:
        from transformers import AutoImageProcessor, CLIPModel

        assert CLIPModel.from_pretrained(trained_clip).config.vision_config.image_size == 32
        proc = AutoImageProcessor.from_pretrained(trained_clip)
        assert list(proc.image_mean) == pytest.approx(tiny_clip.OPENAI_MEAN)
        meta = json.loads((trained_clip / "mmalign_tiny.json").read_text())
        assert meta["builder"] == "clip_shapes_tiny" and meta["heldout"]

    def test_colour_accuracy_on_heldout_scenes(self, trained_clip: Path) -> None:
        meta = json.loads((trained_clip / "mmalign_tiny.json").read_text())
        heldout = [tuple(s) for s in meta["heldout"]]
        clip = CLIPEmbedder(trained_clip)
        assert tiny_clip.colour_accuracy(clip, heldout) >= 0.9
        assert tiny_clip.colour_accuracy(clip, heldout, full_captions=False) >= 0.9
        assert tiny_clip.colour_accuracy(clip, heldout, size=64) >= 0.9  # resized by the embedder

    def test_steering_prefers_non_red(self, trained_clip: Path) -> None:
        prompt = "one red square on the left"
        images = scenes([(c, 1, "left") for c in COLOURS])
        batch = image_batch(images, prompts=[prompt] * 4)
        plain = load_reward("clip_score", path=str(trained_clip), raw=True)(batch)
        assert plain.argmax() == 0  # CLIP alone prefers the red square, as the prompt asks
        r = load_reward("clip_steering", path=str(trained_clip), safe_anchors=SAFE, unsafe_anchors=UNSAFE)
        out = r(batch)
        assert (out[1:] > out[0]).all(), out.tolist()

    def test_concept_flag_on_rendered_scenes(self, trained_clip: Path) -> None:
        spec = [(c, k, p) for c in COLOURS for k, p in ((1, "left"), (2, "top"), (3, None), (4, "center"))]
        r = load_reward(
            "clip_concept_flag",
            path=str(trained_clip),
            unsafe_concepts=["red", "a red object"],
            safe_concepts=["green", "blue", "yellow"],
        )
        expected = [1.0 if c == "red" else 0.0 for c, _, _ in spec]
        assert r(image_batch(scenes(spec))).tolist() == expected
        assert load_reward("colour_present", colour="red")(image_batch(scenes(spec))).tolist() == expected


def test_scene_captions() -> None:
    caps = dict(tiny_clip.scene_captions("red", 1, "left"))
    assert caps[shapes_caption("red", 1, "left")] == ("red", 1, "left")
    assert caps["a red square"] == ("red", 1, None) and caps["red"] == ("red", None, None)
    assert tiny_clip.caption_matches(("red", None, "left"), ("red", 2, "left"))
    assert not tiny_clip.caption_matches(("red", None, "left"), ("red", 2, None))
    assert not tiny_clip.caption_matches(("red", 2, None), ("blue", 2, None))
    assert "a red square" not in dict(tiny_clip.scene_captions("red", 2, "left"))
