"""Rollout loops: how a text or VLM policy turns a dataset row into the sequence it trains on.

A loop is chosen by ``rollout.loop`` (``rollout.loop_kwargs`` are its options) and handed to the
policy's constructor (``TextPolicy(..., loop=...)``; `VLMPolicy` likewise). Three are registered:

``single_turn``
    One completion per sample, exactly as the policy always sampled (`TextPolicy.single_turn_rollout`).

``multi_turn``
    Generated turns alternate with content an **environment** appends to the conversation (a tool's
    answer, a zoomed crop of the image, a hint). The environment is a function the pipeline supplies
    (or ``loop_kwargs.environment: "package.module:function"``)::

        def env(turn: TurnContext) -> Done | Insert: ...

    It is called once per sample after each generated turn, with that turn's text, the sample's dataset
    row and the conversation so far, and answers `Done` (the conversation is over) or
    ``Insert(text=..., images=[...], role="user")`` (content appended before the next turn). Under a chat
    template the insertion becomes a message of ``role`` followed by the opening of the next assistant
    turn, rendered by the policy's own chat template (`TextPolicy.insert_text`); ``role=None`` appends
    ``text`` verbatim. Each turn is one batched ``generate`` over the samples still active (all G samples
    of every prompt together). With a rollout engine (``rollout.engine``: ``vllm``, ``fake``) each turn is
    one engine call over the whole token sequences so far (prompt, generated turns and insertions; a VLM's
    images as the engine's multimodal inputs); the engine's log-probs of the generated tokens become
    ``Rollout.logp_sampler`` and ``logp_old`` is re-scored with the trainer's weights, as for single turns.

    Options: ``max_turns`` (generated turns, default 4); ``max_tokens_per_turn`` (default
    ``rollout.max_new_tokens``); ``max_insert_tokens`` (tokens of one insertion, default 512);
    ``max_completion_tokens``: the cap on the completion region (generated + inserted tokens; default
    ``max_turns * max_tokens_per_turn + (max_turns - 1) * max_insert_tokens``, which never binds). Each
    turn generates at most ``min(max_tokens_per_turn, cap - tokens so far)``; an insertion longer than
    ``max_insert_tokens``, or one that would leave no room for one more generated token under the cap,
    ends the sample instead (an insertion is never cut, so an image is never split). ``reward_text``: what
    ``outputs["texts"]`` holds (below). ``mask_over_turn`` (default False): samples that reach
    ``max_turns`` still wanting to go on get no loss (``outputs["exclude_from_loss"]``).

``igpo``
    ``multi_turn`` that also scores the gold answer after every turn with the policy itself and records
    the per-turn information gains as ``step_rewards`` (IGPO; `InfoGainMultiTurn`). Options: those of
    ``multi_turn`` plus ``answer_column`` (default ``answer``), ``answer_template`` (``"{answer}"``) and
    ``gain`` (``logprob`` or ``prob``). Text policies.

What the rollout holds (both loops; the multi-turn one fills the completion region with several turns):

- the **completion region** (``payload["completion_ids"]``, Long[B,T], right-padded) is everything after
  the prompt: generated turns and inserted content, in order. ``payload["completion_attention_mask"]``
  marks its real tokens (the model attends to generated AND inserted tokens); ``Rollout.mask`` marks the
  actions, i.e. only the generated tokens (each turn up to and including its EOS / stop string): inserted
  tokens and padding never take part in the loss. One action = one completion-region position, so every
  Float[B,T] tensor (``logp_old``, ``logp_ref``, ...) lines up with ``completion_ids``; log-probs at
  positions outside ``mask`` are 0.
- VLM: ``payload["completion_mm_token_type_ids"]`` (Long[B,T]) types the inserted image tokens;
  ``pixel_values[i]`` / ``image_grid_thw[i]`` hold ALL images of sample i in order (prompt images, then
  inserted ones) and ``payload["num_prompt_images"]`` (Long[B]) says how many of them the prompt has.
- ``outputs["texts"]`` (what rewards read as ``batch.texts``): with ``reward_text: conversation`` (the
  default) the decoded completion region, i.e. every generated turn AND the inserted content after the
  prompt (special tokens skipped, exactly as single-turn texts are decoded); with ``last_turn`` only the
  last generated turn. Always: ``outputs["turns"]`` (per sample, the list of generated turn texts),
  ``outputs["inserted_texts"]`` (per sample, the environment's ``text`` of each insertion),
  ``outputs["num_turns"]`` (Long[B]), ``outputs["num_tokens"]`` (generated tokens = ``mask.sum(1)``),
  ``outputs["num_inserted_tokens"]`` (Long[B]), ``outputs["stop_reasons"]`` (per sample: ``done``,
  ``max_turns``, ``insert_too_long`` or ``max_completion_tokens``) and ``outputs["truncated"]`` (Bool[B]):
  True when a limit ended the sample (any stop reason but ``done``) or its last turn was cut at its token
  budget without EOS / stop string.
- ``outputs["env_state"]`` (both loops; per sample a dict): what the environment wrote into
  ``TurnContext.state`` (`Conversation.state`); ``{}`` for single-turn rollouts and untouched samples.
- ``outputs["exclude_from_loss"]`` (Bool[B], multi_turn with ``mask_over_turn: true``): the samples stopped
  at the turn cap (``stop_reason == "max_turns"``). The trainer computes advantages with them (they count
  in their group's statistics) and then drops them from the loss (over-turn masking).

A new loop subclasses `RolloutLoop`, registers with ``@LOOPS.register(name)`` and drives the policy
through `TurnPolicy` (the primitives `TextPolicy` and `VLMPolicy` implement).
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

from mmalign.registry import Registry, RegistryError, import_path, option_checked

if TYPE_CHECKING:
    from torch import Tensor

    from mmalign.data.batch import Rollout

__all__ = [
    "DONE",
    "LOOPS",
    "InfoGainMultiTurn",
    "Conversation",
    "Done",
    "Environment",
    "Insert",
    "MultiTurn",
    "RolloutLoop",
    "Segment",
    "SingleTurn",
    "TurnContext",
    "TurnPolicy",
    "answer_logprobs",
    "get",
    "loop_from_config",
    "make_loop",
    "names",
]


# ----------------------------------------------------------------------------- what an environment sees


@dataclass(frozen=True)
class Done:
    """An environment's answer: the conversation is over; the turn just generated is the last one."""


DONE = Done()


@dataclass(frozen=True)
class Insert:
    """An environment's answer: append this content to the conversation, then generate another turn.

    ``images`` (PIL images, or paths) need a VLM policy. ``role``: the chat role of the inserted message
    (``"user"``, ``"tool"`` ... whatever the chat template accepts); ``None`` appends ``text`` verbatim
    with no chat formatting (no images then). Inserted tokens are attended to but never trained."""

    text: str = ""
    images: Sequence[Any] = ()
    role: str | None = "user"


@dataclass
class Segment:
    """A contiguous piece of a sample's completion region: one generated turn or one insertion."""

    ids: list[int]
    trained: bool
    """Generated by the policy (its tokens are actions in the loss) or inserted (attended, never trained)."""
    text: str
    """Generated: the decoded turn (special tokens skipped). Inserted: the environment's `Insert.text`."""
    finished: bool = True
    """Generated: the turn ended with EOS or a stop string (False: cut at its token budget)."""
    token_types: list[int] | None = None
    """VLM: multimodal token types of `ids` (0 text, 1 image); None means all text."""
    vision: dict[str, Tensor | None] = field(default_factory=dict)
    """VLM: the processor's vision tensors of the inserted images (``pixel_values``, ``image_grid_thw``)."""
    images: list[Any] = field(default_factory=list)
    """The inserted images (as loaded)."""
    logprobs: list[float] | None = None
    """Generated by a rollout engine: the engine's log-prob of each of `ids` (the rollout's ``logp_sampler``
    for the importance-sampling correction); None when the policy sampled the turn itself."""


@dataclass
class Conversation:
    """One sample while a loop runs: its prompt (encoded by the policy) and the segments after it."""

    index: int
    """Position of the sample in the rollout."""
    group_index: int
    """Which of the G samples of its prompt (0 .. G-1)."""
    row: dict[str, Any]
    """The dataset row."""
    prompt: Any
    """The policy's encoding of the prompt (token ids; processor outputs for a VLM); loops do not read it."""
    segments: list[Segment] = field(default_factory=list)
    stop_reason: str = ""
    """Why the sample ended: ``done``, ``max_turns``, ``insert_too_long``, ``max_completion_tokens``."""
    truncated: bool = False
    state: dict[str, Any] = field(default_factory=dict)
    """The environment's per-sample scratch space (tool state, the views of a visual search, the final
    answer it parsed ...); the rollout exposes it as ``outputs["env_state"]``. Keep it JSON-serialisable:
    the trainer writes it beside each sample in the run directory."""

    @property
    def length(self) -> int:
        """Tokens in the completion region so far."""
        return sum(len(s.ids) for s in self.segments)

    @property
    def turns(self) -> list[str]:
        """The generated turns' texts, in order."""
        return [s.text for s in self.segments if s.trained]

    @property
    def inserted_texts(self) -> list[str]:
        return [s.text for s in self.segments if not s.trained]


@dataclass(frozen=True)
class TurnContext:
    """What the environment is called with after each generated turn of one sample."""

    conversation: Conversation
    """The sample's conversation (live: it grows as the loop goes on)."""
    turn: int
    """0-based index of the turn just generated."""
    text: str
    """That turn's decoded text (special tokens skipped)."""
    finished: bool
    """The turn ended with EOS or a stop string (False: it was cut at its token budget)."""
    turns: tuple[str, ...] = ()
    """All generated turns so far, this one last (a snapshot taken at the call)."""
    inserted_texts: tuple[str, ...] = ()
    """The texts of the insertions so far (a snapshot taken at the call)."""

    @property
    def row(self) -> dict[str, Any]:
        """The sample's dataset row (every column: answers, image paths ...). Shared by the G samples of a
        prompt: write per-sample state into `state`, never into the row."""
        return self.conversation.row

    @property
    def state(self) -> dict[str, Any]:
        """The sample's `Conversation.state` (per-sample, writable; becomes ``outputs["env_state"]``)."""
        return self.conversation.state

    @property
    def sample_index(self) -> int:
        return self.conversation.index

    @property
    def group_index(self) -> int:
        return self.conversation.group_index


Environment = Callable[[TurnContext], "Done | Insert"]
"""``env(turn: TurnContext) -> Done | Insert``: see the module docstring."""


class TurnPolicy(Protocol):
    """The primitives a policy offers to rollout loops (`TextPolicy` and `VLMPolicy` implement them)."""

    max_new_tokens: int

    def single_turn_rollout(
        self, rows: list[dict[str, Any]], group_size: int, *, compute_logp: bool
    ) -> Rollout:
        """One completion per sample (the policy's plain sampling)."""
        ...

    def start_conversations(self, rows: list[dict[str, Any]], group_size: int) -> list[Conversation]:
        """`group_size` empty conversations per row, group by group (prompt encoded once per row)."""
        ...

    def generate_turn(self, conversations: list[Conversation], budgets: list[int]) -> list[Segment]:
        """One generated turn per conversation (batched), of at most ``budgets[i]`` tokens each, cut after
        its EOS / stop string. The conversations are not modified."""
        ...

    def insert_segment(self, conversation: Conversation, insert: Insert) -> Segment:
        """The tokens of `insert` as they follow `conversation` (chat formatting, image tokens)."""
        ...

    def finish_conversations(
        self,
        rows: list[dict[str, Any]],
        group_size: int,
        conversations: list[Conversation],
        *,
        compute_logp: bool,
    ) -> Rollout:
        """The `Rollout` of finished conversations (payload, loss mask, texts, per-turn outputs)."""
        ...


# ----------------------------------------------------------------------------- loops

LOOPS: Registry[type[RolloutLoop]] = Registry("rollout loop")


class RolloutLoop(abc.ABC):
    """Turns rows into a `Rollout` through a `TurnPolicy`. Subclasses take their options as keyword
    arguments (``rollout.loop_kwargs``) plus ``environment``."""

    name: ClassVar[str] = ""
    multi_turn: ClassVar[bool] = False
    gives_step_rewards: ClassVar[bool] = False
    """The loop writes ``Rollout.step_rewards`` itself (``igpo``), so a per-step estimator needs no per_step reward."""

    @abc.abstractmethod
    def rollout(
        self, policy: TurnPolicy, rows: list[dict[str, Any]], group_size: int, *, compute_logp: bool
    ) -> Rollout: ...


@LOOPS.register("single_turn")
class SingleTurn(RolloutLoop):
    """One completion per sample (the default)."""

    name = "single_turn"

    def __init__(self, *, environment: Environment | None = None) -> None:
        self.environment = environment  # not used: a pipeline may always supply one

    def rollout(
        self, policy: TurnPolicy, rows: list[dict[str, Any]], group_size: int, *, compute_logp: bool
    ) -> Rollout:
        rollout = policy.single_turn_rollout(rows, group_size, compute_logp=compute_logp)
        rollout.outputs.setdefault("env_state", [{} for _ in range(len(rollout))])
        return rollout


@LOOPS.register("multi_turn")
class MultiTurn(RolloutLoop):
    """Generated turns alternate with environment content (text, images) appended to the conversation."""

    name = "multi_turn"
    multi_turn = True

    def __init__(
        self,
        *,
        environment: Environment | None = None,
        max_turns: int = 4,
        max_tokens_per_turn: int | None = None,
        max_insert_tokens: int = 512,
        max_completion_tokens: int | None = None,
        reward_text: Literal["conversation", "last_turn"] = "conversation",
        mask_over_turn: bool = False,
    ) -> None:
        if environment is None:
            raise ValueError(
                "the multi_turn rollout loop needs an environment: a function TurnContext -> Done | Insert "
                "(supplied by the pipeline, or loop_kwargs.environment: 'package.module:function')"
            )
        if not callable(environment):
            raise TypeError(f"the multi_turn environment must be callable, got {environment!r}")
        for key, value in (
            ("max_turns", max_turns),
            ("max_tokens_per_turn", max_tokens_per_turn),
            ("max_insert_tokens", max_insert_tokens),
            ("max_completion_tokens", max_completion_tokens),
        ):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"multi_turn option {key!r} must be an integer >= 1, got {value!r}")
        if reward_text not in ("conversation", "last_turn"):
            raise ValueError(
                f"multi_turn option 'reward_text' must be 'conversation' or 'last_turn', got {reward_text!r}"
            )
        self.environment = environment
        self.max_turns = max_turns
        self.max_tokens_per_turn = max_tokens_per_turn
        self.max_insert_tokens = max_insert_tokens
        self.max_completion_tokens = max_completion_tokens
        self.reward_text = reward_text
        if not isinstance(mask_over_turn, bool):
            raise ValueError(
                f"multi_turn option 'mask_over_turn' must be true or false, got {mask_over_turn!r}"
            )
        self.mask_over_turn = mask_over_turn

    def limits(self, policy: TurnPolicy) -> tuple[int, int]:
        """(tokens per turn, cap on the completion region) for `policy`."""
        per_turn = self.max_tokens_per_turn or policy.max_new_tokens
        cap = self.max_completion_tokens
        if cap is None:
            cap = self.max_turns * per_turn + (self.max_turns - 1) * self.max_insert_tokens
        return per_turn, cap

    def rollout(
        self, policy: TurnPolicy, rows: list[dict[str, Any]], group_size: int, *, compute_logp: bool
    ) -> Rollout:
        per_turn, cap = self.limits(policy)
        conversations = policy.start_conversations(rows, group_size)
        active = list(conversations)
        after_turn = getattr(self, "_after_turn", None)
        if after_turn is not None:
            after_turn(conversations)
        for turn in range(self.max_turns):
            if not active:
                break
            budgets = [min(per_turn, cap - c.length) for c in active]
            segments = policy.generate_turn(active, budgets)
            still: list[Conversation] = []
            for conv, seg in zip(active, segments, strict=True):
                conv.segments.append(seg)
                reply = self._ask(conv, turn, seg)
                if isinstance(reply, Done):
                    conv.stop_reason, conv.truncated = "done", not seg.finished
                    continue
                if turn + 1 == self.max_turns:
                    conv.stop_reason, conv.truncated = "max_turns", True
                    continue
                inserted = policy.insert_segment(conv, reply)
                if len(inserted.ids) > self.max_insert_tokens:
                    conv.stop_reason, conv.truncated = "insert_too_long", True
                    continue
                if conv.length + len(inserted.ids) + 1 > cap:
                    conv.stop_reason, conv.truncated = "max_completion_tokens", True
                    continue
                conv.segments.append(inserted)
                still.append(conv)
            if after_turn is not None:  # igpo: every conversation that took this turn, after its insertion
                after_turn(active)
            active = still
        rollout = policy.finish_conversations(rows, group_size, conversations, compute_logp=compute_logp)
        if self.reward_text == "last_turn":
            rollout.outputs["texts"] = [c.turns[-1] for c in conversations]
        rollout.outputs["env_state"] = [c.state for c in conversations]
        if self.mask_over_turn:
            import torch

            rollout.outputs["exclude_from_loss"] = torch.tensor(
                [c.stop_reason == "max_turns" for c in conversations], dtype=torch.bool
            )
        return rollout

    def _ask(self, conv: Conversation, turn: int, seg: Segment) -> Done | Insert:
        ctx = TurnContext(
            conversation=conv,
            turn=turn,
            text=seg.text,
            finished=seg.finished,
            turns=tuple(conv.turns),
            inserted_texts=tuple(conv.inserted_texts),
        )
        env = self.environment
        assert env is not None
        try:
            reply = env(ctx)
        except Exception as e:
            raise RuntimeError(
                f"rollout environment {_name(env)} failed on sample {conv.index} (turn {turn}): "
                f"{type(e).__name__}: {e}"
            ) from e
        if not isinstance(reply, Done | Insert):
            raise TypeError(
                f"rollout environment {_name(env)} returned {type(reply).__name__} on sample {conv.index} "
                f"(turn {turn}); it must return mmalign.data.rollout_loops.Done or Insert"
            )
        return reply


@LOOPS.register("igpo")
class InfoGainMultiTurn(MultiTurn):
    """``multi_turn`` plus IGPO's turn rewards: the policy's own gain in log P(gold answer | history) per turn.

    "Information Gain-based Policy Optimization" (IGPO): after every turn k (the generated turn and the
    environment's insertion after it, if any) the policy scores the gold answer a (the row's
    ``answer_column``, rendered with ``answer_template``) by teacher forcing:

        s_k = log pi(a | prompt, turns 1..k)     (s_0: the prompt alone)
        r_k = s_k - s_{k-1}                      (``gain: logprob``, default)
        r_k = exp(s_k / |a|) - exp(s_{k-1} / |a|) (``gain: prob``: the per-token geometric-mean probability)

    The rollout then carries ``step_rewards`` (Float[B,T]: r_k on every action of turn k, 0 elsewhere),
    for the per-step estimator ``grpo_process``; ``outputs["env_state"][i]["turn_rewards"]`` (the list
    r_1..r_K, for ``gigpo`` / ``hgpo``'s ``turn_rewards``) and ``["answer_logprobs"]`` (s_0..s_K). The
    outcome reward is configured as usual. The scores are taken without gradient at temperature 1 with
    the sampling weights (``policy.model``), over the prompt tokens and the completion region so far.

    (our design): the logprob gain as default (the paper's probability gain is ``gain: prob``), the
    score after the insertion that follows a turn, and dense per-action step rewards. Text policies only
    (the conversation's prompt must be token ids); a VLM policy raises ValueError.
    """

    name = "igpo"
    gives_step_rewards = True

    def __init__(
        self,
        *,
        environment: Environment | None = None,
        answer_column: str = "answer",
        answer_template: str = "{answer}",
        gain: Literal["logprob", "prob"] = "logprob",
        **options: Any,
    ) -> None:
        super().__init__(environment=environment, **options)
        if gain not in ("logprob", "prob"):
            raise ValueError(f"igpo option 'gain' must be 'logprob' or 'prob', got {gain!r}")
        if "{answer}" not in answer_template:
            raise ValueError(
                f"igpo option 'answer_template' must contain '{{answer}}', got {answer_template!r}"
            )
        self.answer_column, self.answer_template, self.gain = answer_column, answer_template, gain

    def rollout(
        self, policy: TurnPolicy, rows: list[dict[str, Any]], group_size: int, *, compute_logp: bool
    ) -> Rollout:
        import torch

        from mmalign.algorithms.advantages import turns_from_mask

        for row in rows:
            if row.get(self.answer_column) is None:
                raise ValueError(
                    f"igpo: a row has no {self.answer_column!r} column (loop_kwargs.answer_column): {sorted(row)}"
                )
        scores: dict[int, list[float]] = {}

        def score(convs: list[Conversation]) -> None:
            values = answer_logprobs(policy, convs, [self._answer(c.row) for c in convs])
            for c, v in zip(convs, values, strict=True):
                scores.setdefault(c.index, []).append(v)

        self._after_turn = score
        try:
            rollout = super().rollout(policy, rows, group_size, compute_logp=compute_logp)
        finally:
            self._after_turn = None
        turn = turns_from_mask(rollout.mask)
        steps = torch.zeros(rollout.mask.shape, dtype=torch.float32)
        for i, state in enumerate(rollout.outputs["env_state"]):
            s = scores[i]
            n_ans = len(self._answer_ids(policy, rows[i // group_size]))
            if self.gain == "prob":
                vals = [math.exp(v / max(n_ans, 1)) for v in s]
            else:
                vals = list(s)
            gains = [b - a for a, b in zip(vals[:-1], vals[1:], strict=True)]
            state["answer_logprobs"] = list(s)
            state["turn_rewards"] = gains
            for k, g in enumerate(gains):
                steps[i][turn[i] == k] = g
        rollout.step_rewards = steps
        return rollout

    def _answer(self, row: dict[str, Any]) -> str:
        return self.answer_template.format(answer=row[self.answer_column])

    def _answer_ids(self, policy: TurnPolicy, row: dict[str, Any]) -> list[int]:
        return list(policy.tokenizer(self._answer(row), add_special_tokens=False)["input_ids"])  # type: ignore[attr-defined]


def answer_logprobs(policy: Any, conversations: list[Conversation], answers: list[str]) -> list[float]:
    """log pi(answer_i | prompt_i + completion region so far), summed over the answer's tokens, per conversation.

    One batched forward of ``policy.model`` without gradient (right-padded: causal attention makes the
    padding invisible), logits at temperature 1. Text policies only (``conversation.prompt`` token ids).
    """
    import torch

    if not conversations:
        return []
    seqs, spans = [], []
    for conv, answer in zip(conversations, answers, strict=True):
        if not isinstance(conv.prompt, list | tuple):
            raise ValueError(
                "igpo scores the gold answer with a text policy (the prompt as token ids); "
                f"this policy's prompt is a {type(conv.prompt).__name__}"
            )
        head = [int(t) for t in conv.prompt] + [t for seg in conv.segments for t in seg.ids]
        ans = list(policy.tokenizer(answer, add_special_tokens=False)["input_ids"])
        if not ans:
            raise ValueError(f"igpo: the answer {answer!r} has no tokens")
        seqs.append(head + ans)
        spans.append((len(head), len(ans)))
    width = max(len(x) for x in seqs)
    pad = policy.tokenizer.pad_token_id or 0
    ids = torch.full((len(seqs), width), int(pad), dtype=torch.long)
    att = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, x in enumerate(seqs):
        ids[i, : len(x)] = torch.tensor(x)
        att[i, : len(x)] = 1
    device = next(policy.model.parameters()).device
    with torch.no_grad():
        logits = policy.model(input_ids=ids.to(device), attention_mask=att.to(device)).logits.float()
    logp = torch.log_softmax(logits, dim=-1)
    out = []
    for i, (start, n) in enumerate(spans):
        target = ids[i, start : start + n].to(device)
        out.append(float(logp[i, start - 1 : start + n - 1].gather(-1, target[:, None]).sum()))
    return out


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


# ----------------------------------------------------------------------------- construction


def get(name: str) -> type[RolloutLoop]:
    return LOOPS.get(name)


def names() -> list[str]:
    return LOOPS.names()


def make_loop(name: str, *, environment: Environment | None = None, **options: Any) -> RolloutLoop:
    """The loop registered as `name` with its options; unknown names raise `RegistryError`, unknown
    options `TypeError`, bad values or a missing environment `ValueError`."""
    cls = LOOPS.get(name)
    return option_checked("rollout loop", name, cls, 0)(environment=environment, **options)


def resolve_environment(spec: str) -> Environment:
    """``"package.module:function"`` -> the function (an environment named in ``loop_kwargs``); found with
    `mmalign.registry.import_path`. A ValueError naming the spec if it cannot be imported or is not callable."""
    try:
        obj = import_path(spec, "rollout environment", "package.module:function")
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot import the environment {spec!r}: {e}") from None
    if not callable(obj):
        raise ValueError(f"the environment {spec!r} is not callable")
    return obj


def loop_from_config(cfg: Any, environment: Environment | None = None) -> RolloutLoop:
    """The loop named by ``cfg.rollout.loop`` with ``cfg.rollout.loop_kwargs``; a pipeline passes its
    environment (``loop_kwargs.environment: "package.module:function"`` names one instead). Problems are
    `ConfigError`s naming the key."""
    from mmalign.config import ConfigError

    r = cfg.rollout
    source = getattr(cfg, "source", "config")
    options = dict(r.loop_kwargs)
    spec = options.pop("environment", None)
    try:
        cls = LOOPS.get(r.loop)
    except RegistryError as e:
        raise ConfigError(f"{source}: key 'rollout.loop': {e}") from None
    if spec is not None:
        try:
            environment = resolve_environment(str(spec))
        except ValueError as e:
            raise ConfigError(f"{source}: key 'rollout.loop_kwargs.environment': {e}") from None
    if cls.multi_turn and environment is None:
        raise ConfigError(
            f"{source}: key 'rollout.loop': {r.loop!r} needs an environment (a function TurnContext -> "
            f"Done | Insert) and pipeline {getattr(cfg, 'pipeline', '?')!r} supplies none; name one with "
            f"rollout.loop_kwargs.environment: 'package.module:function'"
        )
    try:
        return make_loop(r.loop, environment=environment, **options)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{source}: key 'rollout.loop_kwargs': {e}") from None
