"""The data that flows: rows and prompts, the Rollout, prompt samplers, media, rollout loops, the hub."""
