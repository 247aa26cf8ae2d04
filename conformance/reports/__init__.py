"""What a run reports: the run log and every form made from it.

- :mod:`~conformance.reports.results`: each test's outcome in one model, the kernel x check
  matrix and the JSON document;
- :mod:`~conformance.reports.html_page`: the one self-contained HTML page made from the JSON;
- :mod:`~conformance.reports.failure_summary`: the failures by cause, each at its smallest case,
  with the patterns their meshes and dtypes share and where to start;
- :mod:`~conformance.reports.html_plots`: the ladders of the compile tiers and benchmarks as SVG;
- :mod:`~conformance.reports.bench`: benchmark records and their tables.

May import: the checks (their records and concerns), the runner's cases, the registry and specs;
never the run path or the pytest side, which hand it what they have.
"""
