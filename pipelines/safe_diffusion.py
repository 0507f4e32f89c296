"""Safe diffusion (SafeDiffusion-R1): GRPO with a CLIP steering reward removes an unsafe concept from a
text-to-image model without paired data, while safe prompts keep their quality.

Details: docs/algorithms.md, "pipelines.safe_diffusion".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from mmalign.algorithms.names import needs_reference
from mmalign.config import Config, ConfigError
from mmalign.data.rows import load_rows
from mmalign.policies.denoising import SamplerSettings
from mmalign.training.seeding import process_seed
from pipelines import TrainingSetup, register_pipeline
from pipelines.common import options
from rewards import RewardSet, check_reward_specs

CATEGORIES = ("safe", "unsafe")


@dataclass
class SafeDiffusionOptions(SamplerSettings):
    """The ``options:`` section: the sampler (`mmalign.policies.denoising.SamplerSettings`, validated there;
    ``noise_level`` and ``sde_kind`` are the flow policy's, policy ddim takes ``eta``), the policy, the
    prompt files and the reward models."""

    policy: Literal["ddim", "flow"] = "ddim"
    """`ddim`: a UNet (SD 1.x/2.x) folder, DDIM steps with eta > 0; `flow`: an SD3-style flow-matching folder."""
    num_steps: int = 20
    """Sampling steps (every stochastic step is trained unless a window or fraction is set)."""
    eta: float = 1.0
    """DDIM noise (policy ddim): 1 is DDPM-like sampling; must be in (0, 1] to have log-probs."""
    guidance_scale: float = 5.0
    """Classifier-free guidance (empty negative prompt), the same in sampling and training; 1 turns it off."""
    seed: int | None = None
    """The sampler's private generator is seeded with this (null: the top-level ``seed``) + the process rank."""
    latent_size: int | None = None
    """Latent side (None: the denoiser's sample_size; the image is this times the VAE's factor)."""
    safe_prompts: list[str] = field(default_factory=list, metadata={"data_files": True})
    """Training prompt files whose rows are safe (.txt or .jsonl)."""
    unsafe_prompts: list[str] = field(default_factory=list, metadata={"data_files": True})
    """Training prompt files whose rows are unsafe."""
    eval_safe_prompts: list[str] = field(default_factory=list, metadata={"data_files": True})
    """Evaluation prompt files whose rows are safe (.txt or .jsonl)."""
    eval_unsafe_prompts: list[str] = field(default_factory=list, metadata={"data_files": True})
    """Evaluation prompt files whose rows are unsafe."""
    category_column: str = "category"
    """The data column holding safe / unsafe (set on rows from the option lists; read from data files)."""
    reward_models: dict[str, str] = field(default_factory=dict)
    """Offline runs: reward-model folders to build if missing, path -> tiny builder (e.g. a tiny CLIP)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.policy == "ddim" and self.sde_kind not in ("flow_sde", "ddim"):
            raise ValueError(
                f"sde_kind {self.sde_kind!r} is a flow-policy step (policy: flow); policy ddim samples DDIM "
                "steps, whose noise is eta"
            )
        if self.policy == "flow" and self.sde_kind == "ddim":
            raise ValueError("sde_kind ddim needs policy: ddim")
        self.policy_sampler()  # policy ddim: checks eta

    def policy_sampler(self, seed: int | None = None) -> SamplerSettings:
        """The settings the policy samples with: policy ddim samples DDIM steps with ``noise_level`` = eta."""
        changes: dict[str, Any] = {} if seed is None else {"seed": seed}
        if self.policy == "ddim":
            changes.update(sde_kind="ddim", noise_level=self.eta)
        return self.sampler_settings(**changes)


def safe_options(cfg: Config) -> SafeDiffusionOptions:
    return options(cfg, SafeDiffusionOptions)


def _rows(
    cfg: Config, o: SafeDiffusionOptions, files: dict[str, list[str]], data_file: str | None, what: str
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for category, paths in files.items():
        for path in paths:
            for row in load_rows(path, cfg.data.prompt_template):
                row[o.category_column] = category
                rows.append(row)
    if data_file:
        for row in load_rows(data_file, cfg.data.prompt_template):
            value = row.get(o.category_column)
            if value not in CATEGORIES:
                raise ConfigError(
                    f"{row.get('_source', data_file)}: column {o.category_column!r} must be 'safe' or 'unsafe' "
                    f"(options.category_column), got {value!r}"
                )
            rows.append(row)
    if what == "train":
        if not rows:
            raise ConfigError(
                f"{cfg.source}: no training prompts: give options.safe_prompts / options.unsafe_prompts or data.train"
            )
        present = {r[o.category_column] for r in rows}
        if present != set(CATEGORIES):
            missing = sorted(set(CATEGORIES) - present)
            raise ConfigError(
                f"{cfg.source}: the training prompts have no {missing[0]} rows; SafeDiffusion-R1 trains on both "
                "safe and unsafe prompts (safe ones keep the quality from collapsing)"
            )
    return rows


def build_policy(cfg: Config, o: SafeDiffusionOptions) -> Any:
    """The DDIM or flow policy of `cfg.model` with the sampling options of `o`. The sampler draws its noise
    from a private generator seeded with ``options.seed`` (default: the top-level ``seed``) + the process rank
    (every process samples different noise); the trainer saves its state in every checkpoint, so a resumed run draws the same noise as an
    uninterrupted one."""
    m = cfg.model
    path = m.name_or_path
    seed = process_seed(cfg.seed if o.seed is None else o.seed)
    common: dict[str, Any] = dict(
        dtype=m.dtype,
        lora=m.lora,
        sampler=o.policy_sampler(seed=seed),
        latent_size=o.latent_size,
        need_reference=needs_reference(cfg),
    )
    if o.policy == "ddim":
        from mmalign.policies.ddim import DDIMPolicy

        return DDIMPolicy.from_pretrained(path, **common)
    from mmalign.policies.families import policy_class_for

    return policy_class_for(path, "text_to_image").from_pretrained(path, **common)


@register_pipeline("safe_diffusion", options=SafeDiffusionOptions)
def build(cfg: Config) -> Any:
    """SafeDiffusion-R1: CLIP steering reward on mixed safe/unsafe prompts (DDIM or flow policy)."""
    o = safe_options(cfg)
    # cheapest first: the prompt files and the reward entries are checked before any model is built
    train = _rows(
        cfg, o, {"safe": o.safe_prompts, "unsafe": o.unsafe_prompts}, cfg.data.train or None, "train"
    )
    evals = _rows(
        cfg, o, {"safe": o.eval_safe_prompts, "unsafe": o.eval_unsafe_prompts}, cfg.data.eval, "eval"
    )
    check_reward_specs(cfg.rewards, cfg.source)
    rewards = RewardSet(cfg.rewards, source=cfg.source)
    policy = build_policy(cfg, o)
    return TrainingSetup(
        policy=policy, rewards=rewards, data=train, eval_data=evals or None, sample_columns=["category"]
    )
