"""Terminal views of a grid: its expanded runs, where each run is, their memory estimates."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from fsdp_bench.config.grid import (
    SweepSpec,
    axis_keys,
    expand,
    get_path,
)
from fsdp_bench.config.run import RunConfig
from fsdp_bench.config.schema import build, non_default_fields
from fsdp_bench.errors import ConfigError, yaml_scalar
from fsdp_bench.launch.packing import pack_runs
from fsdp_bench.memory.model_check import check_models
from fsdp_bench.store import ResultStore
from fsdp_bench.sweep import results_dir_for, sweep_status

if TYPE_CHECKING:
    import optuna
    import pandas as pd

    from fsdp_bench.search import Candidate, Confirmation, SearchOutcome


def text_table(header: list[str], rows: list[list[str]]) -> str:
    """Left-aligned columns, two spaces apart."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return "\n".join(
        "  ".join(value.ljust(width) for value, width in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    )


def describe_expansion(spec: SweepSpec, results: Path | None) -> str:
    expansion = expand(spec)
    check_models(expansion.runs)  # a dry run shows a broken model as a real run would
    done = ResultStore(results_dir_for(spec, results)).done_ids()
    keys = axis_keys(spec)
    packs = pack_runs(expansion.runs, spec.launcher)
    job_of = {run.run_id: index for index, pack in enumerate(packs, 1) for run in pack}
    rows = [
        [
            run.run_id,
            *(yaml_scalar(get_path(run, k)) for k in keys),
            str(run.nodes),
            str(job_of[run.run_id]),
            "yes" if run.run_id in done else "no",
        ]
        for run in expansion.runs
    ]
    shapes = Counter((len(p), p[0].world_size, p[0].nodes) for p in packs)
    packing = "; ".join(
        f"{count} job{'s' if count > 1 else ''} of {runs} run{'s' if runs > 1 else ''} at "
        f"world size {size} on {nodes} node{'s' if nodes > 1 else ''}"
        for (runs, size, nodes), count in sorted(shapes.items(), key=lambda kv: kv[0][1:])
    )
    header = ["run_id", *(k.split(".")[-1] for k in keys), "nodes", "job", "recorded"]
    return (
        text_table(header, rows)
        + f"\n{len(expansion.runs)} runs in {len(packs)} jobs ({expansion.excluded} excluded, "
        f"{expansion.collapsed} equal to another run): {packing}; "
        f"{spec.launcher.jobs_in_flight} job{'s' if spec.launcher.jobs_in_flight > 1 else ''} "
        "in flight at once"
    )


def describe_status(spec: SweepSpec, results: Path | None) -> str:
    states = sweep_status(spec, results)
    rows = [[s.run_id, s.state, s.job_id or "-", s.detail] for s in states]
    counts = Counter(s.state for s in states)
    summary = ", ".join(f"{n} {state}" for state, n in counts.most_common())
    return text_table(["run_id", "state", "job", "detail"], rows) + "\n" + summary


def describe_launch(spec: SweepSpec, run_id: str, results: Path) -> str:
    """For one run of the grid: the torchrun line and sbatch script that measure it again
    with `fsdp-bench run` (`launch_lines`)."""
    from fsdp_bench.cli.launch_lines import launch_lines

    runs = {r.run_id: r for r in expand(spec).runs}
    if run_id not in runs:
        raise ConfigError(f"--print-launch: {run_id!r} is not a run id of {spec.name}")
    return "\n".join(launch_lines(spec, runs[run_id], results))


def describe_search(outcome: SearchOutcome, spec: SweepSpec, top: int = 5) -> str:
    """Counts, the best feasible configuration (YAML and fully_shard calls), the top runs,
    and the Pareto front when two objectives were searched."""
    from fsdp_bench.report.tables import format_ranking, ranking
    from fsdp_bench.search import best_feasible, pareto_trials
    from fsdp_bench.store import load_results

    store = ResultStore(outcome.results_dir)
    c = outcome.counts
    trials = outcome.study.get_trials(deepcopy=False)
    lines = [
        f"search {spec.name}: {len(trials)} trials in {outcome.storage}; "
        f"this session: {c['launched']} run, {c['pruned']} pruned by the estimate, "
        f"{c['infeasible']} infeasible when measured, {c['failed']} failed, "
        f"{c['from_store']} answered from the results store, {c['excluded']} excluded"
    ]
    best = best_feasible(outcome.study, store, spec)
    budget = spec.memory.budget_gib
    if best is None:
        lines.append("no feasible configuration yet")
        return "\n".join(lines)
    trial, value = best
    result = store.get(str(trial.user_attrs["run_id"]))
    assert result is not None
    fits = f" of a {budget:g} GiB budget" if budget is not None else ""
    lines.append(
        f"best feasible: {spec.search.metric} {value:,.6g} (trial {trial.number}, run "
        f"{result.run_id}), peak {result.peak_memory_gib:.3f} GiB per rank{fits}"
    )
    progress = _progress_line(outcome.study, store, spec, result.run_id)
    results = load_results(outcome.results_dir)
    confirmation = outcome.confirmation
    if confirmation is not None and confirmation.winner is not None:
        lines += _confirmation_lines(confirmation, spec)
        result = confirmation.winner.trial
    else:
        lines += _tied_lines(outcome, spec, results, result.run_id)
        lines += _confirmation_lines(confirmation, spec) if confirmation else []
    if outcome.confirm_skipped:
        lines.append(f"no confirmation round: {outcome.confirm_skipped}")
    lines.append(progress)
    confirmed = confirmation is not None and confirmation.winner is not None
    best_name = "the confirmed best" if confirmed else "the best feasible"
    lines += _reproduce_lines(spec, build(RunConfig, result.config), best_name, outcome.results_dir)
    finished = {str(t.user_attrs["run_id"]) for t in trials if "run_id" in t.user_attrs}
    table = ranking(results, finished)
    lines += [f"top {top} of {len(table)} runs:", format_ranking(table.head(top))]
    if spec.search.multi_objective:
        front = pareto_trials(outcome.study, store, spec)
        front_ids = [t.user_attrs["run_id"] for t in sorted(front, key=lambda t: t.values[1])]
        lines += [
            "Pareto front (tokens vs peak memory):",
            *(f"  {run_id}" for run_id in front_ids),
        ]
    return "\n".join(lines)


def _progress_line(
    study: optuna.Study, store: ResultStore, spec: SweepSpec, best_run_id: str
) -> str:
    """How many launches did not fit, and when the best was launched: a best found early and
    unchanged since says more trials are unlikely to help; one found late says they may."""
    from fsdp_bench.memory.calibration import calibration
    from fsdp_bench.search.trials import constraint_value, launched_run_ids

    known = calibration(spec.memory, store)
    launched = launched_run_ids(study)
    records = [r for r in map(store.get, launched) if r is not None]
    unfit = sum(
        r.status == "oom" or (r.status == "ok" and constraint_value(r, spec.memory, known) > 0)
        for r in records
    )
    text = f"{len(launched)} runs launched, {unfit} of them did not fit (OOM or over the budget)"
    if best_run_id not in launched:
        return text + "; the best was recorded before this search"
    at = launched.index(best_run_id) + 1
    since = len(launched) - at
    advice = (
        "more trials may find a faster one"
        if since < max(3, len(launched) // 4)
        else "more trials are unlikely to help"
    )
    return f"{text}; the best was launch {at}, unchanged for the {since} since: {advice}"


def _reproduce_lines(spec: SweepSpec, run: RunConfig, name: str, results: Path) -> list[str]:
    """A run as a grid base, as fully_shard calls, and as a torchrun line / sbatch script."""
    from fsdp_bench.cli.codegen import fully_shard_code
    from fsdp_bench.cli.launch_lines import launch_lines

    blocks, note = "model.layers", ""
    if run.model.is_user_model:  # where the model check found them (memoised: no rebuild)
        found = check_models([run])[run.run_id].blocks_path
        blocks = f"model.{found}" if found else blocks
        note = "" if found else " (model.layers: your model's list of blocks, in forward order)"
    base = non_default_fields(run)
    base["model"] = {"name": run.model.name, **base.get("model", {})}  # named, even the default
    base = {"model": base.pop("model"), **base}
    return [
        "",
        f"{name} as a grid base (YAML):",
        _indent(yaml.safe_dump(base, sort_keys=False)),
        f"in your training script (Python){note}:",
        _indent(fully_shard_code(run, blocks=blocks)),
        *launch_lines(spec, run, results),
    ]


def _tied_lines(
    outcome: SearchOutcome, spec: SweepSpec, results: pd.DataFrame, best_run_id: str
) -> list[str]:
    """The feasible runs that cannot be told apart from the best one by tokens/s
    (`fsdp_bench.stats.indistinguishable`); nothing when the search's metric is another."""
    from fsdp_bench.report.configs import SCALE_COLUMNS, config_columns, named_apart, varying
    from fsdp_bench.report.ties import tied_with
    from fsdp_bench.search import feasible_run_ids

    if spec.search.metric != "tokens_per_s" or results.empty:
        return []
    feasible = feasible_run_ids(outcome.study, ResultStore(outcome.results_dir), spec)
    tied = tied_with(results[results["run_id"].isin(feasible)], best_run_id)
    if not tied:
        return []
    by_id = results.drop_duplicates("run_id").set_index("run_id")
    columns = varying(results, config_columns(results, SCALE_COLUMNS))
    best = by_id.loc[[best_run_id]].iloc[0]
    return [f"tied with the best: {named_apart(by_id, tied, best, columns)}"]


def _confirmation_lines(confirmation: Confirmation, spec: SweepSpec) -> list[str]:
    """The confirmed winner with its interval, those tied with it, the candidates that
    failed, and the trials' best when the winner is another configuration."""
    lines = [
        f"confirmation: the {len(confirmation.candidates)} best feasible configurations "
        f"measured again, {confirmation.rounds} rounds interleaved in {confirmation.shapes} "
        "job(s), one per world size and node count (runs of different shapes cannot share a "
        "process group: they alternate only within their shape)"
    ]
    winner = confirmation.winner
    if winner is None:
        lines.append("  no candidate was measured again: the trials' best stands unconfirmed")
    else:
        lines.append(f"  confirmed best: {_confirmed(winner, spec)}")
        if confirmation.tied:
            tied = "; ".join(_confirmed(c, spec) for c in confirmation.tied)
            lines.append(f"  tied with the best: {tied}")
    for failed in confirmation.failed:
        lines.append(f"  not confirmed: {_config_name(failed, spec)}: {failed.problem}")
    best = confirmation.trial_best
    if confirmation.winner_differs and best is not None:
        if best in confirmation.tied:
            verdict = "tied with the confirmed best"
        elif best.competes:
            verdict = f"slower when measured again: {best.estimate.value:,.6g} tokens/s"
        else:
            verdict = "not confirmed"
        lines.append(
            f"  the trials' best was another: trial run {best.trial.run_id} "
            f"({best.trial.tokens_per_s:,.6g} tokens/s in its trial), {verdict}"
        )
    if confirmation.error:
        lines.append(f"  the round stopped early: {confirmation.error}")
    return lines


def _confirmed(candidate: Candidate, spec: SweepSpec) -> str:
    """tokens/s with its 95% interval, and which configuration (run id: the confirmation's)."""
    estimate = candidate.estimate
    shown = f"{estimate.value:,.6g} tokens/s"
    if estimate.low is not None and estimate.high is not None:
        shown += f" (95% CI {estimate.low:,.6g}-{estimate.high:,.6g})"
    else:
        shown += " (no 95% CI: fewer than 6 timed steps)"
    return f"{shown}, {_config_name(candidate, spec)}"


def _config_name(candidate: Candidate, spec: SweepSpec) -> str:
    """run <confirmation id> (trial run <id>: the searched axes' values)."""
    run = build(RunConfig, candidate.trial.config)
    values = " ".join(f"{k}={yaml_scalar(get_path(run, k))}" for k in axis_keys(spec))
    confirmed = candidate.confirmed.run_id if candidate.confirmed is not None else "-"
    return f"run {confirmed} (trial run {candidate.trial.run_id}: {values})"


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.rstrip().splitlines()) + "\n"


def print_ranking(results_dir: Path, run_ids: list[str]) -> str | None:
    """The ranking of `run_ids` with its notes; the id of the run to give a launch line for,
    the fastest FSDP2 configuration (`ties.verdict`; None: no run ok)."""
    from fsdp_bench.report.failures import failure_reasons
    from fsdp_bench.report.tables import format_ranking, ranking
    from fsdp_bench.report.ties import noise_text, verdict
    from fsdp_bench.store import load_results

    df = load_results(results_dir)
    table = ranking(df, run_ids)
    print(format_ranking(table))
    if "tie" in table:
        print(f"between-pass noise: {noise_text(df[df['run_id'].isin(run_ids)])}")
    failures = failure_reasons(df[df["run_id"].isin(run_ids)])
    if len(failures):
        count = int(failures["runs"].sum())
        print(f"{count} run{'s' if count > 1 else ''} did not finish ok:")
        for status, reason, runs in failures[["status", "reason", "runs"]].to_numpy().tolist():
            print(f"  {status}, {runs} run{'s' if runs > 1 else ''}: {reason}")
    contended = int(table["contended"].eq(True).sum()) if "contended" in table else 0
    if contended:
        print(
            f"{contended} runs were measured while something else competed for the machine "
            "(contended; see 'contention'); --rerun-contended measures them again"
        )
    lines, chosen = verdict(table, df)
    for line in lines:
        print(line)
    return chosen
