"""`fsdp-bench search`: optuna over a grid's axes, on the local launcher with the tiny model."""

from __future__ import annotations

import itertools
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from fsdp_bench.cli.codegen import fully_shard_code
from fsdp_bench.cli.main import main
from fsdp_bench.cli.views import describe_search
from fsdp_bench.config.fsdp import FsdpConfig, checkpointed_every
from fsdp_bench.config.grid import load_grid, run_for_point, search_space
from fsdp_bench.config.model import ModelConfig
from fsdp_bench.config.run import DataConfig, RunConfig, TrainConfig
from fsdp_bench.config.schema import to_plain
from fsdp_bench.job.model.zoo import build_model
from fsdp_bench.job.training import loss_fn, rank_batches
from fsdp_bench.report.build import build_report
from fsdp_bench.search import (
    SearchOptions,
    best_feasible,
    counted_trials,
    open_study,
    run_search,
)
from fsdp_bench.store import ResultStore, RunResult
from tests.conftest import REPO, started_counts, write_grid

GRID = {
    "name": "search",
    "base": {
        "world_size": 2,
        "model": {"name": "tiny"},
        "data": {"micro_batch_size": 2},
        "measure": {"warmup_steps": 1, "timed_steps": 2, "repeats": 1},
    },
    "axes": {
        "fsdp.grouping": ["root", "block", "linear"],
        "fsdp.reshard_after_forward": ["default", False],
        "fsdp.mixed_precision": ["fp32", "bf16"],
    },
    # tracked peaks per rank: 16-26 MiB; 21 MiB keeps fp32 root and reshard false out
    "memory": {"budget_gib": 0.0205},
    "search": {"trials": 10, "seed": 1, "confirm_top_k": 0},  # on where a test confirms
    "launcher": {"collective_timeout_s": 30},
}


def search(folder: Path, grid: dict[str, Any], **options: Any) -> Any:
    spec = load_grid(write_grid(folder, grid))
    return spec, run_search(
        spec, SearchOptions(results_dir=folder / "r", progress=False, **options)
    )


@pytest.mark.slow
def test_search_finds_a_feasible_best_never_launches_a_predicted_oom_and_confirms(
    tmp_path: Path,
) -> None:
    grid = {**GRID, "search": {**GRID["search"], "confirm_top_k": 2, "confirm_rounds": 2}}
    grid["base"] = {**GRID["base"], "measure": {"warmup_steps": 1, "timed_steps": 3, "repeats": 1}}
    spec, outcome = search(tmp_path, grid)
    store = ResultStore(outcome.results_dir)
    records = {r.run_id: r for r in store.results()}
    skipped = {i for i, r in records.items() if r.status == "skipped"}
    launched = set(started_counts(outcome.results_dir))
    assert skipped, "the budget excludes part of the space"
    assert not skipped & launched, "a predicted OOM was launched"
    assert all(records[i].reason.startswith("predicted_oom") for i in skipped)
    assert outcome.counts["pruned"] == len(skipped)
    best = best_feasible(outcome.study, store, spec)
    assert best is not None
    best_record = records[best[0].user_attrs["run_id"]]
    assert best_record.status == "ok" and best_record.peak_memory_gib <= 0.0205
    counted = counted_trials(outcome.study)
    launched_trials = [t for t in counted if t.user_attrs.get("launched")]  # none abandoned
    assert len(launched_trials) == outcome.counts["launched"]  # (launched: confirmations too)
    # trials counts launches: pruned points are free, so the search goes on until 10 runs
    # were launched or every one of the 12 points was asked
    assert len(launched_trials) == 10 or len(counted) == 12, (len(launched_trials), len(counted))
    assert len(counted) > len(launched_trials), "pruned points were asked without a launch"
    # each the run of its point (root with reshard false is the root default's run)
    assert {t.user_attrs.get("run_id") for t in counted} == {
        run.run_id for t in counted if (run := run_for_point(spec, t.params)) is not None
    }
    infeasible = [t for t in outcome.study.trials if t.constraints.get("memory", 0) > 0]
    assert {t.user_attrs["run_id"] for t in infeasible} <= skipped
    assert (outcome.results_dir / "study.journal").exists()
    check_confirmation(outcome, spec, tmp_path)


def check_confirmation(outcome: Any, spec: Any, folder: Path) -> None:
    """The best two measured again in two interleaved rounds, under their own run ids, and
    reused by a rerun."""
    confirmation = outcome.confirmation
    assert confirmation is not None and len(confirmation.candidates) == 2
    store = ResultStore(outcome.results_dir)
    trial_ids = {c.trial.run_id for c in confirmation.candidates}
    records = [c.confirmed for c in confirmation.candidates]
    assert all(r is not None and r.status == "ok" for r in records), confirmation.failed
    ids = {r.run_id for r in records if r is not None}
    assert len(ids) == 2 and not ids & trial_ids and all(store.has(i) for i in ids)
    for r in records:
        assert r is not None and r.step_times_s is not None
        assert len(r.step_times_s) == 2 * 1 * 3, "two rounds of one repeat of three steps"
        assert r.config["measure"]["rounds"] == 2
    text = describe_search(outcome, spec)
    assert "confirmed best: " in text and "95% CI" in text
    progress = next(line for line in text.splitlines() if " runs launched, " in line)
    pattern = (r"(\d+) runs launched, (\d+) of them did not fit \(OOM or over the budget\); "
               r"the best was launch (\d+), unchanged for the (\d+) since: "
               r"more trials (may find a faster one|are unlikely to help)")  # fmt: skip
    said = re.fullmatch(pattern, progress)
    assert said is not None, progress
    assert int(said[1]) == outcome.counts["launched"] == int(said[3]) + int(said[4])
    base = text.split("as a grid base (YAML):\n", 1)[1].splitlines()
    assert base[:2] == ["    model:", "      name: tiny"], "pasted as a base, it runs this model"
    assert confirmation.winner is not None
    again = run_search(spec, SearchOptions(results_dir=folder / "r", progress=False))
    assert again.counts["launched"] == 0 and again.confirmation is not None
    assert {c.confirmed.run_id for c in again.confirmation.candidates if c.confirmed} == ids


@pytest.mark.slow
def test_search_resumes_after_a_kill_without_repeating(tmp_path: Path) -> None:
    grid = {**GRID, "search": {"trials": 4, "seed": 2, "confirm_top_k": 0}}
    path = write_grid(tmp_path, grid)
    results = tmp_path / "r"
    command = [sys.executable, "-m", "fsdp_bench", "search", str(path), "--results",
               str(results), "--no-progress"]  # fmt: skip
    driver = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 300
    while len(started_counts(results)) < 2:
        assert time.monotonic() < deadline and driver.poll() is None
        time.sleep(0.2)
    os.kill(driver.pid, signal.SIGKILL)
    driver.wait()
    resumed = subprocess.run([*command[:-1], "--trials", "5"], cwd=REPO, capture_output=True,
                             text=True, timeout=600)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    assert "best feasible" in resumed.stdout
    assert set(started_counts(results).values()) == {1}, "no run ran twice"
    spec = load_grid(path)
    study = open_study(spec, ResultStore(results), None)
    launched = {t.user_attrs["run_id"] for t in study.trials if t.user_attrs.get("launched")}
    assert launched == set(started_counts(results)) and len(launched) == 5, "five launches"
    assert all(t.state.is_finished() for t in study.trials)


def test_over_budget_is_never_best_even_when_fastest(tmp_path: Path) -> None:
    spec = load_grid(write_grid(tmp_path, GRID))
    store = ResultStore(tmp_path / "r")
    study = open_study(spec, store, None)
    fast_but_big = _record(store, "root", tokens=99_000.0, peak=0.030)
    slow_but_fits = _record(store, "block", tokens=5_000.0, peak=0.019)
    for result in (fast_but_big, slow_but_fits):
        trial = study.ask()
        trial.set_user_attr("run_id", result.run_id)
        trial.set_constraint("memory", result.peak_memory_gib - 0.0205)
        study.tell(trial, [result.tokens_per_s])
    best = best_feasible(study, store, spec)
    assert best is not None and best[0].user_attrs["run_id"] == slow_but_fits.run_id
    assert study.best_trial.user_attrs["run_id"] == slow_but_fits.run_id  # optuna 5 agrees


def _record(store: ResultStore, grouping: str, tokens: float, peak: float) -> RunResult:
    run = RunConfig(world_size=2, fsdp=FsdpConfig(grouping=grouping))
    result = RunResult(
        run_id=run.run_id, status="ok", config=to_plain(run), tokens_per_s=tokens,
        peak_memory_gib=peak,
    )  # fmt: skip
    store.record(result)
    return result


def test_a_dry_run_shows_the_space_the_estimates_and_what_would_be_pruned(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    grid = {**GRID, "exclude": [{"fsdp.grouping": "linear", "fsdp.mixed_precision": "bf16"}]}
    path, results = write_grid(tmp_path, grid), tmp_path / "r"
    assert main(["search", str(path), "--dry-run", "--results", str(results)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(
        "search search: 10 trials over 8 distinct runs (each key sampled from every value the "
        "grid gives it: 3 x 2 x 2 = 12 points, 2 excluded or not valid, 2 equal to another)"
    )
    assert "  fsdp.grouping: root, block, linear" in out and out[4].startswith("then: no confirm")
    verdicts = [m[1] for line in out if (m := re.search(r"\) +(yes|no|maybe) ", line))]
    assert len(verdicts) == 8 and "yes" in verdicts  # root's default reshard is false
    pruned = re.fullmatch(r"the search skips the (\d+) points .* among the other (\d+)", out[-2])
    assert pruned is not None and int(pruned[1]) == verdicts.count("no") > 0
    assert int(pruned[2]) == 8 - verdicts.count("no")
    assert out[-1] == "nothing launched (a dry run)"
    assert not (results / "study.journal").exists() and not list(results.glob("runs/*"))
    assert main(["search", str(path), "--dry-run", "--no-prune", "--results", str(results)]) == 0
    said = capsys.readouterr().out
    assert "--no-prune: points predicted over the budget are launched too" in said


@pytest.mark.slow
def test_multi_objective_reports_a_pareto_front(tmp_path: Path) -> None:
    grid = {**GRID, "search": {"trials": 6, "seed": 3, "multi_objective": True}}
    grid["memory"] = {}
    spec, outcome = search(tmp_path, grid)
    from fsdp_bench.search import pareto_trials

    front = pareto_trials(outcome.study, ResultStore(outcome.results_dir), spec)
    assert len(front) >= 2 and all(len(t.values) == 2 for t in front), front
    speeds = sorted((t.values[1], t.values[0]) for t in front)  # by memory
    assert all(b[1] > a[1] for a, b in itertools.pairwise(speeds)), speeds


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize(
    "run",
    [
        RunConfig(fsdp=FsdpConfig(grouping="block", mixed_precision="bf16", prefetch=2)),
        RunConfig(fsdp=FsdpConfig(grouping="blocks:2", activation_checkpointing="block")),
        RunConfig(
            model=ModelConfig(name="tiny", tie_embeddings=True),
            fsdp=FsdpConfig(grouping="linear", reshard_after_forward=False),
            train=TrainConfig(accumulation_steps=2, grad_sync="last"),
        ),
        RunConfig(
            strategy="ddp",
            train=TrainConfig(accumulation_steps=2, grad_sync="last", optimizer="sgd"),
        ),
        RunConfig(
            model=ModelConfig(name="tiny", dtype="bf16"),
            fsdp=FsdpConfig(
                mixed_precision="bf16",
                reduce_dtype="bf16",
                activation_checkpointing="selective_op",
                reshard_after_forward="all_but_last",
            ),
            train=TrainConfig(optimizer_impl="fused", max_grad_norm=1.0),
        ),
        RunConfig(
            fsdp=FsdpConfig(
                activation_checkpointing="every_2",
                grouping="blocks:2",
                reshard_after_forward="all_but_last",
            ),
            train=TrainConfig(optimizer_impl="for_loop", max_grad_norm=0.5, accumulation_steps=2),
        ),
        RunConfig(
            fsdp=FsdpConfig(mixed_precision="bf16", float8_all_gather=True),
            train=TrainConfig(float8="tensorwise"),
        ),
        RunConfig(strategy="ddp", train=TrainConfig(float8="rowwise")),
        RunConfig(
            fsdp=FsdpConfig(activation_checkpointing="block"),
            train=TrainConfig(compile="block", compile_loss=True),
        ),
        RunConfig(
            fsdp=FsdpConfig(
                reshard_after_backward="last",
                reduce_scatter_buffers=2,
                separate_reduce_scatter_group=True,
                comm_buffers_from_process_group=True,
                cast_forward_inputs=False,
            ),
            train=TrainConfig(accumulation_steps=2),
        ),
    ],
    ids=[
        "block-bf16-prefetch",
        "blocks2-ac",
        "linear-tied-accumulation",
        "ddp",
        "torchtitan-like",
        "every-2-clipped",
        "float8-all-gather",
        "ddp-float8",
        "compiled-blocks-and-loss",
        "fsdp2-knobs",
    ],
)
def test_generated_code_runs(one_rank_group: None, run: RunConfig) -> None:
    """The Python printed for the best configuration, executed on a real (one-rank) group."""
    code = fully_shard_code(run, device="cpu")
    model = build_model(run.model).module
    if run.strategy == "ddp":
        model.to_empty(device="cpu")
        model.init_weights()
        if run.model.tie_embeddings:
            model.output.weight = model.tok_embeddings.weight
    batches = rank_batches(
        RunConfig(data=DataConfig(micro_batch_size=1, seq_len=16)), 0, 1024, torch.device("cpu")
    )
    namespace: dict[str, Any] = {
        "model": model,
        "loss_fn": loss_fn,
        "inputs": batches[0][0],
        "targets": batches[0][1],
        "micro_batches": batches * run.train.accumulation_steps,
    }
    exec(compile(code, "<generated>", "exec"), namespace)  # our own output
    trained: nn.Module = namespace["model"]
    assert all(p.grad is None for p in trained.parameters()), "the step ran to zero_grad"
    assert "fully_shard" in code or run.strategy == "ddp"
    optimizer = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[run.train.optimizer]
    assert isinstance(namespace["optimizer"], optimizer)
    group = namespace["optimizer"].param_groups[0]
    assert group["lr"] == run.train.learning_rate
    assert bool(group["fused"]) == (run.train.optimizer_impl == "fused")
    stored = {p.dtype for p in trained.parameters()}
    assert stored == {torch.bfloat16 if run.model.dtype == "bf16" else torch.float32}
    wrapped = [m for m in trained.modules() if isinstance(m, CheckpointWrapper)]
    every = checkpointed_every(run.fsdp.activation_checkpointing)
    want = 0 if run.fsdp.activation_checkpointing == "none" else 4 // (every or 1)
    assert len(wrapped) == want
    float8 = [m for m in trained.modules() if type(m).__name__ == "Float8Linear"]
    assert len(float8) == (28 if run.train.float8 != "none" else 0)
    compiled = [m for m in trained.modules() if m._compiled_call_impl is not None]
    assert len(compiled) == {"none": 0, "block": 4, "model": 1}[run.train.compile]
    assert (namespace["loss_fn"] is not loss_fn) == run.train.compile_loss


def test_search_settings_are_validated(tmp_path: Path) -> None:
    bad = {**GRID, "search": {"trials": 0}}
    path = write_grid(tmp_path, bad)
    done = subprocess.run(
        [sys.executable, "-m", "fsdp_bench", "search", str(path)],
        capture_output=True, text=True, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 2
    assert "search.trials: 0 is not allowed; expected an integer >= 1" in done.stderr
    flag = subprocess.run(
        [sys.executable, "-m", "fsdp_bench", "search", str(write_grid(tmp_path, GRID)),
         "--parallel", "0"],
        capture_output=True, text=True, cwd=REPO,
    )  # fmt: skip
    assert flag.returncode == 2 and "--parallel: 0 is not allowed" in flag.stderr


def test_journal_is_readable_by_optuna(tmp_path: Path) -> None:
    spec = load_grid(write_grid(tmp_path, GRID))
    store = ResultStore(tmp_path / "r")
    study = open_study(spec, store, None)
    trial = study.ask({"fsdp.grouping": optuna.distributions.CategoricalDistribution(["root"])})
    study.tell(trial, [1.0])
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    again = optuna.load_study(
        study_name="search",
        storage=JournalStorage(JournalFileBackend(str(tmp_path / "r" / "study.journal"))),
    )
    assert [t.values for t in again.trials] == [[1.0]]


@pytest.mark.parametrize("sampler", ["additive", "tpe", "random", "grid", "gp"])
def test_a_recorded_space_is_searched_from_the_store_without_launching(
    tmp_path: Path, sampler: str
) -> None:
    """Every point already recorded: each sampler covers the 12 points (a point proposed again
    is free, so the budget counts distinct points) and names the fastest that fits."""
    grid = {**GRID, "search": {"trials": 12, "seed": 0, "sampler": sampler, "confirm_top_k": 0}}
    spec = load_grid(write_grid(tmp_path, grid))
    store = ResultStore(tmp_path / "r")
    expected = record_every_point(spec, store)
    outcome = run_search(spec, SearchOptions(results_dir=tmp_path / "r", progress=False))
    assert outcome.counts["launched"] == 0 and outcome.counts["pruned"] == 0
    assert {t.user_attrs["run_id"] for t in counted_trials(outcome.study)} == {
        r.run_id for r in store.results()
    }
    best = best_feasible(outcome.study, store, spec)
    assert best is not None and best[0].user_attrs["run_id"] == expected


def record_every_point(spec: Any, store: ResultStore) -> str:
    """Synthetic records for the whole space; the run id of the fastest under 21 MiB."""
    expected, fastest = "", 0.0
    for i, values in enumerate(itertools.product(*search_space(spec).values())):
        run = run_for_point(spec, dict(zip(search_space(spec), values, strict=True)))
        assert run is not None
        tokens, peak = 1000.0 + 97.0 * ((i * 5) % 12), 0.015 + 0.001 * i
        store.record(RunResult(run_id=run.run_id, status="ok", config=to_plain(run),
                               tokens_per_s=tokens, peak_memory_gib=peak))  # fmt: skip
        if peak <= 0.0205 and tokens > fastest:
            expected, fastest = run.run_id, tokens
    return expected


def test_a_database_storage_holds_the_study(tmp_path: Path) -> None:
    spec = load_grid(
        write_grid(tmp_path, {**GRID, "search": {"trials": 5, "seed": 0, "confirm_top_k": 0}})
    )
    store = ResultStore(tmp_path / "r")
    record_every_point(spec, store)
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    options = SearchOptions(results_dir=tmp_path / "r", progress=False, storage=url)
    run_search(spec, options)
    study = optuna.load_study(study_name="search", storage=url)
    # every point recorded: answered from the store for free, so all 12 are asked
    assert len(counted_trials(study)) == 12
    assert not any(t.user_attrs.get("launched") for t in study.trials)
    assert not (tmp_path / "r" / "study.journal").exists()
    report = build_report(tmp_path / "r", out=tmp_path / "report", storage=url)
    drawn = {figure.name: figure for figure in report.figures}
    assert not drawn["search_progress"].skipped, "the report reads the study from the database"
    bad = subprocess.run(
        [sys.executable, "-m", "fsdp_bench", "search", str(write_grid(tmp_path, GRID)),
         "--storage", "nonsense://x", "--results", str(tmp_path / "r")],
        capture_output=True, text=True, cwd=REPO,
    )  # fmt: skip
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
    assert "--storage: 'nonsense://x' is not a usable database URL" in bad.stderr


@pytest.mark.slow
def test_a_search_over_the_practitioners_knobs_end_to_end(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """sweeps/torchtitan-llama3-8b.yaml's knobs (checkpointing, reshard, reduce dtype, bf16
    storage, optimizer implementation, world size), scaled to the tiny model on this CPU,
    searched through the command as a user runs it, under a budget that rules some out."""
    grid = {
        "name": "practitioners",
        "base": {
            "world_size": 2,
            "model": {"name": "tiny"},
            "data": {"micro_batch_size": 2, "seq_len": 128},
            "fsdp": {
                "grouping": "block",
                "reshard_after_forward": "all_but_last",
                "mixed_precision": "bf16",
                "reduce_dtype": "fp32",
                "activation_checkpointing": "selective_op",
            },
            "train": {"optimizer": "adamw", "optimizer_impl": "foreach", "max_grad_norm": 1.0},
            "measure": {"warmup_steps": 1, "timed_steps": 3, "repeats": 1},
        },
        "axes": {
            "world_size": [1, 2],
            "fsdp.activation_checkpointing": ["selective_op", "block", "every_2"],
            "fsdp.reshard_after_forward": ["all_but_last", False],
            "fsdp.reduce_dtype": ["fp32", "bf16"],
            "model.dtype": ["fp32", "bf16"],
            "train.optimizer_impl": ["foreach", "for_loop"],
        },
        "memory": {"budget_gib": 0.02},
        "search": {"trials": 6, "seed": 0, "confirm_top_k": 2, "confirm_rounds": 2},
        "launcher": {"collective_timeout_s": 60},
    }
    path, results = write_grid(tmp_path, grid), tmp_path / "r"
    assert main(["search", str(path), "--results", str(results), "--no-progress"]) == 0
    said = capsys.readouterr().out
    assert " runs launched, " in said and "as a grid base (YAML):" in said
    records = {r.run_id: r for r in ResultStore(results).results()}
    launched = set(started_counts(results))
    ok = [r for r in records.values() if r.status == "ok" and r.run_id in launched]
    assert len(ok) >= 4 and {r.config["world_size"] for r in ok} <= {1, 2}
    assert not launched & {i for i, r in records.items() if r.status == "skipped"}
    assert any(r.config["model"]["dtype"] == "bf16" for r in records.values())


@pytest.mark.slow
def test_a_search_over_float8_compile_and_fsdp2_knobs_end_to_end(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The configurations that win, searched through the command as a user runs it: float8,
    per-block compile, HSDP's once-a-step all-reduce and unsharded parameters between
    micro-batches (HSDP of 2 replicas of 1 rank, 2 micro-batches). The additive sampler's
    first launches cover every value of every axis, so each setting runs at least once."""
    grid = {
        "name": "configs-that-win",
        "base": {
            "world_size": 2,
            "strategy": "hsdp",
            "model": {"name": "tiny"},
            "data": {"micro_batch_size": 2, "seq_len": 128},
            "fsdp": {"shard_group_size": 1, "mixed_precision": "bf16"},
            "train": {"accumulation_steps": 2},
            "measure": {"warmup_steps": 1, "timed_steps": 3, "repeats": 1},
        },
        "axes": {
            "train.float8": ["none", "tensorwise"],
            "train.compile": ["none", "block"],
            "train.grad_sync": ["every", "all_reduce_last"],
            "fsdp.reshard_after_backward": ["every", "last"],
        },
        "search": {"trials": 4, "seed": 0, "confirm_top_k": 0},
        "launcher": {"collective_timeout_s": 60},
    }
    path, results = write_grid(tmp_path, grid), tmp_path / "r"
    assert main(["search", str(path), "--results", str(results), "--no-progress"]) == 0
    assert " runs launched, " in capsys.readouterr().out
    ok = [r for r in ResultStore(results).results() if r.status == "ok"]
    assert len(ok) >= 3, [(r.run_id, r.status, r.reason) for r in ResultStore(results).results()]
    seen = {
        key: {r.config[section].get(name, "none" if name != "grad_sync" else "every") for r in ok}
        for key, (section, name) in {
            "float8": ("train", "float8"),
            "compile": ("train", "compile"),
            "grad_sync": ("train", "grad_sync"),
        }.items()
    }
    assert seen == {
        "float8": {"none", "tensorwise"},
        "compile": {"none", "block"},
        "grad_sync": {"every", "all_reduce_last"},
    }, seen
    for record in ok:  # HSDP all-reduces once a step under all_reduce_last, else twice
        once = record.config["train"].get("grad_sync") == "all_reduce_last"
        assert record.all_reduces_per_step == (5 if once else 10), record.run_id
        if record.config["train"].get("compile", "none") != "none":
            assert record.peak_memory_source == "cpu_allocator"
