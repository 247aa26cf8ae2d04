"""The ``send_recv`` family: move a sharded array to another set of devices, bit for bit.

``fn(x, *, dst) -> jax.Array``. ``x`` lies on the source devices under a ``NamedSharding``;
``dst`` is a ``NamedSharding`` over as many destination devices. Device ``i`` of the source
mesh's device array sends its shard to device ``i`` of the destination mesh, so ``dst`` must put
on its device ``i`` the block the source puts on its device ``i``, in the same memory kind: the
same ``PartitionSpec`` over an equally shaped mesh, or any spelling of that placement (``P()``
for ``P('x')`` on one device, a 2 x 2 mesh flattened under a spec over both axes), which must be
moved like it. Any other destination is refused with an error naming both shardings; one whose
shards keep their shapes but map blocks to other devices (``P('y', 'x')`` for ``P('x', 'y')``)
may instead be moved with every block where it says. The result lies on ``dst``, is bitwise
equal to ``x``, and ``x`` is left intact. In a multi-process job every process calls ``fn`` with
the same arguments, including processes that own no source or destination device.

Unlike the shard_map families there is no arithmetic, so there is no tolerance: the ground
truth is the source's bytes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from conformance.specs.base import RegistrationOption

#: The float8 variants; those a JAX release lacks are left out by :func:`available_dtypes`.
FLOAT8_DTYPES = (
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e4m3b11fnuz",
    "float8_e3m4",
    "float8_e4m3",
    "float8_e8m0fnu",
)

#: Every dtype a transfer must move intact. 64-bit types need ``jax_enable_x64`` and the 4-bit
#: ones are packed two to a byte on some backends, so neither is in the contract (yet).
DTYPES = (
    "float32",
    "bfloat16",
    "float16",
    *FLOAT8_DTYPES,
    "complex64",
    "int8",
    "uint8",
    "int32",
    "uint32",
    "bool",
)


def available_dtypes(names: tuple[str, ...] = DTYPES) -> tuple[str, ...]:
    """``names`` that this JAX release knows."""
    import jax.numpy as jnp

    return tuple(n for n in names if hasattr(jnp, n))


def np_dtype(name: str) -> np.dtype:
    import jax.numpy as jnp

    return np.dtype(getattr(jnp, name))


@dataclasses.dataclass(frozen=True)
class PointToPointSpec:
    """The contract of a point-to-point family (no mesh axis, no arithmetic)."""

    name: str
    summary: str
    dtypes: tuple[str, ...]
    signature_text: str
    #: Keywords this family's implementations may pass to ``conformance.register``.
    registration_options: Mapping[str, RegistrationOption] = dataclasses.field(default_factory=dict)

    def signature(self, axis_name: str = "axis") -> str:
        return self.signature_text


SEND_RECV = PointToPointSpec(
    name="send_recv",
    summary="fn(x, *, dst): every shard of x to the same position of dst's devices, bitwise",
    dtypes=DTYPES,
    signature_text="x NamedSharding(src mesh, spec) -> dst: each block on the device at the same position",
    registration_options={
        "accepts_timeout": RegistrationOption(
            default=False,
            accepts=lambda v: isinstance(v, bool),
            expects="True or False",
            doc="it accepts timeout= (seconds) and raises TimeoutError naming the peer: opts into the "
            "timeout check",
        ),
        "resources": RegistrationOption(
            default=None,
            accepts=lambda v: v is None or callable(v),
            expects="a callable returning counters ({'streams': 2, ...}) or None",
            doc="what it holds (streams, communicators), which must not grow over repeated calls",
        ),
    },
)

#: This module's family (:mod:`conformance.specs` collects it).
SPEC = SEND_RECV
