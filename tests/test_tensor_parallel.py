"""FSDP2 with tensor parallelism on a 2-D mesh (shard x tp): a real sweep on gloo with parity,
collectives counted per mesh dimension and stated exactly, validation one line each."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_bench.config import DataConfig, ModelConfig, RunConfig
from fsdp_bench.config.fsdp import FsdpConfig
from fsdp_bench.errors import CombinationError
from tests.conftest import sweep, tiny_grid, write_grid

# tiny: dim 128, 4 blocks, 4 heads (2 key/value, head_dim 32), ffn 384, vocab 1024; fp32
ACTIVATION_BYTES = 1 * 128 * 128 * 4  # micro-batch 1 x seq 128 x dim 128, fp32: 64 KiB
TOKEN_BYTES = 1 * 128 * 4  # one fp32 number per token
BLOCK_LINEARS = 128 * 128 * 2 + 64 * 128 * 2 + 3 * 384 * 128  # wq wo, wk wv, w1 w2 w3
BLOCK_BYTES_PER_TP_RANK = (BLOCK_LINEARS // 2 + 2 * 128) * 4  # linears split, norms whole
ROOT_BYTES_PER_TP_RANK = (2 * 1024 * 128 // 2 + 128) * 4  # embedding, output split; norm


@pytest.mark.slow
def test_tp_sweep_trains_correctly_and_counts_collectives_per_dimension(tmp_path: Path) -> None:
    """tiny at world size 4 over tp_size [1, 2], HSDP x TP (2 replicas x 1 shard x tp 2),
    small (8 key/value heads) at tp_size 4, and tensorwise float8 at tp_size 2 (torchao's
    float8 tensor-parallel styles; float8 all-gather on the shard dimension), with --verify:
    parity holds, and the memory estimate made before launch is within 5% of the peak
    tracked in the run.

    tp_size 2 (mesh 2 x 2, sequence parallel). On the shard dimension FSDP2 does what it does
    without TP, on parameters half the size: 5 all-gathers in forward (root, 4 blocks), 4 in
    backward (blocks resharded, the root kept), 5 reduce-scatters. On the tp dimension, per
    block and pass, 2 all-gathers (the sequence gathered before attention and before the
    MLP in forward; the row-parallel outputs' gradients in backward) and 2 reduce-scatters
    (wo's and w2's outputs to the sequence shards; the inputs' gradients): 16 and 16; the
    embedding's output is reduce-scattered (its gradient all-gathered), the output
    projection gathers its input (its gradient reduce-scattered): 18 all-gathers and 18
    reduce-scatters of whole activations. All-reduces: the gradient of each of the 9 norms'
    weights (replicated over tp), and 3 for the loss on logits split by vocabulary (each
    token's largest logit, its sum of exponentials, its target's logit)."""
    axes = [
        {"tp_size": [1, 2]},
        {"tp_size": [2], "strategy": ["hsdp"], "fsdp.shard_group_size": [2]},
        {"tp_size": [4], "model.name": ["small"]},
        {"tp_size": [2], "train.float8": ["tensorwise"], "fsdp.float8_all_gather": [True],
         "tp_sequence_parallel": [False]},
    ]  # fmt: skip
    _, df = sweep(tmp_path, tiny_grid("tp", axes, world_size=4), verify=True)
    assert set(df.status) == {"ok"} and df.parity_ok.all(), df[["status", "reason"]].to_string()
    error = (df.estimated_peak_gib / df.tracked_peak_gib - 1).abs()
    assert (error < 0.05).all(), df[["tp_size", "estimated_peak_gib", "tracked_peak_gib"]]
    hsdp = df[df.strategy == "hsdp"].iloc[0]
    assert set(hsdp.collectives_per_dimension) == {"replicate", "tp"}  # shards of one rank
    assert hsdp.collectives_per_dimension["replicate"]["all_reduces"] == 5  # one per group
    plain = df[(df.strategy == "fsdp") & (df.float8 == "none")]
    by_tp = {int(row.tp_size): row for row in plain.itertuples()}
    assert by_tp[1].collectives_per_dimension == {
        "shard": {
            "all_gathers": 9,
            "all_gather_bytes": by_tp[1].all_gather_bytes_per_step,
            "reduce_scatters": 5,
            "reduce_scatter_bytes": by_tp[1].reduce_scatter_bytes_per_step,
        }
    }
    assert by_tp[2].collectives_per_dimension == {
        "shard": {
            "all_gathers": 9,
            "all_gather_bytes": ROOT_BYTES_PER_TP_RANK + 8 * BLOCK_BYTES_PER_TP_RANK,
            "reduce_scatters": 5,
            "reduce_scatter_bytes": ROOT_BYTES_PER_TP_RANK + 4 * BLOCK_BYTES_PER_TP_RANK,
        },
        "tp": {
            "all_gathers": 18,
            "all_gather_bytes": 18 * ACTIVATION_BYTES,
            "reduce_scatters": 18,
            "reduce_scatter_bytes": 18 * ACTIVATION_BYTES,
            "all_reduces": 9 + 3,
            "all_reduce_bytes": 9 * 128 * 4 + 3 * TOKEN_BYTES,
        },
    }


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"world_size": 4, "tp_size": 3}, "must divide world_size 4: one of 1, 2, 4"),
        ({"world_size": 4, "tp_size": 4}, "must divide the model's n_kv_heads (2): one of 1, 2"),
        (
            {"world_size": 4, "tp_size": 2, "strategy": "ddp"},
            "runs with strategy fsdp or hsdp, not ddp",
        ),
        ({"world_size": 4, "tp_size": 2, "processes_per_node": 1}, "stays inside a node"),
        (
            {"world_size": 6, "tp_size": 2, "processes_per_node": 3, "tp_across_nodes": True},
            "must be a multiple of processes_per_node 3 (whole nodes per group)",
        ),
    ],
)
def test_bad_tp_sizes_get_one_line(settings: dict[str, object], message: str) -> None:
    with pytest.raises(CombinationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        RunConfig(model=ModelConfig(name="tiny"), data=DataConfig(seq_len=64), **settings)


def test_simulations_in_one_process_do_not_share_process_groups() -> None:
    """An HSDP x TP simulation after a TP one without sequence parallel, in one process: the
    second used to get the first world's tensor-parallel group back (torch's per-thread state
    keyed by meshes that compare equal) and failed on a sequence gathered twice."""
    from fsdp_bench.memory.simulate import simulate_alike

    tp = RunConfig(
        world_size=4, tp_size=2, model=ModelConfig(name="tiny"), data=DataConfig(seq_len=128)
    )
    hsdp_tp = dataclasses.replace(tp, strategy="hsdp", fsdp=FsdpConfig(shard_group_size=2))
    simulate_alike([dataclasses.replace(tp, tp_sequence_parallel=False)])
    assert simulate_alike([hsdp_tp])[0].peak_bytes > 0  # it raised a shape error before


@pytest.mark.slow
def test_compiled_blocks_with_tensor_parallelism_are_simulated_from_the_partition() -> None:
    """Compiled blocks under TP run AOTAutograd's partition in the simulation, which saves
    less than eager (on the CPU the allocator's peak of such runs: -0.9% and -9.4% from the
    partition's estimate, +15% and +12% from eager's: sweeps/compiled-cpu.yaml); whole blocks
    checkpointed are estimated as eager (the compiled checkpoint saves a DeviceMesh)."""
    from fsdp_bench.config.run import TrainConfig
    from fsdp_bench.memory.compiled import compiled_as
    from fsdp_bench.memory.simulate import simulate

    eager = RunConfig(
        world_size=4, tp_size=2, model=ModelConfig(name="tiny"), data=DataConfig(seq_len=128)
    )
    compiled = dataclasses.replace(eager, train=TrainConfig(compile="block"))
    assert compiled_as(compiled) == "partition"
    assert simulate(compiled).peak_bytes < simulate(eager).peak_bytes
    full_ac = dataclasses.replace(compiled, fsdp=FsdpConfig(activation_checkpointing="block"))
    assert compiled_as(full_ac) == "eager"
    assert simulate(full_ac).peak_bytes > 0


def test_a_tensor_parallel_group_shares_its_batch() -> None:
    """A step's tokens are counted once per tensor-parallel group (throughput, MFU)."""
    run = RunConfig(world_size=4, tp_size=2, model=ModelConfig(name="tiny"))
    assert (run.dp_size, run.mesh_shape, run.mesh_dim_names) == (2, (2, 2), ("shard", "tp"))
    assert run.tokens_per_step == 2 * run.data.seq_len
    across = dataclasses.replace(run, processes_per_node=1, tp_across_nodes=True)
    assert across.nodes == 4 and across.mesh_shape == (2, 2)  # asked for: a group spans nodes


def test_a_bad_tp_size_in_a_grid_exits_2_with_one_line(tmp_path: Path) -> None:
    grid = write_grid(tmp_path, tiny_grid("bad-tp", {"tp_size": [3]}, world_size=4))
    done = subprocess.run(
        [sys.executable, "-m", "fsdp_bench", "sweep", str(grid), "--dry-run"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert "tp_size: 3 is not allowed; must divide world_size 4" in done.stderr


def _run_generated_code(rank: int, world: int, store_path: str) -> None:
    """One rank of `test_the_generated_code_runs_tensor_parallel` (top level: spawned)."""
    import torch
    import torch.distributed as dist

    from fsdp_bench.cli.codegen import fully_shard_code
    from fsdp_bench.job.model.zoo import build_model
    from fsdp_bench.job.training import loss_fn, rank_batches

    dist.init_process_group(
        "gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world
    )
    try:
        run = RunConfig(world_size=world, tp_size=2, model=ModelConfig(name="tiny"),
                        data=DataConfig(seq_len=16))  # fmt: skip
        inputs, targets = rank_batches(run, rank, 1024, torch.device("cpu"))[0]
        namespace = {"model": build_model(run.model).module, "loss_fn": loss_fn,
                     "inputs": inputs, "targets": targets}  # fmt: skip
        exec(compile(fully_shard_code(run, device="cpu"), "<generated>", "exec"), namespace)
        assert all(p.grad is None for p in namespace["model"].parameters())
    finally:
        dist.destroy_process_group()


def test_the_generated_code_runs_tensor_parallel(tmp_path: Path) -> None:
    """The printed mesh, TP plan, fully_shard calls and loss_parallel step, run as printed on
    two gloo ranks (one data-parallel shard x tp 2)."""
    import torch.multiprocessing as mp

    mp.spawn(_run_generated_code, args=(2, str(tmp_path / "store")), nprocs=2)


def test_the_report_plots_the_fastest_run_at_each_world_size_and_tp_size() -> None:
    import pandas as pd

    from fsdp_bench.report.figure_data import tensor_parallel_points

    rows = [  # (world size, tp_size, tokens/s, peak GiB, status)
        (4, 1, 100.0, 2.0, "ok"), (4, 1, 120.0, 2.5, "ok"), (4, 2, 90.0, 1.2, "ok"),
        (8, 2, 150.0, 1.1, "ok"), (8, 4, 300.0, 0.5, "oom"),
    ]  # fmt: skip
    df = pd.DataFrame(
        [{"world_size": w, "tp_size": t, "tokens_per_s": s, "tokens_per_s_ci_low": s - 1,
          "tokens_per_s_ci_high": s + 1, "peak_memory_gib": m, "status": st, "run_id": str(i)}
         for i, (w, t, s, m, st) in enumerate(rows)]
    )  # fmt: skip
    points = tensor_parallel_points(df)
    assert points[["world_size", "tp_size", "tokens_per_s", "peak_memory_gib"]].values.tolist() == [
        [4, 1, 120.0, 2.5], [4, 2, 90.0, 1.2], [8, 2, 150.0, 1.1],
    ]  # fmt: skip
    assert tensor_parallel_points(df[df.tp_size == 1]).empty  # tp_size does not vary


@pytest.mark.slow
def test_a_transformers_model_runs_the_plan_its_config_ships(tmp_path: Path) -> None:
    """A tiny transformers Llama at 2 x 2 with its config's base_model_tp_plan (and the head
    split by vocabulary) trains as one process does; a GPT-2, whose config has no plan, is
    refused before launch in one line, exit 2."""
    from transformers import GPT2Config, LlamaConfig

    LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=256,
    ).save_pretrained(tmp_path / "llama")  # fmt: skip
    GPT2Config(
        n_embd=64,
        n_layer=2,
        n_head=4,
        vocab_size=256,
        n_positions=256,
        bos_token_id=0,
        eos_token_id=0,
    ).save_pretrained(tmp_path / "gpt2")
    grid = tiny_grid("tp-hf", {"tp_size": [2]}, world_size=4)
    grid["base"]["model"] = {"name": f"hf:{tmp_path / 'llama'}"}
    grid["base"]["data"] = {"seq_len": 32}
    _, df = sweep(tmp_path, grid, verify=True)
    assert set(df.status) == {"ok"} and df.parity_ok.all(), df[["status", "reason"]].to_string()
    assert set(df.collectives_per_dimension.iloc[0]) == {"shard", "tp"}

    grid["name"], grid["base"]["model"] = "tp-gpt2", {"name": f"hf:{tmp_path / 'gpt2'}"}
    done = subprocess.run(
        [sys.executable, "-m", "fsdp_bench", "sweep", str(write_grid(tmp_path, grid)), "--dry-run"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert "GPT2LMHeadModel has no tensor-parallel plan" in done.stderr


def test_tp_size_is_a_search_axis_whose_invalid_points_are_rejected_trials(
    tmp_path: Path,
) -> None:
    """A search over tp_size [1, 2, 3] at world size 4 (3 divides neither it nor the heads):
    the points of tp_size 3 are rejected trials, named why, never launched; the best of the
    recorded points is found."""
    from fsdp_bench.config.grid import load_grid, run_for_point
    from fsdp_bench.config.schema import to_plain
    from fsdp_bench.search.searcher import SearchOptions, best_feasible, run_search
    from fsdp_bench.store import ResultStore, RunResult

    grid = tiny_grid("tp-search", {"tp_size": [1, 2, 3], "fsdp.grouping": ["block", "root"]},
                     world_size=4)  # fmt: skip
    grid["search"] = {"trials": 6, "seed": 0, "sampler": "grid", "confirm_top_k": 0}
    spec = load_grid(write_grid(tmp_path, grid))
    store = ResultStore(tmp_path / "r")
    speeds = {(1, "block"): 100.0, (1, "root"): 90.0, (2, "block"): 120.0, (2, "root"): 80.0}
    for (tp, grouping), tokens in speeds.items():
        run = run_for_point(spec, {"tp_size": tp, "fsdp.grouping": grouping})
        assert run is not None
        store.record(RunResult(run_id=run.run_id, status="ok", config=to_plain(run),
                               tokens_per_s=tokens, peak_memory_gib=0.01))  # fmt: skip
    outcome = run_search(spec, SearchOptions(results_dir=tmp_path / "r", progress=False))
    assert outcome.counts["launched"] == 0
    assert outcome.counts["excluded"] == 2
    failures = [t.user_attrs.get("failure", "") for t in outcome.study.trials]
    assert sum("tp_size: 3 is not allowed; must divide world_size 4" in f for f in failures) == 2
    best = best_feasible(outcome.study, store, spec)
    assert best is not None and best[0].params == {"tp_size": 2, "fsdp.grouping": "block"}


TP_USER_MODEL = """
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from fsdp_bench import ModelBundle


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self, vocab, dim, depth):
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        x = self.embedding(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def mlp(vocab=256, dim=32, depth=2):
    net = Net(vocab, dim, depth)
    plan = {"blocks.*.up": ColwiseParallel(), "blocks.*.down": RowwiseParallel()}
    return ModelBundle(module=net, blocks=list(net.blocks), vocab_size=vocab, tp_plan=plan)
"""


@pytest.mark.slow
def test_tp_parity_across_precision_sequence_parallel_grouping_and_a_users_plan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tiny at 2 x 2: bf16 compute, without sequence parallel, one group for the whole model;
    and a user's model that gives its own plan (`ModelBundle.tp_plan`): each trains as one
    process does, and its estimate is within 5% of the tracked peak."""
    (tmp_path / "tpmodels.py").write_text(TP_USER_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))  # as the CLI imports from the grid's folder
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    axes = [
        {"fsdp.mixed_precision": ["bf16"]},
        {"tp_sequence_parallel": [False]},
        {"fsdp.grouping": ["root"], "tp_sequence_parallel": [False]},
        {"model.name": ["tpmodels:mlp"]},
    ]
    _, df = sweep(tmp_path, tiny_grid("tp-parity", axes, world_size=4, tp_size=2), verify=True)
    assert len(df) == 4
    assert set(df.status) == {"ok"} and df.parity_ok.all(), df[["run_id", "status", "reason"]]
    error = (df.estimated_peak_gib / df.tracked_peak_gib - 1).abs()
    assert (error < 0.05).all(), df[["run_id", "estimated_peak_gib", "tracked_peak_gib"]]
    user = df[df.model == "tpmodels:mlp"].iloc[0]
    assert user.collectives_per_dimension["tp"]["all_reduces"] >= 2 * 2  # a block's down, twice


def test_the_report_lists_collectives_per_mesh_dimension() -> None:
    import pandas as pd

    from fsdp_bench.report.figure_data import collectives_by_dimension

    per = {"shard": {"all_gathers": 9, "all_gather_bytes": 2 * 2**20},
           "tp": {"all_reduces": 12, "all_reduce_bytes": 2**19}}  # fmt: skip
    df = pd.DataFrame([
        {"run_id": "a", "status": "ok", "tokens_per_s": 1.0, "world_size": 4, "tp_size": 2,
         "collectives_per_dimension": per},
        *({"run_id": run_id, "status": "ok", "tokens_per_s": 2.0, "world_size": 4, "tp_size": 1,
           "collectives_per_dimension": {"shard": {"all_gathers": 9}}} for run_id in "bc"),
    ])  # fmt: skip
    table = collectives_by_dimension(df)
    assert table[["configuration", "dimension"]].values.tolist() == [
        ["W=4: tp_size=2", "shard"], ["W=4: tp_size=2", "tp"],
    ]  # fmt: skip
    assert table["all-gather"].tolist() == [9, 0] and table["all-gather MiB"].tolist() == [2, 0]
    assert table["all-reduce"].tolist() == [0, 12] and table["all-reduce MiB"].tolist() == [0, 0.5]
