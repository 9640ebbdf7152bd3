"""Training: typed config, the loop (accumulation, schedule, clipping, checkpoints)."""

from structlm.train.loop import TrainConfig, load_config, train

__all__ = ["TrainConfig", "load_config", "train"]
