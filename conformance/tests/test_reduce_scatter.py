"""The ``reduce_scatter`` family: every check of :mod:`conformance.family_tests` for each implementation."""

from conformance.family_tests import *  # noqa: F403

FAMILY = "reduce_scatter"
