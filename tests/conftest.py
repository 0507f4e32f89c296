"""Shared fixtures: tiny models are built once per test session, offline, into a temp folder."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_text_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The quickstart's warm-started tiny LM: a copy of the shipped ``assets/models/text_reasoning-tiny`` (what
    the `text_reasoning` tiny builder writes; building it again takes ~40 s, and
    tests/tiny/test_shipped_models.py::test_the_text_reasoning_builder_rebuilds_the_shipped_model does, ``slow``)."""
    import shutil

    path = tmp_path_factory.mktemp("models") / "text_reasoning-tiny"
    shutil.copytree(Path(__file__).resolve().parents[1] / "assets" / "models" / "text_reasoning-tiny", path)
    return path


@pytest.fixture(scope="session")
def random_text_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A randomly initialised tiny LM + BPE tokenizer saved with save_pretrained (instant)."""
    import torch

    from mmalign import tiny

    torch.manual_seed(0)
    texts = [
        f"Q: {a} + {b} = ?\nA: <answer>{a + b}</answer> hello world, the end."
        for a in range(10)
        for b in range(10)
    ]
    tok = tiny.train_bpe_tokenizer(texts, vocab_size=300)
    model = tiny.tiny_causal_lm(tok, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    path = tmp_path_factory.mktemp("models") / "random-tiny"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def random_vlm_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A randomly initialised tiny Qwen2-VL + processor (the `vlm_random` builder), ~10 s once."""
    from mmalign import tiny

    return tiny.build("vlm_random", tmp_path_factory.mktemp("models") / "vlm-random", announce=False)


@pytest.fixture(scope="session")
def shapes_clip_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny CLIP trained on the shapes world (the `clip_shapes_tiny` builder), built once per session
    (~40 s on 2 cores): the reward model of the safe-diffusion and video tests."""
    from mmalign import tiny

    return tiny.build("clip_shapes_tiny", tmp_path_factory.mktemp("models") / "clip-shapes", announce=False)


@pytest.fixture(scope="session")
def tiny_sd3_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny SD3-layout flow-matching folder, random weights: transformer, VAE, two CLIPs and a T5
    (the `flow_sd3_tiny_3enc` builder), a few seconds once."""
    from mmalign import tiny

    return tiny.build("flow_sd3_tiny_3enc", tmp_path_factory.mktemp("models") / "sd3", announce=False)


@pytest.fixture(scope="session")
def tiny_flux_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny FLUX.1-dev-style folder (guidance embedding), random weights (the `flux_tiny` builder)."""
    from mmalign import tiny

    return tiny.build("flux_tiny", tmp_path_factory.mktemp("models") / "flux", announce=False)


@pytest.fixture(scope="session")
def tiny_sd15_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny SD 1.5-style UNet folder with a DDIM scheduler, random weights (the `ddim_sd15_tiny` builder)."""
    from mmalign import tiny

    return tiny.build("ddim_sd15_tiny", tmp_path_factory.mktemp("models") / "sd15", announce=False)


@pytest.fixture
def check_shared_prefix_matches_plain():
    """Callable(policy, rollout, plain=None): the shared-prefix forward gives the plain forward's per-token
    log-probs AND parameter gradients (to fp32 tolerance) for `rollout` under a random weighting of the tokens.

    Without `plain` the check toggles ``policy.shared_prefix``; with `plain` (a policy with the same weights,
    built with shared_prefix off) each policy runs the path it was built with and nothing is toggled."""
    import torch

    def check(pol, ro, plain=None) -> None:
        weights = torch.randn(ro.mask.shape)

        def run(p, shared=None):
            if shared is not None:
                p.shared_prefix = shared
            p.model.zero_grad(set_to_none=True)
            logp = p.action_stats(ro).logp
            (logp * weights).sum().backward()
            grads = {
                n: q.grad.clone()
                for n, q in p.model.named_parameters()
                if q.requires_grad and q.grad is not None
            }
            return logp.detach(), grads

        if plain is None:
            plain_logp, plain_grads = run(pol, False)
            shared_logp, shared_grads = run(pol, True)
        else:
            assert pol.shared_prefix and not plain.shared_prefix
            plain_logp, plain_grads = run(plain)
            shared_logp, shared_grads = run(pol)
        assert torch.allclose(shared_logp, plain_logp, atol=1e-5), (shared_logp - plain_logp).abs().max()
        assert plain_grads.keys() == shared_grads.keys() and len(plain_grads) > 0
        for name, g in plain_grads.items():
            assert torch.allclose(shared_grads[name], g, atol=1e-5, rtol=1e-4), name

    return check


@pytest.fixture
def check_chunked_matches_full():
    """Callable(policy, rollout, chunk): log-probs, entropies AND parameter gradients of the chunked
    log-prob path (``policy.logprob_chunk_size = chunk``) equal the full-logits path's (None), to fp32
    tolerance, under a random weighting of the tokens; the no-grad log-probs too. Returns the number of
    parameters compared."""
    import torch

    def check(pol, ro, chunk: int) -> int:
        weights = torch.randn(ro.mask.shape, generator=torch.Generator().manual_seed(3))

        def run(size):
            pol.logprob_chunk_size = size
            pol.model.zero_grad(set_to_none=True)
            stats = pol.action_stats(ro)
            (stats.logp * weights).sum().backward()
            grads = {
                n: q.grad.clone()
                for n, q in pol.model.named_parameters()
                if q.requires_grad and q.grad is not None
            }
            with torch.no_grad():
                no_grad = pol._logprobs(pol.model, ro, grad=False)
            return stats.logp.detach(), stats.entropy, no_grad, grads

        full = run(None)
        chunked = run(chunk)
        for name, a, b in zip(("logp", "entropy", "no-grad logp"), chunked[:3], full[:3], strict=True):
            assert torch.allclose(a, b, atol=1e-5), (name, (a - b).abs().max())
        assert full[3].keys() == chunked[3].keys() and len(full[3]) > 0
        for name, g in full[3].items():
            assert torch.allclose(chunked[3][name], g, atol=1e-5, rtol=1e-4), name
        return len(full[3])

    return check


@pytest.fixture
def run_mmalign():
    """Run the real ``python -m mmalign.app.cli ARGS`` in `cwd` (warnings off) -> CompletedProcess (text)."""
    import os
    import subprocess
    import sys

    def run(*args: str, cwd: Path, timeout: int = 120) -> subprocess.CompletedProcess:
        env = {**os.environ, "PYTHONWARNINGS": "ignore"}
        return subprocess.run(
            [sys.executable, "-m", "mmalign.app.cli", *args],
            capture_output=True,
            text=True,
            cwd=cwd,
            env=env,
            timeout=timeout,
        )

    return run
