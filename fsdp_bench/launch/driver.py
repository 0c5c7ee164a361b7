"""Follow jobs to the end: keep the launcher's slots full, collect records as they land, and
turn whatever a job left behind (rank notes, the scheduler's final state) into records.

Failure policy, by class:
- oom, error, timeout (collective hang, run or Slurm time limit), cancelled: recorded, never
  retried; the job's other runs go on in a new job.
- preempted, node_fail: the run goes back to the queue, up to launcher.requeue_limit times.
- a job that ends before its first run (broken environment): retried, then recorded `error`.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsdp_bench.config.grid import SweepSpec
from fsdp_bench.config.run import RunConfig
from fsdp_bench.job.spec import JobSpec
from fsdp_bench.launch.base import ALIVE_STATES, Launcher, SubmittedJob
from fsdp_bench.launch.ledger import Ledger
from fsdp_bench.launch.packing import job_shape, pack_runs
from fsdp_bench.launch.stability import REMEASURES, disagreement, folder_noise
from fsdp_bench.launch.verdicts import (
    REQUEUED_STATUSES,
    Verdict,
    classify_failure,
    explain_from_logs,
    read_notes,
    unmeasured_record,
)
from fsdp_bench.memory.model_check import run_flops
from fsdp_bench.store import EstimatedPeaks, ResultStore, RunResult

# A job that ends without starting its next run is retried this many times before the run is
# recorded as an error (a broken environment must not loop forever).
MAX_ATTEMPTS = 3
# After the first rank reports a failure, the others get this long to end by themselves before
# the job is cancelled (a rank that hangs never will).
FAILURE_GRACE_S = 5.0
# sacct may not know a job for a few seconds after squeue forgot it.
UNKNOWN_GRACE_S = 60.0


@dataclass
class Watched:
    job: SubmittedJob
    runs: list[RunConfig]
    cancel_reason: str = ""
    unknown_since: float | None = None


@dataclass
class Progress:
    """What the driver has seen, for the caller's summary."""

    recorded: int = 0
    statuses: Counter[str] = field(default_factory=Counter)


class Driver:
    """Submits packs of runs, polls the jobs, turns what they leave on disk into records."""

    def __init__(
        self,
        store: ResultStore,
        ledger: Ledger,
        spec: SweepSpec,
        verify: bool,
        on_record: Callable[[RunResult], None] | None = None,
        estimates: dict[str, EstimatedPeaks] | None = None,
    ) -> None:
        self.store = store
        self.ledger = ledger
        self.spec = spec
        self.verify = verify
        self.estimates = estimates or {}
        self.on_record = on_record
        self.progress = Progress()
        self.attempts: Counter[str] = Counter()
        self.interruptions: Counter[str] = Counter()
        self.seen: set[str] = set()
        self.packs: list[list[RunConfig]] = []
        """Packs not submitted yet (while `run` follows its jobs)."""
        self.noise_runs: list[RunResult] | None = None
        """The folder's records whose passes inform the between-pass noise (read once)."""
        self.disagreements: dict[str, list[str]] = {}

    def run(
        self,
        launcher: Launcher,
        watched: list[Watched],
        packs: list[list[RunConfig]],
        supply: Callable[[int], list[list[RunConfig]] | None] | None = None,
    ) -> None:
        """Until every pack has run: fill free slots, poll, reconcile jobs that ended.

        `supply(free_slots)` hands out more packs as slots free up (a search asks its sampler
        then), [] for none yet, None once it never will again. On Ctrl-C, local jobs are
        cancelled (they would go on timing on this machine); cluster jobs go on, and the same
        command collects them later."""
        try:
            self._follow(launcher, watched, packs, supply)
        except KeyboardInterrupt:
            if launcher.kind == "local":
                _stop_local_jobs([item.job for item in watched])
                for item in watched:
                    self.ledger.close(item.job.job_id)
            raise

    def wait_for(
        self, launcher: Launcher, watched: list[Watched], say: Callable[[str], None] = print
    ) -> None:
        """Wait until the jobs an earlier driver left running end (a driver killed with kill -9
        leaves its local job timing), stopping a run that overruns as `run` would. Called
        before this driver checks models, estimates or submits anything: on one machine any of
        those beside a timed run slows it. `run` collects and records the jobs afterwards."""
        states = launcher.poll([w.job for w in watched])
        alive = [w for w in watched if states.get(w.job.job_id) in ALIVE_STATES]
        if alive:
            ids = ", ".join(w.job.job_id for w in alive)
            say(
                f"fsdp-bench: waiting for job {ids}, which an earlier driver started and which "
                "is still timing runs on this machine"
            )
        while alive:
            time.sleep(self.spec.launcher.poll_s)
            states = launcher.poll([w.job for w in alive])
            for item in alive:
                if states.get(item.job.job_id) == "RUNNING":
                    self._watchdog(item)
            alive = [w for w in alive if states.get(w.job.job_id) in ALIVE_STATES]

    def _follow(
        self,
        launcher: Launcher,
        watched: list[Watched],
        packs: list[list[RunConfig]],
        supply: Callable[[int], list[list[RunConfig]] | None] | None,
    ) -> None:
        poll_s = self.spec.launcher.poll_s
        self.packs = packs  # the same lists, changed in place: what `withdraw` looks at
        exhausted = supply is None
        while watched or packs or not exhausted:
            free = launcher.max_jobs_in_flight - len(watched) - len(packs)
            if not exhausted and free > 0:
                more = supply(free)  # type: ignore[misc]
                exhausted = more is None
                packs += more or []
                if not (watched or packs):
                    continue
            self.fill(launcher, watched, packs)
            time.sleep(poll_s)
            states = launcher.poll([w.job for w in watched])
            for item in list(watched):
                self._collect(item.runs)
                state = states.get(item.job.job_id, "UNKNOWN")
                if state in ALIVE_STATES:
                    if state == "RUNNING":
                        self._watchdog(item)
                    continue
                finished = all(self.store.has(r.run_id) for r in item.runs)
                if state == "UNKNOWN" and not finished and not self._waited_enough(item):
                    continue
                watched.remove(item)
                packs[:0] = self._reconcile(item, state)
                self.ledger.close(item.job.job_id)

    def fill(
        self, launcher: Launcher, watched: list[Watched], packs: list[list[RunConfig]]
    ) -> None:
        """Submit as many packs as there are free slots; same-shape packs as one array."""
        while packs and len(watched) < launcher.max_jobs_in_flight:
            free = launcher.max_jobs_in_flight - len(watched)
            batch = [packs.pop(0)]
            shape = job_shape(batch[0])
            while packs and len(batch) < min(free, launcher.max_array_size):
                if job_shape(packs[0]) != shape:
                    break
                batch.append(packs.pop(0))
            for runs in batch:  # notes of an interrupted earlier attempt must not count
                for run in runs:
                    shutil.rmtree(self.store.inflight(run.run_id), ignore_errors=True)
            jobs = launcher.submit([self._job_spec(runs) for runs in batch])
            pairs = list(zip(jobs, batch, strict=True))
            self.ledger.add(
                launcher.kind, [(job.job_id, [r.run_id for r in runs]) for job, runs in pairs]
            )
            watched += [Watched(job=job, runs=runs) for job, runs in pairs]

    def _job_spec(self, runs: list[RunConfig]) -> JobSpec:
        launcher = self.spec.launcher
        return JobSpec(
            runs=tuple(runs),
            results_dir=str(self.store.root.resolve()),
            device=launcher.job_device,
            cpu_threads_per_rank=launcher.cpu_threads_per_rank,
            collective_timeout_s=launcher.collective_timeout_s,
            verify=self.verify,
            estimates={
                r.run_id: self.estimates[r.run_id] for r in runs if r.run_id in self.estimates
            },
            flops=run_flops(runs),  # checked before launch: from the check's memo
        )

    def _waited_enough(self, item: Watched) -> bool:
        now = time.monotonic()
        if item.unknown_since is None:
            item.unknown_since = now
        return now - item.unknown_since > UNKNOWN_GRACE_S

    def _collect(self, runs: list[RunConfig]) -> None:
        """Report records that workers have written since the last look."""
        for run in runs:
            if run.run_id not in self.seen and self.store.has(run.run_id):
                self.announce(self.store.get(run.run_id))

    def announce(self, result: RunResult | None) -> None:
        if result is None or result.run_id in self.seen:
            return
        result = self._stable(result)
        if result is None:  # set aside: the run is measured again when its job has ended
            return
        self.seen.add(result.run_id)
        self.progress.recorded += 1
        self.progress.statuses[result.status] += 1
        if self.on_record is not None:
            self.on_record(result)

    def _stable(self, result: RunResult) -> RunResult | None:
        """The record as it stands, or, when its passes disagree beyond the folder's noise
        (`stability`), None the first time (set aside: measured again) and then the same
        record made `unstable`, naming both measurements."""
        if self.noise_runs is None:
            self.noise_runs = [r for r in self.store.results() if r.run_id != result.run_id]
        reason = disagreement(result, folder_noise(self.noise_runs))
        if not reason:
            self.noise_runs.append(result)
            return result
        earlier = self.disagreements.setdefault(result.run_id, [])
        earlier.append(reason)
        if len(earlier) <= REMEASURES:
            self.store.set_aside(result.run_id)
            return None
        said = "; measured again: ".join(earlier)
        unstable = dataclasses.replace(result, status="unstable", reason=said)
        self.store.record(unstable)
        return unstable

    def _watchdog(self, item: Watched) -> None:
        """Cancel a job whose run overran its time, or whose ranks failed but did not all end."""
        if item.cancel_reason:
            return
        for run in item.runs:
            inflight = self.store.inflight(run.run_id)
            running_s = age_s(inflight / "started.json")
            if running_s is None or self.store.has(run.run_id):
                continue
            limit = self.spec.launcher.run_timeout_s
            if running_s > limit:
                item.cancel_reason = f"run exceeded launcher.run_timeout_s ({limit:g} s)"
            failed = [n for n in read_notes(inflight) if n["class"] in ("oom", "error", "timeout")]
            ages = [age_s(inflight / f"rank{n['rank']}.json") for n in failed]
            known = [age for age in ages if age is not None]
            if known and min(known) > FAILURE_GRACE_S:
                item.cancel_reason = "ranks that did not fail were stuck after a rank failed"
            if item.cancel_reason:
                item.job.cancel()
                return

    def _reconcile(self, item: Watched, state: str) -> list[list[RunConfig]]:
        """After a job ended: record its failed run, and return what must run again."""
        self._collect(item.runs)
        progressed = any(self.store.has(r.run_id) for r in item.runs)
        remaining = []
        for run in item.runs:
            if self.store.has(run.run_id):
                continue
            inflight = self.store.inflight(run.run_id)
            if not inflight.exists():
                remaining.append(run)
                continue
            progressed = True
            verdict = classify_failure(read_notes(inflight), item.cancel_reason, state)
            limit = self.spec.launcher.requeue_limit
            if verdict.status == "interrupted":
                shutil.rmtree(inflight, ignore_errors=True)
                raise RanksInterrupted(f"run {run.run_id}: {verdict.reason}")
            if verdict.status in REQUEUED_STATUSES and self.interruptions[run.run_id] < limit:
                self.interruptions[run.run_id] += 1
                remaining.append(run)
            else:
                self._record_failure(run, verdict, item.job, state)
            shutil.rmtree(inflight, ignore_errors=True)
        if not progressed:  # the job died before its first run: count it against the runs
            for run in remaining:
                self.attempts[run.run_id] += 1
            if remaining and self.attempts[remaining[0].run_id] >= MAX_ATTEMPTS:
                reason = (
                    f"{MAX_ATTEMPTS} jobs in a row ended before this run started "
                    f"(last job {item.job.job_id}, {state}); log tail:\n{item.job.log_tail(0)}"
                )
                for run in remaining:
                    self._record_failure(run, Verdict("error", reason), item.job, state)
                remaining = []
        return pack_runs(remaining, self.spec.launcher)

    def _record_failure(
        self, run: RunConfig, verdict: Verdict, job: SubmittedJob, state: str
    ) -> None:
        if verdict.unexplained:  # the logs are all there is to go on
            tails = [job.log_tail(rank, 8) for rank in range(run.world_size)]
            verdict = explain_from_logs(verdict, tails)
        self.record_unlaunched(
            run, verdict.status, verdict.reason, {"job_id": job.job_id, "job_state": state}
        )

    def withdraw(self, run: RunConfig, status: str, reason: str) -> None:
        """Take back a run decided against after it was packed (its estimate, corrected by
        runs measured since, no longer fits): dropped from its pack before the pack is
        submitted, or skipped by its job's worker if the run has not started (the record is
        written then, `ResultStore.request_skip`); a run started or recorded goes on."""
        if self.store.has(run.run_id):
            return
        for pack in self.packs:
            if run in pack:
                pack.remove(run)
                self.packs[:] = [p for p in self.packs if p]
                self.record_unlaunched(run, status, reason, {})
                return
        if not (self.store.inflight(run.run_id) / "started.json").exists():
            peaks = self.estimates.get(run.run_id)
            self.store.request_skip(unmeasured_record(run, status, reason, {}, peaks))

    def record_unlaunched(
        self, run: RunConfig, status: str, reason: str, provenance: dict[str, Any]
    ) -> None:
        """A record the driver writes itself: a failure, or a run it did not launch."""
        result = unmeasured_record(run, status, reason, provenance, self.estimates.get(run.run_id))
        self.store.record(result)
        self.announce(result)


def _stop_local_jobs(jobs: list[SubmittedJob], grace_s: float = 5.0) -> None:
    """After a Ctrl-C: a terminal's reached the local jobs' controllers too, and each is
    killing its ranks; a second SIGINT then would interrupt that and print its traceback.
    Jobs still alive after `grace_s` (the Ctrl-C was this process's alone) are cancelled."""
    deadline = time.monotonic() + grace_s
    alive = [job for job in jobs if _alive(job)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [job for job in alive if _alive(job)]
    for job in alive:
        job.cancel()


def _alive(job: SubmittedJob) -> bool:
    check = getattr(job, "alive", None)
    return bool(check()) if check is not None else False


class RanksInterrupted(KeyboardInterrupt):
    """A signal stopped a job's ranks but not this process (a Ctrl-C the terminal gave the
    ranks alone, a kill -INT of them): the user's Ctrl-C all the same. The run in flight is not
    recorded, so the same command measures it again, and the command ends as interrupted."""


def age_s(path: Path) -> float | None:
    """Seconds since `path` was written; None when it is not there (a worker removes a run's
    in-flight folder when the run is recorded, and between its passes)."""
    try:
        return time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return None
