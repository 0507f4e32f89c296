"""The policy contract (`mmalign.policies.base.Policy`), checked for EVERY policy on tiny offline models.

Each test runs for text (`TextPolicy`), VLM (`VLMPolicy`), flow matching (`SD3Policy`, SD3 layout: two
CLIPs + T5), Flux (`FluxPolicy`), FLUX.1 Kontext
editing (`FluxKontextPolicy`, a ``source_image`` column), Qwen-Image (`QwenImagePolicy`), Qwen-Image-Edit
(`QwenImageEditPolicy`, a ``source_image`` column read by the VLM and appended to the sequence), DDIM (`DDIMPolicy`) and Wan video (`WanPolicy`:
text to video, channel-concat editing with a ``source_video`` column, VACE editing with an ``edit_mask``, Wan2.1
image to video with an ``image`` column and CLIP image states, and Wan2.2's two experts), each with full
fine-tuning and with LoRA:

- a policy IS a `Policy`;
- re-evaluating a fresh rollout gives ratio 1 (``evaluate(r).logp == r.logp_old`` on the masked actions);
- gradients of the log-probs reach the trainable parameters, and no other parameter of the policy
  (frozen base weights under LoRA, VAE, text encoders, reference copy);
- under LoRA, `reference_logprobs` is the adapter-off model (computed here with peft / diffusers' own
  adapter switch, and with the base model loaded afresh), after the adapter was perturbed;
- with a reference, the KL is 0 before any update (the policy's own KL in `action_stats` for diffusion, k1/k2/k3
  from `reference_logprobs` for text / VLM), and not 0 after a change of the weights;
- `trainable_state_dict` / `load_trainable_state_dict` restore the log-probs exactly, and `save` writes a
  folder that the policy's own `from_pretrained` loads back with the saved weights;
- two `GroupTrainer` steps change every trainable parameter and no frozen one, with KL 0 at step 1; and
  `sample_view` shows one sample per rollout entry, of the policy's kind (text, image or video).

The tiny models are built once per session (``tests/conftest.py``; the Wan folders and the editing rows' source
clips by this file's session fixtures) and loaded through each policy's real `from_pretrained`; shapes are tiny
(2 prompts x 2 samples, 3 denoising steps, 6 new tokens, 9 frames of 32 x 32).
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from mmalign.algorithms import losses
from mmalign.config import LoraConfig, config_from_dict
from mmalign.data.batch import Rollout
from mmalign.policies.base import SAMPLE_KINDS, Policy
from rewards import Reward, RewardBatch, RewardSet

LORA = LoraConfig(enabled=True, r=4, alpha=8)
GROUP = 2
MAX_NEW_TOKENS = 6
NUM_STEPS = 3
SEQ = 8
"""T5 length of the SD3 and Flux prompt encoders (small: fast)."""
QWEN_SEQ = 24
"""Prompt states of the tiny Qwen-Image (its template's system part is dropped first)."""


# ----------------------------------------------------------------------------- rewards that vary in a group


class TextCharSum(Reward):
    """Sum of character codes mod 97: differs between two gibberish completions of a random model."""

    def __call__(self, batch: RewardBatch) -> list[float]:
        return [float(sum(map(ord, t)) % 97) for t in batch.texts]


class ImageMean(Reward):
    """Mean pixel value: a continuous number, different for every sample."""

    needs = {"images"}

    def __call__(self, batch: RewardBatch) -> Tensor:
        return batch.outputs["images"].float().mean(dim=(1, 2, 3))


class VideoMean(Reward):
    """Mean pixel value of the decoded clip: a continuous number, different for every sample."""

    needs = {"videos"}

    def __call__(self, batch: RewardBatch) -> Tensor:
        return batch.outputs["videos"].float().mean(dim=(1, 2, 3, 4))


# ----------------------------------------------------------------------------- the Wan folders and clips

WAN_SIZE = {"num_frames": 9, "height": 32, "width": 32, "max_sequence_length": SEQ}
"""The tiny Wan builders' target size: 9 frames of 32 x 32 (5 latent frames of 8 x 8)."""


def _wan_folder(factory: pytest.TempPathFactory, name: str, **kw: Any) -> Path:
    from mmalign.tiny.wan import build_tiny_wan

    return build_tiny_wan(factory.mktemp("models") / name, **kw)


@pytest.fixture(scope="session")
def tiny_wan_t2v_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _wan_folder(tmp_path_factory, "wan-t2v")


@pytest.fixture(scope="session")
def tiny_wan_concat_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _wan_folder(tmp_path_factory, "wan-concat", condition="concat")


@pytest.fixture(scope="session")
def tiny_wan_vace_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _wan_folder(tmp_path_factory, "wan-vace", condition="vace")


@pytest.fixture(scope="session")
def tiny_wan22_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _wan_folder(tmp_path_factory, "wan22", two_experts=True)


@pytest.fixture(scope="session")
def tiny_wan_i2v_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _wan_folder(tmp_path_factory, "wan-i2v", condition="i2v")


@pytest.fixture(scope="session")
def tiny_qwen_image_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mmalign import tiny

    return tiny.build("qwen_image_tiny", tmp_path_factory.mktemp("models") / "qwen-image", announce=False)


@pytest.fixture(scope="session")
def tiny_qwen_image_edit_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mmalign import tiny

    return tiny.build(
        "qwen_image_edit_tiny", tmp_path_factory.mktemp("models") / "qwen-image-edit", announce=False
    )


@pytest.fixture(scope="session")
def wan_media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two 9-frame 32 x 32 source clips and an edit mask, written with `mmalign.data.media.write_array`."""
    from mmalign.data.media import write_array

    root = tmp_path_factory.mktemp("wan-media")
    g = torch.Generator().manual_seed(0)
    for name in ("a", "b"):
        write_array(torch.rand(9, 3, 32, 32, generator=g), root / f"{name}.npz")
    mask = torch.zeros(9, 32, 32)
    mask[:, 8:24, 4:20] = 1.0
    write_array(mask, root / "mask.npz")
    from PIL import Image

    for name in ("first", "second"):  # first frames of image to video
        pixels = (torch.rand(32, 32, 3, generator=g) * 255).to(torch.uint8).numpy()
        Image.fromarray(pixels).save(root / f"{name}.png")
    return root


@pytest.fixture(scope="session")
def kontext_media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two 16 x 16 source images (the tiny Flux's output size) for the FLUX.1 Kontext editing rows."""
    from mmalign.data.media import save_image

    root = tmp_path_factory.mktemp("kontext-media")
    g = torch.Generator().manual_seed(0)
    for name in ("a", "b"):
        save_image(torch.rand(3, 16, 16, generator=g), root / f"{name}.png")
    return root


# ----------------------------------------------------------------------------- the policies


def _text_rows() -> list[dict[str, Any]]:
    return [{"prompt": "Q: 1 + 2 = ?\nA:", "idx": 0}, {"prompt": "hello world", "idx": 1}]


def _vlm_rows() -> list[dict[str, Any]]:
    from mmalign.tiny import vlm as tiny_vlm

    rng = random.Random(0)
    red = tiny_vlm.draw_shape("red", tiny_vlm.SHAPES[0], rng)
    blue = tiny_vlm.draw_shape("blue", tiny_vlm.SHAPES[1], rng)
    return [
        {"prompt": "What colour is the shape?", "images": [red]},
        {"prompt": "colour?", "images": [blue]},
    ]


def _image_rows() -> list[dict[str, Any]]:
    return [{"prompt": "a red cat", "label": 1}, {"prompt": "Two blue dogs, left!", "label": 2}]


def _edit_rows(media: Path) -> list[dict[str, Any]]:
    """Editing rows: each a source clip; the first also an edit mask (the second edits everywhere)."""
    return [
        {
            "prompt": "make the square red",
            "source_video": str(media / "a.npz"),
            "edit_mask": str(media / "mask.npz"),
        },
        {"prompt": "remove the blue square", "source_video": str(media / "b.npz")},
    ]


def _i2v_rows(media: Path) -> list[dict[str, Any]]:
    """Image-to-video rows: each a first frame (a PNG file)."""
    return [
        {"prompt": "the square moves right", "image": str(media / "first.png")},
        {"prompt": "a blue square falls", "image": str(media / "second.png")},
    ]


def _text_policy(path: Path, **kw: Any) -> Policy:
    from mmalign.policies.text import TextPolicy

    return TextPolicy.from_pretrained(str(path), max_new_tokens=MAX_NEW_TOKENS, **kw)


def _vlm_policy(path: Path, **kw: Any) -> Policy:
    from mmalign.policies.vlm import VLMPolicy

    return VLMPolicy.from_pretrained(
        str(path), max_new_tokens=MAX_NEW_TOKENS, min_pixels=3136, max_pixels=3136, **kw
    )


def _flow_policy(path: Path, **kw: Any) -> Policy:
    from mmalign.policies.sd3 import SD3Policy

    return SD3Policy.from_pretrained(path, num_steps=NUM_STEPS, seed=0, max_sequence_length=SEQ, **kw)


def _flux_policy(path: Path, **kw: Any) -> Policy:
    from mmalign.policies.flux import FluxPolicy

    return FluxPolicy.from_pretrained(path, num_steps=NUM_STEPS, seed=0, max_sequence_length=SEQ, **kw)


def _kontext_policy(path: Path, **kw: Any) -> Policy:
    from mmalign.policies.flux_kontext import FluxKontextPolicy

    return FluxKontextPolicy.from_pretrained(path, num_steps=NUM_STEPS, seed=0, max_sequence_length=SEQ, **kw)


def _kontext_rows(media: Path) -> list[dict[str, Any]]:
    """Image-editing rows: an instruction and a source image each (FLUX.1 Kontext)."""
    return [
        {"prompt": "make the red square blue", "source_image": str(media / "a.png")},
        {"prompt": "move the square to the left", "source_image": str(media / "b.png")},
    ]


def _ddim_policy(path: Path, **kw: Any) -> Policy:
    from mmalign.policies.ddim import DDIMPolicy

    return DDIMPolicy.from_pretrained(path, num_steps=NUM_STEPS, seed=0, **kw)


def _wan_policy(path: Path, condition: str = "none", **kw: Any) -> Policy:
    from mmalign.policies.wan import wan_policy_class

    cls = wan_policy_class(condition)
    return cls.from_pretrained(path, num_steps=NUM_STEPS, seed=0, **WAN_SIZE, **kw)


def _qwen_image_policy(path: Path, **kw: Any) -> Policy:
    from mmalign.policies.qwen_image import QwenImagePolicy

    return QwenImagePolicy.from_pretrained(
        path, num_steps=NUM_STEPS, seed=0, latent_size=8, max_sequence_length=QWEN_SEQ, **kw
    )


def _qwen_edit_policy(path: Path, **kw: Any) -> Policy:
    """Qwen-Image-Edit at 16 px (the Kontext rows' sources), true CFG: the negative prompt read with each source."""
    from mmalign.policies.qwen_image_edit import QwenImageEditPolicy

    return QwenImageEditPolicy.from_pretrained(
        path,
        num_steps=NUM_STEPS,
        seed=0,
        latent_size=8,
        max_sequence_length=QWEN_SEQ,
        guidance_scale=2.0,
        **kw,
    )


def _wan_i2v_policy(path: Path, **kw: Any) -> Policy:
    """Wan2.1-style image to video: the CLIP image states need the 512 text tokens diffusers' attention assumes."""
    from mmalign.policies.wan import WanImageToVideoPolicy

    size = {**WAN_SIZE, "max_sequence_length": 512}
    return WanImageToVideoPolicy.from_pretrained(path, num_steps=NUM_STEPS, seed=0, **size, **kw)


def _wan_edit_policy(condition: str) -> Callable[..., Policy]:
    def load(path: Path, **kw: Any) -> Policy:
        return _wan_policy(path, condition=condition, **kw)

    return load


@dataclass(frozen=True)
class Family:
    """How to build one policy family from its tiny folder, and what it samples."""

    name: str
    model_dir: str
    """The session fixture (``tests/conftest.py``) holding the tiny folder."""
    load: Callable[..., Policy]
    """``load(folder, **kwargs)``: the policy through its own `from_pretrained`."""
    rows: Callable[[], list[dict[str, Any]]]
    kind: str
    """What `sample_view` shows of a sample (`SAMPLE_KINDS`)."""
    reward: type[Reward]
    frozen_modules: tuple[str, ...] = field(default=())
    """Policy attributes whose parameters never train (checked to exist)."""
    dead_ends: tuple[str, ...] = field(default=())
    """Regexes of trainable parameter names whose gradient is 0 by the architecture itself (no loss of the
    image can reach them), so they may stay unchanged."""
    media: str | None = None
    """A session fixture with the rows' media files: then ``rows(media_folder)`` builds the rows."""


FAMILIES = {
    f.name: f
    for f in (
        Family("text", "random_text_model_dir", _text_policy, _text_rows, "text", TextCharSum),
        Family("vlm", "random_vlm_model_dir", _vlm_policy, _vlm_rows, "text", TextCharSum),
        Family(
            "flow",
            "tiny_sd3_model_dir",
            _flow_policy,
            _image_rows,
            "image",
            ImageMean,
            ("vae", "text_encoder", "text_encoder_2", "text_encoder_3"),
            # the tiny SD3 has one joint block, so it is the last one: ``context_pre_only``, its text-stream
            # output is discarded and the text queries (add_q_proj) reach nothing (as in every SD3's last block)
            (r"transformer_blocks\.0\.attn\.add_q_proj\.",),
        ),
        Family(
            "flux",
            "tiny_flux_model_dir",
            _flux_policy,
            _image_rows,
            "image",
            ImageMean,
            ("vae", "text_encoder", "text_encoder_2"),
        ),
        Family(
            "flux_kontext",
            "tiny_flux_model_dir",
            _kontext_policy,
            _kontext_rows,
            "image",
            ImageMean,
            ("vae", "text_encoder", "text_encoder_2"),
            media="kontext_media_dir",
        ),
        Family(
            "ddim",
            "tiny_sd15_model_dir",
            _ddim_policy,
            _image_rows,
            "image",
            ImageMean,
            ("vae", "text_encoder"),
        ),
        Family(
            "qwen_image",
            "tiny_qwen_image_dir",
            _qwen_image_policy,
            _image_rows,
            "image",
            ImageMean,
            ("vae", "text_encoder"),
            # the last joint block's text-stream output is discarded (as in every Qwen-Image), so its text
            # queries, text feed-forward and text output projection reach nothing (the tiny model has 2 blocks)
            (r"transformer_blocks\.1\.(attn\.(to_add_out|add_q_proj|norm_added_q)|txt_mlp)\.",),
        ),
        Family(
            "qwen_image_edit",
            "tiny_qwen_image_edit_dir",
            _qwen_edit_policy,
            _kontext_rows,
            "image",
            ImageMean,
            ("vae", "text_encoder"),
            (r"transformer_blocks\.1\.(attn\.(to_add_out|add_q_proj|norm_added_q)|txt_mlp)\.",),
            media="kontext_media_dir",
        ),
        Family(
            "wan_t2v",
            "tiny_wan_t2v_dir",
            _wan_policy,
            _image_rows,
            "video",
            VideoMean,
            ("vae", "text_encoder"),
        ),
        Family(
            "wan_concat",
            "tiny_wan_concat_dir",
            _wan_edit_policy("concat"),
            _edit_rows,
            "video",
            VideoMean,
            ("vae", "text_encoder"),
            media="wan_media_dir",
        ),
        Family(
            "wan_vace",
            "tiny_wan_vace_dir",
            _wan_edit_policy("vace"),
            _edit_rows,
            "video",
            VideoMean,
            ("vae", "text_encoder"),
            media="wan_media_dir",
        ),
        Family(
            "wan_i2v",
            "tiny_wan_i2v_dir",
            _wan_i2v_policy,
            _i2v_rows,
            "video",
            VideoMean,
            ("vae", "text_encoder", "image_encoder"),
            media="wan_media_dir",
        ),
        # two experts: with 3 steps (shift 3) the timesteps are 1000, 751 and 9, so step 1 runs the high-noise
        # expert and steps 2-3 the low-noise one (boundary 875): the gradient test needs both to get gradients
        Family(
            "wan22", "tiny_wan22_dir", _wan_policy, _image_rows, "video", VideoMean, ("vae", "text_encoder")
        ),
    )
}


@dataclass(frozen=True)
class Case:
    family: Family
    lora: bool

    @property
    def id(self) -> str:
        return f"{self.family.name}-{'lora' if self.lora else 'full'}"


CASES = [Case(f, lora) for f in FAMILIES.values() for lora in (False, True)]
LORA_CASES = [c for c in CASES if c.lora]


class Built:
    """One case's folder, rows and a factory of fresh policies (each test mutates its own)."""

    def __init__(self, case: Case, folder: Path, media: Path | None = None) -> None:
        self.case, self.folder = case, folder
        self.family = case.family
        self.rows = case.family.rows() if media is None else case.family.rows(media)

    def make(self, *, lora: bool | None = None, **kw: Any) -> Policy:
        use_lora = self.case.lora if lora is None else lora
        if use_lora:
            kw["lora"] = LORA
        return self.family.load(self.folder, **kw)

    def is_dead_end(self, name: str) -> bool:
        return any(re.search(pattern, name) for pattern in self.family.dead_ends)

    def load(self, folder: Path, **kw: Any) -> Policy:
        """A policy from another folder (e.g. a saved one) with this family's options, no LoRA."""
        return self.family.load(folder, **kw)


def _built(request: pytest.FixtureRequest) -> Built:
    case: Case = request.param
    media = case.family.media
    return Built(
        case,
        request.getfixturevalue(case.family.model_dir),
        None if media is None else request.getfixturevalue(media),
    )


@pytest.fixture(params=CASES, ids=lambda c: c.id)
def built(request: pytest.FixtureRequest) -> Built:
    return _built(request)


@pytest.fixture(params=LORA_CASES, ids=lambda c: c.id)
def built_lora(request: pytest.FixtureRequest) -> Built:
    return _built(request)


# ----------------------------------------------------------------------------- helpers


def fresh_rollout(pol: Policy, b: Built, *, compute_logp: bool = True, seed: int = 0) -> Rollout:
    torch.manual_seed(seed)
    r = pol.rollout(b.rows, GROUP, compute_logp=compute_logp)
    assert len(r) == len(b.rows) * GROUP and r.mask.shape[0] == len(r)
    assert bool(r.mask.any(dim=1).all()), "every sample must have at least one action"
    return r


def logp_of(pol: Policy, r: Rollout) -> Tensor:
    """`action_stats`'s log-probs without grad, 0 on masked-out actions."""
    with torch.no_grad():
        return pol.action_stats(r).logp.detach().masked_fill(~r.mask, 0.0)


def masked(x: Tensor, r: Rollout) -> Tensor:
    return x.detach().masked_fill(~r.mask.to(x.device), 0.0)


def all_parameters(pol: Policy) -> dict[int, tuple[str, torch.nn.Parameter]]:
    """Every parameter of every module the policy holds (model, reference copy, VAE, text encoders, the
    components of a diffusion pipeline), by id, with a readable name."""
    found: dict[int, tuple[str, torch.nn.Parameter]] = {}

    def visit(prefix: str, obj: Any) -> None:
        if isinstance(obj, torch.nn.Module):
            for n, p in obj.named_parameters():
                found.setdefault(id(p), (f"{prefix}.{n}", p))

    for key, value in vars(pol).items():
        visit(key, value)
    components = getattr(pol, "components", None)
    if components is not None:
        for key, value in vars(components).items():
            visit(f"components.{key}", value)
    return found


def split_parameters(
    pol: Policy,
) -> tuple[list[tuple[str, torch.nn.Parameter]], list[tuple[str, torch.nn.Parameter]]]:
    """(trainable, frozen): `trainable_parameters()` and every other parameter the policy holds."""
    every = all_parameters(pol)
    trainable_ids = [id(p) for p in pol.trainable_parameters()]
    assert len(set(trainable_ids)) == len(trainable_ids), "trainable_parameters() lists a tensor twice"
    unknown = [i for i in trainable_ids if i not in every]
    assert not unknown, "trainable_parameters() returns tensors that are no parameter of the policy's modules"
    trainable = [every[i] for i in trainable_ids]
    ids = set(trainable_ids)
    frozen = [v for i, v in every.items() if i not in ids]
    return trainable, frozen


@torch.no_grad()
def perturb(params: list[torch.nn.Parameter], scale: float = 0.05, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.add_(scale * torch.randn(p.shape, generator=g).to(p.device, p.dtype))


def lora_b(pol: Policy) -> list[torch.nn.Parameter]:
    params = [p for n, p in pol.model.named_parameters() if "lora_B" in n]
    assert params, "a LoRA policy without lora_B weights"
    return params


@torch.no_grad()
def adapter_off_logp(pol: Policy, r: Rollout) -> Tensor:
    """`action_stats`'s log-probs with the LoRA adapter switched off by the libraries themselves: peft's
    ``disable_adapter()`` context (transformers models wrapped by peft), or diffusers'
    ``disable_adapters()`` / ``enable_adapters()`` (denoisers with ``add_adapter``)."""
    model = pol.model
    if hasattr(model, "disable_adapter") and hasattr(model, "base_model"):  # peft PeftModel
        with model.disable_adapter():
            return logp_of(pol, r)
    model.disable_adapters()
    try:
        return logp_of(pol, r)
    finally:
        model.enable_adapters()


ATOL = 1e-5
"""fp32 tolerance on log-probs recomputed by the same forward."""


# ----------------------------------------------------------------------------- the contract


def test_is_a_policy(built: Built) -> None:
    pol = built.make()
    assert isinstance(pol, Policy)
    assert isinstance(pol.kl_in_action_stats, bool)
    assert pol.forward_model is pol.model
    names = [n for n, p in pol.model.named_parameters() if p.requires_grad]
    if built.case.lora:
        assert names and all("lora_" in n for n in names)
    trainable, frozen = split_parameters(pol)
    assert trainable and all(p.requires_grad for _, p in trainable)
    for attr in built.family.frozen_modules:  # e.g. the VAE and text encoders: held, never trained
        prefixes = (f"{attr}.", f"components.{attr}.")
        assert any(n.startswith(prefixes) for n, _ in frozen), f"no parameters of {attr}"
        assert not any(n.startswith(prefixes) for n, _ in trainable), f"{attr} is trainable"


def test_ratio_is_one_on_reevaluation(built: Built) -> None:
    pol = built.make()
    r = fresh_rollout(pol, built)
    assert r.logp_old is not None and r.logp_old.shape == r.mask.shape
    assert bool(torch.isfinite(r.logp_old[r.mask]).all())
    logp = masked(pol.action_stats(r).logp, r)
    torch.testing.assert_close(logp, masked(r.logp_old, r), atol=ATOL, rtol=1e-5)
    # and a minibatch slice (another order) gives the same numbers
    idx = [3, 0, 2]
    sub = r[idx]
    torch.testing.assert_close(
        masked(pol.action_stats(sub).logp, sub), masked(sub.logp_old, sub), atol=ATOL, rtol=1e-5
    )


def test_gradients_reach_only_trainable_parameters(built: Built) -> None:
    pol = built.make(need_reference=True)
    r = fresh_rollout(pol, built, compute_logp=False)
    if built.case.lora:  # lora_B starts at 0, which blocks the gradient into lora_A
        perturb(lora_b(pol))
    trainable, frozen = split_parameters(pol)
    assert trainable and frozen
    pol.model.train()
    pol.model.zero_grad(set_to_none=True)
    (pol.action_stats(r).logp * r.mask).sum().backward()
    no_grad = [n for n, p in trainable if p.grad is None and not built.is_dead_end(n)]
    assert not no_grad, f"trainable parameters without a gradient: {no_grad[:5]}"
    trainable = [(n, p) for n, p in trainable if p.grad is not None]
    bad = [n for n, p in trainable if not bool(torch.isfinite(p.grad).all())]
    assert not bad, f"non-finite gradients: {bad[:5]}"
    zero = [n for n, p in trainable if not bool(p.grad.abs().sum() > 0)]
    unexpected = [n for n in zero if not built.is_dead_end(n)]
    assert not unexpected, f"all-zero gradients: {unexpected[:5]} ({len(zero)} of {len(trainable)} tensors)"
    leaked = [n for n, p in frozen if p.grad is not None and bool(p.grad.abs().sum() > 0)]
    assert not leaked, f"gradients reach parameters outside trainable_parameters(): {leaked[:5]}"


def test_lora_reference_is_the_adapter_off_model(built_lora: Built) -> None:
    b = built_lora
    pol = b.make()
    r = fresh_rollout(pol, b)
    perturb(lora_b(pol), scale=0.2)
    on = logp_of(pol, r)
    ref = masked(pol.reference_logprobs(r), r)
    assert not ref.requires_grad
    off = adapter_off_logp(pol, r)
    assert not torch.allclose(on, off, atol=1e-4), "perturbing the adapter did not change the log-probs"
    torch.testing.assert_close(ref, off, atol=ATOL, rtol=1e-5)
    # the adapter-off model is the base model: the folder loaded afresh without LoRA, and the rollout's own
    # log-probs (sampled with the adapter at its identity initialisation)
    base = b.make(lora=False)
    torch.testing.assert_close(ref, logp_of(base, r), atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(ref, masked(r.logp_old, r), atol=ATOL, rtol=1e-5)
    # switching the adapter off for the reference leaves it on afterwards
    torch.testing.assert_close(logp_of(pol, r), on, atol=0, rtol=0)


def _kl(pol: Policy, r: Rollout, estimator: str) -> Tensor:
    if pol.kl_in_action_stats:
        stats = pol.action_stats(r)
        assert stats.kl is not None and stats.kl.shape == r.mask.shape, (
            "kl_in_action_stats without ActionStats.kl"
        )
        return masked(stats.kl, r)
    logp = pol.action_stats(r).logp
    ref = pol.reference_logprobs(r)
    return masked(losses.kl(logp, ref.to(logp.device), estimator, mask=r.mask.to(logp.device)), r)


def test_kl_is_zero_at_initialisation(built: Built) -> None:
    pol = built.make(need_reference=True)
    r = fresh_rollout(pol, built)
    for est in ("k1", "k2", "k3"):
        kl = _kl(pol, r, est)
        assert float(kl.abs().max()) <= 1e-6, (est, float(kl.abs().max()))
        if pol.kl_in_action_stats:
            break  # the policy's own KL does not depend on the estimator
    perturb(lora_b(pol) if built.case.lora else pol.trainable_parameters(), scale=0.2)
    assert float(_kl(pol, r, "k3").abs().max()) > 1e-6, "the KL stays 0 after the weights changed"


def test_trainable_state_round_trip_and_save(built: Built, tmp_path: Path) -> None:
    pol = built.make()
    r = fresh_rollout(pol, built)
    before = logp_of(pol, r)
    state = pol.trainable_state_dict()
    assert len(state) == len(pol.trainable_parameters()), (
        "trainable_state_dict must hold every trainable tensor"
    )
    assert all(isinstance(v, Tensor) for v in state.values())
    perturb(pol.trainable_parameters(), scale=0.2)
    changed = logp_of(pol, r)
    assert not torch.allclose(changed, before, atol=1e-4), "perturbing the trainable weights changed nothing"
    # the state is a copy: perturbing the model left it alone, and loading it restores the log-probs exactly
    pol.load_trainable_state_dict(state)
    torch.testing.assert_close(logp_of(pol, r), before, atol=0, rtol=0)
    # save() writes the CURRENT weights into a folder that the policy's own from_pretrained loads
    perturb(pol.trainable_parameters(), scale=0.2, seed=2)
    now = logp_of(pol, r)
    out = tmp_path / "saved"
    pol.save(out)
    again = built.load(out)
    torch.testing.assert_close(logp_of(again, r), now, atol=ATOL, rtol=1e-5)
    assert not torch.allclose(logp_of(again, r), before, atol=1e-4)


def _trainer_config(b: Built, out: Path):
    return config_from_dict(
        {
            "pipeline": "policy_contract",
            "output_dir": str(out),
            "seed": 0,
            "rollout": {
                "group_size": GROUP,
                "prompts_per_step": len(b.rows),
                "max_new_tokens": MAX_NEW_TOKENS,
            },
            "rewards": [{"name": f"{__name__}:{b.family.reward.__name__}", "alias": "varied"}],
            "algorithm": {"kl_coef": 0.01},
            "trainer": {"steps": 2, "lr": 1e-3, "progress_bar": False, "save_every": 100, "sample_every": 1},
        },
        "test",
    )


def test_two_trainer_steps_change_only_trainable_parameters(built: Built, tmp_path: Path) -> None:
    from mmalign.training.trainer import GroupTrainer
    from pipelines import TrainingSetup

    pol = built.make(need_reference=True)
    cfg = _trainer_config(built, tmp_path / "run")
    rewards = RewardSet(cfg.rewards)
    trainable, frozen = split_parameters(pol)
    before_t = {n: p.detach().clone() for n, p in trainable}
    before_f = {n: p.detach().clone() for n, p in frozen}
    trainer = GroupTrainer(cfg, TrainingSetup(policy=pol, rewards=rewards, data=list(built.rows)))
    history = trainer.train()
    assert [m["step"] for m in history] == [1, 2]
    assert history[0]["reward/varied/std"] > 0, "the reward must vary (else nothing is updated)"
    assert history[0]["kl"] == pytest.approx(0.0, abs=1e-6)
    unchanged = [n for n, p in trainable if torch.equal(p.detach(), before_t[n]) and not built.is_dead_end(n)]
    assert not unchanged, (
        f"trainable parameters that two steps did not move: {unchanged[:5]} (of {len(trainable)})"
    )
    moved = [n for n, p in frozen if not torch.equal(p.detach(), before_f[n])]
    assert not moved, f"frozen parameters changed by training: {moved[:5]}"
    assert (tmp_path / "run" / "final").is_dir()

    # sample_view: one dict per sample, of the policy's kind; the run directory shows the same kind
    samples = [
        json.loads(x) for x in (tmp_path / "run" / "samples" / "step_000002.jsonl").read_text().splitlines()
    ]
    assert len(samples) == len(built.rows) * GROUP and all(built.family.kind in s for s in samples)
    r = pol.rollout(built.rows, GROUP, compute_logp=False)
    pol.materialize(r, rewards.needs)
    views = pol.sample_view(r)
    assert isinstance(views, list) and len(views) == len(r)
    for view in views:
        assert isinstance(view, dict) and set(view) <= set(SAMPLE_KINDS)
        value = view.get(built.family.kind)
        if built.family.kind == "text":
            assert isinstance(value, str)
        elif built.family.kind == "video":
            assert isinstance(value, Tensor) and value.dim() == 4 and value.shape[1] == 3
            assert value.shape[0] == WAN_SIZE["num_frames"]
            assert float(value.min()) >= 0 and float(value.max()) <= 1
        else:
            assert isinstance(value, Tensor) and value.dim() == 3 and value.shape[0] == 3
            assert float(value.min()) >= 0 and float(value.max()) <= 1
