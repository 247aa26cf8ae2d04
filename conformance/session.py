"""A run's settings and state, passed down as objects: never assigned into other modules' globals.

:class:`Settings` are the bounds a user sets (``--hang-timeout``, ``--check-timeout``,
``--isolation``). A :class:`Session` is one run's state: its settings, the kernels that hung
(their later checks are not judged instead of hanging again), the worker process that checks
Pallas kernels on CPU (:mod:`conformance.run.check_worker`), what each compile for a TPU or GPU topology
gave, and where a multi-process job's ranks are in their exchanges. Nothing of a run is kept in a
module: two sessions in one process see nothing of each other's. The pytest plugin keeps one in
``config.stash`` for the whole session; absltest's ``main``, the replay command and the worker
process each make their own.

:func:`conformance.run.outcomes.run_check` makes its session the active one for the duration of one
check (:meth:`Session.active`, undone when the check returns), which is how the watchdog deep in
:mod:`conformance.runner` reads the hang timeout of this run and not of another.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

#: Where a Pallas kernel on CPU is checked: "process" (a worker process that can be stopped
#: whatever hangs) or "off" (this process).
ISOLATION_MODES = ("process", "off")
#: What a kernel whose compiled schedule leaves more bytes exposed than the compiler's own collective
#: matmul gets: "report" (the tables say it is behind) or "fail" (the schedule check fails it).
BEHIND_COMPILER_MODES = ("report", "fail")
#: What a schedule check's rule (every transfer but one per ring direction has a matmul inside it) is
#: in a run: "compiler" (a kernel fails it only where it is also behind the compiler's own collective
#: matmul: level or ahead is no worse than not writing the kernel) or "hidden" (the rule alone).
SCHEDULE_VERDICTS = ("compiler", "hidden")


#: The time bounds a user sets, each a :class:`Settings` field and the option ``--hang-timeout`` etc.
TIME_BOUNDS = {
    "hang_timeout_s": "stop a Pallas kernel running longer than this in interpret mode",
    "check_timeout_s": "stop the worker process when a Pallas or compile tier check takes longer",
    "compile_timeout_s": "a compile for a TPU or GPU topology taking longer is abandoned and fails its check",
}


@dataclasses.dataclass(frozen=True)
class Settings:
    """The bounds of a run (each has a command-line option of the same name)."""

    #: Seconds a Pallas kernel may run in interpret mode before the watchdog stops it.
    hang_timeout_s: float = 20.0
    #: Seconds a stopped kernel has to unwind after the watchdog's abort before it counts as
    #: unstoppable (a thread stuck below Python, where no flag or semaphore reaches it).
    abort_grace_s: float = 10.0
    #: Seconds one check of a Pallas kernel or of a compile tier (traces, compiles and runs) may take in
    #: the worker process.
    check_timeout_s: float = 300.0
    #: Seconds one compile for a TPU or GPU topology may take; past it, the compile is abandoned and its
    #: check fails naming it (:mod:`conformance.targets.target_compiles`).
    compile_timeout_s: float = 300.0
    #: :data:`ISOLATION_MODES`.
    isolation: str = "process"
    #: :data:`BEHIND_COMPILER_MODES`.
    behind_compiler: str = "report"
    #: :data:`SCHEDULE_VERDICTS`.
    schedule_verdict: str = "compiler"
    #: Compiler options (name, value) given to every compile for a TPU or GPU topology whose compiler
    #: knows them (``--compiler-option``), beside the flags of ``XLA_FLAGS`` and ``LIBTPU_INIT_ARGS``.
    compiler_options: tuple[tuple[str, object], ...] = ()

    def __post_init__(self) -> None:
        if self.isolation not in ISOLATION_MODES:
            raise ValueError(f"isolation {self.isolation!r} is not one of {ISOLATION_MODES}")
        if self.behind_compiler not in BEHIND_COMPILER_MODES:
            raise ValueError(
                f"behind_compiler {self.behind_compiler!r} is not one of {BEHIND_COMPILER_MODES}"
            )
        if self.schedule_verdict not in SCHEDULE_VERDICTS:
            raise ValueError(f"schedule_verdict {self.schedule_verdict!r} is not one of {SCHEDULE_VERDICTS}")
        for name in ("hang_timeout_s", "abort_grace_s", "check_timeout_s", "compile_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be a positive number of seconds, not {getattr(self, name)!r}")

    def verdict_options(self) -> list[str]:
        """The command-line options of these settings that decide a verdict and are not the defaults
        (``--behind-compiler``, ``--schedule-verdict``, ``--compiler-option``): what a replay line
        carries so that it judges as the run did."""
        default = Settings()
        options = [
            f"--{field.replace('_', '-')}={getattr(self, field)}"
            for field in ("behind_compiler", "schedule_verdict")
            if getattr(self, field) != getattr(default, field)
        ]
        return options + [f"--compiler-option={name}={value}" for name, value in self.compiler_options]


@dataclasses.dataclass
class Agreement:
    """Where the ranks of a multi-process job are in their exchanges through the job's key-value store
    (:func:`conformance.jobs.distributed.exchange`): the test they are in, and per topic the rounds so far.
    Every rank numbers its rounds alike, so each round's keys are the same on every rank."""

    test: str = ""
    rounds: dict[str, int] = dataclasses.field(default_factory=dict)

    def begin(self, test: str) -> None:
        """Rounds start again at each test (the plugin calls this at each test's setup)."""
        self.test = test
        self.rounds.clear()

    def next_round(self, topic: str) -> int:
        self.rounds[topic] = self.rounds.get(topic, 0) + 1
        return self.rounds[topic]


@dataclasses.dataclass(frozen=True)
class Hang:
    """A kernel that hung this run: the one-line verdict, and the case it hung on."""

    what: str
    where: str
    #: Its thread was given up still blocked (a bounded call, :func:`conformance.watchdog.call_bounded`),
    #: not stopped (a Pallas kernel the watchdog aborted).
    abandoned: bool = False
    #: The pytest test it hung in, where known: a later case in that same test (hypothesis shrinking
    #: the example that hung) fails as the hang did; a case in any other test is not judged.
    test: str | None = None

    def same_test(self, current_test: str | None, token: str) -> bool:
        """Whether the case ``token``, run now in ``current_test``, is in the test this hang happened in;
        outside pytest, whether it is on the same mesh (a token starts with its mesh label)."""
        if self.test is not None and current_test is not None:
            return self.test == current_test
        return self.where.split(":")[0] == token.split(":")[0]


class Session:
    """One run's settings and state."""

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        on_unstoppable: Callable[[Any, list[Any]], None] | None = None,
    ) -> None:
        self.settings = settings or Settings()
        #: (family, implementation) -> how it hung; its later checks are not judged.
        self.hung: dict[tuple[str, str], Hang] = {}
        #: Called from the watchdog's thread with the case and the stuck threads' stacks when a
        #: kernel the watchdog stopped has not unwound; it must not return. ``None``: say where the
        #: threads are stuck and end the process (:func:`conformance.watchdog.end_process`).
        self.on_unstoppable = on_unstoppable
        #: The thread bounded calls run on (:class:`conformance.watchdog.BoundedCaller`), started at
        #: first use.
        self.caller: Any = None
        #: The worker process of :mod:`conformance.run.check_worker`, started at first use.
        self.worker: Any = None
        #: Where a pytest session keeps its results (:class:`conformance.reports.results.RunLog`); ``None``
        #: for a run that reports each outcome as it comes (absltest, replay, the worker).
        self.log: Any = None
        #: Where compiles for TPU and GPU topologies are kept across processes and runs
        #: (:mod:`conformance.targets.target_compiles`); ``None``: in this process only.
        self.target_compile_dir: str | None = None
        #: Where the verdicts of Pallas kernels' interpreted programs are kept
        #: (:mod:`conformance.run.interpret_outcomes`), or ``None``.
        self.interpret_outcome_dir: str | None = None
        #: The compiles for TPU and GPU topologies given up past ``compile_timeout_s``, each in a
        #: thread that may still run: what they were.
        self.abandoned_compiles: list[str] = []
        #: What each compile for a TPU or GPU topology gave this session, by its key: the compile, the
        #: compiler's refusal, or that it timed out
        #: (:func:`conformance.targets.target_compiles.compile_lowered`).
        self.target_compiles: dict[str, Any] = {}
        #: (family, implementation) -> whether its program binds XLA's ragged all-to-all
        #: (:func:`conformance.targets.cpu_ragged_all_to_all.implementation_calls_the_op`).
        self.calls_ragged_all_to_all: dict[tuple[str, str], bool] = {}
        #: This process's place in a multi-process job's exchanges (:class:`Agreement`).
        self.agreement = Agreement()
        #: The implementation, mesh and platform whose programs the runner holds
        #: (:func:`conformance.runner.held_for`), once a check has run in this process.
        self.held: Any = None

    def activate(self) -> Callable[[], None]:
        """Make this session :func:`current`; returns the closure that undoes it."""
        token = _ACTIVE.set(self)
        return lambda: _ACTIVE.reset(token)

    @contextlib.contextmanager
    def active(self) -> Iterator[Session]:
        """This session is :func:`current` inside the block, and the one before it after."""
        token = _ACTIVE.set(self)
        try:
            yield self
        finally:
            _ACTIVE.reset(token)

    def current_test(self) -> str | None:
        """The pytest test running now (its node id), where this session reports to a pytest run."""
        return getattr(self.log, "current", None)

    def abandoned_calls(self) -> list[str]:
        """Where each call this session gave up on as hung was (its thread may still be blocked), and
        each compile it gave up on past its bound (its thread may still be compiling)."""
        hung = [f"{impl}: {hang.where}" for (_, impl), hang in self.hung.items() if hang.abandoned]
        return hung + self.abandoned_compiles

    def close(self) -> None:
        """Stop the worker process, if one was started."""
        if self.worker is not None:
            self.worker.close()
            self.worker = None


_ACTIVE: contextvars.ContextVar[Session | None] = contextvars.ContextVar("conformance_session", default=None)


def current() -> Session:
    """The active session; outside any, a fresh one with the default settings (remembering nothing)."""
    return _ACTIVE.get() or Session()


def active_or_none() -> Session | None:
    return _ACTIVE.get()
