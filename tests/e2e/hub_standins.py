"""Architecture-faithful tiny stand-ins for the hub models the real configs and the docs name, written into an
offline Hugging Face cache (a folder used as ``HF_HOME``) under exactly those ids.

A stand-in has the real model's classes, folder layout (diffusers subfolders, ``model_index.json``), tokenizer
class, special tokens, chat template, processor files (the published ``preprocessor_config.json`` forms) and
generation config (the Qwen repositories' sampling defaults, repetition penalty included); only the sizes are
tiny and the weights random, except the Qwen2.5 / Qwen2.5-VL stand-ins, which get a few seconds of supervised
warm start so that they answer in the formats the configs' rewards read (`warm_start`, `warm_start_vl`).
`mmalign train configs/<name>.yaml` then runs the real ``from_pretrained("org/name")`` path through
huggingface_hub's cache with ``HF_HUB_OFFLINE=1`` (tests/e2e/test_real_configs.py). The datasets the configs
read by ``hf:`` id are `DATASET_STANDINS`: parquet shards and a README declaring the configurations, as on the
hub, in the real column schema.

`STANDINS` maps each hub id to its builder (a function writing a ``save_pretrained`` folder); `write_hub_cache`
writes the ids asked for in the cache layout huggingface_hub reads (``datasets--org--name`` for datasets)::

    HF_HOME/hub/models--org--name/refs/main                  (the commit hash)
    HF_HOME/hub/models--org--name/snapshots/<commit>/...     (the files)

which `huggingface_hub.snapshot_download(id, local_files_only=True)` and `hf_hub_download` resolve (plain files
in the snapshot folder, no blobs: the cache reader only follows refs/main to the snapshot).

The tiny builders of `mmalign.tiny` are reused where they already build the real classes (SD3, FLUX.1, SD 1.5,
Qwen-Image, Qwen-Image-Edit, Wan); where the real model differs from them (SD3.5's QK-norm and dual-attention
blocks, Qwen2.5's tokenizer and chat template) the stand-in adjusts the built folder.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "DATASET_STANDINS",
    "STANDINS",
    "commit_of",
    "repo_folder",
    "write_hub_cache",
]

OPENAI_MEAN = [0.48145466, 0.4578275, 0.40821073]
OPENAI_STD = [0.26862954, 0.26130258, 0.27577711]
"""OpenAI CLIP's image normalisation (CLIP, SD 1.5's feature extractor, Qwen2.5-VL)."""

Builder = Callable[[Path], None]
STANDINS: dict[str, Builder] = {}
"""Hub model id -> builder writing the stand-in's files into an empty folder."""
DATASET_STANDINS: dict[str, Builder] = {}
"""Hub dataset id -> builder writing the repository's files (data files in the hub's layout, README.md)."""


def standin(*repo_ids: str, table: dict[str, Builder] = STANDINS) -> Callable[[Builder], Builder]:
    """Register `fn` as the stand-in builder of `repo_ids` (in `table`: `STANDINS` or `DATASET_STANDINS`)."""

    def register(fn: Builder) -> Builder:
        for repo_id in repo_ids:
            table[repo_id] = fn
        return fn

    return register


# ----------------------------------------------------------------------------- the cache layout


def commit_of(repo_id: str) -> str:
    """A fixed 40-hex "commit" per id (the snapshot folder's name and the content of refs/main)."""
    return hashlib.sha1(f"mmalign-standin:{repo_id}".encode()).hexdigest()


def repo_folder(hf_home: str | Path, repo_id: str, repo_type: str = "model") -> Path:
    """``HF_HOME/hub/<type>s--org--name``: the cache folder of one repository."""
    return Path(hf_home) / "hub" / f"{repo_type}s--{repo_id.replace('/', '--')}"


def write_hub_cache(
    hf_home: str | Path, repo_ids: Iterable[str], repo_type: str = "model"
) -> dict[str, Path]:
    """Write the stand-ins of `repo_ids` (models, or with ``repo_type="dataset"`` datasets; those not already
    there) into the cache under `hf_home`; returns each id's snapshot folder. An id without a stand-in raises
    KeyError naming it and the table to add it to (`STANDINS` / `DATASET_STANDINS`)."""
    table, table_name = (
        (STANDINS, "STANDINS") if repo_type == "model" else (DATASET_STANDINS, "DATASET_STANDINS")
    )
    out = {}
    Path(hf_home).mkdir(parents=True, exist_ok=True)
    for repo_id in repo_ids:
        if repo_id not in table:
            raise KeyError(
                f"no stand-in for hub {repo_type} id {repo_id!r}: add a builder for it to {table_name} in "
                "tests/e2e/hub_standins.py"
            )
        folder = repo_folder(hf_home, repo_id, repo_type)
        commit = commit_of(repo_id)
        snapshot = folder / "snapshots" / commit
        if not (folder / "refs" / "main").is_file():
            tmp = Path(tempfile.mkdtemp(prefix="standin-", dir=Path(hf_home)))
            try:
                table[repo_id](tmp)
                snapshot.parent.mkdir(parents=True, exist_ok=True)
                if snapshot.exists():
                    shutil.rmtree(snapshot)
                tmp.rename(snapshot)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            (folder / "refs").mkdir(parents=True, exist_ok=True)
            (folder / "refs" / "main").write_text(commit)  # last: the repo exists whole or not at all
        out[repo_id] = snapshot
    return out


# ----------------------------------------------------------------------------- Qwen2.5 / Qwen2.5-VL

QWEN_SPECIALS = [
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
"""Qwen2.5's special tokens after ``<|endoftext|>`` (tokenizer_config.json's added tokens 151644-151656)."""

QWEN25_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) "
    "or (message.role == 'assistant') %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""Qwen2.5-Instruct's chat template without its tool-definition branch (no config here passes tools): the
default system message when none is given, ``<|im_start|>role\\n...<|im_end|>\\n`` turns."""

QWEN25_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""Qwen2.5-VL-Instruct's chat template (chat_template.json of the 3B / 7B repositories)."""

_CORPUS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May. Natalia sold 48+24 = <<48+24=72>>72 clips. #### 72",
    "Please reason step by step, and put your final answer within \\boxed{}. The answer is \\boxed{72}.",
    "Answer the question about the image. Think briefly, then put the final answer in <answer></answer> tags.",
    "You are a radiology assistant. Give the bounding box of the requested finding in <answer></answer> tags.",
    "Locate the nodule. Answer with <answer>[12,30,40,52]</answer>. Find the storage tank left of the lake. "
    "Zoom with <crop>[0,0,56,56]</crop> or answer with <answer>[1,2,3,4]</answer>.",
    "What colour is the shape? red green blue yellow circle square triangle 0 1 2 3 4 5 6 7 8 9",
    "You are Qwen, created by Alibaba Cloud. You are a helpful assistant. system user assistant",
]


GSM8K_QUESTION = (
    "Natalia sold {a} clips to her friends in April and {b} clips in May. How many clips did she sell?"
)
"""The question of the GSM8K-schema rows (tests/e2e/test_real_configs.py) and of the text stand-in's warm start."""


def qwen25_tokenizer(chat_template: str, vocab_size: int = 640) -> Any:
    """A ``Qwen2Tokenizer`` (byte-level BPE trained in-process with Qwen2's pre-tokenizer) with Qwen2.5's special
    tokens, ``<|im_end|>`` as EOS and ``<|endoftext|>`` as padding (as the Instruct repositories set them)."""
    from transformers import Qwen2Tokenizer

    from mmalign.tiny import train_bpe_tokenizer

    fast = train_bpe_tokenizer(_CORPUS * 4, vocab_size=vocab_size, extra_special=QWEN_SPECIALS)
    with tempfile.TemporaryDirectory() as tmp:
        fast.save_pretrained(tmp)
        tok = Qwen2Tokenizer.from_pretrained(tmp)
    tok.eos_token = "<|im_end|>"
    tok.pad_token = "<|endoftext|>"
    tok.chat_template = chat_template
    return tok


def _qwen_generation_config(tok: Any, **sampling: Any) -> Any:
    """The Instruct repositories' generation_config.json, with the stand-in tokenizer's ids."""
    from transformers import GenerationConfig

    eot, im_end = tok.convert_tokens_to_ids("<|endoftext|>"), tok.convert_tokens_to_ids("<|im_end|>")
    return GenerationConfig(
        bos_token_id=eot, pad_token_id=eot, eos_token_id=[im_end, eot], do_sample=True, **sampling
    )


@standin("Qwen/Qwen2.5-0.5B-Instruct")
def qwen25_instruct(path: Path) -> None:
    """``Qwen2ForCausalLM`` (GQA 2:1, tied embeddings, RoPE theta 1e6, head size 32) + Qwen2.5's tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    tok = qwen25_tokenizer(QWEN25_CHAT_TEMPLATE)
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    model = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=len(tok),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=32768,
            max_window_layers=2,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            use_sliding_window=False,
            bos_token_id=eot,
            eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        )
    )
    model.generation_config = _qwen_generation_config(
        tok, repetition_penalty=1.1, temperature=0.7, top_p=0.8, top_k=20
    )
    warm_start(model, tok, boxed_sums)
    model.save_pretrained(path)
    tok.save_pretrained(path)


Example = Callable[[Any], tuple[list[dict[str, str]], str]]
"""rng -> (chat messages, the assistant's completion): one supervised example of a warm start."""


def warm_start(model: torch.nn.Module, tok: Any, example: Example, steps: int = 120, seed: int = 0) -> None:
    """A few seconds of supervised steps on `example`s (loss on the completion and ``<|im_end|>`` only), so that
    the stand-in answers in the format the real config's rewards read, right only part of the time: its groups
    then differ in reward and a GRPO step has something to update (random weights score 0 everywhere: dynamic
    sampling would skip every update, a NaN-only reward would stop the run)."""
    import random

    rng = random.Random(seed)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        seqs, starts = [], []
        for _ in range(16):
            messages, completion = example(rng)
            prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            p_ids = tok(prompt)["input_ids"]
            seqs.append(p_ids + tok(completion)["input_ids"] + [im_end])
            starts.append(len(p_ids))
        width = max(map(len, seqs))
        ids = torch.full((len(seqs), width), tok.pad_token_id)
        labels = torch.full((len(seqs), width), -100)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, (seq, start) in enumerate(zip(seqs, starts, strict=True)):
            ids[i, : len(seq)], mask[i, : len(seq)] = torch.tensor(seq), 1
            labels[i, start : len(seq)] = torch.tensor(seq[start:])
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def boxed_sums(rng: Any) -> tuple[list[dict[str, str]], str]:
    """`GSM8K_QUESTION` with the text_reasoning config's system prompt -> ``The answer is \\boxed{N}.``, N the sum
    half the time, else off by one or two."""
    a, b = rng.randint(1, 5), rng.randint(1, 5)
    answer = a + b if rng.random() < 0.5 else a + b + rng.choice([-2, -1, 1, 2])
    system = "Please reason step by step, and put your final answer within \\boxed{}."
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": GSM8K_QUESTION.format(a=a, b=b)},
    ]
    return messages, f"The answer is \\boxed{{{answer}}}."


def _box(rng: Any, side: int) -> str:
    x0, y0 = rng.randint(0, side // 2), rng.randint(0, side // 2)
    return f"[{x0},{y0},{x0 + rng.randint(8, side // 2)},{y0 + rng.randint(8, side // 2)}]"


def answer_tags(rng: Any) -> tuple[list[dict[str, str]], str]:
    """A question -> ``<answer>...</answer>`` holding a small number or a pixel box (the VQA and grounding
    configs' formats), sometimes without the tags."""
    completion = (
        f"<answer>{rng.randint(1, 9)}</answer>" if rng.random() < 0.5 else f"<answer>{_box(rng, 56)}</answer>"
    )
    if rng.random() < 0.2:
        completion = completion.removeprefix("<answer>").removesuffix("</answer>")
    return [
        {"role": "user", "content": rng.choice(["Find x.", "Locate the nodule.", "How many?"])}
    ], completion


def crop_or_answer(rng: Any) -> tuple[list[dict[str, str]], str]:
    """A zoom prompt -> ``<crop>[box]</crop>`` or ``<answer>[box]</answer>`` (GeoViS' multi-turn format)."""
    tag = "crop" if rng.random() < 0.5 else "answer"
    prompt = "Find the building. Zoom with <crop>[x1,y1,x2,y2]</crop> or answer with <answer>[x1,y1,x2,y2]</answer>."
    return [{"role": "user", "content": prompt}], f"<{tag}>{_box(rng, 448)}</{tag}>"


def warm_start_vl(
    model: torch.nn.Module, tok: Any, example: Example, steps: int = 150, seed: int = 0
) -> None:
    """`warm_start` for a Qwen2.5-VL: each example's user turn gets a random picture (56 to 448 px a side, 4 to
    256 vision tokens, read by the vision tower as in a rollout) before its text."""
    import random

    import numpy as np
    from PIL import Image
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    processor = Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(min_pixels=3136, max_pixels=12845056),
        tokenizer=tok,
        video_processor=Qwen2VLVideoProcessor(),
        chat_template=QWEN25_VL_CHAT_TEMPLATE,
    )
    rng = random.Random(seed)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        items = []
        for _ in range(8):
            messages, completion = example(rng)
            side = rng.choice([56, 112, 224, 448])
            pixels = np.random.default_rng(rng.randint(0, 2**31)).integers(
                0, 255, (side, side, 3), dtype=np.uint8
            )
            content = [{"type": "image"}, {"type": "text", "text": messages[-1]["content"]}]
            turn = [*messages[:-1], {"role": "user", "content": content}]
            prompt = tok.apply_chat_template(turn, tokenize=False, add_generation_prompt=True)
            enc = processor(text=[prompt], images=[Image.fromarray(pixels)], return_tensors="pt")
            items.append((enc, tok(completion)["input_ids"] + [im_end]))
        width = max(e["input_ids"].shape[1] + len(c) for e, c in items)
        ids = torch.full((len(items), width), tok.pad_token_id)
        labels = torch.full((len(items), width), -100)
        mask = torch.zeros((len(items), width), dtype=torch.long)
        types = torch.zeros((len(items), width), dtype=torch.long)
        for i, (enc, comp) in enumerate(items):
            n = enc["input_ids"].shape[1]
            ids[i, :n], ids[i, n : n + len(comp)] = enc["input_ids"][0], torch.tensor(comp)
            labels[i, n : n + len(comp)] = torch.tensor(comp)
            mask[i, : n + len(comp)] = 1
            if "mm_token_type_ids" in enc:
                types[i, :n] = enc["mm_token_type_ids"][0]
        batch = {
            "input_ids": ids,
            "attention_mask": mask,
            "labels": labels,
            "pixel_values": torch.cat([e["pixel_values"] for e, _ in items]),
            "image_grid_thw": torch.cat([e["image_grid_thw"] for e, _ in items]),
        }
        if "mm_token_type_ids" in items[0][0]:
            batch["mm_token_type_ids"] = types
        loss = model(**batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


QWEN25_VL_PREPROCESSOR: dict[str, Any] = {
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": OPENAI_MEAN,
    "image_std": OPENAI_STD,
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2_5_VLProcessor",
}
"""preprocessor_config.json of the Qwen2.5-VL-Instruct repositories, as published (the legacy ``min_pixels`` /
``max_pixels`` keys, no video processor file: `AutoProcessor` builds the processor from this, the tokenizer
files and chat_template.json)."""


def qwen25_vl_model(tok: Any, hidden: int = 64) -> torch.nn.Module:
    """``Qwen2_5_VLForConditionalGeneration``: 2 text layers (head size 32, GQA 2:1, M-RoPE sections [4, 6, 6]
    scaled from the real [16, 24, 24]) and a 2-block vision tower with windowed attention in block 0 and full
    attention in block 1 (the real tower alternates 7 windowed, 1 full), wired to the tokenizer's vision tokens."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = {t: tok.convert_tokens_to_ids(t) for t in [*QWEN_SPECIALS, "<|endoftext|>"]}
    text = dict(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128000,
        max_window_layers=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [4, 6, 6]},
        rms_norm_eps=1e-6,
        use_sliding_window=False,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=hidden,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=112,
        fullatt_block_indexes=[1],
        tokens_per_second=2,
    )
    config = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    return Qwen2_5_VLForConditionalGeneration(config)


@standin("Qwen/Qwen2.5-VL-3B-Instruct")
def qwen25_vl_3b(path: Path) -> None:
    """Qwen2.5-VL-3B-Instruct (VQA, medical grounding): `qwen25_vl_instruct` warm-started on `answer_tags`."""
    qwen25_vl_instruct(path, answer_tags)


@standin("Qwen/Qwen2.5-VL-7B-Instruct")
def qwen25_vl_7b(path: Path) -> None:
    """Qwen2.5-VL-7B-Instruct (GeoViS' zoom search): `qwen25_vl_instruct` warm-started on `crop_or_answer`."""
    qwen25_vl_instruct(path, crop_or_answer)


def qwen25_vl_instruct(path: Path, example: Example) -> None:
    """Qwen2.5-VL-Instruct: `qwen25_vl_model` (`warm_start_vl`ed on `example`), the Instruct generation config, the
    tokenizer, and `QWEN25_VL_PREPROCESSOR` + chat_template.json (the processor as the repositories publish it)."""
    torch.manual_seed(0)
    tok = qwen25_tokenizer(QWEN25_VL_CHAT_TEMPLATE)
    model = qwen25_vl_model(tok)
    model.generation_config = _qwen_generation_config(
        tok, repetition_penalty=1.05, temperature=0.1, top_p=0.001, top_k=1
    )
    warm_start_vl(model, tok, example)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    _write_json(path / "preprocessor_config.json", QWEN25_VL_PREPROCESSOR)
    _write_json(path / "chat_template.json", {"chat_template": QWEN25_VL_CHAT_TEMPLATE})


def _write_json(file: Path, data: dict[str, Any]) -> None:
    file.write_text(json.dumps(data, indent=2) + "\n")


# ----------------------------------------------------------------------------- diffusion policies


@standin("stabilityai/stable-diffusion-3.5-medium")
def sd35_medium(path: Path) -> None:
    """SD3.5 Medium: `mmalign.tiny.sd3.build_tiny_sd3` in the real three-encoder layout (two CLIPs with
    projection, a T5 ``text_encoder_3``, ``model_index.json`` naming ``StableDiffusion3Pipeline``), its
    transformer rebuilt with SD3.5's RMS QK-norm and Medium's MMDiT-X dual-attention block (block 0)."""
    _sd35(path, dual_attention_layers=[0])


@standin("stabilityai/stable-diffusion-3.5-large")
def sd35_large(path: Path) -> None:
    """SD3.5 Large: as `sd35_medium` with QK-norm only (no dual-attention blocks)."""
    _sd35(path, dual_attention_layers=[])


def _sd35(path: Path, dual_attention_layers: list[int]) -> None:
    from diffusers import SD3Transformer2DModel

    from mmalign.tiny.sd3 import build_tiny_sd3

    build_tiny_sd3(path, text_encoders=3)
    config = dict(SD3Transformer2DModel.load_config(path / "transformer"))
    config.update(qk_norm="rms_norm", dual_attention_layers=dual_attention_layers)
    torch.manual_seed(1)
    SD3Transformer2DModel.from_config(config).save_pretrained(path / "transformer")


SD15_PNDM_SCHEDULER: dict[str, Any] = {
    "_class_name": "PNDMScheduler",
    "_diffusers_version": "0.6.0",
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "beta_start": 0.00085,
    "clip_sample": False,
    "num_train_timesteps": 1000,
    "set_alpha_to_one": False,
    "skip_prk_steps": True,
    "steps_offset": 1,
    "trained_betas": None,
}
"""scheduler/scheduler_config.json of stable-diffusion-v1-5 as published (a PNDM config that DDIM reads too)."""


@standin("stable-diffusion-v1-5/stable-diffusion-v1-5")
def sd15(path: Path) -> None:
    """SD 1.5: `mmalign.tiny.sd15.build_tiny_sd15` (UNet, VAE, CLIP text encoder) completed to the published
    layout: the SD 1.5 schedule as a ``PNDMScheduler`` (``skip_prk_steps``), a tiny ``safety_checker/`` and
    ``feature_extractor/``, and ``model_index.json`` naming ``StableDiffusionPipeline``."""
    import diffusers
    from diffusers.pipelines.stable_diffusion.safety_checker import StableDiffusionSafetyChecker
    from transformers import CLIPConfig, CLIPImageProcessor

    from mmalign.tiny.sd15 import build_tiny_sd15

    build_tiny_sd15(path)
    shutil.rmtree(path / "scheduler")
    (path / "scheduler").mkdir()
    _write_json(path / "scheduler/scheduler_config.json", SD15_PNDM_SCHEDULER)
    torch.manual_seed(0)
    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    checker = StableDiffusionSafetyChecker(
        CLIPConfig(
            text_config=small, vision_config={**small, "image_size": 224, "patch_size": 14}, projection_dim=32
        )
    )
    checker.save_pretrained(path / "safety_checker")
    CLIPImageProcessor(
        size={"shortest_edge": 224},
        crop_size={"height": 224, "width": 224},
        image_mean=OPENAI_MEAN,
        image_std=OPENAI_STD,
    ).save_pretrained(path / "feature_extractor")
    _write_json(
        path / "model_index.json",
        {
            "_class_name": "StableDiffusionPipeline",
            "_diffusers_version": diffusers.__version__,
            "feature_extractor": ["transformers", "CLIPImageProcessor"],
            "requires_safety_checker": True,
            "safety_checker": ["stable_diffusion", "StableDiffusionSafetyChecker"],
            "scheduler": ["diffusers", "PNDMScheduler"],
            "text_encoder": ["transformers", "CLIPTextModel"],
            "tokenizer": ["transformers", "CLIPTokenizer"],
            "unet": ["diffusers", "UNet2DConditionModel"],
            "vae": ["diffusers", "AutoencoderKL"],
        },
    )


@standin("black-forest-labs/FLUX.1-dev")
def flux_dev(path: Path) -> None:
    """FLUX.1-dev: `mmalign.tiny.flux.build_tiny_flux` (guidance embedding, CLIP + T5, ``FluxPipeline``)."""
    from mmalign.tiny.flux import build_tiny_flux

    build_tiny_flux(path, guidance_embeds=True)


@standin("black-forest-labs/FLUX.1-Kontext-dev")
def flux_kontext(path: Path) -> None:
    """FLUX.1 Kontext-dev: the FLUX.1-dev stand-in with ``model_index.json`` naming ``FluxKontextPipeline``."""
    from mmalign.policies.flux_kontext import mark_kontext_folder

    flux_dev(path)
    mark_kontext_folder(path)


@standin("Qwen/Qwen-Image-Edit-2509", "Qwen/Qwen-Image-Edit-2511")
def qwen_image_edit_plus(path: Path) -> None:
    """Qwen-Image-Edit-2509 / 2511: `mmalign.tiny.qwen_image_edit_plus.build_tiny_qwen_image_edit_plus`
    (``model_index.json`` naming ``QwenImageEditPlusPipeline``, ``processor/`` included)."""
    from mmalign.tiny.qwen_image_edit_plus import build_tiny_qwen_image_edit_plus

    build_tiny_qwen_image_edit_plus(path)


@standin("Tongyi-MAI/Z-Image-Turbo")
def z_image_turbo(path: Path) -> None:
    """Z-Image-Turbo: `mmalign.tiny.z_image.build_tiny_z_image` (Qwen3 text encoder, FLUX.1's VAE layout, the
    Turbo scheduler config)."""
    from mmalign.tiny.z_image import build_tiny_z_image

    build_tiny_z_image(path)


@standin("black-forest-labs/FLUX.2-dev")
def flux2_dev(path: Path) -> None:
    """FLUX.2 [dev]: `mmalign.tiny.flux2.build_tiny_flux2` (Mistral3 text encoder with its PixtralProcessor,
    guidance embedding, ``Flux2Pipeline``)."""
    from mmalign.tiny.flux2 import build_tiny_flux2

    build_tiny_flux2(path)


@standin("black-forest-labs/FLUX.2-klein-base-4B")
def flux2_klein_base(path: Path) -> None:
    """FLUX.2 [klein] base 4B: `mmalign.tiny.flux2.build_tiny_flux2` with a Qwen3 text encoder
    (``Flux2KleinPipeline``, ``is_distilled`` false: CFG applies)."""
    from mmalign.tiny.flux2 import build_tiny_flux2

    build_tiny_flux2(path, klein=True, is_distilled=False)


@standin("Qwen/Qwen-Image")
def qwen_image(path: Path) -> None:
    """Qwen-Image: `mmalign.tiny.qwen_image.build_tiny_qwen_image` (Qwen2.5-VL text encoder, Qwen-Image VAE)."""
    from mmalign.tiny.qwen_image import build_tiny_qwen_image

    build_tiny_qwen_image(path)


@standin("Qwen/Qwen-Image-Edit")
def qwen_image_edit(path: Path) -> None:
    """Qwen-Image-Edit: `mmalign.tiny.qwen_image_edit.build_tiny_qwen_image_edit` (``processor/`` included)."""
    from mmalign.tiny.qwen_image_edit import build_tiny_qwen_image_edit

    build_tiny_qwen_image_edit(path)


@standin("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "Wan-AI/Wan2.1-T2V-14B-Diffusers")
def wan21_t2v(path: Path) -> None:
    """Wan2.1 T2V: `mmalign.tiny.wan.build_tiny_wan` with the UniPC scheduler the real folders ship."""
    from mmalign.tiny.wan import build_tiny_wan

    build_tiny_wan(path, scheduler="unipc")


@standin("Wan-AI/Wan2.1-VACE-1.3B-diffusers")
def wan21_vace(path: Path) -> None:
    """Wan2.1 VACE: ``WanVACETransformer3DModel`` (`build_tiny_wan` ``condition="vace"``), UniPC scheduler."""
    from mmalign.tiny.wan import build_tiny_wan

    build_tiny_wan(path, condition="vace", scheduler="unipc")


@standin("Wan-AI/Wan2.1-I2V-14B-480P-Diffusers")
def wan21_i2v(path: Path) -> None:
    """Wan2.1 I2V: first-frame conditioning plus a CLIP ``image_encoder/`` and ``image_processor/``."""
    from mmalign.tiny.wan import build_tiny_wan

    build_tiny_wan(path, condition="i2v")


@standin("Wan-AI/Wan2.2-I2V-A14B-Diffusers")
def wan22_i2v(path: Path) -> None:
    """Wan2.2 I2V A14B: two experts (``transformer_2``, ``boundary_ratio``), no CLIP image encoder."""
    from mmalign.tiny.wan import build_tiny_wan

    build_tiny_wan(path, condition="i2v", two_experts=True, image_encoder=False)


@standin("hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v")
def hunyuan_video15_t2v(path: Path) -> None:
    """HunyuanVideo 1.5 480p T2V: `mmalign.tiny.hunyuan_video15.build_tiny_hunyuan_video15` (``model_index.json``
    naming ``HunyuanVideo15Pipeline``, Qwen2.5-VL text model, ByT5, ``guider/``)."""
    from mmalign.tiny.hunyuan_video15 import build_tiny_hunyuan_video15

    build_tiny_hunyuan_video15(path)


@standin("hunyuanvideo-community/HunyuanVideo-1.5-480p_i2v")
def hunyuan_video15_i2v(path: Path) -> None:
    """HunyuanVideo 1.5 480p I2V: `mmalign.tiny.hunyuan_video15.build_tiny_hunyuan_video15_i2v` (``model_index.json``
    naming ``HunyuanVideo15ImageToVideoPipeline``, plus a SigLIP ``image_encoder/`` and ``feature_extractor/``)."""
    from mmalign.tiny.hunyuan_video15 import build_tiny_hunyuan_video15_i2v

    build_tiny_hunyuan_video15_i2v(path)


# ----------------------------------------------------------------------------- reward models


def tiny_clip(
    image_size: int = 224, patch: int = 14, hidden: int = 32, projection: int = 32
) -> tuple[Any, Any]:
    """(a random ``CLIPModel`` at the real ViT-L/14 input size (224 px, patch 14, 77 text positions), the
    byte-level ``CLIPTokenizer`` of `mmalign.tiny.sd3`)."""
    from transformers import CLIPConfig, CLIPModel

    from mmalign.tiny.sd3 import clip_byte_tokenizer

    tok = clip_byte_tokenizer(max_length=77)
    torch.manual_seed(0)
    model = CLIPModel(
        CLIPConfig(
            text_config=dict(
                vocab_size=len(tok),
                hidden_size=hidden,
                intermediate_size=2 * hidden,
                num_hidden_layers=2,
                num_attention_heads=2,
                max_position_embeddings=77,
                bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            ),
            vision_config=dict(
                image_size=image_size,
                patch_size=patch,
                hidden_size=hidden,
                intermediate_size=2 * hidden,
                num_hidden_layers=2,
                num_attention_heads=2,
            ),
            projection_dim=projection,
        )
    )
    return model, tok


CLIP_PREPROCESSOR: dict[str, Any] = {
    "crop_size": 224,
    "do_center_crop": True,
    "do_normalize": True,
    "do_resize": True,
    "feature_extractor_type": "CLIPFeatureExtractor",
    "image_mean": OPENAI_MEAN,
    "image_std": OPENAI_STD,
    "resample": 3,
    "size": 224,
}
"""preprocessor_config.json of openai/clip-vit-large-patch14 as published (legacy integer sizes, a
``CLIPFeatureExtractor``)."""


@standin("openai/clip-vit-large-patch14", "laion/CLIP-ViT-H-14-laion2B-s32B-b79K")
def clip_with_processor(path: Path) -> None:
    """A CLIP repository: ``CLIPModel`` (`tiny_clip`), tokenizer files and `CLIP_PREPROCESSOR`."""
    model, tok = tiny_clip()
    model.save_pretrained(path)
    tok.save_pretrained(path)
    _write_json(path / "preprocessor_config.json", CLIP_PREPROCESSOR)


@standin("yuvalkirstain/PickScore_v1")
def pickscore(path: Path) -> None:
    """PickScore_v1 as published: a ``CLIPModel``'s config and weights only (its processor is laion's)."""
    model, _ = tiny_clip()
    torch.manual_seed(1)
    model.save_pretrained(path)


@standin("Falconsai/nsfw_image_detection")
def nsfw_classifier(path: Path) -> None:
    """``ViTForImageClassification`` (labels ``normal`` / ``nsfw``, 224 px, patch 16) + ``ViTImageProcessor``."""
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor

    torch.manual_seed(0)
    model = ViTForImageClassification(
        ViTConfig(
            image_size=224,
            patch_size=16,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            id2label={0: "normal", 1: "nsfw"},
            label2id={"normal": 0, "nsfw": 1},
        )
    )
    model.save_pretrained(path)
    ViTImageProcessor(
        size={"height": 224, "width": 224}, image_mean=[0.5] * 3, image_std=[0.5] * 3
    ).save_pretrained(path)


# ----------------------------------------------------------------------------- datasets


def _parquet(file: Path, rows: list[dict[str, Any]], features: Any = None) -> None:
    """`rows` as one parquet shard at `file` (through `datasets`, which encodes Image features as the hub does)."""
    import datasets

    file.parent.mkdir(parents=True, exist_ok=True)
    datasets.Dataset.from_list(rows, features=features).to_parquet(str(file))


def _readme(path: Path, configs: dict[str, dict[str, str]]) -> None:
    """README.md whose YAML front matter declares each configuration's split files, as the hub's dataset cards
    do (``configs: - config_name: main  data_files: - split: train  path: main/train-*``)."""
    lines = ["---", "configs:"]
    for name, splits in configs.items():
        lines += [f"- config_name: {name}", "  data_files:"]
        for split, pattern in splits.items():
            lines += [f"  - split: {split}", f"    path: {pattern}"]
    (path / "README.md").write_text(
        "\n".join([*lines, "---", "", "Stand-in (tests/e2e/hub_standins.py).", ""])
    )


def gsm8k_rows(pairs: Iterable[tuple[int, int]]) -> list[dict[str, str]]:
    """GSM8K rows (``question``, ``answer`` = worked solution ending in ``#### N``) of the `GSM8K_QUESTION` sums."""
    return [
        {
            "question": GSM8K_QUESTION.format(a=a, b=b),
            "answer": f"Natalia sold {a}+{b} = <<{a}+{b}={a + b}>>{a + b} clips altogether.\n#### {a + b}",
        }
        for a, b in pairs
    ]


@standin("openai/gsm8k", table=DATASET_STANDINS)
def gsm8k(path: Path) -> None:
    """openai/gsm8k: configurations ``main`` and ``socratic``, each ``{train,test}-00000-of-00001.parquet``."""
    train = gsm8k_rows((a, b) for a in range(1, 6) for b in range(1, 6))
    test = gsm8k_rows([(1, 2), (2, 2), (3, 1), (4, 5)])
    for config in ("main", "socratic"):
        _parquet(path / config / "train-00000-of-00001.parquet", train)
        _parquet(path / config / "test-00000-of-00001.parquet", test)
    _readme(path, {c: {"train": f"{c}/train-*", "test": f"{c}/test-*"} for c in ("main", "socratic")})


@standin("nateraw/parti-prompts", table=DATASET_STANDINS)
def parti_prompts(path: Path) -> None:
    """nateraw/parti-prompts: one ``train`` split with ``Prompt``, ``Category``, ``Challenge``, ``Note``."""
    prompts = [
        ("a red apple next to a blue cup", "Food & Beverage", "Colors"),
        ("a cat sitting on a wooden chair", "Animals", "Simple Detail"),
        ("a lighthouse on a cliff at dusk", "Outdoor Scenes", "Perspective"),
        ('a sign that says "hello"', "Artifacts", "Writing & Symbols"),
    ]
    rows = [{"Prompt": p, "Category": c, "Challenge": ch, "Note": ""} for p, c, ch in prompts]
    _parquet(path / "data" / "train-00000-of-00001.parquet", rows)
    _readme(path, {"default": {"train": "data/train-*"}})


@standin("hiyouga/geometry3k", table=DATASET_STANDINS)
def geometry3k(path: Path) -> None:
    """hiyouga/geometry3k: ``train`` / ``validation`` / ``test`` with ``images`` (a list of PNG diagrams, hub
    Image features), ``problem`` (``<image>`` + text) and ``answer``."""
    import datasets
    from PIL import Image, ImageDraw

    def diagram(i: int) -> Image.Image:
        img = Image.new("RGB", (112, 84), "white")
        d = ImageDraw.Draw(img)
        d.polygon([(10, 74), (100, 74), (10 + 8 * i, 10)], outline="black")
        d.text((50, 76), str(3 + i), fill="black")
        return img

    features = datasets.Features(
        {
            "images": datasets.Sequence(datasets.Image()),
            "problem": datasets.Value("string"),
            "answer": datasets.Value("string"),
        }
    )
    for split, n in (("train", 6), ("validation", 2), ("test", 3)):
        rows = [
            {"images": [diagram(i)], "problem": f"<image>Find x. The base is {3 + i}.", "answer": str(3 + i)}
            for i in range(n)
        ]
        _parquet(path / "data" / f"{split}-00000-of-00001.parquet", rows, features)
    _readme(path, {"default": {s: f"data/{s}-*" for s in ("train", "validation", "test")}})
