"""Training: typed config, the loop (accumulation, schedule, clipping, checkpoints)."""

from structlm.train.loop import (
    TrainConfig,
    build_model,
    build_optimizer,
    clip_gradients,
    load_config,
    train,
)

__all__ = ["TrainConfig", "build_model", "build_optimizer", "clip_gradients", "load_config",
           "train"]
