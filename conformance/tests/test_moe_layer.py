"""Conformance of every ``moe_layer`` implementation.

The spec is ``conformance/specs/moe_layer.py``; the checks are the standard ones.
"""

from conformance.family_tests import *  # noqa: F403  (the standard checks, parametrized per FAMILY)

FAMILY = "moe_layer"
