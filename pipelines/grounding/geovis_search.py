"""GeoViS inference-time tree search: UCT over zoomed views of the image, valued by the model itself.

The search (GeoViS; where the paper is silent the choice is marked "(our design)"):

- a NODE holds a view (`pipelines.grounding.geovis_views.View`; view 0 = the full image). Actions: zoom into one of
  the ``grid`` x ``grid`` (3 x 3) equal cells of the node's region (cells that `check_crop` refuses, too
  small or too thin, are not offered), or zoom out to the view's parent (not from view 0). The same region
  reached twice is the same view (and its value is computed once per search);
- each SIMULATION (``simulations``, 10): SELECT from the root by UCT while the node is fully expanded,
  ``Q_child + c * sqrt(ln N_parent / N_child)`` with Q = mean backed-up value, c = sqrt(2) (our design:
  the paper gives no constant); EXPAND one untried action (in the fixed order cells row-major then zoom
  out; in a random order when ``temperature > 0``); EVALUATE the new node's view; BACKPROPAGATE the value
  (N += 1, W += v on the path, Q = W / N). Nodes at tree depth ``max_depth`` (5 actions from the root)
  are not expanded. The root is evaluated once before the simulations (not counted as one);
- VALUE of a view: ``v = w_qa * r_QA + w_iou * r_IoU`` with 0.1 / 0.9:

  * r_QA: the mean P("yes") over yes/no checks on the crop alone: the object (``YESNO_PROMPT`` on the
    row's ``object`` column), the position (``YESNO_PROMPT`` on ``expression``) and the relation
    (``RELATION_PROMPT`` on ``relation``); a missing / empty column drops its check (our design: the
    templates). With no check at all r_QA is left out and v = r_IoU (our design);
  * r_IoU: IoU, in the crop's own frame, of the model's box for ``BOX_PROMPT`` on the crop alone with the
    CENTRAL box of the crop, [1/3, 2/3] of its width and height (our design: the middle cell of the 3 x 3
    grid), so a view scores high when the target sits in its middle at about a third of its size; no
    parsable box -> 0;

- the BEST VIEW is the tree node with the highest mean value Q among visited nodes; ties go to the deeper
  view (more zoom-ins from view 0), then to the earlier one;
- FINAL BOX: ``final="full_image"`` (the paper): the model gets the full image AND the best crop (two
  images, ``FULL_IMAGE_BOX_PROMPT``) and writes the box in the FIRST image's (view 0's) coordinates;
  ``final="best_crop"`` (our design, for small models): the box the model wrote for the best crop during
  its evaluation (no extra call), mapped to global pixels by the view's affine map. With view 0 as the best
  view both reduce to ``BOX_PROMPT`` on the full image. The box is clipped to the image.

Model calls go through a `SearchOracle` (``yes_probability`` / ``predict_box``); `VLMOracle` implements it
with a `VLMPolicy`, rendering prompts exactly as the policy does. `TreeSearchPolicy` wraps a VLMPolicy as a
`Policy` for ``mmalign eval`` only (training refuses it).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from mmalign.batch import Rollout
from mmalign.policies.base import ActionStats, Policy
from pipelines.grounding.geovis_views import (
    BOX_PROMPT,
    MAX_ASPECT,
    MIN_CROP_PX,
    YESNO_PROMPT,
    Region,
    View,
    check_crop,
    clip_region,
    crop_image,
    grid_cells,
    make_view,
    processor_pixel_bounds,
    resolve_convention,
    view_frame,
    view_to_global,
)
from rewards.boxes import iou, order_box, parse_box

__all__ = [
    "CENTRAL_BOX",
    "FULL_IMAGE_BOX_PROMPT",
    "INFERENCE_ONLY",
    "RELATION_PROMPT",
    "SearchConfig",
    "SearchOracle",
    "SearchResult",
    "TreeSearchPolicy",
    "VLMOracle",
    "format_answer",
    "select_child",
    "tree_search",
    "uct_score",
    "view_depth",
    "yes_no_questions",
]

RELATION_PROMPT = "Is the target {relation} in this image? Answer yes or no."
"""The relation check of r_QA (our design: the paper names the check, not its wording)."""
FULL_IMAGE_BOX_PROMPT = (
    "The second image is a zoomed view of the first. Locate {expression} in the first image. "
    "Answer with <answer>[x1,y1,x2,y2]</answer>."
)
"""The paper's final step: full image + best crop, box in the first image's coordinates (our wording)."""
CENTRAL_BOX = (1 / 3, 1 / 3, 2 / 3, 2 / 3)
"""The central box r_IoU compares with, in fractions of the crop's width / height (our design)."""
INFERENCE_ONLY = "tree search is inference only: use it with `mmalign eval`"
FINALS = ("full_image", "best_crop")


# ============================================================================ oracle
@runtime_checkable
class SearchOracle(Protocol):
    """The model calls of the search. ``convention`` is how `predict_box` boxes are written (a
    `pipelines.grounding.geovis_views.CONVENTIONS` name), relative to the image whose frame the prompt asks for."""

    convention: str

    def yes_probability(self, images: list[Any], question: str) -> float:
        """P("yes") in [0, 1] for a yes/no `question` about `images` (PIL images)."""
        ...

    def predict_box(self, images: list[Any], prompt: str, frame: int = -1) -> Sequence[float] | None:
        """The box the model answers to `prompt`, in the coordinates (``convention``) of ``images[frame]``
        (the last image unless the prompt asks for another); None when no box can be read."""
        ...


def _parse_box(text: str) -> tuple[float, float, float, float] | None:
    box = parse_box(text)
    return None if box is None else tuple(float(v) for v in box)  # type: ignore[return-value]


class VLMOracle:
    """`SearchOracle` backed by a `VLMPolicy`: prompts are rendered by the policy's own `encode_row` /
    `batch_inputs` (its chat template, system prompt and processor), so the search sees the prompts
    training uses.

    - `yes_probability`: one forward; softmax over the next-token logits after the generation prompt
      restricted to the FIRST token of "yes" and of "no": P(yes) = e^l_yes / (e^l_yes + e^l_no);
    - `predict_box`: ``generate`` (greedy when ``temperature`` is 0, else sampled at that temperature;
      ``max_new_tokens`` defaults to the policy's), then `parse_box` (the <answer> box first).

    ``convention``: how the model writes boxes ("resized" by default; a family alias is accepted)."""

    def __init__(
        self,
        policy: Any,
        convention: str = "resized",
        *,
        temperature: float = 0.0,
        max_new_tokens: int | None = None,
    ) -> None:
        self.policy = policy
        self.convention = resolve_convention(convention)
        self.temperature = float(temperature)
        self.max_new_tokens = max_new_tokens
        tok = policy.tokenizer
        self.yes_id = self._first_token(tok, "yes")
        self.no_id = self._first_token(tok, "no")
        if self.yes_id == self.no_id:
            raise ValueError(f"the tokenizer starts 'yes' and 'no' with the same token ({self.yes_id})")
        self.last_text: str | None = None
        """The last `predict_box` completion (for debugging and logs)."""

    @staticmethod
    def _first_token(tokenizer: Any, word: str) -> int:
        ids = tokenizer.encode(word, add_special_tokens=False)
        if not ids:
            raise ValueError(f"the tokenizer encodes {word!r} to no token")
        return int(ids[0])

    def _inputs(self, images: list[Any], text: str) -> dict[str, Tensor]:
        enc = self.policy.encode_row({"prompt": text, "images": list(images)})
        dev = self.policy.device
        return {k: v.to(dev) for k, v in self.policy.batch_inputs([enc]).items()}

    @torch.no_grad()
    def yes_probability(self, images: list[Any], question: str) -> float:
        inputs = self._inputs(images, question)
        logits = self.policy.model(**inputs, logits_to_keep=1, use_cache=False).logits[0, -1].float()
        pair = torch.stack([logits[self.yes_id], logits[self.no_id]])
        return float(torch.softmax(pair, dim=0)[0])

    @torch.no_grad()
    def predict_box(self, images: list[Any], prompt: str, frame: int = -1) -> Sequence[float] | None:
        p = self.policy
        inputs = self._inputs(images, prompt)
        kwargs: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens or p.max_new_tokens,
            "pad_token_id": p.tokenizer.pad_token_id,
            "eos_token_id": p.eos_ids or None,
        }
        if self.temperature > 0:
            kwargs.update(do_sample=True, temperature=self.temperature, top_p=1.0, top_k=0)
        else:
            kwargs["do_sample"] = False
        if p.stop_strings:
            kwargs.update(stop_strings=p.stop_strings, tokenizer=p.tokenizer)
        if p.suppressed_ids:
            kwargs["suppress_tokens"] = p.suppressed_ids
        out = p.model.generate(**inputs, **kwargs)
        new = out[0, inputs["input_ids"].shape[1] :]
        self.last_text = p.tokenizer.decode(new, skip_special_tokens=True)
        return _parse_box(self.last_text)


# ============================================================================ tree
@dataclass
class SearchConfig:
    """Search settings; see the module docstring. ``c``: UCT exploration constant (our design: sqrt 2)."""

    simulations: int = 10
    max_depth: int = 5
    c: float = math.sqrt(2.0)
    grid: int = 3
    w_qa: float = 0.1
    w_iou: float = 0.9
    final: str = "full_image"
    min_crop_px: float = MIN_CROP_PX
    max_aspect: float = MAX_ASPECT
    allow_zoom_out: bool = True

    def __post_init__(self) -> None:
        if self.final not in FINALS:
            raise ValueError(f"search option final={self.final!r}: use one of {list(FINALS)}")
        if self.simulations < 0 or self.max_depth < 0 or self.grid < 1:
            raise ValueError(
                f"search options: simulations ({self.simulations}) and max_depth ({self.max_depth}) must be "
                f">= 0 and grid ({self.grid}) >= 1"
            )


@dataclass
class _Node:
    view: View
    depth: int
    parent: _Node | None = None
    untried: list[Any] = field(default_factory=list)
    children: list[_Node] = field(default_factory=list)
    visits: int = 0
    total: float = 0.0

    @property
    def q(self) -> float:
        return self.total / self.visits if self.visits else 0.0


@dataclass
class SearchResult:
    """What `tree_search` found for one image."""

    views: list[View]
    """Every view evaluated, in order of first visit (view 0 first)."""
    best_view: View
    answer_box: Region | None
    """Global box, ORIGINAL image pixels, clipped to the image; None when the model wrote no box."""
    simulations: int
    depth_reached: int
    """The deepest tree node created (actions from the root)."""
    model_calls: int
    scores: list[dict[str, Any]]
    """Per view: {"view", "value", "r_qa", "r_iou", "visits", "mean"} (visits / mean summed over the tree
    nodes holding the view)."""


def uct_score(child_total: float, child_visits: int, parent_visits: int, c: float) -> float:
    """UCT: ``W/N + c * sqrt(ln N_parent / N)``; +inf for an unvisited child."""
    if child_visits <= 0:
        return math.inf
    return child_total / child_visits + c * math.sqrt(math.log(parent_visits) / child_visits)


def select_child(node: Any, c: float) -> Any:
    """The child of `node` (``.children``, each with ``.total`` / ``.visits``) of highest `uct_score`; ties
    go to the earlier child."""
    best, best_score = None, -math.inf
    for child in node.children:
        s = uct_score(child.total, child.visits, node.visits, c)
        if s > best_score:
            best, best_score = child, s
    return best


def view_depth(view: View, views: dict[int, View]) -> int:
    """Zoom-ins from view 0 to `view` (0 for view 0), following ``parent``."""
    d = 0
    while view.parent is not None:
        view = views[view.parent]
        d += 1
    return d


def yes_no_questions(row: dict[str, Any]) -> list[str]:
    """The r_QA checks for `row`: object, position (expression), relation; empty / missing columns drop out."""
    out = []
    for column, template, key in (
        ("object", YESNO_PROMPT, "expression"),
        ("expression", YESNO_PROMPT, "expression"),
        ("relation", RELATION_PROMPT, "relation"),
    ):
        value = row.get(column)
        if value is not None and str(value).strip():
            out.append(template.format(**{key: str(value).strip()}))
    return out


def tree_search(
    image: Any,
    row: dict[str, Any],
    oracle: SearchOracle,
    config: SearchConfig | None = None,
    *,
    min_pixels: int,
    max_pixels: int,
    factor: int = 28,
    rng: random.Random | None = None,
) -> SearchResult:
    """Run the GeoViS search on the PIL `image` for `row` (``expression``, optional ``object`` /
    ``relation``). `min_pixels` / `max_pixels` / `factor`: the processor's resize bounds (the views'
    ``resized`` sizes). `rng`: shuffles the expansion order when given (``temperature > 0``)."""
    cfg = config or SearchConfig()
    expression = row.get("expression")
    if expression is None or not str(expression).strip():
        raise ValueError(
            f"{row.get('_source', 'row')}: the GeoViS search needs an 'expression' column "
            f"(columns: {sorted(row)})"
        )
    expression = str(expression).strip()
    image_size = image.size
    convention = resolve_convention(oracle.convention)
    questions = yes_no_questions(row)
    root_view = View.root(image_size, min_pixels, max_pixels, factor)
    views: dict[int, View] = {0: root_view}
    by_region: dict[Region, View] = {root_view.region: root_view}
    evals: dict[int, dict[str, Any]] = {}
    calls = 0

    def evaluate(view: View) -> float:
        nonlocal calls
        if view.id in evals:
            return evals[view.id]["value"]
        crop = crop_image(image, view.region)
        probs = [oracle.yes_probability([crop], q) for q in questions]
        calls += len(probs)
        box = oracle.predict_box([crop], BOX_PROMPT.format(expression=expression))
        calls += 1
        box = order_box(box) if box is not None else None
        r_iou = 0.0
        if box is not None:
            fw, fh = view_frame(view, convention)
            frac = (box[0] / fw, box[1] / fh, box[2] / fw, box[3] / fh)
            r_iou = iou(frac, CENTRAL_BOX)
        if probs:
            r_qa = sum(min(max(p, 0.0), 1.0) for p in probs) / len(probs)
            value = cfg.w_qa * r_qa + cfg.w_iou * r_iou
        else:
            r_qa, value = None, r_iou
        evals[view.id] = {"value": value, "r_qa": r_qa, "r_iou": r_iou, "box": box}
        return value

    def actions(view: View) -> list[Any]:
        acts: list[Any] = []
        for cell in grid_cells(view, cfg.grid):
            region = clip_region(cell, image_size)
            if check_crop(region, cfg.min_crop_px, cfg.max_aspect) is None:
                acts.append(region)
        if cfg.allow_zoom_out and view.parent is not None:
            acts.append("out")
        if rng is not None:
            rng.shuffle(acts)
        return acts

    def open_view(action: Any, node: _Node) -> View:
        if action == "out":
            assert node.view.parent is not None
            return views[node.view.parent]
        v = make_view(
            action,
            view_id=len(views),
            parent=node.view.id,
            image_size=image_size,
            min_pixels=min_pixels,
            max_pixels=max_pixels,
            factor=factor,
        )
        known = by_region.get(v.region)
        if known is not None:
            return known
        views[v.id] = v
        by_region[v.region] = v
        return v

    root = _Node(view=root_view, depth=0)
    root.untried = actions(root_view)
    root.visits, root.total = 1, evaluate(root_view)
    nodes = [root]
    depth_reached = 0
    for _ in range(cfg.simulations):
        node, path = root, [root]
        while node.depth < cfg.max_depth and not node.untried and node.children:
            node = select_child(node, cfg.c)
            path.append(node)
        if node.depth < cfg.max_depth and node.untried:
            action = node.untried.pop(0)
            child = _Node(view=open_view(action, node), depth=node.depth + 1, parent=node)
            child.untried = actions(child.view)
            node.children.append(child)
            nodes.append(child)
            path.append(child)
            depth_reached = max(depth_reached, child.depth)
            node = child
        value = evaluate(node.view)
        for n in path:
            n.visits += 1
            n.total += value

    order = list(evals)  # views in order of first evaluation
    rank = {vid: i for i, vid in enumerate(order)}
    best = max(
        nodes,
        key=lambda n: (n.q, view_depth(n.view, views), -rank[n.view.id]),
    )
    best_view = best.view
    if cfg.final == "best_crop" or best_view.id == 0:
        box = evals[best_view.id]["box"]
        global_box = view_to_global(box, best_view, convention) if box is not None else None
    else:
        crop = crop_image(image, best_view.region)
        raw = oracle.predict_box([image, crop], FULL_IMAGE_BOX_PROMPT.format(expression=expression), frame=0)
        calls += 1
        box = order_box(raw) if raw is not None else None
        global_box = view_to_global(box, root_view, convention) if box is not None else None
    if global_box is not None:
        global_box = clip_region(global_box, image_size)
    per_view: dict[int, list[_Node]] = {}
    for n in nodes:
        per_view.setdefault(n.view.id, []).append(n)
    scores = []
    for vid in order:
        held = per_view.get(vid, [])
        visits = sum(n.visits for n in held)
        e = evals[vid]
        scores.append(
            {
                "view": vid,
                "value": e["value"],
                "r_qa": e["r_qa"],
                "r_iou": e["r_iou"],
                "visits": visits,
                "mean": sum(n.total for n in held) / visits if visits else None,
            }
        )
    return SearchResult(
        views=[views[vid] for vid in order],
        best_view=best_view,
        answer_box=global_box,
        simulations=cfg.simulations,
        depth_reached=depth_reached,
        model_calls=calls,
        scores=scores,
    )


def format_answer(box: Sequence[float] | None) -> str:
    """``<answer>[x1, y1, x2, y2]</answer>`` (original pixels, 1 decimal at most); a reply without a box
    (scores 0 with any box reward) when `box` is None."""
    if box is None:
        return "<answer>no box</answer>"
    return "<answer>[" + ", ".join(f"{round(float(v), 1):g}" for v in box) + "]</answer>"


# ============================================================================ policy
def _load_rgb(x: Any) -> Any:
    from PIL import Image

    if isinstance(x, Image.Image):
        return x.convert("RGB")
    with Image.open(x) as im:
        return im.convert("RGB")


class TreeSearchPolicy(Policy):
    """A `VLMPolicy` driven by the GeoViS tree search, for ``mmalign eval`` only.

    `rollout` returns per sample (``outputs``):

    - ``texts``: ``<answer>[x1, y1, x2, y2]</answer>`` with the GLOBAL box in absolute ORIGINAL pixels
      (box rewards must read it with ``coords: absolute``);
    - ``env_state``: {"views": [visited views, `View.to_dict`], "answer_box": [x1,y1,x2,y2] (absent when
      the model wrote no box), "best_view": id, "search": {"simulations", "depth_reached", "model_calls",
      "scores"}};
    - ``num_turns`` Long[B]: the TURNS USED = zoom depth of the chosen view + 1 (the zoom-ins that reach
      it, plus the answer), what a zoom policy would need to answer from that view; ``model_calls``
      Long[B]: the oracle calls the search made.

    ``mask`` is Bool[B,1], all False (no trained actions); ``payload`` is empty. With ``temperature`` 0
    the search is deterministic and the `group_size` samples of a row are copies of one search; with
    ``temperature > 0`` each sample runs its own search, expanding actions in a random order (seeded from
    torch's generator, so ``eval.seed`` fixes it) and sampling the box predictions at that temperature.
    `action_stats` / `reference_logprobs` / `save` raise (``INFERENCE_ONLY``); trainable parameters and
    state are the wrapped policy's, so a trained checkpoint loads into it."""

    def __init__(
        self,
        policy: Any,
        *,
        convention: str = "resized",
        config: SearchConfig | None = None,
        temperature: float = 0.0,
        oracle: SearchOracle | None = None,
        max_new_tokens: int | None = None,
    ) -> None:
        self.policy = policy
        self.model = policy.model
        self.forward_model = policy.model
        self.config = config or SearchConfig()
        self.temperature = float(temperature)
        self.oracle = oracle or VLMOracle(
            policy, convention, temperature=self.temperature, max_new_tokens=max_new_tokens
        )
        processor = getattr(policy, "processor", None)
        if processor is None:
            raise ValueError(
                f"TreeSearchPolicy wraps a VLMPolicy (with a processor), got {type(policy).__name__}"
            )
        self.min_pixels, self.max_pixels, self.factor = processor_pixel_bounds(processor)

    # ------------------------------------------------------------------ rollout
    def _search(self, row: dict[str, Any], rng: random.Random | None) -> SearchResult:
        images = row.get("images", row.get("image"))
        images = images if isinstance(images, list | tuple) else [images]
        if not images or images[0] is None:
            raise ValueError(
                f"{row.get('_source', 'row')}: the GeoViS search needs an image ('images' column)"
            )
        return tree_search(
            _load_rgb(images[0]),
            row,
            self.oracle,
            self.config,
            min_pixels=self.min_pixels,
            max_pixels=self.max_pixels,
            factor=self.factor,
            rng=rng,
        )

    def setup(self, run: Any) -> None:
        """Called by the trainer only: training with the tree search is refused (it has no trained actions)."""
        from mmalign.config import ConfigError

        raise ConfigError(
            f"{run.cfg.source}: key 'options.search': {INFERENCE_ONLY}; train the zoom policy with "
            f"options.search: zoom and compare with the search at evaluation"
        )

    @torch.no_grad()
    def rollout(self, rows: list[dict[str, Any]], group_size: int, *, compute_logp: bool = False) -> Rollout:
        """Search once per row (once per sample when ``temperature > 0``); see the class docstring."""
        if compute_logp:
            raise RuntimeError(INFERENCE_ONLY + " (compute_logp=True asked for log-probs)")
        was_training = self.model.training
        self.model.eval()
        try:
            results: list[SearchResult] = []
            for row in rows:
                if self.temperature > 0:
                    for _ in range(group_size):
                        seed = int(torch.randint(0, 2**31 - 1, (1,)).item())
                        results.append(self._search(row, random.Random(seed)))
                else:
                    results.extend([self._search(row, None)] * group_size)
        finally:
            if was_training:
                self.model.train()
        views_by_result = [{v.id: v for v in r.views} for r in results]
        texts, states, turns = [], [], []
        for r, vmap in zip(results, views_by_result, strict=True):
            texts.append(format_answer(r.answer_box))
            state: dict[str, Any] = {
                "views": [v.to_dict() for v in r.views],
                "best_view": r.best_view.id,
                "search": {
                    "simulations": r.simulations,
                    "depth_reached": r.depth_reached,
                    "model_calls": r.model_calls,
                    "scores": r.scores,
                },
            }
            if r.answer_box is not None:
                state["answer_box"] = [float(v) for v in r.answer_box]
            states.append(state)
            turns.append(view_depth(r.best_view, vmap) + 1)
        prompts = [str(r.get("prompt", r.get("expression", ""))) for r in rows for _ in range(group_size)]
        group = torch.arange(len(rows)).repeat_interleave(group_size)
        columns: dict[str, list[Any]] = {}
        for key in rows[0]:
            columns[key] = [r.get(key) for r in rows for _ in range(group_size)]
        b = len(prompts)
        return Rollout(
            group=group,
            mask=torch.zeros((b, 1), dtype=torch.bool),
            prompts=prompts,
            columns=columns,
            outputs={
                "texts": texts,
                "env_state": states,
                "num_turns": torch.tensor(turns, dtype=torch.long),
                "model_calls": torch.tensor([r.model_calls for r in results], dtype=torch.long),
            },
        )

    def rollout_stats(self, rollout: Rollout) -> dict[str, Tensor]:
        out = {}
        for key, name in (("num_turns", "num_turns/mean"), ("model_calls", "model_calls/mean")):
            value = rollout.outputs.get(key)
            if isinstance(value, Tensor):
                out[name] = value.float()
        return out

    # ------------------------------------------------------------------ refused
    def action_stats(self, rollout: Rollout) -> ActionStats:
        raise RuntimeError(INFERENCE_ONLY)

    def reference_logprobs(self, rollout: Rollout) -> Tensor:
        raise RuntimeError(INFERENCE_ONLY)

    def save(self, path: str | Path) -> None:
        raise RuntimeError(INFERENCE_ONLY + f" (nothing to save to {path}; save the wrapped policy)")

    # ------------------------------------------------------------------ the wrapped policy's weights
    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return self.policy.trainable_parameters()

    def trainable_state_dict(self) -> dict[str, Tensor]:
        return self.policy.trainable_state_dict()

    def load_trainable_state_dict(self, state: dict[str, Tensor]) -> None:
        """Into the wrapped policy: ``mmalign eval`` loads a trained checkpoint this way."""
        self.policy.load_trainable_state_dict(state)

    @property
    def generator(self) -> Any:
        return getattr(self.policy, "generator", None)
