"""mmalign: group-relative RL (GRPO and family) for language, vision-language and generative models."""

__version__ = "0.1.0"
