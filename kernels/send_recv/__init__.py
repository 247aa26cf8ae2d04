"""send_recv: move a sharded array to another set of devices. ``jax.device_put`` (baseline) and
NCCL send/recv through CuPy (GPU)."""

from conformance.kernels.send_recv.nccl_cupy import nccl_send_recv
from conformance.kernels.send_recv.xla import xla_device_put

__all__ = ["nccl_send_recv", "xla_device_put"]
