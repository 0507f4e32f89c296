"""`mmalign sample` / `mmalign eval` and the functions behind them (mmalign/app/evaluation.py)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from mmalign.app.cli import main
from mmalign.app.evaluation import format_report, load_weights, resolve_checkpoint, score
from mmalign.config import ConfigError, config_from_dict
from mmalign.data.batch import Rollout
from mmalign.data.media import save_grid
from mmalign.data.rows import DataError, load_prompt_rows, load_rows
from rewards import RewardSet, register_reward
from rewards.base import Reward


@register_reward("test_eval_first_char_digit")
class FirstCharDigit(Reward):
    """1 if the output's first character is a digit (a toy score for these tests)."""

    needs = {"texts"}

    def __call__(self, batch):
        return torch.tensor([1.0 if t[:1].isdigit() else 0.0 for t in batch.outputs["texts"]])


def _rollout(texts, split):
    b = len(texts)
    return Rollout(
        group=torch.arange(b),
        mask=torch.ones((b, 1), dtype=torch.bool),
        prompts=["p"] * b,
        columns={"category": split},
        outputs={"texts": texts},
    )


def test_score_means_per_split_against_hand_numbers():
    r = _rollout(["1a", "b", "2", "c", "3"], ["safe", "unsafe", "unsafe", "safe", "safe"])
    nan_reward = {"name": "answer_accuracy", "kwargs": {"answer_column": "answer"}}
    rs = RewardSet([{"name": "test_eval_first_char_digit"}])
    out = score(r, [rs, None], split_column="category")
    assert out["all"]["samples"] == 5 and out["all"]["test_eval_first_char_digit"] == pytest.approx(3 / 5)
    assert out["safe"]["test_eval_first_char_digit"] == pytest.approx(2 / 3)
    assert out["unsafe"]["test_eval_first_char_digit"] == pytest.approx(1 / 2)
    assert set(out) == {"all", "safe", "unsafe"}
    # a reward that is NaN everywhere (no answer column) gives NaN, not 0
    r.columns["answer"] = [None] * 5
    out = score(r, [RewardSet([nan_reward])])
    assert math.isnan(out["all"]["answer_accuracy"])


def test_score_unknown_split_column_names_the_key():
    with pytest.raises(ConfigError, match="eval.split_column.*'kind'"):
        score(_rollout(["1"], ["safe"]), [RewardSet([{"name": "test_eval_first_char_digit"}])], "kind")


def test_format_report_shows_change():
    rep = {
        "prompts": 2,
        "samples_per_prompt": 3,
        "seed": 1,
        "checkpoint": "ck",
        "base": {"all": {"samples": 6.0, "acc": 0.25}},
        "trained": {"all": {"samples": 6.0, "acc": 0.75}},
    }
    text = format_report(rep)
    line = next(x for x in text.splitlines() if " acc " in x)
    assert line.split()[-3:] == ["0.2500", "0.7500", "+0.5000"]


def test_save_grid_layout(tmp_path):
    imgs = torch.zeros((3, 3, 4, 5))
    imgs[1, 0] = 1.0  # second image red
    path = save_grid(imgs, tmp_path / "g.png", ncols=2, pad=1)
    arr = np.asarray(Image.open(path))
    assert arr.shape == (2 * 5 + 1, 2 * 6 + 1, 3)
    assert tuple(arr[1, 1]) == (0, 0, 0)  # first image, black
    assert tuple(arr[1, 1 + 6]) == (255, 0, 0)  # second image, top-left pixel
    assert tuple(arr[0, 0]) == (255, 255, 255)  # padding
    assert tuple(arr[6 + 1, 6 + 1]) == (255, 255, 255)  # the empty fourth cell


def test_resolve_checkpoint(tmp_path):
    assert resolve_checkpoint(tmp_path, "base") is None
    assert resolve_checkpoint(tmp_path, "latest") is None
    ck = tmp_path / "checkpoints" / "step_000003"
    ck.mkdir(parents=True)
    (ck / "trainable.safetensors").write_bytes(b"")
    (ck / "COMPLETE").write_text("3")
    assert resolve_checkpoint(tmp_path, "latest") == ck
    assert resolve_checkpoint(tmp_path, str(ck)) == ck
    assert resolve_checkpoint(tmp_path / "x", str(tmp_path)) == ck
    with pytest.raises(ConfigError, match="neither a checkpoint"):
        resolve_checkpoint(tmp_path, str(tmp_path / "nope"))


def test_weights_of_another_model_are_a_config_error_naming_the_checkpoint(tmp_path):
    """A checkpoint whose tensors do not match the policy's trainable parameters: one line naming the folder
    (a user error), and the policy's weights are left as they were."""
    from safetensors.torch import save_file

    from mmalign.policies.base import Policy

    class Tiny(Policy):
        rollout = action_stats = reference_logprobs = save = None

        def __init__(self):
            self.model = torch.nn.Linear(2, 2)

    pol = Tiny()
    before = {n: p.detach().clone() for n, p in pol.model.named_parameters()}
    ck = tmp_path / "ck"
    ck.mkdir()
    save_file({"other.weight": torch.zeros(2, 2)}, str(ck / "trainable.safetensors"))
    with pytest.raises(ConfigError, match=r"checkpoint .*ck: checkpoint does not match the model"):
        load_weights(pol, ck)
    assert all(torch.equal(p, before[n]) for n, p in pol.model.named_parameters())
    save_file({k: v + 1 for k, v in before.items()}, str(ck / "trainable.safetensors"))
    load_weights(pol, ck)
    assert all(torch.equal(p, before[n] + 1) for n, p in pol.model.named_parameters())


def test_text_prompt_files(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("# comment\na cat\n\n  a dog  \n")
    rows = load_rows(str(f), "{question}")
    assert [r["prompt"] for r in rows] == ["a cat", "a dog"]
    assert rows[1]["_source"].endswith("p.txt:4")
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"ok\n\xff\xfe\n")
    with pytest.raises(DataError, match=r"bad.txt:2: not valid UTF-8"):
        load_rows(str(bad))
    empty = tmp_path / "e.txt"
    empty.write_text("# only\n\n")
    with pytest.raises(DataError, match="no prompts"):
        load_rows(str(empty))
    j = tmp_path / "p.jsonl"
    j.write_text('{"prompt": "x", "colour": "red"}\n')
    assert load_prompt_rows(str(j), "{question}")[0]["prompt"] == "x"


def test_eval_config_validation():
    base = {"pipeline": "text_reasoning", "output_dir": "x", "rewards": [{"name": "answer_accuracy"}]}
    with pytest.raises(ConfigError, match="eval.group_size"):
        config_from_dict({**base, "eval": {"group_size": 0}})
    with pytest.raises(ConfigError, match="eval"):
        config_from_dict({**base, "eval": {"groupsize": 2}})
    cfg = config_from_dict({**base, "eval": {"rewards": [{"name": "format"}], "split_column": "c"}})
    assert cfg.eval.rewards[0].name == "format" and cfg.eval.split_column == "c"


@pytest.fixture
def text_config(tmp_path, random_text_model_dir):
    data = tmp_path / "d.jsonl"
    data.write_text(
        "".join(
            json.dumps({"question": f"{a} + 1", "answer": str(a + 1), "category": "ab"[a % 2]}) + "\n"
            for a in range(4)
        )
    )
    cfg = {
        "pipeline": "text_reasoning",
        "output_dir": str(tmp_path / "run"),
        "model": {"name_or_path": str(random_text_model_dir)},
        "data": {"train": str(data), "eval": str(data), "prompt_template": "Q: {question} = ?\nA:"},
        "rollout": {"group_size": 2, "prompts_per_step": 2, "max_new_tokens": 4},
        "rewards": [{"name": "answer_accuracy"}],
        "trainer": {"steps": 1, "lr": 0.05, "save_every": 1, "progress_bar": False},
        "eval": {
            "group_size": 3,
            "split_column": "category",
            "rewards": [{"name": "test_eval_first_char_digit"}],
        },
    }
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_cli_eval_before_after_and_sample(capsys, text_config, tmp_path):
    rc = main(["eval", str(text_config)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "scoring the base model only" in err
    rep = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert "trained" not in rep and rep["base"]["all"]["samples"] == 12 and rep["base"]["a"]["samples"] == 6
    assert set(rep["base"]["all"]) == {"samples", "answer_accuracy", "test_eval_first_char_digit"}

    assert main(["train", str(text_config)]) == 0
    capsys.readouterr()
    rc = main(["eval", str(text_config)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    rep = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert rep["checkpoint"].endswith("step_000001")
    assert rep["base"]["all"]["samples"] == rep["trained"]["all"]["samples"] == 12
    assert "change" in out
    # perturb the checkpoint's weights: `sample` must load them (samples differ from the base under one seed)
    from safetensors.torch import load_file, save_file

    f = tmp_path / "run" / "checkpoints" / "step_000001" / "trainable.safetensors"
    state = load_file(str(f))
    g = torch.Generator().manual_seed(0)
    save_file({k: v + 0.5 * torch.randn(v.shape, generator=g) for k, v in state.items()}, str(f))
    from mmalign.training import rundir

    rundir.write_manifest(f.parent, 1)  # an intended edit: re-seal the checkpoint, or it fails verification
    assert (
        main(["sample", str(text_config), "--checkpoint", "base", "-n", "2", "--out", str(tmp_path / "s0")])
        == 0
    )
    assert main(["sample", str(text_config), "-n", "2", "--out", str(tmp_path / "s1")]) == 0
    capsys.readouterr()
    s0 = [json.loads(x) for x in (tmp_path / "s0" / "samples.jsonl").read_text().splitlines()]
    s1 = [json.loads(x) for x in (tmp_path / "s1" / "samples.jsonl").read_text().splitlines()]
    assert len(s0) == len(s1) == 8 and [r["sample"] for r in s0[:4]] == [0, 1, 0, 1]
    assert [r["text"] for r in s0] != [r["text"] for r in s1]
    # same seed, same weights: the same samples
    assert (
        main(["sample", str(text_config), "--checkpoint", "base", "-n", "2", "--out", str(tmp_path / "s2")])
        == 0
    )
    s2 = [json.loads(x) for x in (tmp_path / "s2" / "samples.jsonl").read_text().splitlines()]
    assert [r["text"] for r in s0] == [r["text"] for r in s2]


def test_cli_sample_prompt_flags(capsys, text_config, tmp_path):
    rc = main(
        [
            "sample",
            str(text_config),
            "--checkpoint",
            "base",
            "--prompt",
            "Q: 1 + 1 = ?\nA:",
            "-n",
            "3",
            "--out",
            str(tmp_path / "s"),
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 0, err
    rows = [json.loads(x) for x in (tmp_path / "s" / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and rows[0]["prompt"] == "Q: 1 + 1 = ?\nA:"
    rc = main(["sample", str(text_config), "--checkpoint", str(tmp_path / "missing")])
    out, err = capsys.readouterr()
    assert rc == 1 and "neither a checkpoint folder" in err


def test_eval_of_a_diffusion_policy_samples_the_ode_and_reports_it(tiny_sd3_model_dir, tmp_path):
    """`mmalign eval` / `sample` generate with the policy's evaluation sampler: a flow policy trained at noise
    level 0.7 evaluates with the deterministic ODE (``eval_noise_level: 0``, the default, as Flow-GRPO), the
    report says so, and the training sampler is restored; ``eval_noise_level: null`` evaluates the SDE."""
    from mmalign.app.evaluation import evaluate_run, generate
    from mmalign.policies.sd3 import SD3Policy
    from pipelines import TrainingSetup

    def policy(**kw):
        return SD3Policy.from_pretrained(tiny_sd3_model_dir, num_steps=3, seed=0, max_sequence_length=8, **kw)

    rows = [{"prompt": "a red cat"}, {"prompt": "a blue dog"}]
    cfg = config_from_dict(
        {
            "pipeline": "eval_test",
            "output_dir": str(tmp_path / "run"),
            "rewards": [{"name": "jpeg_compressibility"}],
            "eval": {"group_size": 2, "prompts_per_batch": 1},
        }
    )
    pol = policy(noise_level=0.7)
    comps = TrainingSetup(policy=pol, rewards=RewardSet(cfg.rewards), data=rows, eval_data=rows)
    rep = evaluate_run(cfg, comps, checkpoint=None, progress=False)
    assert rep["sampler"] == {"sampler": "ode", "num_steps": 3} and rep["base"]["all"]["samples"] == 4
    assert "sampler: ode, num_steps 3" in format_report(rep)
    assert pol.noise_level == 0.7
    ours = generate(pol, rows, 2, seed=5, decode=False, progress=False)
    ode = generate(policy(noise_level=0), rows, 2, seed=5, decode=False, progress=False)
    assert ours.mask.shape == (4, 0)  # (prompts encoded in another batch: fp32 rounding apart)
    torch.testing.assert_close(ours.outputs["latents"], ode.outputs["latents"], atol=1e-5, rtol=1e-5)
    pol.sampler = pol.sampler.sampler_settings(eval_noise_level=None)
    rep = evaluate_run(cfg, comps, checkpoint=None, progress=False)
    assert rep["sampler"] == {"sampler": "sde", "sde_kind": "flow_sde", "noise_level": 0.7, "num_steps": 3}
    assert generate(pol, rows, 2, seed=5, decode=False, progress=False).mask.shape == (4, 3)
