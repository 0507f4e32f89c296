"""DiffusionNFT and AWM (`algorithm.objective`) trained through the one trainer on the shipped tiny SD3 model:
the policy-computed loss path of `GroupTrainer`, the old-policy EMA as a policy-contributed checkpointed
callback, exact resume, and (slow) a rising reward."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mmalign.app.evaluation import load_weights
from mmalign.config import ConfigError
from mmalign.policies import forward_process as fp
from tests.policies.tiny_t2i import SMALL
from tests.policies.tiny_t2i import make_trainer as make
from tests.policies.tiny_t2i import t2i_config as cfg

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
    k = t.policy.training.num_actions
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


def with_ema(c, spec: dict | None = None):
    """`algorithm.eval_ema` (a dict of `WeightEMA` options) set on a loaded config."""
    c.algorithm.eval_ema = {} if spec is None else spec
    return c


def test_eval_ema_resumes_exactly_and_is_exported(tmp_path: Path) -> None:
    """DiffusionNFT with its evaluation EMA (decay min((1 + n) / (10 + n), 0.9)) beside the old policy: both are
    checkpointed and resume bit for bit; final/ holds the EMA's weights; a checkpoint's EMA loads into a policy."""
    from safetensors.torch import load_file

    args = (*SMALL, "trainer.steps=3", "trainer.save_every=1", "trainer.keep_checkpoints=5")
    full = make(with_ema(cfg(NFT, tmp_path / "full", *args)))
    ema_full = next(cb for cb in full.callbacks if isinstance(cb, fp.WeightEMA))
    assert ema_full.preset == "diffusion_nft" and ema_full.params is not None  # copied at set-up
    full_hist = full.train()
    assert [m["ema/decay"] for m in full_hist] == pytest.approx([2 / 11, 3 / 12, 4 / 13])

    part = make(with_ema(cfg(NFT, tmp_path / "part", *args[:-2], "trainer.steps=2", "trainer.save_every=1")))
    part.train()
    resumed = make(with_ema(cfg(NFT, tmp_path / "part", *args)), resume=True)
    ema = next(cb for cb in resumed.callbacks if isinstance(cb, fp.WeightEMA))
    assert resumed.step == 2 and ema.updates == 2
    resumed.train()
    metrics = [json.loads(x) for x in (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()]
    assert [strip_time(m) for m in metrics] == [strip_time(m) for m in full_hist]
    for a, b in zip(ema_full.params, ema.params, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(full.policy.trainable_parameters(), resumed.policy.trainable_parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert any(
        not torch.equal(a.detach(), b)
        for a, b in zip(full.policy.trainable_parameters(), ema_full.params, strict=True)
    )

    # final/: the EMA's weights (the LoRA adapter merged), as DiffusionNFT saves its EMA
    pol = full.policy
    with ema_full.applied():
        expected = pol._denoiser_to_save(tmp_path / "scratch", "transformer").state_dict()
    saved = load_file(str(next((tmp_path / "full" / "final" / "transformer").glob("*.safetensors"))))
    assert set(saved) == set(expected)
    for k, v in saved.items():
        torch.testing.assert_close(v, expected[k].detach().to(v.dtype), rtol=0, atol=0)

    # a checkpoint's EMA weights, by trainable-state name, loadable into the policy (mmalign eval / sample)
    weights = fp.checkpoint_ema_weights(tmp_path / "full" / "checkpoints" / "step_000003")
    assert weights is not None and set(weights) == set(pol.trainable_state_dict())
    with torch.no_grad():
        for p in pol.trainable_parameters():
            p.zero_()
    load_weights(pol, tmp_path / "full" / "checkpoints" / "step_000003")  # what `mmalign eval` loads
    for a, b in zip(pol.trainable_parameters(), ema_full.params, strict=True):
        torch.testing.assert_close(a.detach(), b, rtol=0, atol=0)
    assert fp.checkpoint_ema_weights(next((tmp_path / "part").glob("checkpoints/step_*"))) is not None


def test_awm_ema_kl_trains_through_the_trainer(tmp_path: Path) -> None:
    """AWM with ema_kl_beta > 0 and no eval_ema: Flow-Factory's default EMA (decay 0.995, power warm-up 10,
    every 10 epochs) is built, the loss reads its velocity and logs the v-space KL to it."""
    c = cfg(
        TINY,
        tmp_path / "run",
        *SMALL,
        *AWM,
        "trainer.steps=2",
        "trainer.save_every=1000",
        "algorithm.objective_kwargs={ema_kl_beta: 0.1}",
    )
    t = make(c)
    ema = next(cb for cb in t.callbacks if isinstance(cb, fp.WeightEMA))
    assert ema.preset == "flow_factory" and ema.every == 10 and t.policy.training.ema_in_loss
    hist = t.train()
    for m in hist:
        assert "objective/ema_kl" in m and m["objective/ema_kl"] >= 0 and "ema/decay" not in m
    assert hist[-1]["objective/ema_kl"] > 0  # the weights moved off the EMA (not updated before epoch 10)


def test_objective_config_errors_name_the_key(tmp_path: Path) -> None:
    """A config built in code (no `mmalign.app.preflight` pass) meets the same checks when the policy is set up
    (tests/app/test_preflight_objective.py: the command line refuses them before any model loads)."""
    for extra, key in [
        (["algorithm.timesteps={strategy: nope}"], "algorithm.timesteps"),
        (["algorithm.old_policy={decay_type: 7}"], "algorithm.old_policy"),
        (["algorithm.solver=sde"], "algorithm.solver"),  # noise_level 0 in the NFT config
    ]:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            make(cfg(NFT, tmp_path / key, *SMALL, *extra))
    with pytest.raises(ConfigError, match=r"algorithm\.eval_ema.*schedule must be one of"):
        make(with_ema(cfg(NFT, tmp_path / "ema", *SMALL), {"schedule": "cubic"}))
    with pytest.raises(ConfigError, match=r"algorithm\.objective_kwargs\.ema_kl_beta.*must be"):
        make(cfg(TINY, tmp_path / "beta", *SMALL, *AWM, "algorithm.objective_kwargs={ema_kl_beta: lots}"))


AWM_EMA_KL = [*AWM, "algorithm.objective_kwargs={ema_kl_beta: 0.1}"]
"""AWM with Flow-Factory's recommended EMA KL (beta 0.1 towards an EMA with decay 0.9, power, every epoch)."""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("base", "extra", "ema"),
    [(NFT, [], None), (TINY, AWM, None), (TINY, AWM_EMA_KL, {"decay": 0.9, "every": 1})],
)
def test_objective_raises_the_reward(tmp_path: Path, base: Path, extra: list[str], ema: dict | None) -> None:
    c = cfg(
        base,
        tmp_path / "run",
        *extra,
        "rollout.prompts_per_step=4",
        "trainer.steps=16",
        "trainer.save_every=1000",
    )
    if ema is not None:
        with_ema(c, ema)
    reward = [m["reward/mean"] for m in make(c).train()]
    first, last = sum(reward[:4]) / 4, sum(reward[-4:]) / 4
    assert last > first + 0.05, (first, last)
