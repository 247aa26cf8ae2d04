"""The ``send_recv`` family's cases and checks: routes, layouts, bit patterns, verdicts.

A *route* is a source mesh shape and where its devices send: to themselves (``identical``), to
the same devices in reverse order (``permuted``), to as many other devices (``disjoint``, and
``disjoint_back`` the other way), or to a window half over the source (``overlapping``). Devices
are taken in JAX's order, process by process, so in a job of 2 processes x 4 devices
``4-disjoint`` sends from process 0 to process 1 and ``4-disjoint_back`` from 1 to 0; with one
device per process every pair crosses.

A *layout* is a global shape and a ``PartitionSpec`` over the source mesh: a vector split over
every axis (3 elements per shard, odd), a matrix split over both dimensions, a 3-D array
replicated over (some) mesh axes, and an array of zero elements.

Values are the dtype's bit patterns: random bytes (every NaN payload a dtype has shows up), with
-0.0, infinities, quiet and signalling NaNs with payloads, subnormals and the extremes first.
The checks compare raw bytes, shard by shard, against the numpy source: nothing is converted.

The parts: :mod:`~conformance.transfers.cases` (routes, layouts, values, one transfer),
:mod:`~conformance.transfers.bounded` (calls that cannot hang the run),
:mod:`~conformance.transfers.verdicts` (the checks) and :mod:`~conformance.transfers.hygiene`
(resources left open, pickle on the wire).
"""

from jax.sharding import PartitionSpec as P

from conformance.specs.send_recv import np_dtype
from conformance.transfers.bounded import (
    CALL_TIMEOUT_HANG_TIMEOUTS,
    bounded_call,
    call_timeout_s,
)
from conformance.transfers.cases import (
    FAMILY,
    LAYOUT_NAMES,
    ROUTE_KINDS,
    ROUTES,
    Layout,
    Route,
    Transfer,
    host_values,
    layout,
    place,
    special_values,
    standard_routes,
)
from conformance.transfers.hygiene import check_no_pickle, check_resources, is_pickle_stream, open_resources
from conformance.transfers.verdicts import (
    BAD_DESTINATIONS,
    BLOCK_MAPS,
    bad_destination,
    blocks,
    check_bad_destination,
    check_block_map,
    check_same_placement,
    check_sharding,
    check_source_intact,
    check_timeout,
    check_values,
    compare_shards,
    first_difference,
    other_block_map,
    same_placement,
)

__all__ = [
    "BAD_DESTINATIONS",
    "BLOCK_MAPS",
    "CALL_TIMEOUT_HANG_TIMEOUTS",
    "FAMILY",
    "LAYOUT_NAMES",
    "ROUTES",
    "ROUTE_KINDS",
    "Layout",
    "P",
    "Route",
    "Transfer",
    "bad_destination",
    "blocks",
    "bounded_call",
    "call_timeout_s",
    "check_bad_destination",
    "check_block_map",
    "check_no_pickle",
    "check_resources",
    "check_same_placement",
    "check_sharding",
    "check_source_intact",
    "check_timeout",
    "check_values",
    "compare_shards",
    "first_difference",
    "host_values",
    "is_pickle_stream",
    "layout",
    "np_dtype",
    "open_resources",
    "other_block_map",
    "place",
    "same_placement",
    "special_values",
    "standard_routes",
]
