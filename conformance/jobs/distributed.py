"""The suite as one process of a multi-process JAX job (``pytest --distributed``).

Started by ``python -m conformance launch`` (:mod:`conformance.jobs.launch`), a rank finds its
place in the launcher's environment; started by another launcher (Open MPI's ``mpirun``,
SLURM's ``srun``, a Cloud TPU pod's ``--worker=all``), ``jax.distributed.initialize()``
detects the cluster itself. Either way this runs before any backend starts: it sets the
rank's simulated CPU device count (``CONFORMANCE_DEVICES_PER_PROCESS``, where given) and
gloo for collectives between CPU processes, then joins the job.
"""

from __future__ import annotations

import hashlib
import os
import time

import jax

from conformance import compat
from conformance import session as session_lib
from conformance.jobs.launch import DEVICES_PER_PROCESS, LOG_DIR, NUM_PROCESSES, PROCESS_ID

#: Why a Pallas kernel's checks on CPU skip in a multi-process job.
PALLAS_INTERPRET = (
    "not run in a multi-process job: TPU interpret mode runs a kernel's remote DMAs and semaphores "
    "inside one process, and this mesh spans several; run it single-process"
)


def launched() -> bool:
    """Whether this process is a rank started by ``python -m conformance launch``."""
    return PROCESS_ID in os.environ


def initialize() -> None:
    """Join the job (idempotent): device count and gloo first, then ``jax.distributed.initialize``;
    arrays with no shard on this process allowed (:func:`compat.allow_arrays_without_local_shards`)."""
    from jax._src import distributed as jax_distributed

    compat.allow_arrays_without_local_shards()
    if jax_distributed.global_state.client is not None:
        return
    devices = os.environ.get(DEVICES_PER_PROCESS)
    if devices:
        compat.configure_cpu_devices(int(devices))
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if launched():  # the coordinator address comes from JAX_COORDINATOR_ADDRESS, which JAX reads
        jax.distributed.initialize(
            num_processes=int(os.environ[NUM_PROCESSES]), process_id=int(os.environ[PROCESS_ID])
        )
    else:
        jax.distributed.initialize()


def note_current_test(nodeid: str) -> None:
    """Tell the launcher which test this rank is in (empty: between tests)."""
    log_dir = os.environ.get(LOG_DIR)
    if log_dir and launched():
        with open(os.path.join(log_dir, f"rank-{os.environ[PROCESS_ID]}.test"), "w") as f:
            f.write(nodeid)


#: How long a rank waits for the others' answer before saying which did not answer.
AGREE_TIMEOUT_S = 600.0


class RankGaveUp(RuntimeError):
    """Another rank posted a later step of this test (its verdict, or the test's outcome) while this
    one waited for it at an earlier step: it left the test before getting there (e.g. its kernel
    raised while tracing, or its check raised something that is not a verdict)."""

    def __init__(self, rank: int, verdict: str) -> None:
        super().__init__(f"rank {rank} stopped before this step of the test; its verdict: {verdict}")
        self.rank, self.verdict = rank, verdict


def client():
    """The ``jax.distributed`` key-value client of this process, or ``None`` outside a job."""
    return _client()


def _client():
    from jax._src import distributed as jax_distributed

    return jax_distributed.global_state.client


def rank_and_size() -> tuple[int, int]:
    from jax._src import distributed as jax_distributed

    state = jax_distributed.global_state
    return state.process_id or 0, state.num_processes or 1


def is_multi_process() -> bool:
    """Whether this process joined a job of more than one process (starts no backend)."""
    return _client() is not None and rank_and_size()[1] > 1


def job_layout_problem() -> str | None:
    """What is wrong with this job's devices, in words, or ``None``: starts the backend and checks
    that every process has the same number of local devices, and the number ``launch`` asked for
    (``--devices-per-process``), so that meshes of the job's devices cross process boundaries."""
    rank, size = rank_and_size()
    local, total = jax.local_device_count(), jax.device_count()
    wanted = os.environ.get(DEVICES_PER_PROCESS)
    if wanted and local != int(wanted):
        return (
            f"rank {rank}: this process has {local} local devices, but the job asked for {wanted} per "
            f"process ({DEVICES_PER_PROCESS}); something set the CPU device count before the suite "
            "joined the job"
        )
    if total != local * size:
        return (
            f"rank {rank}: the job's {size} processes have {total} devices in all, not {size} x {local}: "
            "processes with different local device counts"
        )
    return None


def _try_get(client, key: str) -> str | None:
    try:
        return client.key_value_try_get(key)
    except Exception:  # NOT_FOUND: not posted yet
        return None


#: The longest pause between two looks for the other ranks' answers. Polled, not a blocking get:
#: under JAX 0.6.2 two ranks each in ``blocking_key_value_get`` for the other's key, both posted,
#: were seen waiting for ever (in the timeout self-test).
_MAX_PAUSE_S = 0.01


def exchange(topic: str, text: str) -> list[str]:
    """Every rank's ``text`` for this step of the current test, in rank order.

    Every rank calls it at the same steps, within the run's session, whose
    :class:`~conformance.session.Agreement` numbers the steps. Plain text through the job's
    key-value store (nothing is unpickled). A rank that posts a later step (its ``verdict`` of the
    check, or the test's ``outcome``) while the others wait at an earlier one makes them raise
    :class:`RankGaveUp` instead of waiting for ever.
    """
    if not is_multi_process():
        return [text]
    active = session_lib.active_or_none()
    if active is None:
        raise RuntimeError(f"an exchange of {topic!r} in a multi-process job outside a session of the suite")
    agreement = active.agreement
    rank, size = rank_and_size()
    base = f"conformance/{agreement.test}/{topic}/{agreement.next_round(topic)}"
    # A rank that has posted a later step of this test (its verdict, or its outcome: the test's last
    # exchange) will never post this one: watch for those instead of waiting for ever.
    test = f"conformance/{agreement.test}"
    watch = {"outcome": [], "verdict": [f"{test}/outcome/1"]}.get(
        topic, [f"{test}/verdict/{agreement.rounds.get('verdict', 0) + 1}", f"{test}/outcome/1"]
    )
    client = _client()
    client.key_value_set(f"{base}/{rank}", text)
    got: dict[int, str] = {rank: text}
    deadline, pause = time.monotonic() + AGREE_TIMEOUT_S, 0.0005
    while len(got) < size:
        for r in range(size):
            if r in got:
                continue
            value = _try_get(client, f"{base}/{r}")
            if value is not None:
                got[r] = value
                continue
            # the later steps only once this wait has lasted (each look is a call to the coordinator)
            for later in watch if pause >= _MAX_PAUSE_S else ():
                if (gave_up := _try_get(client, f"{later}/{r}")) is None:
                    continue
                # A rank posts its steps in order: it may have posted this step and gone on to the
                # later one between the two looks above, so look at this step once more.
                value = _try_get(client, f"{base}/{r}")
                if value is None:
                    raise RankGaveUp(r, gave_up)
                got[r] = value
                break
        if len(got) < size:
            if time.monotonic() > deadline:
                missing = [r for r in range(size) if r not in got]
                raise RuntimeError(
                    f"rank {rank}: ranks {missing} gave no {topic!r} answer in "
                    f"{AGREE_TIMEOUT_S:g} s in {agreement.test or 'collection'}"
                )
            time.sleep(pause)
            pause = min(pause * 2, _MAX_PAUSE_S)
    return [got[r] for r in range(size)]


class ProgramMismatch(RuntimeError):
    """The ranks traced different programs for the same call."""


def by_message(per_rank: list[tuple[int, str]], size: int) -> list[str]:
    """Each distinct message once, led by the ranks that gave it (``[ranks 0, 2 of 4] text``), in
    the order of the lowest rank giving each: ranks can fail one test differently (one times out,
    another raises the wrong error), and every rank's own message is shown."""
    groups: dict[str, list[int]] = {}
    for rank, text in per_rank:
        groups.setdefault(text, []).append(rank)
    return [
        f"[{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))} of {size}] {text}"
        for text, ranks in groups.items()
    ]


def agree_on_program(lowered, what: str) -> None:
    """Every rank must have traced the same program (``lowered``, a ``jax.stages.Lowered``) for ``what``."""
    if not is_multi_process():
        return
    digest = hashlib.sha256(lowered.as_text().encode()).hexdigest()[:16]
    digests = exchange("program", digest)
    if len(set(digests)) > 1:
        rank, _ = rank_and_size()
        groups: dict[str, list[int]] = {}
        for r, d in enumerate(digests):
            groups.setdefault(d, []).append(r)
        parts = "; ".join(f"ranks {rs} traced program {d}" for d, rs in groups.items())
        raise ProgramMismatch(
            f"the ranks traced different programs for {what} ({parts}); every process of a JAX job must "
            "trace the same program: does the kernel branch on jax.process_index() or other per-process "
            f"state while tracing? (this is rank {rank})"
        )
