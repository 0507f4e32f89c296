"""DiffusionNFT and AWM (`algorithm.objective`) trained through the one trainer on the shipped tiny SD3 model:
the policy-computed loss path of `GroupTrainer`, the old-policy EMA as a policy-contributed checkpointed
callback, exact resume, and (slow) a rising reward."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import pipelines
from mmalign.app.run import build_trainer
from mmalign.config import ConfigError, load_config
from mmalign.policies import forward_process as fp

REPO = Path(__file__).resolve().parents[2]
NFT = REPO / "configs" / "text_to_image-nft-tiny.yaml"
TINY = REPO / "configs" / "text_to_image-tiny.yaml"
AWM = [
    "algorithm.objective=awm",
    "algorithm.solver=euler",
    "options.noise_level=0.0",
    "options.seed=0",
    "algorithm.old_policy={decay_type: 0}",
]
SMALL = ["rollout.prompts_per_step=2", "rollout.group_size=4", "options.num_steps=4"]


def cfg(base: Path, out: Path, *extra: str):
    return load_config(
        base,
        [
            f"model.name_or_path={REPO / 'assets' / 'models' / 'text_to_image-tiny'}",
            f"data.train={REPO / 'assets' / 'text_to_image' / 'train.jsonl'}",
            f"data.eval={REPO / 'assets' / 'text_to_image' / 'eval.jsonl'}",
            f"output_dir={out}",
            "trainer.progress_bar=false",
            "trainer.sample_every=1000",
            *extra,
        ],
    )


def make(c, resume: bool = False):
    return build_trainer(c, pipelines.get(c.pipeline)(c), resume=resume)


def strip_time(m: dict) -> dict:
    return {k: v for k, v in m.items() if not k.startswith("time/")}


@pytest.mark.parametrize(
    ("base", "extra", "metric"), [(NFT, [], "objective/r"), (TINY, AWM, "objective/ratio")]
)
def test_objective_trains_through_the_trainer(
    tmp_path: Path, base: Path, extra: list[str], metric: str
) -> None:
    c = cfg(base, tmp_path / "run", *SMALL, *extra, "trainer.steps=2", "trainer.save_every=1000")
    t = make(c)
    old = [cb for cb in t.callbacks if isinstance(cb, fp.OldPolicy)]
    assert len(old) == 1  # contributed by the policy, not by the pipeline
    before = [p.detach().clone() for p in t.policy.trainable_parameters()]
    history = t.train()
    k = t.policy.num_objective_actions
    assert t._last_batch.mask.shape == (8, k) and "clean_latents" in t._last_batch.payload
    assert "logp_old" not in t._last_batch.payload and t._last_batch.logp_old is None
    for m in history:
        assert metric in m and torch.isfinite(torch.tensor(m["loss"])) and "approx_kl" not in m
    moved = [
        not torch.equal(a, b.detach()) for a, b in zip(before, t.policy.trainable_parameters(), strict=True)
    ]
    assert any(moved)
    if base is NFT:  # d = 0.001 * step: the old copy trails the weights but has moved off the start
        assert history[-1]["nft/old_decay"] == pytest.approx(0.002)
        assert old[0].params is not None
        assert any(not torch.equal(q, p) for q, p in zip(old[0].params, before, strict=True))


def test_old_policy_resumes_exactly(tmp_path: Path) -> None:
    args = (*SMALL, "trainer.steps=3", "trainer.save_every=1", "trainer.keep_checkpoints=5")
    full = make(cfg(NFT, tmp_path / "full", *args))
    full_hist = full.train()

    part = make(cfg(NFT, tmp_path / "part", *args[:-2], "trainer.steps=2", "trainer.save_every=1"))
    part.train()
    resumed = make(cfg(NFT, tmp_path / "part", *args), resume=True)
    assert resumed.step == 2
    old = next(cb for cb in resumed.callbacks if isinstance(cb, fp.OldPolicy))
    assert old.params is not None  # restored from the checkpoint, before any step of the resumed run
    resumed.train()
    metrics = [json.loads(x) for x in (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()]
    assert [strip_time(m) for m in metrics] == [strip_time(rundir_m) for rundir_m in full_hist]
    old_full = next(cb for cb in full.callbacks if isinstance(cb, fp.OldPolicy))
    for a, b in zip(old_full.params, old.params, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(full.policy.trainable_parameters(), resumed.policy.trainable_parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_objective_config_errors_name_the_key(tmp_path: Path) -> None:
    for extra, key in [
        (["algorithm.timesteps={strategy: nope}"], "algorithm.timesteps"),
        (["algorithm.old_policy={decay_type: 7}"], "algorithm.old_policy"),
        (["algorithm.solver=sde"], "algorithm.solver"),  # noise_level 0 in the NFT config
    ]:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            make(cfg(NFT, tmp_path / key, *SMALL, *extra))


@pytest.mark.slow
@pytest.mark.parametrize(("base", "extra"), [(NFT, []), (TINY, AWM)])
def test_objective_raises_the_reward(tmp_path: Path, base: Path, extra: list[str]) -> None:
    c = cfg(
        base,
        tmp_path / "run",
        *extra,
        "rollout.prompts_per_step=4",
        "trainer.steps=16",
        "trainer.save_every=1000",
    )
    reward = [m["reward/mean"] for m in make(c).train()]
    first, last = sum(reward[:4]) / 4, sum(reward[-4:]) / 4
    assert last > first + 0.05, (first, last)
