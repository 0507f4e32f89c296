"""FSDP2 sharding (`torch.distributed.fsdp.fully_shard`): wrapping, full-weight gathering, sharded checkpoints.

`apply_fsdp2` shards a model as accelerate's FSDP2 plugin with ``TRANSFORMER_BASED_WRAP`` does: one
``fully_shard`` group per transformer block (by default the classes in ``_no_split_modules``; `DEFAULT_BLOCKS`),
then the root. Every rank must run the same number of forwards and backwards. `save_sharded` / `load_sharded`
write and read DCP folders of the trainable weights and optimizer state (all ranks must call);
`gather_full_state_dict` returns full CPU tensors on every rank (engine weight sync, ``final/``). The block
table and the trainer's use: docs/distributed.md, "FSDP2".
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

SHARDED_DIR = "sharded"
"""The DCP folder (model and optimizer shards of every rank) inside a checkpoint of a sharded run."""

DEFAULT_BLOCKS: dict[str, tuple[str, ...]] = {
    "qwen2": ("Qwen2DecoderLayer",),
    "qwen2_vl": ("Qwen2VLDecoderLayer", "Qwen2VLVisionBlock"),
    "qwen2_5_vl": ("Qwen2_5_VLDecoderLayer", "Qwen2_5_VLVisionBlock"),
    "sd3": ("JointTransformerBlock",),
    "flux": ("FluxTransformerBlock", "FluxSingleTransformerBlock"),
    "wan": ("WanTransformerBlock",),
}
"""The transformer-block classes that ``_no_split_modules`` gives for each supported family (documentation)."""


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    return DTensor


def is_dtensor(x: Any) -> bool:
    """Whether `x` is a `torch.distributed.tensor.DTensor` (a sharded or replicated distributed tensor)."""
    cls = _dtensor_type()
    return cls is not None and isinstance(x, cls)


def is_fsdp2(module: nn.Module) -> bool:
    """Whether `module` (or any submodule) was sharded with FSDP2's ``fully_shard``."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return any(isinstance(m, FSDPModule) for m in module.modules())


def _base_model(model: nn.Module) -> nn.Module:
    get_base = getattr(model, "get_base_model", None)  # peft
    return get_base() if callable(get_base) else model


def default_block_classes(model: nn.Module) -> list[str]:
    """The class names to wrap by default: the model's ``_no_split_modules`` (of the base model for peft)."""
    names: list[str] = []
    for m in (model, _base_model(model)):
        for name in getattr(m, "_no_split_modules", None) or []:
            if name not in names:
                names.append(name)
    return names


def find_blocks(model: nn.Module, block_classes: Sequence[str | type] | None = None) -> list[nn.Module]:
    """The submodules to shard one by one: instances of `block_classes` (class names or classes; default
    `default_block_classes`), outermost first, never one inside another."""
    wanted = list(block_classes) if block_classes is not None else default_block_classes(model)
    if not wanted:
        raise ValueError(
            f"apply_fsdp2: {type(model).__name__} declares no _no_split_modules; pass block_classes (the "
            "transformer-block class names to shard, e.g. ['Qwen2DecoderLayer'])"
        )
    names = {w for w in wanted if isinstance(w, str)}
    types = tuple(w for w in wanted if isinstance(w, type))
    blocks: list[nn.Module] = []
    inside: set[int] = set()
    for m in model.modules():
        if id(m) in inside or m is model:
            continue
        if type(m).__name__ in names or (types and isinstance(m, types)):
            blocks.append(m)
            inside.update(id(s) for s in m.modules())
    if not blocks:
        raise ValueError(
            f"apply_fsdp2: no module of {type(model).__name__} is one of the block classes {sorted(map(str, wanted))}"
        )
    return blocks


def apply_fsdp2(
    model: nn.Module,
    mesh: Any = None,
    block_classes: Sequence[str | type] | None = None,
    *,
    reshard_after_forward: bool = True,
    mp_policy: Any = None,
) -> nn.Module:
    """Shard `model` in place with FSDP2: ``fully_shard`` on each transformer block (`find_blocks`), then on
    the root. `mesh`: a 1-D `DeviceMesh` (default: all ranks of the default process group, on CUDA when it is
    available, else CPU). Returns `model` (its class becomes ``FSDP<Class>``; names are unchanged)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "apply_fsdp2 needs an initialised process group (torchrun, or torch.distributed.init_process_group)"
        )
    if is_fsdp2(model):
        raise ValueError(f"apply_fsdp2: {type(model).__name__} is already sharded with fully_shard")
    if mesh is None:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cuda" if torch.cuda.is_available() else "cpu", (dist.get_world_size(),))
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    for block in find_blocks(model, block_classes):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


# ----------------------------------------------------------------------------- full weights


def _full(value: Tensor, cpu: bool) -> Tensor:
    v = value.detach()
    v = v.full_tensor() if is_dtensor(v) else v.clone()
    return v.cpu() if cpu else v


def gather_full_state_dict(
    module: nn.Module, *, trainable_only: bool = False, cpu: bool = True
) -> dict[str, Tensor]:
    """Full (unsharded) tensors of `module`'s state dict, under the usual names, on EVERY rank (a collective
    when parameters are DTensors: all ranks must call it). ``trainable_only``: only parameters with
    ``requires_grad`` (named as in ``named_parameters``, tied weights once). ``cpu``: move them to the CPU
    (else they stay on the parameters' device). Plain tensors are cloned, so the result never aliases the
    model."""
    if trainable_only:
        return {n: _full(p, cpu) for n, p in module.named_parameters() if p.requires_grad}
    return {n: _full(v, cpu) for n, v in module.state_dict().items()}


@contextlib.contextmanager
def full_parameters(module: nn.Module) -> Iterator[None]:
    """Within the block, every DTensor parameter of `module` is replaced by a plain parameter holding its full
    value (gathered on every rank: a collective), so code that reads module attributes (``layer.weight``, e.g.
    peft's ``get_delta_weight``) sees full tensors. Tied parameters stay tied. Read-only: changes made inside
    are dropped. ``module.state_dict()`` inside the block still returns the sharded DTensors (FSDP2 re-registers
    them); use `gather_full_state_dict` for a state dict."""
    saved: list[tuple[nn.Module, str, nn.Parameter]] = []
    full: dict[int, nn.Parameter] = {}
    with torch.no_grad():
        for m in module.modules():
            for name, p in list(m._parameters.items()):
                if p is None or not is_dtensor(p):
                    continue
                if id(p) not in full:
                    full[id(p)] = nn.Parameter(p.detach().full_tensor(), requires_grad=p.requires_grad)
                saved.append((m, name, p))
                m._parameters[name] = full[id(p)]
    try:
        yield
    finally:
        for m, name, p in saved:
            m._parameters[name] = p


# ----------------------------------------------------------------------------- training helpers


@contextlib.contextmanager
def no_grad_sync(module: nn.Module) -> Iterator[None]:
    """Accumulate gradients locally (no reduce-scatter) for the backwards inside the block; the next backward
    outside it reduces the accumulated sum. A no-op for a module that is not FSDP2-sharded."""
    if not hasattr(module, "set_requires_gradient_sync"):
        yield
        return
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


def clip_grad_norm_(parameters: Iterable[nn.Parameter], max_norm: float, norm_type: float = 2.0) -> Tensor:
    """`torch.nn.utils.clip_grad_norm_` for DTensor (sharded) gradients: the norm is the global one (over
    all shards, the same on every rank) and comes back as a plain scalar tensor."""
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return torch.zeros(())
    norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type)
    if is_dtensor(norm):
        norm = norm.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(
        params, max_norm, _like_grads(norm, params[0].grad) if is_dtensor(params[0].grad) else norm
    )
    return norm.detach()


def _like_grads(norm: Tensor, grad: Any) -> Tensor:
    from torch.distributed.tensor import DTensor, Replicate

    return DTensor.from_local(norm, grad.device_mesh, [Replicate()] * grad.device_mesh.ndim)


# ----------------------------------------------------------------------------- sharded checkpoints


def _plain_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    while not isinstance(optimizer, torch.optim.Optimizer) and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer  # accelerate's AcceleratedOptimizer
    return optimizer


def _options(**kwargs: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=True, **kwargs)


def save_sharded(path: str | Path, model: nn.Module, optimizer: Any) -> None:
    """Write the trainable weights and the optimizer state of an FSDP2 model as a DCP folder at `path`
    (every rank writes its own shards; all ranks must call it). Frozen parameters (a LoRA run's base model) are
    not written, except a frozen output embedding tied to the input one, which DCP keeps under the head's name."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, _plain_optimizer(optimizer), options=_options())
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(path))


def load_sharded(path: str | Path, model: nn.Module, optimizer: Any) -> None:
    """Read a `save_sharded` folder into `model` and `optimizer` (resharded to this run's mesh; all ranks must
    call it). A folder that is not a DCP checkpoint is an error naming it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = Path(path)
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(
            f"{path} is not a sharded (torch.distributed.checkpoint) checkpoint: no .metadata"
        )
    opt = _plain_optimizer(optimizer)
    msd, osd = get_state_dict(model, opt, options=_options())
    state = {"model": msd, "optimizer": osd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(
        model,
        opt,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        options=_options(strict=False),
    )


# ----------------------------------------------------------------------------- launches
def launched_processes() -> int:
    """The number of processes the launcher started (``WORLD_SIZE``, set by torchrun / accelerate launch)."""
    import os

    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def check_batches(cfg: Any, world: int) -> None:
    """``rollout.prompts_per_step`` and ``trainer.minibatch_size`` split evenly over `world` processes; a
    `ConfigError` naming the key otherwise (the trainer checks it, and the command line's preflight before any
    model loads, with `launched_processes`)."""
    from mmalign.errors import ConfigError

    r, t = cfg.rollout, cfg.trainer
    if r.prompts_per_step % world:
        raise ConfigError(
            f"{cfg.source}: key 'rollout.prompts_per_step' ({r.prompts_per_step}) must be divisible by "
            f"the number of processes ({world})"
        )
    if t.minibatch_size and t.minibatch_size % world:
        raise ConfigError(
            f"{cfg.source}: key 'trainer.minibatch_size' must be divisible by the number of processes"
        )


def check_launch(distributed_type: Any, num_processes: int) -> None:
    """Refuse a DeepSpeed launch (not supported: use FSDP2), and a launch of ``WORLD_SIZE`` > 1 processes that
    accelerate did not set up as that many."""
    from mmalign.config import ConfigError

    if str(getattr(distributed_type, "value", distributed_type)).upper() == "DEEPSPEED":
        raise ConfigError(
            "DeepSpeed is not supported: accelerate's DeepSpeed engine steps the optimizer at every backward "
            "(mmalign accumulates micro-batches), and mmalign's checkpoints and final/ hold neither the ZeRO "
            "partitions of the other processes nor ZeRO-3 weights. For a sharded run use FSDP2: accelerate "
            "launch --config_file configs/accelerate/fsdp2.yaml (docs/distributed.md)"
        )
    launched = launched_processes()
    if launched > 1 and num_processes != launched:
        raise ConfigError(
            f"the launcher started {launched} processes (WORLD_SIZE), but accelerate set up {num_processes} "
            f"(distributed type {getattr(distributed_type, 'value', distributed_type)}): each would run alone. "
            "Set trainer.cpu=true (or ACCELERATE_USE_CPU=true) for CPU processes"
        )
