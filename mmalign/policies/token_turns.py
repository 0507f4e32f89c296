"""The multi-turn protocol of a token policy (`mmalign.data.rollout_loops.TurnPolicy`): conversations, generated
turns, inserted messages and the `Rollout` of finished conversations."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from mmalign.data.batch import Rollout
from mmalign.data.rollout_loops import Conversation, Insert, Segment
from mmalign.engines.client import EngineClient
from mmalign.policies.token_sampling import completion_mask, pad_right

_TURN_PROBE = "MMALIGN_ASSISTANT_TURN_PROBE"
"""Stand-in assistant message used to find the strings a chat template puts around an inserted message."""

TURN_SEED_STRIDE = 104_729
"""With a rollout engine, turn k of a step samples with seed ``step seed + k * TURN_SEED_STRIDE`` (conversation
i adds i, as every engine call does), so no two turns of a step draw from the same random stream."""


class TurnProtocol:
    """Multi-turn methods of `TextPolicy` (the loop calls these; `VLMPolicy` overrides the encoding parts)."""

    model: torch.nn.Module
    tokenizer: Any
    eos_ids: list[int]
    stop_strings: list[str]
    use_chat_template: bool
    system_prompt: str | None
    device: torch.device
    engine_client: EngineClient
    suppressed_ids: list[int]
    _engine_sampling: Callable[..., Any]
    _logprobs: Callable[..., Tensor]
    _prompt_token_ids: Callable[[str], list[int]]
    _left_pad: Callable[[list[list[int]]], tuple[Tensor, Tensor]]
    _sampling_kwargs: Callable[[], dict[str, Any]]
    _generate_in_chunks: Callable[..., list[Any]]
    _stop_lengths: Callable[[Tensor], Tensor]
    _rollout_fields: Callable[..., tuple[list[str], Tensor, dict[str, list[Any]]]]

    # ------------------------------------------------------------------ inserted messages
    def _chat_content(self, text: str, num_images: int) -> Any:
        """A message's ``content`` for the chat template (a VLM lists image parts first)."""
        if num_images:
            raise ValueError(f"{type(self).__name__} cannot insert images (use a VLM policy)")
        return text

    def _render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def insert_text(self, insert: Insert, previous: Segment | None) -> str:
        """The text that appends `insert` after the segment `previous`: ``insert.text`` verbatim (``role=None``
        or no chat template), else what the chat template writes after an assistant turn (its end, less the
        EOS already generated; the message; the next assistant turn's opening), found with a probe."""
        n_images = len(insert.images)
        if insert.role is None or not self.use_chat_template:
            if n_images:
                raise ValueError("an Insert with images needs a chat role (and a chat template)")
            return insert.text
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        probe = [
            *system,
            {"role": "user", "content": "Q"},
            {"role": "assistant", "content": _TURN_PROBE},
        ]
        base = self._render_chat(probe, False)
        message = {"role": insert.role, "content": self._chat_content(insert.text, n_images)}
        full = self._render_chat([*probe, message], True)
        if _TURN_PROBE not in base or not full.startswith(base):
            raise ValueError(
                "the chat template does not render a conversation as a prefix of its continuation, so a "
                "message cannot be appended after a generated turn; return Insert(role=None, text=...) with "
                "the exact text instead"
            )
        closing = base[base.rindex(_TURN_PROBE) + len(_TURN_PROBE) :]
        if previous is not None and previous.ids and previous.ids[-1] in self.eos_ids:
            eos_text = self.tokenizer.decode([previous.ids[-1]], skip_special_tokens=False)
            if eos_text and closing.startswith(eos_text):
                closing = closing[len(eos_text) :]
        return closing + full[len(base) :]

    # ------------------------------------------------------------------ turns
    def start_conversations(self, rows: list[dict[str, Any]], group_size: int) -> list[Conversation]:
        """`group_size` empty conversations per row; the prompt is tokenized once per row."""
        conversations: list[Conversation] = []
        for row in rows:
            prompt = self._prompt_token_ids(str(row["prompt"]))
            for g in range(group_size):
                conversations.append(
                    Conversation(index=len(conversations), group_index=g, row=row, prompt=prompt)
                )
        return conversations

    def _sequence_ids(self, conversation: Conversation) -> list[int]:
        """Prompt + completion region so far, as one token list."""
        return list(conversation.prompt) + [t for seg in conversation.segments for t in seg.ids]

    def generate_turn(self, conversations: list[Conversation], budgets: list[int]) -> list[Segment]:
        """One batched `generate` over the conversations' whole sequences (left-padded), then each new turn
        cut to its budget and after its EOS / stop string. With a rollout engine: `engine_turn`."""
        if self.engine_client.engine is not None:
            return self.engine_turn(conversations, budgets)
        max_new = max(budgets)
        pad = self.tokenizer.pad_token_id

        def generate(chunk: list[Conversation]) -> Tensor:
            ids, att = self._left_pad([self._sequence_ids(c) for c in chunk])
            kwargs = {**self._sampling_kwargs(), "max_new_tokens": max_new}
            out = self.model.generate(
                input_ids=ids.to(self.device), attention_mask=att.to(self.device), **kwargs
            )
            return out[:, ids.shape[1] :].cpu()

        parts = self._generate_in_chunks(conversations, generate)
        new = torch.cat([pad_right(x, max(q.shape[1] for q in parts), pad) for x in parts])
        return self._turn_segments(new, budgets)

    def engine_prompt_of(self, conversation: Conversation) -> Any:
        """The rollout engine's prompt for a conversation: its whole token sequence so far (`VLMPolicy`: a
        `mmalign.engines.MultimodalPrompt` with the images)."""
        return self._sequence_ids(conversation)

    def engine_turn(self, conversations: list[Conversation], budgets: list[int]) -> list[Segment]:
        """One turn per conversation sampled by the rollout engine (one call, one sample each, at most
        ``max(budgets)`` new tokens, the policy's temperature / top-k / top-p / stop settings, a seed of its
        own per turn: `TURN_SEED_STRIDE`), cut as `generate_turn` cuts; each segment keeps the engine's
        log-probs of its tokens (`Segment.logprobs`)."""
        turn = len(conversations[0].turns) if conversations else 0
        spec = self._engine_sampling(self.suppressed_ids)
        seed = None if spec.seed is None else spec.seed + turn * TURN_SEED_STRIDE
        spec = dataclasses.replace(spec, max_new_tokens=max(budgets), seed=seed)
        prompts = [self.engine_prompt_of(c) for c in conversations]
        new, logp = self.engine_client.generate(prompts, 1, spec, self.tokenizer.pad_token_id)
        return self._turn_segments(new, budgets, logp)

    def _turn_segments(
        self, new_ids: Tensor, budgets: list[int], logp: Tensor | None = None
    ) -> list[Segment]:
        """Generated turns as segments: at most `budgets[i]` tokens, up to and including EOS / stop string;
        `logp` (Float[B, T], an engine's log-probs of `new_ids`) is kept per segment."""
        segments = []
        for i, (row, budget) in enumerate(zip(new_ids, budgets, strict=True)):
            ids = row[:budget][None]
            stop = self._stop_lengths(ids) if self.stop_strings else None
            n = int(completion_mask(ids, self.eos_ids, stop).sum())
            kept = ids[0, :n].tolist()
            finished = bool(kept) and kept[-1] in self.eos_ids
            if stop is not None and int(stop[0]) <= n:
                finished = True
            text = self.tokenizer.decode(kept, skip_special_tokens=True)
            logprobs = None if logp is None else logp[i, :n].tolist()
            segments.append(Segment(ids=kept, trained=True, text=text, finished=finished, logprobs=logprobs))
        return segments

    def insert_segment(self, conversation: Conversation, insert: Insert) -> Segment:
        """The tokens of `insert` after `conversation` (`insert_text`, tokenized without special tokens)."""
        previous = conversation.segments[-1] if conversation.segments else None
        text = self.insert_text(insert, previous)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return Segment(ids=list(ids), trained=False, text=insert.text)

    # ------------------------------------------------------------------ the rollout
    def finish_conversations(
        self,
        rows: list[dict[str, Any]],
        group_size: int,
        conversations: list[Conversation],
        *,
        compute_logp: bool,
    ) -> Rollout:
        """The `Rollout` of finished conversations: the completion region holds every segment in order;
        ``mask`` marks the generated tokens only, ``completion_attention_mask`` every real token. Turns an
        engine sampled: the engine goes to sleep (`EngineClient.sampling_done`), its log-probs of the generated
        tokens become ``logp_sampler`` (0 elsewhere) and ``logp_old`` is always re-scored with the trainer's
        weights (as `TextPolicy`'s single-turn engine rollout does)."""
        sampled = any(seg.logprobs is not None for c in conversations for seg in c.segments)
        if sampled:
            self.engine_client.sampling_done()
        prompts, group, columns = self._rollout_fields(rows, group_size)
        b = len(conversations)
        width = max(1, max(c.length for c in conversations))
        pad = self.tokenizer.pad_token_id
        completion_ids = torch.full((b, width), pad, dtype=torch.long)
        attention = torch.zeros((b, width), dtype=torch.long)
        mask = torch.zeros((b, width), dtype=torch.bool)
        logp_engine = torch.zeros((b, width), dtype=torch.float32)
        for i, conv in enumerate(conversations):
            at = 0
            for seg in conv.segments:
                n = len(seg.ids)
                completion_ids[i, at : at + n] = torch.tensor(seg.ids, dtype=torch.long)
                attention[i, at : at + n] = 1
                mask[i, at : at + n] = seg.trained
                if seg.trained and seg.logprobs is not None:
                    logp_engine[i, at : at + n] = torch.tensor(seg.logprobs, dtype=torch.float32)
                at += n
        texts = self.tokenizer.batch_decode(
            [ids[: c.length].tolist() for ids, c in zip(completion_ids, conversations, strict=True)],
            skip_special_tokens=True,
        )
        outputs: dict[str, Any] = {
            "texts": texts,
            "num_tokens": mask.sum(dim=1),
            "truncated": torch.tensor([c.truncated for c in conversations], dtype=torch.bool),
            "turns": [c.turns for c in conversations],
            "inserted_texts": [c.inserted_texts for c in conversations],
            "num_turns": torch.tensor([len(c.turns) for c in conversations], dtype=torch.long),
            "num_inserted_tokens": attention.sum(dim=1) - mask.sum(dim=1),
            "stop_reasons": [c.stop_reason for c in conversations],
        }
        payload = {
            **self._conversation_prompt_payload(conversations, columns),
            "completion_ids": completion_ids,
            "completion_attention_mask": attention,
        }
        rollout = Rollout(
            group=group, mask=mask, prompts=prompts, columns=columns, outputs=outputs, payload=payload
        )
        if compute_logp or sampled:
            rollout.logp_old = self._logprobs(self.model, rollout, grad=False)
        if sampled:
            rollout = self.engine_client.keep_logprobs(rollout, logp_engine)
        return rollout

    def _conversation_prompt_payload(
        self, conversations: list[Conversation], columns: dict[str, list[Any]]
    ) -> dict[str, Any]:
        """The prompt part of a multi-turn payload (VLMs add token types and vision inputs, and columns)."""
        prompt_ids, prompt_mask = self._left_pad([list(c.prompt) for c in conversations])
        return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask}
