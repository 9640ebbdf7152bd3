"""``structlm share analyze``: the seed's tests 1–3 (alignment of weight bases, shared
functional subspaces, attention-sink-aware covariances) and the role classifier, each
with its null control (:mod:`.analyze` runs them, :mod:`.report` writes the report)."""
