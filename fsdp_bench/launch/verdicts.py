"""What a run that did not finish was: its status and reason, from the notes its ranks left,
the scheduler's final state and, when no rank said why, the ranks' logs.

The root cause wins over its echoes: a rank's OOM or error makes its peers fail too (timeouts,
closed connections), so oom > error > timeout among the notes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

from fsdp_bench.config.run import RunConfig
from fsdp_bench.config.schema import to_plain
from fsdp_bench.job.failure_words import classify_text
from fsdp_bench.store import EstimatedPeaks, RunResult, now_iso

# Scheduler end states that explain a run's end better than its ranks' last words.
SCHEDULER_VERDICTS: dict[str, tuple[str, str]] = {
    "TIMEOUT": ("timeout", "Slurm TIMEOUT: the job reached its time limit (launcher.timeout_min)"),
    "CANCELLED": ("cancelled", "the job was cancelled (scancel) while this run was executing"),
    "OUT_OF_MEMORY": ("oom", "the node ran out of host memory (Slurm OUT_OF_MEMORY)"),
    "NODE_FAIL": ("node_fail", "a node of the job failed (Slurm NODE_FAIL)"),
    "PREEMPTED": ("preempted", "the job was preempted (Slurm PREEMPTED)"),
    "BOOT_FAIL": ("error", "a node failed to boot (Slurm BOOT_FAIL)"),
    "DEADLINE": ("timeout", "the job reached its deadline (Slurm DEADLINE)"),
}
REQUEUED_STATUSES = ("preempted", "node_fail")


class Verdict(NamedTuple):
    """A failed run's status and reason."""

    status: str
    reason: str
    unexplained: bool = False
    """No rank said why: the reason is only what was seen, and the logs should be added."""


def classify_failure(notes: list[dict[str, Any]], cancel_reason: str, state: str) -> Verdict:
    """The run's status and reason; the root cause wins over its echoes. `interrupted`: a
    signal reached the ranks, not the driver (a Ctrl-C the terminal gave the ranks alone):
    the user's interruption, not a property of the run, which is never recorded so.

    A rank's OOM or error makes its peers fail too (timeouts, closed connections): those are
    not the cause, so oom > error > timeout among the notes. When the driver stopped the job,
    the notes explain why; otherwise a scheduler verdict (time limit, scancel, host OOM, node
    failure, preemption) explains the notes.
    """
    by_rank = sorted(notes, key=lambda n: n["rank"])

    def root_cause() -> Verdict | None:
        for wanted in ("oom", "error", "timeout"):
            for note in by_rank:
                if note["class"] == wanted:
                    where = f"rank {note['rank']} ({note['hostname']})"
                    return Verdict(wanted, f"{where}: {note['message']}")
        return None

    if cancel_reason:
        return root_cause() or Verdict("timeout", cancel_reason)
    if state in SCHEDULER_VERDICTS:
        return Verdict(*SCHEDULER_VERDICTS[state])
    cause = root_cause()
    if cause:
        return cause
    interrupted = [f"rank {n['rank']} ({n['hostname']})" for n in by_rank
                   if n["class"] == "interrupted"]  # fmt: skip
    if interrupted:
        return Verdict("interrupted", f"a signal interrupted {', '.join(interrupted)}")
    seen = ", ".join(f"rank {n['rank']}: {n['class']}" for n in by_rank) or "no rank reported"
    reason = f"a rank ended without a report ({seen}; job state {state})"
    return Verdict("error", reason, unexplained=True)


def explain_from_logs(verdict: Verdict, tails: list[str]) -> Verdict:
    """A silent failure read from the ranks' logs: a line such as NCCL's "Watchdog caught
    collective operation timeout" (the process aborted from NCCL's thread, no note written)
    or a CUDA out-of-memory makes the run `timeout` or `oom`; the tails are kept either way."""
    found = [
        (rank, line.strip())
        for rank, tail in enumerate(tails)
        for line in tail.splitlines()
        if classify_text(line) in ("timeout", "oom")
    ]
    logs = "\n".join(f"rank {rank} log tail:\n{tail}" for rank, tail in enumerate(tails))
    if not found:
        return verdict._replace(reason=f"{verdict.reason}\n{logs}")
    rank, line = found[0]
    return Verdict(classify_text(line), f"rank {rank} (from its log): {line}\n{logs}")


def read_notes(inflight: Path) -> list[dict[str, Any]]:
    """The ranks' failure notes of the run's latest attempt (a requeued job starts over)."""
    try:
        attempt = json.loads((inflight / "started.json").read_text())["attempt"]
    except (OSError, ValueError, KeyError):
        attempt = None
    notes = []
    for path in inflight.glob("rank*.json"):
        try:
            note = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if attempt is None or note.get("attempt") == attempt:
            notes.append(note)
    return notes


def unmeasured_record(
    run: RunConfig,
    status: str,
    reason: str,
    provenance: dict[str, Any],
    peaks: EstimatedPeaks | None = None,
) -> RunResult:
    """The record of a run that ended without its ranks writing one (a failure, or a run
    not launched), stamped with when it was written."""
    return RunResult(
        run_id=run.run_id,
        status=status,  # type: ignore[arg-type]
        config=to_plain(run),
        reason=reason,
        **(peaks or EstimatedPeaks())._asdict(),
        provenance={**provenance, "finished_at": now_iso()},
    )
