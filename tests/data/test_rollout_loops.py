"""Rollout loops (`mmalign.data.rollout_loops`): multi-turn rollouts with inserted text and images on the tiny
random VLM and the tiny text LM -- log-probs against one independent plain forward, ratio 1, no gradient
from inserted tokens, the shared-prefix path, limits and truncation, config errors -- and ``single_turn``
left as it was."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from mmalign import tiny
from mmalign.algorithms.losses import aggregate
from mmalign.algorithms.losses import get as get_loss
from mmalign.config import ConfigError, load_config
from mmalign.data.rollout_loops import (
    DONE,
    Done,
    Insert,
    MultiTurn,
    Segment,
    SingleTurn,
    TurnContext,
    loop_from_config,
    make_loop,
)
from mmalign.policies.base import RunInfo
from mmalign.policies.text import TextPolicy
from mmalign.policies.vlm import VLMPolicy
from mmalign.tiny import vlm as tiny_vlm

REPO = Path(__file__).resolve().parents[2]
ASSETS = REPO / "assets" / "vlm_reasoning"
TEMPERATURE = 0.7
LOOK = "Look closer."


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "vlm-random"
    tiny.build("vlm_random", path)
    return path


def pictures(n: int, seed: int = 0) -> list[Any]:
    rng = random.Random(seed)
    colours = list(tiny_vlm.COLOURS)
    return [tiny_vlm.draw_shape(colours[i % 4], tiny_vlm.SHAPES[i % 3], rng) for i in range(n)]


def crop_of(image: Any) -> Any:
    """The zoomed top-left quarter of `image` (what a visual-search tool would return)."""
    w, h = image.size
    return image.crop((0, 0, w // 2, h // 2)).resize((w, h))


def vlm_rows() -> list[dict[str, Any]]:
    a, b, c = pictures(3)
    return [
        {"prompt": "What colour is the shape?", "images": [a], "answer": "red"},
        # the second sample of this group stops after one turn: ragged completion regions
        {"prompt": "Two pictures. Which colour is in the second one?", "images": [b, c], "stop_early": True},
    ]


class ZoomEnv:
    """Turn 0: insert a zoomed crop of the row's first image and a line of text; then done."""

    def __init__(self) -> None:
        self.calls: list[TurnContext] = []

    def __call__(self, ctx: TurnContext) -> Done | Insert:
        self.calls.append(ctx)
        if ctx.turn == 0 and not (ctx.row.get("stop_early") and ctx.group_index == 1):
            return Insert(text=LOOK, images=[crop_of(ctx.row["images"][0])])
        return DONE


def vlm_policy(vlm_dir: Path, env: Any, **kw: Any) -> VLMPolicy:
    return VLMPolicy.from_pretrained(
        str(vlm_dir),
        max_new_tokens=5,
        temperature=TEMPERATURE,
        min_pixels=3136,
        max_pixels=3136,
        loop="multi_turn",
        loop_kwargs={"max_turns": 3},
        environment=env,
        **kw,
    )


@pytest.fixture(scope="module")
def vlm_multi(vlm_dir: Path) -> tuple[VLMPolicy, Any, ZoomEnv]:
    env = ZoomEnv()
    pol = vlm_policy(vlm_dir, env)
    assert pol.shared_prefix  # logp_old below comes from the shared-prefix path
    torch.manual_seed(0)
    ro = pol.rollout(vlm_rows(), 2, compute_logp=True)
    return pol, ro, env


def runs(ro: Any, i: int) -> list[tuple[int, int, bool]]:
    """(start, end, trained) of each segment of sample i's completion region (generated vs inserted)."""
    att = ro.payload["completion_attention_mask"][i].bool().tolist()
    mask = ro.mask[i].tolist()
    out: list[tuple[int, int, bool]] = []
    for j, (a, m) in enumerate(zip(att, mask, strict=True)):
        if not a:
            break
        if out and out[-1][2] == m:
            out[-1] = (out[-1][0], j + 1, m)
        else:
            out.append((j, j + 1, m))
    return out


def expected_insert(tok: Any, previous_last_id: int, body: str) -> str:
    """The tiny VLM template's text after an assistant turn: close it (unless it ended with <|im_end|>),
    the user message, then the opening of the next assistant turn -- written out by hand."""
    closing = "\n" if previous_last_id == tok.convert_tokens_to_ids(tiny_vlm.IM_END) else "<|im_end|>\n"
    return closing + body + "<|im_start|>assistant\n"


def vlm_reference_logp(pol: VLMPolicy, row: dict[str, Any], ro: Any, i: int) -> torch.Tensor:
    """Per-token log-probs of sample i's completion region from ONE plain forward of the model over the
    whole sequence, built here with the processor and the chat template (not with the policy's code)."""
    proc, tok = pol.processor, pol.tokenizer
    images = list(row["images"])
    msgs = [
        {
            "role": "user",
            "content": [*({"type": "image"} for _ in images), {"type": "text", "text": row["prompt"]}],
        }
    ]
    prompt_text = proc.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    enc = proc(text=[prompt_text], images=images, return_tensors="pt")
    ids, types = [enc["input_ids"][0]], [enc["mm_token_type_ids"][0]]
    pixels, grids = [enc["pixel_values"]], [enc["image_grid_thw"]]
    comp = ro.payload["completion_ids"][i]
    for start, end, trained in runs(ro, i):
        if trained:
            ids.append(comp[start:end])
            types.append(torch.zeros(end - start, dtype=torch.long))
            continue
        body = f"<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{LOOK}<|im_end|>\n"
        text = expected_insert(tok, int(comp[start - 1]), body)
        ins = proc(text=[text], images=[crop_of(images[0])], return_tensors="pt", add_special_tokens=False)
        assert torch.equal(ins["input_ids"][0], comp[start:end])  # the policy inserted exactly this
        ids.append(ins["input_ids"][0])
        types.append(ins["mm_token_type_ids"][0])
        pixels.append(ins["pixel_values"])
        grids.append(ins["image_grid_thw"])
    full = torch.cat(ids)
    with torch.no_grad():
        logits = pol.model(
            input_ids=full[None],
            mm_token_type_ids=torch.cat(types)[None],
            pixel_values=torch.cat(pixels),
            image_grid_thw=torch.cat(grids),
        ).logits[0]
    logits[:, pol.suppressed_ids] = float("-inf")
    logp = torch.log_softmax(logits.float() / TEMPERATURE, dim=-1)
    p = enc["input_ids"].shape[1]
    n = full.shape[0] - p
    return logp[p - 1 : -1].gather(-1, full[p:, None]).squeeze(-1)[:n]


# ----------------------------------------------------------------------------- VLM, two turns with an image


def test_vlm_two_turns_layout_and_environment_calls(vlm_multi: tuple[VLMPolicy, Any, ZoomEnv]) -> None:
    pol, ro, env = vlm_multi
    p = ro.payload
    image_id = pol.processor.image_token_id
    assert ro.outputs["num_turns"].tolist() == [2, 2, 2, 1]
    assert ro.outputs["stop_reasons"] == ["done"] * 4
    assert p["num_prompt_images"].tolist() == [1, 1, 2, 2]
    for i in range(4):
        segs = runs(ro, i)
        assert [s[2] for s in segs] == ([True, False, True] if i < 3 else [True])
        grid = p["image_grid_thw"][i]
        n_images = int(p["num_prompt_images"][i]) + (1 if i < 3 else 0)
        assert grid.shape[0] == n_images and p["pixel_values"][i].shape[0] == int(grid.prod(-1).sum())
        comp_images = p["completion_ids"][i] == image_id
        # the inserted image's tokens: attended, typed as image, never trained
        assert int(comp_images.sum()) == (4 if i < 3 else 0)  # a 56x56 picture is 2x2 merged tokens
        assert bool(p["completion_mm_token_type_ids"][i][comp_images].eq(1).all())
        assert not bool(ro.mask[i][comp_images].any())
        assert bool(p["completion_attention_mask"][i][comp_images].eq(1).all())
        turns = [p["completion_ids"][i][s:e].tolist() for s, e, t in segs if t]
        assert ro.outputs["turns"][i] == [pol.tokenizer.decode(t, skip_special_tokens=True) for t in turns]
        assert ro.outputs["inserted_texts"][i] == ([LOOK] if i < 3 else [])
        n = int(p["completion_attention_mask"][i].sum())
        assert ro.outputs["texts"][i] == pol.tokenizer.decode(
            p["completion_ids"][i][:n], skip_special_tokens=True
        )
        assert ro.outputs["num_tokens"][i] == ro.mask[i].sum()
        assert not p["completion_attention_mask"][i][n:].any() and not ro.mask[i][n:].any()
    # the environment saw every turn: its text, the row, which sample
    assert [(c.sample_index, c.turn) for c in env.calls] == [
        (0, 0),
        (1, 0),
        (2, 0),
        (3, 0),
        (0, 1),
        (1, 1),
        (2, 1),
    ]
    for c in env.calls:
        assert c.text == ro.outputs["turns"][c.sample_index][c.turn]
        assert list(c.turns) == ro.outputs["turns"][c.sample_index][: c.turn + 1]
        assert list(c.inserted_texts) == [LOOK] * c.turn
        assert c.row["prompt"] == ro.prompts[c.sample_index]
    assert bool((ro.logp_old[~ro.mask] == 0).all()) and bool(torch.isfinite(ro.logp_old).all())
    stats = pol.rollout_stats(ro)
    assert stats["num_turns/mean"].tolist() == [2, 2, 2, 1]
    assert torch.equal(stats["completion_len/mean"], ro.mask.sum(1).float())


def test_vlm_multi_turn_logprobs_equal_one_plain_forward(vlm_multi: tuple[VLMPolicy, Any, ZoomEnv]) -> None:
    """logp_old (shared-prefix path, batched, padded) equals, on every generated token of both turns, the
    log-probs of one plain forward over the sample's whole sequence (prompt image, turn 1, inserted crop and
    text, turn 2) built independently with the processor."""
    pol, ro, _ = vlm_multi
    rows = vlm_rows()
    for i in range(len(ro)):
        ref = vlm_reference_logp(pol, rows[i // 2], ro, i)
        n = ref.shape[0]
        m = ro.mask[i, :n]
        assert not ro.mask[i, n:].any()
        torch.testing.assert_close(ro.logp_old[i, :n][m], ref[m], atol=1e-5, rtol=0)


def test_vlm_multi_turn_ratio_is_one_and_slices(vlm_multi: tuple[VLMPolicy, Any, ZoomEnv]) -> None:
    pol, ro, _ = vlm_multi
    stats = pol.action_stats(ro)
    assert stats.logp.requires_grad
    torch.testing.assert_close(stats.logp.detach(), ro.logp_old, atol=1e-6, rtol=0)
    idx = [3, 0, 2]  # a reordered minibatch: per-sample image lists are re-joined in the new order
    torch.testing.assert_close(pol.action_stats(ro[idx]).logp.detach(), ro.logp_old[idx], atol=1e-6, rtol=0)


def test_vlm_second_turn_sees_the_inserted_image(vlm_multi: tuple[VLMPolicy, Any, ZoomEnv]) -> None:
    """Replacing the inserted crop's pixels changes the second turn's log-probs, not the first turn's."""
    pol, ro, _ = vlm_multi
    sub = ro[[0, 1]]
    for i in range(2):
        k = int(sub.payload["num_prompt_images"][i])
        grid = sub.payload["image_grid_thw"][i]
        rows = int(grid[:k].prod(-1).sum())
        pix = sub.payload["pixel_values"][i].clone()
        pix[rows:] = torch.randn_like(pix[rows:])
        sub.payload["pixel_values"] = list(sub.payload["pixel_values"])
        sub.payload["pixel_values"][i] = pix
    with torch.no_grad():
        other = pol.action_stats(sub).logp
    for i in range(2):
        (s1, e1, _), _, (s2, e2, _) = runs(sub, i)
        torch.testing.assert_close(other[i, s1:e1], ro.logp_old[i, s1:e1], atol=1e-6, rtol=0)
        assert (other[i, s2:e2] - ro.logp_old[i, s2:e2]).abs().max() > 1e-4


@pytest.mark.parametrize("shared", [True, False])
def test_vlm_inserted_tokens_get_no_gradient(vlm_multi: tuple[VLMPolicy, Any, ZoomEnv], shared: bool) -> None:
    """Through the trainer's loss (ppo_clip + token_mean on ``rollout.mask``): the gradient w.r.t. the
    logits at every position that predicts an inserted token is exactly 0, and perturbing the inserted
    positions' log-probs leaves the loss unchanged."""
    pol, ro, _ = vlm_multi
    seen: list[torch.Tensor] = []

    def keep(_module: Any, _inp: Any, out: torch.Tensor) -> None:
        out.retain_grad()
        seen.append(out)

    handle = pol.model.lm_head.register_forward_hook(keep)
    old_shared, old_chunk = pol.shared_prefix, pol.logprob_chunk_size
    pol.shared_prefix = shared
    pol.logprob_chunk_size = None  # the full-logits path: [B, T, V] logits whose gradient can be read
    try:
        logp = pol.action_stats(ro).logp
    finally:
        pol.shared_prefix, pol.logprob_chunk_size = old_shared, old_chunk
        handle.remove()
    adv = torch.tensor([1.0, -0.5, 2.0, -1.0])

    def loss_of(lp: torch.Tensor) -> torch.Tensor:
        out = get_loss("ppo_clip")(lp, ro.logp_old, adv, ro.mask)
        return aggregate(out.per_token, ro.mask, "token_mean")

    inserted = ro.payload["completion_attention_mask"].bool() & ~ro.mask
    assert inserted.any()
    loss = loss_of(logp)
    perturbed = logp + inserted.float() * torch.randn_like(logp) * 3.0
    assert torch.equal(loss_of(perturbed), loss)
    loss.backward()
    t = ro.mask.shape[1]
    if shared:  # prefix pass: [U, 1, V] predicts the first completion token; completion pass [B, T, V]
        prefix, completion = seen
        assert prefix.grad is not None and completion.grad is not None
        grad = completion.grad[:, :-1]  # position j predicts completion token j + 1
        assert bool(torch.isfinite(completion.grad).all())
        assert bool((grad[inserted[:, 1:]] == 0).all())
    else:
        (out,) = seen
        grad = out.grad[:, -t - 1 : -1]  # predicts completion token j
        assert bool(torch.isfinite(out.grad).all())
        assert bool((grad[inserted] == 0).all())
        assert bool((grad[ro.mask].abs().sum(-1) > 0).all())  # and the generated ones do get gradient
    pol.model.zero_grad(set_to_none=True)


def test_vlm_chunked_logprobs_never_score_inserted_tokens(vlm_multi: tuple[VLMPolicy, Any, ZoomEnv]) -> None:
    """The chunked path sends only the generated (trained) tokens through the output head: the rows it
    scores are exactly ``rollout.mask``'s, so inserted observation tokens get no log-prob and no gradient;
    and its log-probs equal the full path's."""
    pol, ro, _ = vlm_multi
    rows: list[int] = []
    handle = pol.model.lm_head.register_forward_hook(
        lambda _m, inp, _o: rows.append(inp[0].shape[0]) if inp[0].dim() == 2 else None
    )
    old_chunk = pol.logprob_chunk_size
    try:
        pol.logprob_chunk_size = 5
        with torch.no_grad():
            chunked = pol.action_stats(ro).logp
        pol.logprob_chunk_size = None
        with torch.no_grad():
            full = pol.action_stats(ro).logp
    finally:
        pol.logprob_chunk_size = old_chunk
        handle.remove()
    inserted = ro.payload["completion_attention_mask"].bool() & ~ro.mask
    assert inserted.any()
    n = int(ro.mask.sum())
    assert sum(rows[: -(-n // 5)]) == n and max(rows) <= 5
    torch.testing.assert_close(chunked, full, atol=1e-5, rtol=0)
    assert bool((chunked[inserted] == 0).all())


def test_vlm_multi_turn_shared_prefix_equals_plain_forward(
    vlm_multi: tuple[VLMPolicy, Any, ZoomEnv], check_shared_prefix_matches_plain: Any
) -> None:
    """A multi-turn batch (inserted images in the completion region, ragged lengths, groups scattered by a
    shuffle): the shared-prefix path gives the plain forward's log-probs and parameter gradients."""
    pol, ro, _ = vlm_multi
    shuffled = ro[torch.randperm(len(ro), generator=torch.Generator().manual_seed(1))]
    try:
        check_shared_prefix_matches_plain(pol, shuffled)
    finally:
        pol.shared_prefix = True
        pol.model.zero_grad(set_to_none=True)


def test_vlm_insert_text_follows_the_chat_template(vlm_dir: Path) -> None:
    pol = vlm_policy(vlm_dir, ZoomEnv())
    tok = pol.tokenizer
    im_end = tok.convert_tokens_to_ids(tiny_vlm.IM_END)
    ended = Segment(ids=[5, im_end], trained=True, text="x")
    cut = Segment(ids=[5, 6], trained=True, text="x", finished=False)
    body = "<|im_start|>tool\n<|vision_start|><|image_pad|><|vision_end|><|vision_start|><|image_pad|><|vision_end|>hi<|im_end|>\n"
    two = Insert(text="hi", images=pictures(2), role="tool")
    assert pol.insert_text(two, ended) == "\n" + body + "<|im_start|>assistant\n"
    assert pol.insert_text(two, cut) == "<|im_end|>\n" + body + "<|im_start|>assistant\n"
    assert pol.insert_text(Insert(text=" raw", role=None), ended) == " raw"
    with pytest.raises(ValueError, match="needs a chat role"):
        pol.insert_text(Insert(text="x", images=pictures(1), role=None), ended)


# ----------------------------------------------------------------------------- text policy


def text_env(ctx: TurnContext) -> Done | Insert:
    """Odd samples stop after one turn; the others get two tool answers (module-level: importable by path)."""
    if ctx.group_index % 2 == 1 or ctx.turn >= 2:
        return DONE
    return Insert(text=f"Tool says {ctx.turn}.")


PROMPTS = ["Q: 1 + 2 = ?\nA:", "hello"]


@pytest.fixture(scope="module")
def text_multi(random_text_model_dir: Path) -> tuple[TextPolicy, Any]:
    pol = TextPolicy.from_pretrained(
        str(random_text_model_dir),
        max_new_tokens=5,
        temperature=TEMPERATURE,
        use_chat_template=True,
        loop="multi_turn",
        loop_kwargs={"max_turns": 3},
        environment=text_env,
    )
    torch.manual_seed(0)
    return pol, pol.rollout([{"prompt": p} for p in PROMPTS], 4, compute_logp=True)


def test_text_multi_turn_logprobs_equal_one_plain_forward(text_multi: tuple[TextPolicy, Any]) -> None:
    pol, ro = text_multi
    tok = pol.tokenizer
    assert ro.outputs["num_turns"].tolist() == [3, 1] * 4
    for i in range(len(ro)):
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": PROMPTS[i // 4]}], tokenize=False, add_generation_prompt=True
        )
        ids = [torch.tensor(tok(prompt, add_special_tokens=False)["input_ids"])]
        comp = ro.payload["completion_ids"][i]
        k = 0
        for s, e, trained in runs(ro, i):
            if not trained:  # closing "\n" of the assistant turn, the user message, the next assistant turn
                text = f"\n<|user|>Tool says {k}.\n<|assistant|>"
                assert comp[s:e].tolist() == tok(text, add_special_tokens=False)["input_ids"]
                k += 1
            ids.append(comp[s:e])
        full = torch.cat(ids)
        with torch.no_grad():
            logits = pol.model(input_ids=full[None]).logits[0]
        p = ids[0].shape[0]
        ref = torch.log_softmax(logits / TEMPERATURE, -1)[p - 1 : -1].gather(-1, full[p:, None]).squeeze(-1)
        n = ref.shape[0]
        m = ro.mask[i, :n]
        torch.testing.assert_close(ro.logp_old[i, :n][m], ref[m], atol=1e-5, rtol=0)
        assert ro.outputs["inserted_texts"][i] == [f"Tool says {j}." for j in range(k)]
    torch.testing.assert_close(pol.action_stats(ro).logp.detach(), ro.logp_old, atol=1e-6, rtol=0)


def test_text_multi_turn_shared_prefix_equals_plain_forward(
    text_multi: tuple[TextPolicy, Any], check_shared_prefix_matches_plain: Any
) -> None:
    pol, ro = text_multi
    try:
        check_shared_prefix_matches_plain(
            pol, ro[torch.randperm(len(ro), generator=torch.Generator().manual_seed(3))]
        )
    finally:
        pol.shared_prefix = True
        pol.model.zero_grad(set_to_none=True)


def always_insert(ctx: TurnContext) -> Insert:
    return Insert(text=" Tool: ok.", role=None)


def _text_policy(path: Path, **loop_kwargs: Any) -> TextPolicy:
    return TextPolicy.from_pretrained(
        str(path), max_new_tokens=4, loop="multi_turn", loop_kwargs=loop_kwargs, environment=always_insert
    )


def test_limits_and_truncation(random_text_model_dir: Path) -> None:
    rows = [{"prompt": p} for p in PROMPTS]
    n_ins = len(
        _text_policy(random_text_model_dir).tokenizer(" Tool: ok.", add_special_tokens=False)["input_ids"]
    )

    ro = _text_policy(random_text_model_dir, max_turns=2).rollout(rows, 2, compute_logp=False)
    assert ro.outputs["stop_reasons"] == ["max_turns"] * 4 and ro.outputs["truncated"].all()
    assert ro.outputs["num_turns"].tolist() == [2] * 4
    assert (ro.outputs["num_inserted_tokens"] == n_ins).all()

    # room for the insertion and 2 more tokens: the second turn gets a budget of 2
    cap = 4 + n_ins + 2
    ro = _text_policy(random_text_model_dir, max_turns=5, max_completion_tokens=cap).rollout(
        rows, 2, compute_logp=False
    )
    assert (ro.payload["completion_attention_mask"].sum(1) <= cap).all()
    assert all(len(t) >= 2 for t in ro.outputs["turns"]) and ro.outputs["truncated"].all()
    for i in range(4):
        first, _, second = runs(ro, i)[:3]
        assert second[1] - second[0] <= min(4, cap - (first[1] - first[0]) - n_ins)
    assert set(ro.outputs["stop_reasons"]) <= {"max_completion_tokens", "max_turns"}

    # no insertion fits with room for one more generated token
    ro = _text_policy(random_text_model_dir, max_completion_tokens=n_ins + 1).rollout(
        rows, 2, compute_logp=False
    )
    assert ro.outputs["num_turns"].tolist() == [1] * 4
    assert ro.outputs["stop_reasons"] == ["max_completion_tokens"] * 4 and ro.outputs["truncated"].all()

    ro = _text_policy(random_text_model_dir, max_insert_tokens=n_ins - 1).rollout(rows, 2, compute_logp=False)
    assert (
        ro.outputs["stop_reasons"] == ["insert_too_long"] * 4 and ro.outputs["num_turns"].tolist() == [1] * 4
    )

    torch.manual_seed(0)
    ro = _text_policy(random_text_model_dir, max_turns=2, reward_text="last_turn").rollout(
        rows, 2, compute_logp=False
    )
    assert ro.outputs["texts"] == [t[-1] for t in ro.outputs["turns"]]


def test_environment_errors(random_text_model_dir: Path) -> None:
    rows = [{"prompt": "hello"}]
    bad = TextPolicy.from_pretrained(
        str(random_text_model_dir), max_new_tokens=2, loop="multi_turn", environment=lambda ctx: None
    )
    with pytest.raises(TypeError, match="returned NoneType on sample 0 .turn 0.; it must return"):
        bad.rollout(rows, 1)

    def broken(ctx: TurnContext) -> Insert:
        raise KeyError("tool")

    pol = TextPolicy.from_pretrained(
        str(random_text_model_dir), max_new_tokens=2, loop="multi_turn", environment=broken
    )
    with pytest.raises(RuntimeError, match="broken failed on sample 0 .turn 0.: KeyError"):
        pol.rollout(rows, 1)
    images = TextPolicy.from_pretrained(
        str(random_text_model_dir),
        max_new_tokens=2,
        use_chat_template=True,
        loop="multi_turn",
        environment=lambda ctx: Insert(text="x", images=pictures(1)),
    )
    with pytest.raises(ValueError, match="cannot insert images"):
        images.rollout(rows, 1)
    with pytest.raises(ValueError, match="needs an environment"):
        make_loop("multi_turn")
    with pytest.raises(ValueError, match="'max_turns' must be an integer >= 1"):
        make_loop("multi_turn", environment=text_env, max_turns=0)


# ----------------------------------------------------------------------------- config


def text_cfg(*overrides: str) -> Any:
    return load_config(REPO / "configs" / "text_reasoning-tiny.yaml", list(overrides))


def test_loop_from_config() -> None:
    assert isinstance(loop_from_config(text_cfg()), SingleTurn)
    with pytest.raises(
        ConfigError, match=r"key 'rollout.loop': unknown rollout loop 'multi_trun'. Did you mean 'multi_turn'"
    ):
        loop_from_config(text_cfg("rollout.loop=multi_trun"))
    with pytest.raises(
        ConfigError, match=r"key 'rollout.loop': 'multi_turn' needs an environment .* 'text_reasoning'"
    ):
        loop_from_config(text_cfg("rollout.loop=multi_turn"))
    loop = loop_from_config(text_cfg("rollout.loop=multi_turn"), environment=text_env)
    assert isinstance(loop, MultiTurn) and loop.environment is text_env and loop.max_turns == 4
    with pytest.raises(
        ConfigError,
        match=r"key 'rollout.loop_kwargs': rollout loop 'multi_turn' got unknown option\(s\) 'max_turn'",
    ):
        loop_from_config(
            text_cfg("rollout.loop=multi_turn", "rollout.loop_kwargs.max_turn=3"), environment=text_env
        )
    named = loop_from_config(
        text_cfg(
            "rollout.loop=multi_turn",
            f"rollout.loop_kwargs.environment={__name__}:text_env",
            "rollout.loop_kwargs.max_turns=2",
        )
    )
    assert isinstance(named, MultiTurn) and named.environment is text_env and named.max_turns == 2
    with pytest.raises(ConfigError, match=r"key 'rollout.loop_kwargs.environment': cannot import"):
        loop_from_config(
            text_cfg("rollout.loop=multi_turn", f"rollout.loop_kwargs.environment={__name__}:nope")
        )


def test_pipeline_fails_before_loading_the_model(tmp_path: Path) -> None:
    from pipelines.text_reasoning import build_text_policy

    cfg = text_cfg("rollout.loop=multi_turn", f"model.name_or_path={tmp_path / 'absent'}")
    with pytest.raises(ConfigError, match="needs an environment"):
        build_text_policy(cfg)
    assert not (tmp_path / "absent").exists()


def test_text_multi_turn_samples_each_turn_with_the_engine(random_text_model_dir: Path) -> None:
    """``rollout.engine: fake`` with the multi_turn loop: each turn is ONE engine call over the active
    conversations' whole token sequences (prompt + turns + insertions); the engine's log-probs land on the
    generated tokens only (``logp_sampler``, 0 on inserted tokens) and equal the trainer's re-scoring
    (``logp_old``) and an independent plain forward; the engine sleeps once sampling is done."""
    pol = TextPolicy.from_pretrained(
        str(random_text_model_dir),
        max_new_tokens=5,
        temperature=TEMPERATURE,
        use_chat_template=True,
        loop="multi_turn",
        loop_kwargs={"max_turns": 3},
        environment=text_env,
    )
    pol.setup(RunInfo(cfg=text_cfg("rollout.engine=fake"), accelerator=None))
    engine = pol.engine
    seen: list[list[list[int]]] = []
    generate = engine.generate

    def recording(prompts: Any, n: int, spec: Any) -> Any:
        seen.append([list(p) for p in prompts])
        return generate(prompts, n, spec)

    engine.generate = recording  # type: ignore[method-assign]
    pol.on_train_step(0)
    ro = pol.rollout([{"prompt": p} for p in PROMPTS], 4, compute_logp=False)
    assert [len(x) for x in seen] == [8, 4, 4]  # odd samples stop after turn 0
    assert [c[0] for c in engine.calls[-4:]] == ["generate", "generate", "generate", "sleep"]
    assert engine.asleep
    for i in range(0, len(ro), 2):  # the 3-turn samples: turn k's engine prompt is the sequence so far
        prompt = pol._prompt_token_ids(PROMPTS[i // 4])
        n = int(ro.payload["completion_attention_mask"][i].sum())
        full = prompt + ro.payload["completion_ids"][i, :n].tolist()
        starts = [s for s, _, trained in runs(ro, i) if trained]
        assert [seen[k][i // 2 if k else i] for k in range(3)] == [full[: len(prompt) + s] for s in starts]
    assert ro.logp_sampler is not None and ro.logp_old is not None
    assert torch.all(ro.logp_sampler[~ro.mask] == 0) and torch.all(ro.logp_sampler[ro.mask] < 0)
    torch.testing.assert_close(ro.logp_sampler, ro.logp_old, atol=1e-5, rtol=0)
    for i in range(len(ro)):  # an independent reference: one plain forward over prompt + completion region
        prompt = pol._prompt_token_ids(PROMPTS[i // 4])
        n = int(ro.payload["completion_attention_mask"][i].sum())
        full = torch.tensor(prompt + ro.payload["completion_ids"][i, :n].tolist())
        with torch.no_grad():
            logits = pol.model(input_ids=full[None]).logits[0]
        p = len(prompt)
        ref = torch.log_softmax(logits / TEMPERATURE, -1)[p - 1 : -1].gather(-1, full[p:, None]).squeeze(-1)
        m = ro.mask[i, :n]
        torch.testing.assert_close(ro.logp_sampler[i, :n][m], ref[m], atol=1e-5, rtol=0)
    assert ro.outputs["inserted_texts"][0] == ["Tool says 0.", "Tool says 1."]


def test_vlm_multi_turn_samples_each_turn_with_the_engine(vlm_dir: Path) -> None:
    """A VLM with ``rollout.engine: fake``: the engine's prompt for turn 1 holds the prompt's images AND the
    inserted crop, each as ONE placeholder (runs of image tokens collapsed, the engine expands them again);
    its log-probs of the generated tokens equal the trainer's re-scoring, inserted image tokens get none."""
    from mmalign.engines import MultimodalPrompt

    pol = vlm_policy(vlm_dir, ZoomEnv())
    pol.setup(RunInfo(cfg=text_cfg("rollout.engine=fake"), accelerator=None))
    seen: list[list[Any]] = []
    generate = pol.engine.generate

    def recording(prompts: Any, n: int, spec: Any) -> Any:
        seen.append(list(prompts))
        return generate(prompts, n, spec)

    pol.engine.generate = recording  # type: ignore[method-assign]
    pol.on_train_step(0)
    ro = pol.rollout(vlm_rows(), 2, compute_logp=False)
    image_token = pol.model.config.image_token_id
    assert [len(x) for x in seen[:2]] == [4, 3]  # sample 3 stops after turn 0
    for i, prompt in enumerate(seen[1]):  # samples 0, 1, 2 (the active ones keep their order)
        assert isinstance(prompt, MultimodalPrompt)
        n_images = len(vlm_rows()[i // 2]["images"]) + 1  # the prompt's images + the crop
        assert len(prompt.images) == n_images and prompt.token_ids.count(image_token) == n_images
    assert ro.payload["completion_mm_token_type_ids"][ro.mask].sum() == 0
    inserted = ro.payload["completion_mm_token_type_ids"].bool()
    assert inserted.any() and torch.all(ro.logp_sampler[inserted] == 0)
    assert torch.all(ro.logp_sampler[~ro.mask] == 0)
    torch.testing.assert_close(ro.logp_sampler, ro.logp_old, atol=1e-5, rtol=0)
    assert pol.engine.asleep


# ----------------------------------------------------------------------------- single_turn is unchanged


def _same(a: Any, b: Any) -> None:
    assert torch.equal(a.mask, b.mask) and torch.equal(a.logp_old, b.logp_old)
    assert a.outputs["texts"] == b.outputs["texts"]
    assert a.payload.keys() == b.payload.keys()
    for k, v in a.payload.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, b.payload[k]), k


def test_single_turn_is_the_plain_rollout(random_text_model_dir: Path, vlm_dir: Path) -> None:
    """The default loop is `single_turn`; it IS `single_turn_rollout` (same draws, bit for bit); the payload's
    attention mask equals the loss mask; and log-probs are bit-identical to re-scoring with the loss mask as
    attention (the payload without ``completion_attention_mask``, as before it existed)."""
    text = TextPolicy.from_pretrained(str(random_text_model_dir), max_new_tokens=6)
    vlm = VLMPolicy.from_pretrained(str(vlm_dir), max_new_tokens=6, min_pixels=3136, max_pixels=3136)
    cases = [(text, [{"prompt": p} for p in PROMPTS]), (vlm, vlm_rows())]
    for pol, rows in cases:
        assert isinstance(pol.loop, SingleTurn)
        torch.manual_seed(0)
        a = pol.rollout(rows, 3, compute_logp=True)
        torch.manual_seed(0)
        b = pol.single_turn_rollout(rows, 3, compute_logp=True)
        _same(a, b)
        assert torch.equal(a.payload["completion_attention_mask"], a.mask.long())
        assert "turns" not in a.outputs and "num_prompt_images" not in a.payload
        legacy = a[list(range(len(a)))]
        del legacy.payload["completion_attention_mask"]
        for shared in (True, False):
            pol.shared_prefix = shared
            with torch.no_grad():
                assert torch.equal(pol.action_stats(legacy).logp, pol.action_stats(a).logp)
