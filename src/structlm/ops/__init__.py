"""Implementations of the algebra product: ``reference`` (the oracle), ``blocked``
(pure-PyTorch GEMMs over the support, five layouts), the compiled few-row CPU kernels
(``cpu_kernels``, registered as custom ops in ``cpu_ops``) and the Triton GPU kernels
(``triton/``, imported lazily); ``route`` is the one decision of which of them runs."""

from structlm.ops.blocked import blocked_linear
from structlm.ops.partition import TypePartition
from structlm.ops.plan import BlockPlan, make_plan
from structlm.ops.reference import effective_weight, reference_linear
from structlm.ops.route import (
    THRESHOLDS,
    Backend,
    Decision,
    Route,
    choose,
    force_backend,
    force_layout,
    resolve_backend,
)

__all__ = [
    "THRESHOLDS",
    "Backend",
    "BlockPlan",
    "Decision",
    "Route",
    "TypePartition",
    "blocked_linear",
    "choose",
    "effective_weight",
    "force_backend",
    "force_layout",
    "make_plan",
    "reference_linear",
    "resolve_backend",
]
