"""Shared functional bases (Part B): analyse and compress pretrained models by sharing
one basis per matrix type across layers.

Everything reaches models through :mod:`structlm.share.adapters`; statistics are
accumulated in float64 (:mod:`structlm.share.calibration`); perplexity follows one
protocol (:mod:`structlm.share.perplexity`); ``structlm share analyze`` runs tests 1–3
with null controls (:mod:`structlm.share.analysis`); ``structlm share compress`` and
``share experiment`` compress and fine-tune (:mod:`structlm.share.compress`).
"""
