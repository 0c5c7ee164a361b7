"""How a rank fails: what kind of failure an exception is, and the note it leaves for the driver.

A failing rank writes a note (rank, class, message, traceback) into the run's in-flight folder
and ends its process: the rest of the job cannot trust a process group with a collective left
half done, and a fresh process is the only clean slate after an OOM. The driver turns the
notes into the run's record (`launch/driver.py`).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import torch

from fsdp_bench.config.run import RunConfig
from fsdp_bench.job.failure_words import classify_text
from fsdp_bench.job.rendezvous import RankInfo, hostname
from fsdp_bench.store import now_iso, write_atomic


class Terminated(BaseException):
    """The scheduler is ending the job (scancel, requeue, time limit): stop at once."""


def classify(err: BaseException) -> str:
    """oom, timeout, error; or peer / interrupted, which only echo another rank's failure."""
    if isinstance(err, (KeyboardInterrupt, SystemExit, Terminated)):
        return "interrupted"  # the driver or the scheduler stopped the job
    if isinstance(err, torch.OutOfMemoryError):
        return "oom"
    return classify_text(f"{type(err).__name__}: {err}")


def note_failure(inflight: Path, info: RankInfo, err: BaseException, **extra: object) -> None:
    """Write this rank's note for the run whose in-flight folder is `inflight`."""
    note = {
        "rank": info.rank,
        "attempt": info.attempt,
        "hostname": hostname(),
        "class": classify(err),
        "type": type(err).__name__,
        "message": compiler_named(err) + _tail(traceback.format_exception_only(type(err), err)),
        "traceback": _tail(traceback.format_exception(type(err), err, err.__traceback__), 40),
        "at": now_iso(),
        **extra,
    }
    write_atomic(inflight / f"rank{info.rank}.json", json.dumps(note))


_COMPILER_PARTS = ("_dynamo", "_functorch", "_inductor")
"""torch.compile's parts: dynamo's tracing, AOTAutograd, the inductor backend."""


def compiler_named(err: BaseException) -> str:
    """A prefix saying that torch.compile failed (e.g. no working C++ compiler on the host,
    or AOTAutograd refusing what a compiled checkpoint of DTensor code saves), not the
    configuration's own training: the error's type is of torch.compile, or it was raised
    there (a plain AssertionError in AOTAutograd)."""
    module = type(err).__module__
    frames = traceback.extract_tb(err.__traceback__)
    raised_in = frames[-1].filename if frames else ""
    compiler = any(
        module.startswith(f"torch.{part}") or f"{os.sep}torch{os.sep}{part}{os.sep}" in raised_in
        for part in _COMPILER_PARTS
    )
    return "torch.compile failed: " if compiler else ""


def fail(inflight: Path, info: RankInfo, err: BaseException, **extra: object) -> NoReturn:
    """Leave a note for the driver and end this process (see the module docstring)."""
    try:
        note_failure(inflight, info, err, **extra)
    finally:
        traceback.print_exception(type(err), err, err.__traceback__)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def mark_started(inflight: Path, info: RankInfo) -> None:
    marker = {"job_id": info.job_id, "attempt": info.attempt, "started_at": now_iso()}
    write_atomic(inflight / "started.json", json.dumps(marker))


def _tail(lines: list[str], keep: int = 5) -> str:
    return "".join(lines[-keep:]).strip()[-2000:]


SLOWED = 20
"""How many times as long a step of a `slow_pass` run's first pass takes."""


def slowed(
    run: RunConfig, rank: int, step: Callable[[], None], first_pass: bool
) -> Callable[[], None]:
    """The step, or for `fault.kind: slow_pass` in a first pass on its rank the step followed
    by a sleep of SLOWED - 1 times its duration."""
    if run.fault.kind != "slow_pass" or rank != run.fault.rank or not first_pass:
        return step

    def slow_step() -> None:
        start = time.perf_counter()
        step()
        time.sleep((SLOWED - 1) * (time.perf_counter() - start))

    return slow_step


def inject_fault(run: RunConfig, rank: int, device: torch.device) -> None:
    """The grid's `fault` section: a real failure of the asked kind on one rank, to test
    that each becomes the right record."""
    if run.fault.kind in ("none", "slow_pass") or rank != run.fault.rank:
        return
    match run.fault.kind:
        case "oom":  # a real allocation failure: 256 TiB
            torch.empty(1 << 48, dtype=torch.uint8, device=device)
        case "error":
            raise RuntimeError(f"injected fault on rank {rank}")
        case "hang":
            while True:
                time.sleep(3600)
        case "exit":
            os._exit(17)
        case "interrupt":
            signal.raise_signal(signal.SIGINT)
            time.sleep(60)  # the handler raises KeyboardInterrupt in this thread meanwhile
        case other:
            raise ValueError(f"fault.kind {other!r}")


def handle_scheduler_signals() -> None:
    """What a rank does on the scheduler's signals (set once per job).

    submitit ignores SIGTERM in jobs; here it means the allocation is going away, and the run
    must not go on for the scheduler's kill delay, measuring nothing useful: it raises
    `Terminated`. submitit turns its early warning (USR2, 90 s before the time limit or at
    preemption) into an exception unless the job checkpoints; jobs here are requeued whole by
    Slurm and the scheduler's final state (TIMEOUT, PREEMPTED) classifies the run, so the rank
    says so and keeps working."""

    def terminate(signum: int, frame: object) -> None:
        raise Terminated(f"the job was stopped by the scheduler ({signal.Signals(signum).name})")

    def warn(signum: int, frame: object) -> None:
        print("fsdp-bench: the scheduler warns that this job ends soon (USR2)", flush=True)

    signal.signal(signal.SIGTERM, terminate)
    signal.signal(signal.SIGUSR2, warn)
