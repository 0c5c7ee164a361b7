"""What else the machine was doing around a run: load average, the CPU that processes outside
the run used, and other processes on the run's GPUs.

A run timed while something else competes for the cores or the GPU measures the competition
(a driver killed with kill -9 left its job timing while the rerun's estimator ran beside it:
1,900-3,800 tokens/s against 9,000-10,000 quiet). Each run is sampled twice, before it builds
its model and after its timed steps, in a short window in which its ranks sleep, so whatever
is busy then is someone else; the two readings also give what others used over the whole run
(its timed steps included), at no cost. The record says what was seen and marks the run
`contended`.

Reads /proc (Linux) and, on CUDA, NVML when `pynvml` is importable; torch only inside
`run_pids` (the one collective), so the arithmetic is tested without it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WINDOW_S = 0.1
"""How long each sample watches the CPU. At the kernel's 100 ticks per second this is 10
ticks per core, a resolution of 10% of one core (5% of a 2-core machine), for 0.2 s per run
(two samples); the reading over the whole run is the finer one."""

CONTENDED_CPU_PCT = 10.0
"""Other processes using more than this percentage of the machine's CPU, in either window or
over the run, mark a run contended. An idle machine (the driver polling, shells, daemons)
measures 0-3% here; one busy process on one core of a 2-core machine is 50%, and on a 16-core
one 6%, so 10% is clear of the noise and catches a competitor that takes a core or more of a
small machine, or several of a large one."""

WINDOW_CONTENDED_PCT = 25.0
"""The same for a single 0.1 s window, which counts few ticks (on 2 cores 20, 5% each): the
driver's polling alone read 14% in one window of a quiet CI run. Over the run the finer
CONTENDED_CPU_PCT applies."""

_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)
"""user, nice, system, irq, softirq, steal in /proc/stat (guest time is inside user). Steal is
time a hypervisor gave to another machine: competition too."""


@dataclass(frozen=True)
class LoadSample:
    """One rank's look at its host and its GPU; None where it could not tell."""

    when: str = "start"
    """"start" (before the model is built) or "end" (after the timed steps)."""
    load_per_core: float | None = None
    """The 1-minute load average over the host's cores (our ranks included)."""
    other_cpu_pct: float | None = None
    """Percent of the host's CPU that processes outside the run used during the window."""
    gpu_other_processes: int | None = None
    """Processes other than the run's on this rank's GPU (CUDA with NVML only)."""
    ticks: tuple[int, int, int] | None = None
    """The (busy, total, ours) reading nearest the run: after a start window, before an end
    window (local rank 0 only); a start and its end give `over_run_pct`."""


def machine_ticks(stat_text: str) -> tuple[int, int]:
    """(busy, total) clock ticks of all cores together, from /proc/stat's first line."""
    for line in stat_text.splitlines():
        if line.startswith("cpu "):
            values = [int(v) for v in line.split()[1:]]
            # guest and guest_nice (8, 9) are already counted in user and nice
            total = sum(values[:8])
            return sum(values[i] for i in _BUSY_FIELDS if i < len(values)), total
    raise ValueError("no aggregate 'cpu' line in /proc/stat")


def process_ticks(stat_line: str) -> int:
    """utime + stime (all threads) from a /proc/<pid>/stat line. The command name may hold
    spaces and parentheses, so fields are counted after its last ')'."""
    fields = stat_line[stat_line.rindex(")") + 2 :].split()
    return int(fields[11]) + int(fields[12])  # fields 14 and 15 of proc(5)


def other_cpu_pct(before: tuple[int, int, int], after: tuple[int, int, int]) -> float | None:
    """Percent of the machine used outside the run between two (busy, total, ours) readings."""
    busy = after[0] - before[0]
    total = after[1] - before[1]
    ours = after[2] - before[2]
    if total <= 0:
        return None
    return max(0.0, 100.0 * (busy - ours) / total)


def _read(pids: Iterable[int], proc: Path) -> tuple[int, int, int]:
    busy, total = machine_ticks((proc / "stat").read_text())
    ours = 0
    for pid in pids:
        try:
            ours += process_ticks((proc / str(pid) / "stat").read_text())
        except (OSError, ValueError, IndexError):
            continue  # a rank that ended; its ticks no longer count anywhere
    return busy, total, ours


def run_pids(world_size: int) -> frozenset[int]:
    """The pids of this job's ranks on this host (a collective: every rank calls it once)."""
    import socket

    import torch.distributed as dist

    found: list[tuple[str, int] | None] = [None] * world_size
    dist.all_gather_object(found, (socket.gethostname(), os.getpid()))
    here = socket.gethostname()
    return frozenset(pid for host, pid in filter(None, found) if host == here)


def sample(
    when: str,
    local_rank: int,
    run_pids: frozenset[int],
    gpu_uuid: str | None,
    window_s: float = WINDOW_S,
    proc: Path = Path("/proc"),
) -> LoadSample:
    """Every rank sleeps `window_s` (so the run is quiet); local rank 0 measures its host's
    CPU meanwhile, and each rank on a GPU counts the other processes on it."""
    if local_rank != 0:
        time.sleep(window_s)
        return LoadSample(when, gpu_other_processes=gpu_processes(gpu_uuid, run_pids))
    try:
        before = _read(run_pids, proc)
        time.sleep(window_s)
        after = _read(run_pids, proc)
        load = os.getloadavg()[0] / (os.cpu_count() or 1)
    except (OSError, ValueError):  # no /proc (not Linux)
        time.sleep(window_s)
        return LoadSample(when, gpu_other_processes=gpu_processes(gpu_uuid, run_pids))
    other = other_cpu_pct(before, after)
    nearest = after if when == "start" else before
    return LoadSample(when, load, other, gpu_processes(gpu_uuid, run_pids), nearest)


def over_run_pct(samples: list[LoadSample]) -> float | None:
    """The most that processes outside the run used between a start reading and its end
    reading (one pair per host and pass, in order), in percent of the host's CPU."""
    starts = [s.ticks for s in samples if s.when == "start" and s.ticks is not None]
    ends = [s.ticks for s in samples if s.when == "end" and s.ticks is not None]
    found = [other_cpu_pct(a, b) for a, b in zip(starts, ends, strict=False)]
    known = [f for f in found if f is not None]
    return max(known) if known else None


def gpu_processes(uuid: str | None, run_pids: frozenset[int]) -> int | None:
    """Processes other than the run's on the GPU with this UUID (torch's
    `get_device_properties(device).uuid`), by NVML; None without CUDA or NVML, or when NVML
    does not list the GPU.

    By UUID, not index: NVML numbers every GPU of the node, torch only those that
    CUDA_VISIBLE_DEVICES shows, in its order, so on a shared Slurm node torch's cuda:0 may
    be NVML's GPU 5 and NVML's GPU 0 another job's. In a container NVML may report host
    pids that match none of ours; then one of the GPU's processes is taken to be this rank
    (each rank has a GPU of its own)."""
    if uuid is None:
        return None
    try:
        import pynvml  # type: ignore[import-not-found,unused-ignore]

        pynvml.nvmlInit()
        handle = nvml_handle(pynvml, uuid)
        if handle is None:
            return None
        found = {p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}
        found |= {p.pid for p in pynvml.nvmlDeviceGetGraphicsRunningProcesses(handle)}
    except Exception:  # no pynvml, no driver, an NVML error: unknown
        return None
    others = found - run_pids
    if others and len(others) == len(found):
        return len(others) - 1
    return len(others)


def nvml_handle(nvml: Any, uuid: str) -> Any:
    """NVML's handle of the GPU whose UUID is `uuid` (None: NVML does not list it, e.g. a
    MIG slice). torch writes UUIDs bare or with a GPU- prefix, NVML with it, as str or bytes
    by version: compared without prefix and case."""
    wanted = _bare_uuid(uuid)
    for index in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        if _bare_uuid(nvml.nvmlDeviceGetUUID(handle)) == wanted:
            return handle
    return None


def _bare_uuid(uuid: str | bytes) -> str:
    text = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
    return text.strip().lower().removeprefix("gpu-")


def verdict(samples: list[LoadSample], cpu_pct: float = CONTENDED_CPU_PCT) -> tuple[bool, str]:
    """Whether the run competed with something, and one line saying what was seen ("" when
    quiet): others' CPU in a window or over the run, or a process on its GPU. Load average
    alone does not decide: it lags a minute and counts our ranks."""
    windows = [s.other_cpu_pct for s in samples if s.other_cpu_pct is not None]
    window = max(windows, default=None)
    over_run = over_run_pct(samples)
    gpu = [s.gpu_other_processes for s in samples if s.gpu_other_processes is not None]
    reasons = []
    if over_run is not None and over_run > cpu_pct:
        reasons.append(
            f"processes outside the run used {over_run:.0f}% of the machine's CPU over the run "
            f"(over {cpu_pct:g}%)"
        )
    elif window is not None and window > WINDOW_CONTENDED_PCT:
        reasons.append(
            f"processes outside the run used {window:.0f}% of the machine's CPU "
            f"(over {WINDOW_CONTENDED_PCT:g}% in a 0.1 s window)"
        )
    if gpu and max(gpu) > 0:
        reasons.append(f"{max(gpu)} other process(es) on the run's GPU")
    return bool(reasons), "; ".join(reasons)


def record_fields(samples: list[LoadSample]) -> dict[str, Any]:
    """The record's fields (`RunResult.contended` and after) from every rank's samples: the
    largest figure of each kind over hosts (and passes), the verdict over all of them."""

    def most(values: Iterable[float | int | None]) -> Any:
        known = [v for v in values if v is not None]
        return max(known) if known else None

    if not samples:
        return {}
    contended, contention = verdict(samples)
    start = [s for s in samples if s.when == "start"]
    end = [s for s in samples if s.when == "end"]
    return {
        "contended": contended,
        "contention": contention,
        "load_per_core_start": most(s.load_per_core for s in start),
        "load_per_core_end": most(s.load_per_core for s in end),
        "other_cpu_start_pct": most(s.other_cpu_pct for s in start),
        "other_cpu_end_pct": most(s.other_cpu_pct for s in end),
        "other_cpu_run_pct": over_run_pct(samples),
        "gpu_other_processes": most(s.gpu_other_processes for s in samples),
    }
