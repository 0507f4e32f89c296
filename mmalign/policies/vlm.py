"""Vision-language policy: Qwen2-VL / Qwen2.5-VL style models, one action = one generated token.

Loaded with `AutoProcessor` and `AutoModelForImageTextToText` (hub id or local folder). A row
carries ``prompt`` text and ``images`` (file paths, already resolved, or PIL images; one or
several per prompt) and optionally ``video`` (a list of frame paths or PIL frames). The prompt is
the processor's chat template over one user message: the image (and video) placeholders, then
the text. Sampling, temperature-scaled log-probs and the action mask work as in `TextPolicy`:

- rollouts use ``model.generate`` on left-padded prompts (temperature, top-p, top-k, max new
  tokens, stop strings); each row is encoded by the processor once and shared by its group;
- the payload keeps what the log-probs need: prompt ids / mask / ``mm_token_type_ids``
  (batch-first tensors), the completion ids, and the vision inputs as PER-SAMPLE LISTS:
  ``pixel_values`` [i] = Float[patches_i, D] (Qwen2-VL concatenates patches over the batch, so
  only per-sample storage slices consistently with `Rollout.__getitem__`), ``image_grid_thw`` [i]
  = Long[images_i, 3], and ``pixel_values_videos`` / ``video_grid_thw`` likewise; `action_stats`
  re-concatenates the entries of the samples in its minibatch;
- log-probs are recomputed with grad from one forward over prompt + completion (M-RoPE positions
  are computed by the model from ``mm_token_type_ids`` and the grids); the action mask covers
  only completion tokens up to and including EOS, never a prompt or image token;
- with ``shared_prefix`` (``model.shared_prefix``, on by default) and a model that has an M-RoPE
  index function (``get_rope_index``: Qwen2-VL, Qwen2.5-VL) that recompute encodes each group's
  prompt, image tokens and vision tower included, once (`_shared_prefix_vlm_logits`; same
  log-probs and gradients); generation never shares a prefix (one batched ``generate``). One log
  line at construction says whether it is on, or why it is off;
- ``Rollout.columns`` gain ``image_width`` / ``image_height`` (the first image's original size),
  ``resized_width`` / ``resized_height`` (its size as the model sees it: grid x patch size) and
  ``image_sizes`` / ``resized_sizes`` (lists of (w, h) over all of a row's images), so box rewards
  can rescale between the two;
- multi-turn (``rollout.loop: multi_turn``, `mmalign.rollout_loops`): an environment may insert text AND
  images between generated turns (a zoomed crop, a tool's picture). The completion region then holds
  generated and inserted tokens (``completion_attention_mask`` marks all real ones; ``Rollout.mask`` only
  the generated ones), ``completion_mm_token_type_ids`` types its image tokens, and ``pixel_values[i]`` /
  ``image_grid_thw[i]`` list ALL images of sample i in order (prompt images first;
  ``num_prompt_images[i]`` of them). Each turn is one batched ``generate`` over the whole sequences of
  the samples still active; log-probs come from one forward over prompt + completion region (the
  shared-prefix path passes the inserted images to the completion pass);
- ``freeze_vision`` stops gradients into the vision tower; LoRA targets the language model's
  linear layers only (`language_model_lora_targets`); the reference is the adapter disabled
  (LoRA) or a frozen copy (full fine-tuning with KL), as in `TextPolicy`.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mmalign.batch import Rollout
from mmalign.logprobs import final_hidden_states
from mmalign.policies.base import RunInfo
from mmalign.policies.text import (
    TextPolicy,
    _pad_left,
    _pad_right,
    completion_attention,
)
from mmalign.rollout_loops import Conversation, Insert, Segment

log = logging.getLogger(__name__)

LANGUAGE_LINEAR = r"(self_attn\.(q_proj|k_proj|v_proj|o_proj)|mlp\.(gate_proj|up_proj|down_proj))"
VISION_MODULE = re.compile(r"(^|\.)visual\.")
"""Parameter/module names of the vision tower (``model.visual.*`` in Qwen2-VL and Qwen2.5-VL)."""

_VISION_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
_IMAGE_KEYS = ("pixel_values", "image_grid_thw")
"""The vision inputs an insertion may add (images; videos only come with the prompt)."""


def language_model_lora_targets(target_modules: list[str] | str = "all-linear") -> str:
    """A peft ``target_modules`` regex that matches only linear layers of the language model.

    ``"all-linear"`` becomes every attention and MLP projection of ``language_model.layers``; a
    list of short names (``["q_proj", "v_proj"]``) is restricted to the language model too (in
    Qwen2.5-VL the vision blocks have ``gate_proj``/``up_proj`` as well); any other string is
    taken as the caller's own regex, unchanged.
    """
    if target_modules == "all-linear":
        leaf = LANGUAGE_LINEAR
    elif isinstance(target_modules, list):
        leaf = "(" + "|".join(r"(.*\.)?" + re.escape(m) for m in target_modules) + ")"
    else:
        return target_modules
    return rf".*language_model\.layers\.\d+\.{leaf}"


def _load_image(x: Any) -> Any:
    from PIL import Image

    if isinstance(x, Image.Image):
        return x.convert("RGB")
    with Image.open(x) as im:
        return im.convert("RGB")


def _as_list(x: Any) -> list[Any]:
    if x is None:
        return []
    return list(x) if isinstance(x, list | tuple) else [x]


class VLMPolicy(TextPolicy):
    """An image(+video)-text-to-text model as a GRPO policy. See the module docstring."""

    def __init__(
        self,
        model: torch.nn.Module,
        processor: Any,
        *,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        freeze_vision: bool = False,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("use_chat_template", True)
        self.processor = processor
        if min_pixels is not None or max_pixels is not None:
            set_pixel_range(processor, min_pixels, max_pixels)
        self.freeze_vision = freeze_vision
        if freeze_vision:
            for name, p in model.named_parameters():
                if VISION_MODULE.search(name):
                    p.requires_grad_(False)
        super().__init__(model, processor.tokenizer, **kwargs)
        ip = getattr(processor, "image_processor", None)
        self.patch_size = int(getattr(ip, "patch_size", 14) or 14)
        cfg = getattr(model, "config", None)
        vision_ids = {
            getattr(cfg, k, None)
            for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
        }
        self.suppressed_ids = sorted(i for i in vision_ids if isinstance(i, int) and i not in self.eos_ids)
        """Vision placeholder tokens are never sampled (a sampled <|image_pad|> would be read as an image
        slot when log-probs are recomputed); they are masked out of the recomputed distribution too."""
        self.shared_prefix = self._resolve_shared_prefix(self.shared_prefix)

    def _resolve_shared_prefix(self, requested: bool) -> bool:
        """Whether log-probs use the shared-prefix forward (`_shared_prefix_vlm_logits`); logs one line.

        In a VLM the flag only governs the log-prob recompute: generation (`_generate_vlm`) always
        runs the plain batched `generate`, because `TextPolicy._prefill` builds its cache with 1-D
        positions and no vision inputs. The shared forward needs the model's M-RoPE index function
        (`get_rope_index`, Qwen2-VL / Qwen2.5-VL) to split the 3-D positions between prompt and
        completions, and is not used under gradient checkpointing (as in `TextPolicy`)."""
        if not requested:
            log.info(
                "shared prefix: off (model.shared_prefix: false); log-probs use the plain per-sample forward"
            )
            return False
        if _rope_index_fn(self.model) is None:
            log.warning(
                "shared prefix: off (%s has no M-RoPE get_rope_index, so prompt and completion positions "
                "cannot be split); log-probs use the plain per-sample forward",
                type(_base_model(self.model)).__name__,
            )
            return False
        if _checkpointing_enabled(self.model):
            log.warning(
                "shared prefix: off (gradient checkpointing is on: the model keeps no KV cache of the prompt "
                "in training); log-probs use the plain per-sample forward"
            )
            return False
        log.info("shared prefix: on (prompt + image tokens encoded once per group for log-probs)")
        return True

    # ------------------------------------------------------------------ building
    # `TextPolicy.from_pretrained` builds a VLMPolicy through these two hooks.
    @staticmethod
    def _load_pretrained(name_or_path: str, load_kwargs: dict[str, Any]) -> tuple[Any, torch.nn.Module]:
        """(processor, model) through `AutoProcessor` and `AutoModelForImageTextToText`."""
        from transformers import AutoModelForImageTextToText, AutoProcessor

        processor = AutoProcessor.from_pretrained(
            name_or_path, trust_remote_code=load_kwargs["trust_remote_code"]
        )
        return processor, AutoModelForImageTextToText.from_pretrained(name_or_path, **load_kwargs)

    @staticmethod
    def _lora_targets(target_modules: list[str] | str) -> list[str] | str:
        """LoRA on the language model's linear layers only: the vision tower gets no adapters."""
        return language_model_lora_targets(target_modules)

    # ------------------------------------------------------------------ prompts
    def format_vlm_prompt(self, prompt: str, num_images: int, has_video: bool) -> str:
        content: list[dict[str, Any]] = [{"type": "image"} for _ in range(num_images)]
        if has_video:
            content.append({"type": "video"})
        content.append({"type": "text", "text": prompt})
        messages: list[dict[str, Any]] = []
        if self.system_prompt:
            messages.append({"role": "system", "content": self.system_prompt})
        messages.append({"role": "user", "content": content})
        return self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def _chat_content(self, text: str, num_images: int) -> Any:
        """An inserted message's content: its image parts, then the text (as in `format_vlm_prompt`)."""
        return [*({"type": "image"} for _ in range(num_images)), {"type": "text", "text": text}]

    def _render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        return self.processor.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def encode_row(self, row: dict[str, Any]) -> dict[str, Any]:
        """Processor outputs for one row (unbatched): ids, token types, vision tensors, image sizes."""
        images = [_load_image(x) for x in _as_list(row.get("images", row.get("image")))]
        frames = [_load_image(x) for x in _as_list(row.get("video"))]
        text = self.format_vlm_prompt(str(row["prompt"]), len(images), bool(frames))
        kwargs: dict[str, Any] = {"text": [text], "return_tensors": "pt"}
        if images:
            kwargs["images"] = images
        if frames:
            kwargs["videos"] = [frames]
        enc = self.processor(**kwargs)
        out: dict[str, Any] = {
            "input_ids": enc["input_ids"][0],
            "mm_token_type_ids": enc["mm_token_type_ids"][0]
            if "mm_token_type_ids" in enc
            else torch.zeros_like(enc["input_ids"][0]),
            "image_sizes": [(im.width, im.height) for im in images],
        }
        for key in _VISION_KEYS:
            out[key] = enc[key] if key in enc else None
        grid = out["image_grid_thw"]
        out["resized_sizes"] = (
            [(int(w) * self.patch_size, int(h) * self.patch_size) for _, h, w in grid.tolist()]
            if grid is not None
            else []
        )
        return out

    def batch_inputs(self, encs: list[dict[str, Any]]) -> dict[str, Tensor]:
        """Left-padded model inputs for a list of `encode_row` outputs (vision tensors concatenated)."""
        width = max(e["input_ids"].shape[0] for e in encs)
        pad = self.tokenizer.pad_token_id
        ids = torch.full((len(encs), width), pad, dtype=torch.long)
        att = torch.zeros((len(encs), width), dtype=torch.long)
        tt = torch.zeros((len(encs), width), dtype=torch.long)
        for i, e in enumerate(encs):
            n = e["input_ids"].shape[0]
            ids[i, width - n :] = e["input_ids"]
            att[i, width - n :] = 1
            tt[i, width - n :] = e["mm_token_type_ids"]
        out: dict[str, Tensor] = {"input_ids": ids, "attention_mask": att, "mm_token_type_ids": tt}
        out.update(_cat_vision([{k: e[k] for k in _VISION_KEYS} for e in encs]))
        return out

    # ------------------------------------------------------------------ rollout
    def setup(self, run: RunInfo) -> None:
        """Build the rollout engine named by ``rollout.engine`` as `TextPolicy` does (``hf``: `generate`
        samples); a VLM engine gets the processor (``fake``) or the resize bounds (``vllm``)."""
        TextPolicy.setup(self, run)

    def _engine_defaults(self, engine: str, kwargs: dict[str, Any], run: RunInfo) -> None:
        """`TextPolicy._engine_defaults`, plus what a VLM engine needs to process images exactly as this
        policy does: the processor itself (``fake``), or vLLM's ``mm_processor_kwargs`` with the same
        ``min_pixels`` / ``max_pixels`` and a ``limit_mm_per_prompt`` (``vllm``)."""
        super()._engine_defaults(engine, kwargs, run)
        if engine == "fake":
            kwargs.setdefault("processor", self.processor)
        elif engine == "vllm":
            ip = self.processor.image_processor
            llm = dict(kwargs.get("llm_kwargs") or {})
            bounds = {
                k: getattr(ip, k) for k in ("min_pixels", "max_pixels") if getattr(ip, k, None) is not None
            }
            llm.setdefault("mm_processor_kwargs", bounds)
            llm.setdefault("limit_mm_per_prompt", {"image": 8})
            kwargs["llm_kwargs"] = llm

    @staticmethod
    def _size_columns(encs: list[dict[str, Any]]) -> dict[str, list[Any]]:
        """Per sample: the prompt images' original and resized sizes (for box rewards)."""
        return {
            "image_width": [e["image_sizes"][0][0] if e["image_sizes"] else None for e in encs],
            "image_height": [e["image_sizes"][0][1] if e["image_sizes"] else None for e in encs],
            "resized_width": [e["resized_sizes"][0][0] if e["resized_sizes"] else None for e in encs],
            "resized_height": [e["resized_sizes"][0][1] if e["resized_sizes"] else None for e in encs],
            "image_sizes": [list(e["image_sizes"]) for e in encs],
            "resized_sizes": [list(e["resized_sizes"]) for e in encs],
        }

    @torch.no_grad()
    def single_turn_rollout(
        self, rows: list[dict[str, Any]], group_size: int, *, compute_logp: bool = True
    ) -> Rollout:
        """Sample `group_size` completions per row (``prompt`` + ``images`` / ``video``)."""
        row_encs = [self.encode_row(r) for r in rows]
        encs = [e for e in row_encs for _ in range(group_size)]  # shared, not copied
        prompts, group, columns = self._rollout_fields(rows, group_size)
        columns.update(self._size_columns(encs))
        if self.engine is not None:
            return self._vlm_rollout_with_engine(rows, row_encs, group_size, prompts, group, columns)

        parts = self._generate_in_chunks(encs, self._generate_vlm)
        p_width = max(p[0].shape[1] for p in parts)
        c_width = max(p[3].shape[1] for p in parts)
        pad = self.tokenizer.pad_token_id
        extra: dict[str, Any] = {"mm_token_type_ids": torch.cat([_pad_left(p[2], p_width, 0) for p in parts])}
        for key in _VISION_KEYS:
            extra[key] = [e[key] for e in encs]  # per-sample list: slices with the batch
        return self._finish_rollout(
            prompts,
            group,
            columns,
            torch.cat([_pad_left(p[0], p_width, pad) for p in parts]),
            torch.cat([_pad_left(p[1], p_width, 0) for p in parts]),
            torch.cat([_pad_right(p[3], c_width, pad) for p in parts]),
            compute_logp,
            extra_payload=extra,
        )

    def engine_prompt(self, row: dict[str, Any]) -> Any:
        """The rollout engine's prompt for a row: the token ids of the chat-templated text with ONE
        placeholder per image and the images (a `MultimodalPrompt`; the engine expands the placeholders),
        or plain token ids for a row without images."""
        from mmalign.engines import MultimodalPrompt

        if row.get("video") is not None:
            raise ValueError(
                "a video row cannot be sampled with a rollout engine yet; use rollout.engine: hf for video"
            )
        images = [_load_image(x) for x in _as_list(row.get("images", row.get("image")))]
        text = self.format_vlm_prompt(str(row["prompt"]), len(images), False)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return MultimodalPrompt(ids, images) if images else ids

    def _vlm_rollout_with_engine(
        self,
        rows: list[dict[str, Any]],
        row_encs: list[dict[str, Any]],
        group_size: int,
        prompts: list[str],
        group: Tensor,
        columns: dict[str, list[Any]],
    ) -> Rollout:
        """Sample with `self.engine` (images passed as its multimodal inputs); the payload holds this policy's
        own processor outputs, ``logp_old`` is recomputed with the trainer's weights and the engine's
        log-probs are kept as ``rollout.logp_sampler`` for the importance-sampling correction (as in
        `TextPolicy._rollout_with_engine`)."""
        from mmalign.engines import outputs_to_tensors

        spec = self._engine_sampling(self.suppressed_ids)
        outs = self.engine.generate([self.engine_prompt(r) for r in rows], group_size, spec)
        completion_ids, logp_engine, _ = outputs_to_tensors(outs, self.tokenizer.pad_token_id)
        batch = self.batch_inputs(row_encs)
        extra: dict[str, Any] = {
            "mm_token_type_ids": batch["mm_token_type_ids"].repeat_interleave(group_size, 0)
        }
        for key in _VISION_KEYS:
            extra[key] = [e[key] for e in row_encs for _ in range(group_size)]
        rollout = self._finish_rollout(
            prompts,
            group,
            columns,
            batch["input_ids"].repeat_interleave(group_size, 0),
            batch["attention_mask"].repeat_interleave(group_size, 0),
            completion_ids,
            True,
            extra_payload=extra,
        )
        return self._keep_engine_logprobs(rollout, logp_engine)

    def _generate_vlm(self, encs: list[dict[str, Any]]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        inputs = {k: v.to(self.device) for k, v in self.batch_inputs(encs).items()}
        kwargs = self._sampling_kwargs()
        if self.suppressed_ids:
            kwargs["suppress_tokens"] = self.suppressed_ids
        ids = inputs["input_ids"]
        out = self.model.generate(**inputs, **kwargs)
        return (
            ids.cpu(),
            inputs["attention_mask"].cpu(),
            inputs["mm_token_type_ids"].cpu(),
            out[:, ids.shape[1] :].cpu(),
        )

    # ------------------------------------------------------------------ multi-turn primitives
    def start_conversations(self, rows: list[dict[str, Any]], group_size: int) -> list[Conversation]:
        """`group_size` empty conversations per row; each row is encoded by the processor once."""
        conversations: list[Conversation] = []
        for row in rows:
            enc = self.encode_row(row)
            for g in range(group_size):
                conversations.append(
                    Conversation(index=len(conversations), group_index=g, row=row, prompt=enc)
                )
        return conversations

    def _conversation_enc(self, conversation: Conversation) -> dict[str, Any]:
        """The whole sequence so far in `encode_row`'s format: ids, token types, all vision inputs."""
        enc = conversation.prompt
        ids = [enc["input_ids"]]
        types = [enc["mm_token_type_ids"]]
        for seg in conversation.segments:
            ids.append(torch.tensor(seg.ids, dtype=torch.long))
            types.append(
                torch.tensor(seg.token_types, dtype=torch.long)
                if seg.token_types is not None
                else torch.zeros(len(seg.ids), dtype=torch.long)
            )
        out: dict[str, Any] = {"input_ids": torch.cat(ids), "mm_token_type_ids": torch.cat(types)}
        out.update(_sample_vision(enc, [s.vision for s in conversation.segments]))
        return out

    def generate_turn(self, conversations: list[Conversation], budgets: list[int]) -> list[Segment]:
        """One batched `generate` over the conversations' whole sequences (prompt and inserted images
        included), each new turn cut to its budget and after its EOS / stop string."""
        max_new = max(budgets)
        pad = self.tokenizer.pad_token_id

        def generate(chunk: list[Conversation]) -> Tensor:
            inputs = {
                k: v.to(self.device)
                for k, v in self.batch_inputs([self._conversation_enc(c) for c in chunk]).items()
            }
            kwargs = {**self._sampling_kwargs(), "max_new_tokens": max_new}
            if self.suppressed_ids:
                kwargs["suppress_tokens"] = self.suppressed_ids
            out = self.model.generate(**inputs, **kwargs)
            return out[:, inputs["input_ids"].shape[1] :].cpu()

        parts = self._generate_in_chunks(conversations, generate)
        new = torch.cat([_pad_right(x, max(q.shape[1] for q in parts), pad) for x in parts])
        return self._turn_segments(new, budgets)

    def insert_segment(self, conversation: Conversation, insert: Insert) -> Segment:
        """`insert` through the processor: the chat-formatted text (`insert_text`) with its images' tokens
        expanded, their token types and vision tensors."""
        previous = conversation.segments[-1] if conversation.segments else None
        text = self.insert_text(insert, previous)
        images = [_load_image(x) for x in insert.images]
        kwargs: dict[str, Any] = {"text": [text], "return_tensors": "pt", "add_special_tokens": False}
        if images:
            kwargs["images"] = images
        enc = self.processor(**kwargs)
        ids = enc["input_ids"][0]
        types = enc["mm_token_type_ids"][0] if "mm_token_type_ids" in enc else torch.zeros_like(ids)
        vision = {k: enc[k] if k in enc else None for k in _IMAGE_KEYS}
        return Segment(
            ids=ids.tolist(),
            trained=False,
            text=insert.text,
            token_types=types.tolist(),
            vision=vision,
            images=images,
        )

    def _conversation_prompt_payload(
        self, conversations: list[Conversation], columns: dict[str, list[Any]]
    ) -> dict[str, Any]:
        """Prompt ids / mask / token types (left-padded), the completion region's token types, and the
        per-sample vision lists of ALL images (prompt ones first, ``num_prompt_images`` of them)."""
        encs = [c.prompt for c in conversations]
        columns.update(self._size_columns(encs))
        batch = self.batch_inputs(encs)
        width = max(1, max(c.length for c in conversations))
        completion_types = torch.zeros((len(conversations), width), dtype=torch.long)
        for i, conv in enumerate(conversations):
            at = 0
            for seg in conv.segments:
                if seg.token_types is not None:
                    completion_types[i, at : at + len(seg.ids)] = torch.tensor(
                        seg.token_types, dtype=torch.long
                    )
                at += len(seg.ids)
        out: dict[str, Any] = {
            "prompt_ids": batch["input_ids"],
            "prompt_mask": batch["attention_mask"],
            "mm_token_type_ids": batch["mm_token_type_ids"],
            "completion_mm_token_type_ids": completion_types,
            "num_prompt_images": torch.tensor(
                [0 if e["image_grid_thw"] is None else int(e["image_grid_thw"].shape[0]) for e in encs],
                dtype=torch.long,
            ),
        }
        merged = [_sample_vision(c.prompt, [s.vision for s in c.segments]) for c in conversations]
        for key in _VISION_KEYS:
            out[key] = [m[key] for m in merged]  # per-sample list: slices with the batch
        return out

    # ------------------------------------------------------------------ log-probs
    def _logprobs(
        self,
        model: torch.nn.Module,
        rollout: Rollout,
        *,
        grad: bool,
        entropy_out: list[Tensor] | None = None,
        chunked: bool | None = None,
    ) -> Tensor:
        """`TextPolicy._logprobs` for image-text sequences (vision inputs per sample; the vision placeholder
        tokens suppressed, as when sampling); chunked through the output head like the text policy."""
        chunked = self._use_chunked(model) if chunked is None else chunked
        p = rollout.payload
        dev = self.device
        prompt_ids, prompt_mask = p["prompt_ids"].to(dev), p["prompt_mask"].to(dev)
        completion_ids = p["completion_ids"].to(dev)
        mask = rollout.mask.to(dev)
        t = completion_ids.shape[1]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention = torch.cat([prompt_mask, completion_attention(rollout).to(dev)], dim=1)
        completion_types = p.get("completion_mm_token_type_ids")
        completion_types = (
            torch.zeros_like(completion_ids) if completion_types is None else completion_types.to(dev)
        )
        token_types = torch.cat([p["mm_token_type_ids"].to(dev), completion_types], dim=1)
        vision = {
            k: v.to(dev)
            for k, v in _cat_vision([{k: p[k][i] for k in _VISION_KEYS} for i in range(len(rollout))]).items()
        }
        kwargs: dict[str, Any] = {}
        if not vision:  # text-only rows: 1-D positions that skip the left padding
            kwargs["position_ids"] = (attention.cumsum(dim=1) - 1).clamp(min=0)
        with torch.set_grad_enabled(grad):
            rope = (
                _rope_index_fn(model)
                if self.shared_prefix and vision and not self._gradient_checkpointing()
                else None
            )
            if rope is not None:
                features = self._shared_prefix_vlm_logits(
                    model,
                    rope,
                    rollout,
                    input_ids,
                    attention,
                    token_types,
                    prompt_ids.shape[1],
                    t,
                    hidden=chunked,
                    grad=grad,
                )
            else:
                inputs = dict(
                    input_ids=input_ids,
                    attention_mask=attention,
                    mm_token_type_ids=token_types,
                    use_cache=False,
                    **vision,
                    **kwargs,
                )
                if chunked:
                    features = final_hidden_states(model, grad=grad, **inputs)[0][:, -t - 1 : -1, :]
                else:
                    features = model(**inputs, logits_to_keep=t + 1).logits[:, -t - 1 : -1, :]
            # the distribution that was sampled: no vision placeholders
            logp, entropy = self._score_features(
                model,
                features,
                completion_ids,
                mask,
                chunked=chunked,
                with_entropy=entropy_out is not None,
                suppressed_ids=self.suppressed_ids,
            )
        if chunked and not self._chunking_checked:
            self._check_chunking(model, rollout, logp)
        if entropy_out is not None:
            assert entropy is not None
            entropy_out.append(entropy.masked_fill(~mask, 0.0))
        return logp.masked_fill(~mask, 0.0)

    def _shared_prefix_vlm_logits(
        self,
        model: torch.nn.Module,
        rope: Any,
        rollout: Rollout,
        input_ids: Tensor,
        attention: Tensor,
        token_types: Tensor,
        p: int,
        t: int,
        *,
        hidden: bool = False,
        grad: bool = True,
    ) -> Tensor:
        """Shared-prefix forward for VLMs: each group's prompt, image tokens included, is encoded once
        (the vision tower runs once per group too) and its KV cache is gathered for the completions.

        Qwen2-VL's 3-D M-RoPE positions are computed for the full prompt + completion sequences first
        and split between the two passes, so log-probs and gradients equal the plain forward. Images
        inserted into the completion region (multi-turn) go to the completion pass."""
        from transformers import DynamicCache

        dev = input_ids.device
        p_load = rollout.payload
        vision_all = {
            k: v.to(dev)
            for k, v in _cat_vision(
                [{k: p_load[k][i] for k in _VISION_KEYS} for i in range(len(rollout))]
            ).items()
        }
        positions, _ = rope(
            input_ids,
            mm_token_type_ids=token_types,
            image_grid_thw=vision_all.get("image_grid_thw"),
            video_grid_thw=vision_all.get("video_grid_thw"),
            attention_mask=attention,
        )
        group = rollout.group.to(dev)
        uniq, inverse = torch.unique(group, return_inverse=True)
        first = torch.full((uniq.numel(),), group.numel(), dtype=torch.long, device=dev)
        first = first.scatter_reduce(0, inverse, torch.arange(group.numel(), device=dev), reduce="amin")
        firsts = first.tolist()
        split = [_split_vision(p_load, i) for i in range(len(rollout))]
        vision = {k: v.to(dev) for k, v in _cat_vision([split[i][0] for i in firsts]).items()}
        inserted = {k: v.to(dev) for k, v in _cat_vision([s[1] for s in split]).items()}
        prefix_model = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
        prefix_inputs = dict(
            input_ids=input_ids[first, :p],
            attention_mask=attention[first, :p],
            mm_token_type_ids=token_types[first, :p],
            position_ids=positions[:, first, :p],
            past_key_values=DynamicCache(),
            use_cache=True,
            **vision,
        )
        if hidden:
            h_p, out_p = final_hidden_states(prefix_model, grad=grad, **prefix_inputs)
            last_p = h_p[:, -1:, :]
        else:
            out_p = prefix_model(**prefix_inputs, logits_to_keep=1)
            last_p = out_p.logits[:, -1:, :]
        cache = out_p.past_key_values
        cache.batch_select_indices(inverse)
        inputs = dict(
            input_ids=input_ids[:, p:],
            attention_mask=attention,
            mm_token_type_ids=token_types[:, p:],
            position_ids=positions[:, :, p:],
            past_key_values=cache,
            use_cache=True,
            **inserted,
        )
        rest = final_hidden_states(model, grad=grad, **inputs)[0] if hidden else model(**inputs).logits
        return torch.cat([last_p[inverse], rest[:, :-1, :]], dim=1)

    # ------------------------------------------------------------------ weights
    def save(self, path: str | Path) -> None:
        """`save_pretrained` of the adapter (LoRA) or the whole model, plus the processor."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(path)
        self.processor.save_pretrained(path)


def set_pixel_range(processor: Any, min_pixels: int | None, max_pixels: int | None) -> None:
    """Set the image (and video) processor's resize bounds (``size`` shortest/longest edge = pixel counts)."""
    for name in ("image_processor", "video_processor"):
        ip = getattr(processor, name, None)
        if ip is None:
            continue
        size = dict(getattr(ip, "size", None) or {})
        if min_pixels is not None:
            size["shortest_edge"] = int(min_pixels)
            if hasattr(ip, "min_pixels"):
                ip.min_pixels = int(min_pixels)
        if max_pixels is not None:
            size["longest_edge"] = int(max_pixels)
            if hasattr(ip, "max_pixels"):
                ip.max_pixels = int(max_pixels)
        ip.size = size


def _rope_index_fn(model: torch.nn.Module) -> Any:
    """The model's M-RoPE index function (`get_rope_index`), through peft/DDP wrappers; None if absent."""
    for module in model.modules():
        fn = getattr(module, "get_rope_index", None)
        if callable(fn):
            return fn
    return None


def _base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under a peft wrapper (the model itself otherwise)."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def _checkpointing_enabled(model: torch.nn.Module) -> bool:
    """Gradient (activation) checkpointing switched on, whether or not the model is in training mode."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):  # transformers >= 5 name first
        flag = getattr(model, name, None)
        if flag is not None:
            return bool(flag)
    return False


def _sample_vision(
    prompt_enc: dict[str, Any], inserted: list[dict[str, Tensor | None]]
) -> dict[str, Tensor | None]:
    """One sample's vision inputs: the prompt's, then the images of each insertion, in order."""
    out: dict[str, Tensor | None] = {}
    for key in _VISION_KEYS:
        parts = [prompt_enc.get(key)] + [v.get(key) for v in inserted]
        parts = [x for x in parts if x is not None]
        out[key] = torch.cat(parts, dim=0) if len(parts) > 1 else (parts[0] if parts else None)
    return out


def _split_vision(
    payload: dict[str, Any], i: int
) -> tuple[dict[str, Tensor | None], dict[str, Tensor | None]]:
    """Sample `i`'s vision inputs split into the prompt's and those inserted after it (multi-turn): the
    first ``num_prompt_images[i]`` images (all of them when the payload has no such key) are the prompt's."""
    prompt: dict[str, Tensor | None] = {k: payload[k][i] for k in _VISION_KEYS}
    grid = prompt["image_grid_thw"]
    counts = payload.get("num_prompt_images")
    if grid is None or counts is None or int(counts[i]) >= grid.shape[0]:
        return prompt, {}
    k = int(counts[i])
    rows = int(grid[:k].prod(dim=-1).sum())
    pixels = prompt["pixel_values"]
    assert pixels is not None
    inserted = {"pixel_values": pixels[rows:], "image_grid_thw": grid[k:]}
    prompt["pixel_values"] = pixels[:rows] if k else None
    prompt["image_grid_thw"] = grid[:k] if k else None
    return prompt, inserted


def _cat_vision(items: list[dict[str, Tensor | None]]) -> dict[str, Tensor]:
    """Concatenate per-sample vision tensors (patches, grids) in batch order; absent keys are left out."""
    out: dict[str, Tensor] = {}
    for key in _VISION_KEYS:
        parts = [it[key] for it in items if it.get(key) is not None]
        if parts:
            out[key] = torch.cat(parts, dim=0)  # type: ignore[arg-type]
    return out
