"""Conformance suite for JAX distributed collective kernels.

Public interface::

    import conformance

    @conformance.register("allgather_matmul", name="my_ring_matmul")
    def my_ring_matmul(lhs, rhs, *, mesh, axis_name): ...

    conformance.implementations("allgather_matmul")  # {name: callable}

    # what it supports: checked on exactly that, the rest reported "not claimed"
    @conformance.register("all_gather", name="my_gather", dtypes=("float32", "bfloat16"),
                          supports=conformance.multiples_of(rows_per_shard=8))

Run the checks with ``pytest --pyargs conformance -m cpu --kernels=MODULE[,MODULE...]``
(installed, the pytest plugin loads through its entry point) and restrict them with
``--impl=GLOB``. A Pallas kernel compiled for a TPU raises
``conformance.TpuConstraintError`` for a shape a TPU's compiler would refuse; refusing through
``conformance.refuse_on_tpu(message)`` lets the suite hold each refusal against the real compiler.
Importing this package starts no JAX backend.
"""

from conformance import native_logs

with native_logs.filtered():  # the first import of JAX, where its CUDA plugin may log on a host without CUDA
    from conformance.registry import Implementation, implementations, multiples_of, register, registered
    from conformance.specs.moe_routing import ExpertCapacity, ExpertReplicas
    from conformance.targets.mosaic import TpuConstraintError
    from conformance.targets.mosaic import refuse as refuse_on_tpu

__all__ = [
    "ExpertCapacity",
    "ExpertReplicas",
    "Implementation",
    "TpuConstraintError",
    "implementations",
    "multiples_of",
    "refuse_on_tpu",
    "register",
    "registered",
]
__version__ = "0.1.0"
