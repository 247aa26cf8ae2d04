"""The family test modules: one per family (``FAMILY = "..."`` and ``from conformance.family_tests
import *``), the benchmarks, the send_recv family's own tests, and the fixed tests of the suite
(the seed case of JAX issue #21855, the built-in Pallas ring's TPU refusals). A new family adds a
module here as a third party's does in its own repository (docs/families.md).

May import anything of the suite: these are the top of the house, run by pytest.
"""
