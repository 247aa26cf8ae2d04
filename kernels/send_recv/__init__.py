"""send_recv: move a sharded array to another set of devices. ``jax.device_put`` (baseline), JAX's
transfer servers, and NCCL send/recv through CuPy (GPU)."""

from conformance.kernels.send_recv.nccl_cupy import nccl_send_recv
from conformance.kernels.send_recv.transfer_server import jax_transfer_server
from conformance.kernels.send_recv.xla import xla_device_put

__all__ = ["jax_transfer_server", "nccl_send_recv", "xla_device_put"]
