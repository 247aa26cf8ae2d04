"""The suite as one process of a multi-process JAX job (``pytest --distributed``).

Started by ``python -m conformance launch`` (:mod:`conformance.launch`), a rank finds its
place in the launcher's environment; started by another launcher (Open MPI's ``mpirun``,
SLURM's ``srun``, a Cloud TPU pod's ``--worker=all``), ``jax.distributed.initialize()``
detects the cluster itself. Either way this runs before any backend starts: it sets the
rank's simulated CPU device count (``CONFORMANCE_DEVICES_PER_PROCESS``, where given) and
gloo for collectives between CPU processes, then joins the job.
"""

from __future__ import annotations

import os

import jax

from conformance import compat
from conformance.launch import DEVICES_PER_PROCESS, LOG_DIR, NUM_PROCESSES, PROCESS_ID


def launched() -> bool:
    """Whether this process is a rank started by ``python -m conformance launch``."""
    return PROCESS_ID in os.environ


def initialize() -> None:
    """Join the job (idempotent): device count and gloo first, then ``jax.distributed.initialize``."""
    from jax._src import distributed as jax_distributed

    if jax_distributed.global_state.client is not None:
        return
    devices = os.environ.get(DEVICES_PER_PROCESS)
    if devices:
        compat.configure_cpu_devices(int(devices))
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if launched():  # the coordinator address comes from JAX_COORDINATOR_ADDRESS, which JAX reads
        jax.distributed.initialize(num_processes=int(os.environ[NUM_PROCESSES]),
                                   process_id=int(os.environ[PROCESS_ID]))  # fmt: skip
    else:
        jax.distributed.initialize()


def note_current_test(nodeid: str) -> None:
    """Tell the launcher which test this rank is in (empty: between tests)."""
    log_dir = os.environ.get(LOG_DIR)
    if log_dir and launched():
        with open(os.path.join(log_dir, f"rank-{os.environ[PROCESS_ID]}.test"), "w") as f:
            f.write(nodeid)
