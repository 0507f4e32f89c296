"""Image rewards (rewards/image.py; the shapes world's in mmalign/tiny/world_rewards.py): JPEG size, the shapes world,
CLIP score, aesthetic MLP, preference.

Every model here is tiny, built from config kwargs and saved to tmp_path: nothing is downloaded.
"""

from __future__ import annotations

import io
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

import rewards
from mmalign.tiny.world import PALETTE, render_scene
from rewards import RewardBatch, RewardSet, load_reward
from rewards.image import (
    CLIPEmbedder,
    aesthetic_mlp,
    colour_mask,
    connected_components,
    jpeg_size_kb,
    to_pil,
)


def image_batch(images: torch.Tensor, prompts: list[str] | None = None, **columns: list[Any]) -> RewardBatch:
    n = images.shape[0]
    return RewardBatch(prompts=prompts or [""] * n, outputs={"images": images}, columns=dict(columns))


def test_registered_with_summaries() -> None:
    for name in (
        "jpeg_compressibility",
        "jpeg_incompressibility",
        "saturation",
        "shapes_compositional",
        "shapes_layout",
        "clip_score",
        "aesthetic",
        "preference",
    ):
        cls = rewards.resolve(name)  # the shapes-world ones through their entry points (mmalign.tiny)
        assert cls.name == name and "images" in cls.needs
        doc = (cls.__doc__ or "").strip()
        assert doc and "\n" not in doc.splitlines()[0] and len(doc.splitlines()[0]) > 10
    assert rewards.get("clip_score").needs == {"images", "prompts"}


SHAPES_WORLD_REWARDS = ("shapes_compositional", "shapes_layout", "shapes_edit_accuracy", "colour_present")


def test_shapes_world_rewards_load_through_their_entry_points(tmp_path: Path) -> None:
    """The shapes-world rewards live with their fixtures (`mmalign.tiny.world_rewards`): a fresh interpreter
    that imports ``rewards`` has none of them registered and no `mmalign.tiny` module loaded, and looking one up
    by name imports it through its ``mmalign.rewards`` entry point (pyproject.toml)."""
    declared = {ep.name: ep.value for ep in entry_points(group=rewards.ENTRY_POINT_GROUP)}
    assert {n: declared.get(n) for n in SHAPES_WORLD_REWARDS} == dict.fromkeys(
        SHAPES_WORLD_REWARDS, "mmalign.tiny.world_rewards"
    ), "reinstall the package (pip install -e . --no-deps) to register the entry points"
    code = f"""
import sys
import rewards
names = {SHAPES_WORLD_REWARDS!r}
assert not [m for m in sys.modules if m.startswith("mmalign.tiny")], "import rewards imported mmalign.tiny"
assert not set(names) & set(rewards.names()), "registered before any lookup"
for name in names:
    reward = rewards.load_reward(name, **({{"colour": "red"}} if name == "colour_present" else {{}}))
    assert type(reward).__module__ == "mmalign.tiny.world_rewards", (name, type(reward))
print("looked up", len(names))
"""
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert "looked up 4" in out.stdout


# =========================================================================== saturation
class TestSaturation:
    def test_hand_worked(self) -> None:
        # HSV saturation (max - min) / max per pixel: (1, .5, .5) -> .5, black -> 0, white -> 0,
        # (.2, .1, 0) -> 1; mean .375. A pure red image: 1; a grey one: 0.
        img = torch.tensor([[[1.0, 0.0], [1.0, 0.2]], [[0.5, 0.0], [1.0, 0.1]], [[0.5, 0.0], [1.0, 0.0]]])
        red = torch.zeros(3, 2, 2)
        red[0] = 1.0
        grey = torch.full((3, 2, 2), 0.4)
        r = load_reward("saturation")(image_batch(torch.stack([img, red, grey])))
        assert r.tolist() == pytest.approx([0.375, 1.0, 0.0])
        scaled = load_reward("saturation", scale=2.0)(image_batch(img[None]))
        assert scaled.tolist() == pytest.approx([0.75])

    def test_matches_pil_hsv(self) -> None:
        """PIL's own RGB -> HSV conversion (S in 0..255) on a random uint8 image: the same mean saturation."""
        g = torch.Generator().manual_seed(3)
        img = (torch.rand(3, 9, 7, generator=g) * 255).round() / 255
        pil_s = torch.tensor(list(to_pil(img).convert("HSV").getdata()), dtype=torch.float64)[:, 1] / 255
        r = load_reward("saturation")(image_batch(img[None]))
        assert float(r[0]) == pytest.approx(float(pil_s.mean()), abs=2.5e-3)  # PIL rounds S to 8 bits

    def test_needs_images_and_a_finite_scale(self) -> None:
        with pytest.raises(ValueError, match="scale"):
            load_reward("saturation", scale=float("nan"))
        with pytest.raises(KeyError, match=r"needs outputs\['images'\]"):
            load_reward("saturation")(RewardBatch(prompts=["a"], outputs={}, columns={}))


# =========================================================================== JPEG
class TestJpeg:
    def test_flat_more_compressible_than_noise(self) -> None:
        g = torch.Generator().manual_seed(0)
        flat = torch.full((3, 64, 64), 0.5)
        noise = torch.rand(3, 64, 64, generator=g)
        batch = image_batch(torch.stack([flat, noise]))
        comp = load_reward("jpeg_compressibility")(batch)
        incomp = load_reward("jpeg_incompressibility")(batch)
        assert comp[0] > comp[1] and incomp[1] > incomp[0]
        assert torch.allclose(comp, -incomp)

    def test_sizes_match_pil(self) -> None:
        g = torch.Generator().manual_seed(1)
        images = torch.rand(3, 3, 40, 48, generator=g)
        for quality in (95, 50):
            expected = []
            for img in images:
                arr = (img * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
                buf = io.BytesIO()
                Image.fromarray(arr).save(buf, format="JPEG", quality=quality)
                expected.append(len(buf.getvalue()) / 1000)
            r = load_reward("jpeg_incompressibility", quality=quality, scale=2.0)(image_batch(images))
            assert r.dtype == torch.float32 and r.shape == (3,)
            assert torch.allclose(r, 2.0 * torch.tensor(expected), atol=1e-4)
            assert jpeg_size_kb(images[0], quality) == pytest.approx(expected[0])

    def test_options_and_errors(self) -> None:
        with pytest.raises(TypeError, match="jpeg_compressibility.*unknown option.*'qualty'"):
            load_reward("jpeg_compressibility", qualty=3)
        with pytest.raises(ValueError, match="quality"):
            load_reward("jpeg_compressibility", quality=0)
        with pytest.raises(KeyError, match="outputs\\['images'\\]"):
            load_reward("jpeg_compressibility")(RewardBatch(prompts=["a"], outputs={"texts": ["x"]}))

    def test_in_reward_set_under_no_grad(self) -> None:
        rs = RewardSet(["jpeg_compressibility", {"name": "jpeg_incompressibility", "weight": 0.5}])
        assert rs.needs == {"images"}
        out = rs(image_batch(torch.rand(2, 3, 16, 16)))
        assert out.shape == (2, 2) and torch.isfinite(out).all()

    def test_to_pil_clamps(self) -> None:
        img = torch.tensor([-1.0, 0.5, 2.0]).view(3, 1, 1).expand(3, 2, 2)
        assert to_pil(img).getpixel((0, 0)) == (0, 128, 255)


# =========================================================================== shapes world
SCENES = [
    ("red", 1, "left"),
    ("blue", 3, "top"),
    ("green", 4, "center"),
    ("yellow", 2, None),
    ("red", 5, "bottom"),
    ("blue", 2, "right"),
    ("green", 9, None),
]


def scenes_batch(scenes: list[tuple[str, int, str | None]], size: int = 64, **kw: Any) -> RewardBatch:
    images = torch.stack([render_scene(c, n, p, size, **kw) for c, n, p in scenes])
    return image_batch(
        images,
        colour=[c for c, _, _ in scenes],
        count=[n for _, n, _ in scenes],
        position=[p for _, _, p in scenes],
    )


class TestShapes:
    def test_rendered_scenes_score_one(self) -> None:
        r = load_reward("shapes_compositional")
        assert r.needs == {"images"}
        assert r(scenes_batch(SCENES)).tolist() == [1.0] * len(SCENES)
        assert r(scenes_batch(SCENES, size=96, shape="circle")).tolist() == [1.0] * len(SCENES)

    def test_render_scene(self) -> None:
        img = render_scene("red", 2, "left", 32)
        assert img.shape == (3, 32, 32) and img.min() >= 0 and img.max() <= 1
        assert render_scene("red", as_pil=True).size == (64, 64)
        assert (render_scene("blue", 0) == 1).all()  # white background only
        with pytest.raises(ValueError, match="unknown colour 'purple'"):
            render_scene("purple")
        with pytest.raises(ValueError, match="unknown position"):
            render_scene("red", 1, "middle")

    def test_wrong_scenes_score_lower(self) -> None:
        images = scenes_batch(SCENES).outputs["images"][:5]
        batch = image_batch(
            images,
            colour=["blue", "blue", "green", "yellow", "red"],  # row 0: wrong colour -> nothing right
            count=[1, 2, 4, 2, 5],  # row 1: wrong count
            position=["left", "top", "left", "left", "top"],  # rows 2-4: wrong position
        )
        r = load_reward("shapes_compositional")(batch)
        assert torch.allclose(r, torch.tensor([0.0, 2 / 3, 2 / 3, 2 / 3, 2 / 3]))
        weighted = load_reward("shapes_compositional", weights={"position": 2.0})(batch)
        assert torch.allclose(weighted, torch.tensor([0.0, 3 / 4, 2 / 4, 2 / 4, 2 / 4]))

    def test_hand_constructed(self) -> None:
        white = torch.ones(3, 30, 30)
        red = torch.tensor(PALETTE["red"]).float().view(3, 1, 1) / 255
        a = white.clone()
        a[:, 2:6, 2:6] = red  # two red blobs on the left, touching only diagonally -> two 4-components
        a[:, 6:10, 6:10] = red
        a[:, 20:22, 2:4] = red  # a 4-pixel blob, counted
        a[:, 25:26, 25:26] = red  # a single pixel: below min_pixels, ignored
        b = white.clone()
        # near red (within the threshold), on the right
        b[:, 12:18, 24:30] = torch.tensor([0.95, 0.05, 0.05]).view(3, 1, 1)
        images = torch.stack([a, b])
        mask = colour_mask(images, PALETTE["red"])
        with pytest.raises(TypeError, match="RGB triple"):  # names are the shapes world's palette_mask
            colour_mask(images, "red")
        _, counts = connected_components(mask, min_pixels=1)
        assert counts == [4, 1]
        labels, counts = connected_components(mask, min_pixels=4)
        assert counts == [3, 1] and (labels[0, 25, 25] == -1)
        batch = image_batch(images, colour=["red", "red"], count=[3, 1], position=["left", "right"])
        assert load_reward("shapes_compositional")(batch).tolist() == [1.0, 1.0]
        batch = image_batch(images, colour=["red", "red"], count=[3, 1], position=["right", "center"])
        assert load_reward("shapes_compositional")(batch).tolist() == pytest.approx([2 / 3, 2 / 3])
        # a stricter threshold no longer sees the off-palette square
        strict = load_reward("shapes_compositional", threshold=0.05)(batch)
        assert strict[1] == 0.0

    def test_layout_ignores_colour_but_not_the_scene(self) -> None:
        # rows ask for red; the images show blue (recoloured), red, nothing, and a wrong layout
        blue_left = render_scene("blue", 2, "left", size=32)
        red_left = render_scene("red", 2, "left", size=32)
        blank = torch.ones(3, 32, 32)
        one_right = render_scene("green", 1, "right", size=32)
        images = torch.stack([blue_left, red_left, blank, one_right])
        batch = image_batch(images, colour=["red"] * 4, count=[2] * 4, position=["left"] * 4)
        layout = load_reward("shapes_layout")(batch).tolist()
        # hand-worked: checks (present, count, position) -> 3/3, 3/3, 0/3, 1/3 (present only)
        assert layout == pytest.approx([1.0, 1.0, 0.0, 1 / 3])
        # the colour-aware reward fails the recoloured scene on all three checks
        assert load_reward("shapes_compositional")(batch).tolist()[0] == 0.0

    def test_components_long_snake(self) -> None:
        m = torch.zeros(1, 9, 9, dtype=torch.bool)
        m[0, 0, :] = m[0, 2, :] = m[0, 4, :] = m[0, 6, :] = m[0, 8, :] = True
        m[0, 1, 8] = m[0, 3, 0] = m[0, 5, 8] = m[0, 7, 0] = True  # a serpentine: one component
        labels, counts = connected_components(m)
        assert counts == [1] and labels[0][m[0]].unique().numel() == 1
        m[0, 7, 0] = False
        assert connected_components(m)[1] == [2]

    def test_optional_columns_and_missing(self) -> None:
        img = render_scene("green", 2, "right").unsqueeze(0).expand(4, -1, -1, -1)
        batch = image_batch(img, colour=["green", "green", None, "green"], count=[None, 3, 1, 0])
        r = load_reward("shapes_compositional")(batch)  # no position column at all
        assert r[0] == 1.0 and r[1] == 0.5 and torch.isnan(r[2]) and r[3] == 0.0
        with pytest.raises(KeyError, match="colour column 'color'"):
            load_reward("shapes_compositional", colour_column="color")(batch)
        with pytest.raises(ValueError, match="unknown weight key"):
            load_reward("shapes_compositional", weights={"size": 1})
        with pytest.raises(ValueError, match="unknown colour 'purple'"):
            load_reward("shapes_compositional")(image_batch(img[:1], colour=["purple"]))


# =========================================================================== CLIP
TEXTS = ["a red square on the left", "two blue circles", "a green thing", "yellow", "a photo of a cat"]


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import CLIPConfig, CLIPModel

    from mmalign.tiny import train_bpe_tokenizer

    tok = train_bpe_tokenizer(TEXTS * 4, vocab_size=300)
    torch.manual_seed(0)
    config = CLIPConfig(
        text_config=dict(
            vocab_size=len(tok),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=32,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        ),
        vision_config=dict(
            image_size=32,
            patch_size=8,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
        ),
        projection_dim=16,
    )
    model = CLIPModel(config)
    path = tmp_path_factory.mktemp("clip") / "tiny-clip"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def manual_embeddings(
    path: Path, images: torch.Tensor, texts: list[str]
) -> tuple[torch.Tensor, torch.Tensor, Any]:
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
    return torch.nn.functional.normalize(im, dim=-1), torch.nn.functional.normalize(tx, dim=-1), model


class TestClip:
    def test_clip_score_matches_manual(self, tiny_clip: Path) -> None:
        g = torch.Generator().manual_seed(0)
        images = torch.rand(4, 3, 32, 32, generator=g)  # already the model's size: no resize
        texts = TEXTS[:4]
        im, tx, _ = manual_embeddings(tiny_clip, images, texts)
        cos = (im * tx).sum(-1)
        r = load_reward("clip_score", path=str(tiny_clip), batch_size=3)
        assert r.needs == {"images", "prompts"}
        out = r(image_batch(images, prompts=texts))
        assert out.shape == (4,) and torch.allclose(out, 100 * cos, atol=1e-4)
        raw = load_reward("clip_score", path=str(tiny_clip), raw=True)(image_batch(images, prompts=texts))
        assert torch.allclose(raw, cos, atol=1e-6)
        clamped = load_reward("clip_score", path=str(tiny_clip), raw=True, clamp=True)(
            image_batch(images, prompts=texts)
        )
        assert torch.allclose(clamped, cos.clamp_min(0), atol=1e-6)
        by_column = load_reward("clip_score", path=str(tiny_clip), text_column="caption")(
            image_batch(images, prompts=["x"] * 4, caption=texts)
        )
        assert torch.allclose(by_column, out, atol=1e-5)

    def test_resize_and_batching(self, tiny_clip: Path) -> None:
        clip = CLIPEmbedder(tiny_clip)
        assert clip.image_size == (32, 32)
        images = torch.rand(3, 3, 48, 64)
        x = clip.preprocess(images)
        assert x.shape == (3, 3, 32, 32)
        e = clip.encode_images(images)
        assert torch.allclose(e.norm(dim=-1), torch.ones(3), atol=1e-5)
        assert torch.allclose(clip.encode_images(images[1:2]), e[1:2], atol=1e-5)

    def test_image_processor_statistics(self, tiny_clip: Path, tmp_path: Path) -> None:
        import shutil

        from transformers import CLIPImageProcessor

        folder = tmp_path / "with-processor"
        shutil.copytree(tiny_clip, folder)
        CLIPImageProcessor(image_mean=[0.5, 0.5, 0.5], image_std=[0.25, 0.25, 0.25]).save_pretrained(folder)
        clip = CLIPEmbedder(folder)
        x = torch.full((1, 3, 32, 32), 0.75)
        assert torch.allclose(clip.preprocess(x), torch.ones(1, 3, 32, 32))

    def test_missing_path_names_it(self, tmp_path: Path) -> None:
        missing = tmp_path / "no-such-clip"
        with pytest.raises(FileNotFoundError, match=str(missing)):
            load_reward("clip_score", path=str(missing))
        with pytest.raises(FileNotFoundError, match="no-such.pt"):
            load_reward("clip_score", path=str(tmp_path / "no-such.pt"), backend="open_clip", arch="ViT-B-32")
        with pytest.raises(TypeError, match="'clip_score' needs the option\\(s\\) 'path'"):
            load_reward("clip_score")
        with pytest.raises(ValueError, match="backend"):
            load_reward("clip_score", path=str(tmp_path), backend="onnx")

    def test_preference(self, tiny_clip: Path) -> None:
        images = torch.rand(2, 3, 32, 32)
        texts = TEXTS[:2]
        im, tx, model = manual_embeddings(tiny_clip, images, texts)
        out = load_reward("preference", path=str(tiny_clip))(image_batch(images, prompts=texts))
        expected = model.logit_scale.exp() * (im * tx).sum(-1)
        assert torch.allclose(out, expected, atol=1e-4)


@pytest.fixture(scope="module")
def tiny_open_clip(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    import json

    import open_clip

    d = tmp_path_factory.mktemp("open_clip")
    arch = "mmalign-test-tiny-clip"
    cfg = {
        "embed_dim": 16,
        "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "patch_size": 8, "head_width": 16},
        "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
    }
    (d / f"{arch}.json").write_text(json.dumps(cfg))
    open_clip.add_model_config(d)
    torch.manual_seed(0)
    model = open_clip.create_model(arch)
    ckpt = d / "tiny.pt"
    torch.save(model.state_dict(), ckpt)
    return arch, ckpt


def test_open_clip_backend_matches_manual(tiny_open_clip: tuple[str, Path]) -> None:
    import open_clip

    arch, ckpt = tiny_open_clip
    model, _, _ = open_clip.create_model_and_transforms(arch, pretrained=str(ckpt))
    model.eval()
    images = torch.rand(2, 3, 32, 32)
    texts = TEXTS[:2]
    mean = torch.tensor(open_clip.OPENAI_DATASET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(open_clip.OPENAI_DATASET_STD).view(1, 3, 1, 1)
    with torch.no_grad():
        im = torch.nn.functional.normalize(model.encode_image((images - mean) / std), dim=-1)
        tx = torch.nn.functional.normalize(model.encode_text(open_clip.get_tokenizer(arch)(texts)), dim=-1)
    r = load_reward("clip_score", path=str(ckpt), backend="open_clip", arch=arch, raw=True)
    assert torch.allclose(r(image_batch(images, prompts=texts)), (im * tx).sum(-1), atol=1e-5)
    with pytest.raises(ValueError, match="needs `arch`"):
        load_reward("clip_score", path=str(ckpt), backend="open_clip")


class TestAesthetic:
    @pytest.mark.parametrize("fmt", ["pt", "safetensors", "laion"])
    def test_matches_manual_mlp(self, tiny_clip: Path, tmp_path: Path, fmt: str) -> None:
        torch.manual_seed(3)
        mlp = aesthetic_mlp(16, (8, 4)).eval()
        state = mlp.state_dict()
        if fmt == "safetensors":
            from safetensors.torch import save_file

            weights = tmp_path / "mlp.safetensors"
            save_file(state, str(weights))
        else:
            weights = tmp_path / "mlp.pt"
            if fmt == "laion":
                state = {f"layers.{k}": v for k, v in state.items()}
            torch.save(state, weights)
        images = torch.rand(3, 3, 32, 32)
        r = load_reward("aesthetic", mlp_path=str(weights), path=str(tiny_clip), hidden=[8, 4], scale=2.0)
        assert r.needs == {"images"}
        im, _, _ = manual_embeddings(tiny_clip, images, ["x"])
        with torch.no_grad():
            expected = 2.0 * mlp(im).squeeze(-1)
        assert torch.allclose(r(image_batch(images)), expected, atol=1e-5)

    def test_laion_layout(self) -> None:
        keys = set(aesthetic_mlp(768).state_dict())
        assert {"0.weight", "2.weight", "4.weight", "6.weight", "7.weight", "7.bias"} <= keys

    def test_errors(self, tiny_clip: Path, tmp_path: Path) -> None:
        missing = tmp_path / "nope" / "aesthetic.pt"
        with pytest.raises(FileNotFoundError, match=str(missing)):
            load_reward("aesthetic", mlp_path=str(missing), path=str(tiny_clip))
        weights = tmp_path / "mlp.pt"
        torch.save(aesthetic_mlp(16, (8,)).state_dict(), weights)
        with pytest.raises(ValueError, match="set `hidden`"):
            load_reward("aesthetic", mlp_path=str(weights), path=str(tiny_clip), hidden=[8, 4])
