"""Typed, validated run configuration: YAML files plus dotted command-line overrides.

A config is a tree of dataclasses. Loading checks every key and value against the declared
fields and types; an unknown or misspelled key is an error naming the key, the file and a
close match. Command-line overrides use dotted paths: ``trainer.lr=1e-5 rollout.group_size=4``;
values are parsed as YAML scalars (so ``1e-5`` is a float, ``[a, b]`` a list, ``null`` None), except
that a key of type ``str`` takes the text exactly as typed (``data.prompt_template=Q: {question}``).
An index into a list is a number (``rewards.0.weight=0.5``); the index one past the end appends.

YAML is read with YAML 1.2 number and boolean rules, in files and overrides alike: ``1e-5`` is a
float (YAML 1.1 reads it as a string), only ``true``/``false`` are booleans (``no`` stays a string,
so ``mixed_precision: no`` works), and a key given twice in one mapping is an error.

Pipelines may declare their own typed section: ``@register_pipeline("my_pipeline", options=MyOptions)``
(in ``pipelines``) makes the top-level ``options:`` mapping validate against ``MyOptions``. This module
does not import ``pipelines`` (it sits above): the loaders ask a finder for the pipeline's registration,
the one passed as ``pipeline_finder`` or else the hook `mmalign.registry.find_pipeline`, which imports
only the module that registers the pipeline named in the config.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml

from mmalign import registry as _registry
from mmalign.errors import ConfigError

# ----------------------------------------------------------------------------- sections


@dataclass
class LoraConfig:
    enabled: bool = False
    """Train LoRA adapters instead of the full model."""
    r: int = 8
    """LoRA rank (>= 1)."""
    alpha: int = 16
    """LoRA scaling alpha (> 0)."""
    dropout: float = 0.0
    """Dropout on the LoRA inputs, in [0, 1)."""
    target_modules: list[str] | str = "all-linear"
    """Modules that get adapters: a list of names, or `all-linear`."""


@dataclass
class ModelConfig:
    name_or_path: str = ""
    """Hub id or local folder, loaded with `from_pretrained`."""
    tiny_builder: str | None = None
    """If set and `name_or_path` does not exist, build that tiny model there first (mmalign.tiny)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype the weights are loaded in."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    use_chat_template: bool = False
    """Wrap each prompt in the tokenizer's chat template (with `system_prompt`) before generating."""
    system_prompt: str | None = None
    """System message prepended when `use_chat_template` is true."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (less memory, more compute)."""
    shared_prefix: bool = True
    """Encode each group's prompt once when recomputing log-probs (same numbers as the plain forward;
    not used under gradient checkpointing). Set false for a model whose KV cache cannot carry grad."""
    logprob_chunk_size: int | Literal["auto"] | None = "auto"
    """Text and VLM policies: compute per-token log-probs (and entropies) from the final hidden states,
    this many completion tokens at a time through the output head, recomputing each chunk's logits in the
    backward pass, so memory does not grow with the batch or length (null: from the full [B, T, V] logits;
    same numbers). `auto`: as many tokens as fit in `logprob_memory_mb` at the model's vocabulary size V
    (a plain linear head: 4.5 bytes per token and vocabulary entry, 6.5 in half precision, e.g. 392
    tokens at V = 151,936 and 256 MiB; another head, e.g. LoRA on `lm_head`: about 17). Checked against
    the full path on the first batch."""
    logprob_memory_mb: float = 256.0
    """Memory budget (MiB) of one chunk of logits and its temporaries when `logprob_chunk_size` is `auto`
    (the gradient of the output head's weight, V x hidden in fp32, comes on top)."""
    attn_implementation: str | None = None
    """Passed to `from_pretrained` (e.g. `sdpa`, `flash_attention_2`; null: the model's default)."""
    trust_remote_code: bool = False
    """Passed to `from_pretrained` (run the model repository's own code)."""


@dataclass
class DataConfig:
    train: str = ""
    """JSONL file (one JSON object per line), a `.txt` file of prompts, or `hf:<dataset id or folder>[:<config>]:<split>`
    for a Hugging Face dataset (`hf:openai/gsm8k:main:train`; known hub datasets get the pipeline's columns,
    `mmalign.data.rows.KNOWN_DATASETS`; offline: read from the local caches)."""
    eval: str | None = None
    """Evaluation prompts, same formats as `train` (`mmalign eval` / `sample`; null: the training rows)."""
    prompt_template: str = "{question}"
    """Python format string over the row's columns; gives the prompt text."""
    shuffle: bool = True
    """Visit the training rows in a shuffled order (passed to the prompt sampler)."""
    max_rows: int | None = None
    """Load at most this many rows (null: all)."""
    sampler: str = "uniform"
    """Prompt sampler (mmalign.data.prompt_samplers): `uniform` (shuffled epochs) or `vade` (Thompson sampling on
    per-prompt Beta posteriors of success, picking the most informative prompts)."""
    sampler_kwargs: dict[str, Any] = field(default_factory=dict)
    """Options of the prompt sampler."""
    success_threshold: float | None = 0.5
    """For the sampler's feedback: a sample succeeds when its total reward is > this (null: the
    group's mean reward clamped to [0, 1] is its success rate)."""
    too_long: Literal["error", "skip", "truncate"] = "error"
    """A prompt whose tokens plus ``rollout.max_new_tokens`` exceed the model's context, found before the
    first step: stop with an error naming file, line and length; skip the row (counted, logged); or cut the
    prompt's start so that it fits (counted, logged)."""
    too_few_prompts: Literal["warn", "error"] = "warn"
    """Fewer distinct prompts than ``rollout.prompts_per_step``: a step then trains copies of one prompt;
    warn (default) or stop."""


@dataclass
class RolloutConfig:
    group_size: int = 8
    """Samples per prompt (G): the group advantages are computed over."""
    prompts_per_step: int = 8
    """Prompts per training step (a step rolls out prompts_per_step * group_size samples)."""
    max_new_tokens: int = 64
    """Most tokens generated per completion (text and VLM policies)."""
    temperature: float = 1.0
    """Sampling temperature (> 0: GRPO needs sampling)."""
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1] (1: off)."""
    top_k: int = 0
    """Top-k sampling (0: off)."""
    stop_strings: list[str] = field(default_factory=list)
    """Generation stops at any of these strings."""
    sampler: Literal["mmalign", "hf"] = "mmalign"
    """Single-turn sampling of text policies without an engine (VLM and multi-turn rollouts use `generate`):
    `mmalign` (its own KV-cache decode loop: the distribution `generate` samples, drawn on the last
    position's logits in their dtype, without `multinomial`'s V random numbers per token; models whose
    generation config sets e.g. a repetition penalty use `generate` anyway) or `hf` (Hugging Face
    `generate`, the same tokens as before for a seed)."""
    engine: Literal["hf", "fake", "vllm"] = "hf"
    """Who samples: `hf` (the policy's own `generate`), `vllm` (colocated vLLM, `mmalign[vllm]`, GPU)
    or `fake` (an in-process CPU engine with its own weight copy, for tests)."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Options of the rollout engine (e.g. vLLM's)."""
    sync_timeout_s: float = 600.0
    """Weight sync to the engine after each optimizer step fails with a clear error past this."""
    is_correction: Literal["none", "token", "sequence"] = "token"
    """Truncated importance sampling for the engine/trainer log-prob mismatch (engines other than hf)."""
    is_cap: float = 2.0
    """Cap of the truncated importance weights of `is_correction`."""
    batch_size: int | None = None
    """Generate at most this many sequences at once (token policies); diffusion policies: samples denoised at
    once, rounded down to whole groups, at least one group (None: the whole step)."""
    loop: str = "single_turn"
    """How text and VLM policies turn a prompt into a sequence (`mmalign.data.rollout_loops`): ``single_turn``
    (one completion), or a multi-turn loop where an environment the pipeline supplies appends text and
    images between generated turns."""
    loop_kwargs: dict[str, Any] = field(default_factory=dict)
    """Options of the rollout loop (e.g. ``max_turns``)."""


@dataclass
class RewardConfig:
    name: str = ""
    """Registered name, entry point of group `mmalign.rewards`, or `package.module:Class`."""
    weight: float = 1.0
    """Weight of this reward in the total reward (0: logged only)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Options of the reward (its constructor's keyword arguments)."""
    alias: str | None = None
    """Column name of this reward in metrics and samples (default: `name`); needed to use one reward twice."""
    device: str | None = None
    """Where the reward's model runs (e.g. `cuda:1`, `cpu`), passed to its constructor as `device=`; an
    error for a reward whose constructor has no `device` parameter, or when `kwargs` has `device` too
    (null: the reward's own default)."""
    batch_size: int | None = None
    """Score at most this many samples per call: the batch goes to the reward in consecutive chunks and
    the results are concatenated (null: the whole batch in one call)."""
    timeout_s: float | None = None
    """Wall-clock limit of one call (one chunk) in seconds; past it the step fails with a `RewardError`.
    The call runs in a worker thread that cannot be stopped and goes on in the background; the `remote`
    reward's own `timeout_s` truly bounds an HTTP call (null: no limit)."""


GUARD_ADV_CLIP = 5.0
"""The advantage clamp of a run with GRPO-Guard's RatioNorm (``options.guard_ratio_norm``) whose
``algorithm.adv_clip`` is null: verl-omni's ``GRPOGuardLoss`` clamps advantages to +-``adv_clip_max`` (5 by
default); `mmalign.training.trainer.GroupTrainer` applies it and logs a line saying so."""


@dataclass
class AlgorithmConfig:
    estimator: str = "grpo"
    """Advantage estimator (`mmalign.algorithms.advantages`)."""
    estimator_kwargs: dict[str, Any] = field(default_factory=dict)
    """Options of the estimator."""
    reward_transforms: list[dict[str, Any]] = field(default_factory=list)
    """Reward transforms run before the estimator, in order (`mmalign.algorithms.reward_transforms`): each
    ``{name: ..., column: <reward name or index, optional>, <options>}``."""
    group_refill: dict[str, Any] = field(default_factory=dict)
    """Refilling the all-fail groups of a round (`mmalign.algorithms.group_refill.GroupRefill` keywords): ``hints: true``
    re-rolls them with tiered hints in the prompt (``hint_column``, default ``hints``; else prefixes of the
    ``reference_column`` answer at ``prefix_fractions``; ``hint_template``), ``replay: true`` injects the
    prompt's best past success (R³, IS-weighted through ``rollout.is_correction``). ``{}``: off. A sample
    succeeds when its combined reward is >= ``data.success_threshold``. Hints never reach evaluation."""
    loss: str = "ppo_clip"
    """Policy loss (`mmalign.algorithms.losses`)."""
    loss_kwargs: dict[str, Any] = field(default_factory=dict)
    """Options of the loss (e.g. its clip range)."""
    loss_agg: str = "token_mean"
    """How per-token losses are averaged into one number."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the reference policy (0: no reference model is kept)."""
    kl_estimator: str = "k3"
    """KL estimator for the penalty (k1, k2, k3)."""
    adv_clip: float | None = None
    """Clamp advantages to [-adv_clip, adv_clip] (null: no clamp, except with GRPO-Guard's
    ``options.guard_ratio_norm``, where null clamps at 5, verl-omni's ``adv_clip_max``)."""
    filter: str = "none"
    """Group filter applied before the update (`mmalign.algorithms.filters`; `none`: keep every group)."""
    filter_kwargs: dict[str, Any] = field(default_factory=dict)
    """Options of the filter."""
    aux_coefs: dict[str, float] = field(default_factory=dict)
    """Coefficient of each auxiliary loss term the policy returns (`ActionStats.aux_losses`), by name; the
    trainer adds ``coef * term`` to the loss. A term without a coefficient here is an error."""
    objective: str | None = None
    """A forward-process training objective of flow-matching policies (`mmalign.algorithms.flow_objectives`:
    ``diffusion_nft``, ``awm``) in place of the policy-gradient loss; null: the policy-gradient path
    (``loss``). One action is one (sample, training sigma) pair; ``loss`` / ``loss_kwargs`` are unused."""
    objective_kwargs: dict[str, Any] = field(default_factory=dict)
    """Options of ``objective`` (e.g. DiffusionNFT's ``beta``, AWM's ``weighting`` and ``clip_range``)."""
    timesteps: dict[str, Any] = field(default_factory=dict)
    """How ``objective`` draws its training sigmas (`mmalign.algorithms.flow_objectives.sample_timesteps` keywords:
    ``strategy``, ``timestep_range``, ``num_timesteps``, ...), over the objective's own defaults."""
    old_policy: dict[str, Any] | None = None
    """The old policy of ``objective``: `mmalign.policies.forward_process.OldPolicy` keywords
    (``decay_type`` 0/1/2, or ``flat`` / ``ramp`` / ``cap``), an EMA of the weights updated after every
    step and checkpointed; null: the current weights, detached."""
    eval_ema: dict[str, Any] | None = None
    """An EMA of the trained weights for evaluation and export (``objective`` runs;
    `mmalign.policies.forward_process.WeightEMA` keywords: ``preset``, ``decay``, ``schedule``,
    ``warmup_steps``, ``initial_decay``, ``flat_steps``, ``ramp_rate``, ``every``, ``count_from``; ``{}``: the
    objective's preset, DiffusionNFT's d = min((1+n)/(10+n), 0.9) or Flow-Factory's for AWM). Checkpointed,
    written as ``final/`` and read by `mmalign eval` / `mmalign sample`; AWM's ``ema_kl_beta`` regularises
    toward it. null: none (AWM with ``ema_kl_beta`` > 0 builds Flow-Factory's default)."""
    sample_with_old: bool = False
    """``objective`` rollouts are sampled with the old policy's weights (DiffusionNFT's recipe; needs
    ``old_policy``)."""
    solver: Literal["euler", "dpm2", "sde"] = "euler"
    """How ``objective`` rollouts sample their clean latents: ``euler`` (the flow ODE), ``dpm2``
    (DiffusionNFT's second-order solver) or ``sde`` (the policy's own SDE, ``options.noise_level`` > 0)."""


@dataclass
class AsyncConfig:
    """Asynchronous rollouts (`trainer.async`; `mmalign.training.asynchronous`): a rollout worker with its own copy of the
    policy samples the next steps' batches while the trainer updates; the trainer pushes its weights to it after
    each training step. A sample is at most `max_staleness` training steps older than the weights it is trained
    on; the loss corrects it with the truncated importance weights of ``rollout.is_correction``."""

    max_staleness: int = 1
    """K: the most training steps (weight versions) a sample's behaviour weights may lag the trained weights. The
    worker prefetches K steps ahead; 0 is the synchronous trainer run through the worker (the same numbers)."""
    backend: Literal["process", "ray"] = "process"
    """Where the rollout worker runs: ``process`` (a forked worker process on this machine, with a background
    thread that scores rewards as batches arrive) or ``ray`` (Ray actors, the ``ray`` extra)."""
    timeout_s: float = 600.0
    """Waiting for a rollout or a weight sync fails loudly past this many seconds (a dead or frozen worker)."""
    ray_address: str | None = None
    """``ray`` backend: the cluster address given to ``ray.init`` (None: a local Ray instance)."""
    num_workers: int = 1
    """``ray`` backend: rollout actors; the rounds are handed out round-robin."""
    worker_resources: dict[str, Any] = field(default_factory=dict)
    """``ray`` backend: the resources of each rollout actor (``num_cpus``, ``num_gpus``, ...), so it is placed on
    its own device or node."""
    score_in_worker: bool = False
    """Score the rewards in the rollout worker right after it samples (its process, device or node; the reward
    set is copied there) instead of in a thread of the trainer's process as each batch arrives."""
    reward_workers: int = 0
    """``ray`` backend: reward actors, each with its own copy of the reward set, that score every sampled round as
    soon as its rollout actor finishes it (handed from actor to actor through the object store; the rounds
    assigned round-robin), so scoring overlaps both the sampling of the next round and the update. 0: score in a
    thread of the trainer's process (or in the rollout worker with `score_in_worker`). Each scoring call is
    waited for at most `timeout_s`, and a dead reward actor stops the step at once, naming the actor."""
    reward_resources: dict[str, Any] = field(default_factory=dict)
    """``ray`` backend with `reward_workers`: the resources of each reward actor (``num_cpus``, default 1,
    ``num_gpus``, custom resources), so reward models run on their own device or node."""


TRACKERS = ("tensorboard", "wandb")
"""The experiment trackers `TrainerConfig.log_with` may name (`mmalign.app.trackers`)."""


@dataclass
class TrainerConfig:
    steps: int = 100
    """Training steps (one rollout and its updates each)."""
    lr: float = 1e-5
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas, two numbers in [0, 1)."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    lr_scheduler: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate schedule after the warm-up."""
    warmup_steps: int = 0
    """Steps of linear warm-up from 0 to `lr`."""
    num_iterations: int = 1
    """mu: passes over each rollout."""
    minibatch_size: int | None = None
    """Samples per optimizer step (None: the whole rollout, one optimizer step per pass)."""
    microbatch_size: int | None = None
    """Samples per forward/backward; gradients accumulate up to `minibatch_size`."""
    shuffle_minibatches: bool = True
    """Shuffle samples between minibatches (when a rollout gives more than one optimizer step)."""
    max_grad_norm: float | None = 1.0
    """Clip the gradient norm to this (null: no clipping)."""
    mixed_precision: Literal["no", "bf16", "fp16"] = "no"
    """Accelerate mixed precision (`no`, `bf16`, `fp16`)."""
    cpu: bool = False
    """Force the CPU even when a GPU is available (passed to Accelerate)."""
    log_every: int = 1
    """Write metrics every this many steps (and at the last)."""
    sample_every: int = 10
    """Write samples/step_N.jsonl every this many steps (and at step 1)."""
    save_every: int = 50
    """Write a checkpoint every this many steps (and at the end)."""
    keep_checkpoints: int = 2
    """Checkpoints kept in output_dir/checkpoints (older ones are deleted)."""
    progress_bar: bool = True
    """Show a progress bar (main process only)."""
    dist_timeout_s: float = 300.0
    """Multi-process runs: the bound on waiting for another process, in seconds. It is the process group's
    collective timeout and the heartbeat monitor's limit: when a peer is frozen or dead, every process stops
    within about this long with an error naming the rank and the last complete checkpoint."""
    nan_reward_steps: int = 3
    """Stop the run when one reward is NaN for every sample this many steps in a row (0: never)."""
    log_with: list[str] = field(default_factory=list)
    """Experiment trackers that also receive the run, through accelerate: ``tensorboard`` and / or ``wandb``
    (the ``trackers`` extra: ``pip install -e ".[trackers]"``). They get the config at the start, the numbers
    of every logged step and the sample images / videos of every sample step (`mmalign.app.trackers`). Empty:
    only ``metrics.jsonl`` and ``samples/``."""
    tracker_project: str | None = None
    """Project name given to the trackers: the W&B project, the TensorBoard run folder
    ``output_dir/tensorboard/<project>/``. None: the last part of ``output_dir``."""
    tracker_kwargs: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Start options per tracker, by name: ``wandb`` -> ``wandb.init`` (``entity``, ``mode: offline``, ``name``,
    ``tags``, ...), ``tensorboard`` -> ``SummaryWriter`` (``flush_secs``, ...). Options of trackers not in
    `log_with` are ignored."""
    tracker_media: int = 8
    """Sample images / videos logged to the trackers at each sample step, at most: the first samples of the
    main process's batch (its first group first); 0 logs none."""
    async_: AsyncConfig | None = field(default=None, metadata={"yaml_key": "async"})
    """Asynchronous rollouts (YAML key ``trainer.async``, e.g. ``{max_staleness: 1}``; null: synchronous).
    See `AsyncConfig` and docs/distributed.md."""


@dataclass
class WatchdogConfig:
    """The over-optimisation watchdog (`eval.watchdog`): held-out gold rewards (`eval.rewards`) on fixed
    prompts and seeds every `every` steps during training, compared with the training reward."""

    every: int = 0
    """Evaluate the gold rewards every this many training steps (0: off)."""
    prompts: int = 8
    """Held-out prompts per evaluation (the first rows of `data.eval`, else of `data.train`)."""
    group_size: int = 2
    """Samples per prompt in each watchdog evaluation (fixed seeds: `eval.seed`)."""
    patience: int = 2
    """Divergence: the gold reward falls below its best by more than `tolerance` for this many consecutive
    evaluations while the training reward does not fall."""
    tolerance: float = 0.02
    """How far (absolute, in gold-reward units) below its best the gold reward may fall before it counts."""
    drift: bool = True
    """Images and video: also track drift of simple image statistics (saturation, colour entropy,
    high-frequency energy, background uniformity) against the base model's samples."""
    keep_best: bool = True
    """Keep the checkpoint with the best gold reward (`best/` in the run directory)."""
    stop: bool = False
    """Stop the run when divergence is detected (otherwise warn and go on)."""


@dataclass
class EvalConfig:
    """`mmalign eval` and `mmalign sample`: what is generated and how it is scored (no training)."""

    rewards: list[RewardConfig] = field(default_factory=list)
    """Scores used only in evaluation (e.g. a safety classifier whose mean is the flagged share, a
    CLIP score), reported beside the training rewards; same format as the top-level `rewards`."""
    group_size: int = 4
    """Samples per evaluation prompt."""
    split_column: str | None = None
    """Report every score per value of this data column too (e.g. `category`: safe / unsafe)."""
    max_rows: int | None = None
    """Evaluate at most this many prompts (None: all of `data.eval`, else of `data.train`)."""
    prompts_per_batch: int = 8
    """Prompts per generation call; chunk c of them is seeded with `eval.seed` + 1000003·c and, on N
    processes, generated by process c % N, so the samples do not depend on N."""
    seed: int = 1234
    """Seeds the sampling noise; the same for every checkpoint, so before/after samples are paired."""
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    """Over-optimisation watchdog during training (off unless `eval.watchdog.every` > 0)."""


@dataclass
class Config:
    pipeline: str = ""
    """Registered pipeline name (`mmalign list pipelines`); required."""
    output_dir: str = ""
    """Run directory (config.yaml, metrics.jsonl, samples/, checkpoints/, final/); required."""
    seed: int = 0
    """Seeds Python, NumPy and torch for the run (saved with every checkpoint)."""
    overwrite: bool = False
    """Allow training into an `output_dir` that already holds a run (its metrics are replaced). A non-empty
    folder that holds no run is refused even so (`mmalign.training.rundir.foreign_problem`)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    rewards: list[RewardConfig] = field(default_factory=list)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    options: Any = None
    """Pipeline-specific section, typed by the options class the pipeline registered with
    ``register_pipeline(name, options=...)``."""
    source: str = field(default="<dict>", compare=False)
    """Where the config came from (set by the loader; not a YAML key)."""

    def to_dict(self) -> dict[str, Any]:
        out = _to_plain(self)
        out.pop("source", None)
        return out


# ----------------------------------------------------------------------------- YAML


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 floats (``1e-5``) and booleans (only true/false), duplicate keys as errors."""

    def construct_mapping(self, node: yaml.Node, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.get(key)
                except TypeError:  # unhashable key: SafeConstructor reports it
                    continue
                if first is not None:
                    raise yaml.constructor.ConstructorError(
                        None,
                        None,
                        f"duplicate key {key!r} (first given on line {first + 1})",
                        key_node.start_mark,
                    )
                seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


_FLOAT_TAG, _BOOL_TAG = "tag:yaml.org,2002:float", "tag:yaml.org,2002:bool"
_FLOAT_RE = re.compile(
    r"""^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
    |[-+]?\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+\.[0-9_]*
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)
_BOOL_RE = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")


def _resolvers() -> dict[str, list[tuple[str, re.Pattern[str]]]]:
    out: dict[str, list[tuple[str, re.Pattern[str]]]] = {}
    for ch, items in yaml.SafeLoader.yaml_implicit_resolvers.items():
        new = []
        for tag, rx in items:
            if tag == _FLOAT_TAG:
                rx = _FLOAT_RE
            elif tag == _BOOL_TAG:
                if ch not in "tTfF":
                    continue
                rx = _BOOL_RE
            new.append((tag, rx))
        out[ch] = new
    return out


_Loader.yaml_implicit_resolvers = _resolvers()


def _load_yaml(text: str, name: str) -> Any:
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{name}:{mark.line + 1}:{mark.column + 1}" if mark is not None else name
        what = "; ".join(x for x in (e.context, e.problem) if x) or str(e)
        raise ConfigError(f"{where}: invalid YAML: {what}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{name}: invalid YAML: {e}") from None


# ----------------------------------------------------------------------------- conversion


@dataclass
class _Source:
    """Where the values came from: a file (or `<dict>`) and the keys the command line set."""

    name: str
    overrides: list[tuple[str, str, str]] = field(default_factory=list)
    """(key as written in messages, e.g. ``rewards[0].weight``, the override text, its raw value)."""
    label: str = ""

    def override_for(self, key: str) -> tuple[str, str, str] | None:
        for o in reversed(self.overrides):
            k = o[0]
            if key == k or key.startswith((k + ".", k + "[")) or k.startswith((key + ".", key + "[")):
                return o
        return None

    def raw_for(self, key: str) -> str | None:
        for k, _, raw in reversed(self.overrides):
            if k == key:
                return raw
        return None

    def where(self, key: str | None) -> str:
        o = self.override_for(key) if key is not None else None
        if o is not None:
            return f"command line: override {o[1]!r}"
        return self.label or self.name


def _where(src: _Source | str, key: str | None) -> str:
    return src.where(key) if isinstance(src, _Source) else src


def yaml_key(f: dataclasses.Field[Any]) -> str:
    """The YAML key of a config dataclass field: its name, or ``metadata["yaml_key"]`` where the key is a Python
    keyword (``trainer.async`` is the field ``async_``)."""
    return str(f.metadata.get("yaml_key", f.name))


def _to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {yaml_key(f): _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list | tuple):
        return [_to_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {k: _to_plain(v) for k, v in obj.items()}
    return obj


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in get_args(tp))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return f"a mapping ({tp.__name__})"
    return getattr(tp, "__name__", str(tp))


def _accepts_str(tp: Any) -> bool:
    return tp is str or (get_origin(tp) in (Union, types.UnionType) and str in get_args(tp))


class _Mismatch(Exception):
    pass


_NUMBER_RE = re.compile(r"[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")
_BOOL_WORDS = {"true": True, "false": False, "yes": True, "no": False, "on": True, "off": False}


def _convert(value: Any, tp: Any, key: str, src: _Source | str) -> Any:
    """Check `value` against type `tp`; return it converted (dicts into dataclasses)."""
    if tp is Any:
        return value
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            if dataclasses.is_dataclass(arg) and isinstance(value, dict):
                return _build(arg, value, key, src)  # its own error names the key inside the section
            try:
                return _convert(value, arg, key, src)
            except (_Mismatch, ConfigError):
                continue
        raise _Mismatch
    if origin is Literal:
        if any(value == a and type(value) is type(a) for a in get_args(tp)):
            return value
        raise _Mismatch
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise _Mismatch
        return _build(tp, value, key, src)
    if origin is list:
        if not isinstance(value, list):
            raise _Mismatch
        (item_tp,) = get_args(tp) or (Any,)
        return [_convert_checked(v, item_tp, f"{key}[{i}]", src) for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise _Mismatch
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _BOOL_WORDS:  # YAML 1.1 spellings
            return _BOOL_WORDS[value.strip().lower()]
        raise _Mismatch
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _Mismatch
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and _NUMBER_RE.fullmatch(value.strip()):  # a quoted number: "1e-5"
            return float(value)
        raise _Mismatch
    if tp is str:
        if isinstance(value, str):
            return value
        raise _Mismatch
    if isinstance(value, tp):
        return value
    raise _Mismatch


def _convert_checked(value: Any, tp: Any, key: str, src: _Source | str) -> Any:
    raw = src.raw_for(key) if isinstance(src, _Source) else None
    if raw is not None and value is not None and _accepts_str(tp):
        # a str key set on the command line takes the text as typed: `data.prompt_template=Q: {question}`
        # is not a YAML mapping, `output_dir=2024` not a number, `... #1` not a comment ('quotes' unquote)
        if isinstance(value, str):
            if not raw.lstrip().startswith(("'", '"')):
                value = raw
        else:
            try:
                return _convert(value, tp, key, src)
            except (_Mismatch, ConfigError):
                value = raw
    try:
        return _convert(value, tp, key, src)
    except _Mismatch:
        raise ConfigError(
            f"{_where(src, key)}: key '{key}' must be {_type_name(tp)}, got {type(value).__name__} {value!r}"
        ) from None


def _build(cls: type, data: dict[str, Any], prefix: str, src: _Source | str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {
        yaml_key(f): f
        for f in dataclasses.fields(cls)
        if f.init and not (cls is Config and f.name == "source")
    }
    dot = f"{prefix}." if prefix else ""
    kwargs: dict[str, Any] = {}
    for k, v in data.items():
        full = f"{dot}{k}"
        if k not in fields:
            close = difflib.get_close_matches(str(k), list(fields), n=1)
            hint = f" (did you mean '{dot}{close[0]}'?)" if close else ""
            raise ConfigError(
                f"{_where(src, full)}: unknown key '{full}'{hint}. Valid keys here: {', '.join(sorted(fields))}"
            )
        kwargs[fields[k].name] = _convert_checked(v, hints[fields[k].name], full, src)
    for name, f in fields.items():
        if (
            f.name not in kwargs
            and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        ):
            raise ConfigError(
                f"{_where(src, dot + name)}: key '{dot}{name}' is required ({_type_name(hints[f.name])})"
            )
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:  # e.g. a check in the dataclass's __post_init__
        raise ConfigError(f"{_where(src, prefix or None)}: section '{prefix or cls.__name__}': {e}") from None


# ----------------------------------------------------------------------------- overrides


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (["a", "b", "c"], parsed value); a value YAML cannot parse stays a string."""
    if "=" not in text:
        raise ConfigError(f"command line: override {text!r} must look like key.sub=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"command line: override {text!r} has an empty key")
    parts = [p.strip() for p in key.split(".")]
    if not all(parts):
        raise ConfigError(f"command line: override {text!r}: the key has an empty part")
    if not raw.strip():
        return parts, ""
    try:
        value = yaml.load(raw, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError:
        value = raw
    return parts, value


def _list_index(node: list[Any], part: str, path: list[str], i: int) -> int:
    if not re.fullmatch(r"[0-9]+", part) or int(part) > len(node):
        valid = f"0..{len(node) - 1}, or {len(node)} to append" if node else "0 to append"
        raise ConfigError(
            f"command line: override '{'.'.join(path)}': '{'.'.join(path[: i + 1])}' is not a valid index "
            f"into a list of {len(node)} (use {valid})"
        )
    return int(part)


def apply_override(data: dict[str, Any], path: list[str], value: Any) -> str:
    """Set `value` at `path` in the plain mapping `data` (creating sections); return the key as messages
    write it (``rewards[0].weight``). A list index may be one past the end, which appends; a missing
    list is created by its index 0 (``rollout.stop_strings.0=</answer>``)."""
    node: Any = data
    key = ""
    for i, part in enumerate(path[:-1]):
        # a section the file does not have is created: a list if the next part is an index, else a mapping
        new: Any = [] if re.fullmatch(r"[0-9]+", path[i + 1]) else {}
        if isinstance(node, list):
            idx = _list_index(node, part, path, i)
            if idx == len(node):
                node.append(new)
            elif node[idx] is None:
                node[idx] = new
            key += f"[{idx}]"
            node = node[idx]
        else:
            key = f"{key}.{part}" if key else part
            if node.get(part) is None:
                node[part] = new
            node = node[part]
        if not isinstance(node, dict | list):
            raise ConfigError(
                f"command line: override '{'.'.join(path)}': '{'.'.join(path[: i + 1])}' is a value, not a section"
            )
    last = path[-1]
    if isinstance(node, list):
        idx = _list_index(node, last, path, len(path) - 1)
        if idx == len(node):
            node.append(value)
        else:
            node[idx] = value
        key += f"[{idx}]"
    else:
        node[last] = value
        key = f"{key}.{last}" if key else last
    return key


# ----------------------------------------------------------------------------- entry points


def config_from_dict(
    data: dict[str, Any], source: str = "<dict>", *, pipeline_finder: _registry.PipelineFinder | None = None
) -> Config:
    """Validate a plain mapping into a `Config` (errors name the key and `source`); `pipeline_finder`: see
    `load_config`."""
    return _from_dict(data, _Source(source), pipeline_finder)


def _pipeline_meta(
    name: str, src: _Source, finder: _registry.PipelineFinder | None
) -> typing.Mapping[str, Any] | None:
    """The registration metadata of pipeline `name` (None: no source registers it; its options stay plain
    data, and the command line reports the unknown name with close matches)."""
    if not name:
        return None
    try:
        return (finder or _registry.find_pipeline)(name)
    except _registry.PluginError as e:
        raise ConfigError(f"{_where(src, 'pipeline')}: key 'pipeline': {e}") from e.__cause__


def _from_dict(data: Any, src: _Source, finder: _registry.PipelineFinder | None = None) -> Config:
    if not isinstance(data, dict):
        raise ConfigError(f"{src.name}: the top level must be a mapping, got {type(data).__name__}")
    raw_options = data.get("options")
    rest = {k: v for k, v in data.items() if k != "options"}
    cfg = _build(Config, rest, "", src)
    cfg.source = src.label or src.name
    meta = _pipeline_meta(cfg.pipeline, src, finder)
    options_cls = None if meta is None else meta.get("options")
    if options_cls is not None:
        cfg.options = _convert_checked(
            {} if raw_options is None else raw_options, options_cls, "options", src
        )
    elif raw_options is not None:
        if raw_options and meta is not None:
            raise ConfigError(
                f"{src.name}: key 'options': pipeline {cfg.pipeline!r} takes no options section (it declares no "
                f"options class), got {sorted(raw_options) if isinstance(raw_options, dict) else raw_options!r}; "
                "remove it"
            )
        cfg.options = raw_options
    validate(cfg, src)
    return cfg


def load_config(
    path: str | Path,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    pipeline_finder: _registry.PipelineFinder | None = None,
) -> Config:
    """Read a YAML config and apply `key.sub=value` overrides; raise ConfigError on any problem.

    The ``options:`` section is validated with the options class of the pipeline the config names, which
    `pipeline_finder` (name -> registration metadata or None; default `mmalign.registry.find_pipeline`)
    looks up. A pipeline no source registers keeps its options as plain data."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"config file not found: {path}" + (" (it is a directory)" if path.is_dir() else "")
        )
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read the config: {e}") from None
    data = _load_yaml(text, str(path))
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    src = _Source(str(path))
    for item in overrides:
        keys, value = parse_override(item)
        key = apply_override(data, keys, value)
        src.overrides.append((key, item, item.split("=", 1)[1]))
    if overrides:
        src.label = f"{path} (with command-line overrides)"
    return _from_dict(data, src, pipeline_finder)


def _validate_async(cfg: Config, need: typing.Callable[[bool, str, str], None]) -> None:
    """`trainer.async`: a bounded staleness, a positive timeout, and the importance-sampling correction that
    stale samples need; the loss must be a log-prob loss (the IS weights compare log-probs)."""
    c = cfg.trainer.async_
    if c is None:
        return
    need(c.max_staleness >= 0, "trainer.async.max_staleness", "must be >= 0")
    need(_finite(c.timeout_s) and c.timeout_s > 0, "trainer.async.timeout_s", "must be a finite number > 0")
    need(c.num_workers >= 1, "trainer.async.num_workers", "must be >= 1")
    need(c.reward_workers >= 0, "trainer.async.reward_workers", "must be >= 0")
    need(
        c.reward_workers == 0 or c.backend == "ray",
        "trainer.async.reward_workers",
        "needs trainer.async.backend 'ray' (reward workers are Ray actors)",
    )
    need(
        c.reward_workers == 0 or not c.score_in_worker,
        "trainer.async.reward_workers",
        "and trainer.async.score_in_worker both say where to score the rewards: set one of them",
    )
    need(
        c.reward_workers > 0 or not c.reward_resources,
        "trainer.async.reward_resources",
        "is an option of the reward actors: set trainer.async.reward_workers > 0",
    )
    for name, amount in c.reward_resources.items():
        need(
            isinstance(amount, int | float)
            and not isinstance(amount, bool)
            and _finite(amount)
            and amount >= 0,
            f"trainer.async.reward_resources.{name}",
            f"must be a number >= 0, got {amount!r}",
        )
    need(
        not cfg.algorithm.group_refill,
        "algorithm.group_refill",
        "is not available with trainer.async yet: its hinted re-rolls sample in the trainer's process",
    )
    need(
        c.backend == "ray" or (c.num_workers == 1 and c.ray_address is None and not c.worker_resources),
        "trainer.async.backend",
        "is 'process': num_workers, ray_address and worker_resources are options of the 'ray' backend",
    )
    if c.max_staleness > 0:
        need(
            cfg.rollout.is_correction != "none",
            "rollout.is_correction",
            "must be 'token' or 'sequence' with trainer.async.max_staleness > 0: stale samples are corrected "
            "with the truncated importance weights",
        )
        need(
            cfg.algorithm.objective is None,
            "trainer.async.max_staleness",
            f"must be 0 with algorithm.objective {cfg.algorithm.objective!r}: a policy-computed loss has no "
            "log-probs to importance-weight stale samples with",
        )


def _validate_trackers(t: TrainerConfig, need: typing.Callable[[bool, str, str], None]) -> None:
    def close(name: str) -> str:
        match = difflib.get_close_matches(name, TRACKERS, n=1)
        return f" (did you mean {match[0]!r}?)" if match else ""

    for i, name in enumerate(t.log_with):
        need(
            name in TRACKERS,
            f"trainer.log_with[{i}]",
            f"names an unknown tracker {name!r}{close(name)}; known: {', '.join(TRACKERS)}",
        )
        need(name not in t.log_with[:i], f"trainer.log_with[{i}]", f"names {name!r} twice")
    need(
        t.tracker_project is None or bool(t.tracker_project.strip()),
        "trainer.tracker_project",
        "must be a non-empty name or null",
    )
    for name, opts in t.tracker_kwargs.items():
        key = f"trainer.tracker_kwargs.{name}"
        need(
            name in TRACKERS,
            key,
            f"names an unknown tracker {name!r}{close(str(name))}; known: {', '.join(TRACKERS)}",
        )
        need(isinstance(opts, dict), key, f"must be a mapping of start options, got {type(opts).__name__}")
    need(t.tracker_media >= 0, "trainer.tracker_media", "must be >= 0")


def _finite(x: float) -> bool:
    return math.isfinite(x)


# The built-in estimators (`mmalign.algorithms.advantages`) whose advantages are all 0 in a group of fewer than 2 valid
# samples (the module's shared convention: each one centres a sample's reward on the other samples of its
# group before anything else, reinforce_pp's batch whitening and grpo_process's per-step part included), so
# with `rollout.group_size` 1 nothing is learned. Not `mc_grpo`: its rollout draws one extra sample per
# group (`extra_samples=1`), so a group of G=1 has 2 samples and the non-median one gets a non-zero
# advantage. Estimators registered by plugins are not known here and are not checked.
_GROUP_RELATIVE_ESTIMATORS = frozenset(
    {
        "grpo",
        "dr_grpo",
        "rloo",
        "reinforce_pp",
        "gdpo",
        "ngrpo",
        "pass_at_k",
        "a_grae",
        "grpo_process",
        "gigpo",
        "hgpo",
        "factorized",
        "ace",
        "canon",
        "drpo",
        "hapo",
        "adora",
        "riskpo",
    }
)


def validate(cfg: Config, src: _Source | str | None = None) -> None:
    """Cross-field checks that the type system cannot express."""
    where = cfg.source if src is None else src
    r, t, a, m = cfg.rollout, cfg.trainer, cfg.algorithm, cfg.model

    def need(cond: bool, key: str, msg: str) -> None:
        if not cond:
            raise ConfigError(f"{_where(where, key)}: key '{key}' {msg}")

    need(bool(cfg.pipeline), "pipeline", "is required")
    need(bool(cfg.output_dir), "output_dir", "is required")
    if m.lora.enabled:
        need(m.lora.r >= 1, "model.lora.r", "must be >= 1")
        need(m.lora.alpha > 0, "model.lora.alpha", "must be > 0")
    need(0 <= m.lora.dropout < 1, "model.lora.dropout", "must be in [0, 1)")
    need(
        m.logprob_chunk_size is None or m.logprob_chunk_size == "auto" or m.logprob_chunk_size >= 1,
        "model.logprob_chunk_size",
        "must be >= 1, auto or null",
    )
    need(_finite(m.logprob_memory_mb) and m.logprob_memory_mb > 0, "model.logprob_memory_mb", "must be > 0")
    need(cfg.data.max_rows is None or cfg.data.max_rows >= 1, "data.max_rows", "must be >= 1 or null")
    need(r.group_size >= 1, "rollout.group_size", "must be >= 1")
    need(r.prompts_per_step >= 1, "rollout.prompts_per_step", "must be >= 1")
    need(r.max_new_tokens >= 1, "rollout.max_new_tokens", "must be >= 1")
    need(
        _finite(r.temperature) and r.temperature > 0,
        "rollout.temperature",
        "must be a finite number > 0 (sampling is required for GRPO)",
    )
    need(0 < r.top_p <= 1, "rollout.top_p", "must be in (0, 1]")
    need(r.top_k >= 0, "rollout.top_k", "must be >= 0 (0: no top-k)")
    need(r.batch_size is None or r.batch_size >= 1, "rollout.batch_size", "must be >= 1 or null")
    need(t.steps >= 1, "trainer.steps", "must be >= 1")
    e = cfg.eval
    need(e.group_size >= 1, "eval.group_size", "must be >= 1")
    need(e.max_rows is None or e.max_rows >= 1, "eval.max_rows", "must be >= 1 or null")
    need(e.prompts_per_batch >= 1, "eval.prompts_per_batch", "must be >= 1")
    w = e.watchdog
    need(w.every >= 0, "eval.watchdog.every", "must be >= 0 (0: off)")
    need(w.prompts >= 1, "eval.watchdog.prompts", "must be >= 1")
    need(w.group_size >= 1, "eval.watchdog.group_size", "must be >= 1")
    need(w.patience >= 1, "eval.watchdog.patience", "must be >= 1")
    need(_finite(w.tolerance) and w.tolerance >= 0, "eval.watchdog.tolerance", "must be a finite number >= 0")
    need(
        w.every == 0 or bool(e.rewards),
        "eval.watchdog.every",
        "needs gold rewards in eval.rewards (rewards other than the training rewards)",
    )
    need(_finite(t.lr) and t.lr >= 0, "trainer.lr", "must be a finite number >= 0")
    need(
        _finite(t.weight_decay) and t.weight_decay >= 0,
        "trainer.weight_decay",
        "must be a finite number >= 0",
    )
    need(len(t.betas) == 2, "trainer.betas", "must be two numbers")
    need(all(0 <= b < 1 for b in t.betas), "trainer.betas", f"must be in [0, 1), got {t.betas}")
    need(_finite(t.adam_eps) and t.adam_eps > 0, "trainer.adam_eps", "must be a finite number > 0")
    need(t.warmup_steps >= 0, "trainer.warmup_steps", "must be >= 0")
    need(t.num_iterations >= 1, "trainer.num_iterations", "must be >= 1")
    for key in ("minibatch_size", "microbatch_size"):
        v = getattr(t, key)
        need(v is None or v >= 1, f"trainer.{key}", "must be >= 1 or null")
    if t.minibatch_size and t.microbatch_size:
        need(
            t.minibatch_size % t.microbatch_size == 0,
            "trainer.microbatch_size",
            f"({t.microbatch_size}) must divide trainer.minibatch_size ({t.minibatch_size})",
        )
    need(t.max_grad_norm is None or t.max_grad_norm > 0, "trainer.max_grad_norm", "must be > 0 or null")
    for key in ("log_every", "sample_every", "save_every", "keep_checkpoints"):
        need(getattr(t, key) >= 1, f"trainer.{key}", "must be >= 1")
    need(_finite(t.dist_timeout_s) and t.dist_timeout_s > 0, "trainer.dist_timeout_s", "must be > 0")
    need(t.nan_reward_steps >= 0, "trainer.nan_reward_steps", "must be >= 0 (0: never stop)")
    _validate_async(cfg, need)
    _validate_trackers(t, need)
    need(_finite(a.kl_coef) and a.kl_coef >= 0, "algorithm.kl_coef", "must be a finite number >= 0")
    need(a.adv_clip is None or a.adv_clip > 0, "algorithm.adv_clip", "must be > 0 or null")
    need(len(cfg.rewards) >= 1, "rewards", "must list at least one reward")
    columns: dict[str, int] = {}
    for i, rw in enumerate(cfg.rewards):
        need(bool(rw.name), f"rewards[{i}].name", "is required")
        need(_finite(rw.weight), f"rewards[{i}].weight", f"must be a finite number, got {rw.weight}")
        column = rw.alias or rw.name
        need(
            column not in columns,
            f"rewards[{i}]",
            f"is named {column!r} like rewards[{columns.get(column)}]; give one of them an `alias`",
        )
        columns[column] = i
    _validate_can_learn(cfg, need)


def _validate_can_learn(cfg: Config, need: typing.Callable[[bool, str, str], None]) -> None:
    """A configuration whose every advantage is 0 trains nothing: an error before any model loads."""
    r, a = cfg.rollout, cfg.algorithm
    need(
        r.group_size >= 2 or a.estimator not in _GROUP_RELATIVE_ESTIMATORS,
        "rollout.group_size",
        f"is {r.group_size}, but algorithm.estimator {a.estimator!r} compares each sample with the other "
        "samples of its group and gives a group of one sample advantage 0: nothing would be learned; "
        "use rollout.group_size >= 2",
    )
    weights = ", ".join(f"rewards[{i}].weight" for i in range(len(cfg.rewards)))
    need(
        any(rw.weight != 0 for rw in cfg.rewards),
        "rewards",
        f"has weight 0 everywhere ({weights}): no reward contributes to the advantages (0 means logged "
        "only), so nothing would be learned; give at least one reward a non-zero weight",
    )
