"""Euphonium's policy scored in chunks of trained steps (`Policy.action_chunks`): the log-probs of each chunk
are the columns of the whole, and the chunks' drift-distillation terms add up to the whole microbatch's."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.pipelines.video.test_video_geometry import ROWS, _policies, folders  # noqa: F401 (fixture)


def test_distillation_chunks_add_up(folders, tmp_path: Path) -> None:  # noqa: F811
    comp, _ = _policies(folders, tmp_path, "options.guidance_strength=0.5")
    policy = comp.policy
    policy.on_train_step(0)
    r = policy.rollout(ROWS, 2, compute_logp=True)
    assert r.num_actions > 1
    with torch.no_grad():
        whole = policy.action_stats(r)
        parts = [policy.action_stats(r, actions=torch.tensor([j])) for j in range(r.num_actions)]
    torch.testing.assert_close(torch.cat([p.logp for p in parts], dim=1), whole.logp)
    total = sum(p.aux_losses["drift_distill"] for p in parts)
    torch.testing.assert_close(total, whole.aux_losses["drift_distill"], rtol=1e-5, atol=1e-7)
