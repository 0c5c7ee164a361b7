"""Each memory figure estimated before launch beside the record's measurement of the same
quantity: the error, and whether the measurement fell inside the estimate's interval."""

from __future__ import annotations

import math

import pandas as pd

from fsdp_bench.report.configs import config_columns, config_labels
from fsdp_bench.report.summaries import ok_runs

ESTIMATE_PAIRS = {
    "tensors": ("estimated_peak_gib", "tracked_peak_gib"),
    "allocated": ("estimated_allocated_gib", "peak_memory_gib"),
    "reserved": ("estimated_reserved_gib", "peak_reserved_gib"),
    "device-used": ("estimated_device_used_gib", "device_used_peak_gib"),
}
"""Each figure estimated before launch and the record's measurement of the same quantity
(allocated: max_memory_allocated, on CUDA; tracked tensors on CPU have no allocator)."""


def estimate_accuracy(df: pd.DataFrame) -> pd.DataFrame:
    """Ok runs with an estimate: for each figure both sides have, the estimate, the
    measurement, the error in % of the measurement and whether the measurement fell inside
    the estimate's interval; the estimate's fits and the correction it was decided with.
    Index: the run's label (W=8: block); columns `<figure> est`, `<figure> measured`,
    `<figure> error %`, `<figure> inside`, fits, correction, and run_id."""
    ok = ok_runs(df)
    pairs = {
        name: (est, got)
        for name, (est, got) in ESTIMATE_PAIRS.items()
        if est in ok and got in ok and (ok[est].notna() & ok[got].notna()).any()
    }
    if ok.empty or not pairs:
        return pd.DataFrame()
    if "allocated" in pairs and "peak_memory_source" in ok:  # CPU: peak is the tensors again
        ok = ok[ok["peak_memory_source"] == "cuda_max_memory_allocated"]
    ok = ok.sort_values(["world_size", "run_id"])
    labels = config_labels(ok, config_columns(ok, ["world_size"]))
    index = [f"W={int(w)}: {text}" for w, text in zip(ok["world_size"], labels, strict=True)]
    table = pd.DataFrame(index=index)
    for name, (est, got) in pairs.items():
        estimated, measured = ok[est].to_numpy(dtype=float), ok[got].to_numpy(dtype=float)
        table[f"{name} est"] = estimated
        table[f"{name} measured"] = measured
        table[f"{name} error %"] = 100 * (estimated - measured) / measured
        low, high = est.replace("_gib", "_low_gib"), est.replace("_gib", "_high_gib")
        if low in ok and high in ok and ok[low].notna().any():
            lows, highs = ok[low].to_numpy(dtype=float), ok[high].to_numpy(dtype=float)
            table[f"{name} inside"] = [
                None if math.isnan(a) else bool(a <= m <= b)
                for a, m, b in zip(lows, measured, highs, strict=True)
            ]
    if "estimate_fits" in ok:
        table["fits"] = ok["estimate_fits"].to_numpy()
    if "estimate_correction" in ok:
        table["correction"] = [
            c.get("factor") if isinstance(c, dict) else None for c in ok["estimate_correction"]
        ]
    table["run_id"] = ok["run_id"].to_numpy()
    return table
