"""What the runs a results folder has measured say about the estimate, learned from each run as
it is recorded: a correction of the deciding figure, and what lives outside the allocator.

Records keep the estimate as the models made it (raw), never corrected, so a correction read
back from them is the same each time it is read. The deciding figure is reserved memory on
CUDA (the allocator replay's peak) and the tensors elsewhere; its correction is the median of
measured / raw over the runs of the finest scope that has any: the same GPU, model, world size
and compile setting, then the same GPU, model and compile setting, then the same GPU and
compile setting. An OOM is evidence too: the process held `W` GiB and asked for `X` more
(torch's message), so the run needed at least W + X, and it counts in the median at that
over its estimate. How far single runs stray from the median (`Correction.scatter`) widens
the intervals. With no GPU named (`memory.gpu`), a run may land on any GPU the folder has
measured, and the largest correction is taken.
"""

from __future__ import annotations

import dataclasses
import math
import re
import statistics
from dataclasses import dataclass, field
from typing import Any

from fsdp_bench.config.grid_settings import MemoryConfig
from fsdp_bench.config.run import RunConfig
from fsdp_bench.store import ResultStore, RunResult

_OOM_HELD = re.compile(
    r"Tried to allocate ([0-9.]+) ([KMG]iB).*?this process has ([0-9.]+) ([KMG]iB) memory in use",
    re.S,
)
_UNIT_GIB = {"KiB": 1 / 1024**2, "MiB": 1 / 1024, "GiB": 1.0}


@dataclass(frozen=True)
class Sample:
    """One measured run: measured / raw of the deciding figure (a lower bound for an OOM)."""

    run_id: str
    device: str
    """The GPU's name as torch gives it ("NVIDIA H200"), "cpu", or "" for an OOM whose
    device nobody recorded."""
    model: str
    world_size: int
    compiled: bool
    ratio: float
    at_least: bool = False
    """An OOM: the run needed more than `ratio` x its estimate."""


@dataclass(frozen=True)
class Correction:
    """The factor on the deciding figure, and the runs it was learned from."""

    factor: float = 1.0
    run_ids: tuple[str, ...] = ()
    scope: str = ""
    """What the runs share with the estimated one ("NVIDIA H200, llama3-8b, eager")."""
    scatter: float = 0.0
    """How far one run's measured / raw strays from the others': twice the standard deviation
    of ln(ratio) over the runs (from 3 on; 0 before), a relative band the interval widens by.
    Systematic error is what the factor corrects; this is what no factor can."""

    @property
    def describe(self) -> str:
        if not self.run_ids:
            return "none (no measured run of this GPU and model)"
        runs = ", ".join(self.run_ids[:4]) + (" ..." if len(self.run_ids) > 4 else "")
        spread = f", scatter ±{100 * self.scatter:.0f}%" if self.scatter else ""
        return f"x {self.factor:.3f}{spread} from {len(self.run_ids)} runs ({self.scope}: {runs})"


@dataclass(frozen=True)
class Calibration:
    """The folder's measured runs, as samples (`calibration`)."""

    configured_outside_gib: float | None = None
    samples: tuple[Sample, ...] = ()
    outside_gaps_gib: dict[tuple[str, int], list[float]] = field(default_factory=dict)
    """Device-used at the end of the timed steps minus peak reserved, per (GPU, world size)."""
    gpu: str | None = None

    @property
    def uncorrected(self) -> Calibration:
        """The same settings without what runs measured: the models' own figures."""
        return Calibration(self.configured_outside_gib, gpu=self.gpu)

    def correction(self, run: RunConfig) -> Correction:
        compiled = run.train.compiled
        mine = [s for s in self.samples if s.compiled == compiled and self._on_my_gpu(s.device)]
        model, world_size = run.model.name, run.world_size
        scopes = {
            f"{model}, world size {world_size}": [
                s for s in mine if s.model == model and s.world_size == world_size
            ],
            model: [s for s in mine if s.model == model],
            "any model": mine,
        }
        for label, chosen in scopes.items():
            if any(not s.at_least for s in chosen):
                return _worst_device(chosen, f"{label}, {'compiled' if compiled else 'eager'}")
        return Correction()

    def outside(self, world_size: int) -> tuple[float, tuple[float, float], str] | None:
        """(median, (lowest, highest)) GiB of device-used minus reserved in measured runs of
        this world size, and what it came from; None without such runs (another world size
        has other communicators, over other links: the default model stands then)."""
        if self.configured_outside_gib is not None:
            value = self.configured_outside_gib
            return value, (value, value), "configured (memory.overhead_gib)"
        gaps = [g for (device, w), found in self.outside_gaps_gib.items()
                if w == world_size and self._on_my_gpu(device) for g in found]  # fmt: skip
        if not gaps:
            return None
        source = f"measured: {len(gaps)} CUDA runs at world size {world_size}"
        return statistics.median(gaps), (min(gaps), max(gaps)), source

    def learn(self, result: RunResult) -> Calibration:
        """This calibration with what one more recorded run says."""
        sample = _sample(result)
        samples = (*self.samples, sample) if sample is not None else self.samples
        gaps = self.outside_gaps_gib
        if result.status == "ok" and result.device_used_peak_gib and result.peak_reserved_gib:
            key = (str(result.provenance.get("device_name", "")), int(result.config["world_size"]))
            gap = result.device_used_peak_gib - result.peak_reserved_gib
            gaps = {**gaps, key: [*gaps.get(key, []), gap]}
        return dataclasses.replace(self, samples=samples, outside_gaps_gib=gaps)

    def _on_my_gpu(self, device: str) -> bool:
        return self.gpu is None or not device or self.gpu.split("-")[0] in device


MIN_SCATTER_SAMPLES = 3
"""Runs before their scatter widens the interval (two ratios say little of a spread)."""


def _worst_device(samples: list[Sample], scope: str) -> Correction:
    """Per GPU: the median ratio over its runs, an OOM counted at what it needed (a lower
    bound, so the median leans low only where OOMs are many), with the ratios' scatter; the
    largest over GPUs (an OOM of unknown GPU counts for every one).

    A median, not the largest bound: where single runs stray from the estimate (a 10% random
    error), one OOM that needed 20% more says that run was off, and raising every estimate by
    it would prune the fastest runs at the memory edge; the scatter widens the intervals
    instead, so a run near the budget is `maybe` and measured."""
    devices = {s.device for s in samples if s.device} or {""}
    best: Correction | None = None
    for device in sorted(devices):
        here = [s for s in samples if s.device in (device, "")]
        if all(s.at_least for s in here):
            continue
        ratios = [s.ratio for s in here]
        logs = [math.log(r) for r in ratios if r > 0]
        scatter = (
            math.expm1(2 * statistics.stdev(logs)) if len(logs) >= MIN_SCATTER_SAMPLES else 0.0
        )
        ids = tuple(s.run_id for s in here)
        where = f"{device}, {scope}" if device else scope
        factor = statistics.median(ratios)
        if best is None or factor > best.factor:
            best = Correction(factor, ids, where, scatter)
    return best or Correction()


def calibration(memory: MemoryConfig, store: ResultStore | None) -> Calibration:
    """The folder's measured runs, read now (`Calibration.learn` adds later ones)."""
    known = Calibration(memory.overhead_gib, gpu=memory.gpu)
    for result in store.results() if store is not None else []:
        known = known.learn(result)
    return known


def _sample(result: RunResult) -> Sample | None:
    config = result.config
    if config.get("fault", {}).get("kind", "none") != "none":
        return None  # an injected failure says nothing about memory
    device = str(result.provenance.get("device_name", ""))
    common: dict[str, Any] = {
        "run_id": result.run_id,
        "model": str(config.get("model", {}).get("name", "")),
        "world_size": int(config.get("world_size", 1)),
        "compiled": _compiled(config.get("train", {})),
    }
    if result.status == "ok":
        if result.peak_reserved_gib and result.estimated_reserved_gib:
            ratio = result.peak_reserved_gib / result.estimated_reserved_gib
        elif result.tracked_peak_gib and result.estimated_peak_gib and not result.peak_reserved_gib:
            ratio = result.tracked_peak_gib / result.estimated_peak_gib
        else:
            return None
        return Sample(device=device, ratio=ratio, **common)
    if result.status == "oom":
        needed = _oom_needed_gib(result.reason)
        outside = (result.estimated_device_used_gib or 0) - (result.estimated_reserved_gib or 0)
        if needed is None or not result.estimated_reserved_gib:
            return None
        return Sample(
            device=device, ratio=(needed - outside) / result.estimated_reserved_gib,
            at_least=True, **common,
        )  # fmt: skip
    return None


def _oom_needed_gib(reason: str) -> float | None:
    """What an OOM's process held plus what it asked for, from torch's message."""
    found = _OOM_HELD.search(reason)
    if found is None:
        return None
    asked, asked_unit, held, held_unit = found.groups()
    return float(asked) * _UNIT_GIB[asked_unit] + float(held) * _UNIT_GIB[held_unit]


def _compiled(train: dict[str, object]) -> bool:
    """A stored run's `train` settings compile something (`TrainConfig.compiled`)."""
    return train.get("compile", "none") != "none" or bool(train.get("compile_loss", False))
