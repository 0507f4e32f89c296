"""Real data by id (issue 34, item 3): `hf:<id>[:<config>]:<split>` sources read through `datasets` from an
offline Hugging Face cache, each known dataset's hub schema mapped onto the pipeline's columns (GSM8K's
``#### 72``, MATH's ``\\boxed{}``, Geometry3K's images, RefCOCO's boxes, PartiPrompts' ``Prompt``), and the
missing-file message naming the ``hf:`` source or the command that writes the file.

The stand-ins have the real schema (column names, types, the answer format, the repository's file layout) with
hand-written rows, and are read through the same path as a hub id on a machine that loaded the dataset before
(``HF_HOME/datasets``, as `datasets.load_dataset` prepares it) or downloaded it with
``hf download ID --repo-type dataset`` (``HF_HOME/hub``): `write_hub_dataset` and `write_prepared_dataset`
write those two layouts, and `STANDINS` builds each known dataset's stand-in (the e2e tests of the real
configs can reuse them).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

datasets = pytest.importorskip("datasets")

from mmalign.config import ConfigError, load_config  # noqa: E402
from mmalign.data import rows as data_mod  # noqa: E402
from mmalign.data.rows import DataError, load_rows, missing_data_hint, parse_hf_source  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

# ----------------------------------------------------------------------------- the two cache layouts


def commit_of(repo_id: str) -> str:
    """A fixed 40-hex "commit" per dataset id (the snapshot folder's name and refs/main)."""
    return hashlib.sha1(f"mmalign-dataset-standin:{repo_id}".encode()).hexdigest()


def write_hub_dataset(hf_home: Path, repo_id: str, files: dict[str, bytes | str]) -> Path:
    """A dataset repository in the hub cache as `hf download REPO --repo-type dataset` leaves it
    (``HF_HOME/hub/datasets--org--name/{refs/main, snapshots/<commit>/...}``) holding `files` (path in the
    repository -> content); returns the snapshot folder."""
    folder = hf_home / "hub" / f"datasets--{repo_id.replace('/', '--')}"
    snapshot = folder / "snapshots" / commit_of(repo_id)
    for name, content in files.items():
        path = snapshot / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / "main").write_text(commit_of(repo_id))
    return snapshot


def write_prepared_dataset(hf_home: Path, repo_id: str, config: str, splits: dict[str, Any]) -> Path:
    """A hub dataset as `datasets.load_dataset(repo_id, config)` prepares it on its first online load: the
    parquet builder's Arrow files and dataset_info.json under ``HF_HOME/datasets/<org>___<name>/<config>/0.0.0/
    <hash>/`` (what `datasets` reads by id offline). `splits`: split name -> `datasets.Dataset`."""
    from datasets.naming import camelcase_to_snakecase
    from datasets.packaged_modules.parquet.parquet import Parquet

    src = hf_home / "prepared-src" / repo_id.replace("/", "--") / config
    src.mkdir(parents=True, exist_ok=True)
    files = {}
    for split, ds in splits.items():
        ds.to_parquet(str(src / f"{split}.parquet"))
        files[split] = str(src / f"{split}.parquet")
    org, name = repo_id.split("/")
    out = (
        hf_home
        / "datasets"
        / f"{org}___{camelcase_to_snakecase(name)}"
        / config
        / "0.0.0"
        / commit_of(repo_id)[:16]
    )
    builder = Parquet(
        cache_dir=str(hf_home / "builder-tmp"), dataset_name=name, config_name=config, data_files=files
    )
    builder.download_and_prepare(output_dir=str(out))
    return out


def parquet_bytes(ds: Any) -> bytes:
    """`ds` as one parquet file (the hub's ``data/<split>-00000-of-00001.parquet``)."""
    buf = io.BytesIO()
    ds.to_parquet(buf)
    return buf.getvalue()


def readme(configs: dict[str, dict[str, str]]) -> str:
    """A dataset card whose YAML lists `configs` (config name -> split -> file pattern), as the hub's do."""
    lines = ["---", "configs:"]
    for name, splits in configs.items():
        lines += [f"- config_name: {name}", "  data_files:"]
        lines += [f"  - split: {split}\n    path: {pattern}" for split, pattern in splits.items()]
    return "\n".join([*lines, "---", ""])


def png(width: int, height: int, color: tuple[int, int, int] = (200, 30, 30)) -> Any:
    from PIL import Image

    return Image.new("RGB", (width, height), color)


# ----------------------------------------------------------------------------- the stand-ins (real schemas)

GSM8K_TRAIN = [
    {
        "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
        "How many clips did Natalia sell altogether in April and May?",
        "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
        "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72",
    },
    {
        "question": "A shop sold 1,200 pens on Monday and 350 on Tuesday. How many pens did it sell?",
        "answer": "It sold 1,200 + 350 = <<1200+350=1550>>1,550 pens.\n#### 1,550",
    },
]
GSM8K_TEST = [
    {"question": "Janet has 3 apples and buys 4 more. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"}
]


def gsm8k_repo() -> dict[str, bytes | str]:
    """openai/gsm8k: configs `main` and `socratic`, each main/train-00000-of-00001.parquet and test; columns
    question, answer (the worked solution ending in ``#### <number>``)."""
    files: dict[str, bytes | str] = {}
    for config in ("main", "socratic"):
        files[f"{config}/train-00000-of-00001.parquet"] = parquet_bytes(
            datasets.Dataset.from_list(GSM8K_TRAIN)
        )
        files[f"{config}/test-00000-of-00001.parquet"] = parquet_bytes(datasets.Dataset.from_list(GSM8K_TEST))
    files["README.md"] = readme(
        {c: {"train": f"{c}/train-*", "test": f"{c}/test-*"} for c in ("main", "socratic")}
    )
    return files


MATH_TRAIN = [
    {
        "problem": "What is $\\frac{1}{4} + \\frac{1}{4}$?",
        "level": "Level 1",
        "type": "Prealgebra",
        "solution": "We add: $\\frac{1}{4}+\\frac{1}{4}=\\frac{2}{4}=\\boxed{\\frac{1}{2}}$.",
    },
    {"problem": "Is 7 prime?", "level": "Level 1", "type": "Number Theory", "solution": "Yes, 7 is prime."},
    {
        "problem": "Compute $2^{10}$.",
        "level": "Level 2",
        "type": "Algebra",
        "solution": "$2^{10} = \\boxed{1024}$.",
    },
]


def math_lighteval_repo() -> dict[str, bytes | str]:
    """DigitalLearningGmbH/MATH-lighteval: problem, level, type, solution (the answer only inside \\boxed{})."""
    ds = datasets.Dataset.from_list(MATH_TRAIN)
    return {
        "data/train-00000-of-00001.parquet": parquet_bytes(ds),
        "data/test-00000-of-00001.parquet": parquet_bytes(ds.select([0])),
        "README.md": readme({"default": {"train": "data/train-*", "test": "data/test-*"}}),
    }


def math500_repo() -> dict[str, bytes | str]:
    """HuggingFaceH4/MATH-500: problem, solution, answer, subject, level (int), unique_id; one split, test."""
    row = {
        "problem": "Convert the point $(0,3)$ to polar coordinates.",
        "solution": "We get $r = 3$ and $\\theta = \\frac{\\pi}{2}$: $\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}$.",
        "answer": "\\left( 3, \\frac{\\pi}{2} \\right)",
        "subject": "Precalculus",
        "level": 2,
        "unique_id": "test/precalculus/807.json",
    }
    return {
        "test.jsonl": json.dumps(row) + "\n",
        "README.md": readme({"default": {"test": "test.jsonl"}}),
    }


def geometry3k_repo() -> dict[str, bytes | str]:
    """hiyouga/geometry3k: images (a list of images), problem (with an ``<image>`` placeholder), answer, id,
    choices, ground_truth; splits train / validation / test."""
    features = datasets.Features(
        {
            "images": datasets.Sequence(datasets.Image()),
            "problem": datasets.Value("string"),
            "answer": datasets.Value("string"),
            "id": datasets.Value("int64"),
            "choices": datasets.Sequence(datasets.Value("string")),
            "ground_truth": datasets.Value("string"),
        }
    )
    rows = {
        "images": [[png(40, 30)], [png(24, 24, (10, 120, 10))]],
        "problem": ["<image>Find x. Round to the nearest tenth.", "<image>Find the area of the square."],
        "answer": ["8.5", "2\\sqrt{3}"],
        "id": [2101, 7],
        "choices": [["7.5", "8.5", "9.5", "10.5"], ["12", "2\\sqrt{3}", "6", "9"]],
        "ground_truth": ["B", "B"],
    }
    ds = datasets.Dataset.from_dict(rows, features=features)
    return {
        "data/train-00000-of-00001.parquet": parquet_bytes(ds),
        "data/validation-00000-of-00001.parquet": parquet_bytes(ds.select([1])),
        "data/test-00000-of-00001.parquet": parquet_bytes(ds.select([1])),
        "README.md": readme(
            {"default": {"train": "data/train-*", "validation": "data/validation-*", "test": "data/test-*"}}
        ),
    }


REFCOCO_IMAGE = "coco/train2014/COCO_train2014_000000000009.jpg"


def refcoco_repo() -> dict[str, bytes | str]:
    """jxu124/refcoco: one row per referred object: image_path (COCO train2014, relative), bbox (x1, y1, x2,
    y2 in pixels), captions (its referring expressions), sentences, raw_image_info (COCO's image JSON), ..."""
    row = {
        "sent_ids": [0, 1],
        "file_name": "COCO_train2014_000000000009_1.jpg",
        "ann_id": 1,
        "ref_id": 0,
        "image_id": 9,
        "split": "train",
        "sentences": [
            {
                "raw": "The dog on the left",
                "sent": "the dog on the left",
                "sent_id": 0,
                "tokens": ["the", "dog"],
            },
            {"raw": "left dog", "sent": "left dog", "sent_id": 1, "tokens": ["left", "dog"]},
        ],
        "category_id": 18,
        "raw_anns": json.dumps({"bbox": [10.0, 20.0, 40.0, 40.0], "category_id": 18, "id": 1}),
        "raw_image_info": json.dumps(
            {"file_name": "COCO_train2014_000000000009.jpg", "width": 64, "height": 80}
        ),
        "raw_sentences": "[]",
        "image_path": REFCOCO_IMAGE,
        "bbox": [10.0, 20.0, 50.0, 60.0],
        "captions": ["the dog on the left", "left dog"],
        "global_image_id": "coco.9",
        "anns_id": "1",
    }
    ds = datasets.Dataset.from_list([row])
    return {
        "data/train-00000-of-00001.parquet": parquet_bytes(ds),
        "data/validation-00000-of-00001.parquet": parquet_bytes(ds),
        "README.md": readme({"default": {"train": "data/train-*", "validation": "data/validation-*"}}),
    }


def lmms_refcoco_repo() -> dict[str, bytes | str]:
    """lmms-lab/RefCOCO: question_id, image (in the row), question, answer (the referring expressions), segmentation,
    bbox (COCO's x, y, width, height), iscrowd, file_name; evaluation splits only (val, test, testA, testB)."""
    features = datasets.Features(
        {
            "question_id": datasets.Value("string"),
            "image": datasets.Image(),
            "question": datasets.Value("string"),
            "answer": datasets.Sequence(datasets.Value("string")),
            "segmentation": datasets.Sequence(datasets.Value("float32")),
            "bbox": datasets.Sequence(datasets.Value("float32")),
            "iscrowd": datasets.Value("int8"),
            "file_name": datasets.Value("string"),
        }
    )
    ds = datasets.Dataset.from_dict(
        {
            "question_id": ["1"],
            "image": [png(64, 80)],
            "question": [
                "Please carefully observe the area circled in the image and come up with a caption."
            ],
            "answer": [["the dog on the left", "left dog"]],
            "segmentation": [[10.0, 20.0, 40.0, 20.0, 40.0, 60.0]],
            "bbox": [[10.0, 20.0, 30.0, 40.0]],
            "iscrowd": [0],
            "file_name": ["COCO_train2014_000000000009.jpg"],
        },
        features=features,
    )
    return {
        "data/val-00000-of-00001.parquet": parquet_bytes(ds),
        "README.md": readme({"default": {"val": "data/val-*"}}),
    }


PARTI_TSV = (
    "Prompt\tCategory\tChallenge\tNote\n"
    "bond\tAbstract\tBasic\tBiology-inspired concepts with multiple meanings\n"
    "a red apple next to a blue cup\tProduce & Plants\tColor\t\n"
)


def parti_repo() -> dict[str, bytes | str]:
    """nateraw/parti-prompts: one file, PartiPrompts.tsv (Prompt, Category, Challenge, Note), and a card without
    a configs section (the split is `train`)."""
    return {"PartiPrompts.tsv": PARTI_TSV, "README.md": "---\nlicense: apache-2.0\n---\n# PartiPrompts\n"}


STANDINS: dict[str, Callable[[], dict[str, bytes | str]]] = {
    "openai/gsm8k": gsm8k_repo,
    "DigitalLearningGmbH/MATH-lighteval": math_lighteval_repo,
    "HuggingFaceH4/MATH-500": math500_repo,
    "hiyouga/geometry3k": geometry3k_repo,
    "jxu124/refcoco": refcoco_repo,
    "lmms-lab/RefCOCO": lmms_refcoco_repo,
    "nateraw/parti-prompts": parti_repo,
}
"""Dataset id -> the files of its stand-in repository (real column names, types, answer formats, layout)."""


@pytest.fixture
def hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty offline Hugging Face home: ``HF_HOME``, ``HF_HUB_OFFLINE=1`` for this process (huggingface_hub's
    and `datasets`' own flags, which they read at import) and its children; the working directory is `tmp_path`."""
    from huggingface_hub import constants

    home = tmp_path / "hf_home"
    home.mkdir()
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", home / "datasets")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    return home


def standin(hf_home: Path, repo_id: str) -> Path:
    return write_hub_dataset(hf_home, repo_id, STANDINS[repo_id]())


# ----------------------------------------------------------------------------- the spec


def test_spec_form_config_before_split() -> None:
    assert parse_hf_source("hf:openai/gsm8k:main:test") == data_mod.HFSource("openai/gsm8k", "main", "test")
    assert parse_hf_source("hf:openai/gsm8k") == data_mod.HFSource("openai/gsm8k", "main", "train")  # known
    assert parse_hf_source("hf:org/other:validation") == data_mod.HFSource("org/other", None, "validation")
    for bad in ("hf:", "hf:a:b:c:d", "hf:a::train", "hf:a:"):
        with pytest.raises(DataError, match=r"expected hf:<dataset id or folder>\[:<config>\]:<split>"):
            parse_hf_source(bad)


# ----------------------------------------------------------------------------- text: GSM8K, MATH


def test_gsm8k_by_id_from_the_hub_cache_gives_the_final_answer(hf_home: Path) -> None:
    """The real config's `data.train` read as the pipeline reads it: ``#### 72`` -> answer "72", the worked
    solution in `solution`, the question as the prompt; the config's accuracy reward scores \\boxed{72}."""
    from rewards.text import AnswerAccuracy

    standin(hf_home, "openai/gsm8k")
    cfg = load_config(ROOT / "configs" / "text_reasoning.yaml")
    assert cfg.data.train == "hf:openai/gsm8k:main:train" and cfg.data.eval == "hf:openai/gsm8k:main:test"
    rows = load_rows(cfg.data.train, cfg.data.prompt_template, cfg.data.max_rows)
    assert [r["answer"] for r in rows] == ["72", "1,550"]
    assert rows[0]["prompt"] == GSM8K_TRAIN[0]["question"] and rows[0]["solution"] == GSM8K_TRAIN[0]["answer"]
    assert rows[0]["_source"] == "hf:openai/gsm8k:main:train[0]"
    assert [r["answer"] for r in load_rows(cfg.data.eval, cfg.data.prompt_template)] == ["7"]
    assert [r["answer"] for r in load_rows("hf:openai/gsm8k")] == ["72", "1,550"]  # default config and split

    kwargs = next(r.kwargs for r in cfg.rewards if r.name == "answer_accuracy")
    reward = AnswerAccuracy(**kwargs)
    assert reward.score("48 + 24 = 72, so \\boxed{72}", rows[0]["answer"]) == 1.0
    assert reward.score("\\boxed{71}", rows[0]["answer"]) == 0.0
    assert reward.score("so \\boxed{1550}", rows[1]["answer"]) == 1.0


def test_gsm8k_by_id_from_the_prepared_datasets_cache(hf_home: Path) -> None:
    """What a first online `load_dataset("openai/gsm8k", "main")` leaves in HF_HOME/datasets is read by id."""
    write_prepared_dataset(
        hf_home,
        "openai/gsm8k",
        "main",
        {"train": datasets.Dataset.from_list(GSM8K_TRAIN), "test": datasets.Dataset.from_list(GSM8K_TEST)},
    )
    assert not (hf_home / "hub").exists()
    rows = load_rows("hf:openai/gsm8k:main:test")
    assert [(r["question"], r["answer"]) for r in rows] == [(GSM8K_TEST[0]["question"], "7")]
    msg = str(pytest.raises(DataError, load_rows, "hf:openai/gsm8k:socratic:train").value)
    assert "socratic" in msg and "['main']" in msg and f"name the configuration: {data_mod.HF_FORM}" in msg


def test_gsm8k_config_and_split_errors_name_the_form(hf_home: Path) -> None:
    standin(hf_home, "openai/gsm8k")
    msg = str(pytest.raises(DataError, load_rows, "hf:openai/gsm8k:train:main").value)
    assert msg.startswith("hf:openai/gsm8k:train:main: cannot load the dataset")
    assert "the split comes last: hf:openai/gsm8k:main:train?" in msg
    msg = str(pytest.raises(DataError, load_rows, "hf:openai/gsm8k:main:validation").value)
    assert "validation" in msg and "'train', 'test'" in msg


def test_a_row_without_the_final_answer_is_left_out_and_counted(hf_home: Path, caplog) -> None:
    bad = {"question": "q", "answer": "no final line"}
    write_hub_dataset(
        hf_home,
        "openai/gsm8k",
        {
            "main/train-00000-of-00001.parquet": parquet_bytes(
                datasets.Dataset.from_list([bad, GSM8K_TRAIN[0]])
            ),
            "README.md": readme({"main": {"train": "main/train-*"}}),
        },
    )
    with caplog.at_level(logging.WARNING, logger="mmalign.data.rows"):
        rows = load_rows("hf:openai/gsm8k:main:train")
    assert [r["answer"] for r in rows] == ["72"] and rows[0]["_source"].endswith("[1]")
    assert "left out 1 hub row(s) (1 with its 'answer' has no '#### <final answer>' line)" in caplog.text


def test_a_hub_schema_change_is_an_error_naming_the_columns(hf_home: Path) -> None:
    write_hub_dataset(
        hf_home,
        "openai/gsm8k",
        {
            "main/train-00000-of-00001.parquet": parquet_bytes(
                datasets.Dataset.from_list([{"question": "q"}])
            ),
            "README.md": readme({"main": {"train": "main/train-*"}}),
        },
    )
    msg = str(pytest.raises(DataError, load_rows, "hf:openai/gsm8k:main:train").value)
    assert msg.startswith(
        "hf:openai/gsm8k:main:train[0]: does not have the schema mmalign maps for openai/gsm8k"
    )
    assert "hub columns: ['question']" in msg


def test_math_answer_from_the_boxed_solution(hf_home: Path, caplog) -> None:
    standin(hf_home, "DigitalLearningGmbH/MATH-lighteval")
    with caplog.at_level(logging.WARNING, logger="mmalign.data.rows"):
        rows = load_rows("hf:DigitalLearningGmbH/MATH-lighteval:train")
    assert [(r["prompt"], r["answer"]) for r in rows] == [
        ("What is $\\frac{1}{4} + \\frac{1}{4}$?", "\\frac{1}{2}"),
        ("Compute $2^{10}$.", "1024"),
    ]
    assert rows[0]["level"] == "Level 1" and rows[1]["_source"].endswith("[2]")
    assert "1 with its 'solution' has no \\boxed{} answer" in caplog.text

    from rewards.text import AnswerAccuracy

    assert AnswerAccuracy(extract="boxed").score("so $\\boxed{0.5}$", rows[0]["answer"]) == 1.0


def test_math500_keeps_its_answer_column(hf_home: Path) -> None:
    standin(hf_home, "HuggingFaceH4/MATH-500")
    (row,) = load_rows("hf:HuggingFaceH4/MATH-500:test")
    assert row["prompt"] == "Convert the point $(0,3)$ to polar coordinates."
    assert row["answer"] == "\\left( 3, \\frac{\\pi}{2} \\right)" and row["level"] == 2


# ----------------------------------------------------------------------------- VLM: Geometry3K


def test_geometry3k_rows_hold_their_images_and_a_question_without_the_placeholder(hf_home: Path) -> None:
    from pipelines.common import VLMOptions, load_vlm_rows

    standin(hf_home, "hiyouga/geometry3k")
    cfg = load_config(ROOT / "configs" / "vlm_reasoning.yaml")
    assert cfg.data.train == "hf:hiyouga/geometry3k:train"
    rows = load_vlm_rows(cfg.data.train, cfg.data.prompt_template, cfg.options)
    assert [r["prompt"] for r in rows] == [
        "Find x. Round to the nearest tenth.",
        "Find the area of the square.",
    ]
    assert [r["answer"] for r in rows] == ["8.5", "2\\sqrt{3}"]
    assert [[im.size for im in r["images"]] for r in rows] == [[(40, 30)], [(24, 24)]]
    assert rows[1]["images"][0].getpixel((0, 0)) == (10, 120, 10)
    assert rows[0]["choices"] == ["7.5", "8.5", "9.5", "10.5"]
    (test_row,) = load_vlm_rows(cfg.data.eval, cfg.data.prompt_template, VLMOptions())
    assert test_row["answer"] == "2\\sqrt{3}"


# ----------------------------------------------------------------------------- grounding: RefCOCO


def test_refcoco_by_id_gives_one_grounding_row_per_caption(hf_home: Path, tmp_path: Path) -> None:
    """jxu124/refcoco's x1, y1, x2, y2 pixel box, relative COCO path and image size reach the grounding rows."""
    from pipelines.grounding.data import GroundingOptions, load_grounding_rows

    standin(hf_home, "jxu124/refcoco")
    root = tmp_path / "coco_root"
    (root / REFCOCO_IMAGE).parent.mkdir(parents=True)
    png(64, 80).save(root / REFCOCO_IMAGE)
    rows = load_grounding_rows(
        "hf:jxu124/refcoco:train", "Locate {expression}.", GroundingOptions(image_root=str(root))
    )
    assert [r["prompt"] for r in rows] == ["Locate the dog on the left.", "Locate left dog."]
    assert all(
        r["boxes"] == [[10.0, 20.0, 50.0, 60.0]] and r["box"] == [10.0, 20.0, 50.0, 60.0] for r in rows
    )
    assert all(r["images"] == [str(root / REFCOCO_IMAGE)] for r in rows)
    assert all((r["image_width"], r["image_height"]) == (64, 80) for r in rows)
    assert [r["_source"] for r in rows] == ["hf:jxu124/refcoco:train[0]"] * 2


def test_lmms_refcoco_converts_the_coco_xywh_box(hf_home: Path) -> None:
    """lmms-lab/RefCOCO's bbox [10, 20, 30, 40] is x, y, width, height: the box is [10, 20, 40, 60]."""
    from pipelines.grounding.data import GroundingOptions, load_grounding_rows

    standin(hf_home, "lmms-lab/RefCOCO")
    rows = load_grounding_rows("hf:lmms-lab/RefCOCO:val", "Locate {expression}.", GroundingOptions())
    assert [r["expression"] for r in rows] == ["the dog on the left", "left dog"]
    assert all(r["boxes"] == [[10.0, 20.0, 40.0, 60.0]] for r in rows)
    assert all(
        r["images"][0].size == (64, 80) and (r["image_width"], r["image_height"]) == (64, 80) for r in rows
    )


# ----------------------------------------------------------------------------- text-to-image: PartiPrompts


@pytest.mark.parametrize("config", ["text_to_image.yaml", "qwen_image.yaml"])
def test_parti_prompts_by_id_from_its_tsv(hf_home: Path, config: str) -> None:
    from pipelines.common import load_prompts

    standin(hf_home, "nateraw/parti-prompts")
    cfg = load_config(ROOT / "configs" / config)
    assert cfg.data.train == "hf:nateraw/parti-prompts:train"
    rows = load_prompts(cfg.data.train, cfg.data.prompt_template)
    assert [r["prompt"] for r in rows] == ["bond", "a red apple next to a blue cup"]
    assert rows[1]["Challenge"] == "Color" and rows[0]["Category"] == "Abstract"


def test_every_hf_source_of_a_real_config_is_a_known_dataset() -> None:
    """A real config's hub data gets the mapping tested above (a new id needs an entry and a stand-in here)."""
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        cfg = load_config(path)
        for source in (cfg.data.train, cfg.data.eval):
            if source and source.startswith("hf:"):
                src = parse_hf_source(source)
                assert src.name in data_mod.KNOWN_DATASETS and src.name in STANDINS, (path.name, source)


# ----------------------------------------------------------------------------- not cached, hub unreachable


def test_an_uncached_id_offline_says_how_to_fetch_it(hf_home: Path) -> None:
    msg = str(pytest.raises(DataError, load_rows, "hf:openai/gsm8k:main:train").value)
    assert msg.startswith("hf:openai/gsm8k:main:train: the dataset openai/gsm8k is in neither local cache")
    assert "this process is offline (HF_HUB_OFFLINE=1)" in msg
    assert "hf download openai/gsm8k --repo-type dataset" in msg
    assert "datasets.load_dataset('openai/gsm8k', 'main')" in msg
    assert "`python -m mmalign.data.rows export hf:openai/gsm8k:main:train FILE.jsonl`" in msg


def test_an_unreachable_hub_fails_fast_or_reads_the_cache(hf_home: Path, monkeypatch) -> None:
    """Not offline, the hub refusing connections (a closed port on 127.0.0.1): an uncached id fails in
    seconds (not `datasets`' ~25 s of retries); a cached one is read from the cache."""
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)  # (.ci/run sets both)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    data_mod._hub_problem.cache_clear()
    try:
        start = time.monotonic()
        msg = str(pytest.raises(DataError, load_rows, "hf:nateraw/parti-prompts:train").value)
        assert time.monotonic() - start < 15
        assert "is in neither local cache" in msg and "the hub is not reachable" in msg
        standin(hf_home, "nateraw/parti-prompts")
        assert [r["prompt"] for r in load_rows("hf:nateraw/parti-prompts:train")][0] == "bond"
        assert datasets.config.HF_HUB_OFFLINE is False  # only that load read the caches alone
    finally:
        data_mod._hub_problem.cache_clear()


# ----------------------------------------------------------------------------- missing local files, export


def test_missing_local_file_names_the_hf_source_and_the_export_command(tmp_path: Path, monkeypatch) -> None:
    from mmalign.app.preflight import check_data_files

    monkeypatch.chdir(tmp_path)
    cfg = load_config(ROOT / "configs" / "text_reasoning.yaml", ["data.train=data/gsm8k/train.jsonl"])
    msg = str(pytest.raises(ConfigError, check_data_files, cfg).value)
    assert "key 'data.train': data file not found: data/gsm8k/train.jsonl. To get it: GSM8K by id: " in msg
    assert "data.train=hf:openai/gsm8k:main:train, or write this file: " in msg
    assert msg.endswith(
        "python -m mmalign.data.rows export hf:openai/gsm8k:main:train data/gsm8k/train.jsonl"
    )
    assert "data.eval=hf:openai/gsm8k:main:test" in missing_data_hint(
        "data/gsm8k/test.jsonl", key="data.eval"
    )
    # the loader's own message (code that calls it without the preflight)
    msg = str(pytest.raises(DataError, load_rows, "data/gsm8k/train.jsonl").value)
    assert msg.startswith(
        "data file not found: data/gsm8k/train.jsonl; GSM8K by id: data.train=hf:openai/gsm8k"
    )


@pytest.mark.parametrize(
    ("config", "override", "expected"),
    [
        (
            "medloc.yaml",
            [],
            ["python -m pipelines.grounding.data convert coco|refcoco", "hf:jxu124/refcoco:train"],
        ),
        ("geovis.yaml", [], ["python -m pipelines.grounding.data convert", "hf:jxu124/refcoco:train"]),
        (
            "text_to_image.yaml",
            ["data.train=data/pickscore/train.txt"],
            [
                "dataset/pickscore/{train,test}.txt",
                "github.com/yifan123/flow_grpo",
                "hf:nateraw/parti-prompts:train",
            ],
        ),
        (
            "vlm_reasoning.yaml",
            ["data.train=data/vqa/train.jsonl"],
            ["data.train=hf:hiyouga/geometry3k:train"],
        ),
    ],
)
def test_missing_file_of_each_real_config_says_where_it_comes_from(
    tmp_path: Path, monkeypatch, config: str, override: list[str], expected: list[str]
) -> None:
    from mmalign.app.preflight import check_data_files

    monkeypatch.chdir(tmp_path)
    msg = str(
        pytest.raises(ConfigError, check_data_files, load_config(ROOT / "configs" / config, override)).value
    )
    assert "data file not found" in msg and "To get it: " in msg
    for text in expected:
        assert text in msg, (text, msg)
    if override and override[0].endswith(".txt"):  # export writes JSONL, not a prompt list
        assert "mmalign.data.rows export" not in msg


def test_export_writes_the_rows_the_pipeline_reads(hf_home: Path, tmp_path: Path, capsys) -> None:
    """`python -m mmalign.data.rows export` writes the mapped rows (images as PNG files next to the JSONL); the
    JSONL file then loads as the hub source did."""
    from pipelines.common import VLMOptions, load_vlm_rows

    standin(hf_home, "openai/gsm8k")
    out = tmp_path / "data" / "gsm8k" / "train.jsonl"
    assert data_mod.main(["export", "hf:openai/gsm8k:main:train", str(out)]) == 0
    assert f"wrote 2 rows to {out}" in capsys.readouterr().out
    rows = load_rows(str(out))
    assert [(r["prompt"], r["answer"], r["solution"]) for r in rows] == [
        (g["question"], a, g["answer"]) for g, a in zip(GSM8K_TRAIN, ["72", "1,550"], strict=True)
    ]

    standin(hf_home, "hiyouga/geometry3k")
    out = tmp_path / "data" / "vqa" / "train.jsonl"
    assert data_mod.main(["export", "hf:hiyouga/geometry3k:train", str(out), "--max-rows", "1"]) == 0
    (line,) = out.read_text().splitlines()
    assert json.loads(line)["images"] == ["train_images/000000.png"]
    (row,) = load_vlm_rows(str(out), "{question}", VLMOptions())
    assert row["images"] == [str(out.parent / "train_images" / "000000.png")]
    assert row["prompt"] == "Find x. Round to the nearest tenth." and row["answer"] == "8.5"

    assert data_mod.main(["export", "hf:openai/gsm8k:main:nope", str(tmp_path / "x.jsonl")]) == 1
    assert "error: hf:openai/gsm8k:main:nope: cannot load the dataset" in capsys.readouterr().err


def test_a_local_folder_of_data_files_is_read_as_it_is(tmp_path: Path, hf_home: Path) -> None:
    """A dataset repository downloaded with --local-dir (README configs + parquet) is named by its folder; its
    rows keep the hub columns (the known mapping goes with the hub id)."""
    folder = tmp_path / "gsm8k_copy"
    for name, content in gsm8k_repo().items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    rows = load_rows(f"hf:{folder}:socratic:test")
    assert rows[0]["answer"] == GSM8K_TEST[0]["answer"] and rows[0]["prompt"] == GSM8K_TEST[0]["question"]
