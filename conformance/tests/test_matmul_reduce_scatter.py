"""Conformance of every ``matmul_reduce_scatter`` implementation.

The spec (shapes, shardings, reference, gradients, forward and backward
collectives, byte bounds) is ``conformance/specs/matmul_reduce_scatter.py``;
the checks are the standard ones, plus accuracy against the baseline.
"""

from conformance.family_tests import *  # noqa: F403  (the standard checks, parametrized per FAMILY)

FAMILY = "matmul_reduce_scatter"
