"""The family registry: which policy class trains the diffusion model in a folder or under a hub id.

A family is one `Family` entry (`register_family`): the task it serves, the policy class (``"module:Class"``,
imported only when chosen), the diffusers pipeline classes its ``model_index.json`` may name, its transformer
classes (for folders without an index) and the substrings of a hub id that name it when nothing is cached to
read. `family_for` decides in that order: pipeline class (any task: a model of another task is refused, naming
the pipeline that trains it), transformer class (this task's families), the longest hub-id hint, the task's
default. A third-party family is a policy subclass plus one `register_family` call.

For `mmalign plan`, a family also describes its denoiser (`Family.plan`, a `PlanSpec` or ``"module:attr"`` naming
one, imported only when planned): the latent and token counts of one sample (`PlanShapes`, from a `PlanRequest`:
the run's options and the model's component configs), the keyword inputs of one denoiser call on the meta device,
and how its rollout decodes. The policy class answers the rest (``lora_targets``, ``two_branch_cfg``), so the
planner simulates a registered family with no edit of its own. `plan_family` is the planner's lookup.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmalign.errors import ConfigError

__all__ = [
    "Family",
    "PlanRequest",
    "PlanShapes",
    "PlanSpec",
    "families",
    "family_for",
    "pipeline_class",
    "plan_family",
    "policy_class_for",
    "register_family",
    "vae_factor",
]

TASKS = ("text_to_image", "image_edit", "video")
"""The tasks a family serves (``video`` covers text to video, image to video and video editing)."""


@dataclass(frozen=True)
class PlanRequest:
    """What a family's `PlanSpec` is asked with: `options` (the config's ``options`` section as a mapping),
    `components` (each component's config.json values by folder name: ``transformer`` / ``unet``, ``vae``,
    ``text_encoder``, ...), the name of the trained `denoiser` component, and the `task` it is planned for."""

    options: Mapping[str, Any]
    components: Mapping[str, Mapping[str, Any]]
    denoiser: str
    task: str

    def option(self, name: str, default: Any = None) -> Any:
        """``options.<name>`` of the config, else `default`."""
        return self.options.get(name, default)

    @property
    def config(self) -> Mapping[str, Any]:
        """The denoiser's config.json values."""
        return self.components[self.denoiser]

    def component(self, name: str) -> Mapping[str, Any] | None:
        """The config.json values of component `name`, None when the model has no such component."""
        return self.components.get(name)


@dataclass(frozen=True)
class PlanShapes:
    """One sample as the denoiser sees it: the `latent` it denoises (the shape the policy's ``latent_shape`` gives,
    without the batch), the `text_tokens` of its prompt states (every token valid: the planner's worst case), the
    `image_tokens` of its sequence (the reference image's included), the decoded `pixels`, the
    `reference_tokens` of a source image appended to the sequence (image editing) and, for a denoiser that takes
    the states of several text encoders, `text_parts`: the text tokens of each (summing to `text_tokens`)."""

    latent: tuple[int, ...]
    text_tokens: int
    image_tokens: int
    pixels: tuple[int, ...]
    reference_tokens: int = 0
    text_parts: tuple[int, ...] = ()


@dataclass(frozen=True)
class PlanSpec:
    """A family's denoiser as `mmalign plan` simulates it.

    `shapes(request) -> PlanShapes`: one sample's latent and token counts. `inputs(config, shapes, batch, dtype)`:
    the keyword arguments of one denoiser call on `batch` rows, as the policy's ``velocity`` builds them, with
    tensors on the ``meta`` device (`config`: the denoiser's config.json values). `vae_latent(shapes)`: the latent
    one sample's VAE decode takes (default: ``shapes.latent``). `video`: the rollout decodes clips (the ``auto``
    decode chunk is one clip). `vae_fp32`: the VAE loads in fp32 whatever ``model.dtype``. `lora_targets`: the
    ``all-linear`` LoRA targets when the policy class has no ``lora_targets``. `meta_values`: the denoiser's
    forward reads the values of constant tensors (all-zero states, all-valid masks: ``if torch.all(x == 0)``,
    boolean-mask indexing), so the planner tracks the fill values of the tensors ``torch.zeros`` / ``ones`` /
    ``full`` make while it runs (the inputs among them); `inputs` must then make its constant tensors so."""

    shapes: Callable[[PlanRequest], PlanShapes]
    inputs: Callable[..., dict[str, Any]]
    vae_latent: Callable[[PlanShapes], tuple[int, ...]] | None = None
    video: bool = False
    vae_fp32: bool = False
    lora_targets: tuple[str, ...] | None = None
    meta_values: bool = False


def vae_factor(request: PlanRequest) -> int:
    """Pixels per latent along a side of an ``AutoencoderKL``-style VAE: 2 ** (len(block_out_channels) - 1) of the
    ``vae`` component, 8 when it has no such list (or there is no VAE)."""
    vae = request.component("vae")
    if vae is not None and "block_out_channels" in vae:
        return 2 ** (len(vae["block_out_channels"]) - 1)
    return 8


def _resolve(ref: str) -> Any:
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class Family:
    """One model family: `name`, the `task` it serves, its `policy` (``"module:Class"``), the ``model_index.json``
    pipeline classes and transformer classes that identify it, lowercase hub-id `hints`, whether it is the
    task's `default` (chosen when nothing else decides), and its `plan` (a `PlanSpec` or ``"module:attr"``
    naming one; None: `mmalign plan` cannot simulate it)."""

    name: str
    task: str
    policy: str
    pipelines: tuple[str, ...] = ()
    transformers: tuple[str, ...] = ()
    hints: tuple[str, ...] = ()
    default: bool = False
    plan: PlanSpec | str | None = None

    def policy_class(self) -> type:
        """Import and return the policy class."""
        return _resolve(self.policy)

    def plan_spec(self) -> PlanSpec:
        """The family's `PlanSpec` (imported when named by a string); a `ConfigError` when it registers none."""
        if self.plan is None:
            raise ConfigError(
                f"mmalign plan: family {self.name!r} ({self.policy}) registers no planner description "
                "(Family.plan, a mmalign.policies.families.PlanSpec); measure a step on the device instead "
                "(benchmarks/gpu_acceptance.py, docs/plan.md)"
            )
        return _resolve(self.plan) if isinstance(self.plan, str) else self.plan


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


def plan_family(name_or_path: str | Path, denoiser_class: str, task: str | None = None) -> Family:
    """The family `mmalign plan` simulates for a model whose trained component is a `denoiser_class`: `family_for`
    of `task` (each task in turn when None) when that family names the class among its ``transformers`` (or names
    none), else the first family that names the class (a denoiser that a pipeline option, not the model folder,
    selects: the DDIM UNet). A `ConfigError` when no family names it."""
    for t in (task,) if task is not None else TASKS:
        try:
            fam = family_for(name_or_path, t)
        except ConfigError:
            continue
        if not fam.transformers or denoiser_class in fam.transformers:
            return fam
    for fam in _FAMILIES.values():
        if denoiser_class in fam.transformers and (task is None or fam.task == task):
            return fam
    for fam in _FAMILIES.values():
        if denoiser_class in fam.transformers:
            return fam
    raise ConfigError(
        f"mmalign plan: no registered family trains a {denoiser_class} ({name_or_path}); a new family is a policy "
        "subclass plus one mmalign.policies.families.register_family call with a PlanSpec (docs/extending.md)"
    )


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
        plan="mmalign.policies.family_plans:SD3_PLAN",
    ),
    Family(
        "flux",
        "text_to_image",
        "mmalign.policies.flux:FluxPolicy",
        pipelines=("FluxPipeline",),
        transformers=("FluxTransformer2DModel",),
        hints=("flux",),
        plan="mmalign.policies.family_plans:FLUX_PLAN",
    ),
    Family(
        "qwen_image",
        "text_to_image",
        "mmalign.policies.qwen_image:QwenImagePolicy",
        pipelines=("QwenImagePipeline",),
        transformers=("QwenImageTransformer2DModel",),
        hints=("qwen-image", "qwen_image"),
        plan="mmalign.policies.family_plans:QWEN_IMAGE_PLAN",
    ),
    Family(
        "flux2",
        "text_to_image",
        "mmalign.policies.flux2:Flux2Policy",
        pipelines=("Flux2Pipeline",),
        transformers=("Flux2Transformer2DModel",),
        hints=("flux.2", "flux2"),
        plan="mmalign.policies.family_plans:FLUX2_PLAN",
    ),
    Family(
        "flux2_klein",
        "text_to_image",
        "mmalign.policies.flux2:Flux2KleinPolicy",
        pipelines=("Flux2KleinPipeline",),
        hints=("flux.2-klein", "flux2-klein", "flux2_klein"),
        plan="mmalign.policies.family_plans:FLUX2_PLAN",
    ),
    Family(
        "z_image",
        "text_to_image",
        "mmalign.policies.z_image:ZImagePolicy",
        pipelines=("ZImagePipeline",),
        transformers=("ZImageTransformer2DModel",),
        hints=("z-image", "z_image"),
        plan="mmalign.policies.family_plans:Z_IMAGE_PLAN",
    ),
    Family(
        "flux_kontext",
        "image_edit",
        "mmalign.policies.flux_kontext:FluxKontextPolicy",
        pipelines=("FluxKontextPipeline",),
        transformers=("FluxTransformer2DModel",),
        hints=("kontext",),
        default=True,
        plan="mmalign.policies.family_plans:FLUX_KONTEXT_PLAN",
    ),
    Family(
        "qwen_image_edit",
        "image_edit",
        "mmalign.policies.qwen_image_edit:QwenImageEditPolicy",
        pipelines=("QwenImageEditPipeline",),
        transformers=("QwenImageTransformer2DModel",),
        hints=("qwen-image-edit", "qwen_image_edit"),
        plan="mmalign.policies.family_plans:QWEN_IMAGE_EDIT_PLAN",
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
        plan="mmalign.policies.family_plans:QWEN_IMAGE_EDIT_PLUS_PLAN",
    ),
    Family(
        "wan",
        "video",
        "mmalign.policies.wan:WanPolicy",
        pipelines=("WanPipeline", "WanImageToVideoPipeline", "WanVACEPipeline"),
        transformers=("WanTransformer3DModel", "WanVACETransformer3DModel"),
        hints=("wan2", "wan-ai"),
        default=True,
        plan="mmalign.policies.family_plans:WAN_PLAN",
    ),
    Family(
        "hunyuan_video15",
        "video",
        "mmalign.policies.hunyuan_video15:HunyuanVideo15Policy",
        pipelines=("HunyuanVideo15Pipeline",),
        transformers=("HunyuanVideo15Transformer3DModel",),
        hints=("hunyuanvideo-1.5", "hunyuanvideo1.5", "hunyuan_video15", "hunyuanvideo15"),
        plan="mmalign.policies.family_plans:HUNYUAN_VIDEO15_PLAN",
    ),
    Family(
        "hunyuan_video15_i2v",
        "video",
        "mmalign.policies.hunyuan_video15:HunyuanVideo15ImageToVideoPolicy",
        pipelines=("HunyuanVideo15ImageToVideoPipeline",),
        hints=(
            "hunyuanvideo-1.5-480p_i2v",
            "hunyuanvideo-1.5-720p_i2v",
            "hunyuanvideo-1.5-diffusers-480p_i2v",
            "hunyuanvideo-1.5-diffusers-720p_i2v",
        ),
        plan="mmalign.policies.family_plans:HUNYUAN_VIDEO15_I2V_PLAN",
    ),
    # the UNet of SD 1.x / 2.x that DDIMPolicy trains (``options.policy: ddim`` of safe_diffusion picks it, not the
    # folder: no pipeline class or hub hint, so `family_for` never returns it); listed for `plan_family`
    Family(
        "sd_unet",
        "text_to_image",
        "mmalign.policies.ddim:DDIMPolicy",
        transformers=("UNet2DConditionModel",),
        plan="mmalign.policies.family_plans:SD_UNET_PLAN",
    ),
):
    register_family(_family)
