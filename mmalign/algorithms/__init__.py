"""The math: advantage estimators, losses and their composition, filters, reward transforms, the flow SDE.

Importing the package registers every built-in entry: the registry modules and the seed-paper modules that add
to them (`seed_estimators`, `seed_losses`, `seed_transforms`, which import their registry, never the reverse).
"""

from mmalign.algorithms import (  # noqa: F401
    advantages,
    losses,
    reward_transforms,
    seed_estimators,
    seed_losses,
    seed_transforms,
)
