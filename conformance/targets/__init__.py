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
