"""Conformance of every ``all_gather`` implementation.

The spec is ``conformance/specs/all_gather.py``; the checks are the standard ones
plus, for Pallas kernels, the race check under both DMA execution modes.
"""

from conformance.family_tests import *  # noqa: F403  (the standard checks, parametrized per FAMILY)

FAMILY = "all_gather"
