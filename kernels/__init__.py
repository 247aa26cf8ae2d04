"""Reference kernels, one family per sub-package.

Importing this package registers every built-in implementation with
``conformance.register``, exactly as a third-party module would.
"""

from conformance.kernels import all_gather, allgather_matmul, matmul_reduce_scatter, send_recv  # noqa: F401  (register on import)
