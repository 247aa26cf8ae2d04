"""Conformance of every ``allgather_matmul`` implementation.

The spec (shapes, shardings, reference, collectives, byte bound) is
``conformance/specs/allgather_matmul.py``; the checks are the standard ones.
"""

from conformance.family_tests import *  # noqa: F403  (the standard checks, parametrized per FAMILY)

FAMILY = "allgather_matmul"
