"""Parse compiled HLO (and lowered StableHLO) text into collective operations.

This is the only place in the project that reads HLO text. Checks ask it
questions ("which collectives, how many bytes does a device receive") and
never count substrings themselves.

For compiled HLO we parse every computation, resolve operand shapes through
the instruction table, and give each collective a *multiplicity*: how many
times it runs per call, following ``while`` bodies (with XLA's
``known_trip_count``), calls and conditionals from the ENTRY computation. A
collective inside a loop whose trip count XLA could not determine has
multiplicity ``None``, and byte accounting then reports "unbounded" instead
of guessing.

Bytes received per device follow the usual algorithm-independent accounting:

* collective-permute: the operand, on every device that is a target;
* all-gather: ``result - operand`` (everything but one's own piece);
* reduce-scatter and all-to-all: ``(g-1)/g`` of the operand, for group size g;
* all-reduce: ``2 (g-1)/g`` of the operand (reduce-scatter then all-gather);
* ragged-all-to-all: how many rows arrive is data, so its bound: the whole output buffer (its
  result), which the senders may fill. (The bytes checks count its groups in a run instead:
  :func:`conformance.checks.ragged_bytes.as_the_op_moves_them`.) In StableHLO it is a custom call,
  ``stablehlo.custom_call @ragged_all_to_all``, read in the one form JAX prints.

Replica groups come in every form the supported XLAs print, each expanded to
explicit device-id groups: the list ``{{0,1},{2,3}}``, the iota form
``[4,2]<=[2,4]T(1,0)``, and the mesh-axes form ``mesh['x'=4,'y'=2] {'y'}``
(with sub-axes ``{'x':(2)4}`` and ``, device_ids=(...)``), which XLA prints
from JAX 0.10 for partitioner-made collectives and from 0.12 for all of them;
in StableHLO, ``dense<...>`` and ``#stablehlo.replica_group_mesh_axes<...>``
over an ``sdy.mesh``. Groups are read in the op's mode (cross-replica,
cross-partition, both, or flattened ids) and the module's replica and partition
counts, so an empty ``{}`` becomes the group it stands for. Text in a form not
listed here raises :class:`HloParseError` quoting it: a parser that guessed, or
returned no groups, would let the audit measure less than it says.

The parts: :mod:`~conformance.hlo.model` (what is returned), :mod:`~conformance.hlo.replica_groups`,
:mod:`~conformance.hlo.compiled` (HLO text), :mod:`~conformance.hlo.stablehlo` (lowered modules) and
:mod:`~conformance.hlo.dataflow` (overlap, from dataflow and from a scheduled module's run order).
"""

from conformance.hlo.compiled import HloModule, Instruction, collectives_of, parse_hlo, parse_module
from conformance.hlo.dataflow import (
    MATMUL_OPCODES,
    OverlapSummary,
    Schedule,
    ScheduledTransfer,
    Transfer,
    overlap,
    schedule,
)
from conformance.hlo.model import (
    COLLECTIVE_KINDS,
    CollectiveOp,
    CollectiveSummary,
    HloParseError,
    Shape,
    allowed_text,
    disallowed,
    less_what_compiling_removes,
)
from conformance.hlo.replica_groups import Groups, mesh_axes_groups, parse_replica_groups
from conformance.hlo.stablehlo import parse_stablehlo

__all__ = [
    "COLLECTIVE_KINDS",
    "MATMUL_OPCODES",
    "CollectiveOp",
    "CollectiveSummary",
    "Groups",
    "HloModule",
    "HloParseError",
    "Instruction",
    "OverlapSummary",
    "Schedule",
    "ScheduledTransfer",
    "Shape",
    "Transfer",
    "allowed_text",
    "collectives_of",
    "disallowed",
    "less_what_compiling_removes",
    "mesh_axes_groups",
    "overlap",
    "parse_hlo",
    "parse_module",
    "parse_replica_groups",
    "parse_stablehlo",
    "schedule",
]
