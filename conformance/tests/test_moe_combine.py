"""Conformance of every ``moe_combine`` implementation.

The spec is ``conformance/specs/moe_combine.py``; the checks are the standard ones.
"""

from conformance.family_tests import *  # noqa: F403  (the standard checks, parametrized per FAMILY)

FAMILY = "moe_combine"
