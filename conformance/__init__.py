"""Conformance suite for JAX distributed collective kernels.

Public interface::

    import conformance

    @conformance.register("allgather_matmul", name="my_ring_matmul")
    def my_ring_matmul(lhs, rhs, *, mesh, axis_name): ...

    conformance.implementations("allgather_matmul")  # {name: callable}

Run the checks with ``pytest conformance --kernels=MODULE[,MODULE...]`` and
restrict them with ``--impl=GLOB``. A Pallas kernel compiled for a TPU raises
``conformance.TpuConstraintError`` for a shape a TPU's compiler would refuse.
Importing this package starts no JAX backend.
"""

from conformance.mosaic import TpuConstraintError
from conformance.registry import Implementation, implementations, register, registered

__all__ = ["Implementation", "TpuConstraintError", "implementations", "register", "registered"]
__version__ = "0.1.0"
