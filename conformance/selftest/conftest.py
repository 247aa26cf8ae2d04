"""The self-tests' order: the longest modules first, so that pytest-xdist's workers finish together.

The selftest envs run ``--dist loadfile`` (a module to one worker: the modules whose tests share one run
of the suite stay together) with ``--no-loadscope-reorder``: left to itself, pytest-xdist hands the
modules out by their number of tests, most first, and the longest modules have few tests (a job
launched per test, a fresh environment per test), so they started last and ran alone at the end while
the other worker sat idle. Here they go first, longest first (each module's test time in the selftest
env of a fresh clone's ``.ci/run``, in seconds, beside it); the rest keep their order after them.
"""

from __future__ import annotations

import pytest

#: The self-test modules that take longest, longest first (test time in the selftest env, seconds).
LONGEST_FIRST = (
    "test_plugin_options",  # 197
    "test_rejects_broken_kernels",  # 188
    "test_multiprocess",  # 150
    "test_downstream",  # 94
    "test_tpu_schedule",  # 48
    "test_send_recv_rejects",  # 40
    "test_xdist",  # 32
    "test_bounds",  # 30
    "test_bad_outputs_end_to_end",  # 29
    "test_compilation_cache",  # 19
    "test_interpret_outcomes",  # 18
    "test_benchmarks_run",  # 14
    "test_cpu_ragged_all_to_all",  # 12
    "test_launch",  # 12
    "test_compile_timeout",  # 11
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The self-tests of :data:`LONGEST_FIRST` first, in its order; every other test after them, in the
    order it was collected (a stable sort: a module's own tests keep theirs)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}

    def place(item: pytest.Item) -> int:
        module = getattr(item, "module", None)
        name = getattr(module, "__name__", "").rpartition(".")[2]
        is_selftest = getattr(module, "__name__", "").startswith("conformance.selftest.")
        return rank.get(name, len(rank)) if is_selftest else len(rank)

    items.sort(key=place)
