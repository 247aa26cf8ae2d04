"""What a kernel claims, and the cases the checks run on because of it.

A kernel registered with ``dtypes=``, ``platforms=`` or ``supports=`` (see
:func:`conformance.register`) is checked on the cases it claims and reported
*not claimed* on the others; it never loses a whole check to a declaration:

- a drawn dtype comes from the dtypes it claims;
- drawn and fixed dims it does not claim move to the nearest dims it does: each
  dim rounded up to a multiple of 1, 2, 4, ... 256, fewest dims moved and then
  smallest total size first
  (a kernel that tiles rows by 8 is checked at 8 rows per shard where the suite's
  fixed shape has 3);
- a mesh, platform or dtype no dims can satisfy is not claimed, with the
  kernel's own reason.

A kernel that declares nothing claims every case, and nothing here changes its
cases.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping

import pytest

from conformance import registry
from conformance.fixtures.meshes import MeshConfig

#: The multiples a dim may be rounded up to when looking for dims a kernel claims.
MULTIPLES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
#: Prefix of the skip reason that marks a test "not claimed" (the plugin reports it as its own outcome).
NOT_CLAIMED = "not claimed"


class NotClaimed(pytest.skip.Exception):
    """The implementation does not claim this case; the reason is its declaration's.

    Raised inside a test it is pytest's skip with a reason starting "not claimed:", which the
    plugin reports as an outcome of its own (neither passed nor skipped).
    """

    def __init__(self, impl: str, reason: str) -> None:
        super().__init__(f"{NOT_CLAIMED}: {impl}: {reason}", pytrace=False)
        self.impl, self.reason = impl, reason


def mesh_shape(mesh: MeshConfig) -> dict[str, int]:
    return dict(zip(mesh.axis_names, mesh.shape, strict=True))


def reason(
    family: str, impl: str, *, platform: str, mesh: MeshConfig, dims: Mapping[str, int], dtype: str
) -> str | None:
    """``None`` if ``impl`` claims the case, else its reason."""
    return registry.get(family, impl).claims(
        platform=platform, dtype=dtype, dims=dims, mesh_shape=mesh_shape(mesh), axis_size=mesh.axis_size
    )


def declares_anything(family: str, impl: str) -> bool:
    record = registry.get(family, impl)
    return record.dtypes is not None or record.platforms is not None or record.supports is not None


def _candidates(value: int) -> list[int]:
    return sorted({math.ceil(value / m) * m for m in MULTIPLES})


def adapt(
    family: str,
    impl: str,
    *,
    platform: str,
    mesh: MeshConfig,
    dims: Mapping[str, int],
    dtype: str,
    avoid: Mapping[str, int] | None = None,
) -> dict[str, int]:
    """``dims`` if the kernel claims them, else the smallest rounded-up dims it claims, other than
    ``avoid`` where another exists (the even fixed shape avoids the odd one's dims, so both run).

    Raises :class:`NotClaimed` (with the reason given for ``dims``) when no such dims exist.
    """
    dims = dict(dims)
    why = reason(family, impl, platform=platform, mesh=mesh, dims=dims, dtype=dtype)
    if why is None:
        return dims
    names = list(dims)
    options = sorted(
        itertools.product(*(_candidates(dims[n]) for n in names)),
        # fewest dims moved first, then the smallest: a kernel that tiles rows keeps the suite's widths
        key=lambda values: (
            sum(v != dims[n] for n, v in zip(names, values, strict=True)),
            math.prod(values),
            values,
        ),
    )
    claimed = (
        candidate
        for values in options
        if reason(
            family,
            impl,
            platform=platform,
            mesh=mesh,
            dims=(candidate := dict(zip(names, values, strict=True))),
            dtype=dtype,
        )
        is None
    )
    first = next(claimed, None)
    if first is None:
        raise NotClaimed(impl, why)
    if avoid is not None and first == dict(avoid):
        return next(claimed, first)
    return first


def claimed_dtypes(
    family: str,
    impl: str,
    *,
    platform: str,
    mesh: MeshConfig,
    dims: Mapping[str, int],
    dtypes: tuple[str, ...],
) -> tuple[str, ...]:
    """Those of ``dtypes`` for which some dims near ``dims`` are claimed on this mesh and platform."""
    out = []
    for dtype in dtypes:
        try:
            adapt(family, impl, platform=platform, mesh=mesh, dims=dims, dtype=dtype)
        except NotClaimed:
            continue
        out.append(dtype)
    return tuple(out)
