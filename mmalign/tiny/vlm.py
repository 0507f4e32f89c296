"""A tiny offline Qwen2-VL and a synthetic visual question task (tests, quickstart, benchmarks).

Builders registered in `mmalign.tiny.BUILDERS`: ``vlm_random`` (random weights, instant) and
``vlm_reasoning`` (warm-started on the colour task, then blurred with noisy labels so that RL has
something to fix).

Details: docs/architecture.md, "mmalign.tiny.vlm".
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch

from mmalign.tiny import BUILDERS, EOS, train_bpe_tokenizer
from mmalign.tiny.warm_start import fit

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"
VLM_SPECIALS = [IM_START, IM_END, VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]

# Qwen2-VL's chat template without the default system message: a user turn's content is a
# string or a list of {"type": "image"|"video"|"text"} parts; every image becomes
# <|vision_start|><|image_pad|><|vision_end|> (the processor expands the pad to the image's tokens).
VLM_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

COLOURS = {"red": (220, 30, 30), "green": (30, 170, 40), "blue": (30, 60, 220), "yellow": (230, 200, 20)}
SHAPES = ("circle", "square", "triangle")
QUESTION = "What colour is the shape?"
IMAGE_SIZE = 56
PIXELS = IMAGE_SIZE * IMAGE_SIZE  # min = max: every picture is 56x56 -> 2x2 merged tokens


def answer_text(answer: str) -> str:
    return f"<answer>{answer}</answer>"


# ----------------------------------------------------------------------------- model + processor


def tiny_vlm_processor(texts: list[str], *, min_pixels: int = PIXELS, max_pixels: int = PIXELS) -> Any:
    """A `Qwen2VLProcessor`: in-process BPE with Qwen2-VL's special tokens, small image sizes."""
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    tokenizer = train_bpe_tokenizer(texts, vocab_size=360, extra_special=VLM_SPECIALS)
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    image_processor = Qwen2VLImageProcessor(min_pixels=min_pixels, max_pixels=max_pixels)
    video_processor = Qwen2VLVideoProcessor(min_pixels=min_pixels, max_pixels=max_pixels * 4)
    return Qwen2VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=VLM_CHAT_TEMPLATE,
    )


def special_token_ids(tokenizer: Any) -> dict[str, int]:
    """The ids of EOS and the Qwen2-VL special tokens in `tokenizer`."""
    return {t: tokenizer.convert_tokens_to_ids(t) for t in [EOS, *VLM_SPECIALS]}


def qwen2_vl_model(tokenizer: Any, text: dict[str, Any], vision: dict[str, Any]) -> torch.nn.Module:
    """A `Qwen2VLForConditionalGeneration` from text / vision config kwargs, wired to `tokenizer`'s special
    tokens (image / video pads, vision start / end; EOS and <|im_end|> end generation; tied embeddings)."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    ids = special_token_ids(tokenizer)
    config = Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids[IMAGE_PAD],
        video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=True,
    )
    model = Qwen2VLForConditionalGeneration(config)
    model.generation_config.eos_token_id = [ids[IM_END], ids[EOS]]
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = None
    return model


def tiny_vlm(tokenizer: Any, **text_overrides: Any) -> torch.nn.Module:
    """A Qwen2-VL of ~150k parameters (2 text layers of width 64, a 1-block vision tower of width 32)."""
    ids = special_token_ids(tokenizer)
    text: dict[str, Any] = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        eos_token_id=ids[IM_END],
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    text.update(text_overrides)
    vision = dict(
        depth=1,
        embed_dim=32,
        hidden_size=text["hidden_size"],
        num_heads=2,
        mlp_ratio=2,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
    )
    return qwen2_vl_model(tokenizer, text, vision)


def _corpus() -> list[str]:
    texts = []
    for c in COLOURS:
        texts.append(f"{IM_START}user\n{QUESTION}{IM_END}\n{IM_START}assistant\n{answer_text(c)}{IM_END}")
        texts.append(f"How many shapes? Which one is {c}? {answer_text(c)} {answer_text('3')}")
    return texts * 4


def save_vlm(path: Path, model: torch.nn.Module, processor: Any, meta: dict[str, Any]) -> None:
    model.save_pretrained(path)
    processor.save_pretrained(path)
    (path / "mmalign_tiny.json").write_text(json.dumps(meta))


@BUILDERS.register("vlm_random", minutes=0.05)
def build_vlm_random(path: Path, seed: int = 0) -> None:
    """Random-weight tiny Qwen2-VL + processor (instant; for tests of shapes and plumbing)."""
    torch.manual_seed(seed)
    processor = tiny_vlm_processor(_corpus())
    save_vlm(path, tiny_vlm(processor.tokenizer), processor, {"builder": "vlm_random", "seed": seed})


# ----------------------------------------------------------------------------- synthetic task


def draw_shape(colour: str, shape: str, rng: random.Random, size: int = IMAGE_SIZE) -> Any:
    """One `colour` `shape` at a random place and size on a white `size` x `size` picture."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (size, size), (255, 255, 255))
    d = ImageDraw.Draw(img)
    s = rng.randint(size // 2, size - 8)
    x, y = rng.randint(2, size - s - 2), rng.randint(2, size - s - 2)
    fill = COLOURS[colour]
    if shape == "circle":
        d.ellipse([x, y, x + s, y + s], fill=fill)
    elif shape == "square":
        d.rectangle([x, y, x + s, y + s], fill=fill)
    else:
        d.polygon([(x + s // 2, y), (x, y + s), (x + s, y + s)], fill=fill)
    return img


def shape_rows(n: int, seed: int) -> list[tuple[Any, str, str]]:
    """`n` (PIL image, colour, shape) triples, colours balanced."""
    rng = random.Random(seed)
    colours = list(COLOURS)
    out = []
    for i in range(n):
        colour, shape = colours[i % len(colours)], rng.choice(SHAPES)
        out.append((draw_shape(colour, shape, rng), colour, shape))
    rng.shuffle(out)
    return out


def write_dataset(folder: str | Path, n: int = 64, seed: int = 7) -> Path:
    """PNG pictures + ``train.jsonl`` (``images`` relative to `folder`, ``question``, ``answer``, sizes)."""
    folder = Path(folder)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    lines = []
    for i, (img, colour, shape) in enumerate(shape_rows(n, seed)):
        rel = f"images/{i:03d}.png"
        img.save(folder / rel, optimize=True)
        lines.append(
            json.dumps(
                {
                    "images": [rel],
                    "question": QUESTION,
                    "answer": colour,
                    "shape": shape,
                    "image_width": img.width,
                    "image_height": img.height,
                }
            )
        )
    (folder / "train.jsonl").write_text("\n".join(lines) + "\n")
    return folder / "train.jsonl"


@BUILDERS.register("vlm_reasoning", minutes=1, phases=2)
def build_vlm_reasoning(
    path: Path,
    sharp_steps: int = 300,
    blur_steps: int = 150,
    p_correct: float = 0.4,
    seed: int = 0,
    num_images: int = 256,
) -> None:
    """Tiny Qwen2-VL warm-started on the colour task, then blurred so that RL has something to fix.

    Phase 1 (`sharp_steps`) teaches the answer format and the colours; phase 2 (`blur_steps`)
    fine-tunes on noisy labels (right with probability `p_correct`, else another colour), so the
    base model samples the right colour only part of the time at temperature 1.
    """
    torch.manual_seed(seed)
    rng = random.Random(seed)
    processor = tiny_vlm_processor(_corpus())
    tok = processor.tokenizer
    model = tiny_vlm(tok)
    model.train()
    data = shape_rows(num_images, seed=seed + 1000)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    enc = processor(images=[d[0] for d in data], text=[prompt] * len(data), return_tensors="pt")
    n_prompt = enc["input_ids"].shape[1]  # every prompt has the same length (one 56x56 picture)
    per_image = enc["pixel_values"].shape[0] // len(data)
    pixels = enc["pixel_values"].view(len(data), per_image, -1)
    im_end = tok.convert_tokens_to_ids(IM_END)
    answers = {c: tok(answer_text(c))["input_ids"] + [im_end] for c in COLOURS}
    colours = list(COLOURS)

    def batch(noisy: bool, size: int = 32) -> dict[str, torch.Tensor]:
        idx = rng.sample(range(len(data)), size)
        comps = []
        for i in idx:
            c = data[i][1]
            if noisy and rng.random() >= p_correct:
                c = rng.choice([x for x in colours if x != c])
            comps.append(answers[c])
        width = max(map(len, comps))
        comp = torch.full((size, width), tok.pad_token_id)
        labels = torch.full((size, n_prompt + width), -100)
        att = torch.zeros((size, n_prompt + width), dtype=torch.long)
        att[:, :n_prompt] = 1
        for j, c in enumerate(comps):
            comp[j, : len(c)] = torch.tensor(c)
            labels[j, n_prompt : n_prompt + len(c)] = torch.tensor(c)
            att[j, n_prompt : n_prompt + len(c)] = 1
        ids = torch.cat([enc["input_ids"][idx], comp], dim=1)
        tt = torch.cat([enc["mm_token_type_ids"][idx], torch.zeros_like(comp)], dim=1)
        return {
            "input_ids": ids,
            "attention_mask": att,
            "labels": labels,
            "mm_token_type_ids": tt,
            "pixel_values": pixels[idx].reshape(-1, pixels.shape[-1]),
            "image_grid_thw": enc["image_grid_thw"][idx],
        }

    for phase, steps, lr in (("sharp", sharp_steps, 3e-3), ("blur", blur_steps, 1e-3)):
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        noisy = phase == "blur"
        fit(
            opt,
            steps,
            lambda _, noisy=noisy: model(**batch(noisy=noisy)).loss,
            f"VLM warm start, {phase} phase",
        )
    model.eval()
    save_vlm(
        path,
        model,
        processor,
        {
            "builder": "vlm_reasoning",
            "sharp_steps": sharp_steps,
            "blur_steps": blur_steps,
            "p_correct": p_correct,
            "seed": seed,
        },
    )


if __name__ == "__main__":  # regenerate the bundled data set: python -m mmalign.tiny.vlm
    print(write_dataset(Path(__file__).resolve().parents[2] / "assets" / "vlm_reasoning"))
