"""Shared functional bases (Part B): analyse and compress pretrained models by sharing
one basis per matrix type across layers.

Everything reaches models through :mod:`structlm.hf.adapters`; statistics are
accumulated in float64 (:mod:`structlm.hf.calibration`); perplexity follows one
protocol (:mod:`structlm.hf.perplexity`); ``structlm share analyze`` runs tests 1–3
with null controls (:mod:`structlm.share.analysis`); ``structlm share compress`` and
``structlm experiment share`` compress and fine-tune (:mod:`structlm.share.compress`).
"""

from structlm.share.compress.io import load_compressed, save_compressed

__all__ = ["load_compressed", "save_compressed"]
