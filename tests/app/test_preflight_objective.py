"""Issue 35, item 3b: a forward-process objective's settings (``algorithm.objective``: DiffusionNFT, AWM, Flow-DPO)
that a config alone decides are refused by the validation pass (`mmalign.app.preflight.validate`, the CLI's
``mmalign train``) before any model loads: every config here points ``model.name_or_path`` at a folder that does
not exist and has no tiny builder, and every way of loading a model raises (`no_model`), so a test passes only
when the objective's error comes first, naming the config file and the key."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from mmalign.app import preflight
from mmalign.app.cli import main
from mmalign.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
NFT, DPO, TINY = "text_to_image-nft-tiny", "text_to_image-dpo-tiny", "text_to_image-tiny"
SMALL = ["rollout.prompts_per_step=2", "rollout.group_size=4", "options.num_steps=4"]
AWM = ["algorithm.objective=awm", "algorithm.solver=euler", "options.noise_level=0.0"]


def config_file(tmp_path: Path, name: str) -> Path:
    """configs/<name>.yaml with absolute data paths, a model folder that does not exist (no tiny builder) and
    output_dir under `tmp_path`."""
    data = yaml.safe_load((ROOT / "configs" / f"{name}.yaml").read_text())
    data["data"] = {k: str(ROOT / v) for k, v in data["data"].items()}
    data["model"]["name_or_path"] = str(tmp_path / "no-such-model")
    data["model"]["tiny_builder"] = None
    data["output_dir"] = str(tmp_path / "run")
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def validate(tmp_path: Path, name: str, *overrides: str) -> None:
    path = config_file(tmp_path, name)
    preflight.validate(load_config(path, [*SMALL, *overrides]), resume=False)


CASES = [
    (NFT, ["algorithm.timesteps={strategy: nope}"], "key 'algorithm.timesteps.strategy' must be one of"),
    (NFT, ["algorithm.timesteps={strategy: discret}"], "(did you mean 'discrete'?)"),
    (
        NFT,
        ["algorithm.timesteps={stratgy: discrete}"],
        "unknown key 'algorithm.timesteps.stratgy' (did you mean",
    ),
    (NFT, ["algorithm.timesteps={timestep_range: 1.5}"], "key 'algorithm.timesteps.timestep_range'"),
    (
        NFT,
        ["algorithm.timesteps={num_timesteps: 0}"],
        "key 'algorithm.timesteps.num_timesteps' must be an integer",
    ),
    (NFT, ["algorithm.timesteps={num_timesteps: 2.5}"], "key 'algorithm.timesteps.num_timesteps'"),
    (NFT, ["algorithm.timesteps={strategy: uniform, time_shift: 0}"], "key 'algorithm.timesteps.time_shift'"),
    (NFT, ["algorithm.timesteps={logit_std: wide}"], "key 'algorithm.timesteps.logit_std' must be float"),
    (NFT, ["algorithm.old_policy={decay_type: 7}"], "key 'algorithm.old_policy': OldPolicy: decay_type"),
    (NFT, ["algorithm.old_policy={decay_typ: 1}"], "unknown key 'algorithm.old_policy.decay_typ'"),
    (NFT, ["algorithm.old_policy={decay_type: null, flat: 0}"], "key 'algorithm.old_policy': OldPolicy"),
    (NFT, ["algorithm.solver=sde"], "key 'algorithm.solver': 'sde' samples with the policy's SDE"),
    (
        NFT,
        ["algorithm.eval_ema={schedule: cubic}"],
        "key 'algorithm.eval_ema': eval_ema: schedule must be one of",
    ),
    (NFT, ["algorithm.eval_ema={decay: high}"], "key 'algorithm.eval_ema.decay' must be float"),
    (
        NFT,
        ["algorithm.eval_ema={decay: 1.5}"],
        "key 'algorithm.eval_ema': eval_ema: decay and initial_decay must",
    ),
    (
        NFT,
        ["algorithm.eval_ema={decy: 0.9}"],
        "unknown key 'algorithm.eval_ema.decy' (did you mean 'decay'?)",
    ),
    (
        TINY,
        [*AWM, "algorithm.objective_kwargs={ema_kl_beta: lots}"],
        "algorithm.objective_kwargs.ema_kl_beta",
    ),
    (
        DPO,
        ["trainer.microbatch_size=6"],
        "key 'trainer.microbatch_size': algorithm.objective 'flow_dpo' pairs",
    ),
    (DPO, ["trainer.minibatch_size=6"], "key 'trainer.minibatch_size'"),
    (
        DPO,
        ["trainer.minibatch_size=4", "trainer.shuffle_minibatches=true"],
        "key 'trainer.shuffle_minibatches': algorithm.objective 'flow_dpo' pairs",
    ),
]


@pytest.mark.parametrize(("name", "overrides", "expected"), CASES)
def test_objective_settings_are_refused_before_any_model(
    tmp_path: Path, no_model: None, name: str, overrides: list[str], expected: str
) -> None:
    with pytest.raises(ConfigError) as e:
        validate(tmp_path, name, *overrides)
    message = str(e.value)
    assert expected in message and str(tmp_path / f"{name}.yaml") in message
    assert "model.name_or_path" not in message


@pytest.mark.parametrize("name", [NFT, DPO])
def test_a_valid_objective_config_reaches_the_model_check(tmp_path: Path, no_model: None, name: str) -> None:
    """The control: the same configs without a bad setting pass the objective's checks and stop at the missing
    model folder, the check that follows (so the errors above came before it)."""
    with pytest.raises(ConfigError, match=r"key 'model\.name_or_path': no such model folder"):
        validate(tmp_path, name, "algorithm.timesteps={strategy: discrete, num_timesteps: 2}")


def test_the_cli_reports_the_objective_error_first(
    tmp_path: Path, no_model: None, capsys: pytest.CaptureFixture[str]
) -> None:
    path = config_file(tmp_path, NFT)
    rc = main(["train", str(path), *SMALL, "algorithm.old_policy={decay_type: 7}"])
    err = capsys.readouterr().err
    assert rc == 1
    assert f"{path} (with command-line overrides): key 'algorithm.old_policy': OldPolicy: decay_type" in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_sampling_commands_do_not_check_training_settings(tmp_path: Path, no_model: None) -> None:
    """`mmalign sample` / `eval` (``resume`` None) never set up training: the objective's settings are not
    theirs to refuse (the model check is the first error)."""
    path = config_file(tmp_path, NFT)
    cfg = load_config(path, [*SMALL, "algorithm.old_policy={decay_type: 7}"])
    with pytest.raises(ConfigError, match=r"key 'model\.name_or_path'"):
        preflight.validate(cfg, resume=None)
