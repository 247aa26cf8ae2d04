"""Top-level conftest: the suite's pytest plugin (options, parametrization, backend gating)."""

pytest_plugins = ("conformance.pytest_plugin",)
