"""Replica groups in every form the supported XLAs print, expanded to explicit device-id groups
(see :mod:`conformance.hlo`)."""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Sequence

import numpy as np

from conformance.hlo.model import _unknown

Groups = tuple[tuple[int, ...], ...]


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _rows(ids: np.ndarray, size: int) -> Groups:
    return tuple(tuple(int(i) for i in row) for row in ids.reshape(-1, size))


_EXPLICIT = re.compile(r"\{\s*(?:\{[0-9,\s]*\}\s*(?:,\s*\{[0-9,\s]*\}\s*)*)?\}")
_IOTA = re.compile(r"\[(?P<shape>\d+(?:,\d+)*)\]<=\[(?P<dims>\d+(?:,\d+)*)\](?:T\((?P<perm>\d+(?:,\d+)*)\))?")
_MESH = re.compile(
    r"mesh\[(?P<axes>[^\]]*)\](?:,\s*device_ids=\((?P<ids>[^()]*(?:\([^()]*\))?)\))?\s*\{(?P<grouped>[^}]*)\}"
)  # device_ids=(...) may hold an iota's T(...): matched here so that the refusal can name it
_MESH_AXIS = re.compile(r"\s*'?(?P<name>[^'=,\s]+)'?=(?P<size>\d+)\s*")
_AXIS_REF = re.compile(r"\s*'?(?P<name>[^':,\s]+)'?(?::\((?P<pre>\d+)\)(?P<size>\d+))?\s*")


def _iota(dims_text: str, perm_text: str | None, *, what: str, text: str) -> np.ndarray:
    """XLA's iota tile assignment ``[dims]T(perm)``: ``arange`` over ``dims``, transposed by ``perm``."""
    dims = _ints(dims_text)
    ids = np.arange(math.prod(dims)).reshape(dims)
    if perm_text:
        perm = _ints(perm_text)
        if sorted(perm) != list(range(len(dims))):
            raise _unknown(f"{what} (transpose is not a permutation of the dims)", text)
        ids = ids.transpose(perm)
    return ids


def _iota_groups(text: str) -> Groups:
    """Expand the iota form ``[G,S]<=[dims]T(perm)``: iota over dims, transposed, cut into G groups of S."""
    m = _IOTA.fullmatch(text.strip())
    if not m:
        raise _unknown("the iota replica groups", text)
    shape = _ints(m["shape"])
    ids = _iota(m["dims"], m["perm"], what="the iota replica groups", text=text)
    if len(shape) != 2 or math.prod(shape) != ids.size:
        raise _unknown("the iota replica groups (group shape does not cover the devices)", text)
    return _rows(ids, shape[1])


def mesh_axes_groups(
    axes: Sequence[tuple[str, int]],
    grouped: Sequence[tuple[str, tuple[int, int] | None]],
    device_ids: np.ndarray | None = None,
) -> Groups:
    """Device groups of a collective over mesh axes, as XLA computes them.

    ``axes``: the mesh's ``(name, size)`` in order. ``grouped``: the axes the
    collective runs over, in the order given, each whole (``None``) or a
    sub-axis ``(pre_size, size)``: the ``size`` factor of the axis after its
    ``pre_size`` major-most part. ``device_ids``: the mesh's devices in
    row-major order (iota if ``None``). Each mesh axis is cut at its
    sub-axes' boundaries; the devices are laid out over those pieces, the
    pieces not grouped go first in mesh order, the grouped ones last in the
    order given (the last varying fastest), and consecutive runs of one group's
    size are the groups.
    """
    names = [name for name, _ in axes]
    sizes = dict(axes)
    cuts: dict[str, set[int]] = {name: {1, size} for name, size in axes}
    for name, sub in grouped:
        if name not in sizes:
            raise ValueError(f"axis {name!r} is not in the mesh {names}")
        if sub is not None:
            pre, size = sub
            if sizes[name] % (pre * size):
                raise ValueError(f"sub-axis {name}:({pre}){size} does not divide axis size {sizes[name]}")
            cuts[name] |= {pre, pre * size}
    pieces: list[tuple[str, int, int]] = []  # (axis, pre_size, size), major to minor
    for name in names:
        bounds = sorted(cuts[name])
        pieces += [(name, lo, hi // lo) for lo, hi in itertools.pairwise(bounds)]
        if len(bounds) == 1:  # an axis of size 1
            pieces.append((name, 1, 1))
    index = {}
    for name, sub in grouped:
        pre, size = sub if sub is not None else (1, sizes[name])
        match = [i for i, (n, lo, k) in enumerate(pieces) if n == name and lo == pre and k == size]
        if len(match) != 1:
            raise ValueError(f"grouped axis {name}:({pre}){size} overlaps another")
        index[(name, sub)] = match[0]
    order = [index[(name, sub)] for name, sub in grouped]
    if len(set(order)) != len(order):
        raise ValueError(f"an axis is grouped twice in {grouped}")
    kept = [i for i in range(len(pieces)) if i not in order]
    total = math.prod(sizes.values())
    ids = np.arange(total) if device_ids is None else np.asarray(device_ids).reshape(-1)
    if ids.size != total:
        raise ValueError(f"{ids.size} device ids for a mesh of {total} devices")
    laid = ids.reshape([k for _, _, k in pieces]).transpose(kept + order)
    return _rows(laid, math.prod(pieces[i][2] for i in order))


_IOTA_IDS = re.compile(r"\[(?P<dims>\d+(?:,\d+)*)\](?:T\((?P<perm>\d+(?:,\d+)*)\))?")


def _mesh_device_ids(ids: str, text: str) -> np.ndarray:
    """A mesh's ``device_ids=(...)``: an explicit list (``0,2,1,3``), or an iota over reshape dims
    transposed (``[2,4]T(1,0)``: ``arange(8).reshape(2, 4).transpose(1, 0)``, flattened; XLA's
    ``IotaTileAssignment``, which XLA:CPU prints for the groups of an axis of a 2-D mesh that a
    partitioner, not ``shard_map``, made)."""
    if re.fullmatch(r"[0-9,\s]+", ids):
        return np.array(_ints(ids))
    m = _IOTA_IDS.fullmatch(ids.strip())
    if not m:
        raise _unknown("the mesh-axes replica groups (device_ids)", text)
    return _iota(m["dims"], m["perm"], what="the mesh-axes replica groups (device_ids)", text=text).reshape(
        -1
    )


def _mesh_groups(text: str) -> Groups:
    """Expand the mesh-axes form ``mesh['x'=4,'y'=2] {'y'}`` (sub-axes, ``device_ids=(...)``)."""
    m = _MESH.fullmatch(text.strip())
    if not m:
        raise _unknown("the mesh-axes replica groups", text)
    axes = []
    for part in m["axes"].split(","):
        axis = _MESH_AXIS.fullmatch(part)
        if not axis:
            raise _unknown("the mesh-axes replica groups (mesh axis)", text)
        axes.append((axis["name"], int(axis["size"])))
    grouped: list[tuple[str, tuple[int, int] | None]] = []
    for part in m["grouped"].split(",") if m["grouped"].strip() else ():
        ref = _AXIS_REF.fullmatch(part)
        if not ref:
            raise _unknown("the mesh-axes replica groups (grouped axis)", text)
        grouped.append((ref["name"], (int(ref["pre"]), int(ref["size"])) if ref["pre"] else None))
    ids = None
    if m["ids"] is not None:
        ids = _mesh_device_ids(m["ids"], text)
    try:
        return mesh_axes_groups(axes, grouped, ids)
    except ValueError as e:
        raise _unknown(f"the mesh-axes replica groups ({e})", text) from e


def parse_replica_groups(text: str) -> Groups:
    """One ``replica_groups=`` value as XLA prints it, expanded to explicit groups of ids.

    ``{}`` (every participant) comes back as ``()``: which devices that is
    depends on the op's mode and the module, see :func:`_participants`.
    """
    text = text.strip()
    if _EXPLICIT.fullmatch(text):
        return tuple(_ints(group) for group in re.findall(r"\{([0-9,\s]*)\}", text[1:-1]))
    if text.startswith("["):
        return _iota_groups(text)
    if text.startswith("mesh["):
        return _mesh_groups(text)
    raise _unknown("the replica groups", text)


#: Kinds that take ``use_global_device_ids``; on the others a channel id means cross-partition.
_GLOBAL_IDS_KINDS = frozenset({"all-gather", "all-reduce", "reduce-scatter"})


def _participants(
    groups: Groups,
    *,
    kind: str,
    has_channel: bool,
    global_ids: bool,
    replicas: int,
    partitions: int,
    text: str,
) -> Groups:
    """Groups of device ids (``replica * partitions + partition``), in the op's collective mode.

    XLA's modes: no channel id, cross-replica; a channel id, cross-partition
    (kinds without ``use_global_device_ids``) or cross-replica-and-partition
    (``use_global_device_ids=false``); with ``use_global_device_ids=true``,
    the groups are device ids already. ``{}`` stands for every replica (or
    partition) of the mode.
    """
    if has_channel and global_ids:
        if not groups:
            raise _unknown("flattened-id replica groups (empty: XLA requires them listed)", text)
        return groups
    if not has_channel:  # cross-replica: each partition on its own
        groups = groups or (tuple(range(replicas)),)
        return tuple(tuple(r * partitions + p for r in g) for p in range(partitions) for g in groups)
    if kind not in _GLOBAL_IDS_KINDS:  # cross-partition: each replica on its own
        groups = groups or (tuple(range(partitions)),)
        return tuple(tuple(r * partitions + p for p in g) for r in range(replicas) for g in groups)
    groups = groups or (tuple(range(replicas)),)  # cross-replica-and-partition
    return tuple(tuple(r * partitions + p for r in g for p in range(partitions)) for g in groups)


def _pairs(text: str) -> tuple[tuple[int, int], ...]:
    if not _EXPLICIT.fullmatch(text.strip()):
        raise _unknown("the source-target pairs", text)
    pairs = tuple(_ints(p) for p in re.findall(r"\{([0-9,\s]*)\}", text.strip()[1:-1]))
    if any(len(p) != 2 for p in pairs):
        raise _unknown("the source-target pairs (not pairs)", text)
    return tuple((a, b) for a, b in pairs)
