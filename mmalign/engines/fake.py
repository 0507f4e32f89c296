"""`FakeEngine`: a CPU rollout engine backed by an in-process Hugging Face causal LM.

It implements the `RolloutEngine` contract with its *own copy* of the weights, exactly like a
vLLM engine does: its log-probs equal the trainer's only while the weights are in sync. Tests use
it to exercise weight sync, sync failures and the importance-sampling correction without vLLM.

Details: docs/architecture.md, "mmalign.engines.fake".
"""

from __future__ import annotations

import copy
import threading
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mmalign.algorithms.logprobs import cache_kwarg
from mmalign.data.batch import left_pad
from mmalign.engines.base import (
    EngineOutput,
    EnginePrompt,
    MultimodalPrompt,
    RolloutEngine,
    SamplingSpec,
    WeightState,
    is_peft,
    iter_state,
)


def filter_logits(logits: Tensor, top_k: int, top_p: float) -> Tensor:
    """Set logits outside the top-k / nucleus (top-p) to -inf (always keeps the best token)."""
    out = logits
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(out, top_k, dim=-1).values[..., -1:]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(out, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the better tokens
        drop_sorted = before > top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        out = out.masked_fill(drop, float("-inf"))
    return out


class FakeEngine(RolloutEngine):
    """A `RolloutEngine` on a Hugging Face causal LM held in-process (see the module docstring)."""

    name = "fake"
    supports_lora_adapters = True

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any = None,
        *,
        copy_model: bool = True,
        peft_config: Any = None,
        batch_size: int | None = None,
        sync_delay_s: float = 0.0,
        sync_error: BaseException | None = None,
        processor: Any = None,
        enable_sleep_mode: bool = True,
    ) -> None:
        super().__init__()
        self.enable_sleep_mode = bool(enable_sleep_mode)
        self.calls: list[tuple[str, Any]] = []
        """The engine's calls in order: ``(name, detail)`` (see the module docstring)."""
        self.processor = processor
        """A vision-language model's processor: with it the engine takes `MultimodalPrompt` items."""
        self.supports_images = processor is not None
        if tokenizer is None and processor is not None:
            tokenizer = getattr(processor, "tokenizer", None)
        if is_peft(model):  # sample with the merged weights, as a merge-and-push engine would
            model = copy.deepcopy(model).merge_and_unload()
        elif copy_model:
            model = copy.deepcopy(model)
        model.eval().requires_grad_(False)
        if peft_config is not None:
            from peft import get_peft_config, get_peft_model

            if isinstance(peft_config, dict):
                peft_config = get_peft_config(dict(peft_config))
            model = get_peft_model(model, peft_config)
            model.eval().requires_grad_(False)
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.sync_delay_s = sync_delay_s
        self.sync_error = sync_error
        self._closed = threading.Event()

    @classmethod
    def from_pretrained(
        cls, path: str | Path, *, dtype: torch.dtype = torch.float32, **kwargs: Any
    ) -> FakeEngine:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(path)
        return cls(model, tokenizer, copy_model=False, **kwargs)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # ------------------------------------------------------------------ sampling
    @torch.no_grad()
    def _generate(
        self, prompt_token_ids: list[EnginePrompt], n: int, sampling: SamplingSpec
    ) -> list[EngineOutput]:
        if self.asleep:
            raise RuntimeError("fake engine: generate called while asleep (wake() it first)")
        self.calls.append(("generate", len(prompt_token_ids)))
        if sampling.stop and self.tokenizer is None:
            raise ValueError("fake engine: stop strings need a tokenizer (FakeEngine(model, tokenizer))")
        rows = [i for i in range(len(prompt_token_ids)) for _ in range(n)]
        gens: list[torch.Generator] | None = None
        if sampling.seed is not None:
            gens = [torch.Generator().manual_seed(sampling.seed + i) for i in range(len(prompt_token_ids))]
        chunk = self.batch_size or len(rows)
        out: list[EngineOutput] = []
        for start in range(0, len(rows), chunk):
            out.extend(self._sample(prompt_token_ids, rows[start : start + chunk], sampling, gens))
        return out

    def _sample(
        self,
        prompts: list[EnginePrompt],
        rows: list[int],
        sp: SamplingSpec,
        gens: list[torch.Generator] | None,
    ) -> list[EngineOutput]:
        from transformers import DynamicCache

        dev = self.device
        b = len(rows)
        extra: dict[str, Tensor] = {}
        if any(isinstance(prompts[i], MultimodalPrompt) and prompts[i].images for i in rows):
            ids, att, extra, positions = self._multimodal_inputs(prompts, rows)
        else:
            token_lists = [p.token_ids if isinstance(p, MultimodalPrompt) else p for p in prompts]
            ids, att = left_pad([token_lists[i] for i in rows])
            ids, att = ids.to(dev), att.to(dev)
            positions = (att.cumsum(1) - 1).clamp(min=0)
        cache = DynamicCache()
        out = self.model(
            input_ids=ids,
            attention_mask=att,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{cache_kwarg(): cache},
            **extra,
        )
        mrope = positions.dim() == 3  # [3, B, T] multimodal rotary positions
        suppressed = (
            torch.tensor(sp.suppress_token_ids, dtype=torch.long, device=dev)
            if sp.suppress_token_ids
            else None
        )
        cache = out[cache_kwarg()]
        logits = out.logits[:, -1].float()
        next_pos = positions.amax(dim=(0, 2) if mrope else 1) + 1
        stop_ids = set(sp.stop_token_ids)
        tokens: list[list[int]] = [[] for _ in range(b)]
        logps: list[list[float]] = [[] for _ in range(b)]
        reasons = ["length"] * b
        done = [False] * b
        for step in range(sp.max_new_tokens):
            if suppressed is not None:
                logits = logits.index_fill(-1, suppressed, float("-inf"))
            scaled = logits / sp.temperature if sp.temperature > 0 else logits
            logp_all = torch.log_softmax(scaled, dim=-1)
            if sp.temperature == 0:
                tok = scaled.argmax(dim=-1).cpu()
            else:
                probs = torch.softmax(filter_logits(scaled, sp.top_k, sp.top_p), dim=-1).cpu()
                if gens is None:
                    tok = torch.multinomial(probs, 1).squeeze(1)
                else:
                    tok = torch.stack(
                        [torch.multinomial(probs[r], 1, generator=gens[rows[r]]).squeeze(0) for r in range(b)]
                    )
            picked = logp_all.gather(1, tok.to(dev)[:, None]).squeeze(1).cpu()
            for r in range(b):
                if done[r]:
                    continue
                t = int(tok[r])
                tokens[r].append(t)
                logps[r].append(float(picked[r]))
                if t in stop_ids or (sp.stop and self._hits_stop(tokens[r], sp.stop)):
                    done[r], reasons[r] = True, "stop"
            if all(done) or step == sp.max_new_tokens - 1:
                break
            att = torch.cat([att, torch.ones((b, 1), dtype=att.dtype, device=dev)], dim=1)
            step_pos = next_pos[None, :, None].expand(3, b, 1) if mrope else next_pos[:, None]
            out = self.model(
                input_ids=tok.to(dev)[:, None],
                attention_mask=att,
                position_ids=step_pos,
                use_cache=True,
                **{cache_kwarg(): cache},
            )
            cache = out[cache_kwarg()]
            next_pos = next_pos + 1
            logits = out.logits[:, -1].float()
        texts: list[str | None] = [None] * b
        if self.tokenizer is not None:
            texts = self.tokenizer.batch_decode(tokens, skip_special_tokens=True)
        return [
            EngineOutput(
                token_ids=tokens[r],
                logprobs=logps[r],
                finish_reason=reasons[r],
                prompt_index=rows[r],
                text=texts[r],
            )
            for r in range(b)
        ]

    def _multimodal_inputs(
        self, prompts: list[EnginePrompt], rows: list[int]
    ) -> tuple[Tensor, Tensor, dict[str, Tensor], Tensor]:
        """Left-padded ids / mask with every image placeholder expanded into its patch tokens, the vision
        inputs (``pixel_values``, ``image_grid_thw``, ``mm_token_type_ids``) and the [3, B, T] M-RoPE
        positions, as vLLM's multimodal processing would give them."""
        image_token = getattr(self.model.config, "image_token_id", None)
        merge = int(getattr(self.processor.image_processor, "merge_size", 1))
        rope = next(
            (m.get_rope_index for m in self.model.modules() if callable(getattr(m, "get_rope_index", None))),
            None,
        )
        if image_token is None or rope is None:
            raise ValueError(
                f"fake engine: {type(self.model).__name__} has no image_token_id / get_rope_index; images need a "
                f"Qwen2-VL-style model"
            )
        per_prompt: dict[int, tuple[list[int], Tensor | None, Tensor | None]] = {}
        for i in sorted(set(rows)):
            p = prompts[i]
            ids, images = (p.token_ids, p.images) if isinstance(p, MultimodalPrompt) else (p, [])
            slots = [k for k, t in enumerate(ids) if t == image_token]
            if len(slots) != len(images):
                raise ValueError(
                    f"fake engine: prompt {i} has {len(slots)} image placeholder token(s) for {len(images)} image(s)"
                )
            if not images:
                per_prompt[i] = (list(ids), None, None)
                continue
            enc = self.processor.image_processor(images=images, return_tensors="pt")
            grid = enc["image_grid_thw"]
            counts = (grid.prod(dim=1) // (merge * merge)).tolist()
            expanded: list[int] = []
            k = 0
            for t in ids:
                expanded.extend([t] * int(counts[k]) if t == image_token else [t])
                k += int(t == image_token)
            per_prompt[i] = (expanded, enc["pixel_values"], grid)
        dev = self.device
        ids, att = left_pad([per_prompt[i][0] for i in rows])
        ids, att = ids.to(dev), att.to(dev)
        types = ((ids == image_token) & att.bool()).long()
        pixels = [per_prompt[i][1] for i in rows if per_prompt[i][1] is not None]
        grids = [per_prompt[i][2] for i in rows if per_prompt[i][2] is not None]
        extra = {
            "mm_token_type_ids": types,
            "pixel_values": torch.cat(pixels).to(dev, self.model.dtype),
            "image_grid_thw": torch.cat(grids).to(dev),
        }
        positions, _ = rope(
            ids,
            mm_token_type_ids=types,
            image_grid_thw=extra["image_grid_thw"],
            video_grid_thw=None,
            attention_mask=att,
        )
        return ids, att, extra, positions

    def _hits_stop(self, ids: list[int], stop: list[str]) -> bool:
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        return any(s in text for s in stop)

    # ------------------------------------------------------------------ weights
    def sync_weights(self, state: WeightState, **kwargs: Any) -> None:
        """`RolloutEngine.sync_weights`, recorded in ``calls`` as ``("sync", step)`` once it succeeded."""
        super().sync_weights(state, **kwargs)
        self.calls.append(("sync", kwargs.get("step")))

    def _load_weights(self, state: WeightState, *, lora: bool) -> None:
        if self.asleep:
            raise RuntimeError("fake engine: weights loaded while asleep (wake() it first)")
        if self.sync_delay_s > 0 and self._closed.wait(self.sync_delay_s):
            return  # closed while waiting
        if self.sync_error is not None:
            raise self.sync_error
        if lora:
            self._load_adapter(state)
        else:
            self._load_full(state)

    @torch.no_grad()
    def _load_full(self, state: WeightState) -> None:
        base = self.model.get_base_model() if is_peft(self.model) else self.model
        targets: dict[str, Tensor] = {}
        for name, value in base.state_dict(keep_vars=True).items():
            if ".lora_" in name:
                continue
            targets[name.replace(".base_layer.", ".")] = value
        unknown: list[str] = []
        for name, value in iter_state(state):
            target = targets.get(name)
            if target is None:
                unknown.append(name)
                continue
            if target.shape != value.shape:
                raise ValueError(
                    f"weight {name!r}: engine shape {tuple(target.shape)}, got {tuple(value.shape)}"
                )
            target.data.copy_(value.to(device=target.device, dtype=target.dtype))
        if unknown:
            raise KeyError(
                f"weights unknown to the engine's model: {unknown[:5]}{' ...' if len(unknown) > 5 else ''}"
            )

    def _load_adapter(self, state: WeightState) -> None:
        if not is_peft(self.model):
            raise ValueError(
                "fake engine: lora=True needs an adapter; construct FakeEngine(..., peft_config=...)"
            )
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(self.model, dict(iter_state(state)))
        unexpected = list(getattr(result, "unexpected_keys", []) or [])
        if unexpected:
            raise KeyError(f"adapter weights unknown to the engine's adapter: {unexpected[:5]}")

    # ------------------------------------------------------------------ memory
    @property
    def sleep_enabled(self) -> bool:
        return self.enable_sleep_mode

    def _sleep(self) -> None:
        self.calls.append(("sleep", None))

    def _wake(self) -> None:
        self.calls.append(("wake", None))

    def close(self) -> None:
        self._closed.set()
