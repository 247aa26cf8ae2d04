"""The suite as a job of several processes, and the CPU a run may use.

- :mod:`~conformance.jobs.launch`: ``python -m conformance launch``, N local ranks of one JAX job;
- :mod:`~conformance.jobs.distributed`: a rank joining the job and agreeing with the others through
  the job's key-value store (plain text, the session's agreement numbering each step);
- :mod:`~conformance.jobs.cpu_share`: the CPU quota a container grants, for ``-n auto``.

May import: the core modules (``compat``, ``session``, ``command_line``); nothing above them.
"""
