"""The ``all_reduce`` family: every check of :mod:`conformance.family_tests` for each implementation."""

from conformance.family_tests import *  # noqa: F403

FAMILY = "all_reduce"
