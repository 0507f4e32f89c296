"""The model side of `mmalign plan`: architectures built on the meta device, and a memory / FLOP recorder.

Nothing here allocates a model. A model is described by its components (`ComponentSpec`: library, class,
config.json values) read, in this order, from a local model folder, the local Hugging Face hub cache
(``local_files_only``), or the table of public architecture configs in ``architectures.json`` beside this
file (values typed in from each model's config.json, with the file named). `build_meta` instantiates a
component on the ``meta`` device (shapes and dtypes only).

`Recorder` runs code on such meta modules and records what a real device would allocate: a
``TorchDispatchMode`` that counts the bytes of every tensor storage an operator creates and frees it when
the storage is garbage-collected (the meta tensors live exactly as long as the real ones would, held by
the same autograd graph), with the peak, split by what is live at the peak (gradients of parameters are
tracked by a post-accumulate hook; heap blocks, below `HEAP_LIMIT`, for what a CPU process holds), and the FLOPs of every operator by ``torch.utils.flop_counter``'s
formulas (those ``FlopCounterMode`` uses). Attention runs through `FusedAttention`: meta tensors would pick the
math kernel of ``scaled_dot_product_attention`` (which keeps the full attention matrix), while a GPU (and
the CPU) run the fused flash / memory-efficient kernels, which keep only q, k, v, the output, a
log-sum-exp per query and the mask; the stand-in keeps exactly those and counts the kernel's FLOPs.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary

from mmalign.config import ConfigError

TABLE_FILE = Path(__file__).with_name("architectures.json")

DTYPE_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


# ----------------------------------------------------------------------------- architecture specs
@dataclass
class ComponentSpec:
    """One module of a model: its library (``transformers`` / ``diffusers``), class name, config.json values
    and where they were read from."""

    library: str
    cls: str
    config: dict[str, Any]
    source: str


@dataclass
class ModelSpec:
    """A model as `mmalign plan` sees it: ``kind`` is ``causal_lm``, ``vlm`` or ``diffusers`` (a folder of
    components: ``transformer`` / ``unet``, ``vae``, text encoders)."""

    name: str
    kind: str
    components: dict[str, ComponentSpec]
    origin: str
    """``folder``, ``hub cache`` or ``table``."""

    @property
    def denoiser(self) -> str:
        """The trained component of a diffusers model (``transformer`` or ``unet``)."""
        for name in ("transformer", "unet"):
            if name in self.components:
                return name
        raise ConfigError(f"{self.name}: no transformer/ or unet/ component to train")


def load_table() -> dict[str, Any]:
    """``architectures.json``: {"models": {hub id: entry}, "shared": {ref: component}}."""
    return json.loads(TABLE_FILE.read_text())


def table_names() -> list[str]:
    """The hub ids the architecture table knows."""
    return sorted(load_table()["models"])


def _table_component(table: dict[str, Any], entry: dict[str, Any]) -> ComponentSpec:
    if "$ref_model" in entry:
        inner = table["models"][entry["$ref_model"]]["components"]["model"]
        return ComponentSpec(inner["library"], inner["class"], dict(inner["config"]), entry["source"])
    base = table["shared"][entry["$ref"]] if "$ref" in entry else entry
    return ComponentSpec(base["library"], base["class"], dict(base["config"]), entry["source"])


def _kind_of(cls: str, config: dict[str, Any]) -> str:
    if "vision_config" in config or "ConditionalGeneration" in cls:
        return "vlm"
    return "causal_lm"


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from None


def _component_from_config(config: dict[str, Any], source: str) -> ComponentSpec | None:
    """A component from its config.json: diffusers writes ``_class_name``, transformers ``architectures``."""
    if "_class_name" in config:
        clean = {k: v for k, v in config.items() if not k.startswith("_")}
        return ComponentSpec("diffusers", config["_class_name"], clean, source)
    archs = config.get("architectures") or []
    if archs:
        return ComponentSpec("transformers", archs[0], dict(config), source)
    return None


def spec_from_folder(folder: Path, name: str, origin: str = "folder") -> ModelSpec:
    """A `ModelSpec` of a local model folder: a transformers model (``config.json`` at the top) or a
    diffusers folder (one ``config.json`` per component subfolder)."""
    top = folder / "config.json"
    if top.is_file():
        comp = _component_from_config(_read_json(top), str(top))
        if comp is None:
            raise ConfigError(f"{top}: no 'architectures' entry; cannot tell which model class it is")
        return ModelSpec(name, _kind_of(comp.cls, comp.config), {"model": comp}, origin)
    components = {}
    for sub in sorted(p for p in folder.iterdir() if p.is_dir()):
        cfg_file = sub / "config.json"
        if cfg_file.is_file():
            comp = _component_from_config(_read_json(cfg_file), str(cfg_file))
            if comp is not None:
                components[sub.name] = comp
    if not any(k in components for k in ("transformer", "unet")):
        raise ConfigError(
            f"{folder}: neither a config.json (transformers) nor a transformer/ or unet/ component (diffusers)"
        )
    return ModelSpec(name, "diffusers", components, origin)


def _hub_cache_folder(repo: str) -> Path | None:
    """The local hub-cache snapshot of `repo` holding its config files (nothing is downloaded)."""
    try:
        from huggingface_hub import snapshot_download

        path = snapshot_download(repo, local_files_only=True, allow_patterns=["*.json"])
    except Exception:  # not cached (or no hub library): the table is the fallback
        return None
    return Path(path)


def resolve_model(name_or_path: str) -> ModelSpec:
    """The `ModelSpec` of ``model.name_or_path``: a local folder, else the hub cache, else the table."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return spec_from_folder(path, name_or_path)
    cached = _hub_cache_folder(name_or_path) if "/" in name_or_path else None
    if cached is not None:
        try:
            spec = spec_from_folder(cached, name_or_path, origin="hub cache")
        except ConfigError:
            spec = None
        if spec is not None:
            return spec
    table = load_table()
    entry = table["models"].get(name_or_path)
    if entry is None:
        raise ConfigError(
            f"model {name_or_path!r} (config key model.name_or_path): not a local folder, not in the local "
            f"Hugging Face cache, and not in the architecture table {TABLE_FILE.name} "
            f"(known: {', '.join(table_names())})"
        )
    comps = {k: _table_component(table, v) for k, v in entry["components"].items()}
    return ModelSpec(name_or_path, entry["kind"], comps, "table")


# ----------------------------------------------------------------------------- meta models
def build_meta(comp: ComponentSpec, dtype: torch.dtype) -> torch.nn.Module:
    """`comp` instantiated on the meta device in `dtype` (no memory, no weights)."""
    if comp.library == "diffusers":
        import diffusers

        from mmalign.app.console import quiet_diffusers_fp32_notice

        quiet_diffusers_fp32_notice()  # `.to(dtype)` below would log "should be kept in float32: []"
        cls = getattr(diffusers, comp.cls, None)
        if cls is None:
            raise ConfigError(f"{comp.source}: diffusers has no model class {comp.cls!r}")
        with torch.device("meta"):
            model = cls.from_config(comp.config)
        return register_module(model.to(dtype))
    import transformers

    cls = getattr(transformers, comp.cls, None)
    if cls is None:
        raise ConfigError(f"{comp.source}: transformers has no model class {comp.cls!r}")
    cfg = dict(comp.config)
    model_type = cfg.pop("model_type", None) or getattr(cls.config_class, "model_type", "")
    config = transformers.AutoConfig.for_model(model_type, **cfg)
    config._attn_implementation = "sdpa"
    for sub in ("text_config", "vision_config"):
        inner = getattr(config, sub, None)
        if inner is not None:
            inner._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = cls._from_config(config, dtype=dtype)
    return register_module(model)


def param_numel(module: torch.nn.Module, *, trainable: bool | None = None) -> int:
    """Parameters of `module` (each shared tensor once); only the trainable / frozen ones when asked."""
    seen: set[int] = set()
    n = 0
    for p in module.parameters():
        if trainable is not None and p.requires_grad != trainable:
            continue
        if id(p) not in seen:
            seen.add(id(p))
            n += p.numel()
    return n


def param_bytes(module: torch.nn.Module, *, trainable: bool | None = None) -> int:
    """Bytes of the parameters of `module` in their dtypes (shared tensors once)."""
    seen: set[int] = set()
    n = 0
    for p in module.parameters():
        if trainable is not None and p.requires_grad != trainable:
            continue
        if id(p) not in seen:
            seen.add(id(p))
            n += p.numel() * p.element_size()
    return n


def buffer_bytes(module: torch.nn.Module) -> int:
    """Bytes of the registered buffers of `module` (positional tables, rotary frequencies): on the device with
    the weights."""
    return sum(b.numel() * b.element_size() for b in module.buffers())


def largest_param_bytes(module: torch.nn.Module, *, trainable: bool = True) -> int:
    return max(
        (p.numel() * p.element_size() for p in module.parameters() if p.requires_grad == trainable), default=0
    )


def block_param_bytes(module: torch.nn.Module) -> int:
    """Bytes of the largest repeated block (a child of a ``ModuleList``): what FSDP2 all-gathers at once."""
    best = 0
    for sub in module.modules():
        if isinstance(sub, torch.nn.ModuleList):
            for child in sub:
                best = max(best, param_bytes(child))
    return best


# ----------------------------------------------------------------------------- attention stand-in
class _FusedKernel(torch.autograd.Function):
    """The memory a fused attention kernel keeps for its backward: q, k, v, the output (laid out
    [B, L, H, D] as the kernels write it), the fp32 log-sum-exp [B, H, L] and the additive mask."""

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        shape = (*q.shape[:-3], q.shape[-2], q.shape[-3], v.shape[-1])
        out = torch.empty(shape, dtype=q.dtype, device=q.device).transpose(-2, -3)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse, bias)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, _out, _lse, _bias = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None


class FusedAttention(TorchFunctionMode):
    """Routes ``F.scaled_dot_product_attention`` to `_FusedKernel` and counts its FLOPs (``flops``): 4 L_q L_k
    D per head forward, 2.5 times that more in the backward (recompute of the scores plus the three
    gradient products), as ``FlopCounterMode`` counts the real kernels. A boolean mask is converted to an
    additive mask of the query dtype per call, as ``scaled_dot_product_attention`` does."""

    def __init__(self) -> None:
        super().__init__()
        self.forward_flops = 0
        self.backward_flops = 0

    def __enter__(self) -> FusedAttention:
        # The attribute is patched (not only intercepted by this mode): a checkpointed block recomputed in
        # the backward runs on the autograd engine's thread, where function modes are not active.
        self._real_sdpa = torch.nn.functional.scaled_dot_product_attention
        torch.nn.functional.scaled_dot_product_attention = self._sdpa  # type: ignore[assignment]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.nn.functional.scaled_dot_product_attention = self._real_sdpa
        super().__exit__(*exc)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in (torch.Tensor.nonzero, torch.nonzero) and args and args[0].device.type == "meta":
            return _all_nonzero(args[0], **kwargs)
        return func(*args, **kwargs)

    def _sdpa(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        q, k, v = query, key, value
        bias = attn_mask
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            bias = torch.empty(attn_mask.shape, dtype=q.dtype, device=q.device)
        lq, lk, d = q.shape[-2], k.shape[-2], q.shape[-1]
        heads = q.numel() // (lq * d)
        fwd = 4 * heads * lq * lk * d
        self.forward_flops += fwd
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            self.backward_flops += int(2.5 * fwd)  # counted when the forward runs; the backward follows
            return _FusedKernel.apply(q, k, v, bias)
        shape = (*q.shape[:-3], q.shape[-2], q.shape[-3], v.shape[-1])
        return torch.empty(shape, dtype=q.dtype, device=q.device).transpose(-2, -3)


def _all_nonzero(t: torch.Tensor, as_tuple: bool = False) -> Any:
    """``nonzero`` of a meta tensor taken to be nonzero everywhere (the planner's worst case: every token of a
    mask valid); meta tensors hold no values to look at."""
    n = t.numel()
    if t.dim() <= 1:
        idx = torch.arange(n, device="meta")
        return (idx,) if as_tuple else idx.view(n, 1)
    full = torch.empty((n, t.dim()), dtype=torch.long, device="meta")
    return tuple(full.unbind(1)) if as_tuple else full


# ----------------------------------------------------------------------------- constant meta tensors
_FILLS: dict[Any, Any] = {
    torch.zeros: 0,
    torch.ones: 1,
    torch.zeros_like: 0,
    torch.ones_like: 1,
    torch.Tensor.new_zeros: 0,
    torch.Tensor.new_ones: 1,
}
_FULLS = (torch.full, torch.full_like, torch.Tensor.new_full)
_INPLACE = {
    "__setitem__",
    "__iadd__",
    "__isub__",
    "__imul__",
    "__itruediv__",
    "__iand__",
    "__ior__",
    "__ixor__",
}
KNOWN_LIMIT = 2**24
"""Most elements of a constant tensor `KnownValues` computes with on the CPU (beyond: its value is forgotten)."""


class KnownValues(TorchFunctionMode):
    """Fill values of constant meta tensors, for a forward that reads values (`families.PlanSpec.meta_values`):
    a tensor made by ``torch.zeros`` / ``ones`` / ``full`` (and their ``_like`` / ``new_`` forms) inside the mode
    has a known fill. An operation whose meta arguments all have known fills runs on CPU stand-ins of them (filled
    tensors of the same shapes), so a Python branch on its result (``if torch.all(x == 0)``, ``.item()``) takes
    the path a real run takes; its tensor results come back as meta tensors of the same shapes, with their fills
    when uniform. Boolean-mask indexing of any tensor by a mask of known fill keeps every row (True) or none
    (False). An in-place operation forgets (or updates) the fill of what it writes."""

    def __init__(self) -> None:
        super().__init__()
        self.values: Any = WeakIdKeyDictionary()

    def _known(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t.device.type == "meta" and t in self.values

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        fill = _FILLS.get(func)
        if fill is None and func in _FULLS:
            fill = kwargs.get("fill_value", args[-1] if args else None)
        if fill is not None:
            out = func(*args, **kwargs)
            if (
                isinstance(out, torch.Tensor)
                and out.device.type == "meta"
                and isinstance(fill, int | float | bool)
            ):
                self.values[out] = fill
            return out
        if func is torch.Tensor.__iter__ and self._known(args[0]):
            return iter(self.__torch_function__(torch.Tensor.unbind, types, (args[0],), {}))
        if func is torch.Tensor.__getitem__ and len(args) == 2 and self._known(args[1]):
            picked = self._mask_rows(args[0], args[1])
            if picked is not None:
                return picked
        metas = [
            t
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor) and t.device.type == "meta"
        ]
        getter = getattr(func, "__name__", "") == "__get__"
        if metas and not getter and all(self._known(t) and t.numel() <= KNOWN_LIMIT for t in metas):
            return self._on_cpu(func, args, kwargs)
        name = getattr(func, "__name__", "")
        if metas and (name in _INPLACE or (name.endswith("_") and not name.endswith("__"))):
            self.values.pop(metas[0], None)
        return func(*args, **kwargs)

    def _mask_rows(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor | None:
        """``x[mask]`` for a boolean mask of known fill over x's leading dimensions (a copy, as the gather is)."""
        k = mask.dim()
        if mask.dtype != torch.bool or k == 0 or tuple(x.shape[:k]) != tuple(mask.shape) or self._known(x):
            return None
        rows = mask.numel() if self.values[mask] else 0
        return x.flatten(0, k - 1)[:rows].clone()

    def _on_cpu(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """`func` on the meta tensors (what the recorder sees: views stay views) with the fills its CPU run on the
        stand-ins gives; where meta cannot answer (a Python value of the data, ``nonzero``), the CPU run's
        result (tensors as meta tensors of its shapes)."""
        from torch.utils._python_dispatch import _disable_current_modes

        stand_ins: list[tuple[torch.Tensor, torch.Tensor]] = []

        def real(t: Any) -> Any:
            if isinstance(t, torch.Tensor) and t.device.type == "meta":
                cpu = torch.full(tuple(t.shape), self.values[t], dtype=t.dtype)
                stand_ins.append((t, cpu))
                return cpu
            if (isinstance(t, torch.device) and t.type == "meta") or (isinstance(t, str) and t == "meta"):
                return torch.device("cpu")
            return t

        with _disable_current_modes():  # the recorder does not count the CPU stand-ins
            cpu_out = func(*tree_map(real, args), **tree_map(real, kwargs))
            cpu_leaves = tree_flatten(cpu_out)[0]
            fills = [_fill(t) if isinstance(t, torch.Tensor) else None for t in cpu_leaves]
            for meta, cpu in stand_ins:  # in place: the stand-in now holds what the tensor would
                value = _fill(cpu)
                if value is None:
                    self.values.pop(meta, None)
                else:
                    self.values[meta] = value
        try:
            out = func(*args, **kwargs)
        except (RuntimeError, NotImplementedError):  # a value meta tensors do not have
            out = None
        leaves = tree_flatten(out)[0] if out is not None else []
        same = (
            out is not None
            and len(leaves) == len(cpu_leaves)
            and all(
                not isinstance(c, torch.Tensor) or (isinstance(m, torch.Tensor) and m.shape == c.shape)
                for m, c in zip(leaves, cpu_leaves, strict=True)
            )
        )
        if not same:
            made = {
                id(t): torch.empty(tuple(t.shape), dtype=t.dtype, device="meta")
                for t in cpu_leaves
                if isinstance(t, torch.Tensor)
            }
            out = tree_map(lambda t: made.get(id(t), t) if isinstance(t, torch.Tensor) else t, cpu_out)
            leaves = tree_flatten(out)[0]
        for m, value in zip(leaves, fills, strict=True):
            if isinstance(m, torch.Tensor) and m.device.type == "meta" and value is not None:
                self.values[m] = value
        return out


def _fill(t: torch.Tensor) -> Any:
    """The value every element of CPU tensor `t` holds, None when they differ (or there are none)."""
    if t.numel() == 0:
        return None
    first = t.reshape(-1)[0]
    return first.item() if bool((t == first).all()) else None


# ----------------------------------------------------------------------------- memory recorder
HEAP_LIMIT = 32 * 2**20
"""glibc's largest mmap threshold on 64-bit Linux (``DEFAULT_MMAP_THRESHOLD_MAX``, 4 MiB x sizeof(long)): a CPU
tensor of at least this many bytes is mmapped and its pages go back to the system when it is freed; a smaller
one comes from the heap, which keeps the freed block for later allocations (the threshold starts at 128 KiB and
rises to the largest block freed, up to this limit, so after the first frees every smaller tensor is heap)."""


def size_bucket(n: int) -> int:
    """The power-of-two bucket of an `n`-byte block: blocks of [2**(k-1), 2**k) bytes are bucket k."""
    return int(n).bit_length()


def heap_bytes(buckets: list[int], scale: int = 1) -> int:
    """Bytes of the blocks counted in `buckets` (per `size_bucket`) that are heap blocks (below `HEAP_LIMIT`) once
    each is `scale` times larger (a recording of one row standing for `scale` rows), times `scale`; a bucket is
    classed by its smallest size."""
    return sum(b * scale for k, b in enumerate(buckets) if b and (1 << max(0, k - 1)) * scale < HEAP_LIMIT)


@dataclass
class Peak:
    """Live bytes at a peak: ``total``, how much of it were parameter gradients, how much was in heap blocks
    (below `HEAP_LIMIT`: ``heap``), their bytes by size bucket (``buckets``, `size_bucket`), and the largest
    heap-block bytes live at any moment of the phase (``heap_high``)."""

    total: int = 0
    grads: int = 0
    heap: int = 0
    heap_high: int = 0
    buckets: list[int] = field(default_factory=list)


def _flop_formulas() -> dict[Any, Any]:
    from torch.utils.flop_counter import flop_registry

    return dict(flop_registry)


_FLOP_FORMULAS = _flop_formulas()


class _Block:
    """One tracked storage: its bytes, whether it is a parameter's gradient, and which weak reference owns
    it (an in-place accumulation moves the block to the result's storage)."""

    __slots__ = ("grad", "n", "owner")

    def __init__(self, n: int) -> None:
        self.n, self.grad, self.owner = n, False, None


@dataclass
class Recorder(TorchDispatchMode):
    """Live tensor bytes of the operators run inside it (see the module docstring). Tensors that exist
    before (parameters, inputs) are passed to `ignore`, so what is counted is what the code allocates.
    `phase(name)` records the peak of a named phase separately (`peaks`), with the gradient bytes live at
    that moment (`watch_grads` registers the parameters whose gradients count as such), the bytes in blocks
    below `HEAP_LIMIT` (what a CPU run takes from glibc's heap) then and at their own high-water, and the live
    bytes by size bucket (for a recording of one row that stands for many).

    One correction: with any dispatch mode active, autograd accumulates a parameter's new gradient into the
    existing one out of place (``grad + new``, then the old one is freed) where a plain run adds in place;
    such an ``add`` is counted as the in-place update it would be."""

    current: int = 0
    grads: int = 0
    heap: int = 0
    """Live bytes in blocks below `HEAP_LIMIT` (what the CPU allocator takes from glibc's heap)."""
    flops: int = 0
    """FLOPs of the operators run inside it (``torch.utils.flop_counter``'s formulas: matmuls, convolutions)."""
    nongrad_peak: int = 0
    """The largest non-gradient part of the live bytes at any moment."""
    peaks: dict[str, Peak] = field(default_factory=dict)
    _phase: str = "main"
    _known: Any = None
    _buckets: list[int] = field(default_factory=lambda: [0] * 64)

    def __post_init__(self) -> None:
        super().__init__()
        self._known = WeakIdKeyDictionary()

    def ignore(self, tensors: Iterator[torch.Tensor] | list[torch.Tensor]) -> None:
        for t in tensors:
            self._known[t.untyped_storage()] = None

    def watch_grads(self, params: list[torch.nn.Parameter]) -> None:
        """Count the gradients of `params` as gradients (and stop counting them when set to None)."""
        for p in params:
            p.register_post_accumulate_grad_hook(self._grad_hook)

    def _grad_hook(self, p: torch.Tensor) -> None:
        block = self._known.get(p.grad.untyped_storage())  # type: ignore[union-attr]
        if block is not None and not block.grad:
            block.grad = True
            self.grads += block.n

    def _release(self, block: _Block, ref: Any) -> None:
        if block.owner is ref:
            self.current -= block.n
            self._buckets[size_bucket(block.n)] -= block.n
            if block.n < HEAP_LIMIT:
                self.heap -= block.n
            if block.grad:
                self.grads -= block.n

    def _track(self, st: torch.UntypedStorage, block: _Block) -> None:
        block.owner = weakref.ref(st, lambda r, blk=block: self._release(blk, r))
        self._known[st] = block

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        previous = self._phase
        self._phase = name
        self.peaks.setdefault(name, Peak())
        self._bump()
        try:
            yield
        finally:
            self._phase = previous

    def _bump(self) -> None:
        self.nongrad_peak = max(self.nongrad_peak, self.current - self.grads)
        peak = self.peaks.setdefault(self._phase, Peak())
        peak.heap_high = max(peak.heap_high, self.heap)
        if self.current > peak.total:
            peak.total, peak.grads, peak.heap = self.current, self.grads, self.heap
            peak.buckets = list(self._buckets)

    def _add(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        if st in self._known:
            return
        n = st.nbytes()
        self._track(st, _Block(n))
        self.current += n
        self._buckets[size_bucket(n)] += n
        if n < HEAP_LIMIT:
            self.heap += n
        self._bump()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = _FLOP_FORMULAS.get(func._overloadpacket)
        if formula is not None:
            self.flops += formula(*args, **kwargs, out_val=out)
        if func is torch.ops.aten.add.Tensor and self._moved_gradient(args, out):
            return out
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._add(t)
        return out

    def _moved_gradient(self, args: tuple, out: Any) -> bool:
        """``old + new`` in the backward (autograd accumulating a gradient: several uses of one tensor, or a
        parameter's existing gradient) is done in place by a plain run; move the first operand's block to
        `out` instead of counting a new one."""
        if (
            torch.is_grad_enabled()
            or torch._C._current_autograd_node() is None
            or not isinstance(out, torch.Tensor)
        ):
            return False
        a = args[0] if args else None
        if not (isinstance(a, torch.Tensor) and a.shape == out.shape and a.dtype == out.dtype):
            return False
        block = self._known.get(a.untyped_storage())
        if block is None:
            return False
        self._track(out.untyped_storage(), block)
        return True


@contextmanager
def meta_autocast() -> Iterator[None]:
    """Autocast queries about the ``meta`` device answer "off" inside the block (torch knows no autocast for
    meta and raises): code that asks ``torch.is_autocast_enabled(weight.device.type)`` or enters
    ``torch.autocast(kind, enabled=False)`` then runs on meta tensors as on a device without autocast."""
    enabled, get_dtype, autocast = torch.is_autocast_enabled, torch.get_autocast_dtype, torch.autocast

    def is_enabled(*args: Any) -> bool:
        return False if args and args[0] == "meta" else enabled(*args)

    def autocast_dtype(device_type: str) -> torch.dtype:
        return torch.float32 if device_type == "meta" else get_dtype(device_type)

    class MetaAwareAutocast(autocast):  # type: ignore[misc, valid-type]
        def __init__(self, device_type: str, *args: Any, **kwargs: Any) -> None:
            if device_type == "meta":
                device_type, kwargs = "cpu", {**kwargs, "enabled": False}
                args = ()
            super().__init__(device_type, *args, **kwargs)

    torch.is_autocast_enabled, torch.get_autocast_dtype, torch.autocast = (
        is_enabled,
        autocast_dtype,
        MetaAwareAutocast,
    )
    try:
        yield
    finally:
        torch.is_autocast_enabled, torch.get_autocast_dtype, torch.autocast = enabled, get_dtype, autocast


@contextmanager
def recording(
    params: list[torch.Tensor], *, known_values: bool = False
) -> Iterator[tuple[Recorder, FusedAttention]]:
    """(recorder, attention stand-in) active inside the block; `params` (and the buffers of their registered
    modules) are not counted. FLOPs are counted by the recorder with ``FlopCounterMode``'s formulas (the mode
    itself is not used: its module tracking keeps tensors alive across passes). `known_values`: track the fills
    of constant meta tensors (`KnownValues`)."""
    rec = Recorder()
    rec.ignore(params)
    owners = {id(p) for p in params}
    rec.ignore([b for m in _modules_of(params) for b in m.buffers() if id(b) not in owners])
    attn = FusedAttention()
    with meta_autocast(), attn, rec:
        if not known_values:
            yield rec, attn
            return
        with KnownValues():
            yield rec, attn


_MODULES: weakref.WeakValueDictionary[int, torch.nn.Module] = weakref.WeakValueDictionary()


def register_module(module: torch.nn.Module) -> torch.nn.Module:
    """Remember `module`, so that `recording` of its parameters also leaves its buffers out of the count."""
    _MODULES[id(module)] = module
    return module


def _modules_of(params: list[torch.Tensor]) -> list[torch.nn.Module]:
    ids = {id(p) for p in params}
    return [m for m in list(_MODULES.values()) if any(id(p) in ids for p in m.parameters())]


def run_meta(fn: Callable[[], Any]) -> Any:
    """`fn()` with the default device set to meta (tensors it creates without a device are meta too)."""
    with torch.device("meta"):
        return fn()
