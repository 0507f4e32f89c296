"""The family registry: which policy class trains the diffusion model in a folder or under a hub id.

A family is one `Family` entry (`register_family`): the task it serves, the policy class (``"module:Class"``,
imported only when chosen), the diffusers pipeline classes its ``model_index.json`` may name, its transformer
classes (for folders without an index) and the substrings of a hub id that name it when nothing is cached to
read. `family_for` decides in that order: pipeline class (any task: a model of another task is refused, naming
the pipeline that trains it), transformer class (this task's families), the longest hub-id hint, the task's
default. A third-party family is a policy subclass plus one `register_family` call.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmalign.errors import ConfigError

__all__ = ["Family", "families", "family_for", "pipeline_class", "policy_class_for", "register_family"]

TASKS = ("text_to_image", "image_edit", "video")
"""The tasks a family serves (``video`` covers text to video, image to video and video editing)."""


@dataclass(frozen=True)
class Family:
    """One model family: `name`, the `task` it serves, its `policy` (``"module:Class"``), the ``model_index.json``
    pipeline classes and transformer classes that identify it, lowercase hub-id `hints`, and whether it is the
    task's `default` (chosen when nothing else decides)."""

    name: str
    task: str
    policy: str
    pipelines: tuple[str, ...] = ()
    transformers: tuple[str, ...] = ()
    hints: tuple[str, ...] = ()
    default: bool = False

    def policy_class(self) -> type:
        """Import and return the policy class."""
        module, _, attr = self.policy.partition(":")
        return getattr(importlib.import_module(module), attr)


_FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> Family:
    """Add `family` (a second registration of the same name replaces the first; one default per task)."""
    if family.task not in TASKS:
        raise ValueError(f"family {family.name!r}: task {family.task!r} is not one of {', '.join(TASKS)}")
    if family.default:
        for other in _FAMILIES.values():
            if other.default and other.task == family.task and other.name != family.name:
                raise ValueError(
                    f"family {family.name!r}: {other.name!r} is already the default for {family.task}"
                )
    _FAMILIES[family.name] = family
    return family


def families(task: str | None = None) -> list[Family]:
    """The registered families (of `task`), in registration order."""
    return [f for f in _FAMILIES.values() if task is None or f.task == task]


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _cached_file(repo_id: str, filename: str) -> Path | None:
    """`filename` of hub repo `repo_id` when it is in the local Hugging Face cache (never fetched here)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - huggingface_hub comes with transformers
        return None
    try:
        found = try_to_load_from_cache(repo_id, filename)
    except ValueError:  # not a valid repo id (e.g. a missing local path)
        return None
    return Path(found) if isinstance(found, str) else None


def _config_of(name_or_path: str | Path, filename: str) -> dict[str, Any]:
    p = Path(name_or_path)
    if p.is_dir():
        return _read_json(p / filename)
    cached = _cached_file(str(name_or_path), filename)
    return _read_json(cached) if cached is not None else {}


def pipeline_class(name_or_path: str | Path) -> str | None:
    """``_class_name`` of the model's ``model_index.json`` (a local folder, or a hub id's cached copy), else None."""
    return _config_of(name_or_path, "model_index.json").get("_class_name")


def _transformer_class(name_or_path: str | Path) -> str | None:
    return _config_of(name_or_path, "transformer/config.json").get("_class_name")


def family_for(name_or_path: str | Path, task: str) -> Family:
    """The family of the model at `name_or_path` for `task` (see the module docstring for the order); a
    `ConfigError` on key ``model.name_or_path`` when the model belongs to another task or to no family."""
    key = "key 'model.name_or_path'"
    pipe = pipeline_class(name_or_path)
    if pipe is not None:
        owners = [f for f in _FAMILIES.values() if pipe in f.pipelines]
        mine = [f for f in owners if f.task == task]
        if mine:
            return mine[0]
        if owners:
            raise ConfigError(
                f"{key}: {name_or_path} is a {pipe} model ({owners[0].name}); it is trained by the {owners[0].task} "
                f"task's pipelines, not {task}"
            )
        known = sorted({p for f in families(task) for p in f.pipelines})
        raise ConfigError(
            f"{key}: {name_or_path}/model_index.json names {pipe}, which no registered family trains for {task} "
            f"(known: {', '.join(known)}); a new family is a policy subclass plus one "
            "mmalign.policies.families.register_family call (docs/extending.md)"
        )
    transformer = _transformer_class(name_or_path)
    if transformer is not None:
        for f in families(task):
            if transformer in f.transformers:
                return f
    name = str(name_or_path).lower()
    hinted = [(len(h), f) for f in _FAMILIES.values() for h in f.hints if h in name]
    if hinted:
        best = max(hinted, key=lambda item: item[0])[1]
        if best.task != task:
            raise ConfigError(
                f"{key}: {name_or_path} names a {best.name} model; it is trained by the {best.task} task's "
                f"pipelines, not {task}"
            )
        return best
    for f in families(task):
        if f.default:
            return f
    raise ConfigError(f"{key}: no registered family trains {name_or_path} for {task}")


def policy_class_for(name_or_path: str | Path, task: str) -> type:
    """The policy class of `family_for(name_or_path, task)`."""
    return family_for(name_or_path, task).policy_class()


for _family in (
    Family(
        "sd3",
        "text_to_image",
        "mmalign.policies.sd3:SD3Policy",
        pipelines=("StableDiffusion3Pipeline",),
        transformers=("SD3Transformer2DModel",),
        hints=("stable-diffusion-3", "sd3"),
        default=True,
    ),
    Family(
        "flux",
        "text_to_image",
        "mmalign.policies.flux:FluxPolicy",
        pipelines=("FluxPipeline",),
        transformers=("FluxTransformer2DModel",),
        hints=("flux",),
    ),
    Family(
        "qwen_image",
        "text_to_image",
        "mmalign.policies.qwen_image:QwenImagePolicy",
        pipelines=("QwenImagePipeline",),
        transformers=("QwenImageTransformer2DModel",),
        hints=("qwen-image", "qwen_image"),
    ),
    Family(
        "flux2",
        "text_to_image",
        "mmalign.policies.flux2:Flux2Policy",
        pipelines=("Flux2Pipeline",),
        transformers=("Flux2Transformer2DModel",),
        hints=("flux.2", "flux2"),
    ),
    Family(
        "flux2_klein",
        "text_to_image",
        "mmalign.policies.flux2:Flux2KleinPolicy",
        pipelines=("Flux2KleinPipeline",),
        hints=("flux.2-klein", "flux2-klein", "flux2_klein"),
    ),
    Family(
        "z_image",
        "text_to_image",
        "mmalign.policies.z_image:ZImagePolicy",
        pipelines=("ZImagePipeline",),
        transformers=("ZImageTransformer2DModel",),
        hints=("z-image", "z_image"),
    ),
    Family(
        "flux_kontext",
        "image_edit",
        "mmalign.policies.flux_kontext:FluxKontextPolicy",
        pipelines=("FluxKontextPipeline",),
        transformers=("FluxTransformer2DModel",),
        hints=("kontext",),
        default=True,
    ),
    Family(
        "qwen_image_edit",
        "image_edit",
        "mmalign.policies.qwen_image_edit:QwenImageEditPolicy",
        pipelines=("QwenImageEditPipeline",),
        transformers=("QwenImageTransformer2DModel",),
        hints=("qwen-image-edit", "qwen_image_edit"),
    ),
    Family(
        "qwen_image_edit_plus",
        "image_edit",
        "mmalign.policies.qwen_image_edit_plus:QwenImageEditPlusPolicy",
        pipelines=("QwenImageEditPlusPipeline",),
        hints=(
            "qwen-image-edit-2509",
            "qwen-image-edit-2511",
            "qwen-image-edit-plus",
            "qwen_image_edit_plus",
        ),
    ),
    Family(
        "wan",
        "video",
        "mmalign.policies.wan:WanPolicy",
        pipelines=("WanPipeline", "WanImageToVideoPipeline", "WanVACEPipeline"),
        transformers=("WanTransformer3DModel", "WanVACETransformer3DModel"),
        hints=("wan2", "wan-ai"),
        default=True,
    ),
    Family(
        "hunyuan_video15",
        "video",
        "mmalign.policies.hunyuan_video15:HunyuanVideo15Policy",
        pipelines=("HunyuanVideo15Pipeline",),
        transformers=("HunyuanVideo15Transformer3DModel",),
        hints=("hunyuanvideo-1.5", "hunyuanvideo1.5", "hunyuan_video15", "hunyuanvideo15"),
    ),
):
    register_family(_family)
