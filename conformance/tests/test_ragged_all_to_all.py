"""Conformance of every ``ragged_all_to_all`` implementation.

The spec is ``conformance/specs/ragged_all_to_all.py``; the checks are the standard ones.
"""

from conformance.family_tests import *  # noqa: F403  (the standard checks, parametrized per FAMILY)

FAMILY = "ragged_all_to_all"
