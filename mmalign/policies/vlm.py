"""Vision-language policy: Qwen2-VL / Qwen2.5-VL style models, one action = one generated token.

Loaded with `AutoProcessor` and `AutoModelForImageTextToText`. A row carries ``prompt`` text, ``images``
(paths or PIL images) and optionally ``video`` (frames); the prompt is the processor's chat template over one
user message (the vision placeholders, then the text). Sampling, the action mask and multi-turn work as in
`TextPolicy`; the payload keeps prompt ids / mask / ``mm_token_type_ids`` and the vision inputs as PER-SAMPLE
LISTS (``pixel_values[i]``, ``image_grid_thw[i]``, videos likewise, so they slice with the batch; multi-turn:
all images of sample i in order, ``num_prompt_images[i]`` of them the prompt's). Log-probs use the token
scorer with M-RoPE positions (`MRopePositions`); vision placeholders are never sampled and are suppressed
when scoring. ``Rollout.columns`` gain the first image's original and resized sizes (and lists over all
images) for box rewards. ``freeze_vision`` stops gradients into the vision tower; LoRA targets the language
model only.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mmalign.data.batch import Rollout
from mmalign.data.media import load_rgb
from mmalign.data.rollout_loops import Conversation, Insert, Segment
from mmalign.policies.base import RunInfo
from mmalign.policies.text import TextPolicy
from mmalign.policies.token_sampling import pad_left, pad_right
from mmalign.policies.token_scoring import (
    VISION_KEYS,
    MRopePositions,
    cat_vision,
    checkpointing_on,
    rope_index_fn,
)

log = logging.getLogger(__name__)

LANGUAGE_LINEAR = r"(self_attn\.(q_proj|k_proj|v_proj|o_proj)|mlp\.(gate_proj|up_proj|down_proj))"
VISION_MODULE = re.compile(r"(^|\.)visual\.")
"""Parameter/module names of the vision tower (``model.visual.*`` in Qwen2-VL and Qwen2.5-VL)."""

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


def _as_list(x: Any) -> list[Any]:
    if x is None:
        return []
    return list(x) if isinstance(x, list | tuple) else [x]


def _row_images(row: dict[str, Any], value: Any) -> list[Any]:
    """`load_rgb` of each image in `value` (a column of `row`); one that does not decode (a truncated or
    corrupt file) is a DataError naming the row's file:line and the image, not PIL's bare message."""
    from mmalign.data.rows import DataError

    out = []
    for x in _as_list(value):
        try:
            out.append(load_rgb(x))
        except Exception as e:  # noqa: BLE001 - PIL raises OSError, SyntaxError, ValueError...
            raise DataError(
                f"{row.get('_source', '?')}: image {x} cannot be decoded ({type(e).__name__}: {e}); replace "
                "the file or remove the row (options.on_bad_row: skip skips such rows when the data is loaded)"
            ) from e
    return out


class VLMPolicy(TextPolicy):
    """An image(+video)-text-to-text model as a GRPO policy. See the module docstring."""

    position_scheme = MRopePositions

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
        """Whether log-probs use the shared-prefix forward (logs one line saying so, or why not). Generation
        never shares a prefix here (`TextPolicy._prefill` has 1-D positions and no vision inputs); the scorer
        needs the model's M-RoPE ``get_rope_index`` and no gradient checkpointing."""
        if not requested:
            log.info(
                "shared prefix: off (model.shared_prefix: false); log-probs use the plain per-sample forward"
            )
            return False
        if rope_index_fn(self.model) is None:
            log.warning(
                "shared prefix: off (%s has no M-RoPE get_rope_index, so prompt and completion positions "
                "cannot be split); log-probs use the plain per-sample forward",
                type(_base_model(self.model)).__name__,
            )
            return False
        if checkpointing_on(self.model):
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
        """Processor outputs for one row (unbatched): ids, token types, vision tensors, image sizes, and the
        loaded ``images`` (a rollout engine processes them itself)."""
        images = _row_images(row, row.get("images", row.get("image")))
        frames = _row_images(row, row.get("video"))
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
            "images": images,
        }
        for key in VISION_KEYS:
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
        out.update(cat_vision([{k: e[k] for k in VISION_KEYS} for e in encs]))
        return out

    # ------------------------------------------------------------------ rollout
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
        extra: dict[str, Any] = {"mm_token_type_ids": torch.cat([pad_left(p[2], p_width, 0) for p in parts])}
        for key in VISION_KEYS:
            extra[key] = [e[key] for e in encs]  # per-sample list: slices with the batch
        return self._finish_rollout(
            prompts,
            group,
            columns,
            torch.cat([pad_left(p[0], p_width, pad) for p in parts]),
            torch.cat([pad_left(p[1], p_width, 0) for p in parts]),
            torch.cat([pad_right(p[3], c_width, pad) for p in parts]),
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
        images = _row_images(row, row.get("images", row.get("image")))
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
        spec = self._engine_sampling(self.suppressed_ids)
        completion_ids, logp_engine = self.engine_client.generate(
            [self.engine_prompt(r) for r in rows], group_size, spec, self.tokenizer.pad_token_id
        )
        self.engine_client.sampling_done()  # the engine sleeps while the trainer scores and updates
        batch = self.batch_inputs(row_encs)
        extra: dict[str, Any] = {
            "mm_token_type_ids": batch["mm_token_type_ids"].repeat_interleave(group_size, 0)
        }
        for key in VISION_KEYS:
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
        return self.engine_client.keep_logprobs(rollout, logp_engine)

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

    def engine_prompt_of(self, conversation: Conversation) -> Any:
        """The rollout engine's prompt for a conversation: its token sequence so far with each image's run of
        placeholder tokens collapsed to ONE placeholder (the engine expands it again, `engine_prompt`), and
        all its images in order (the prompt's, then the inserted ones)."""
        from mmalign.engines import MultimodalPrompt

        enc = conversation.prompt
        if enc.get("pixel_values_videos") is not None:
            raise ValueError(
                "a video row cannot be sampled with a rollout engine yet; use rollout.engine: hf for video"
            )
        image_token = getattr(getattr(self.model, "config", None), "image_token_id", None)
        ids = [int(t) for t in enc["input_ids"].tolist()] + [t for s in conversation.segments for t in s.ids]
        images = list(enc.get("images") or []) + [im for s in conversation.segments for im in s.images]
        if not images:
            return ids
        collapsed = [t for k, t in enumerate(ids) if t != image_token or k == 0 or ids[k - 1] != image_token]
        slots = sum(t == image_token for t in collapsed)
        if slots != len(images):
            raise ValueError(
                f"sample {conversation.index}: {slots} runs of image placeholder tokens for {len(images)} images; "
                "two images whose placeholders touch cannot be told apart for the rollout engine (the chat "
                "template should put vision start / end tokens around each)"
            )
        return MultimodalPrompt(collapsed, images)

    def generate_turn(self, conversations: list[Conversation], budgets: list[int]) -> list[Segment]:
        """One batched `generate` over the conversations' whole sequences (prompt and inserted images
        included), each new turn cut to its budget and after its EOS / stop string. With a rollout engine:
        `engine_turn` (the images as its multimodal inputs, `engine_prompt_of`)."""
        if self.engine_client.engine is not None:
            return self.engine_turn(conversations, budgets)
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
        new = torch.cat([pad_right(x, max(q.shape[1] for q in parts), pad) for x in parts])
        return self._turn_segments(new, budgets)

    def insert_segment(self, conversation: Conversation, insert: Insert) -> Segment:
        """`insert` through the processor: the chat-formatted text (`insert_text`) with its images' tokens
        expanded, their token types and vision tensors."""
        previous = conversation.segments[-1] if conversation.segments else None
        text = self.insert_text(insert, previous)
        images = [load_rgb(x) for x in insert.images]
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
        for key in VISION_KEYS:
            out[key] = [m[key] for m in merged]  # per-sample list: slices with the batch
        return out

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


def _base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under a peft wrapper (the model itself otherwise)."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def _sample_vision(
    prompt_enc: dict[str, Any], inserted: list[dict[str, Tensor | None]]
) -> dict[str, Tensor | None]:
    """One sample's vision inputs: the prompt's, then the images of each insertion, in order."""
    out: dict[str, Tensor | None] = {}
    for key in VISION_KEYS:
        parts = [prompt_enc.get(key)] + [v.get(key) for v in inserted]
        parts = [x for x in parts if x is not None]
        out[key] = torch.cat(parts, dim=0) if len(parts) > 1 else (parts[0] if parts else None)
    return out
