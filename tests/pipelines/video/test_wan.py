"""What the Wan video pipelines share (`pipelines.video.wan`): the checks of `WanVideoOptions`, the per-process
sampler seed (`mmalign.training.seeding.process_seed`) and `build_wan_policy` on a tiny random Wan folder (the
condition's policy class, the errors naming the config file)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mmalign.config import load_config
from mmalign.policies.wan import WanConcatPolicy
from mmalign.training.seeding import process_seed
from pipelines.video.video_edit import VideoEditOptions
from pipelines.video.wan import WanVideoOptions, build_wan_policy

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"sde_kind": "ddim"}, "sde_kind"),
        ({"num_frames": 0}, "num_frames"),
        ({"height": 0}, "height"),
        ({"width": -4}, "width"),
    ],
)
def test_bad_video_options_name_the_option(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        WanVideoOptions(**kwargs)


def test_defaults_are_wan_480p() -> None:
    o = WanVideoOptions()
    assert (o.height, o.width, o.num_frames, o.guidance_scale) == (480, 832, 17, 5.0)


def test_process_seed_adds_the_rank_and_keeps_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    assert process_seed(5) == 5 and process_seed(None) is None
    monkeypatch.setenv("RANK", "3")
    assert process_seed(5) == 8 and process_seed(0) == 3 and process_seed(None) is None


def test_build_wan_policy_uses_the_options_and_the_rank_seed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANK", "1")
    cfg = load_config(
        REPO / "configs" / "video_edit-tiny.yaml",
        [f"model.name_or_path={tmp_path / 'wan'}", "model.tiny_builder=wan_concat_tiny", "options.seed=7"],
    )
    opts = cfg.options
    assert isinstance(opts, VideoEditOptions)
    from mmalign.app.fixtures import ensure_fixtures

    ensure_fixtures(cfg)  # the tiny folder, built by the app layer as `mmalign train` does
    policy = build_wan_policy(cfg, opts, condition="concat")
    assert type(policy) is WanConcatPolicy and policy.row_conditioning_keys == ("source_latents",)
    assert (policy.num_frames, policy.height, policy.width) == (opts.num_frames, opts.height, opts.width)
    assert policy.sampler.seed == 8  # options.seed + RANK
    assert policy.sampler.num_steps == opts.num_steps


def test_build_wan_policy_condition_errors_name_the_file(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_config(REPO / "configs" / "video_edit-tiny.yaml")
    with pytest.raises(
        ValueError, match=r"video_edit-tiny.yaml: options: condition must be one of none, concat"
    ):
        build_wan_policy(cfg, cfg.options, condition="blur")

    class OtherVideoFamily:  # a video family without conditions (HunyuanVideo 1.5)
        pass

    import mmalign.policies.families as families

    monkeypatch.setattr(families, "policy_class_for", lambda path, task: OtherVideoFamily)
    with pytest.raises(ValueError, match="condition 'concat' needs a Wan model.*OtherVideoFamily"):
        build_wan_policy(cfg, cfg.options, condition="concat")
