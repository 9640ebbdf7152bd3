"""Training: typed config, the loop (accumulation, schedule, clipping, checkpoints)."""

from .loop import TrainConfig, load_config, train

__all__ = ["TrainConfig", "load_config", "train"]
