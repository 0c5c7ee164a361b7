"""The grid pipeline: expand, drop what is recorded, pack runs into jobs, follow them, record.

The driver never holds a result only in memory: workers write each run's record as it
finishes, failures are recorded from the notes ranks leave, and which runs went into which job
is on disk (`jobs/ledger.json`), so a driver that is killed and started again picks up where
it was without running anything twice.
"""

from __future__ import annotations

import json
import shutil
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from fsdp_bench.config import RunConfig
from fsdp_bench.grid import SweepSpec, expand
from fsdp_bench.launchers import SubmittedJob, make_launcher
from fsdp_bench.results import ResultStore, RunResult, write_atomic
from fsdp_bench.schema import to_plain
from fsdp_bench.worker import JobSpec

# A job that ends without starting its next run is retried this many times before the run is
# recorded as an error (a broken environment must not loop forever).
MAX_ATTEMPTS = 3
# After the first rank reports a failure, the others get this long to end by themselves before
# the job is cancelled (a rank that hangs never will).
FAILURE_GRACE_S = 5.0


@dataclass
class SweepOptions:
    results_dir: Path | None = None
    rerun: bool = False
    """Run again (and replace) runs that are already recorded; old records are kept aside."""
    verify: bool = False
    """Check each configuration against a single-process step before timing it."""
    poll_interval_s: float = 0.2
    progress: bool = True


@dataclass
class SweepOutcome:
    results_dir: Path
    run_ids: list[str]
    already_recorded: int
    recorded: int = 0
    statuses: Counter[str] = field(default_factory=Counter)


@dataclass
class _Watched:
    job: SubmittedJob
    runs: list[RunConfig]
    started_waiting: float = field(default_factory=time.monotonic)
    cancel_reason: str = ""


def results_dir_for(spec: SweepSpec, override: Path | None) -> Path:
    return override if override is not None else Path("results") / spec.name


def run_sweep(
    spec: SweepSpec,
    options: SweepOptions,
    on_record: Callable[[RunResult], None] | None = None,
) -> SweepOutcome:
    """Run every run of the grid that is not recorded yet; return what happened."""
    runs = expand(spec).runs
    store = ResultStore(results_dir_for(spec, options.results_dir))
    launcher = make_launcher(spec.launcher, store.jobs_dir)
    for shape in sorted({(r.world_size, r.nodes) for r in runs}):
        launcher.check(*shape)
    _save_grid(spec, store)
    ledger = Ledger(store.jobs_dir / "ledger.json")

    if options.rerun:
        _set_aside(store, [r.run_id for r in runs])
    done = store.done_ids()
    outcome = SweepOutcome(
        results_dir=store.root,
        run_ids=[r.run_id for r in runs],
        already_recorded=sum(r.run_id in done for r in runs),
    )
    by_id = {r.run_id: r for r in runs}
    watched = [
        _Watched(
            job=launcher.reattach(entry["job_id"]),
            runs=[by_id[i] for i in entry["run_ids"] if i in by_id],
        )
        for entry in ledger.open_jobs(launcher.kind)
    ]
    busy = {r.run_id for w in watched for r in w.runs}
    todo = [r for r in runs if r.run_id not in done and r.run_id not in busy]
    follower = _Follower(store, ledger, spec, options, outcome, on_record)
    follower.start_progress(len(todo) + len(busy))
    try:
        follower.drive(launcher, watched, pack_runs(todo, spec.launcher.max_runs_per_job))
    except KeyboardInterrupt:
        follower.interrupt(watched, cancel=launcher.kind == "local")
        raise
    finally:
        follower.close_progress()
    return outcome


def pack_runs(runs: list[RunConfig], max_per_job: int | None = None) -> list[list[RunConfig]]:
    """Runs of the same shape (world size, nodes) share a job, in first-appearance order."""
    by_shape: dict[tuple[int, int], list[RunConfig]] = {}
    for run in runs:
        by_shape.setdefault((run.world_size, run.nodes), []).append(run)
    size = max_per_job or len(runs) or 1
    return [same[i : i + size] for same in by_shape.values() for i in range(0, len(same), size)]


class _Follower:
    """Submits packs, watches jobs, turns what they leave on disk into records."""

    def __init__(
        self,
        store: ResultStore,
        ledger: Ledger,
        spec: SweepSpec,
        options: SweepOptions,
        outcome: SweepOutcome,
        on_record: Callable[[RunResult], None] | None,
    ) -> None:
        self.store = store
        self.ledger = ledger
        self.spec = spec
        self.options = options
        self.outcome = outcome
        self.on_record = on_record
        self.attempts: Counter[str] = Counter()
        self.seen: set[str] = set()
        self.progress: Any = None

    def drive(self, launcher: Any, watched: list[_Watched], packs: list[list[RunConfig]]) -> None:
        while watched or packs:
            while packs and len(watched) < launcher.max_jobs_in_flight:
                runs = packs.pop(0)
                for run in runs:  # notes of an interrupted earlier attempt must not count
                    shutil.rmtree(self.store.inflight(run.run_id), ignore_errors=True)
                job = launcher.submit(self._job_spec(runs))
                self.ledger.add(job.job_id, launcher.kind, [r.run_id for r in runs])
                watched.append(_Watched(job=job, runs=runs))
            time.sleep(self.options.poll_interval_s)
            for item in list(watched):
                self._collect(item.runs)
                self._watchdog(item)
                if not item.job.alive():
                    watched.remove(item)
                    packs[:0] = self._reconcile(item)
                    self.ledger.close(item.job.job_id)

    def _job_spec(self, runs: list[RunConfig]) -> JobSpec:
        launcher = self.spec.launcher
        return JobSpec(
            runs=tuple(runs),
            results_dir=str(self.store.root.resolve()),
            device=launcher.device,
            cpu_threads_per_rank=launcher.cpu_threads_per_rank,
            collective_timeout_s=launcher.collective_timeout_s,
            verify=self.options.verify,
        )

    def _collect(self, runs: list[RunConfig]) -> None:
        """Report records that workers have written since the last look."""
        for run in runs:
            if run.run_id not in self.seen and self.store.has(run.run_id):
                self._announce(self.store.get(run.run_id))

    def _announce(self, result: RunResult | None) -> None:
        if result is None or result.run_id in self.seen:
            return
        self.seen.add(result.run_id)
        self.outcome.recorded += 1
        self.outcome.statuses[result.status] += 1
        if self.progress is not None:
            self.progress.update(1)
            self.progress.set_postfix_str(_postfix(self.outcome.statuses, result), refresh=True)
        if self.on_record is not None:
            self.on_record(result)

    def _watchdog(self, item: _Watched) -> None:
        """Cancel a job whose run overran its time, or whose ranks failed but did not all end."""
        if item.cancel_reason:
            return
        for run in item.runs:
            inflight = self.store.inflight(run.run_id)
            started = inflight / "started.json"
            if not started.exists() or self.store.has(run.run_id):
                continue
            now = time.time()
            limit = self.spec.launcher.run_timeout_s
            if now - started.stat().st_mtime > limit:
                item.cancel_reason = f"run exceeded launcher.run_timeout_s ({limit:g} s)"
            notes = list(inflight.glob("rank*.json"))
            if notes and now - max(n.stat().st_mtime for n in notes) > FAILURE_GRACE_S:
                item.cancel_reason = "ranks that did not fail were stuck after a rank failed"
            if item.cancel_reason:
                item.job.cancel()

    def _reconcile(self, item: _Watched) -> list[list[RunConfig]]:
        """After a job ended: record its failed run, and return what must run again."""
        self._collect(item.runs)
        progressed = any(self.store.has(r.run_id) for r in item.runs)
        remaining = []
        for run in item.runs:
            if self.store.has(run.run_id):
                continue
            inflight = self.store.inflight(run.run_id)
            if inflight.exists():
                status, reason = classify_failure(_read_notes(inflight), item.cancel_reason)
                self._record_failure(run, status, reason, item.job)
                shutil.rmtree(inflight, ignore_errors=True)
                progressed = True
            else:
                remaining.append(run)
        if not progressed:  # the job died before its first run: count it against the runs
            for run in remaining:
                self.attempts[run.run_id] += 1
            if remaining and self.attempts[remaining[0].run_id] >= MAX_ATTEMPTS:
                reason = (
                    f"{MAX_ATTEMPTS} jobs in a row ended before this run started "
                    f"(last job {item.job.job_id}); log tail:\n{item.job.log_tail(0)}"
                )
                for run in remaining:
                    self._record_failure(run, "error", reason, item.job)
                remaining = []
        return pack_runs(remaining, self.spec.launcher.max_runs_per_job)

    def _record_failure(self, run: RunConfig, status: str, reason: str, job: SubmittedJob) -> None:
        if "without a report" in reason:
            reason += "\n" + "\n".join(
                f"rank {r} log tail:\n{job.log_tail(r, 8)}" for r in range(run.world_size)
            )
        result = RunResult(
            run_id=run.run_id,
            status=status,  # type: ignore[arg-type]
            config=to_plain(run),
            reason=reason,
            provenance={"job_id": job.job_id, "finished_at": _now()},
        )
        self.store.record(result)
        self._announce(result)

    def interrupt(self, watched: list[_Watched], cancel: bool) -> None:
        for item in watched:
            if cancel:
                item.job.cancel()
                self.ledger.close(item.job.job_id)

    def start_progress(self, total: int) -> None:
        if self.options.progress and total:
            from tqdm import tqdm

            self.progress = tqdm(total=total, unit="run", desc=self.spec.name, dynamic_ncols=True)

    def close_progress(self) -> None:
        if self.progress is not None:
            self.progress.close()


def classify_failure(notes: list[dict[str, Any]], cancel_reason: str) -> tuple[str, str]:
    """The run's status from what its ranks reported; the root cause wins over its echoes.

    A rank's OOM or error makes its peers fail too (timeouts, closed connections): those
    echoes are not the cause, so oom > error > timeout > everything else.
    """
    for wanted in ("oom", "error", "timeout"):
        for note in sorted(notes, key=lambda n: n["rank"]):
            if note["class"] == wanted:
                return wanted, f"rank {note['rank']} ({note['hostname']}): {note['message']}"
    if cancel_reason:
        return "timeout", cancel_reason
    seen = ", ".join(f"rank {n['rank']}: {n['class']}" for n in notes) or "no rank reported"
    return "error", f"a rank ended without a report ({seen})"


def _read_notes(inflight: Path) -> list[dict[str, Any]]:
    notes = []
    for path in inflight.glob("rank*.json"):
        try:
            notes.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return notes


def _set_aside(store: ResultStore, run_ids: list[str]) -> None:
    """--rerun: move existing records to replaced/ (kept, not deleted) so the runs go again."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
    for run_id in run_ids:
        path = store.runs_dir / f"{run_id}.json"
        if path.exists():
            target = store.root / "replaced" / f"{run_id}.{stamp}.json"
            target.parent.mkdir(parents=True, exist_ok=True)
            path.replace(target)


def _save_grid(spec: SweepSpec, store: ResultStore) -> None:
    source = Path(spec.source)
    if source.is_file():
        write_atomic(store.root / "grid.yaml", source.read_text())


def _postfix(statuses: Counter[str], last: RunResult) -> str:
    counts = " ".join(f"{k}={v}" for k, v in sorted(statuses.items()))
    if last.status == "ok" and last.tokens_per_s:
        return f"{counts} | last {last.tokens_per_s:,.0f} tok/s"
    return f"{counts} | last {last.status}"


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class Ledger:
    """Which runs went into which job, on disk, so a restarted driver can find its jobs."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.entries: list[dict[str, Any]] = json.loads(path.read_text()) if path.exists() else []

    def add(self, job_id: str, kind: str, run_ids: list[str]) -> None:
        self.entries.append(
            {
                "job_id": job_id,
                "launcher": kind,
                "run_ids": run_ids,
                "submitted_at": _now(),
                "open": True,
            }
        )
        self._save()

    def close(self, job_id: str) -> None:
        for entry in self.entries:
            if entry["job_id"] == job_id:
                entry["open"] = False
        self._save()

    def open_jobs(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.entries if e["open"] and e["launcher"] == kind]

    def _save(self) -> None:
        write_atomic(self.path, json.dumps(self.entries, indent=1))
