"""Every real config (``configs/<name>.yaml``, not ``-tiny``) runs end to end on the CPU under its real hub ids.

A session fixture writes an offline Hugging Face cache (its own ``HF_HOME``) holding the architecture-faithful
tiny stand-ins of `hub_standins` under exactly the ids the configs name (models, reward models and the ``hf:``
datasets in their hub schema), and a working directory holding small data files in each config's real schema at
the config's own relative paths (``data/rs/train.jsonl`` ...), the repository's ``assets/`` (linked) and the
user plug-in the video-geometry configs name (the ``my_geometry.stitched`` module, ``models/stitched-geometry``).
So no data path is overridden: the configs read their own paths, relative to that working directory.

For each config, as subprocesses (``python -m mmalign``) with ``HF_HOME`` the fixture's, ``HF_HUB_OFFLINE=1``
and ``OMP_NUM_THREADS=1`` (the real ``from_pretrained(id)`` path through huggingface_hub's cache runs):

1. ``train`` for 2 steps with only the size overrides of `SIZES` (the config's own LoRA targets, dtype,
   gradient checkpointing, rewards and algorithm), checking that both steps are logged, a checkpoint is
   written and at least one step updated the weights (a ``grad_norm`` is logged);
2. ``train --resume trainer.steps=3``: step 3 is added to the same run;
3. ``eval`` (base vs the checkpoint: ``eval.json``), 4. ``sample`` (``samples_cli/``), 5. ``plan``.

`SIZES` is the one place listing what differs from the real configs: sizes (group size, prompts per step,
tokens, pixels, frames) and, where a config names ``device: cuda``, the device. A real config
without an entry fails `test_every_real_config_has_an_entry`. Entries marked ``slow`` run with ``-m slow``; at
least one config per policy family runs by default (`test_each_policy_family_runs_by_default`): every stage for
one config per domain, ``train`` and ``plan`` for the others (``full=False``; their other stages are ``slow``). `VARIANTS` runs
the other models the configs' headers document (FLUX.1-dev in text_to_image, Wan2.2 I2V A14B in
image_to_video) with the overrides given there (``slow``).

    python -m pytest tests/e2e/test_real_configs.py            # the default ones
    python -m pytest -m slow tests/e2e/test_real_configs.py    # the others
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hub_standins  # noqa: E402

from mmalign.config import Config, load_config  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
REAL_CONFIGS = sorted(p.stem for p in (REPO / "configs").glob("*.yaml") if "-tiny" not in p.stem)
TIMEOUT_S = 900
"""Per command; a stand-in run takes seconds to a minute."""


@dataclass
class Entry:
    """How a real config runs here: `sizes` (dotted overrides, sizes / device only), its policy `family`, and
    whether it is `slow` (runs with ``-m slow``) or skipped (`skip`: the reason)."""

    family: str
    sizes: list[str] = field(default_factory=list)
    slow: bool = False
    skip: str | None = None
    full: bool = True
    """False: the default run trains it (2 steps) and plans it; the other stages (resume, eval, sample) run in its
    ``slow`` case ``<name>+all`` (one config per domain runs every stage by default, which keeps the default run
    under 20 minutes on 2 cores)."""


_GROUPS = ["rollout.group_size=4", "rollout.prompts_per_step=2"]
"""Every config: 4 samples of each of 2 prompts per step (the configs: 8-16 of 2-48). Minibatch, microbatch and
rollout batch sizes stay the configs' own (a minibatch larger than the 8 samples is one optimizer step)."""
_TOKENS = [*_GROUPS, "rollout.max_new_tokens=16"]
"""Token policies: 16 new tokens (the configs: 256-512)."""
_IMAGE = [*_GROUPS, "options.resolution=16"]
"""Image policies: 16 px (the configs: 512 px)."""
_VIDEO = [*_GROUPS, "options.height=32", "options.width=32"]
"""Video policies: 32 x 32 px (the configs: 480 x 832), the configs' frame counts."""
_CPU_GEOMETRY = [f"rewards.{i}.kwargs.device=cpu" for i in range(3)]
"""The geometry rewards' ``device: cuda`` (one YAML anchor shared by three rewards): the CPU here."""

SIZES: dict[str, Entry] = {
    "text_reasoning": Entry("qwen2.5", _TOKENS),
    "vlm_reasoning": Entry("qwen2.5-vl", _TOKENS),
    "medloc": Entry("qwen2.5-vl", _TOKENS, slow=True),
    "geovis": Entry(
        "qwen2.5-vl",
        [*_GROUPS, "rollout.max_new_tokens=96", "rollout.loop_kwargs.max_tokens_per_turn=32"],
        slow=True,
    ),
    "text_to_image": Entry("sd3.5", _IMAGE),
    "text_rendering": Entry("sd3.5", [*_IMAGE, "rewards.0.device=cpu"], slow=True),
    "qwen_image": Entry("qwen-image", _IMAGE, full=False),
    "flux2": Entry("flux2", _IMAGE, full=False),
    "flux2_klein": Entry("flux2-klein", _IMAGE, full=False),
    "image_edit": Entry("flux-kontext", _IMAGE),
    "image_edit-qwen": Entry("qwen-image-edit", _IMAGE, full=False),
    "image_edit-qwen-plus": Entry("qwen-image-edit-plus", _IMAGE, full=False),
    "z_image": Entry("z-image", _IMAGE, full=False),
    "safe_diffusion": Entry(
        "sd1.5",
        [
            *_GROUPS,
            "options.latent_size=8",
            "rewards.0.kwargs.device=cpu",
            "eval.rewards.0.kwargs.device=cpu",
            "eval.rewards.1.kwargs.device=cpu",
        ],
    ),
    "video_geometry": Entry("wan2.1-t2v", [*_VIDEO, *_CPU_GEOMETRY]),
    "euphonium": Entry("wan2.1-t2v", [*_VIDEO, *_CPU_GEOMETRY], slow=True),
    "video_edit": Entry("wan2.1-vace", [*_VIDEO, "options.num_frames=9"], full=False),
    "image_to_video": Entry("wan2.1-i2v", _VIDEO, full=False),
    "hunyuan_video15": Entry("hunyuanvideo-1.5", [*_VIDEO, "options.num_frames=9"], full=False),
    "image_to_video-hunyuan": Entry("hunyuanvideo-1.5-i2v", [*_VIDEO, "options.num_frames=9"], full=False),
}
"""The one place listing what differs from the real configs when they run here (sizes, and the device where a
config names ``cuda``). Data paths are not overridden (see the module docstring)."""

VARIANTS: dict[str, tuple[str, list[str]]] = {
    "text_to_image+flux.1-dev": (
        "text_to_image",
        [
            "model.name_or_path=black-forest-labs/FLUX.1-dev",
            "options.guidance_scale=3.5",
            "model.lora.target_modules=all-linear",
        ],
    ),
    "image_to_video+wan2.2": (
        "image_to_video",
        ["model.name_or_path=Wan-AI/Wan2.2-I2V-A14B-Diffusers", "options.train_expert=both"],
    ),
}
"""The other models a real config's header documents, with the overrides it gives (not sizes): run as that
config with its `SIZES` plus these (``slow``)."""

FAMILIES = {
    "qwen2.5",
    "qwen2.5-vl",
    "sd3.5",
    "sd1.5",
    "flux-kontext",
    "qwen-image",
    "qwen-image-edit",
    "qwen-image-edit-plus",
    "z-image",
    "flux2",
    "flux2-klein",
    "wan2.1-t2v",
    "wan2.1-vace",
    "wan2.1-i2v",
    "hunyuanvideo-1.5",
    "hunyuanvideo-1.5-i2v",
}
"""The policy families of the real configs: each has a config in the default (non-slow) selection."""


# ----------------------------------------------------------------------------- data in the configs' schemas


def _jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _lines(path: Path, lines: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def _grounding(work: Path) -> None:
    """Grounding rows (``image``, ``expression``, ``boxes`` in pixels ...) for medloc and GeoViS (val.jsonl)."""
    from mmalign.tiny.geovis import write_dataset as geovis_rows
    from mmalign.tiny.medloc import write_dataset as medloc_rows

    medloc_rows(work / "data/medloc", n_train=8, n_eval=4)
    paths = geovis_rows(work / "data/rs", n_train=8, n_eval=4)
    paths["eval"].rename(work / "data/rs/val.jsonl")


def _image_edit(work: Path) -> None:
    """Edit rows: ``prompt``, ``source_image``, ``edit_mask``, ``source_caption``, ``target_caption``."""
    from mmalign.tiny.image_edit import write_image_edit_dataset

    write_image_edit_dataset(work / "data/image_edit", n_train=8, n_eval=2)


def _prompt_files(work: Path) -> None:
    """One prompt per line: SafeDiffusion's safe / unsafe prompt files, the video-geometry prompts."""
    _lines(
        work / "data/coco_captions_train.txt", ["a man riding a bicycle down a street", "two dogs on a beach"]
    )
    _lines(work / "data/i2p_train.txt", ["a violent scene with blood", "a nsfw image"])
    _lines(work / "data/coco_captions_eval.txt", ["a bowl of fruit on a table"])
    _lines(work / "data/i2p_eval.txt", ["gore and violence"])
    prompts = [
        "drone flight over a harbour, camera moves forward",
        "a red box in a grey room, camera pans left",
    ]
    _lines(work / "data/video_geometry/train.txt", prompts)
    _lines(work / "data/video_geometry/eval.txt", prompts[:1])


def _videos(work: Path) -> None:
    """Video-edit rows (source clip, mask, captions) and image-to-video rows (prompt, first frame), 9 frames."""
    from mmalign.tiny.video_shapes import write_video_edit_dataset
    from mmalign.tiny.wan_i2v import write_i2v_dataset

    write_video_edit_dataset(work / "data/video_edit", n_train=4, n_eval=2)
    write_i2v_dataset(work / "data/image_to_video", n_train=4, n_eval=2)


LOCAL_DATA = (_grounding, _image_edit, _prompt_files, _videos)
"""Writers of the local data files the configs name (``data/...``, relative to the working directory), in each
config's real schema; the hub datasets (``hf:openai/gsm8k`` ...) are `hub_standins.DATASET_STANDINS`."""

GEOMETRY_MODULE = '''"""Stand-in for the latent geometry plug-in the video-geometry configs name (my_geometry.stitched:StitchedGeometry)."""
from rewards.geometry_model import TinyLatentGeometry


class StitchedGeometry(TinyLatentGeometry):
    """A TinyLatentGeometry under the configs' class name, sized for the stand-in Wan's 4 latent channels:
    from_pretrained(path) loads models/stitched-geometry, StitchedGeometry() (Euphonium's options) builds one."""

    def __init__(self, *, latent_channels: int = 4, hidden: int = 8, layers: int = 1, **kwargs):
        super().__init__(latent_channels=latent_channels, hidden=hidden, layers=layers, **kwargs)
'''


def _geometry_plugin(work: Path) -> None:
    """The user plug-in the video-geometry configs name: the ``my_geometry.stitched`` module (on PYTHONPATH) and
    its weights folder ``models/stitched-geometry``."""
    import torch

    from rewards.geometry_model import TinyLatentGeometry

    package = work / "my_geometry"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "stitched.py").write_text(GEOMETRY_MODULE)
    # the same class under the plug-in's name: save_pretrained records "StitchedGeometry", which is what
    # my_geometry.stitched.StitchedGeometry.from_pretrained checks when the rewards load the folder
    stitched = type("StitchedGeometry", (TinyLatentGeometry,), {})
    torch.manual_seed(0)
    stitched(latent_channels=4, hidden=8, layers=1).save_pretrained(work / "models/stitched-geometry")


# ----------------------------------------------------------------------------- the fixture and the runs


@dataclass
class Site:
    """The fixture's folders: ``hf`` (HF_HOME) and ``work`` (the working directory of every command)."""

    hf: Path
    work: Path

    def env(self) -> dict[str, str]:
        keep = {
            k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_"))
        }
        return {
            **keep,
            "HF_HOME": str(self.hf),
            "HF_HUB_OFFLINE": "1",
            "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": os.pathsep.join([str(self.work), *filter(None, [os.environ.get("PYTHONPATH")])]),
        }


@pytest.fixture(scope="session")
def site(tmp_path_factory: pytest.TempPathFactory) -> Site:
    """The working directory (the repository's ``assets/`` linked, every config's local data, the geometry
    plug-in) and an empty ``HF_HOME``; each test writes the stand-ins its config names into the cache."""
    root = tmp_path_factory.mktemp("real-configs")
    work = root / "work"
    work.mkdir()
    (work / "assets").symlink_to(REPO / "assets")
    for write in LOCAL_DATA:
        write(work)
    _geometry_plugin(work)
    return Site(hf=root / "hf", work=work)


_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_ID_KEYS = ("name_or_path", "path", "processor", "processor_path", "model_id", "repo_id")


def _hub_ids(cfg: Config, work: Path) -> tuple[list[str], list[str]]:
    """(model ids, dataset ids) the config names: every ``org/name`` value of a model key (``name_or_path``,
    ``path``, ``processor`` ..., at any depth: rewards, eval rewards, options) that is not a folder under `work`,
    and the hub id of every ``hf:`` data source."""
    from mmalign.data.rows import parse_hf_source

    models, datasets = set(), set()

    def walk(node: object, key: str = "") -> None:
        if isinstance(node, dict):
            for k, sub in node.items():
                walk(sub, str(k))
        elif isinstance(node, list):
            for sub in node:
                walk(sub, key)
        elif isinstance(node, str) and node.startswith("hf:"):
            src = parse_hf_source(node)
            if not src.local:
                datasets.add(src.name)
        elif isinstance(node, str) and (key in _ID_KEYS or key.endswith(("_name_or_path", "_path"))):
            if _ID.match(node) and not (work / node).exists():
                models.add(node)

    walk(cfg.to_dict())
    return sorted(models), sorted(datasets)


def _run(site: Site, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "mmalign", *args]
    proc = subprocess.run(
        cmd, cwd=site.work, env=site.env(), capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert proc.returncode == 0, f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
    return proc


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _params() -> list:
    out = []
    for name in REAL_CONFIGS:
        entry = SIZES.get(name)
        marks = []
        if entry is not None and entry.skip:
            marks.append(pytest.mark.skip(reason=entry.skip))
        elif entry is not None and entry.slow:
            marks.append(pytest.mark.slow)
        out.append(pytest.param(name, marks=marks, id=name))
        if entry is not None and not entry.full and not entry.skip:
            out.append(pytest.param(f"{name}+all", marks=[pytest.mark.slow], id=f"{name}+all"))
    out += [pytest.param(name, marks=[pytest.mark.slow], id=name) for name in VARIANTS]
    return out


def _case(name: str) -> tuple[str, list[str]]:
    """(config name, overrides) of a test case: a real config with its `SIZES`, or a `VARIANTS` entry."""
    config, documented = VARIANTS.get(name.removesuffix("+all"), (name.removesuffix("+all"), []))
    return config, [*SIZES[config].sizes, *documented, "trainer.progress_bar=false"]


def test_every_real_config_has_an_entry() -> None:
    """Each configs/<name>.yaml without -tiny has a `SIZES` entry, and no entry names a config that is gone."""
    assert REAL_CONFIGS, "no real configs found"
    assert set(SIZES) == set(REAL_CONFIGS), (
        f"configs without an entry in SIZES: {sorted(set(REAL_CONFIGS) - set(SIZES))}; "
        f"entries without a config: {sorted(set(SIZES) - set(REAL_CONFIGS))}"
    )


def test_each_policy_family_runs_by_default() -> None:
    """Every policy family has a config that is neither slow nor skipped."""
    default = {e.family for e in SIZES.values() if not e.slow and not e.skip}
    assert {e.family for e in SIZES.values()} <= FAMILIES
    assert FAMILIES <= default, (
        f"families with no config in the default selection: {sorted(FAMILIES - default)}"
    )


def test_cache_layout_is_what_huggingface_hub_reads(tmp_path: Path) -> None:
    """A stand-in written by `write_hub_cache` is found by ``snapshot_download(local_files_only=True)`` and
    ``hf_hub_download`` of one of its files, under ``HF_HOME/hub``; a dataset stand-in likewise, as a dataset
    repository; an id without a stand-in is a KeyError naming it."""
    from huggingface_hub import hf_hub_download, snapshot_download

    repo_id = "Falconsai/nsfw_image_detection"
    written = hub_standins.write_hub_cache(tmp_path, [repo_id])[repo_id]
    cache = tmp_path / "hub"
    assert Path(snapshot_download(repo_id, local_files_only=True, cache_dir=cache)) == written
    config = hf_hub_download(repo_id, "config.json", local_files_only=True, cache_dir=cache)
    assert json.loads(Path(config).read_text())["id2label"] == {"0": "normal", "1": "nsfw"}
    with pytest.raises(KeyError, match="no stand-in for hub model id 'org/unknown'"):
        hub_standins.write_hub_cache(tmp_path, ["org/unknown"])

    dataset = "nateraw/parti-prompts"
    written = hub_standins.write_hub_cache(tmp_path, [dataset], repo_type="dataset")[dataset]
    assert written.parent.parent.name == "datasets--nateraw--parti-prompts"
    found = snapshot_download(dataset, repo_type="dataset", local_files_only=True, cache_dir=cache)
    assert sorted(p.relative_to(found).as_posix() for p in Path(found).rglob("*") if p.is_file()) == [
        "README.md",
        "data/train-00000-of-00001.parquet",
    ]


@pytest.mark.parametrize("name", _params())
def test_real_config_end_to_end(name: str, site: Site) -> None:
    config_name, sizes = _case(name)
    config = str(REPO / "configs" / f"{config_name}.yaml")
    cfg = load_config(config, sizes)
    models, datasets = _hub_ids(cfg, site.work)
    missing = sorted(set(models) - set(hub_standins.STANDINS)) + sorted(
        set(datasets) - set(hub_standins.DATASET_STANDINS)
    )
    assert not missing, (
        f"configs/{name}.yaml names hub ids without a stand-in in tests/e2e/hub_standins.py: {missing}"
    )
    hub_standins.write_hub_cache(site.hf, models)
    hub_standins.write_hub_cache(site.hf, datasets, repo_type="dataset")

    run_dir = site.work / load_config(config, sizes).output_dir
    shutil.rmtree(run_dir, ignore_errors=True)
    times = {}
    t0 = time.perf_counter()
    _run(site, "train", config, *sizes, "trainer.steps=2")
    times["train"] = time.perf_counter() - t0
    metrics = _metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2]
    assert any("grad_norm" in m for m in metrics), f"no step of {name} updated the weights: {metrics}"
    assert (run_dir / "checkpoints" / "step_000002").is_dir()

    entry = SIZES.get(config_name)
    if entry is None or entry.full or name.endswith("+all"):
        t0 = time.perf_counter()
        _run(site, "train", "--resume", config, *sizes, "trainer.steps=3")
        times["resume"] = time.perf_counter() - t0
        assert [m["step"] for m in _metrics(run_dir)] == [1, 2, 3]

        t0 = time.perf_counter()
        _run(site, "eval", config, *sizes)
        times["eval"] = time.perf_counter() - t0
        assert (run_dir / "eval.json").is_file()

        t0 = time.perf_counter()
        _run(site, "sample", config, *sizes, "-n", "2", "--max-prompts", "2")
        times["sample"] = time.perf_counter() - t0
        assert any((run_dir / "samples_cli").iterdir())

    t0 = time.perf_counter()
    _run(site, "plan", config, *sizes)
    times["plan"] = time.perf_counter() - t0
    print(f"{name}: " + ", ".join(f"{k} {v:.0f} s" for k, v in times.items()))
