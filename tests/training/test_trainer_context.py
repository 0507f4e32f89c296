"""The trainer wiring of issue 26 (EstimatorContext, estimator state, reward transforms, etr's group_std) on the
tiny text model. Proposed as tests/training/test_trainer_context.py once /work/frag/group/integration.diff is applied."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

import pipelines
from mmalign.algorithms import advantages as adv
from mmalign.algorithms import reward_transforms as rt
from mmalign.config import config_from_dict
from mmalign.training.trainer import GroupTrainer

REPO = Path(__file__).resolve().parents[2]
TRAIN_JSONL = REPO / "assets" / "text_reasoning" / "train.jsonl"
VARIED = [
    {"name": "tests.training.test_trainer:LengthMod3", "alias": "length_mod3"},
    {"name": "format", "kwargs": {"tags": ["answer"]}},
]


def cfg(model_dir, out, steps=2, **algorithm):
    data = {
        "pipeline": "text_reasoning",
        "output_dir": str(out),
        "seed": 0,
        "model": {"name_or_path": str(model_dir)},
        "data": {"train": str(TRAIN_JSONL), "prompt_template": "Q: {question} = ?\nA:"},
        "rollout": {"group_size": 4, "prompts_per_step": 4, "max_new_tokens": 8},
        "rewards": VARIED,
        "algorithm": algorithm,
        "trainer": {"steps": steps, "lr": 1e-3, "progress_bar": False, "save_every": 2, "sample_every": 1},
    }
    return config_from_dict(data, "test")


def metrics(out):
    return [
        {k: v for k, v in json.loads(line).items() if not k.startswith("time/")}
        for line in (out / "metrics.jsonl").read_text().splitlines()
    ]


def make(c, resume=False):
    return GroupTrainer(c, pipelines.get(c.pipeline)(c), resume=resume)


def test_spo_with_its_sampler_trains_and_resumes_exactly(random_text_model_dir, tmp_path):
    algo = {"estimator": "spo", "estimator_kwargs": {"rho_mode": "constant"}}

    def with_sampler(c):
        c.data.sampler = "spo"
        return c

    full = make(with_sampler(cfg(random_text_model_dir, tmp_path / "full", steps=4, **algo)))
    full.train()
    assert full.sampler.tracker is full.estimator_state and len(full.estimator_state) > 0
    make(with_sampler(cfg(random_text_model_dir, tmp_path / "part", steps=2, **algo))).train()
    resumed = make(with_sampler(cfg(random_text_model_dir, tmp_path / "part", steps=4, **algo)), resume=True)
    assert len(resumed.estimator_state) > 0  # the tracker came back from the checkpoint
    resumed.train()
    assert metrics(tmp_path / "part") == metrics(tmp_path / "full")
    s1, s2 = full.estimator_state.state_dict(), resumed.estimator_state.state_dict()
    for k in ("ids", "alpha", "beta", "visits"):
        assert torch.equal(s1[k], s2[k])


def test_unlikeliness_transform_uses_logp_old(random_text_model_dir, tmp_path):
    c = cfg(
        random_text_model_dir,
        tmp_path / "run",
        steps=1,
        reward_transforms=[{"name": "unlikeliness", "beta": 0.5}],
    )
    t = make(c)
    assert t.need_logp_old
    t.train()
    b = t._last_batch
    lp = torch.where(b.mask, b.logp_old.double(), 0.0).sum(1) / b.mask.sum(1).clamp(min=1)
    ctx = adv.EstimatorContext(logp_old_mean=lp)
    r = rt.apply([{"name": "unlikeliness", "beta": 0.5}], b.rewards.double(), b.group, context=ctx)
    want = adv.grpo(r, b.group, weights=[1.0, 1.0])
    torch.testing.assert_close(b.advantages.double(), want, rtol=1e-4, atol=1e-5)


def test_ace_with_reference_and_other_estimators(random_text_model_dir, tmp_path):
    t = make(cfg(random_text_model_dir, tmp_path / "ace", steps=1, estimator="ace", kl_coef=0.01))
    t.train()
    b = t._last_batch
    assert b.logp_ref is not None
    m = b.mask
    old = torch.where(m, b.logp_old.double(), 0.0).sum(1) if b.logp_old is not None else None
    ref = torch.where(m, b.logp_ref.double(), 0.0).sum(1)
    base = adv.grpo(b.rewards.double(), b.group, weights=[1.0, 1.0])
    want = torch.where(base < 0, base * (1 + torch.nn.functional.softplus(old - ref)), base)
    torch.testing.assert_close(b.advantages.double(), want, rtol=1e-4, atol=1e-5)
    assert (base < 0).any()
    for i, name in enumerate(["canon", "drpo", "a_grae", "gdpo"]):
        kw = {"estimator_kwargs": {"metric": "length"}} if name == "canon" else {}
        h = make(cfg(random_text_model_dir, tmp_path / f"r{i}", steps=2, estimator=name, **kw)).train()
        assert len(h) == 2


def test_etr_and_d3s_train(random_text_model_dir, tmp_path):
    t = make(cfg(random_text_model_dir, tmp_path / "run", steps=2, loss="etr", filter="d3s"))
    h = t.train()
    assert len(h) == 2 and all(not (isinstance(v, float) and math.isnan(v)) for m in h for v in m.values())
    assert t.group_filter.calls == 2
