"""The training loop's scale-out engines: one process, DDP, or FSDP2 under ``torchrun``.

``parallel`` in the config picks the engine: ``ddp`` replicates the model and
all-reduces gradients; ``fsdp`` shards parameters, gradients and optimiser state over
the ranks with FSDP2 (:func:`torch.distributed.fsdp.fully_shard`, one unit per
transformer block plus the root, which keeps the embedding tied to the LM head);
``auto`` is DDP under ``torchrun`` and one process otherwise. With a world size of 1
every engine is the plain single-process loop.

Checkpoints have one format for every engine: a full (unsharded) safetensors model
as ``safetensors.torch.save_model`` writes it, and the optimiser state in the layout
of ``torch.optim.Optimizer.state_dict`` (integer parameter ids). Under FSDP the full
state is gathered to CPU on rank 0 with
:func:`torch.distributed.checkpoint.state_dict.get_model_state_dict` /
``get_optimizer_state_dict`` and restored with the ``set_*`` counterparts (rank 0 reads
the files and broadcasts), so a run can resume under any engine and world size.
"""

from __future__ import annotations

import contextlib
from typing import Any, Literal

import torch
from torch import nn

from structlm.settings import local_rank, world_size

__all__ = ["PARALLEL_MODES", "Engine", "autocast", "check_parallel", "init_distributed",
           "load_model", "load_optimizer", "no_sync", "optimizer_state", "resolve_engine",
           "unsharded", "wrap"]

PARALLEL_MODES = ("auto", "ddp", "fsdp")
"""Values of ``TrainConfig.parallel``."""

Engine = Literal["single", "ddp", "fsdp"]
"""What actually runs."""


def check_parallel(mode: str) -> None:
    """Raise a ``ValueError`` naming ``mode`` and the options unless it is one of them."""
    if mode not in PARALLEL_MODES:
        raise ValueError(f"unknown parallel={mode!r}: expected one of {list(PARALLEL_MODES)}")


def init_distributed() -> tuple[int, int]:
    """(rank, world size); under ``torchrun`` initialises the process group (NCCL on GPU,
    gloo on CPU) and, on GPU, selects the local device."""
    import torch.distributed as dist

    world = world_size()
    if world <= 1:
        return 0, 1
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank())
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_rank(), world


def resolve_engine(mode: str, world: int) -> Engine:
    """The engine for ``parallel=mode`` on ``world`` processes."""
    check_parallel(mode)
    if world <= 1:
        return "single"
    return "fsdp" if mode == "fsdp" else "ddp"


def wrap(model: nn.Module, engine: Engine, device: torch.device) -> nn.Module:
    """The module to run forward/backward through. DDP returns a wrapper around
    ``model``; FSDP shards ``model`` in place (so build the optimiser afterwards) and
    returns it. On GPU, FSDP gathers parameters in bfloat16 and reduces gradients in
    float32 (``MixedPrecisionPolicy``); on CPU everything stays float32."""
    if engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    if engine != "fsdp":
        return model
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    kwargs: dict[str, Any] = {"mesh": mesh}
    if device.type == "cuda":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                   reduce_dtype=torch.float32)
    for block in _blocks(model):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)  # the rest: embeddings, the tied LM head, final norm
    return model


def _blocks(model: nn.Module) -> nn.ModuleList:
    blocks = getattr(getattr(model, "transformer", None), "h", None)
    if not isinstance(blocks, nn.ModuleList):
        raise TypeError(f"{type(model).__name__} has no transformer.h block list to shard")
    return blocks


def autocast(engine: Engine, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """bfloat16 autocast on GPU; under FSDP the mixed-precision policy replaces it (the
    whole forward then runs on bfloat16 parameters), on CPU nothing."""
    on = device.type == "cuda" and engine != "fsdp"
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=on)


def no_sync(net: nn.Module, engine: Engine, sync: bool) -> contextlib.AbstractContextManager[Any]:
    """Skip DDP's gradient all-reduce on micro-batches before the last one. FSDP
    reduce-scatters every micro-batch into the sharded gradients (memory, not traffic,
    is what it saves), so it needs nothing here."""
    if engine == "ddp" and not sync:
        return net.no_sync()  # type: ignore[operator]
    return contextlib.nullcontext()


def _tied_groups(model: nn.Module) -> list[list[str]]:
    """Names that share one parameter (here the LM head and the token embedding)."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [sorted(names) for names in by_id.values() if len(names) > 1]


def _plain_class(model: nn.Module) -> type[nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))


def unsharded(model: nn.Module, engine: Engine, rank: int) -> nn.Module | None:
    """On rank 0 a model with full parameters for ``save_model`` / ``save_pretrained``:
    ``model`` itself, or under FSDP a CPU copy of the same class assembled from the
    gathered state (collective: every rank must call it). ``None`` on other ranks."""
    if engine != "fsdp":
        return model if rank == 0 else None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=opts)
    if rank != 0:
        return None
    for names in _tied_groups(model):  # one tensor for tied names, as in the live model;
        tied = state[names[0]].clone()  # own storage (a gathered, padded shard is a view)
        state.update(dict.fromkeys(names, tied))
    with torch.device("meta"):
        plain = _plain_class(model)(model.config)  # type: ignore[call-arg]
    plain.load_state_dict(state, assign=True)
    return plain


def load_model(model: nn.Module, path: str, engine: Engine, device: torch.device) -> None:
    """Load a full safetensors checkpoint into ``model`` (sharded or not)."""
    from safetensors.torch import load_file
    from safetensors.torch import load_model as load_plain

    if engine != "fsdp":
        load_plain(model, path, device=str(device))
        return
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    state: dict[str, torch.Tensor] = {}
    if dist.get_rank() == 0:
        state = load_file(path)
        for names in _tied_groups(model):  # the file holds one name of a tied group
            have = next(n for n in names if n in state)
            state.update({n: state[have] for n in names})
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True,
                                                                broadcast_from_rank0=True))


def _param_names(model: nn.Module, opt: torch.optim.Optimizer) -> list[str]:
    """The name of each optimiser parameter, in ``Optimizer.state_dict`` id order."""
    name = {id(p): n for n, p in model.named_parameters()}
    return [name[id(p)] for group in opt.param_groups for p in group["params"]]


def optimizer_state(model: nn.Module, opt: torch.optim.Optimizer, engine: Engine,
                    rank: int) -> dict[str, Any] | None:
    """``opt.state_dict()`` with full tensors on rank 0 (``None`` elsewhere); under FSDP
    gathered to CPU (collective) and renumbered to integer ids."""
    if engine != "fsdp":
        return opt.state_dict() if rank == 0 else None
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )

    full = get_optimizer_state_dict(model, opt, options=StateDictOptions(
        full_state_dict=True, cpu_offload=True))
    if rank != 0:
        return None
    index = {n: i for i, n in enumerate(_param_names(model, opt))}
    return {"state": {index[n]: s for n, s in full["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]}
                             for g in full["param_groups"]]}


def load_optimizer(model: nn.Module, opt: torch.optim.Optimizer, state: dict[str, Any],
                   engine: Engine) -> None:
    """Restore an ``opt.state_dict()``-layout state (as :func:`optimizer_state` writes)."""
    if engine != "fsdp":
        opt.load_state_dict(state)
        return
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_optimizer_state_dict,
    )

    named: dict[str, Any] = {}
    if dist.get_rank() == 0:
        names = _param_names(model, opt)
        named = {"state": {names[i]: s for i, s in state["state"].items()},
                 "param_groups": [{**g, "params": [names[i] for i in g["params"]]}
                                  for g in state["param_groups"]]}
    tuples = [{k for k, v in g.items() if isinstance(v, tuple)} for g in opt.param_groups]
    set_optimizer_state_dict(model, opt, named, options=StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=True))
    for group, keys in zip(opt.param_groups, tuples, strict=True):  # e.g. betas: the
        group.update({k: tuple(group[k]) for k in keys})  # broadcast returns lists

