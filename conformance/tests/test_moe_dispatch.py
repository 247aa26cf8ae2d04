"""Conformance of every ``moe_dispatch`` implementation.

The spec is ``conformance/specs/moe_dispatch.py``; the checks are the standard ones.
"""

from conformance.family_tests import *  # noqa: F403  (the standard checks, parametrized per FAMILY)

FAMILY = "moe_dispatch"
