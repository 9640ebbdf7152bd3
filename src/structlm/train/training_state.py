"""A training run's state in its checkpoint: the model, optimizer, scheduler, sampler and
RNG states, the token data's fingerprint and the run's config (so a resume is checked
against the config it was started with even when ``config.json`` is gone)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from structlm.config import RunError
from structlm.train import distributed as D
from structlm.train.checkpoint import write_checkpoint

__all__ = ["checkpoint_config", "corrupt_message", "save_training_state"]


def save_training_state(ckpt: Path, model: Any, opt: Any, sched: Any, gen: torch.Generator,
                        step: int, engine: D.Engine, rank: int, data_fingerprint: str,
                        config: str) -> None:
    """Write the checkpoint crash-safely from rank 0 (every rank calls: FSDP gathers);
    see :mod:`.checkpoint`. ``config``: the run's config JSON, kept in the checkpoint so a
    resume is checked against it even without ``config.json``."""
    from safetensors.torch import save_model

    full, opt_state = D.unsharded(model, engine, rank), D.optimizer_state(model, opt, engine, rank)
    if full is None or opt_state is None:  # not rank 0
        return

    def write(folder: Path) -> None:
        save_model(full, str(folder / "model.safetensors"))
        torch.save({"optimizer": opt_state, "scheduler": sched.state_dict(), "step": step,
                    "sampler": gen.get_state(), "torch_rng": torch.get_rng_state(),
                    "data_fingerprint": data_fingerprint, "config": config},
                   folder / "state.pt")

    write_checkpoint(ckpt, write, step)


def checkpoint_config(ckpt: Path) -> str | None:
    """The config JSON stored in the checkpoint (``None`` in one written before configs
    were stored there)."""
    path = ckpt / "state.pt"
    try:  # memory-mapped: the optimizer's tensors are not read
        state = torch.load(path, weights_only=False, map_location="cpu", mmap=True)
    except Exception as e:
        raise RunError(corrupt_message(path, e)) from e
    config = state.get("config") if isinstance(state, dict) else None
    return config if isinstance(config, str) else None


def corrupt_message(path: Path, err: Exception) -> str:
    return (f"checkpoint file {path} cannot be read ({type(err).__name__}: {err}). Nothing "
            "was deleted; to start over from step 0, run again with --restart (the run's "
            "checkpoints and metrics are moved aside, not deleted)")
