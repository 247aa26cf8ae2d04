"""Values, output sharding, dtype, determinism, and the kernel called outside jit: every shard of the
result against the numpy float64 reference, within the dtype's tolerance (exact for data movement)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from conformance import compat, runner
from conformance.blame import error_locations, error_text
from conformance.checks.base import (
    Axes,
    Check,
    assert_dtype,
    compare_with_reference,
    fail,
    run_case,
    slice_text,
)
from conformance.runner import Case


def check_values(case: Case, *, check: str = "values") -> None:
    """Every shard of the result equals the float64 reference within the dtype's tolerance."""
    inputs64, out = run_case(case, check, cached=False)
    compare_with_reference(case, check, out, inputs64)
    assert_dtype(case, check, out)  # so the drawn dtypes meet every mesh, not only dtype's two


def check_tpu_native_values(case: Case) -> None:
    """:func:`check_values` at the TPU-native dims, its failures named as this check's."""
    check_values(case, check="tpu_native_values")


def check_output_sharding(case: Case) -> None:
    """The result's sharding is the spec's, and every device holds exactly its block.

    A ``with_sharding_constraint`` is not trusted (it is a no-op on Explicit
    meshes): the sharding is read off the result, and each addressable shard's
    index and data are compared with what the spec's sharding implies.
    """
    inputs64, out = run_case(case, "output_sharding")
    expected_sharding = runner.expected_out_sharding(case)
    ndim = len(case.out_shape)
    if not out.sharding.is_equivalent_to(expected_sharding, ndim):
        got_spec = getattr(out.sharding, "spec", out.sharding)
        raise fail(
            case,
            "output_sharding",
            "output sharding differs from the spec",
            [
                f"expected       : {expected_sharding.spec}",
                f"got            : {got_spec}  ({type(out.sharding).__name__})",
            ],
        )
    typed = _typed_spec_mismatch(case, expected_sharding, ndim)
    if typed:
        raise fail(case, "output_sharding", "the result's typed sharding differs from the spec", typed)
    index_map = expected_sharding.devices_indices_map(tuple(case.out_shape))
    holders = {s.device for s in out.addressable_shards}
    mine = jax.process_index()  # in a multi-process job, each rank judges the devices it addresses
    missing = [d.id for d in index_map if d.process_index == mine and d not in holders]
    if missing:
        raise fail(case, "output_sharding", f"devices {missing} hold no shard of the output")
    for shard in out.addressable_shards:
        want = index_map[shard.device]
        if slice_text(shard.index, case.out_shape) != slice_text(want, case.out_shape):
            raise fail(
                case,
                "output_sharding",
                "a device holds the wrong block",
                [
                    f"device {shard.device.id}: holds {slice_text(shard.index, case.out_shape)}, "
                    f"spec says {slice_text(want, case.out_shape)}",
                ],
            )
    compare_with_reference(case, "output_sharding", out, inputs64)
    _replicas_agree(case, out)  # wrong values are their own cause: this is replicas right but unequal


def _replicas_agree(case: Case, out: jax.Array) -> None:
    """Every device holding one block of the result (a replicated one: an all-gather's, an all-reduce's)
    holds the same bits: a replica summed in another order is another result, which the next step of
    a training run would see diverge. Judged among the shards this process addresses."""
    holders: dict[str, list] = {}
    for shard in out.addressable_shards:
        holders.setdefault(slice_text(shard.index, case.out_shape), []).append(shard)
    for block, shards in holders.items():
        first = np.asarray(shards[0].data)
        bits = first.view(f"u{first.dtype.itemsize}")
        for other in shards[1:]:
            theirs = np.asarray(other.data)
            differ = np.argwhere(bits != theirs.view(f"u{theirs.dtype.itemsize}"))
            if len(differ):
                where = tuple(int(i) for i in differ[0])
                raise fail(
                    case,
                    "output_sharding",
                    "the replicas of one block of the result differ",
                    [
                        f"block          : {block}, held by devices {[s.device.id for s in shards]}",
                        f"first difference: at {list(where)} within the block, device {shards[0].device.id} "
                        f"holds {first[where]!r}, device {other.device.id} {theirs[where]!r}",
                        f"differing      : {len(differ)} of {bits.size} elements",
                        "why            : a replica must be the same bits on every device that holds it; one "
                        "summed in another order rounds differently (sum each block once, on one device, "
                        "and copy it)",
                    ],
                )


def _spec_entries(spec: object, ndim: int) -> tuple:
    """A ``PartitionSpec``'s entries, one per dim (a 1-tuple of axes as its axis, ``None`` padded)."""
    entries = [e[0] if isinstance(e, tuple) and len(e) == 1 else e for e in tuple(spec)]
    return tuple(entries + [None] * (ndim - len(entries)))


def typed_out_spec(case: Case) -> Any:
    """The ``PartitionSpec`` of the result's type as the kernel's traced program declares it (``jax.typeof``
    of the result, on an Explicit mesh), or ``None`` where it has none. Read off ``jax.eval_shape`` of
    the jitted kernel, which reuses its compile's trace: a result's own ``.sharding`` is XLA's placement,
    which JAX 0.6.2 gives as ``P('x')`` for a replicated result on a size-1 axis."""
    out = jax.eval_shape(runner.jitted_for(case), *runner.abstract_args(case))
    leaves = jax.tree_util.tree_leaves(out)
    return getattr(getattr(leaves[0], "sharding", None), "spec", None) if leaves else None


def _typed_spec_mismatch(case: Case, expected: jax.sharding.NamedSharding, ndim: int) -> list[str]:
    """On an Explicit mesh a result's sharding is part of its type (``jax.typeof(out)``, what the
    kernel's traced program declares): what every later op and ``jax.vjp``'s cotangent are held to.
    Two specs that lay out the same blocks only because an axis has size 1 (``P('x')`` and ``P()`` on
    a ring of one) are equivalent as placements and different types. The lines saying so, or none."""
    if case.mesh.axis_type != "explicit":
        return []
    got = typed_out_spec(case)
    if got is None or _spec_entries(got, ndim) == _spec_entries(expected.spec, ndim):
        return []
    size_one = [n for n, s in zip(case.mesh.axis_names, case.mesh.shape, strict=True) if s == 1]
    return [
        f"expected       : {expected.spec} (the type of the result on this Explicit mesh)",
        f"got            : {got}",
        "the same blocks on these devices"
        + (f" only because axis {', '.join(map(repr, size_one))} has size 1" if size_one else "")
        + "; the types differ: every later op on this mesh is typed by the result's, and jax.vjp "
        "(JAX 0.10) rejects a cotangent of the spec's sharding",
    ]


def check_dtype(case: Case) -> None:
    """The result (and every shard of it) has the inputs' dtype; and, since the kernel ran at this
    dtype, every shard's values against the float64 reference (the fixed shapes at every dtype on
    every mesh: the value check's drawn dtypes meet each mesh by chance, these by construction)."""
    inputs64, out = run_case(case, "dtype")
    assert_dtype(case, "dtype", out)
    compare_with_reference(case, "dtype", out, inputs64)


def check_determinism(case: Case) -> None:
    """Two calls on the same inputs give bitwise-equal shards (the first may be the call the other
    fixed-shape checks of this case share)."""
    _, first = run_case(case, "determinism")
    _, second = run_case(case, "determinism", cached=False)
    a = {s.device.id: np.asarray(s.data) for s in first.addressable_shards}
    b = {s.device.id: np.asarray(s.data) for s in second.addressable_shards}
    for dev in sorted(a):
        if a[dev].tobytes() != b.get(dev, np.empty(0)).tobytes():
            diff = np.argwhere(a[dev].view(np.uint8).reshape(-1) != b[dev].view(np.uint8).reshape(-1))
            raise fail(
                case,
                "determinism",
                "two calls on the same inputs differ bitwise",
                [
                    f"first differing shard: device {dev}, first differing byte {int(diff[0][0])}",
                ],
            )


def check_eager(case: Case) -> None:
    """Called outside ``jax.jit``, as users call kernels too, on the inputs of the jitted run: the
    result's shape and dtype, and every shard against the float64 reference within the dtype's
    tolerance, as under jit (so bitwise for data movement, whose tolerance is zero). A kernel whose
    Python takes another path on concrete arrays (a host read of its global input to log a
    checksum: fine in one process, an error in a job where the input is not fully addressable; a
    shortcut for small inputs) is caught here.

    Not bitwise for arithmetic: outside jit a ``shard_map`` body runs op by op, and XLA fuses the
    jitted program, so a matmul split into partial sums may round differently in its last bit
    (measured on the bidirectional rings: 1 ulp on a few elements); JAX promises no more.
    """
    inputs64, jitted_out = run_case(case, "eager")
    try:
        with compat.unfiltered_tracebacks():
            eager_out = runner.execute_eagerly(case)
            jax.block_until_ready(eager_out)
    except Exception as e:
        details = [*error_locations(e), error_text(e)]
        raise fail(
            case,
            "eager",
            f"raised {type(e).__name__} when called outside jax.jit (under jit it returns)",
            details,
        ) from e
    if not isinstance(eager_out, jax.Array):
        raise fail(case, "eager", f"returned {type(eager_out).__name__} outside jax.jit, not a jax.Array")
    if tuple(eager_out.shape) != tuple(jitted_out.shape) or eager_out.dtype != jitted_out.dtype:
        raise fail(
            case,
            "eager",
            f"outside jax.jit the result is {eager_out.dtype}{list(eager_out.shape)}, "
            f"under jit {jitted_out.dtype}{list(jitted_out.shape)}",
        )
    compare_with_reference(
        case, "eager", eager_out, inputs64, subject="outside jax.jit the values differ", blocks=False
    )


#: The eager check's mesh: a ring of 2 on the first axis of an Explicit 2-D mesh, which in a job of two
#: processes is the axis across them, so that no process holds every block of an operand. What it
#: catches is the kernel's Python on concrete arrays, which no longer ring and no other mesh shows more
#: of; outside jit a shard_map body runs op by op (2.4 s for a bidirectional ring of 2 here), so one mesh.
EAGER_MESHES = ("2x4-x-explicit",)
#: A kernel of one mesh axis (its ``supports=`` refuses a 2-D mesh) is called eagerly on a ring of 8
#: instead: every device, so in a job of two processes every process holds part of each operand.
EAGER_FALLBACK_MESHES = ("8-x-explicit-reversed",)

CHECKS = (
    Check(
        "values",
        check_values,
        # a Pallas TPU kernel's on the interpreted meshes (every ring length, every kind of mesh): the
        # others add axis types and 2-D orientations its remote DMAs do not meet, at 1-3 s a case
        axes=Axes(case="drawn", interpreted_meshes="interpreted"),
        doc="Values and dtype on every shard against numpy float64, on every mesh (a Pallas TPU kernel: "
        "every ring length and kind of mesh); drawn dims, dtypes, seeds.",
    ),
    Check(
        "tpu_native_values",
        check_tpu_native_values,
        # every dtype on the longest ring: a DMA window's bytes turn on the dtype, not the ring, and the
        # neighbours a 2-D or 3-D mesh gives a kernel are the values check's on every mesh
        axes=Axes(
            case="tpu_native",
            meshes="longest_ring",
            platforms=False,
            dtypes="dtypes",
            implementations=("pallas",),
        ),
        doc="At the TPU-native dims (the DMA windows a chip runs), exact under interpret mode's on_wait "
        "DMAs.",
    ),
    # at both fixed shapes on a mesh of each kind: a block that lands on the wrong device turns on the
    # mesh's kind (a ring of one, an axis of a 2-D or 3-D mesh, a permuted order); what turns on each
    # ring length is the values check's, on every mesh at drawn shapes (odd rows and 1 among them)
    Check("output_sharding", check_output_sharding, axes=Axes(meshes="covering", shapes=True)),
    Check(
        "dtype",
        check_dtype,
        # every dtype at the odd fixed shape on a ring of one, an odd ring and the longest: a kernel's dtypes
        # turn on its ring's loop (a ring of one's shortcut that skips a cast, an odd ring's split, the hops
        # a narrow accumulator overflows over), not on the mesh's shape or device order; the even twin's
        # defects need no dtype (the float32 checks'); the values check draws dtypes and shapes on every
        # mesh, so a dtype that goes wrong on one mesh alone still meets it. A Pallas TPU kernel's on the
        # ring of one and the odd ring: tpu_native_values runs its every dtype on the longest ring
        axes=Axes(meshes="loop_lengths", dtypes="dtypes", interpreted_meshes="short_loops"),
        doc="Every dtype of the spec at the odd fixed shape on a ring of one, an odd ring and the longest: "
        "the result has its dtype, and each shard its values.",
    ),
    # a second run of the odd fixed case (which runs both directions of a bidirectional ring: 2 rows one
    # way, 1 the other): what makes two runs differ (an unordered accumulation, a race) is the program's,
    # not a ring length's or a shape's: a mesh of each kind; races at both shapes are the race check's
    Check("determinism", check_determinism, axes=Axes(meshes="covering")),
    Check(
        "eager",
        check_eager,
        axes=Axes(meshes=EAGER_MESHES, fallback_meshes=EAGER_FALLBACK_MESHES),
        doc="Called outside ``jax.jit``: the values it gives under jit (odd fixed shape), on every device "
        "(a kernel of one mesh axis: on a ring of 8).",
    ),
)
