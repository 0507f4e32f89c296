"""GeoViS inference-time tree search: UCT over zoomed views of the image, valued by the model itself.

A node holds a view (`geovis_views.View`, view 0 = the full image); its actions zoom into one of the
``grid`` x ``grid`` cells `check_crop` accepts, or out to the parent view. Each simulation selects by UCT
(c = sqrt 2, our design), expands one untried action (not at ``max_depth``), evaluates the view
(``w_qa * r_QA + w_iou * r_IoU``, see `_Search.evaluate`) and backs the value up. The best view (highest
mean value) gives the final box (`_Search.final_box`). "(our design)" marks choices the paper leaves open.
The model is shown every view at its own pixel bounds (`geovis_views.ViewPixels`: view 0 at the root
bounds, crops at the crop bounds) through `geovis_views.view_image`. Model calls go through a
`SearchOracle` (`VLMOracle` wraps a `VLMPolicy`); `TreeSearchPolicy` serves the search as a `Policy` for
``mmalign eval`` only.
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

from mmalign.data.batch import Rollout
from mmalign.data.media import load_rgb
from mmalign.policies.base import ActionStats, Policy
from pipelines.grounding.geovis_views import (
    BOX_PROMPT,
    MAX_ASPECT,
    MIN_CROP_PX,
    PRESIZED,
    YESNO_PROMPT,
    Region,
    View,
    ViewPixels,
    check_crop,
    clip_region,
    grid_cells,
    make_view,
    processor_pixel_bounds,
    resolve_convention,
    view_frame,
    view_image,
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
    """The model calls of the search. The images are views as the model sees them (`view_image`: cut from
    the original and resized to the view's ``resized`` size). ``convention`` is how `predict_box` boxes are
    written (a `pipelines.grounding.geovis_views.CONVENTIONS` name), relative to the view whose frame the
    prompt asks for ("resized": the given image's pixels)."""

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
    """`SearchOracle` backed by a `VLMPolicy`, whose own `encode_row` / `batch_inputs` render the prompts
    (chat template, system prompt, processor) as in training; the images are passed as they are (the row
    says `PRESIZED`). ``convention``: how the model writes boxes ("resized" by default; a family alias is
    accepted)."""

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
        enc = self.policy.encode_row({"prompt": text, "images": list(images), PRESIZED: True})
        dev = self.policy.device
        return {k: v.to(dev) for k, v in self.policy.batch_inputs([enc]).items()}

    @torch.no_grad()
    def yes_probability(self, images: list[Any], question: str) -> float:
        """One forward: softmax of the next-token logits over the first tokens of "yes" and "no"."""
        inputs = self._inputs(images, question)
        logits = self.policy.model(**inputs, logits_to_keep=1, use_cache=False).logits[0, -1].float()
        pair = torch.stack([logits[self.yes_id], logits[self.no_id]])
        return float(torch.softmax(pair, dim=0)[0])

    @torch.no_grad()
    def predict_box(self, images: list[Any], prompt: str, frame: int = -1) -> Sequence[float] | None:
        """``generate`` (greedy at temperature 0, else sampled; ``max_new_tokens`` defaults to the
        policy's), then `parse_box` of the completion (kept in ``last_text``)."""
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
    """Search settings (see the module docstring). ``c``: UCT exploration constant (our design: sqrt 2)."""

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


def _expression(row: dict[str, Any]) -> str:
    """The row's ``expression`` (stripped); ValueError when it is missing or empty."""
    expression = row.get("expression")
    if expression is None or not str(expression).strip():
        raise ValueError(
            f"{row.get('_source', 'row')}: the GeoViS search needs an 'expression' column "
            f"(columns: {sorted(row)})"
        )
    return str(expression).strip()


class _Search:
    """The state of one `tree_search`: views by id and by region, their evaluations (in order of first
    evaluation), the tree nodes, the deepest node created and the oracle calls made."""

    def __init__(
        self,
        image: Any,
        row: dict[str, Any],
        oracle: SearchOracle,
        cfg: SearchConfig,
        *,
        pixels: ViewPixels,
        rng: random.Random | None,
    ) -> None:
        self.expression = _expression(row)
        self.image, self.oracle, self.cfg, self.rng = image, oracle, cfg, rng
        self.image_size = image.size
        self.convention = resolve_convention(oracle.convention)
        self.questions = yes_no_questions(row)
        self.bounds = {"min_pixels": pixels.crop[0], "max_pixels": pixels.crop[1], "factor": pixels.factor}
        self.root_view = pixels.root_view(self.image_size)
        self.views: dict[int, View] = {0: self.root_view}
        self.by_region: dict[Region, View] = {self.root_view.region: self.root_view}
        self.evals: dict[int, dict[str, Any]] = {}
        self.nodes: list[_Node] = []
        self.depth_reached = 0
        self.calls = 0

    # ------------------------------------------------------------------ evaluation
    def r_iou(self, box: Sequence[float] | None, view: View) -> float:
        """IoU of `box` (the crop's frame, ``convention``) with `CENTRAL_BOX`, in fractions of the crop; 0
        without a box."""
        if box is None:
            return 0.0
        fw, fh = view_frame(view, self.convention)
        return iou((box[0] / fw, box[1] / fh, box[2] / fw, box[3] / fh), CENTRAL_BOX)

    def evaluate(self, view: View) -> float:
        """The value of `view`, computed once per search: ``w_qa * r_QA + w_iou * r_IoU``, r_QA the mean
        P("yes") of `yes_no_questions` on the crop alone (no check: the value is r_IoU, our design).
        Records {"value", "r_qa", "r_iou", "box"} (box: in the crop's frame) in ``evals``."""
        if view.id in self.evals:
            return self.evals[view.id]["value"]
        crop = view_image(self.image, view)
        probs = [self.oracle.yes_probability([crop], q) for q in self.questions]
        self.calls += len(probs)
        box = self.oracle.predict_box([crop], BOX_PROMPT.format(expression=self.expression))
        self.calls += 1
        box = order_box(box) if box is not None else None
        r_iou = self.r_iou(box, view)
        if probs:
            r_qa = sum(min(max(p, 0.0), 1.0) for p in probs) / len(probs)
            value = self.cfg.w_qa * r_qa + self.cfg.w_iou * r_iou
        else:
            r_qa, value = None, r_iou
        self.evals[view.id] = {"value": value, "r_qa": r_qa, "r_iou": r_iou, "box": box}
        return value

    # ------------------------------------------------------------------ expansion
    def actions(self, view: View) -> list[Any]:
        """The actions of `view`: its ``grid`` x ``grid`` cells (row-major) that `check_crop` accepts, then
        "out" (to the parent view) when allowed; shuffled by ``rng`` when given."""
        acts: list[Any] = []
        for cell in grid_cells(view, self.cfg.grid):
            region = clip_region(cell, self.image_size)
            if check_crop(region, self.cfg.min_crop_px, self.cfg.max_aspect) is None:
                acts.append(region)
        if self.cfg.allow_zoom_out and view.parent is not None:
            acts.append("out")
        if self.rng is not None:
            self.rng.shuffle(acts)
        return acts

    def open_view(self, action: Any, node: _Node) -> View:
        """The view `action` leads to from `node`: the parent view for "out", else the view of the region
        (an existing view when that region was reached before, else a new one)."""
        if action == "out":
            assert node.view.parent is not None
            return self.views[node.view.parent]
        v = make_view(
            action, view_id=len(self.views), parent=node.view.id, image_size=self.image_size, **self.bounds
        )
        known = self.by_region.get(v.region)
        if known is not None:
            return known
        self.views[v.id] = v
        self.by_region[v.region] = v
        return v

    def new_node(self, view: View, depth: int, parent: _Node | None = None) -> _Node:
        """A tree node for `view` with its untried actions, recorded in ``nodes``."""
        node = _Node(view=view, depth=depth, parent=parent)
        node.untried = self.actions(view)
        self.nodes.append(node)
        return node

    def expand(self, node: _Node) -> _Node:
        """Open `node`'s next untried action: the new child node (tree depth + 1)."""
        action = node.untried.pop(0)
        child = self.new_node(self.open_view(action, node), node.depth + 1, parent=node)
        node.children.append(child)
        self.depth_reached = max(self.depth_reached, child.depth)
        return child

    # ------------------------------------------------------------------ simulation
    def select(self, root: _Node) -> list[_Node]:
        """The path from `root` down by `select_child` while the node is below ``max_depth``, fully
        expanded and has children."""
        node, path = root, [root]
        while node.depth < self.cfg.max_depth and not node.untried and node.children:
            node = select_child(node, self.cfg.c)
            path.append(node)
        return path

    @staticmethod
    def backup(path: Sequence[_Node], value: float) -> None:
        """Add one visit and `value` to every node of `path`."""
        for n in path:
            n.visits += 1
            n.total += value

    def simulate(self, root: _Node) -> None:
        """One simulation: select, expand one untried action (not at ``max_depth``), evaluate the reached
        view, back its value up the path."""
        path = self.select(root)
        node = path[-1]
        if node.depth < self.cfg.max_depth and node.untried:
            node = self.expand(node)
            path.append(node)
        self.backup(path, self.evaluate(node.view))

    # ------------------------------------------------------------------ answer
    def best_view(self) -> View:
        """The view of the node of highest mean value; ties: the deeper view, then the earlier evaluated."""
        rank = {vid: i for i, vid in enumerate(self.evals)}
        best = max(self.nodes, key=lambda n: (n.q, view_depth(n.view, self.views), -rank[n.view.id]))
        return best.view

    def final_box(self, best: View) -> Region | None:
        """The global box (original pixels, clipped to the image), None without one. "full_image" (the
        paper): `FULL_IMAGE_BOX_PROMPT` on the image + best crop, box in view 0's frame; "best_crop" (our
        design), or view 0 as best: the box of `best`'s evaluation, mapped to global pixels."""
        if self.cfg.final == "best_crop" or best.id == 0:
            box, frame_view = self.evals[best.id]["box"], best
        else:
            images = [view_image(self.image, self.root_view), view_image(self.image, best)]
            prompt = FULL_IMAGE_BOX_PROMPT.format(expression=self.expression)
            raw = self.oracle.predict_box(images, prompt, frame=0)
            self.calls += 1
            box, frame_view = (order_box(raw) if raw is not None else None), self.root_view
        if box is None:
            return None
        return clip_region(view_to_global(box, frame_view, self.convention), self.image_size)

    def scores(self) -> list[dict[str, Any]]:
        """Per evaluated view, in order: its evaluation and the visits / mean summed over its tree nodes."""
        per_view: dict[int, list[_Node]] = {}
        for n in self.nodes:
            per_view.setdefault(n.view.id, []).append(n)
        out = []
        for vid, e in self.evals.items():
            held = per_view.get(vid, [])
            visits = sum(n.visits for n in held)
            mean = sum(n.total for n in held) / visits if visits else None
            out.append(
                {
                    "view": vid,
                    "value": e["value"],
                    "r_qa": e["r_qa"],
                    "r_iou": e["r_iou"],
                    "visits": visits,
                    "mean": mean,
                }
            )
        return out

    def run(self) -> SearchResult:
        """Evaluate the root, run ``simulations`` simulations, pick the best view and its box."""
        root = self.new_node(self.root_view, 0)
        root.visits, root.total = 1, self.evaluate(self.root_view)
        for _ in range(self.cfg.simulations):
            self.simulate(root)
        best = self.best_view()
        answer = self.final_box(best)
        return SearchResult(
            views=[self.views[vid] for vid in self.evals],
            best_view=best,
            answer_box=answer,
            simulations=self.cfg.simulations,
            depth_reached=self.depth_reached,
            model_calls=self.calls,
            scores=self.scores(),
        )


def tree_search(
    image: Any,
    row: dict[str, Any],
    oracle: SearchOracle,
    config: SearchConfig | None = None,
    *,
    min_pixels: int,
    max_pixels: int,
    factor: int = 28,
    crop_min_pixels: int | None = None,
    crop_max_pixels: int | None = None,
    rng: random.Random | None = None,
) -> SearchResult:
    """Run the GeoViS search on the PIL `image` for `row` (``expression``, optional ``object`` /
    ``relation``). `min_pixels` / `max_pixels`: the pixel bounds of view 0, `crop_min_pixels` /
    `crop_max_pixels` those of the crops (None: view 0's), `factor` patch size x merge size (the views'
    ``resized`` sizes, `ViewPixels`). `rng`: shuffles the expansion order when given (``temperature > 0``)."""
    pixels = ViewPixels(
        root=(min_pixels, max_pixels),
        crop=(
            min_pixels if crop_min_pixels is None else crop_min_pixels,
            max_pixels if crop_max_pixels is None else crop_max_pixels,
        ),
        factor=factor,
    )
    search = _Search(image, row, oracle, config or SearchConfig(), pixels=pixels, rng=rng)
    return search.run()


def format_answer(box: Sequence[float] | None) -> str:
    """``<answer>[x1, y1, x2, y2]</answer>`` (original pixels, 1 decimal at most); a reply without a box
    (scores 0 with any box reward) when `box` is None."""
    if box is None:
        return "<answer>no box</answer>"
    return "<answer>[" + ", ".join(f"{round(float(v), 1):g}" for v in box) + "]</answer>"


# ============================================================================ policy
def _env_state(r: SearchResult) -> dict[str, Any]:
    """A sample's ``env_state``: the visited views, the best view's id, the search's statistics and, when
    the model wrote one, the answer box (original pixels)."""
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
    return state


class TreeSearchPolicy(Policy):
    """A `VLMPolicy` driven by the GeoViS tree search, for ``mmalign eval`` only (see `rollout`).

    With ``temperature`` 0 the search is deterministic and a row's `group_size` samples copy one search;
    above 0 each sample searches on its own (random expansion order seeded from torch's generator, boxes
    sampled). The views' pixel bounds are the wrapped policy's ``view_pixels`` (the GeoViS policy's root and
    crop bounds), else its processor's for every view. Training methods raise ``INFERENCE_ONLY``; the weights
    are the wrapped policy's."""

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
        pixels = getattr(policy, "view_pixels", None)
        self.pixels: ViewPixels = (
            pixels if isinstance(pixels, ViewPixels) else ViewPixels.same(*processor_pixel_bounds(processor))
        )

    # ------------------------------------------------------------------ rollout
    def _search(self, row: dict[str, Any], rng: random.Random | None) -> SearchResult:
        images = row.get("images", row.get("image"))
        images = images if isinstance(images, list | tuple) else [images]
        if not images or images[0] is None:
            raise ValueError(
                f"{row.get('_source', 'row')}: the GeoViS search needs an image ('images' column)"
            )
        return tree_search(
            load_rgb(images[0]),
            row,
            self.oracle,
            self.config,
            min_pixels=self.pixels.root[0],
            max_pixels=self.pixels.root[1],
            crop_min_pixels=self.pixels.crop[0],
            crop_max_pixels=self.pixels.crop[1],
            factor=self.pixels.factor,
            rng=rng,
        )

    def _search_rows(self, rows: list[dict[str, Any]], group_size: int) -> list[SearchResult]:
        """`group_size` results per row, in row order (one search copied at temperature 0, else one search
        per sample seeded from torch's generator); the model is in eval mode meanwhile."""
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
        return results

    def setup(self, run: Any) -> None:
        """Called by the trainer only: training with the tree search is refused (it has no trained actions)."""
        from mmalign.config import ConfigError

        raise ConfigError(
            f"{run.cfg.source}: key 'options.search': {INFERENCE_ONLY}; train the zoom policy with "
            f"options.search: zoom and compare with the search at evaluation"
        )

    @torch.no_grad()
    def rollout(self, rows: list[dict[str, Any]], group_size: int, *, compute_logp: bool = False) -> Rollout:
        """Search once per row (per sample when ``temperature > 0``). Outputs: ``texts`` (`format_answer`,
        absolute ORIGINAL pixels: read with ``coords: absolute``), ``env_state`` ({"views", "answer_box" when
        a box, "best_view", "search"}), ``num_turns`` (zoom depth of the best view + 1), ``model_calls``.
        ``mask`` is Bool[B,1], all False; ``payload`` is empty."""
        if compute_logp:
            raise RuntimeError(INFERENCE_ONLY + " (compute_logp=True asked for log-probs)")
        results = self._search_rows(rows, group_size)
        texts = [format_answer(r.answer_box) for r in results]
        states = [_env_state(r) for r in results]
        turns = [view_depth(r.best_view, {v.id: v for v in r.views}) + 1 for r in results]
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
