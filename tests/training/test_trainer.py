"""GroupTrainer on tiny offline models: smoke, learning, resume, accumulation, bad inputs."""

from __future__ import annotations

import copy
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch

import pipelines
from mmalign.config import ConfigError, config_from_dict, load_config
from mmalign.training.rundir import latest_checkpoint
from mmalign.training.trainer import GroupTrainer, TrainingError
from rewards import Reward, RewardBatch

REPO = Path(__file__).resolve().parents[2]
TRAIN_JSONL = REPO / "assets" / "text_reasoning" / "train.jsonl"


def make_cfg(model_dir: Path, out: Path, **sections: Any):
    data: dict[str, Any] = {
        "pipeline": "text_reasoning",
        "output_dir": str(out),
        "seed": 0,
        "model": {"name_or_path": str(model_dir)},
        "data": {"train": str(TRAIN_JSONL), "prompt_template": "Q: {question} = ?\nA:"},
        "rollout": {"group_size": 4, "prompts_per_step": 4, "max_new_tokens": 8},
        "rewards": [
            {"name": "answer_accuracy", "kwargs": {"extract": "tag", "mode": "numeric"}},
            {"name": "format", "weight": 0.2, "kwargs": {"tags": ["answer"], "strict": True}},
        ],
        "trainer": {"steps": 3, "lr": 3e-4, "progress_bar": False, "save_every": 100, "sample_every": 1},
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key].update(value)
        else:
            data[key] = value
    return config_from_dict(data, "test")


def make_trainer(cfg, resume: bool = False) -> GroupTrainer:
    return GroupTrainer(cfg, pipelines.get(cfg.pipeline)(cfg), resume=resume)


def read_metrics(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def strip_time(m: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in m.items() if not k.startswith("time/")}


class LengthMod3(Reward):
    """len(text) % 3: varies on a random model's gibberish, so advantages are not all zero."""

    def __call__(self, batch: RewardBatch) -> list[float]:
        return [float(len(t) % 3) for t in batch.texts]


VARIED = [
    {"name": f"{__name__}:LengthMod3", "alias": "length_mod3"},
    {"name": "format", "kwargs": {"tags": ["answer"]}},
]


def test_smoke_parameters_change_and_run_dir(random_text_model_dir: Path, tmp_path: Path) -> None:
    cfg = make_cfg(random_text_model_dir, tmp_path / "run", rewards=VARIED)
    trainer = make_trainer(cfg)
    before = {k: v.clone() for k, v in trainer.policy.trainable_state_dict().items()}
    trainer.train()
    after = trainer.policy.trainable_state_dict()
    changed = sum(not torch.equal(before[k], after[k]) for k in before)
    assert changed == len(before)  # full fine-tuning: every tensor moved
    out = tmp_path / "run"
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for key in (
        "reward/mean",
        "reward/length_mod3/mean",
        "reward/length_mod3/std",
        "reward/format/mean",
        "loss",
        "clip_frac",
        "approx_kl",
        "zero_std_frac",
        "time/step_s",
        "lr",
    ):
        assert key in metrics[0], key
    samples = [json.loads(x) for x in (out / "samples" / "step_000001.jsonl").read_text().splitlines()]
    assert len(samples) == 16 and {"prompt", "text", "rewards", "advantage", "answer"} <= set(samples[0])
    assert set(samples[0]["rewards"]) == {"length_mod3", "format"}
    assert latest_checkpoint(out).name == "step_000003"
    assert (out / "config.yaml").exists()
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(out / "final")
    ref = dict(reloaded.named_parameters())
    for name, value in after.items():
        assert torch.allclose(ref[name], value), name


def test_reward_rises_on_the_tiny_task(tiny_text_model_dir: Path, tmp_path: Path) -> None:
    """The quickstart setting, shortened: accuracy of the last 10 steps beats the first 10 clearly."""
    cfg = load_config(
        REPO / "configs" / "text_reasoning-tiny.yaml",
        [
            f"model.name_or_path={tiny_text_model_dir}",
            f"output_dir={tmp_path / 'run'}",
            "trainer.steps=60",
            "trainer.progress_bar=false",
            "trainer.save_every=1000",
            f"data.train={TRAIN_JSONL}",
        ],
    )
    history = make_trainer(cfg).train()
    acc = [m["reward/answer_accuracy/mean"] for m in history]
    first, last = sum(acc[:10]) / 10, sum(acc[-10:]) / 10
    assert last > first + 0.25, (first, last)


def test_resume_continues_exactly(random_text_model_dir: Path, tmp_path: Path) -> None:
    steps = {"trainer": {"steps": 6, "save_every": 3, "lr": 1e-3, "progress_bar": False}, "rewards": VARIED}
    full_cfg = make_cfg(random_text_model_dir, tmp_path / "full", **steps)
    full = make_trainer(full_cfg).train()

    part_cfg = make_cfg(random_text_model_dir, tmp_path / "part", **steps)
    part_cfg.trainer.steps = 4  # runs past the checkpoint at 3, like a run killed at step 4
    make_trainer(part_cfg).train()
    (tmp_path / "part" / "checkpoints" / "step_000004").rename(
        tmp_path / "part" / "gone"
    )  # "killed" before 4 saved
    resumed_cfg = make_cfg(random_text_model_dir, tmp_path / "part", **steps)
    trainer = make_trainer(resumed_cfg, resume=True)
    assert trainer.step == 3
    trainer.train()
    metrics = read_metrics(tmp_path / "part")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]  # step 4 of the first try was replaced
    assert [strip_time(m) for m in metrics] == [strip_time(m) for m in full]


def test_existing_run_is_not_overwritten(random_text_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ConfigError, match="already holds a run"):
        make_trainer(make_cfg(random_text_model_dir, out))
    assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n'
    with pytest.raises(ConfigError, match="no complete checkpoint"):
        make_trainer(make_cfg(random_text_model_dir, tmp_path / "fresh"), resume=True)


def test_bad_registry_names_point_at_the_config_key(random_text_model_dir: Path, tmp_path: Path) -> None:
    for section, value, key in [
        ("estimator", "grpoo", "algorithm.estimator"),
        ("loss", "ppo", "algorithm.loss"),
        ("loss_agg", "token_meen", "algorithm.loss_agg"),
        ("filter", "dynamic", "algorithm.filter"),
    ]:
        cfg = make_cfg(random_text_model_dir, tmp_path / section, algorithm={section: value})
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            make_trainer(cfg)


_calls = {"n": 0}


class ExplodingReward(Reward):
    """Raises on its third call."""

    needs = {"texts"}

    def __call__(self, batch: RewardBatch) -> list[float]:
        _calls["n"] += 1
        if _calls["n"] == 3:
            raise ZeroDivisionError("boom")
        return [1.0] * len(batch)


class NaNForFirstGroup(Reward):
    """NaN (not applicable) for every sample of the first group of each batch."""

    def __call__(self, batch: RewardBatch) -> list[float]:
        first = int(batch.group[0])
        return [
            float("nan") if int(g) == first else float(len(t) % 3) for g, t in zip(batch.group, batch.texts)
        ]


def test_reward_that_raises_names_itself_and_keeps_earlier_steps(
    random_text_model_dir: Path, tmp_path: Path
) -> None:
    _calls["n"] = 0
    cfg = make_cfg(
        random_text_model_dir,
        tmp_path / "run",
        rewards=[{"name": f"{__name__}:ExplodingReward", "alias": "exploding"}],
        trainer={"steps": 5, "save_every": 1, "progress_bar": False},
    )
    with pytest.raises(TrainingError) as err:
        make_trainer(cfg).train()
    msg = str(err.value)
    assert "step 3" in msg and "'exploding'" in msg and "ZeroDivisionError: boom" in msg
    assert "step_000002" in msg and "--resume" in msg
    assert [m["step"] for m in read_metrics(tmp_path / "run")] == [1, 2]


def test_nan_for_a_whole_group_warns_and_training_goes_on(
    random_text_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = make_cfg(
        random_text_model_dir,
        tmp_path / "run",
        rewards=[
            {"name": f"{__name__}:NaNForFirstGroup", "alias": "picky"},
            {"name": "format", "kwargs": {"tags": ["answer"]}},
        ],
        trainer={"steps": 2, "progress_bar": False, "save_every": 100},
    )
    trainer = make_trainer(cfg)
    history = trainer.train()
    cap = capsys.readouterr()
    err = cap.err + cap.out
    assert "reward 'picky' returned NaN (not applicable) for every sample of group 0" in err
    assert all(m["reward/nan_groups"] >= 1 for m in history)
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in history)
    assert 0 < history[0]["reward/picky/nan_frac"] < 1


def test_microbatches_accumulate_to_the_same_gradient(random_text_model_dir: Path, tmp_path: Path) -> None:
    """token_mean over the global minibatch: splitting it into microbatches leaves the gradient unchanged."""
    cfg = make_cfg(
        random_text_model_dir, tmp_path / "a", trainer={"lr": 0.0, "progress_bar": False}, rewards=VARIED
    )
    trainer = make_trainer(cfg)
    trainer.timers = defaultdict(float)
    torch.manual_seed(3)
    batch, _ = trainer.make_rollout()
    batch.advantages = torch.randn(len(batch))  # make every sample count
    whole = trainer.update(copy.deepcopy(batch))["grad_norm"]
    trainer.microbatch = 3
    split = trainer.update(copy.deepcopy(batch))["grad_norm"]
    assert whole > 0 and abs(whole - split) < 1e-5 * whole


def test_mu_and_minibatches_need_and_use_logp_old(random_text_model_dir: Path, tmp_path: Path) -> None:
    cfg = make_cfg(
        random_text_model_dir,
        tmp_path / "run",
        trainer={
            "num_iterations": 2,
            "minibatch_size": 8,
            "microbatch_size": 4,
            "steps": 2,
            "lr": 1e-3,
            "progress_bar": False,
        },
        rewards=VARIED,
    )
    trainer = make_trainer(cfg)
    assert trainer.need_logp_old
    history = trainer.train()
    # after the first optimizer step the ratio moves away from 1: PPO statistics become non-trivial
    assert all(m["approx_kl"] > 0 for m in history)


def test_kl_penalty_with_lora(random_text_model_dir: Path, tmp_path: Path) -> None:
    cfg = make_cfg(
        random_text_model_dir,
        tmp_path / "run",
        model={"name_or_path": str(random_text_model_dir), "lora": {"enabled": True, "r": 4, "alpha": 8}},
        algorithm={"kl_coef": 0.1, "kl_estimator": "k3"},
        rewards=VARIED,
        trainer={"steps": 3, "lr": 1e-2, "progress_bar": False, "save_every": 100},
    )
    history = make_trainer(cfg).train()
    assert history[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # adapter starts as identity
    assert history[-1]["kl"] > 0
    assert (tmp_path / "run" / "final" / "adapter_config.json").exists()


@pytest.mark.parametrize(
    "algorithm",
    [
        {"filter": "dynamic_sampling", "filter_kwargs": {"max_rounds": 3}},
        {"filter": "replay", "filter_kwargs": {"capacity": 8}},
        {"filter": "range", "filter_kwargs": {"low": 0.0, "high": 1.5}},
        {"estimator": "mc_grpo", "adv_clip": 5.0},
        {"estimator": "rloo", "loss": "gspo", "loss_agg": "seq_mean_token_mean"},
        {"estimator": "dr_grpo", "loss": "cispo", "loss_agg": "seq_sum_norm"},
        {"estimator": "gdpo", "loss": "sapo"},
        {"estimator": "ngrpo", "loss": "dual_clip", "loss_kwargs": {"eps_low": 0.16, "eps_high": 0.24}},
    ],
    ids=lambda a: "-".join(str(v) for v in a.values() if isinstance(v, str)),
)
def test_algorithm_variants_train(random_text_model_dir: Path, tmp_path: Path, algorithm: dict) -> None:
    cfg = make_cfg(
        random_text_model_dir,
        tmp_path / "run",
        algorithm=algorithm,
        rewards=VARIED,
        trainer={"steps": 2, "lr": 1e-3, "progress_bar": False, "save_every": 1},
    )
    trainer = make_trainer(cfg)
    history = trainer.train()
    assert len(history) == 2
    for m in history:
        assert all(v is None or not isinstance(v, float) or v == v for v in m.values())  # no NaN metric
    if algorithm.get("estimator") == "mc_grpo":
        batch = trainer._last_batch
        assert len(batch) == 4 * 5  # G + 1 samples per prompt
        # exactly one pivot per group is left out of the loss
        for g in batch.group_ids():
            rows = (batch.group == g).nonzero().flatten()
            assert int((~batch.mask[rows].any(dim=1)).sum()) == 1
    if algorithm.get("filter") == "dynamic_sampling":
        assert all(m["filter/rounds"] >= 1 for m in history)
        batch = trainer._last_batch
        from mmalign.algorithms.advantages import combine_rewards
        from mmalign.algorithms.filters import group_std

        _, stds = group_std(combine_rewards(batch.rewards, [1.0, 1.0]), batch.group)
        assert (stds > 0).all()  # no zero-variance group reached the update
    # the filter's state is in the checkpoint and reloads
    trainer2 = make_trainer(
        make_cfg(
            random_text_model_dir,
            tmp_path / "run",
            algorithm=algorithm,
            rewards=VARIED,
            trainer={"steps": 3, "lr": 1e-3, "progress_bar": False, "save_every": 1},
        ),
        resume=True,
    )
    assert trainer2.step == 2
    assert trainer2.group_filter.state_dict().keys() == trainer.group_filter.state_dict().keys()


def test_reinforce_pp_over_tokens_gets_the_completion_lengths(
    random_text_model_dir: Path, tmp_path: Path
) -> None:
    """With whiten_over=tokens the trainer hands each sample's number of valid tokens to the estimator:
    the advantages equal a plain loop of verl's token-weighted whitening over the rollout's mask lengths."""
    import math

    from mmalign.algorithms.advantages import combine_rewards

    cfg = make_cfg(
        random_text_model_dir,
        tmp_path / "run",
        rewards=VARIED,
        algorithm={"estimator": "reinforce_pp", "estimator_kwargs": {"whiten_over": "tokens"}},
        rollout={
            "group_size": 4,
            "prompts_per_step": 4,
            "max_new_tokens": 8,
            "stop_strings": [" ", "1", "2", "+"],
        },
        trainer={"steps": 1, "lr": 1e-3, "progress_bar": False, "save_every": 100},
    )
    trainer = make_trainer(cfg)
    trainer.train()
    batch = trainer._last_batch
    r = combine_rewards(batch.rewards, [1.0, 1.0]).tolist()
    n = batch.mask.sum(dim=1).tolist()
    groups = batch.group.tolist()
    x = []
    for i, g in enumerate(groups):
        members = [r[j] for j in range(len(r)) if groups[j] == g]
        x.append(r[i] - sum(members) / len(members))
    total = sum(n)
    mean = sum(ni * xi for ni, xi in zip(n, x)) / total
    std = math.sqrt(sum(ni * (xi - mean) ** 2 for ni, xi in zip(n, x)) / (total - 1))
    expected = [(xi - mean) / (std + 1e-4) for xi in x]
    assert len(set(n)) > 1  # lengths differ, so token weighting matters
    assert batch.advantages.tolist() == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_vade_sampler_trains_and_resumes_exactly(random_text_model_dir: Path, tmp_path: Path) -> None:
    data = {
        "train": str(TRAIN_JSONL),
        "prompt_template": "Q: {question} = ?\nA:",
        "sampler": "vade",
        "sampler_kwargs": {"explore": 0.25},
        "success_threshold": 0.5,
    }
    kw = {"data": data, "rewards": VARIED}
    full = make_trainer(
        make_cfg(
            random_text_model_dir,
            tmp_path / "full",
            trainer={"steps": 4, "save_every": 2, "lr": 1e-3, "progress_bar": False},
            **kw,
        )
    ).train()
    assert "sampler/picked_info" in full[0] and full[-1]["sampler/seen_frac"] > full[0]["sampler/seen_frac"]
    part = make_cfg(
        random_text_model_dir,
        tmp_path / "part",
        trainer={"steps": 2, "save_every": 2, "lr": 1e-3, "progress_bar": False},
        **kw,
    )
    make_trainer(part).train()
    resumed = make_trainer(
        make_cfg(
            random_text_model_dir,
            tmp_path / "part",
            trainer={"steps": 4, "save_every": 2, "lr": 1e-3, "progress_bar": False},
            **kw,
        ),
        resume=True,
    )
    resumed.train()
    assert [strip_time(m) for m in read_metrics(tmp_path / "part")] == [strip_time(m) for m in full]


def test_fake_engine_rollouts_sync_and_is_correction(random_text_model_dir: Path, tmp_path: Path) -> None:
    """An engine samples with its own weight copy; after every optimizer step the trainer pushes the
    weights, so engine and trainer log-probs agree at the next rollout (IS weights ~1)."""
    cfg = make_cfg(
        random_text_model_dir,
        tmp_path / "run",
        rewards=VARIED,
        rollout={
            "group_size": 4,
            "prompts_per_step": 4,
            "max_new_tokens": 8,
            "engine": "fake",
            "is_correction": "token",
            "is_cap": 2.0,
        },
        trainer={"steps": 3, "lr": 1e-2, "progress_bar": False, "save_every": 100},
    )
    trainer = make_trainer(cfg)
    policy = trainer.policy
    assert policy.engine is not None and trainer.need_logp_old
    history = trainer.train()
    for m in history:
        assert m["is/abs_dlogp_mean"] < 1e-4, m  # synced before each rollout
        assert abs(m["is/weight_mean"] - 1.0) < 1e-3
    assert policy.engine.weight_version >= 3
    # without the sync the engine falls behind and the IS weights move away from 1
    policy.sync_engine = lambda step=0: None  # type: ignore[method-assign]
    trainer.cfg.trainer.steps = 5
    late = trainer.train()[-1]
    assert late["is/abs_dlogp_mean"] > 1e-3


def test_engine_sync_failure_is_a_clear_error(random_text_model_dir: Path, tmp_path: Path) -> None:
    cfg = make_cfg(
        random_text_model_dir,
        tmp_path / "run",
        rewards=VARIED,
        rollout={
            "group_size": 2,
            "prompts_per_step": 2,
            "max_new_tokens": 4,
            "engine": "fake",
            "engine_kwargs": {"sync_delay_s": 5.0},
            "sync_timeout_s": 0.2,
        },
        trainer={"steps": 2, "progress_bar": False, "save_every": 100},
    )
    import time

    t0 = time.perf_counter()
    with pytest.raises(TrainingError, match="0.2"):
        make_trainer(cfg).train()
    assert time.perf_counter() - t0 < 30
