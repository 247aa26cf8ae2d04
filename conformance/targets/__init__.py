"""The compile targets: the real compilers of chips this host may not have, and their caches.

- :mod:`~conformance.targets.tpu_compiler`: libtpu compiling for TPU topologies (no chip needed);
- :mod:`~conformance.targets.gpu_compiler`: XLA:GPU compiling for H100 topologies (JAX's CUDA
  plugin, no GPU needed), from the target configs in ``gpu_targets/``;
- :mod:`~conformance.targets.mosaic`: TPU tiling and ``refuse_on_tpu`` (a kernel's refusals, held
  against the compiler);
- :mod:`~conformance.targets.target_compiles`: one compile for a target, bounded in time, kept for
  the session and on disk (what the checks read of it);
- :mod:`~conformance.targets.compilation_cache`: JAX's persistent compilation cache for a run.

May import: the core modules (``compat``, ``session``, ``native_logs``) and ``fixtures``; nothing
that runs a check, reports or drives pytest.
"""

import os
from collections.abc import Callable


def environment_defaults(values: dict[str, str]) -> Callable[[], None]:
    """Set each of ``values`` in ``os.environ`` where it is unset (this process and those it starts);
    returns the closure that removes what it set."""
    added = {k: v for k, v in values.items() if k not in os.environ}
    os.environ.update(added)

    def undo() -> None:
        for key in added:
            os.environ.pop(key, None)

    return undo
