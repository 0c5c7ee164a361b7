"""`fsdp-bench sweep sweeps/quickstart.yaml` end to end, as a user runs it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.test_results import CONTRACT

pytestmark = pytest.mark.slow


def test_quickstart_end_to_end(
    quickstart_sweep: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    results, first = quickstart_sweep
    command = first.args
    assert "31/31" in first.stderr, "the progress bar reached the end"
    # two rounds: records land after the last pass, so the bar shows no rate or time left
    bar = [part for part in re.split(r"[\r\n]", first.stderr) if "(2 passes: " in part]
    assert bar and "runs recorded after the last" in bar[-1]
    assert not any("run/s" in part or "s/run" in part for part in bar)
    assert first.stdout.splitlines()[-1] == f"figures and a summary: fsdp-bench report {results}"
    table = first.stdout.splitlines()
    header = table[1].split()
    assert header[:3] == ["run_id", "world_size", "strategy"] and "tokens/s" in header
    notes = [line for line in table[2:] if "contended" in line and "--rerun" in line]
    verdicts = [line for line in table[2:]
                if line.startswith(("fastest: the DDP baseline", "no clear winner"))]  # fmt: skip
    launch = next(i for i, line in enumerate(table) if line.startswith("to measure it again"))
    # a run timed beside something else says so; a DDP best is named beside the FSDP2 one
    assert launch == 2 + 31 + 1 + len(notes) + len(verdicts)
    noise = table[2 + 31]
    assert noise.startswith("between-pass noise: ")
    ranked_rows = [line.split() for line in table[2 : 2 + 31]]
    fsdp_rows = [row for row in ranked_rows if row[2] != "ddp"]
    best = fsdp_rows[0][0]  # the torchrun line that measures the fastest FSDP2 run again
    assert (ranked_rows[0][2] == "ddp") == any(v.startswith("fastest: the DDP") for v in verdicts)
    torchrun, rest = table[launch + 1].strip().split(" ", 1)
    # this environment's own torchrun, so the line runs as printed from any shell
    assert Path(torchrun).name == "torchrun" and Path(torchrun).is_file(), torchrun
    assert rest.startswith("--nnodes 1 --nproc_per_node ")
    assert (
        f"launch/{best}.yaml" in table[launch + 1]
        and (results / "launch" / f"{best}.yaml").is_file()
    )

    # What a user does next: read the folder with pandas.
    code = f"import fsdp_bench; df = fsdp_bench.load_results({str(results)!r}); print(len(df))"
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert shown.stdout.strip() == "31"

    import fsdp_bench

    df = fsdp_bench.load_results(results)
    assert set(CONTRACT) <= set(df.columns)
    assert set(df.status) == {"ok"}, df[df.status != "ok"][["run_id", "reason"]]
    assert set(df.world_size) == {1, 2}
    # contended runs (a busy machine) stay out of the pooled noise; every quiet one is in it
    contended = int(df["contended"].eq(True).sum())
    quiet = 31 - contended
    assert f"pooled over {quiet} runs, {quiet} degrees" in noise or quiet < 4, noise
    assert (f"{contended} contended runs left out" in noise) == (contended > 0 and quiet >= 4)
    assert (df.tokens_per_s > 0).all() and (df.peak_memory_gib > 0).all()
    ranked = [line.split()[0] for line in table[2 : 2 + 31]]
    assert ranked == df.sort_values("tokens_per_s", ascending=False).run_id.tolist()
    assert (results / "grid.yaml").read_text() == (REPO / "sweeps" / "quickstart.yaml").read_text()

    # One job per world size, and one more for each run whose passes disagreed beyond the
    # noise (set aside in replaced/ and measured again in a later job: launch/stability.py).
    jobs = list((results / "jobs" / "submitit").glob("*_submitted.pkl"))
    measured_again = len(list((results / "replaced").glob("*.json")))
    assert 2 + min(measured_again, 1) <= len(jobs) <= 2 + measured_again, measured_again
    # Run again: everything is recorded, nothing runs.
    again = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0
    assert "31 runs were already recorded" in again.stdout
    assert len(list((results / "jobs" / "submitit").glob("*_submitted.pkl"))) == len(jobs)
