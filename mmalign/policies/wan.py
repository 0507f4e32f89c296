"""`WanPolicy`: Wan 2.1 / 2.2 video flow-matching models as GRPO policies (text to video, image to video and
video editing).

Only the Wan parts live here: the components (`mmalign.policies.wan_components`), UMT5 prompt states (as
``WanPipeline``), video latents [B, C, F, h, w], the transformer call (timestep sigma * num_train_timesteps in
fp32), the conditions, Wan2.2's two experts (``transformer`` for high noise,
``transformer_2`` for low, switched at ``boundary_ratio``; ``train_expert``), the folder's own UniPC scheduler
for deterministic sampling (`uses_ode_scheduler`) and per-path LRU caches of the source pixels and latents.
Sampling, CFG, steps and the trainable-step rules are `mmalign.policies.flow_matching.FlowMatchingPolicy`'s.
docs/video.md describes the conditions and experts; docs/algorithms.md the math.

Each condition (what conditions the video besides the prompt) is a subclass, named in the config by
``options.condition`` and looked up in `WAN_CONDITION_POLICIES` (`wan_policy_class`):

- ``none``: `WanPolicy` itself, text to video;
- ``concat``: `WanConcatPolicy`, the source clip's latents concatenated on the input channels (VIVA);
- ``sdedit``: `WanSDEditPolicy`, the source latents noised to ``sdedit_strength`` and denoised from there;
- ``vace``: `WanVACEPolicy`, the VACE control tensor of the source, mask and reference frames;
- ``i2v``: `WanImageToVideoPolicy`, a first frame given per row.

A condition overrides small hooks of `WanPolicy` (`extra_in_channels`, `condition_rows`,
`condition_inputs`, ...); its row conditioning is stored in the payload, so re-scoring sees what sampling saw.

``i2v`` (``WanImageToVideoPipeline``): each row's ``image`` column (an image file, or a clip whose first frame
is taken) is the first frame; ``image_latents`` (the first-frame mask and the VAE latents of the frame followed
by black frames, `wan_components.i2v_condition`) are concatenated to the noisy latents on the channels, and a
folder with a CLIP image encoder (Wan2.1 I2V) adds ``image_embeds`` (`wan_components.encode_image`), the
transformer's ``encoder_hidden_states_image``. Both are the same in the CFG negative branch, as in the pipeline.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from pathlib import Path
from typing import Any, ClassVar, Self

import torch
from torch import Tensor

from mmalign.config import LoraConfig
from mmalign.data.batch import Rollout
from mmalign.policies.denoising import SamplerSettings, add_lora
from mmalign.policies.flow_matching import FlowMatchingPolicy
from mmalign.policies.wan_components import (
    WAN_MAX_SEQUENCE_LENGTH,
    WanComponents,
    decode_video,
    encode_image,
    encode_video,
    i2v_condition,
    latent_frames,
    vace_control_tensor,
    vae_factors,
)

__all__ = [
    "CONDITIONS",
    "LATENT_CACHE_BYTES",
    "PIXEL_CACHE_BYTES",
    "SDEDIT_MIN_FIRST_STEP",
    "TRAIN_EXPERTS",
    "WAN_CONDITION_POLICIES",
    "WAN_LORA_TARGETS",
    "WanConcatPolicy",
    "WanExperts",
    "WanImageToVideoPolicy",
    "WanPolicy",
    "WanSDEditPolicy",
    "WanVACEPolicy",
    "wan_policy_class",
]

TRAIN_EXPERTS = ("high", "low", "both")
"""Which expert of a two-expert model trains."""
WAN_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2")
"""Attention projections and feed-forward layers of Wan's blocks (``target_modules: all-linear``)."""
SDEDIT_MIN_FIRST_STEP = 1e-3
"""`WanSDEditPolicy`: schedule sigmas less than this below the strength are dropped, so the first step (from the
strength to the next schedule sigma) is never a near-zero step (whose tiny std would make extreme log-probs)."""
PIXEL_CACHE_BYTES = 4 * 2**30
"""CPU memory for the source videos / masks / reference frames kept as pixels (by path; least recently used
dropped first; one fp32 81 x 480 x 832 clip is 0.39 GiB)."""
LATENT_CACHE_BYTES = 4 * 2**30
"""CPU memory for the source latents / VACE control tensors kept (by path; one real 81 x 480 x 832 control
tensor is 50 MB, source latents 8 MB)."""


class _LRU(OrderedDict):
    """A CPU tensor cache holding at most `budget` bytes (least recently used dropped first; the newest entry
    is always kept)."""

    def __init__(self, budget: int) -> None:
        super().__init__()
        self.budget = budget
        self.used = 0

    def get_or(self, key: Any, make: Any) -> Tensor:
        """The tensor cached under `key`, else ``make()`` moved to the CPU and cached."""
        if key in self:
            self.move_to_end(key)
            return self[key]
        value = make().cpu()
        self[key] = value
        self.used += value.nbytes
        while self.used > self.budget and len(self) > 1:
            self.used -= self.popitem(last=False)[1].nbytes
        return value


class WanExperts(torch.nn.Module):
    """Wan2.2's two experts as one module: ``high`` (the folder's ``transformer``) and ``low``
    (``transformer_2``). `forward` takes the transformer's keywords plus ``expert`` Long[B] (0 high, 1 low) and
    runs each sample through its expert (one call per expert present), so `action_stats` and a DDP wrapper see a
    single module and a single forward."""

    def __init__(self, high: torch.nn.Module, low: torch.nn.Module) -> None:
        super().__init__()
        self.high = high
        self.low = low

    @property
    def config(self) -> Any:
        """The high-noise expert's config (both experts share the architecture)."""
        return self.high.config

    def experts(self) -> list[torch.nn.Module]:
        return [self.high, self.low]

    def forward(
        self,
        *,
        expert: Tensor,
        hidden_states: Tensor,
        timestep: Tensor,
        encoder_hidden_states: Tensor,
        control_hidden_states: Tensor | None = None,
        control_hidden_states_scale: Tensor | None = None,
        encoder_hidden_states_image: Tensor | None = None,
        return_dict: bool = False,
    ) -> tuple[Tensor]:
        """(output Float[B, ...],): each sample's prediction from the expert `expert` names."""
        del return_dict
        extra = (
            {}
            if control_hidden_states_scale is None
            else {"control_hidden_states_scale": control_hidden_states_scale}
        )
        batched = {
            "hidden_states": hidden_states,
            "timestep": timestep,
            "encoder_hidden_states": encoder_hidden_states,
        }
        if control_hidden_states is not None:
            batched["control_hidden_states"] = control_hidden_states
        if encoder_hidden_states_image is not None:
            batched["encoder_hidden_states_image"] = encoder_hidden_states_image
        out: Tensor | None = None
        for e, module in enumerate(self.experts()):
            idx = (expert == e).nonzero().flatten()
            if idx.numel() == 0:
                continue
            if idx.numel() == expert.numel():
                return (module(**batched, **extra, return_dict=False)[0],)
            part = module(**{k: v[idx] for k, v in batched.items()}, **extra, return_dict=False)[0]
            if out is None:
                out = part.new_zeros((expert.shape[0], *part.shape[1:]))
            out = out.index_copy(0, idx, part)
        if out is None:
            raise ValueError("WanExperts.forward got an empty batch")
        return (out,)

    def _adapted(self) -> list[torch.nn.Module]:
        return [m for m in self.experts() if getattr(m, "_hf_peft_config_loaded", False)]

    def disable_adapters(self) -> None:
        """Disable the LoRA adapter of every expert that has one (the reference network)."""
        for m in self._adapted():
            m.disable_adapters()

    def enable_adapters(self) -> None:
        for m in self._adapted():
            m.enable_adapters()


class WanPolicy(FlowMatchingPolicy):
    """A Wan video transformer (one or two experts) as a GRPO policy: text to video, and the base of the
    conditioned policies (`WAN_CONDITION_POLICIES`), which override the hooks of the "condition hooks" section.
    See the module docstring."""

    components: WanComponents
    conditioning_keys = ("prompt_embeds",)
    constructor_takes_parts = True
    lora_targets = WAN_LORA_TARGETS
    SCHEDULE_KEYS = ("sigmas", "sigmas_next", "sigma_max_fallback", "expert")
    """`schedule`'s keys; deterministic sampling with the folder's UniPC scheduler adds ``timesteps``."""
    condition: ClassVar[str] = "none"
    """The name of the condition in the config (``options.condition``; `WAN_CONDITION_POLICIES`' key)."""
    needs_source_video: ClassVar[bool] = False
    """Whether every row must carry a ``source_video`` (the editing conditions)."""
    vace_transformer: ClassVar[bool] = False
    """Whether the transformer must be a ``WanVACETransformer3DModel`` (and only then may be one)."""
    num_reference_frames: int = 0
    """Latent frames prepended to every sample (VACE's reference frames; dropped before decoding)."""

    def __init__(
        self,
        transformer: torch.nn.Module,
        vae: torch.nn.Module,
        scheduler: Any,
        text_encoder: torch.nn.Module,
        tokenizer: Any,
        *,
        transformer_2: torch.nn.Module | None = None,
        boundary_ratio: float | None = None,
        train_expert: str = "both",
        sampler: SamplerSettings | None = None,
        num_frames: int = 81,
        height: int = 480,
        width: int = 832,
        max_sequence_length: int = WAN_MAX_SEQUENCE_LENGTH,
        ode_scheduler: Any = None,
        image_encoder: torch.nn.Module | None = None,
        image_processor: Any = None,
        need_reference: bool = False,
        lora: bool = False,
        **sampler_kwargs: Any,
    ) -> None:
        """The parts of a Wan folder (`WanComponents`; `transformer_2` and `boundary_ratio` for Wan2.2's two
        experts, `ode_scheduler` for deterministic sampling, `image_encoder` / `image_processor` for Wan2.1
        image to video). ``num_frames`` x ``height`` x ``width``: the video size in pixels (``WanPipeline``'s
        defaults); a condition's own options are its subclass's keywords; `lora`: the trained expert(s)
        already carry an adapter. Sampler settings as `FlowMatchingPolicy`."""
        self._check_options(train_expert, transformer_2, boundary_ratio)
        if max_sequence_length < 1:
            raise ValueError(f"max_sequence_length must be >= 1, got {max_sequence_length}")
        self.boundary_ratio = boundary_ratio
        self.train_expert = train_expert
        self.max_sequence_length = max_sequence_length
        self.num_frames, self.height, self.width = int(num_frames), int(height), int(width)
        self.transformer, self.transformer_2 = transformer, transformer_2
        self.image_encoder, self.image_processor = image_encoder, image_processor
        self._check_model(vae)
        self.row_conditioning_keys = self.condition_keys()
        self._pixels: _LRU = _LRU(PIXEL_CACHE_BYTES)
        self._latents: _LRU = _LRU(LATENT_CACHE_BYTES)
        self._ode_run: Any = None
        components = WanComponents(
            transformer,
            vae,
            scheduler,
            text_encoder,
            tokenizer,
            transformer_2=transformer_2,
            boundary_ratio=boundary_ratio,
            ode_scheduler=ode_scheduler,
            image_encoder=image_encoder,
            image_processor=image_processor,
        )
        # a frozen expert is its own reference: copy only the trained one (a 14B expert is 28 GB in bf16)
        share = transformer_2 is not None and train_expert != "both" and need_reference and not lora
        super().__init__(
            components,
            sampler=sampler,
            latent_size=self.height // self.spatial_factor,
            need_reference=need_reference and not share,
            lora=lora,
            **sampler_kwargs,
        )
        if share:
            self._share_frozen_expert()

    def build_denoiser(self, components: Any) -> torch.nn.Module:
        """The transformer, or both experts as one `WanExperts` with the untrained one frozen."""
        if components.transformer_2 is None:
            return components.transformer
        for name, module in (("high", components.transformer), ("low", components.transformer_2)):
            if self.train_expert not in (name, "both"):
                module.requires_grad_(False)
        return WanExperts(components.transformer, components.transformer_2)

    def _share_frozen_expert(self) -> None:
        """The KL reference of a one-expert-trained model: a frozen copy of the trained expert, the frozen
        expert shared."""
        self.need_reference = self.kl_in_action_stats = True
        trained = self.transformer if self.train_expert == "high" else self.transformer_2
        ref = copy.deepcopy(trained).eval().requires_grad_(False)
        pair = (ref, self.transformer_2) if self.train_expert == "high" else (self.transformer, ref)
        self.ref_model = WanExperts(*pair)

    def _select_trainable(self, stochastic: list[int]) -> list[int]:
        """The stochastic steps of the trained expert(s) (sets ``step_experts``)."""
        self.step_experts = self._step_experts()
        """Long[steps a rollout runs]: the expert of every step (0: transformer, 1: transformer_2)."""
        want = {"high": 0, "low": 1}.get(self.train_expert)
        trainable = [i for i in stochastic if want is None or int(self.step_experts[i]) == want]
        if not trainable:
            raise ValueError(
                f"train_expert {self.train_expert!r}: no stochastic step of the {self.num_denoising_steps()} "
                f"steps run uses the {self.train_expert}-noise expert (boundary_ratio={self.boundary_ratio}, "
                f"num_steps={self.num_steps}); change boundary_ratio, num_steps or train_expert"
            )
        return trainable

    # ------------------------------------------------------------------ checks
    @staticmethod
    def _check_options(
        train_expert: str, transformer_2: torch.nn.Module | None, boundary_ratio: float | None
    ) -> None:
        if train_expert not in TRAIN_EXPERTS:
            raise ValueError(f"train_expert must be one of {', '.join(TRAIN_EXPERTS)}; got {train_expert!r}")
        if (transformer_2 is None) != (boundary_ratio is None):
            raise ValueError(
                "boundary_ratio is needed exactly when there is a second expert (transformer_2/ in the folder); "
                f"got boundary_ratio={boundary_ratio} with {'a' if transformer_2 is not None else 'no'} transformer_2"
            )
        if transformer_2 is None and train_expert != "both":
            raise ValueError(
                f"train_expert {train_expert!r} needs a two-expert model (a folder with transformer_2/); "
                "a single-transformer model trains with train_expert: both"
            )
        if boundary_ratio is not None and not 0 < boundary_ratio < 1:
            raise ValueError(f"boundary_ratio must be in (0, 1), got {boundary_ratio}")

    def _check_model(self, vae: torch.nn.Module) -> None:
        """Set the VAE factors, check the experts against the condition and the VAE, check the video size."""
        self.temporal_factor, self.spatial_factor = vae_factors(vae)
        self._check_architecture(self.transformer, vae)
        if self.transformer_2 is not None:
            self._check_architecture(self.transformer_2, vae)
        self._check_size(self.transformer)
        self._check_image_encoder()

    def _takes_image_embeds(self) -> bool:
        """Whether the policy feeds the transformer CLIP image states (image to video with ``image_dim``)."""
        return False

    def _check_image_encoder(self) -> None:
        if self._takes_image_embeds():
            if self.image_encoder is None:
                raise ValueError(
                    "transformer/config.json sets image_dim (a Wan2.1 image-to-video transformer): the folder needs "
                    "image_encoder/ and image_processor/ (CLIPVisionModel, CLIPImageProcessor)"
                )
            if self.max_sequence_length != WAN_MAX_SEQUENCE_LENGTH:
                raise ValueError(
                    f"max_sequence_length must be {WAN_MAX_SEQUENCE_LENGTH} for a transformer with image_dim: "
                    "diffusers' Wan attention splits image and text tokens assuming 512 text tokens; got "
                    f"{self.max_sequence_length}"
                )

    def _check_architecture(self, transformer: torch.nn.Module, vae: torch.nn.Module) -> None:
        cfg, z = transformer.config, int(vae.config.z_dim)
        is_vace = hasattr(cfg, "vace_layers")
        if is_vace != self.vace_transformer:
            raise ValueError(
                f"condition {self.condition!r} with a {type(transformer).__name__}: condition vace needs a "
                "WanVACETransformer3DModel (transformer/config.json _class_name) and a VACE transformer needs "
                "condition: vace"
            )
        want = z + self.extra_in_channels(z)
        if int(cfg.in_channels) != want:
            why = self.in_channels_note()
            raise ValueError(
                f"transformer/config.json in_channels={cfg.in_channels}, but condition {self.condition!r} with "
                f"the VAE's z_dim={z} needs {want}{why}"
            )
        if int(cfg.out_channels or cfg.in_channels) != z:
            raise ValueError(f"transformer/config.json out_channels={cfg.out_channels}, expected z_dim={z}")

    def _check_size(self, transformer: torch.nn.Module) -> None:
        t, s = self.temporal_factor, self.spatial_factor
        pt, ph, pw = (int(p) for p in transformer.config.patch_size)
        if self.num_frames < 1 or (self.num_frames - 1) % t:
            raise ValueError(
                f"num_frames must be 1 + a multiple of the VAE's temporal factor {t} (vae/config.json "
                f"temperal_downsample), got {self.num_frames}"
            )
        if self.height % (s * ph) or self.width % (s * pw) or self.height < 1 or self.width < 1:
            raise ValueError(
                f"height and width must be multiples of {s * ph} and {s * pw} (the VAE's spatial factor {s} times "
                f"the transformer's patch_size {[pt, ph, pw]}), got {self.height}x{self.width}"
            )
        f = latent_frames(self.num_frames, t) + self.num_reference_frames
        if f % pt:
            raise ValueError(
                f"{f} latent frames are not a multiple of the transformer's temporal patch {pt} "
                "(transformer/config.json patch_size); change num_frames"
            )

    # ------------------------------------------------------------------ building
    @classmethod
    def load_components(
        cls, name_or_path: str | Path, *, dtype: torch.dtype, **options: Any
    ) -> WanComponents:
        """`load_wan_components` of a Wan folder or hub id."""
        from mmalign.policies.wan_components import load_wan_components

        return load_wan_components(name_or_path, dtype=dtype)

    @classmethod
    def add_lora(cls, components: Any, lora: LoraConfig | None, options: dict[str, Any]) -> bool:
        """A LoRA adapter on `WAN_LORA_TARGETS` for each trained expert (``train_expert`` in `options`)."""
        train_expert = options.get("train_expert", "both")
        use_lora = False
        for which, module in (("high", components.transformer), ("low", components.transformer_2)):
            if module is not None and (components.transformer_2 is None or train_expert in (which, "both")):
                use_lora = add_lora(module, lora, cls.lora_targets) or use_lora
        return use_lora

    @classmethod
    def from_components(cls, components: Any, **kwargs: Any) -> Self:
        """As `FlowMatchingPolicy.from_components`; a ``boundary_ratio`` of None keeps the folder's."""
        if kwargs.get("boundary_ratio", 0) is None:
            del kwargs["boundary_ratio"]
        return super().from_components(components, **kwargs)

    # ------------------------------------------------------------------ prompts, shapes and sigmas
    def encode_conditioning(self, prompts: list[str]) -> dict[str, Tensor]:
        dev = next(self.text_encoder.parameters()).device
        pe = self.components.encode_prompt(prompts, dev, max_sequence_length=self.max_sequence_length)
        return {"prompt_embeds": pe.to(self.device)}

    def latent_frames(self) -> int:
        """Latent frames of a sample: (num_frames - 1) // temporal + 1, plus the VACE reference frames."""
        return latent_frames(self.num_frames, self.temporal_factor) + self.num_reference_frames

    def latent_shape(self) -> tuple[int, ...]:
        """(z_dim, F_lat, h, w): F_lat = `latent_frames`, h = height / spatial, w = width / spatial."""
        s = self.spatial_factor
        return (int(self.vae.config.z_dim), self.latent_frames(), self.height // s, self.width // s)

    def uses_ode_scheduler(self) -> bool:
        """Whether rollouts step with the folder's own scheduler (UniPC, ``components.ode_scheduler``): the
        sampler is deterministic (``noise_level`` 0: `mmalign sample` / `mmalign eval`) and the folder ships
        one (`WanSDEditPolicy` never: its truncated schedule is Euler's). Its sigmas, integer timesteps and
        multistep updates are then ``WanPipeline``'s; training steps always use the Euler / SDE schedule."""
        return self.components.ode_scheduler is not None and self.sampler.deterministic

    @property
    def schedule_keys(self) -> tuple[str, ...]:  # type: ignore[override]
        """`SCHEDULE_KEYS`, plus ``timesteps`` while `uses_ode_scheduler`."""
        return (*self.SCHEDULE_KEYS, "timesteps") if self.uses_ode_scheduler() else self.SCHEDULE_KEYS

    def _fresh_ode_scheduler(self) -> Any:
        """A copy of ``components.ode_scheduler`` with ``set_timesteps(num_steps)`` done (its multistep state
        fresh), on the policy's device."""
        sched = copy.deepcopy(self.components.ode_scheduler)
        sched.set_timesteps(self.num_steps, device=self.device)
        return sched

    def _full_schedule(self) -> tuple[Tensor, Tensor]:
        """(sigmas Float[num_steps + 1], timesteps Float[num_steps]) of ``set_timesteps(num_steps)``, fp32 on
        the CPU, as ``WanPipeline`` sets them: of the flow-matching Euler scheduler, or of the folder's own
        (UniPC: timesteps are integers) while `uses_ode_scheduler`."""
        if self.uses_ode_scheduler():
            ode = self._fresh_ode_scheduler()
            return ode.sigmas.detach().to("cpu", torch.float32), ode.timesteps.detach().to(
                "cpu", torch.float32
            )
        sig = self.full_sigmas()
        return sig, self.scheduler.timesteps.detach().to("cpu", torch.float32)

    def _run_schedule(self) -> tuple[Tensor, Tensor]:
        """(sigmas Float[n + 1], timesteps Float[n]) of the n steps a rollout runs: the full schedule
        (`WanSDEditPolicy` truncates it)."""
        return self._full_schedule()

    def num_denoising_steps(self) -> int:
        """``num_steps`` (`WanSDEditPolicy`: the steps from the strength s down)."""
        return len(self._run_schedule()[1])

    def sigmas(self) -> Tensor:
        """Float[num_denoising_steps + 1]: the shifted sigmas from 1 (`WanSDEditPolicy`: from the strength) to 0."""
        return self._run_schedule()[0]

    def _step_experts(self) -> Tensor:
        """Long[num_denoising_steps]: 0 (``transformer``) where the step's timestep >= boundary_ratio *
        num_train_timesteps, else 1 (``transformer_2``) -- ``WanPipeline``'s rule."""
        t = self._run_schedule()[1]
        if self.boundary_ratio is None:
            return torch.zeros(len(t), dtype=torch.long)
        return (t < self.boundary_ratio * self.scheduler.config.num_train_timesteps).long()

    def schedule(self) -> dict[str, Tensor]:
        """`FlowMatchingPolicy.schedule` plus the expert of every step (and, while `uses_ode_scheduler`, the
        folder scheduler's timesteps, which the transformer is called at)."""
        table = {**super().schedule(), "expert": self._step_experts()}
        if self.uses_ode_scheduler():
            table["timesteps"] = self._run_schedule()[1]
        return table

    def ode_step(self, prediction: Tensor, latents: Tensor, sched: dict[str, Tensor]) -> Tensor:
        """The Euler step; while `uses_ode_scheduler` the folder scheduler's (UniPC's multistep) update of step
        ``sched["step_index"]``, its state started afresh at step 0 of each rollout."""
        if not self.uses_ode_scheduler():
            return super().ode_step(prediction, latents, sched)
        i = int(sched["step_index"][0])
        if i == 0:
            self._ode_run = self._fresh_ode_scheduler()
        run = self._ode_run
        if run is None or (run.step_index or 0) != i:
            raise RuntimeError(
                f"the deterministic sampler steps in order from step 0; got step {i} after "
                f"{None if run is None else run.step_index}"
            )
        return run.step(prediction, run.timesteps[i], latents, return_dict=False)[0]

    # ------------------------------------------------------------------ condition hooks
    def extra_in_channels(self, z_dim: int) -> int:
        """Input channels of the transformer besides the `z_dim` noisy latent channels (none here)."""
        return 0

    def in_channels_note(self) -> str:
        """What the transformer's input channels hold, for the in_channels error (empty here)."""
        return ""

    def condition_keys(self) -> tuple[str, ...]:
        """``row_conditioning_keys``: the keys `condition_rows` returns (none here); called once the model is
        checked."""
        return ()

    def condition_rows(self, columns: dict[str, list[Any]], b: int) -> dict[str, Tensor]:
        """{key of `condition_keys`: Float[b, ...]} on the policy's device, from the dataset `columns` of `b`
        samples (stored in the payload, so re-scoring sees what sampling saw)."""
        return {}

    def condition_inputs(
        self, latents: Tensor, cond: dict[str, Tensor], dtype: torch.dtype
    ) -> tuple[Tensor, dict[str, Any]]:
        """(hidden_states, extra transformer keywords in `dtype`) for the noisy `latents` and the conditioning
        `cond`: the latents as they are and no keywords here."""
        return latents, {}

    # ------------------------------------------------------------------ rows: sources, masks, references
    def _column(self, columns: dict[str, list[Any]], key: str, b: int) -> list[Any]:
        return list(columns.get(key) or [None] * b)

    def _video(self, path: Any) -> Tensor:
        """Float[F, 3, H, W] in [0, 1] of the source video at `path` at the policy's frames and size."""
        from mmalign.data.media import read_video

        key = ("video", str(path))
        return self._pixels.get_or(
            key, lambda: read_video(path, num_frames=self.num_frames, size=(self.height, self.width))
        )

    def _mask(self, path: Any) -> Tensor:
        """Float[F, H, W] in {0, 1} of the edit mask at `path` at the policy's frames and size."""
        from mmalign.data.media import read_mask

        key = ("mask", str(path))
        return self._pixels.get_or(
            key, lambda: read_mask(path, num_frames=self.num_frames, size=(self.height, self.width))
        )

    def _source_paths(self, columns: dict[str, list[Any]], b: int) -> list[Any]:
        paths = self._column(columns, "source_video", b)
        if any(p is None for p in paths):
            need = (
                f"condition {self.condition!r} needs"
                if self.needs_source_video
                else "some rows carry a source_video, so give one in"
            )
            raise ValueError(
                f"{need} a source_video in every row (a path: a folder of frames, a video file or a .npy)"
            )
        return paths

    def source_videos(self, columns: dict[str, list[Any]], b: int) -> Tensor | None:
        """Float[B, F, 3, H, W] of the rows' ``source_video`` (None when no row has one)."""
        paths = self._column(columns, "source_video", b)
        if all(p is None for p in paths):
            return None
        return torch.stack([self._video(p) for p in self._source_paths(columns, b)])

    def edit_masks(self, columns: dict[str, list[Any]], b: int) -> Tensor | None:
        """Float[B, F, H, W] of the rows' ``edit_mask`` (ones for a row without; None when no row has one)."""
        paths = self._column(columns, "edit_mask", b)
        if all(p is None for p in paths):
            return None
        ones = torch.ones(self.num_frames, self.height, self.width)
        return torch.stack([ones if p is None else self._mask(p) for p in paths])

    def source_latents(self, columns: dict[str, list[Any]], b: int) -> Tensor:
        """Float[B, z, F_lat, h, w] on the policy's device: the normalised VAE latents of the source videos."""
        rows = []
        for p in self._source_paths(columns, b):
            rows.append(
                self._latents.get_or(
                    ("latents", str(p)), lambda p=p: encode_video(self.vae, self._video(p)[None])[0]
                )
            )
        return torch.stack(rows).to(self.device)

    # ------------------------------------------------------------------ rollout hooks
    def row_conditioning(self, columns: dict[str, list[Any]], group: Tensor) -> dict[str, Tensor]:
        """The condition's tensors of every sample (`condition_rows`), after checking that no row carries
        reference frames (only `WanVACEPolicy` takes them)."""
        b = int(group.shape[0])
        refs = self._column(columns, "reference_frames", b)
        if any(r is not None and len(r) for r in refs):
            raise ValueError(
                "rows carry reference_frames, which only condition: vace (with num_reference_frames) uses"
            )
        return self.condition_rows(columns, b)

    def initial_latents(
        self, group: Tensor, cond: dict[str, Tensor], columns: dict[str, list[Any]]
    ) -> Tensor:
        """Noise (`WanSDEditPolicy` starts from the noised source latents)."""
        return self._initial_noise(group)

    def rollout_outputs(self, rollout: Rollout) -> None:
        """``source_videos`` and ``edit_masks`` for the rewards, when the rows carry them."""
        b = len(rollout.prompts)
        videos = self.source_videos(rollout.columns, b)
        if videos is not None:
            rollout.outputs["source_videos"] = videos
        masks = self.edit_masks(rollout.columns, b)
        if masks is not None:
            rollout.outputs["edit_masks"] = masks

    def rollout_stats(self, rollout: Rollout) -> dict[str, Tensor]:
        """With two experts: the share of each sample's trained steps each expert produced."""
        if self.transformer_2 is None or "expert" not in rollout.payload:
            return {}
        e = rollout.payload["expert"].float()
        return {"expert_high_share": (e == 0).float().mean(dim=1), "expert_low_share": e.mean(dim=1)}

    # ------------------------------------------------------------------ model
    def velocity(
        self, model: torch.nn.Module, latents: Tensor, sched: dict[str, Tensor], cond: dict[str, Tensor]
    ) -> Tensor:
        """One transformer call on the condition's inputs (`condition_inputs`); two experts: each sample's step
        expert. The timestep is sigma * num_train_timesteps (fp32), or the folder scheduler's
        integer timestep while `uses_ode_scheduler`. An ``expand_timesteps`` folder (TI2V-5B) gets one timestep
        per sample (text to video; its image conditioning is not supported)."""
        # the patch embedding's dtype, not the first parameter's: that one (scale_shift_table) diffusers keeps in
        # fp32 (_keep_in_fp32_modules), and fp32 inputs fail in the bf16 patch convolution outside autocast
        # (`mmalign eval` / `sample` of a bf16 model)
        dtype = next(m.weight.dtype for m in model.modules() if isinstance(m, torch.nn.Conv3d))
        if "timesteps" in sched:
            t = sched["timesteps"]
        else:
            t = sched["sigmas"] * float(self.scheduler.config.num_train_timesteps)
        x, kw = self.condition_inputs(latents, cond, dtype)
        if self.transformer_2 is not None:
            kw["expert"] = sched["expert"]
        return model(
            hidden_states=x.to(dtype),
            timestep=t.float(),
            encoder_hidden_states=cond["prompt_embeds"].to(dtype),
            return_dict=False,
            **kw,
        )[0]

    # ------------------------------------------------------------------ decoding and saving
    def decode_latents(self, z: Tensor) -> Tensor:
        """Float[B, F, 3, H, W] in [0, 1] on the CPU: the whole clip through the Wan VAE (without the VACE
        reference frames), un-normalised with ``latents_mean`` / ``latents_std`` as ``WanPipeline``."""
        return decode_video(self.vae, z[:, :, self.num_reference_frames :])

    def _merged(self, module: torch.nn.Module, path: Path, subfolder: str) -> torch.nn.Module:
        """`module` as saved in ``path/subfolder``: with a LoRA adapter, also written alone to
        ``path/<subfolder>_lora`` and merged into a returned copy; else the module itself."""
        if not getattr(module, "_hf_peft_config_loaded", False):
            return module
        module.save_lora_adapter(str(path / f"{subfolder}_lora"))
        merged = copy.deepcopy(module)
        merged.fuse_lora()
        merged.unload_lora()
        return merged

    def save(self, path: str | Path) -> None:
        """Write the whole Wan folder (loadable by `WanPolicy.from_pretrained` and diffusers' ``WanPipeline``
        / ``WanVACEPipeline``). Under LoRA each adapted expert is merged into a copy, and its adapter also
        saved alone in ``transformer_lora/`` / ``transformer_2_lora/``. The weights are `export_weights`' (the
        evaluation EMA of a forward-process objective, when it keeps one)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        with self.export_weights():
            t2 = (
                self._merged(self.transformer_2, path, "transformer_2")
                if self.transformer_2 is not None
                else None
            )
            self.components.save_pretrained(
                path, transformer=self._merged(self.transformer, path, "transformer"), transformer_2=t2
            )


class WanConcatPolicy(WanPolicy):
    """``condition: concat`` (VIVA): the source clip's VAE latents concatenated to the noisy latents on the
    channels, so the transformer takes 2 z_dim input channels; every row needs a ``source_video``."""

    condition = "concat"
    needs_source_video = True

    def extra_in_channels(self, z_dim: int) -> int:
        """The source latents' `z_dim` channels."""
        return z_dim

    def in_channels_note(self) -> str:
        return " (noisy latents and source latents concatenated)"

    def condition_keys(self) -> tuple[str, ...]:
        return ("source_latents",)

    def condition_rows(self, columns: dict[str, list[Any]], b: int) -> dict[str, Tensor]:
        """``source_latents`` Float[b, z, F_lat, h, w] (`source_latents`)."""
        return {"source_latents": self.source_latents(columns, b)}

    def condition_inputs(
        self, latents: Tensor, cond: dict[str, Tensor], dtype: torch.dtype
    ) -> tuple[Tensor, dict[str, Any]]:
        """[noisy latents | source latents] on the channels."""
        return torch.cat([latents, cond["source_latents"].to(latents)], dim=1), {}


class WanSDEditPolicy(WanPolicy):
    """``condition: sdedit`` (any Wan checkpoint): the source latents noised to the strength s,
    x = (1 - s) z + s eps, then denoised along the schedule's sigmas below s (see docs/algorithms.md); every
    row needs a ``source_video``. Sampling always steps with Euler (never the folder's UniPC scheduler)."""

    condition = "sdedit"
    needs_source_video = True

    def __init__(self, *args: Any, sdedit_strength: float = 0.8, **kwargs: Any) -> None:
        """`sdedit_strength`: s in (0, 1] (1: pure noise, the whole schedule); the rest as `WanPolicy`."""
        if not 0 < sdedit_strength <= 1:
            raise ValueError(f"sdedit_strength must be in (0, 1], got {sdedit_strength}")
        self.sdedit_strength = float(sdedit_strength)
        super().__init__(*args, **kwargs)

    def uses_ode_scheduler(self) -> bool:
        """Never: the truncated schedule is the Euler scheduler's."""
        return False

    def _run_schedule(self) -> tuple[Tensor, Tensor]:
        """The strength s followed by the full schedule's sigmas below s - `SDEDIT_MIN_FIRST_STEP` (and their
        timesteps; s's timestep is s * num_train_timesteps)."""
        sig, t = self._full_schedule()
        s = torch.tensor([self.sdedit_strength], dtype=torch.float32)
        below = sig[:-1] < s - SDEDIT_MIN_FIRST_STEP
        n_train = float(self.scheduler.config.num_train_timesteps)
        return torch.cat([s, sig[:-1][below], sig[-1:]]), torch.cat([s * n_train, t[below]])

    def initial_latents(
        self, group: Tensor, cond: dict[str, Tensor], columns: dict[str, list[Any]]
    ) -> Tensor:
        """The source latents noised to the strength s: (1 - s) z + s eps."""
        noise = self._initial_noise(group)
        z = self.source_latents(columns, int(group.shape[0])).to(noise)
        s = float(self.sigmas()[0])  # the strength, as fp32
        return (1 - s) * z + s * noise


class WanVACEPolicy(WanPolicy):
    """``condition: vace`` (``WanVACEPipeline``, a ``WanVACETransformer3DModel``): the VACE control tensor of
    every row's ``source_video``, ``edit_mask`` and, with ``num_reference_frames``, ``reference_frames``
    (`wan_components.vace_control_tensor`) goes to the VACE blocks, scaled by ``conditioning_scale``."""

    condition = "vace"
    needs_source_video = True
    vace_transformer = True

    def __init__(
        self, *args: Any, conditioning_scale: float = 1.0, num_reference_frames: int = 0, **kwargs: Any
    ) -> None:
        """`conditioning_scale`: the VACE blocks' scale; `num_reference_frames` R >= 0: every row's
        ``reference_frames`` hold R frames, prepended as R latent frames. The rest as `WanPolicy`."""
        if num_reference_frames < 0:
            raise ValueError(f"num_reference_frames must be >= 0, got {num_reference_frames}")
        self.conditioning_scale = float(conditioning_scale)
        self.num_reference_frames = int(num_reference_frames)
        super().__init__(*args, **kwargs)

    def condition_keys(self) -> tuple[str, ...]:
        return ("control_latents",)

    def row_conditioning(self, columns: dict[str, list[Any]], group: Tensor) -> dict[str, Tensor]:
        """``control_latents`` of every sample (`control_latents`; rows may carry reference frames)."""
        return self.condition_rows(columns, int(group.shape[0]))

    def condition_rows(self, columns: dict[str, list[Any]], b: int) -> dict[str, Tensor]:
        return {"control_latents": self.control_latents(columns, b)}

    def condition_inputs(
        self, latents: Tensor, cond: dict[str, Tensor], dtype: torch.dtype
    ) -> tuple[Tensor, dict[str, Any]]:
        """The latents as they are; the control tensor and one ``conditioning_scale`` per VACE layer."""
        n_layers = len(self.transformer.config.vace_layers)
        return latents, {
            "control_hidden_states": cond["control_latents"].to(dtype),
            "control_hidden_states_scale": torch.full(
                (n_layers,), self.conditioning_scale, device=latents.device, dtype=dtype
            ),
        }

    def _references(self, value: Any) -> list[Tensor]:
        """The reference frames of a row, each Float[3, h, w] in [0, 1] at its own size: `value` is a path or
        a list of paths, each read with `mmalign.data.media.read_video` (every frame of each is a reference)."""
        from mmalign.data.media import read_video

        paths = [value] if isinstance(value, str | Path) else list(value)
        stacks = [self._pixels.get_or(("refs", str(p)), lambda p=p: read_video(p)) for p in paths]
        return [frame for stack in stacks for frame in stack]

    def control_latents(self, columns: dict[str, list[Any]], b: int) -> Tensor:
        """Float[B, 2 z + s^2, F_lat, h, w] on the policy's device: the VACE control tensor of every row
        (`wan_components.vace_control_tensor`), cached per (video, mask, references)."""
        videos = self._source_paths(columns, b)
        masks = self._column(columns, "edit_mask", b)
        refs = self._column(columns, "reference_frames", b)
        patch = int(self.transformer.config.patch_size[1])
        rows = []
        for v, m, r in zip(videos, masks, refs, strict=True):
            key = ("control", str(v), str(m), repr(r))

            def make(v: Any = v, m: Any = m, r: Any = r) -> Tensor:
                mask = None if m is None else self._mask(m)[None]
                ref_list = None
                if self.num_reference_frames:
                    stack = self._references(r) if r is not None else []
                    if r is None or len(stack) != self.num_reference_frames:
                        raise ValueError(
                            f"num_reference_frames is {self.num_reference_frames}: every row's reference_frames "
                            f"must hold that many frames; got {0 if r is None else len(stack)} for {v}"
                        )
                    ref_list = [stack]
                return vace_control_tensor(
                    self.vae, self._video(v)[None], mask, patch_size=patch, reference_frames=ref_list
                )[0]

            rows.append(self._latents.get_or(key, make))
        return torch.stack(rows).to(self.device)


class WanImageToVideoPolicy(WanPolicy):
    """``condition: i2v`` (``WanImageToVideoPipeline``): every row's ``image`` is the first frame (see the
    module docstring); the transformer takes z_dim + temporal factor + z_dim input channels."""

    condition = "i2v"

    def _takes_image_embeds(self) -> bool:
        """Whether the transformer takes CLIP image states (``image_dim`` set: Wan2.1 image to video)."""
        return getattr(self.transformer.config, "image_dim", None) is not None

    def extra_in_channels(self, z_dim: int) -> int:
        """The temporal-factor channels of the first-frame mask and the `z_dim` of the image latents."""
        return z_dim + self.temporal_factor

    def in_channels_note(self) -> str:
        return (
            f" (noisy latents, the {self.temporal_factor}-channel first-frame mask and the image latents; "
            "Wan2.2 TI2V-5B's first-frame replacement is not supported)"
        )

    def condition_keys(self) -> tuple[str, ...]:
        return ("image_latents", "image_embeds") if self._takes_image_embeds() else ("image_latents",)

    def condition_rows(self, columns: dict[str, list[Any]], b: int) -> dict[str, Tensor]:
        return self.image_conditioning(columns, b)

    def condition_inputs(
        self, latents: Tensor, cond: dict[str, Tensor], dtype: torch.dtype
    ) -> tuple[Tensor, dict[str, Any]]:
        """[noisy latents | mask and image latents] on the channels; the CLIP image states when stored."""
        x = torch.cat([latents, cond["image_latents"].to(latents)], dim=1)
        kw = {"encoder_hidden_states_image": cond["image_embeds"].to(dtype)} if "image_embeds" in cond else {}
        return x, kw

    def _first_frame(self, path: Any) -> Tensor:
        """Float[3, H, W] in [0, 1] of a row's ``image`` at the policy's size: an image file (``.png`` ...) or
        the first frame of anything `mmalign.data.media.read_video` reads, resized as it resizes."""
        from mmalign.data.media import IMAGE_SUFFIXES, load_rgb, read_video

        def make() -> Tensor:
            p = Path(path)
            if p.suffix.lower() in IMAGE_SUFFIXES:
                import numpy as np

                arr = torch.from_numpy(np.array(load_rgb(p))).permute(2, 0, 1).float() / 255.0
                frame = arr[None]
            else:
                frame = read_video(p)[:1]
            if tuple(frame.shape[-2:]) != (self.height, self.width):
                frame = torch.nn.functional.interpolate(
                    frame,
                    size=(self.height, self.width),
                    mode="bilinear",
                    align_corners=False,
                    antialias=True,
                ).clamp(0, 1)
            return frame[0]

        return self._pixels.get_or(("image", str(path)), make)

    def first_frames(self, columns: dict[str, list[Any]], b: int) -> Tensor:
        """Float[B, 3, H, W] in [0, 1]: the rows' ``image`` (the first frame of image to video)."""
        paths = self._column(columns, "image", b)
        if any(p is None for p in paths):
            raise ValueError(
                "condition 'i2v' needs an image in every row (column 'image': an image file, or a clip whose "
                "first frame is used)"
            )
        return torch.stack([self._first_frame(p) for p in paths])

    def image_conditioning(self, columns: dict[str, list[Any]], b: int) -> dict[str, Tensor]:
        """``image_latents`` Float[B, t + z, F_lat, h, w] (`wan_components.i2v_condition`) and, for a transformer
        with ``image_dim``, ``image_embeds`` Float[B, N, D] (`wan_components.encode_image`), cached per image."""
        paths = [str(p) for p in self._column(columns, "image", b)]
        frames = self.first_frames(columns, b)
        out: dict[str, list[Tensor]] = {"image_latents": [], "image_embeds": []}
        for path, frame in zip(paths, frames, strict=True):
            out["image_latents"].append(
                self._latents.get_or(
                    ("i2v", path, self.num_frames),
                    lambda f=frame: i2v_condition(self.vae, f[None], self.num_frames)[0],
                )
            )
            if self._takes_image_embeds():
                out["image_embeds"].append(
                    self._latents.get_or(
                        ("clip", path),
                        lambda f=frame: encode_image(self.image_encoder, self.image_processor, f[None])[0],
                    )
                )
        return {k: torch.stack(v).to(self.device) for k, v in out.items() if v}


WAN_CONDITION_POLICIES: dict[str, type[WanPolicy]] = {
    cls.condition: cls
    for cls in (WanPolicy, WanConcatPolicy, WanSDEditPolicy, WanVACEPolicy, WanImageToVideoPolicy)
}
"""The policy class of every ``options.condition`` name (add a new condition's subclass here)."""
CONDITIONS = tuple(WAN_CONDITION_POLICIES)
"""The condition names (see the module docstring)."""


def wan_policy_class(condition: str) -> type[WanPolicy]:
    """The `WanPolicy` subclass of the condition named `condition` (`WAN_CONDITION_POLICIES`); an unknown name
    is a ValueError listing the known ones."""
    if condition not in WAN_CONDITION_POLICIES:
        raise ValueError(f"condition must be one of {', '.join(CONDITIONS)}; got {condition!r}")
    return WAN_CONDITION_POLICIES[condition]
