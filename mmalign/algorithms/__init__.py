"""The math: advantage estimators, losses and their composition, filters, reward transforms, the flow SDE."""
