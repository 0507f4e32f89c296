"""FlowPolicy on a tiny offline SD3-style pipeline: round trip, shapes, ratio = 1, gradients, options."""

from __future__ import annotations

import pytest
import torch

from mmalign.policies.flow import FlowPolicy
from mmalign.tiny_flow import build_tiny_sd3, encode_prompt, load_sd3_components

ROWS = [{"prompt": "a red cat", "label": 1}, {"prompt": "a blue dog", "label": 2}]


@pytest.fixture(scope="module")
def pipe_dir(tmp_path_factory: pytest.TempPathFactory):
    return build_tiny_sd3(tmp_path_factory.mktemp("tiny_sd3") / "sd3")


def make(pipe_dir, **kw) -> FlowPolicy:
    kw.setdefault("num_steps", 4)
    kw.setdefault("seed", 0)
    return FlowPolicy.from_pretrained(pipe_dir, **kw)


def test_tiny_pipeline_round_trip(pipe_dir):
    for sub in ("transformer", "vae", "scheduler", "text_encoder", "tokenizer"):
        assert (pipe_dir / sub).is_dir()
    c = load_sd3_components(pipe_dir)
    pe, po = encode_prompt(c.text_encoder, c.tokenizer, ["a red cat", ""])
    assert pe.shape[0] == 2 and pe.shape[2] == c.transformer.config.joint_attention_dim
    assert po.shape == (2, c.transformer.config.pooled_projection_dim)
    c2 = load_sd3_components(pipe_dir)
    for (n, p), (_, q) in zip(c.transformer.named_parameters(), c2.transformer.named_parameters(), strict=True):
        assert torch.equal(p, q), n


def test_rollout_shapes_and_decode(pipe_dir):
    pol = make(pipe_dir)
    r = pol.rollout(ROWS, 3, compute_logp=True)
    b, c, s = 6, pol.model.config.in_channels, pol.latent_size
    assert r.mask.shape == (b, 4) and r.mask.all()
    assert r.logp_old.shape == (b, 4) and torch.isfinite(r.logp_old).all()
    assert r.outputs["latents"].shape == (b, c, s, s)
    assert r.payload["latents"].shape == (b, 4, c, s, s)
    assert r.group.tolist() == [0, 0, 0, 1, 1, 1]
    assert r.columns["label"] == [1, 1, 1, 2, 2, 2]
    img = pol.decode(r)
    assert img.shape[:2] == (b, 3) and img.min() >= 0 and img.max() <= 1
    # consecutive trained transitions chain: x_{t+1} of step j is x_t of step j+1
    assert torch.equal(r.payload["next_latents"][:, 0], r.payload["latents"][:, 1])


@pytest.mark.parametrize("opts", [{}, {"guidance_scale": 3.0}, {"window_size": 2}, {"train_fraction": 0.5}])
def test_reevaluate_ratio_is_one(pipe_dir, opts):
    pol = make(pipe_dir, **opts)
    r = pol.rollout(ROWS, 2, compute_logp=True)
    stats = pol.evaluate(r)
    ratio = torch.exp(stats.logp - r.logp_old)
    torch.testing.assert_close(ratio, torch.ones_like(ratio), atol=1e-5, rtol=0)
    # also on a minibatch slice
    sub = r[[1, 2]]
    torch.testing.assert_close(pol.evaluate(sub).logp.detach(), sub.logp_old, atol=1e-5, rtol=0)


def test_gradients_reach_transformer(pipe_dir):
    pol = make(pipe_dir)
    r = pol.rollout(ROWS, 2, compute_logp=True)
    pol.evaluate(r).logp.sum().backward()
    grads = [p.grad for p in pol.trainable_parameters() if p.grad is not None]
    assert grads and any(g.abs().sum() > 0 for g in grads)
    assert all(p.grad is None for p in pol.vae.parameters())


def test_same_initial_noise(pipe_dir):
    pol = make(pipe_dir, same_initial_noise=True)
    r = pol.rollout(ROWS, 3, compute_logp=False)
    x0 = r.payload["latents"][:, 0]
    assert torch.equal(x0[0], x0[1]) and torch.equal(x0[0], x0[2])
    assert not torch.equal(x0[0], x0[3])
    assert r.logp_old is None
    assert not torch.equal(r.outputs["latents"][0], r.outputs["latents"][1])  # SDE noise differs


def test_window_trains_exactly_window_size_steps(pipe_dir):
    pol = make(pipe_dir, num_steps=6, window_size=2, window_range=(1, 3))
    r = pol.rollout(ROWS, 2, compute_logp=True)
    assert r.mask.shape == (4, 2) and r.logp_old.shape == (4, 2)
    idx = r.payload["step_index"]
    assert (idx[:, 1] - idx[:, 0] == 1).all() and 1 <= int(idx[0, 0]) <= 3
    assert (idx == idx[0]).all()


def test_kl_zero_at_start_and_state_dict(pipe_dir, tmp_path):
    pol = make(pipe_dir, need_reference=True)
    r = pol.rollout(ROWS, 2, compute_logp=True)
    stats = pol.evaluate(r)
    assert stats.kl is not None and stats.kl.shape == (4, 4)
    torch.testing.assert_close(stats.kl.detach(), torch.zeros(4, 4), atol=1e-8, rtol=0)
    torch.testing.assert_close(pol.reference_logprobs(r), r.logp_old, atol=1e-5, rtol=0)
    state = pol.trainable_state_dict()
    with torch.no_grad():
        for p in pol.trainable_parameters():
            p.add_(0.01)
    assert (pol.evaluate(r).kl.detach() > 0).any()
    pol.load_trainable_state_dict(state)
    pol.save(tmp_path / "out")
    again = FlowPolicy.from_pretrained(tmp_path / "out", num_steps=4)
    for (n, p), (_, q) in zip(pol.model.named_parameters(), again.model.named_parameters(), strict=True):
        assert torch.equal(p, q), n


def test_lora_reference_is_disabled_adapter(pipe_dir, tmp_path):
    from mmalign.config import LoraConfig

    pol = make(pipe_dir, need_reference=True, lora=LoraConfig(enabled=True, r=4))
    names = [n for n, p in pol.model.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    r = pol.rollout(ROWS, 2, compute_logp=True)
    stats = pol.evaluate(r)
    torch.testing.assert_close(stats.kl.detach(), torch.zeros(4, 4), atol=1e-8, rtol=0)
    with torch.no_grad():
        for n, p in pol.model.named_parameters():
            if "lora_B" in n:
                p.add_(0.5)
    stats = pol.evaluate(r)
    assert (stats.kl.detach() > 0).any()
    torch.testing.assert_close(pol.reference_logprobs(r), r.logp_old, atol=1e-5, rtol=0)  # adapter off = base
    stats.logp.sum().backward()
    assert all(p.grad is not None for p in pol.trainable_parameters())
    pol.save(tmp_path / "merged")
    assert (tmp_path / "merged" / "transformer_lora").is_dir()
    merged = FlowPolicy.from_pretrained(tmp_path / "merged", num_steps=4)
    torch.testing.assert_close(merged.evaluate(r).logp.detach(), stats.logp.detach(), atol=1e-5, rtol=0)
    base = make(pipe_dir)
    assert not torch.allclose(base.evaluate(r).logp.detach(), stats.logp.detach(), atol=1e-6)


def test_group_trainer_runs_the_flow_policy(pipe_dir, tmp_path):
    """The shared loop drives denoising steps as actions: pixels are decoded only because the reward
    needs them, the policy's own step-mean KL is used, and the transformer's weights move."""
    from mmalign.config import config_from_dict
    from mmalign.trainer import GroupTrainer
    from pipelines import Components
    from rewards import RewardSet

    cfg = config_from_dict(
        {
            "pipeline": "flow_test",
            "output_dir": str(tmp_path / "run"),
            "rollout": {"group_size": 4, "prompts_per_step": 2},
            "rewards": [{"name": "jpeg_incompressibility"}],
            "algorithm": {"kl_coef": 0.01},
            "trainer": {"steps": 2, "lr": 1e-3, "progress_bar": False, "save_every": 1},
        },
        "test",
    )
    pol = make(pipe_dir, num_steps=4, need_reference=True)
    rows = [{"prompt": "a red square"}, {"prompt": "two blue circles"}, {"prompt": "green"}]
    before = {k: v.clone() for k, v in pol.trainable_state_dict().items()}
    trainer = GroupTrainer(cfg, Components(policy=pol, rewards=RewardSet(cfg.rewards), data=rows))
    history = trainer.train()
    assert [m["step"] for m in history] == [1, 2]
    assert "images" in trainer._last_batch.outputs and trainer._last_batch.logp_ref is None
    assert history[0]["kl"] == pytest.approx(0.0, abs=1e-8) and history[1]["kl"] > 0
    after = pol.trainable_state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
