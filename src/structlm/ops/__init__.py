"""Implementations of the algebra product: ``reference`` (the oracle), ``blocked``
(pure-PyTorch GEMMs over the support, five layouts), the compiled few-row CPU kernels
(``cpu_kernels``, registered as custom ops in ``cpu_ops``) and the Triton GPU kernels
(``triton/``, imported lazily); ``dispatch`` resolves the backend of a call."""

from structlm.ops.blocked import blocked_linear
from structlm.ops.dispatch import Backend, force_backend, register_backend, resolve_backend
from structlm.ops.partition import TypePartition
from structlm.ops.plan import BlockPlan, make_plan
from structlm.ops.reference import effective_weight, reference_linear

__all__ = [
    "Backend",
    "BlockPlan",
    "TypePartition",
    "blocked_linear",
    "effective_weight",
    "force_backend",
    "make_plan",
    "reference_linear",
    "register_backend",
    "resolve_backend",
]
