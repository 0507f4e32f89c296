"""Image-editing rewards (rewards/edit.py): CLIP directional similarity on constructed embeddings (hand-worked
cosines) and against a plain reference on the CLIP model itself; the VLM judge against the tiny Qwen2-VL called
directly on [source, edit]; PSNR / SSIM on hand-worked cases, against a NumPy formula and against scikit-image;
the edit region from a mask image or boxes; and the shapes-world edit accuracy on hand-worked scenes.

The CLIP is the shapes-world tiny CLIP (the shipped assets/models/clip_shapes-tiny, else conftest's build)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import rewards.edit  # noqa: F401  (registers the edit rewards)
from mmalign.data.media import save_image
from mmalign.tiny.image_edit import EditExample, Square, draw_scene, edit_examples, example_row, slot_box
from rewards import RewardBatch, load_reward
from rewards.edit import box_mask

ASSETS = Path(__file__).resolve().parents[2] / "assets" / "models"
EDIT_REWARDS = ("clip_directional", "image_vlm_judge", "image_psnr", "image_ssim", "shapes_edit_accuracy")


@pytest.fixture(scope="module")
def clip_path(request: pytest.FixtureRequest) -> Path:
    shipped = ASSETS / "clip_shapes-tiny"
    if (shipped / "config.json").exists():
        return shipped
    return request.getfixturevalue("shapes_clip_dir")


def batch(images: torch.Tensor, **kw: Any) -> RewardBatch:
    """outputs["images"] plus `kw` (tensors -> outputs, lists -> columns)."""
    outputs: dict[str, Any] = {"images": images}
    columns = {}
    for k, v in kw.items():
        (outputs if isinstance(v, torch.Tensor) else columns)[k] = v
    return RewardBatch(prompts=[""] * images.shape[0], outputs=outputs, columns=columns)


def example(edit: str, n_squares: int = 2) -> EditExample:
    return next(e for e in edit_examples() if e.edit == edit and len(e.source) == n_squares)


# =========================================================================== registry
def test_registered_with_summaries() -> None:
    import rewards

    for name in EDIT_REWARDS:
        rewards.resolve(name)  # shapes_edit_accuracy: through its entry point (mmalign.tiny.world_rewards)
        assert name in rewards.names(), name
        assert rewards.REGISTRY.describe(name), name


def test_box_mask_pixel_centres() -> None:
    m = box_mask([[1 / 32, 12 / 32, 9 / 32, 20 / 32]], 32, 32)
    want = torch.zeros(32, 32)
    want[12:20, 1:9] = 1
    assert torch.equal(m, want)
    # the same fractions at another resolution: centres inside [x0 W, x1 W)
    m64 = box_mask([[1 / 32, 12 / 32, 9 / 32, 20 / 32]], 64, 64)
    assert m64.sum() == 16 * 16 and m64[24, 2] == 1 and m64[24, 1] == 0
    wide = box_mask([[0.5, 0.5, 0.75, 0.75]], 8, 8, margin=1)
    assert wide.sum() == 4 * 4 and wide[3, 3] == 1 and wide[6, 6] == 1 and wide[7, 7] == 0


# =========================================================================== clip_directional
def test_clip_directional_matches_a_plain_reference(clip_path: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer, CLIPImageProcessor, CLIPModel

    ex = [example("recolour"), example("move"), example("recolour", 1)]
    sources = torch.stack([draw_scene(e.source) for e in ex])
    edits = torch.stack([draw_scene(e.target) for e in ex])
    edits[1] = edits[1] * 0.8 + 0.1  # an imperfect edit
    paths = []
    for i, s in enumerate(sources):
        paths.append(str(save_image(s, tmp_path / f"s{i}.png")))
    caps = [e.captions() for e in ex]
    reward = load_reward("clip_directional", path=str(clip_path))
    got = reward(
        batch(
            edits,
            source_image=paths,
            source_caption=[c[0] for c in caps],
            target_caption=[c[1] for c in caps],
        )
    )

    # reference: the CLIP model called directly, the formula written out with NumPy
    model = CLIPModel.from_pretrained(clip_path).eval()
    tok = AutoTokenizer.from_pretrained(clip_path)
    proc = CLIPImageProcessor.from_pretrained(clip_path)
    mean = torch.tensor(proc.image_mean).view(1, 3, 1, 1)
    std = torch.tensor(proc.image_std).view(1, 3, 1, 1)
    with torch.no_grad():

        def img(x: torch.Tensor) -> np.ndarray:  # 32 px images at the model's 32 px input: no resize
            f = model.get_image_features(pixel_values=(x - mean) / std)
            f = f if isinstance(f, torch.Tensor) else f.pooler_output
            return f.double().numpy()

        def txt(texts: list[str]) -> np.ndarray:
            t = tok(texts, padding=True, return_tensors="pt")
            f = model.get_text_features(input_ids=t["input_ids"], attention_mask=t["attention_mask"])
            f = f if isinstance(f, torch.Tensor) else f.pooler_output
            return f.double().numpy()

        e_edit, e_src = img(edits), img(sources)
        t_tgt, t_src = txt([c[1] for c in caps]), txt([c[0] for c in caps])
    for i in range(len(ex)):
        unit = [v[i] / np.linalg.norm(v[i]) for v in (e_edit, e_src, t_tgt, t_src)]
        d_img, d_txt = unit[0] - unit[1], unit[2] - unit[3]
        want = float(d_img @ d_txt / (np.linalg.norm(d_img) * np.linalg.norm(d_txt)))
        assert got[i].item() == pytest.approx(want, abs=1e-5)
    # swapping the captions flips the direction
    flipped = reward(
        batch(
            edits,
            source_image=paths,
            source_caption=[c[1] for c in caps],
            target_caption=[c[0] for c in caps],
        )
    )
    torch.testing.assert_close(flipped, -got, atol=1e-6, rtol=0)


class TableCLIP:
    """A stand-in for `CLIPEmbedder` with constructed unit embeddings: an image is looked up by its (constant)
    pixel value, a text by itself."""

    def __init__(self, images: dict[float, list[float]], texts: dict[str, list[float]]) -> None:
        self.images, self.texts = images, texts

    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        return torch.tensor([self.images[round(float(x.flatten()[0]), 3)] for x in images])

    def encode_texts(self, texts: list[str]) -> torch.Tensor:
        return torch.tensor([self.texts[t] for t in texts])


def test_clip_directional_on_constructed_embeddings(clip_path: Path) -> None:
    """Hand-worked: source image e_x = (1, 0, 0); captions t_s = (1, 0, 0) -> t_t = (0.6, 0.8, 0), so the text
    direction is (-0.4, 0.8, 0) with norm sqrt(0.8).
    - edit (0, 1, 0): image direction (-1, 1, 0), dot 1.2, cos = 1.2 / (sqrt(2) sqrt(0.8)) = 3 / sqrt(10);
    - edit (0, 0, 1): image direction (-1, 0, 1), dot 0.4, cos = 1 / sqrt(10);
    - edit = source: no image direction, 0;
    - edit (0.6, 0.8, 0): the image moved exactly as the captions did, cos = 1.
    All times ``scale`` = 2."""
    reward = load_reward("clip_directional", path=str(clip_path), scale=2.0)
    reward.clip = TableCLIP(
        images={0.0: [1, 0, 0], 0.2: [0, 1, 0], 0.4: [0, 0, 1], 0.6: [0.6, 0.8, 0]},
        texts={"before": [1, 0, 0], "after": [0.6, 0.8, 0]},
    )
    edits = torch.stack([torch.full((3, 4, 4), v) for v in (0.2, 0.4, 0.0, 0.6)])
    got = reward(
        batch(
            edits,
            source_images=torch.zeros(4, 3, 4, 4),
            source_caption=["before"] * 4,
            target_caption=["after"] * 4,
        )
    )
    want = [2 * 3 / math.sqrt(10), 2 / math.sqrt(10), 0.0, 2.0]
    assert got.tolist() == pytest.approx(want, abs=1e-6)


def test_clip_directional_edge_cases(clip_path: Path) -> None:
    e = example("recolour", 1)
    src = draw_scene(e.source)[None]
    cap_s, cap_t = e.captions()
    reward = load_reward("clip_directional", path=str(clip_path), scale=100.0)
    # no change of the image: 0; a missing caption: NaN; sources from outputs
    out = reward(
        batch(
            torch.cat([src, src, draw_scene(e.target)[None]]),
            source_images=torch.cat([src, src, src]),
            source_caption=[cap_s, None, cap_s],
            target_caption=[cap_t, cap_t, cap_t],
        )
    )
    assert out[0].item() == 0.0 and math.isnan(out[1].item()) and -100 <= out[2].item() <= 100
    # the tiny CLIP sees a red -> blue recolour as the red -> blue caption change
    assert out[2].item() > 0
    with pytest.raises(KeyError, match="source_caption"):
        reward(batch(src, source_images=src, target_caption=[cap_t]))
    with pytest.raises(KeyError, match="source_image"):
        reward(batch(src, source_caption=[cap_s], target_caption=[cap_t]))


# =========================================================================== image_vlm_judge
@pytest.fixture(scope="module")
def vlm_path(request: pytest.FixtureRequest) -> Path:
    """The tiny Qwen2-VL: the shipped vlm_reasoning-tiny, or conftest's random build."""
    shipped = ASSETS / "vlm_reasoning-tiny"
    if (shipped / "config.json").exists():
        return shipped
    return request.getfixturevalue("random_vlm_model_dir")


def test_image_vlm_judge_shows_the_source_then_the_edit(vlm_path: Path) -> None:
    """The judge's P(yes) is the VLM's on the two-image chat [source, edit] (computed here with the model and
    processor called directly: renormalised over vlm_judge's yes / no ids); show_source=False shows the edit
    alone; a row without a source is NaN."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    rec, mov = example("recolour"), example("move")
    size = 56  # the tiny Qwen2-VL's smallest input (2 x 2 patches of 14 px)
    src = torch.stack([draw_scene(rec.source, size), draw_scene(mov.source, size)])
    edit = torch.stack([draw_scene(rec.target, size), draw_scene(mov.source, size)])
    prompts = [rec.instruction, mov.instruction]
    question = "Was '{prompt}' done? Answer yes or no."
    judge = load_reward("image_vlm_judge", path=str(vlm_path), questions=[question])
    assert judge.needs == {"images", "prompts"}
    got = judge(RewardBatch(prompts=prompts, outputs={"images": edit, "source_images": src}))
    alone = load_reward("image_vlm_judge", path=str(vlm_path), questions=[question], show_source=False)
    got_alone = alone(RewardBatch(prompts=prompts, outputs={"images": edit, "source_images": src}))

    proc = AutoProcessor.from_pretrained(vlm_path)
    model = AutoModelForImageTextToText.from_pretrained(vlm_path).eval()
    yes, no = judge.judge.yes_ids, judge.judge.no_ids

    def p_yes(images: list[torch.Tensor], text: str) -> float:
        content = [{"type": "image"}] * len(images) + [{"type": "text", "text": text}]
        chat = proc.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        )
        pil = [Image.fromarray((x * 255).round().byte().permute(1, 2, 0).numpy()) for x in images]
        enc = proc(text=[chat], images=[pil], return_tensors="pt")
        with torch.no_grad():
            last = model(**enc).logits[0, -1].float()
        pair = torch.cat([last[yes], last[no]]).log_softmax(0).exp()
        return float(pair[: len(yes)].sum())

    for i in range(2):
        text = question.format(prompt=prompts[i])
        assert got[i].item() == pytest.approx(p_yes([src[i], edit[i]], text), abs=1e-5)
        assert got_alone[i].item() == pytest.approx(p_yes([edit[i]], text), abs=1e-5)
    assert set(judge.last_metrics) == {"p_yes_q0"}
    holes = judge(
        RewardBatch(prompts=prompts, outputs={"images": edit}, columns={"source_image": [None, None]})
    )
    assert torch.isnan(holes).all()
    with pytest.raises(KeyError, match="source_image"):
        judge(RewardBatch(prompts=prompts, outputs={"images": edit}))


# =========================================================================== PSNR / SSIM
def _pair(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A source, an edit (noise everywhere, a big change inside the mask) and the mask, 24 x 20 px."""
    g = torch.Generator().manual_seed(seed)
    src = torch.rand(2, 3, 24, 20, generator=g)
    edit = (src + 0.05 * torch.randn(src.shape, generator=g)).clamp(0, 1)
    mask = torch.zeros(2, 24, 20)
    mask[0, 4:14, 3:11] = 1
    mask[1, 10:22, 8:19] = 1
    edit = torch.where(mask[:, None] > 0.5, torch.rand(src.shape, generator=g), edit)
    return src, edit, mask


def test_image_psnr_against_the_formula(tmp_path: Path) -> None:
    src, edit, mask = _pair()
    out = load_reward("image_psnr")(batch(edit, source_images=src, edit_masks=mask))
    every = load_reward("image_psnr", region="all")(batch(edit, source_images=src))
    inside = load_reward("image_psnr", region="inside")(batch(edit, source_images=src, edit_masks=mask))
    for i in range(2):
        x, y, m = edit[i].double().numpy(), src[i].double().numpy(), mask[i].numpy() > 0.5
        for got, keep in ((out, ~m), (inside, m), (every, np.ones_like(m))):
            mse = ((x - y) ** 2)[:, keep].mean()
            assert got[i].item() == pytest.approx(10 * math.log10(1 / mse), abs=1e-4)
    assert (out > inside).all()
    # the same region from a mask image and from boxes; sources from files
    paths, mpaths = [], []
    for i in range(2):
        paths.append(str(save_image(src[i], tmp_path / f"src{i}.png")))
        mpaths.append(str(save_image(mask[i].expand(3, -1, -1), tmp_path / f"mask{i}.png")))
    quant = (src * 255).round() / 255  # what a PNG holds
    want = load_reward("image_psnr")(batch(edit, source_images=quant, edit_masks=mask))
    boxes = [[3 / 20, 4 / 24, 11 / 20, 14 / 24], [[8 / 20, 10 / 24, 19 / 20, 22 / 24]]]
    by_mask = load_reward("image_psnr")(batch(edit, source_image=paths, edit_mask=mpaths))
    by_box = load_reward("image_psnr")(batch(edit, source_image=paths, edit_bbox=boxes))
    mixed = load_reward("image_psnr")(
        batch(edit, source_image=paths, edit_mask=[mpaths[0], None], edit_bbox=[None, boxes[1]])
    )
    for got in (by_mask, by_box, mixed):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    # identical: max_db; no region: NaN; no source: NaN
    same = load_reward("image_psnr", max_db=60.0)(batch(src, source_images=src, edit_masks=mask))
    assert same.tolist() == [60.0, 60.0]
    holes = load_reward("image_psnr")(batch(edit, source_image=[paths[0], None], edit_bbox=[None, boxes[1]]))
    assert math.isnan(holes[0].item()) and math.isnan(holes[1].item())
    with pytest.raises(KeyError, match="edit_mask.*edit_bbox"):
        load_reward("image_psnr")(batch(edit, source_images=src))
    with pytest.raises(ValueError, match="fractions"):
        load_reward("image_psnr")(batch(edit, source_images=src, edit_bbox=[[0, 0, 12, 12], None]))
    with pytest.raises(ValueError, match="region"):
        load_reward("image_psnr", region="border")


def test_image_psnr_and_ssim_hand_worked() -> None:
    """A black 3 x 4 x 4 source; the edit is 0.1 everywhere except 1.0 on the 2 x 2 edit region.
    Outside: MSE = 0.1^2 = 0.01, PSNR = 10 log10(1 / 0.01) = 20 dB; inside: MSE 1, 0 dB; all: MSE =
    (12 * 0.01 + 4 * 1) / 16 = 0.2575, PSNR = 10 log10(1 / 0.2575) = 5.8922 dB.
    SSIM of two constant 16 x 16 images a = 0.5, b = 0.25: local variances and covariance are 0, so
    SSIM = (2ab + C1) / (a^2 + b^2 + C1) x C2 / C2 = (0.25 + 1e-4) / (0.3125 + 1e-4) = 0.2501 / 0.3126 = 0.800064."""
    src = torch.zeros(1, 3, 4, 4)
    edit = torch.full((1, 3, 4, 4), 0.1)
    mask = torch.zeros(1, 4, 4)
    mask[0, 1:3, 1:3] = 1
    edit[0, :, 1:3, 1:3] = 1.0
    b = batch(edit, source_images=src, edit_masks=mask)
    assert load_reward("image_psnr")(b).item() == pytest.approx(20.0, abs=1e-4)
    assert load_reward("image_psnr", region="inside")(b).item() == pytest.approx(0.0, abs=1e-4)
    assert load_reward("image_psnr", region="all")(b).item() == pytest.approx(5.8922, abs=1e-4)
    a_img, b_img = torch.full((1, 3, 16, 16), 0.5), torch.full((1, 3, 16, 16), 0.25)
    ssim = load_reward("image_ssim", region="all")(batch(a_img, source_images=b_img))
    assert ssim.item() == pytest.approx(0.2501 / 0.3126, abs=1e-5)
    assert ssim.item() == pytest.approx(0.800064, abs=1e-5)


def test_image_ssim_against_scikit_image() -> None:
    metrics = pytest.importorskip("skimage.metrics")
    src, edit, mask = _pair(1)
    out = load_reward("image_ssim")(batch(edit, source_images=src, edit_masks=mask))
    every = load_reward("image_ssim", region="all")(batch(edit, source_images=src))
    r = 5  # the window's radius: skimage's mean SSIM skips this border too
    for i in range(2):
        x = edit[i].permute(1, 2, 0).double().numpy()
        y = src[i].permute(1, 2, 0).double().numpy()
        kw = dict(
            gaussian_weights=True, sigma=1.5, use_sample_covariance=False, data_range=1.0, channel_axis=2
        )
        mssim, full = metrics.structural_similarity(x, y, full=True, **kw)
        assert every[i].item() == pytest.approx(mssim, abs=1e-6)
        keep = (mask[i].numpy() <= 0.5)[r:-r, r:-r]
        want = full.mean(axis=2)[r:-r, r:-r][keep].mean()
        assert out[i].item() == pytest.approx(want, abs=1e-6)
    assert load_reward("image_ssim")(
        batch(src, source_images=src, edit_masks=mask)
    ).tolist() == pytest.approx([1, 1])


# =========================================================================== shapes edit accuracy
def _objects(squares: tuple[Square, ...]) -> list[dict[str, Any]]:
    return [{"colour": s.colour, "box": [v / 32 for v in slot_box(s.slot)]} for s in squares]


def test_shapes_edit_accuracy_hand_worked() -> None:
    rec = EditExample(
        (Square("red", "left"), Square("green", "right")),
        (Square("green", "right"), Square("blue", "left")),
        "recolour",
        Square("red", "left"),
        Square("blue", "left"),
        "make the red square blue",
    )
    move = EditExample(
        (Square("red", "left"), Square("green", "right")),
        (Square("green", "right"), Square("red", "top")),
        "move",
        Square("red", "left"),
        Square("red", "top"),
        "move the red square to the top",
    )
    assert example_row(rec)["target_objects"] == _objects(rec.target)
    stray = draw_scene(rec.target)
    bx0, by0, bx1, by1 = slot_box("bottom")
    stray[:, by0:by1, bx0:bx1] = torch.tensor([230, 30, 30]).view(3, 1, 1) / 255  # a red square at the bottom
    half = draw_scene(rec.target)
    x0, y0, x1, y1 = slot_box("left")
    half[:, y0 : y0 + 5, x0:x1] = draw_scene(rec.source)[:, y0 : y0 + 5, x0:x1]  # 5 of 8 rows still red
    images = torch.stack(
        [
            draw_scene(rec.target),  # perfect: 3/3
            draw_scene(rec.source),  # nothing done: blue missing, green there, background clean: 2/3
            stray,  # edit done, red stray outside the boxes: 2/3
            half,  # 3/8 of the box blue < min_fill 0.6: 2/3
            draw_scene(move.target),  # the move done
            draw_scene(move.source),  # nothing done: red missing at the top, red left over outside: 1/3
            torch.ones(3, 32, 32),  # blank: only the background check passes: 1/3
        ]
    )
    objects = [_objects(rec.target)] * 4 + [_objects(move.target)] * 3
    reward = load_reward("shapes_edit_accuracy")
    got = reward(batch(images, target_objects=objects))
    assert got.tolist() == pytest.approx([1, 2 / 3, 2 / 3, 2 / 3, 1, 1 / 3, 1 / 3])
    assert reward.last_metrics == pytest.approx(
        {"objects_ok": (2 + 1 + 2 + 1 + 2 + 1 + 0) / 14, "background_ok": 5 / 7, "exact": 2 / 7}
    )
    strict = load_reward("shapes_edit_accuracy", mode="exact")(batch(images, target_objects=objects))
    assert strict.tolist() == [1, 0, 0, 0, 1, 0, 0]
    # soft: the measured shares. Perfect: 1; nothing done: blue share 0, green 1, background 1
    soft = load_reward("shapes_edit_accuracy", mode="soft")(batch(images[:2], target_objects=objects[:2]))
    assert soft.tolist() == pytest.approx([1, 2 / 3])
    # half: the blue box is 3/8 blue; the rest is background: (3/8 + 1 + 1) / 3
    assert load_reward("shapes_edit_accuracy", mode="soft")(
        batch(images[3:4], target_objects=objects[3:4])
    ).item() == pytest.approx((3 / 8 + 2) / 3)
    # stray: the red square at the bottom covers 64 of the 1024 - 2 * 100 pixels outside the widened boxes
    assert load_reward("shapes_edit_accuracy", mode="soft")(
        batch(images[2:3], target_objects=objects[2:3])
    ).item() == pytest.approx((2 + 1 - 64 / 824) / 3)
    with pytest.raises(ValueError, match="mode"):
        load_reward("shapes_edit_accuracy", mode="fuzzy")
    lenient = load_reward("shapes_edit_accuracy", min_fill=0.3)(
        batch(images[3:4], target_objects=objects[3:4])
    )
    assert lenient.item() == 1.0  # 3/8 >= 0.3
    none = reward(batch(images[:1], target_objects=[None]))
    assert math.isnan(none.item())
    with pytest.raises(ValueError, match="colour"):
        reward(batch(images[:1], target_objects=[[{"colour": "mauve", "box": [0, 0, 0.5, 0.5]}]]))
    with pytest.raises(KeyError, match="target_objects"):
        reward(batch(images[:1]))
