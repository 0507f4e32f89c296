"""VLMPolicy on a tiny offline Qwen2-VL: loading, rollout masks, log-prob recomputation, LoRA/freezing,
the vlm_reasoning pipeline's data errors, and training through GroupTrainer."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Any

import pytest
import torch

import pipelines
from mmalign import tiny
from mmalign.config import LoraConfig, RewardConfig, config_from_dict, load_config
from mmalign.data.rows import DataError
from mmalign.policies.vlm import VISION_MODULE, VLMPolicy
from mmalign.tiny import vlm as tiny_vlm
from mmalign.training.trainer import GroupTrainer
from rewards import Reward, RewardBatch

REPO = Path(__file__).resolve().parents[2]
ASSETS = REPO / "assets" / "vlm_reasoning"


@pytest.fixture(scope="session")
def random_vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "vlm-random"
    tiny.build("vlm_random", path)
    return path


@pytest.fixture(scope="session")
def tiny_vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "vlm_reasoning-tiny"
    tiny.build("vlm_reasoning", path)
    return path


def pictures(n: int, seed: int = 0) -> list[Any]:
    rng = random.Random(seed)
    colours = list(tiny_vlm.COLOURS)
    return [tiny_vlm.draw_shape(colours[i % 4], tiny_vlm.SHAPES[i % 3], rng) for i in range(n)]


def mixed_rows() -> list[dict[str, Any]]:
    """Prompts of different lengths and different numbers (and sizes) of images: left padding matters."""
    a, b, c, d = pictures(4)
    return [
        {"prompt": "What colour is the shape?", "images": [a], "answer": "red"},
        {
            "prompt": "Two pictures. Which colour is in the second one? Answer briefly.",
            "images": [b, c.resize((112, 84))],
        },
        {"prompt": "colour?", "images": [str(ASSETS / "images" / "000.png")]},
        {"prompt": "Three?", "images": [a, b, d]},
    ]


def test_round_trip_through_from_pretrained(random_vlm_dir: Path) -> None:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(random_vlm_dir)
    model = AutoModelForImageTextToText.from_pretrained(random_vlm_dir)
    assert type(processor).__name__ == "Qwen2VLProcessor"
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration"
    tok = processor.tokenizer
    assert (
        model.config.image_token_id
        == tok.convert_tokens_to_ids(tiny_vlm.IMAGE_PAD)
        == processor.image_token_id
    )
    assert model.config.vision_start_token_id == tok.convert_tokens_to_ids(tiny_vlm.VISION_START)
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}]
    text = processor.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    enc = processor(images=pictures(1), text=[text], return_tensors="pt")
    assert enc["image_grid_thw"].tolist() == [[1, 4, 4]]  # 56x56, patch 14
    assert int((enc["input_ids"] == processor.image_token_id).sum()) == 4  # 2x2 after merging


def _capture_generate(policy: VLMPolicy) -> list[torch.Tensor]:
    """Make `policy.model.generate` also record its per-step scores (processed logits)."""
    seen: list[torch.Tensor] = []
    original = policy.model.generate

    def generate(**kwargs: Any) -> torch.Tensor:
        out = original(**kwargs, output_scores=True, return_dict_in_generate=True)
        seen.append(torch.stack(out.scores, dim=1))
        return out.sequences

    policy.model.generate = generate  # type: ignore[method-assign]
    return seen


def test_rollout_masks_and_logprobs(random_vlm_dir: Path) -> None:
    torch.manual_seed(0)
    policy = VLMPolicy.from_pretrained(str(random_vlm_dir), max_new_tokens=8, temperature=0.7)
    scores = _capture_generate(policy)
    rows = mixed_rows()
    r = policy.rollout(rows, 3, compute_logp=True)
    b = len(rows) * 3
    p = r.payload
    assert len(r) == b and r.mask.shape == p["completion_ids"].shape == r.logp_old.shape
    assert len(p["pixel_values"]) == b and len(p["image_grid_thw"]) == b
    # every image token is in the prompt; the action mask only covers completion tokens
    image_id = policy.processor.image_token_id
    n_images = [1, 2, 1, 3]
    for i in range(b):
        grid = p["image_grid_thw"][i]
        assert grid.shape[0] == n_images[i // 3]
        assert int((p["prompt_ids"][i] == image_id).sum()) == int(grid.prod(dim=1).sum()) // 4
        assert p["pixel_values"][i].shape[0] == int(grid.prod(dim=1).sum())
    assert not bool((p["completion_ids"][r.mask] == image_id).any())
    # left padding: the prompt mask ends with ones in every row
    assert bool(p["prompt_mask"][:, -1].all()) and not bool(p["prompt_mask"].all())
    # the mask ends at (and includes) the first EOS
    for i in range(b):
        ids = p["completion_ids"][i].tolist()
        eos_at = [j for j, t in enumerate(ids[: int(r.mask[i].sum())]) if t in policy.eos_ids]
        n = int(r.mask[i].sum())
        assert r.mask[i, :n].all() and not r.mask[i, n:].any()
        if eos_at:
            assert eos_at[0] == n - 1
    # sizes for box rewards
    assert r.columns["image_width"][3] == 56 and r.columns["resized_sizes"][3] == [(56, 56), (56, 28)]
    assert r.columns["image_sizes"][3][1] == (112, 84)

    # log-probs equal generate's own (temperature-scaled) scores on the sampled tokens
    gen = torch.cat(scores, dim=0).log_softmax(dim=-1)
    t = gen.shape[1]
    picked = gen.gather(-1, p["completion_ids"][:, :t, None]).squeeze(-1)
    m = r.mask[:, :t]
    torch.testing.assert_close(r.logp_old[:, :t][m], picked[m], atol=2e-4, rtol=1e-4)

    # a minibatch slice (pixels re-concatenated per sample) gives the same numbers, with grad
    idx = [10, 4, 0, 7]
    stats = policy.action_stats(r[idx])
    assert stats.logp.requires_grad
    torch.testing.assert_close(stats.logp.detach(), r.logp_old[idx], atol=1e-5, rtol=1e-5)


def test_freeze_vision_and_lora_targets(random_vlm_dir: Path) -> None:
    frozen = VLMPolicy.from_pretrained(str(random_vlm_dir), freeze_vision=True)
    names = [n for n, _ in frozen.model.named_parameters() if VISION_MODULE.search(n)]
    assert names and all(not p.requires_grad for n, p in frozen.model.named_parameters() if n in names)
    assert all(p.requires_grad for n, p in frozen.model.named_parameters() if n not in names)
    assert not any(VISION_MODULE.search(n) for n in frozen.trainable_state_dict())

    for targets in ("all-linear", ["q_proj", "v_proj", "gate_proj"]):
        lora = VLMPolicy.from_pretrained(
            str(random_vlm_dir), lora=LoraConfig(enabled=True, r=2, target_modules=targets)
        )
        trainable = list(lora.trainable_state_dict())
        assert trainable and all("lora_" in n and "language_model.layers." in n for n in trainable)
        wrapped = [n for n, mod in lora.model.named_modules() if hasattr(mod, "lora_A")]
        assert wrapped and not any(VISION_MODULE.search(n) for n in wrapped)
        rows = mixed_rows()[:2]
        r = lora.rollout(rows, 2)
        torch.testing.assert_close(lora.reference_logprobs(r), r.logp_old)  # adapter starts as identity


# ----------------------------------------------------------------------------- pipeline


def vlm_cfg(model_dir: Path, out: Path, train: Path, model: dict[str, Any] | None = None, **options: Any):
    return config_from_dict(
        {
            "pipeline": "vlm_reasoning",
            "output_dir": str(out),
            "model": {"name_or_path": str(model_dir), **(model or {})},
            "data": {"train": str(train)},
            "options": {"image_root": str(ASSETS), **options},
            "rollout": {"group_size": 4, "prompts_per_step": 2, "max_new_tokens": 8},
            "rewards": [
                {"name": "answer_accuracy", "kwargs": {"extract": "tag", "mode": "exact"}},
                {"name": "format", "weight": 0.2, "kwargs": {"tags": ["answer"], "strict": True}},
            ],
            "trainer": {"steps": 2, "lr": 1e-3, "progress_bar": False, "save_every": 100, "sample_every": 1},
        },
        "test",
    )


def bad_jsonl(tmp_path: Path) -> Path:
    good = (ASSETS / "train.jsonl").read_text().splitlines()[:3]
    missing = json.dumps(
        {"images": ["images/nope.png"], "question": "What colour is the shape?", "answer": "red"}
    )
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join([good[0], "{not json", good[1], missing, good[2]]) + "\n")
    return path


def test_bad_rows_error_or_skip(
    random_vlm_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pipelines.names()  # registers the options section
    path = bad_jsonl(tmp_path)
    with pytest.raises(DataError, match=rf"{path}:2: invalid JSON"):
        pipelines.get("vlm_reasoning")(vlm_cfg(random_vlm_dir, tmp_path / "a", path))
    missing = tmp_path / "missing.jsonl"
    missing.write_text("\n".join(path.read_text().splitlines()[2:4]) + "\n")
    with pytest.raises(DataError, match=rf"{missing}:2: image file not found: .*nope\.png"):
        pipelines.get("vlm_reasoning")(vlm_cfg(random_vlm_dir, tmp_path / "b", missing))
    with caplog.at_level(logging.WARNING):
        comps = pipelines.get("vlm_reasoning")(
            vlm_cfg(random_vlm_dir, tmp_path / "c", path, on_bad_row="skip")
        )
    assert len(comps.data) == 3
    assert "skipped 2 bad row(s) of 5" in caplog.text
    assert all(Path(p).is_file() for row in comps.data for p in row["images"])


class LengthMod3(Reward):
    """len(text) % 3: varies on a random model's gibberish, so advantages are not all zero."""

    def __call__(self, batch: RewardBatch) -> list[float]:
        return [float(len(t) % 3) for t in batch.texts]


def test_two_steps_through_group_trainer(random_vlm_dir: Path, tmp_path: Path) -> None:
    cfg = vlm_cfg(random_vlm_dir, tmp_path / "run", ASSETS / "train.jsonl", freeze_vision=True)
    cfg.rewards.append(RewardConfig(name=f"{__name__}:LengthMod3", alias="length_mod3"))
    trainer = GroupTrainer(cfg, pipelines.get("vlm_reasoning")(cfg))
    before = {k: v.clone() for k, v in trainer.policy.trainable_state_dict().items()}
    history = trainer.train()
    assert [m["step"] for m in history] == [1, 2]
    after = trainer.policy.trainable_state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert (tmp_path / "run" / "final" / "processor_config.json").exists()


@pytest.mark.slow
def test_accuracy_rises_on_the_tiny_vlm_task(tiny_vlm_dir: Path, tmp_path: Path) -> None:
    """The quickstart config (60 steps, ~1 min on 2 cores): last 10% of steps beat the first 10% clearly."""
    cfg = load_config(
        REPO / "configs" / "vlm_reasoning-tiny.yaml",
        [
            f"model.name_or_path={tiny_vlm_dir}",
            f"output_dir={tmp_path / 'run'}",
            "trainer.progress_bar=false",
            "trainer.save_every=1000",
            f"data.train={ASSETS / 'train.jsonl'}",
            f"options.image_root={ASSETS}",
        ],
    )
    history = GroupTrainer(cfg, pipelines.get(cfg.pipeline)(cfg)).train()
    acc = [m["reward/answer_accuracy/mean"] for m in history]
    n = max(1, len(acc) // 10)
    first, last = sum(acc[:n]) / n, sum(acc[-n:]) / n
    assert last > first + 0.2, (first, last)


def test_video_frames_and_images_in_one_batch(random_vlm_dir: Path) -> None:
    """Video as a list of frames next to an image row: rollout works, and a reordered slice recomputes
    the same log-probs (per-sample video tensors are sliced and re-joined consistently)."""
    pol = VLMPolicy.from_pretrained(str(random_vlm_dir), max_new_tokens=5, min_pixels=3136, max_pixels=3136)
    frames = pictures(4)
    rows = [{"prompt": "What happens?", "video": frames}, {"prompt": "Colour?", "images": [frames[0]]}]
    torch.manual_seed(0)
    ro = pol.rollout(rows, 2, compute_logp=True)
    assert ro.payload["video_grid_thw"][0] is not None and ro.payload["video_grid_thw"][2] is None
    assert torch.allclose(pol.action_stats(ro[[3, 0]]).logp.detach(), ro.logp_old[[3, 0]], atol=1e-5)
    assert not ro.mask[ro.mask.sum(1) == 0].any()


def test_hf_dataset_with_in_memory_images_feeds_the_policy(random_vlm_dir: Path, tmp_path: Path) -> None:
    """A `datasets` source whose image column holds PIL images (as hub datasets do)."""
    datasets = pytest.importorskip("datasets")
    from pipelines.common import VLMOptions, load_vlm_rows

    pics = pictures(2)
    ds = datasets.Dataset.from_dict(
        {
            "images": [[pics[0]], [pics[1]]],
            "question": ["Colour?", "Which colour?"],
            "answer": ["red", "green"],
        },
        features=datasets.Features(
            {
                "images": datasets.Sequence(datasets.Image()),
                "question": datasets.Value("string"),
                "answer": datasets.Value("string"),
            }
        ),
    )
    ds.save_to_disk(str(tmp_path / "vqa"))
    rows = load_vlm_rows(f"hf:{tmp_path / 'vqa'}:train", "{question}", VLMOptions())
    assert len(rows) == 2 and rows[1]["prompt"] == "Which colour?" and rows[1]["answer"] == "green"
    assert rows[0]["images"][0].size == pics[0].size
    pol = VLMPolicy.from_pretrained(str(random_vlm_dir), max_new_tokens=3, min_pixels=3136, max_pixels=3136)
    ro = pol.rollout(rows, 2, compute_logp=True)
    assert len(ro) == 4 and ro.columns["answer"] == ["red", "red", "green", "green"]


# ----------------------------------------------------------------------------- shared prefix


def pipeline_policy(model_dir: Path, out: Path, **model: Any) -> VLMPolicy:
    """The policy that `vlm_reasoning` builds from its config (`model:` keys as given), 56x56 images."""
    pipelines.names()  # registers the options section
    cfg = vlm_cfg(model_dir, out, ASSETS / "train.jsonl", model, min_pixels=3136, max_pixels=3136)
    pol = pipelines.get("vlm_reasoning")(cfg).policy
    assert isinstance(pol, VLMPolicy)
    return pol


def spy_shared_prefix(policy: VLMPolicy) -> list[int]:
    """Record the batch size of every shared-prefix forward (`TokenScorer.shared_prefix_features`) of `policy`."""
    calls: list[int] = []
    original = policy.scorer.shared_prefix_features

    def wrapped(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(len(args[3]))  # the sample -> prompt index
        return original(*args, **kwargs)

    policy.scorer.shared_prefix_features = wrapped  # type: ignore[method-assign]
    return calls


def _vlm_log_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "mmalign.policies.vlm"]


@pytest.mark.parametrize("lora", [False, True])
def test_vlm_shared_prefix_equals_plain_forward(
    random_vlm_dir: Path, tmp_path: Path, lora: bool, check_shared_prefix_matches_plain
) -> None:
    """Prompt + image tokens encoded once per group: the same log-probs AND parameter gradients as the
    plain forward, for prompts with different numbers/sizes of images and scattered groups. Both policies
    come from the `vlm_reasoning` pipeline (default config vs ``model.shared_prefix: false``)."""
    kw: dict[str, Any] = {"lora": {"enabled": True, "r": 4, "alpha": 8}} if lora else {}
    pol = pipeline_policy(random_vlm_dir, tmp_path / "shared", **kw)
    plain = pipeline_policy(random_vlm_dir, tmp_path / "plain", shared_prefix=False, **kw)
    if lora:  # lora_B starts at zero (no gradient into lora_A): move away from the identity adapter
        with torch.no_grad():
            for n, q in pol.model.named_parameters():
                if "lora_B" in n:
                    q.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(2))
    plain.load_trainable_state_dict(pol.trainable_state_dict())
    shared_calls, plain_calls = spy_shared_prefix(pol), spy_shared_prefix(plain)
    torch.manual_seed(0)
    ro = pol.rollout(mixed_rows(), 3, compute_logp=False)
    ro = ro[torch.randperm(len(ro), generator=torch.Generator().manual_seed(1))]
    check_shared_prefix_matches_plain(pol, ro, plain=plain)
    # each policy ran the path it was built with; the 1: the first (chunked) log-prob call also scores one
    # sample from the full logits to check the chunked path (`TokenScorer._check_chunking`)
    assert shared_calls == [len(ro), 1] and plain_calls == []


def test_vlm_reasoning_pipeline_uses_shared_prefix(
    random_vlm_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The default config turns the shared-prefix log-prob path on, says so once, and rollout log-probs
    (no grad) and `action_stats` (with grad, a shuffled slice) both take it."""
    with caplog.at_level(logging.INFO, logger="mmalign.policies.vlm"):
        pol = pipeline_policy(random_vlm_dir, tmp_path / "run")
    assert pol.shared_prefix
    assert _vlm_log_lines(caplog) == [
        "shared prefix: on (prompt + image tokens encoded once per group for log-probs)"
    ]
    calls = spy_shared_prefix(pol)
    torch.manual_seed(0)
    ro = pol.rollout(mixed_rows()[:2], 4, compute_logp=True)
    stats = pol.action_stats(ro[[5, 0, 3]])
    assert calls == [8, 1, 3]  # the 1: the one-sample check of the chunked log-probs, on the first call
    torch.testing.assert_close(stats.logp.detach(), ro.logp_old[[5, 0, 3]], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("why", ["config", "checkpointing", "no_rope_index"])
def test_vlm_shared_prefix_off_says_why(
    random_vlm_dir: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    why: str,
) -> None:
    """Switched off in the config, under gradient checkpointing, or for a model without an M-RoPE index
    function: one log line says it is off and why, and log-probs use the plain forward."""
    model: dict[str, Any] = {}
    if why == "config":
        model["shared_prefix"] = False
        level, reason = logging.INFO, "(model.shared_prefix: false)"
    elif why == "checkpointing":
        model["gradient_checkpointing"] = True
        level, reason = logging.WARNING, "(gradient checkpointing is on"
    else:
        monkeypatch.setattr("mmalign.policies.vlm.rope_index_fn", lambda _model: None)
        level, reason = logging.WARNING, "has no M-RoPE get_rope_index"
    with caplog.at_level(logging.INFO, logger="mmalign.policies.vlm"):
        pol = pipeline_policy(random_vlm_dir, tmp_path / "run", **model)
    records = [r for r in caplog.records if r.name == "mmalign.policies.vlm"]
    assert len(records) == 1 and records[0].levelno == level
    assert records[0].getMessage().startswith("shared prefix: off (") and reason in records[0].getMessage()
    assert not pol.shared_prefix
    calls = spy_shared_prefix(pol)
    ro = pol.rollout(mixed_rows()[:1], 2, compute_logp=True)
    pol.model.train()
    pol.action_stats(ro).logp.sum().backward()
    assert calls == []


@pytest.mark.parametrize("shared_prefix", [True, False])
def test_vlm_chunked_logprobs_equal_full_logits(
    random_vlm_dir: Path, tmp_path: Path, shared_prefix: bool, check_chunked_matches_full
) -> None:
    """The chunked log-prob path (final hidden states through the head, 6 tokens at a time) gives the
    full-logits path's log-probs, entropies and parameter gradients, vision placeholders suppressed,
    with the shared-prefix and the plain forward."""
    pol = pipeline_policy(random_vlm_dir, tmp_path / "run", shared_prefix=shared_prefix)
    assert pol.logprob_chunk_size == "auto" and pol.suppressed_ids  # the pipeline default
    torch.manual_seed(0)
    ro = pol.rollout(mixed_rows(), 2, compute_logp=False)
    ro = ro[torch.randperm(len(ro), generator=torch.Generator().manual_seed(1))]
    assert check_chunked_matches_full(pol, ro, 6) > 10


# ----------------------------------------------------------------------------- rollout engine (fake: a vLLM stand-in)
def engine_policy(model_dir: Path, **kw: Any) -> VLMPolicy:
    from mmalign.engines.fake import FakeEngine

    pol = VLMPolicy.from_pretrained(
        str(model_dir), max_new_tokens=6, min_pixels=3136, max_pixels=3136, temperature=0.9, **kw
    )
    pol.engine = FakeEngine(pol.model, processor=pol.processor)
    return pol


def test_engine_samples_images_like_the_trainer_sees_them(random_vlm_dir: Path) -> None:
    """The engine gets each row as token ids with ONE placeholder per image plus the images, and expands
    them itself (as vLLM does); with equal weights its log-probs equal the trainer's recomputation from
    the policy's own processor outputs, for rows with 0, 1 and 2 images of different sizes."""
    from mmalign.engines import MultimodalPrompt

    pol = engine_policy(random_vlm_dir)
    rows = [*mixed_rows(), {"prompt": "No picture here, just text."}]
    prompts = [pol.engine_prompt(r) for r in rows]
    image_token = pol.model.config.image_token_id
    n_images = [len(r.get("images", [])) for r in rows]
    assert any(n == 0 for n in n_images) and any(n > 1 for n in n_images)
    for p, n in zip(prompts, n_images, strict=True):
        ids = p.token_ids if isinstance(p, MultimodalPrompt) else p
        assert ids.count(image_token) == n  # unexpanded: the engine expands
    torch.manual_seed(0)
    ro = pol.rollout(rows, 3, compute_logp=True)
    assert ro.logp_sampler is not None and ro.mask.any()
    torch.testing.assert_close(ro.logp_sampler, ro.logp_old, atol=1e-4, rtol=0)
    # the images matter: an engine that dropped them would sample from another distribution
    blind = [MultimodalPrompt(p.token_ids, []) if isinstance(p, MultimodalPrompt) else p for p in prompts]
    blind = [
        [t for t in (b.token_ids if isinstance(b, MultimodalPrompt) else b) if t != image_token]
        for b in blind
    ]
    from mmalign.engines import SamplingSpec

    spec = SamplingSpec(temperature=0.9, max_new_tokens=6, seed=0, suppress_token_ids=pol.suppressed_ids)
    with_images = pol.engine.generate(prompts, 1, spec)
    without = pol.engine.generate(blind, 1, spec)
    assert with_images[0].token_ids != without[0].token_ids or with_images[0].logprobs != without[0].logprobs


def test_engine_weight_sync_and_seeds(random_vlm_dir: Path) -> None:
    """Changed trainer weights: the engine falls behind until `sync_engine` pushes them (the text policy's
    sync, shared); a fixed engine seed reproduces the samples."""
    pol = engine_policy(random_vlm_dir)
    rows = mixed_rows()[:2]
    pol.engine_seed = 5
    a = pol.rollout(rows, 2)
    b = pol.rollout(rows, 2)
    assert torch.equal(a.payload["completion_ids"], b.payload["completion_ids"])
    with torch.no_grad():
        for n, q in pol.model.named_parameters():
            if "language_model" in n and n.endswith("weight") and q.dim() == 2:
                q.add_(0.05 * torch.randn_like(q))
    stale = pol.rollout(rows, 2)
    assert (stale.logp_sampler - stale.logp_old)[stale.mask].abs().max() > 1e-3
    pol.sync_engine(step=1)
    fresh = pol.rollout(rows, 2)
    torch.testing.assert_close(fresh.logp_sampler, fresh.logp_old, atol=1e-4, rtol=0)


def test_a_text_engine_refuses_images(random_vlm_dir: Path) -> None:
    from mmalign.engines.fake import FakeEngine

    pol = VLMPolicy.from_pretrained(str(random_vlm_dir), max_new_tokens=4, min_pixels=3136, max_pixels=3136)
    pol.engine = FakeEngine(pol.model, pol.tokenizer)  # no processor: text only
    with pytest.raises(ValueError, match="takes no images"):
        pol.rollout(mixed_rows()[:2], 2)


def test_vlm_trains_with_an_engine_and_the_is_correction(random_vlm_dir: Path, tmp_path: Path) -> None:
    """``rollout.engine: fake`` on the vlm_reasoning pipeline: the trainer syncs the engine after every
    optimizer step (IS weights ~1, as for text) and the truncated IS correction is applied."""
    pipelines.names()
    cfg = vlm_cfg(random_vlm_dir, tmp_path / "run", ASSETS / "train.jsonl", min_pixels=3136, max_pixels=3136)
    cfg.rollout.engine = "fake"
    cfg.rollout.is_correction = "token"
    cfg.trainer.steps = 3
    cfg.trainer.lr = 1e-2
    trainer = GroupTrainer(cfg, pipelines.get("vlm_reasoning")(cfg))
    assert trainer.policy.engine is not None and trainer.policy.engine.supports_images
    history = trainer.train()
    for m in history:
        assert m["is/abs_dlogp_mean"] < 1e-4, m
    assert trainer.policy.engine.weight_version >= 3


@pytest.mark.gpu
def test_vllm_vlm_rollout_matches_the_trainer(tmp_path: Path) -> None:
    """Real vLLM on a tiny Qwen2-VL (text heads of 64 dims, which vLLM's attention kernels need): images go
    through vLLM's multimodal inputs with the policy's resize bounds; its log-probs agree with the trainer's
    recomputation before and after a full weight sync."""
    pytest.importorskip("vllm")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from mmalign.engines import get_engine

    torch.manual_seed(0)
    processor = tiny_vlm.tiny_vlm_processor(tiny_vlm._corpus())
    model = tiny_vlm.tiny_vlm(
        processor.tokenizer, hidden_size=128, num_attention_heads=2, num_key_value_heads=1
    )
    model.save_pretrained(tmp_path / "m")
    processor.save_pretrained(tmp_path / "m")
    pol = VLMPolicy.from_pretrained(str(tmp_path / "m"), max_new_tokens=6, min_pixels=3136, max_pixels=3136)
    pol.model.cuda()
    kwargs: dict[str, Any] = dict(
        dtype="float32", gpu_memory_utilization=0.2, enforce_eager=True, max_model_len=512
    )
    kwargs["enable_sleep_mode"] = False

    class _Run:  # what _engine_defaults reads
        class cfg:  # noqa: N801
            class model:  # noqa: N801
                name_or_path = str(tmp_path / "m")

    pol._engine_defaults("vllm", kwargs, _Run)  # type: ignore[arg-type]
    assert kwargs["llm_kwargs"]["mm_processor_kwargs"] == {"min_pixels": 3136, "max_pixels": 3136}
    pol.engine = get_engine("vllm", **kwargs)
    rows = mixed_rows()[:2]
    ro = pol.rollout(rows, 2)
    gap = (ro.logp_sampler - ro.logp_old)[ro.mask].abs().max().item()
    assert gap < 1e-2, gap
    with torch.no_grad():
        for n, q in pol.model.named_parameters():
            if "language_model" in n and q.dim() == 2:
                q.add_(0.02 * torch.randn_like(q))
    pol.sync_engine(step=1)
    ro = pol.rollout(rows, 2)
    gap = (ro.logp_sampler - ro.logp_old)[ro.mask].abs().max().item()
    assert gap < 1e-2, gap
