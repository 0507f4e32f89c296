"""Asynchronous rollouts with a denoising policy (the tiny SD3-style text-to-image model): K = 0 is the
synchronous trainer bit for bit, and with K = 1 the behaviour log-probs the worker recorded (its SDE transition
log-densities) are those of the weights it had."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import pipelines
from mmalign.config import load_config
from mmalign.training.trainer import GroupTrainer

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "assets" / "models" / "text_to_image-tiny"

pytestmark = [
    pytest.mark.skipif(os.name != "posix", reason="the process backend forks"),
    pytest.mark.skipif(not MODEL.is_dir(), reason=f"{MODEL} is not built (mmalign tiny build text_to_image)"),
]


def cfg_of(out: Path, *extra: str):
    return load_config(
        REPO / "configs" / "text_to_image-tiny.yaml",
        [
            f"model.name_or_path={MODEL}",
            f"output_dir={out}",
            "trainer.progress_bar=false",
            "trainer.save_every=1000",
            "trainer.sample_every=1000",
            "options.num_steps=3",
            "rollout.group_size=2",
            "rollout.prompts_per_step=2",
            "rewards.1={name: jpeg_incompressibility}",  # varies within every group, so the weights move
            "trainer.lr=3e-3",
            *extra,
        ],
    )


def strip(m: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in m.items() if not k.startswith(("time/", "async/"))}


def test_k0_samples_as_sync_for_a_denoising_policy(tmp_path: Path) -> None:
    """The rollout, its rewards and the update's metrics (the gradient norm included) are the synchronous
    trainer's bit for bit; the decoded pixels agree to fp32 rounding (see below)."""
    cfg = cfg_of(tmp_path / "sync", "trainer.steps=1")
    sync = GroupTrainer(cfg, pipelines.get(cfg.pipeline)(cfg))
    expected = sync.train()
    cfg = cfg_of(tmp_path / "async", "trainer.steps=1", "trainer.async={max_staleness: 0}")
    trainer = GroupTrainer(cfg, pipelines.get(cfg.pipeline)(cfg))
    got = trainer.train()
    x, y = strip(expected[0]), strip(got[0])
    diff = {k: (v, y.get(k)) for k, v in x.items() if v != y.get(k)}
    assert not diff and x.keys() == y.keys(), diff
    a, b = sync._last_batch, trainer._last_batch
    assert torch.equal(a.rewards, b.rewards)
    for key in ("latents", "next_latents"):
        assert torch.equal(a.payload[key], b.payload[key]), key
    # decoded in the worker with one torch thread (fork-safe), in the synchronous trainer with torch's default:
    # a convolution's sums may be split differently, so the pixels agree to fp32 rounding
    torch.testing.assert_close(a.outputs["images"], b.outputs["images"], rtol=0, atol=1e-5)


class Recorder:
    def __init__(self) -> None:
        self.batches: dict[int, Any] = {}
        self.weights: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_start(self, trainer: GroupTrainer, step: int) -> None:
        self.weights[step] = trainer.policy.trainable_state_dict()

    def on_step_end(self, trainer: GroupTrainer, step: int, metrics: dict[str, Any]) -> None:
        self.batches[step] = trainer._last_batch
        self.weights[step] = trainer.policy.trainable_state_dict()


def test_k1_denoising_behaviour_logprobs(tmp_path: Path) -> None:
    cfg = cfg_of(tmp_path / "k1", "trainer.steps=3", "trainer.async={max_staleness: 1}")
    rec = Recorder()
    hist = GroupTrainer(cfg, pipelines.get(cfg.pipeline)(cfg), monitors=(rec,)).train()
    assert [m["async/staleness_max"] for m in hist] == [0, 1, 1]
    scorer = pipelines.get(cfg.pipeline)(cfg).policy
    scorer.model.train()
    for step in (2, 3):
        batch = rec.batches[step]
        assert int(batch.outputs["policy_version"][0]) == step - 2
        scorer.load_trainable_state_dict(rec.weights[step - 2])
        with torch.no_grad():
            behaviour = scorer.action_stats(batch).logp
        mask = batch.mask
        assert torch.allclose(batch.logp_sampler[mask], behaviour[mask].float(), atol=1e-4, rtol=1e-4)
        scorer.load_trainable_state_dict(rec.weights[step - 1])
        with torch.no_grad():
            pi_old = scorer.action_stats(batch).logp
        assert float((pi_old - behaviour)[mask].abs().max()) > 1e-5
        # the update scores the actions in chunks (`Policy.action_chunks`) and logs the IS diagnostics of the
        # first chunk of each microbatch (one microbatch here)
        chunks = scorer.action_chunks(batch)
        cols = chunks[0] if chunks else torch.arange(mask.shape[1])
        dlogp = (pi_old - behaviour)[:, cols][mask[:, cols]].abs()
        assert hist[step - 1]["is/abs_dlogp_mean"] == pytest.approx(float(dlogp.mean()), rel=1e-2, abs=1e-6)
