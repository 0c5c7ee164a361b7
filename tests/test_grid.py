"""Grid files: expansion, exclusions, stable run ids, and every validation error a user can hit."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from fsdp_bench.config.fsdp import FsdpConfig
from fsdp_bench.config.grid import expand, load_grid, parse_grid
from fsdp_bench.config.model import ModelConfig
from fsdp_bench.config.run import RunConfig, TrainConfig
from fsdp_bench.errors import ConfigError


def grid(**sections: Any) -> dict[str, Any]:
    return {"name": "g", **sections}


def runs_of(data: dict[str, Any]) -> list[RunConfig]:
    return expand(parse_grid(data)).runs


def error_of(data: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        expand(parse_grid(data, source="grid.yaml"))
    message = str(info.value)
    assert "\n" not in message, "errors are one line"
    return message


def test_cartesian_product_in_axis_order() -> None:
    runs = runs_of(
        grid(axes={"world_size": [1, 2], "fsdp.grouping": ["root", "block", "blocks:2"]})
    )
    assert [(r.world_size, r.fsdp.grouping) for r in runs] == [
        (1, "root"),
        (1, "block"),
        (1, "blocks:2"),
        (2, "root"),
        (2, "block"),
        (2, "blocks:2"),
    ]


def test_base_values_reach_every_run() -> None:
    runs = runs_of(
        grid(
            base={"data": {"seq_len": 64}, "train": {"accumulation_steps": 4}},
            axes={"world_size": [1, 2]},
        )
    )
    assert {(r.data.seq_len, r.train.accumulation_steps) for r in runs} == {(64, 4)}


def test_exclude_matches_values_and_lists() -> None:
    runs = runs_of(
        grid(
            base={"world_size": 4},
            axes={
                "world_size": [2, 4],
                "fsdp.reshard_after_forward": [True, False, 2],
                "fsdp.grouping": ["root", "linear"],
            },
            exclude=[
                {"world_size": 2, "fsdp.reshard_after_forward": 2},
                {"fsdp.grouping": "linear", "fsdp.reshard_after_forward": [True, False]},
            ],
        )
    )
    points = {(r.world_size, r.fsdp.reshard_after_forward, r.fsdp.grouping) for r in runs}
    assert (2, 2, "root") not in points
    assert (4, True, "linear") not in points
    assert (4, 2, "linear") in points
    assert (2, True, "root") in points
    assert len(runs) == 12 - 2 - 4  # rule 1 drops 2 points, rule 2 drops 4, none twice


def test_exclude_tells_true_from_one() -> None:
    runs = runs_of(
        grid(
            axes={"fsdp.reshard_after_forward": [True, 1]},
            exclude=[{"fsdp.reshard_after_forward": 1}],
        )
    )
    assert [r.fsdp.reshard_after_forward for r in runs] == [True]


def test_list_of_products_is_their_union_without_duplicates() -> None:
    runs = runs_of(
        grid(
            axes=[
                {"fsdp.grouping": ["root", "block"]},
                {"fsdp.prefetch": [1, 2]},
                {"fsdp.grouping": ["block"]},  # equal to a run of the first product
            ]
        )
    )
    assert [(r.fsdp.grouping, r.fsdp.prefetch) for r in runs] == [
        ("root", "implicit"),
        ("block", "implicit"),
        ("block", 1),
        ("block", 2),
    ]


def test_ddp_runs_ignore_fsdp_only_settings() -> None:
    expansion = expand(
        parse_grid(
            grid(
                axes={
                    "strategy": ["fsdp", "ddp"],
                    "fsdp.grouping": ["root", "block"],
                    "fsdp.mixed_precision": ["fp32", "bf16"],
                }
            )
        )
    )
    ddp = [r for r in expansion.runs if r.strategy == "ddp"]
    assert len(ddp) == 2  # grouping does not apply to DDP; mixed precision does
    assert {r.fsdp.mixed_precision for r in ddp} == {"fp32", "bf16"}
    assert expansion.collapsed == 2


def test_one_group_for_the_whole_model_is_never_resharded_after_forward() -> None:
    """FSDP2 keeps the root group unsharded after forward unless asked explicitly: with
    `grouping: root` false is the default, one run; true and an int reshard it, runs of
    their own."""
    expansion = expand(
        parse_grid(
            grid(
                base={"world_size": 4},
                axes={
                    "fsdp.grouping": ["root", "block"],
                    "fsdp.reshard_after_forward": ["default", False, True, 2],
                },
            )
        )
    )
    root = [r.fsdp.reshard_after_forward for r in expansion.runs if r.fsdp.grouping == "root"]
    assert sorted(map(str, root)) == ["2", "True", "default"]
    assert expansion.collapsed == 1
    assert len(expansion.runs) == 7


def test_grouping_list_form_is_canonical() -> None:
    runs = runs_of(
        grid(base={"fsdp": {"grouping": ["layers.*.attention", "layers.*.feed_forward"]}})
    )
    assert runs[0].fsdp.grouping == "modules:layers.*.attention,layers.*.feed_forward"


def test_run_id_is_stable_and_ignores_how_it_was_written() -> None:
    a = RunConfig(world_size=2, fsdp=FsdpConfig(grouping="block"))
    b = runs_of(grid(base={"world_size": 2, "fsdp": {"grouping": "block"}}))[0]
    assert a.run_id == b.run_id
    assert a.run_id != RunConfig(world_size=2, fsdp=FsdpConfig(grouping="root")).run_id
    # reshard true and reshard 1 are different settings even though True == 1 in Python
    t = RunConfig(world_size=2, fsdp=FsdpConfig(reshard_after_forward=True))
    one = RunConfig(world_size=2, fsdp=FsdpConfig(reshard_after_forward=1))
    assert t.run_id != one.run_id


def test_run_id_is_the_same_in_another_process() -> None:
    config = RunConfig(
        world_size=4,
        model=ModelConfig(name="small", tie_embeddings=True),
        train=TrainConfig(accumulation_steps=2, grad_sync="last", learning_rate=3e-4),
    )
    code = (
        "from fsdp_bench.config import *\n"
        "print(RunConfig(world_size=4, model=ModelConfig(name='small', tie_embeddings=True),"
        " train=TrainConfig(accumulation_steps=2, grad_sync='last', learning_rate=3e-4)).run_id)"
    )
    other = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "123", "PATH": ""},
    ).stdout.strip()
    assert other == config.run_id


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (
            grid(base={"fsdp": {"groupin": "block"}}),
            "grid.yaml: base.fsdp.groupin: unknown key; did you mean 'grouping'? valid keys: "
            "grouping, reshard_after",
        ),
        (
            grid(axes={"fsdp.reshard": [True]}),
            "grid.yaml: axes.fsdp.reshard: unknown key; did you mean 'fsdp.reshard_after_forward'? "
            "valid keys in fsdp: grouping, reshard_after_forward, prefetch,",
        ),
        (
            grid(axes={"fsdp.reshard_after_foward": [True]}),
            "axes.fsdp.reshard_after_foward: unknown key; "
            "did you mean 'fsdp.reshard_after_forward'",
        ),
        (
            grid(axes={"fsdb.grouping": ["root"]}),
            "axes.fsdb.grouping: unknown key; did you mean 'fsdp.grouping'? valid sections: data.,",
        ),
        (
            grid(bogus=1),
            "grid.yaml: bogus: unknown key; valid keys: name, description, base, axes",
        ),
        (
            grid(base={"world_size": "two"}),
            "grid.yaml: base.world_size: 'two' is not allowed; expected an integer",
        ),
        (
            grid(base={"world_size": True}),
            "grid.yaml: base.world_size: true is not allowed; expected an integer",
        ),
        (
            grid(base={"fsdp": {"reshard_after_forward": "maybe"}}),
            "base.fsdp.reshard_after_forward: 'maybe' is not allowed; "
            "expected one of true, false, default, all_but_last or an integer",
        ),
        (
            grid(base={"measure": {"warmup_steps": 0}}),
            "grid.yaml: base.measure.warmup_steps: 0 is not allowed; expected an integer >= 1",
        ),
        (
            grid(base={"world_size": 6, "processes_per_node": 4}),
            "base.processes_per_node: 4 is not allowed; must divide world_size 6",
        ),
        (
            grid(axes={"world_size": [2, 3], "fsdp.reshard_after_forward": [2]}),
            "grid.yaml: run {world_size: 3, fsdp.reshard_after_forward: 2}: "
            "fsdp.reshard_after_forward: 2 is not allowed; an int must divide the shard group "
            "size (3 ranks): allowed true, false, default or one of 1, 3",
        ),
        (
            grid(base={"train": {"accumulation_steps": 0}}),
            "base.train.accumulation_steps: 0 is not allowed; expected an integer >= 1",
        ),
        (
            grid(axes={"train.accumulation_steps": [1, 0]}),
            "axes.train.accumulation_steps[1]: 0 is not allowed; expected an integer >= 1",
        ),
        (
            grid(base={"model": {"name": "gpt-5"}}),
            "base.model.name: 'gpt-5' is not allowed; expected one of tiny, small, llama3-1b",
        ),
        (
            grid(base={"fsdp": {"grouping": "blocks:0"}}),
            "base.fsdp.grouping: 'blocks:0' is not allowed; expected root, block, blocks:K",
        ),
        (
            grid(base={"fsdp": {"grouping": "blocks:9"}}),
            "base.fsdp.grouping: 'blocks:9' is not allowed; K must be at most the model's 4 blocks",
        ),
        (
            grid(base={"fsdp": {"prefetch": 0}}),
            "base.fsdp.prefetch: 0 is not allowed; expected implicit or a depth >= 1",
        ),
        (
            grid(axes={"world_size": [1, 1]}),
            "axes.world_size[1]: 1 is not allowed; each value may appear only once",
        ),
        (
            grid(axes={"world_size": []}),
            "axes.world_size: [] is not allowed; expected a non-empty list of values",
        ),
        (
            grid(base={"fsdp": {"mixed_precision": "fp16"}}),
            "base.fsdp.mixed_precision: 'fp16' is not allowed; expected one of fp32, bf16",
        ),
        (
            grid(base={"fsdp": {"activation_checkpointing": "every_0"}}),
            "base.fsdp.activation_checkpointing: 'every_0' is not allowed; expected none, block, "
            "every_N (N >= 1) or selective_op",
        ),
        (
            grid(base={"fsdp": {"reduce_dtype": "fp16"}}),
            "base.fsdp.reduce_dtype: 'fp16' is not allowed; expected one of fp32, bf16",
        ),
        (
            grid(base={"model": {"dtype": "bf16"}}),
            "base.model.dtype: 'bf16' is not allowed; bf16 storage computes in bf16: set "
            "fsdp.mixed_precision: bf16 as well",
        ),
        (
            grid(base={"train": {"optimizer_impl": "apex"}}),
            "base.train.optimizer_impl: 'apex' is not allowed; expected one of foreach, fused, "
            "for_loop",
        ),
        (
            grid(base={"train": {"max_grad_norm": 0}}),
            "base.train.max_grad_norm: 0.0 is not allowed; expected a number > 0 or null",
        ),
        (
            grid(base={"world_size": 4, "tp_size": 2, "train": {"compile_loss": True}}),
            "train.compile_loss: true is not allowed; compiles the loss on whole logits: needs "
            "tp_size 1, not 2",
        ),
        (
            grid(launcher={"kind": "kubernetes"}),
            "launcher.kind: 'kubernetes' is not allowed; expected one of local",
        ),
        (
            {"name": "bad name!"},
            "grid.yaml: name: 'bad name!' is not allowed; expected a name of letters",
        ),
    ],
)
def test_validation_errors_name_key_value_and_what_is_allowed(
    data: dict[str, Any], expected: str
) -> None:
    assert expected in error_of(data)


def test_yaml_problems_are_one_line_errors(tmp_path: Path) -> None:
    path = tmp_path / "dup.yaml"
    path.write_text("name: a\nbase:\n  world_size: 2\n  world_size: 4\n")
    with pytest.raises(ConfigError, match="key 'world_size' appears twice"):
        load_grid(path)
    path.write_text("name: a\nbase: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_grid(path)
    with pytest.raises(ConfigError, match="cannot read"):
        load_grid(tmp_path / "missing.yaml")


def test_cli_reports_bad_grid_in_one_line_with_exit_code_2(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("name: bad\nbase:\n  train:\n    accumulation_steps: 0\n")
    command = [
        sys.executable,
        "-m",
        "fsdp_bench",
        "sweep",
        str(path),
        "--results",
        str(tmp_path),
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"fsdp-bench: error: {path}: base.train.accumulation_steps: 0 is not allowed; "
        "expected an integer >= 1"
    ]
    assert not list(tmp_path.glob("runs/*")), "nothing ran"
    debug = subprocess.run([*command[:3], "--debug", *command[3:]], capture_output=True, text=True)
    assert debug.returncode != 0 and "Traceback" in debug.stderr


def test_dry_run_lists_runs_without_running(tmp_path: Path) -> None:
    path = tmp_path / "g.yaml"
    path.write_text(
        "name: g\naxes:\n"
        "  fsdp.grouping: [root, block]\n"
        "  fsdp.reshard_after_forward: [true, false]\n"
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "fsdp_bench",
            "sweep",
            str(path),
            "--dry-run",
            "--results",
            str(tmp_path / "r"),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    lines = done.stdout.strip().splitlines()
    header = ["run_id", "grouping", "reshard_after_forward", "nodes", "job", "recorded"]
    assert lines[0].split() == header
    assert len(lines) == 1 + 4 + 1
    assert lines[1].split()[1:] == ["root", "true", "1", "1", "no"]
    assert lines[-1] == ("4 runs in 1 jobs (0 excluded, 0 equal to another run): 1 job of 4 runs "
                         "at world size 1 on 1 node; 1 job in flight at once")  # fmt: skip
    assert not (tmp_path / "r").exists()


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fsdp_bench", *args], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (
            b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR",
            "not a text file in UTF-8 (byte 0x89 at offset 0)",
        ),
        (
            "name: g\n".encode("utf-16"),
            "not a text file in UTF-8 (byte 0xff at offset 0); it is UTF-16: save it as UTF-8",
        ),
    ],
    ids=["png", "utf-16"],
)
def test_cli_reports_undecodable_grid_in_one_line(
    tmp_path: Path, content: bytes, expected: str
) -> None:
    path = tmp_path / "grid.yaml"
    path.write_bytes(content)
    done = cli("sweep", str(path), "--dry-run", "--results", str(tmp_path / "r"))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f"fsdp-bench: error: {path}: {expected}"]
    assert "Traceback" not in done.stderr


def test_undecodable_bytes_are_located(tmp_path: Path) -> None:
    path = tmp_path / "grid.yaml"
    path.write_bytes(b"name: g\n\xc3\x28")  # a UTF-8 lead byte without its continuation
    with pytest.raises(ConfigError) as info:
        load_grid(path)
    assert str(info.value) == f"{path}: not a text file in UTF-8 (byte 0xc3 at offset 8)"
    path.write_bytes(b"\x80" + random.Random(0).randbytes(4096))
    with pytest.raises(ConfigError, match=r"not a text file in UTF-8 \(byte 0x80 at offset 0\)$"):
        load_grid(path)


@pytest.mark.parametrize("character", ["\x00", "\x07", "\x1b"])
def test_control_characters_are_one_line_errors(tmp_path: Path, character: str) -> None:
    path = tmp_path / "grid.yaml"
    path.write_text(f"name: g\naxes:\n  world_size: [1, 2{character}]\n", encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_grid(path)
    assert str(info.value) == (
        f"{path}: not valid YAML: character #x{ord(character):04x} at line 3, column 20: "
        "control characters are not allowed"
    )


def huge_grid() -> dict[str, Any]:
    """10^12 points: six axes of 100 values (it could never be expanded)."""
    keys = ["data.seed", "data.seq_len", "data.micro_batch_size", "measure.timed_steps",
            "measure.repeats", "train.accumulation_steps"]  # fmt: skip
    return grid(axes={key: list(range(1, 101)) for key in keys})


def test_a_huge_grid_is_refused_by_counting_not_expanding(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import fsdp_bench.config.grid as grid_module

    def never(*args: Any) -> None:
        raise AssertionError("a point was built")

    monkeypatch.setattr(grid_module, "_build_run", never)
    monkeypatch.setattr(grid_module, "_matches", never)
    spec = parse_grid(huge_grid(), source="grid.yaml")
    assert grid_module.point_count(spec) == 10**12
    with pytest.raises(ConfigError) as info:
        expand(spec)
    assert str(info.value) == (
        "grid.yaml: the axes make 1,000,000,000,000 points (before exclude: rules and merging "
        "equal runs), more than the limit of 100,000; split the grid, or raise the limit with "
        "--max-runs 1000000000000"
    )


def test_point_count_sums_products_before_exclusions() -> None:
    from fsdp_bench.config.grid import point_count

    spec = parse_grid(
        grid(
            axes=[{"world_size": [1, 2], "fsdp.grouping": ["root", "block"]}, {"data.seed": [1]}],
            exclude=[{"world_size": 1}],
        )
    )
    assert point_count(spec) == 2 * 2 + 1
    assert point_count(parse_grid(grid())) == 1  # no axes: the base run


def test_max_runs_flag_sets_the_limit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fsdp_bench.cli.main import main

    path = tmp_path / "g.yaml"
    path.write_text(
        yaml.safe_dump(grid(axes={"data.seed": list(range(40)), "world_size": [1, 2, 4]}))
    )
    results = ["--results", str(tmp_path / "r")]
    assert main(["sweep", str(path), "--dry-run", "--max-runs", "100", *results]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"fsdp-bench: error: {path}: the axes make 120 points (before exclude: rules and merging "
        "equal runs), more than the limit of 100; split the grid, or raise the limit with "
        "--max-runs 120"
    ]
    assert main(["sweep", str(path), "--dry-run", "--max-runs", "200", *results]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("120 runs in")
    for command in (["sweep", str(path), "--status"], ["estimate", str(path)]):
        assert main([*command, "--max-runs", "100", *results]) == 2
        assert "more than the limit of 100;" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
    with pytest.raises(SystemExit) as info:
        main(["sweep", str(path), "--dry-run", "--max-runs", "0"])
    assert info.value.code == 2
    assert "--max-runs: '0' is not allowed; expected an integer >= 1" in capsys.readouterr().err


def test_an_unknown_axis_lists_its_own_section_not_every_key() -> None:
    """A typo among 50-odd axis paths: one line of its section's 17 keys (it was 1,000
    characters, every section's)."""
    message = error_of(grid(axes={"fsdp.reshard_after_foward": [True]}))
    assert len(message) < 500 and "train." not in message and "world_size" not in message


def test_settings_that_cannot_run_are_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match=r"last' is not allowed; .*needs strategy hsdp"):
        RunConfig(
            world_size=2, train=TrainConfig(accumulation_steps=2, grad_sync="all_reduce_last")
        )
    with pytest.raises(ConfigError, match="needs CUDA"):
        RunConfig(fsdp=FsdpConfig(symm_mem=True)).check_device("cpu")
    RunConfig(fsdp=FsdpConfig(symm_mem=True)).check_device("cuda")
    with pytest.raises(ConfigError, match="reduce_scatter_buffers"):
        FsdpConfig(reduce_scatter_buffers=0)
