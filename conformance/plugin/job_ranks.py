"""The pytest side of a multi-process JAX job: every rank runs the same tests, agrees on each
test's outcome, and ends past calls it abandoned after they hung."""

from __future__ import annotations

import hashlib
import json
import os
import sys

import pytest

from conformance.jobs import distributed
from conformance.plugin.end_of_run import EXIT_STATUS, SESSION, junit_xml, skip_reason


def exit_past_abandoned_calls(config: pytest.Config) -> None:
    """Last at exit (of one process, a pytest-xdist worker or a rank of a job): if a call the suite
    abandoned after it hung still has its thread blocked (in the job's key-value store, say), or a
    compile for a TPU or GPU topology past its bound is still running, end the process now, with
    pytest's exit status, naming them. Left to Python's finalization, such a thread makes the process
    abort ("terminate called after throwing ...", exit status 134), which a launcher or CI can only
    report as a crash."""
    abandoned = config.stash[SESSION].abandoned_calls() if SESSION in config.stash else []
    if not abandoned:
        return
    status = config.stash.get(EXIT_STATUS, 1)
    where = "; ".join(abandoned)
    distributed.note_current_test(f"(after its tests, ending past abandoned call(s): {where})")
    sys.stdout.flush()
    sys.stderr.write(
        f"conformance: this process ends with exit status {status} without waiting for "
        f"{len(abandoned)} call(s) it abandoned (hung, or compiling past --compile-timeout): {where}\n"
    )
    sys.stderr.flush()
    os._exit(status)


def junit_file_per_rank(config: pytest.Config) -> None:
    """Every rank of a job runs the same tests: rank 0 writes ``--junitxml``'s file, and each other rank
    the file beside it named for its rank (``results.xml.rank-1``), where the path names no rank of its
    own (``--junitxml=results.xml.rank-$CONFORMANCE_PROCESS_ID``); else the ranks would write one file."""
    xml = junit_xml(config)
    rank, _ = distributed.rank_and_size()
    if xml is not None and rank and ".rank-" not in os.path.basename(xml.logfile):
        xml.logfile = f"{xml.logfile}.rank-{rank}"


def same_tests_on_every_rank(nodeids: list[str]) -> None:
    """Stop the job, with the difference, if the ranks collected different tests (else they would
    wait for each other at different tests until a timeout)."""
    digest = f"{len(nodeids)}:{hashlib.sha256(chr(10).join(nodeids).encode()).hexdigest()[:16]}"
    digests = distributed.exchange("collection", digest)
    if len(set(digests)) == 1:
        return
    lists = [text.split("\n") for text in distributed.exchange("collection-lists", "\n".join(nodeids))]
    first = next((k for k in range(max(map(len, lists))) if len({tuple(x[k : k + 1]) for x in lists}) > 1), 0)
    at = "; ".join(
        f"rank {r}: {x[first] if first < len(x) else '(end)'} ({len(x)} tests)" for r, x in enumerate(lists)
    )
    raise pytest.UsageError(
        f"the ranks of this job collected different tests; the first difference, at test "
        f"{first + 1}: {at}. Every rank must run the same command and see the same "
        "kernels (--kernels, --impl, -k, -m)."
    )


def agree_on_outcome(rep: pytest.TestReport) -> None:
    """In a multi-process job, a test that failed on any rank fails on every rank, naming the rank.

    Each rank posts one outcome per test: its call's, or its setup's where the setup did not pass
    (no call follows). Whatever a rank raised outside a check's own agreement (an error while
    placing inputs, say) then still fails the test everywhere, and ``-x`` stops every rank at
    the same test instead of leaving the others waiting for one that has left.
    """
    if not (rep.when == "call" or (rep.when == "setup" and not rep.passed)):
        return
    if not distributed.is_multi_process() or hasattr(rep, "wasxfail"):
        return
    mine = {"outcome": rep.outcome, "line": skip_reason(rep)[:500] if rep.skipped else _first_line(rep)}
    try:
        texts = distributed.exchange("outcome", json.dumps(mine))
    except Exception as e:  # a rank gave up or the store failed: say so, do not crash the session
        rep.outcome, rep.longrepr = "failed", f"could not agree on this test's outcome across ranks: {e}"
        return
    failed = [(r, json.loads(t)) for r, t in enumerate(texts) if json.loads(t)["outcome"] == "failed"]
    me = distributed.rank_and_size()[0]
    others = [(r, v["line"]) for r, v in failed if r != me]
    if others and not rep.failed:
        rank, line = others[0]
        ranks = ", ".join(str(r) for r, _ in failed)
        lines = distributed.by_message(others, len(texts))
        rep.outcome = "failed"
        rep.longrepr = f"failed on rank {rank} of {len(texts)} (ranks {ranks}): {line}"
        if len(lines) > 1:  # every other rank's own message, identical ones once
            rep.longrepr += "\n" + "\n".join(lines)
    elif others and rep.failed and any(line != mine["line"] for _, line in others):
        lines = distributed.by_message(others, len(texts))
        rep.longrepr = f"{rep.longrepr}\n--- the other failing ranks' messages ---\n" + "\n".join(lines)


def _first_line(rep: pytest.TestReport) -> str:
    if not rep.failed:
        return ""
    crash = getattr(rep.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(rep.longrepr or "")
    return text.strip().splitlines()[0][:500] if text.strip() else "(no message)"
