"""Command line: parse, call one function, turn user errors into one line and an exit code."""

from __future__ import annotations

import argparse
import os
import sys
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsdp_bench.errors import FsdpBenchError

if TYPE_CHECKING:
    from fsdp_bench.config.grid import SweepSpec

DEFAULT_GRID = "quickstart.yaml"


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args))
    except FsdpBenchError as err:
        if args.debug:
            raise
        print(f"fsdp-bench: error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt as err:
        print(
            f"\nfsdp-bench: interrupted{f' ({err})' if str(err) else ''}; every finished run "
            "is recorded. Run the same command again to resume.",
            file=sys.stderr,
        )
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fsdp-bench",
        description="Measure which FSDP2 configuration trains your model fastest within memory.",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks of user errors")
    commands = parser.add_subparsers(dest="command", required=True)
    for add in (_sweep_parser, _run_parser, _estimate_parser, _search_parser, _report_parser):
        add(commands).add_argument(
            "--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks"
        )
    return parser


def _sweep_parser(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    sweep = commands.add_parser("sweep", help="run every point of a grid and record the results")
    sweep.add_argument(
        "grid",
        nargs="?",
        help=f"grid YAML file (default: the built-in {DEFAULT_GRID}, a small CPU sweep)",
    )
    sweep.add_argument("--results", type=Path, help="results folder (default: results/<grid name>)")
    sweep.add_argument("--dry-run", action="store_true", help="print the expanded runs and exit")
    sweep.add_argument(
        "--print-launch",
        metavar="RUN_ID",
        help="print the torchrun line and sbatch script that measure this run with "
        "`fsdp-bench run`, and exit",
    )
    sweep.add_argument(
        "--status",
        action="store_true",
        help="where every run is (recorded, running, queued, not submitted) and why",
    )
    sweep.add_argument("--rerun", action="store_true", help="run recorded runs again")
    sweep.add_argument(
        "--rerun-contended",
        action="store_true",
        help="run again the recorded runs measured while something else competed (contended)",
    )
    sweep.add_argument(
        "--verify",
        action="store_true",
        help="check each configuration against a single-process step before timing it",
    )
    sweep.add_argument(
        "--no-prune",
        action="store_true",
        help="launch runs predicted over memory.budget_gib too",
    )
    sweep.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_max_runs(sweep)
    sweep.set_defaults(handler=_sweep)
    return sweep


def _run_parser(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    run = commands.add_parser(
        "run",
        help="every rank of a torchrun or srun launch: measure the grid's runs of its shape",
    )
    run.add_argument("grid", help="grid YAML file")
    run.add_argument("--results", type=Path, help="results folder (default: results/<grid name>)")
    run.add_argument("--verify", action="store_true", help="parity check before timing")
    run.add_argument("--only", nargs="+", default=(), metavar="RUN_ID", help="only these runs")
    _add_max_runs(run)
    run.set_defaults(handler=_run)
    return run


def _estimate_parser(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    estimate = commands.add_parser(
        "estimate", help="predicted peak memory per rank of every run, without a GPU"
    )
    estimate.add_argument("grid", nargs="?", help=f"grid YAML file (default: {DEFAULT_GRID})")
    estimate.add_argument(
        "--results", type=Path, help="results folder (estimates are cached there)"
    )
    estimate.add_argument("--json", action="store_true", help="machine-readable output")
    _add_max_runs(estimate)
    estimate.set_defaults(handler=_estimate)
    return estimate


def _search_parser(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    search = commands.add_parser(
        "search", help="optuna: the fastest configuration of a grid's axes that fits a budget"
    )
    search.add_argument("grid", nargs="?", help=f"grid YAML file (default: {DEFAULT_GRID})")
    search.add_argument("--budget-gib", type=float, help="memory per rank (memory.budget_gib)")
    search.add_argument("--trials", type=int, help="trials in the study (search.trials)")
    search.add_argument("--parallel", type=int, help="trials in flight (search.parallel)")
    search.add_argument(
        "--sampler",
        choices=["additive", "tpe", "random", "grid", "gp"],
        help="search.sampler (default: additive, tpe with --multi-objective)",
    )
    search.add_argument("--seed", type=int)
    search.add_argument("--metric", help="results column to optimise (search.metric)")
    search.add_argument(
        "--confirm-top-k", type=int, help="best configurations measured again (0: none)"
    )
    search.add_argument("--confirm-rounds", type=int, help="interleaved passes to confirm them")
    search.add_argument(
        "--multi-objective", action="store_true", help="optimise the metric and peak memory"
    )
    search.add_argument("--storage", help="optuna storage URL (default: a journal file)")
    search.add_argument("--results", type=Path, help="results folder (default: results/<name>)")
    search.add_argument("--no-prune", action="store_true", help="launch predicted OOMs too")
    search.add_argument("--verify", action="store_true", help="parity check before timing")
    search.add_argument("--no-progress", action="store_true", help="no progress bar")
    search.add_argument(
        "--dry-run",
        action="store_true",
        help="print the space, every point's memory estimate and what would be pruned, and exit",
    )
    search.set_defaults(handler=_search)
    return search


def _report_parser(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    report = commands.add_parser(
        "report", help="figures, report.html and summary.md for a results folder"
    )
    report.add_argument("results", type=Path, help="results folder of a sweep or search")
    report.add_argument(
        "--compare", type=Path, metavar="OTHER", help="a second results folder, side by side"
    )
    report.add_argument("--out", type=Path, help="report folder (default: RESULTS/report)")
    report.add_argument("--svg", action="store_true", help="write SVG figures beside the PNGs")
    report.add_argument(
        "--budget-gib", type=float, help="memory per rank (default: the grid's memory.budget_gib)"
    )
    report.add_argument(
        "--storage", help="the search's optuna storage URL, if it ran with --storage"
    )
    report.set_defaults(handler=_report)
    return report


def _add_max_runs(parser: argparse.ArgumentParser) -> None:
    from fsdp_bench.config.grid import DEFAULT_MAX_RUNS

    parser.add_argument(
        "--max-runs",
        type=_positive_int,
        default=DEFAULT_MAX_RUNS,
        metavar="N",
        help=f"refuse a grid whose axes make more points (default {DEFAULT_MAX_RUNS:,})",
    )


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed; expected an integer >= 1")
    return int(text)


def _grid_path(given: str | None) -> Path:
    if given is not None:
        return Path(given)
    return Path(str(resources.files("fsdp_bench") / "grids" / DEFAULT_GRID))


def _read_grid(given: str | None) -> SweepSpec:
    """The grid named on the command line; a user's model module is found beside it."""
    from fsdp_bench.config.grid import load_grid

    path = _grid_path(given)
    if given is not None:
        _import_user_code_from(path.parent, Path.cwd())
    return load_grid(path)


def _import_user_code_from(*folders: Path) -> None:
    """A user's model (`model.name: package.module:function`) is imported from the grid's
    folder and the working folder, as users expect, here and in every process started from
    here (ranks, estimates, model checks inherit PYTHONPATH; Slurm jobs too, as sbatch
    exports the environment). Appended: installed packages and the standard library win."""
    added = [str(folder.resolve()) for folder in folders]
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths + added))
    sys.path += [folder for folder in dict.fromkeys(added) if folder not in sys.path]


def _load_grid(args: argparse.Namespace) -> SweepSpec:
    """The grid named on the command line, with the command's --max-runs."""
    import dataclasses

    return dataclasses.replace(_read_grid(args.grid), max_runs=args.max_runs)


def _sweep(args: argparse.Namespace) -> int:
    from fsdp_bench.cli import views
    from fsdp_bench.config.grid import expand
    from fsdp_bench.sweep import SweepOptions, results_dir_for, run_sweep

    spec = _load_grid(args)
    if args.print_launch:
        print(views.describe_launch(spec, args.print_launch, results_dir_for(spec, args.results)))
        return 0
    if args.dry_run:
        print(views.describe_expansion(spec, args.results))
        return 0
    if args.status:
        print(views.describe_status(spec, args.results))
        return 0
    options = SweepOptions(
        results_dir=args.results,
        rerun=args.rerun,
        rerun_contended=args.rerun_contended,
        verify=args.verify,
        prune=not args.no_prune,
        progress=not args.no_progress,
    )
    total = len(expand(spec).runs)
    print(f"sweep {spec.name}: {total} runs -> {results_dir_for(spec, args.results)}")
    outcome = run_sweep(spec, options)
    if outcome.already_recorded and not args.rerun:
        print(f"{outcome.already_recorded} runs were already recorded (--rerun runs them again)")
    best = views.print_ranking(outcome.results_dir, outcome.run_ids)
    if best is not None:
        print(views.describe_launch(spec, best, outcome.results_dir))
    print(f"figures and a summary: fsdp-bench report {outcome.results_dir}")
    return 0


def _run(args: argparse.Namespace) -> int:
    from fsdp_bench.cli import views
    from fsdp_bench.launch.in_place import InPlaceOptions, run_in_place
    from fsdp_bench.sweep import results_dir_for

    spec = _load_grid(args)
    results = results_dir_for(spec, args.results)
    outcome = run_in_place(spec, InPlaceOptions(results, args.verify, tuple(args.only)))
    if outcome.rank == 0 and outcome.run_ids:
        views.print_ranking(results, outcome.run_ids)  # no launch lines: this is one already
    return 0


def _estimate(args: argparse.Namespace) -> int:
    from fsdp_bench.cli import estimate_views

    spec = _load_grid(args)
    print(estimate_views.describe_estimates(spec, args.results, args.json))
    return 0


SEARCH_FLAGS = (
    "trials",
    "parallel",
    "sampler",
    "seed",
    "metric",
    "confirm_top_k",
    "confirm_rounds",
)
"""Command-line flags that override the search section's key of that name."""


def _search(args: argparse.Namespace) -> int:
    import dataclasses

    from fsdp_bench.cli import estimate_views, views
    from fsdp_bench.search import SearchOptions, run_search

    spec = _read_grid(args.grid)
    overrides = {k: getattr(args, k) for k in SEARCH_FLAGS if getattr(args, k) is not None}
    if args.multi_objective:
        overrides["multi_objective"] = True
    spec = dataclasses.replace(spec, search=_replace_checked(spec.search, overrides))
    if args.budget_gib is not None:
        memory = _replace_checked(spec.memory, {"budget_gib": args.budget_gib})
        spec = dataclasses.replace(spec, memory=memory)
    if args.dry_run:
        print(estimate_views.describe_search_plan(spec, args.results, prune=not args.no_prune))
        return 0
    options = SearchOptions(
        results_dir=args.results,
        storage=args.storage,
        prune=not args.no_prune,
        verify=args.verify,
        progress=not args.no_progress,
    )
    outcome = run_search(spec, options)
    print(views.describe_search(outcome, spec))
    print(f"figures and a summary: fsdp-bench report {outcome.results_dir}")
    return 0


def _report(args: argparse.Namespace) -> int:
    from fsdp_bench.report.build import build_report

    if args.budget_gib is not None:  # validated as the grid's memory.budget_gib is
        from fsdp_bench.config.grid_settings import MemoryConfig

        _replace_checked(MemoryConfig(), {"budget_gib": args.budget_gib})
    outcome = build_report(
        args.results,
        out=args.out,
        compare=args.compare,
        svg=args.svg,
        budget_gib=args.budget_gib,
        storage=args.storage,
    )
    for path in outcome.paths:
        print(path)
    for figure in outcome.figures:
        if figure.skipped:
            print(f"not drawn: {figure.title}: {figure.skipped}")
    print(outcome.headline)
    if outcome.comparison:
        print(f"Compared with {args.compare}: {outcome.comparison}")
    return 0


def _replace_checked(config: Any, changes: dict[str, Any]) -> Any:
    """A config with command-line values, validated like the grid's (one-line errors that
    name the flag)."""
    import dataclasses

    from fsdp_bench.errors import FieldError

    try:
        return dataclasses.replace(config, **changes)
    except FieldError as err:
        err.key = "--" + err.key.replace("_", "-")
        raise err.located("") from None


if __name__ == "__main__":
    sys.exit(main())
