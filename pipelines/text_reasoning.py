"""Text reasoning: a causal LM trained with GRPO on verifiable answers (GSM8K-style JSONL).

Data: JSONL rows with at least the columns used by ``data.prompt_template`` (``question`` by
default) and the reference answer column read by the accuracy reward (``answer`` by default);
every other column reaches the rewards too. Rewards come from the config (``answer_accuracy``,
``format``, ``overlong`` or any plugin).
"""

from __future__ import annotations

from typing import Any

from mmalign.config import Config
from mmalign.data.rows import load_rows
from mmalign.policies.text import TextPolicy
from pipelines import TrainingSetup, register_pipeline
from pipelines.common import policy_kwargs
from rewards import RewardSet


def build_text_policy(cfg: Config) -> TextPolicy:
    """The `TextPolicy` described by `cfg.model` and `cfg.rollout`."""
    m = cfg.model
    kwargs = policy_kwargs(cfg)  # checks the rollout loop before the model is built or loaded
    path = m.name_or_path
    return TextPolicy.from_pretrained(
        path, use_chat_template=m.use_chat_template, shared_prefix=m.shared_prefix, **kwargs
    )


@register_pipeline("text_reasoning")
def build(cfg: Config) -> Any:
    """Causal LM + verifiable text rewards (accuracy, format, overlong) on JSONL prompts."""
    rows = load_rows(cfg.data.train, cfg.data.prompt_template, cfg.data.max_rows)
    eval_rows = load_rows(cfg.data.eval, cfg.data.prompt_template) if cfg.data.eval else None
    rewards = RewardSet(cfg.rewards, source=cfg.source)
    policy = build_text_policy(cfg)
    return TrainingSetup(
        policy=policy, rewards=rewards, data=rows, eval_data=eval_rows, sample_columns=["answer", "solution"]
    )
