"""Model zoo, grouping plans, and tied weights under every grouping."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from fsdp_bench.config.fsdp import FsdpConfig
from fsdp_bench.config.model import ModelConfig
from fsdp_bench.config.presets import PRESETS
from fsdp_bench.config.run import RunConfig
from fsdp_bench.errors import ConfigError
from fsdp_bench.job.model.zoo import build_model
from fsdp_bench.job.parallel.parallelize import parallelize, plan_groups
from fsdp_bench.job.training import loss_fn, rank_batches


def test_preset_sizes_match_the_published_models() -> None:
    # Meta's model cards: Llama 3.2 1B 1.24B, Llama 3.1 8B 8.03B, 70B 70.6B parameters.
    assert PRESETS["llama3-1b"].num_params == pytest.approx(1.236e9, rel=1e-3)
    assert PRESETS["llama3-8b"].num_params == pytest.approx(8.030e9, rel=1e-3)
    assert PRESETS["llama3-70b"].num_params == pytest.approx(70.55e9, rel=1e-3)
    assert PRESETS["llama2-7b"].num_params == pytest.approx(6.738e9, rel=1e-3)


def test_flops_per_token_is_six_n_plus_attention() -> None:
    shape = PRESETS["tiny"]
    matmul = shape.n_layers * (shape.block_params - 2 * shape.dim) + shape.vocab_size * shape.dim
    expected = 6 * matmul + 12 * shape.n_layers * shape.dim * 256
    assert shape.flops_per_token(256) == expected


def test_build_allocates_nothing() -> None:
    bundle = build_model(ModelConfig(name="llama3-70b"))
    assert all(p.device.type == "meta" for p in bundle.module.parameters())
    assert sum(p.numel() for p in bundle.module.parameters()) == PRESETS["llama3-70b"].num_params
    assert len(bundle.blocks) == 80


def test_user_model_by_import_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_models.py").write_text(
        textwrap.dedent(
            """
            from torch import nn
            from fsdp_bench import ModelBundle

            class Net(nn.Module):
                def __init__(self, width):
                    super().__init__()
                    self.embed = nn.Embedding(100, width)
                    self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(3))
                    self.head = nn.Linear(width, 100)

                def forward(self, tokens):
                    x = self.embed(tokens)
                    for block in self.blocks:
                        x = block(x).relu()
                    return self.head(x)

            def build(width=16):
                net = Net(width)
                return ModelBundle(module=net, blocks=list(net.blocks), vocab_size=100)

            def not_a_bundle():
                return Net(4)
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    bundle = build_model(ModelConfig(name="my_models:build", options={"width": 8}))
    assert len(bundle.blocks) == 3 and bundle.module.embed.weight.shape == (100, 8)
    assert plan_groups(bundle, "block").num_groups == 4
    with pytest.raises(ConfigError, match=r"returned Net, expected fsdp_bench\.ModelBundle"):
        build_model(ModelConfig(name="my_models:not_a_bundle"))
    with pytest.raises(ConfigError, match="has no function 'missing'"):
        build_model(ModelConfig(name="my_models:missing"))
    with pytest.raises(ConfigError, match="cannot import 'no_such_module'"):
        build_model(ModelConfig(name="no_such_module:build"))
    sys.modules.pop("my_models", None)


@pytest.mark.parametrize(
    ("grouping", "groups"),
    [("root", 1), ("block", 5), ("blocks:2", 3), ("blocks:3", 3), ("linear", 30)],
)
def test_group_counts(grouping: str, groups: int) -> None:
    # tiny: 4 blocks of 7 Linears, plus the LM head; the root is always the last group.
    plan = plan_groups(build_model(ModelConfig(name="tiny")), grouping)
    assert plan.num_groups == groups
    assert plan.groups[-1].names == [""]


def test_linear_grouping_keeps_tied_head_with_embedding() -> None:
    plan = plan_groups(build_model(ModelConfig(name="tiny", tie_embeddings=True)), "linear")
    tied = [g for g in plan.groups if "output" in g.names]
    assert len(tied) == 1 and sorted(tied[0].names) == ["output", "tok_embeddings"]
    assert plan.num_groups == 30  # the head's group now also holds the embedding


def test_module_patterns() -> None:
    bundle = build_model(ModelConfig(name="tiny"))
    plan = plan_groups(bundle, "modules:layers.*.attention,layers.*.feed_forward")
    assert [g.names for g in plan.groups[:2]] == [["layers.0.attention"], ["layers.1.attention"]]
    assert plan.num_groups == 9
    with pytest.raises(ConfigError, match=r"pattern 'layers.\*.mlp' matches no module"):
        plan_groups(bundle, "modules:layers.*.mlp")


@pytest.mark.parametrize("grouping", ["root", "block", "blocks:2", "linear", "modules:output"])
def test_tied_weights_stay_one_parameter(mesh: DeviceMesh, grouping: str) -> None:
    run = RunConfig(
        model=ModelConfig(name="tiny", tie_embeddings=True), fsdp=FsdpConfig(grouping=grouping)
    )
    bundle = build_model(run.model)
    model, _ = parallelize(bundle, run, mesh, torch.device("cpu"))
    assert isinstance(model, FSDPModule)
    assert model.output.weight is model.tok_embeddings.weight
    names = list(model.state_dict())
    assert "tok_embeddings.weight" in names and "output.weight" in names
    assert len({id(p) for p in model.parameters()}) == len(list(model.parameters()))
    # The tie failure shows at the first forward (lazy init), so take a real step.
    inputs, targets = rank_batches(run, 0, bundle.vocab_size, torch.device("cpu"))[0]
    loss_fn(model(inputs), targets).backward()
    assert model.output.weight is model.tok_embeddings.weight
    assert model.tok_embeddings.weight.grad is not None


def test_cpu_offload_materialises_shards_on_the_host_and_buffers_where_they_compute(
    mesh: DeviceMesh,
) -> None:
    """FSDP2's CPU offload refuses, at the first forward, shards not on the host (the H200
    check's offload run failed so); buffers must stay on the compute device, with their
    values. The meta device stands in for the GPU here, the host being this machine's CPU."""
    from fsdp_bench.job.model.zoo import parameters_on_meta
    from fsdp_bench.job.parallel.parallelize import materialize, wrap_on_meta

    run = RunConfig(model=ModelConfig(name="tiny"), fsdp=FsdpConfig(cpu_offload=True))
    model, _ = wrap_on_meta(build_model(run.model, "cpu"), run, mesh, torch.device("cpu"))
    materialize(model, torch.device("meta"), params_on_host=True)
    assert {p.device.type for p in model.parameters()} == {"cpu"}

    def with_buffers() -> torch.nn.Module:
        with parameters_on_meta():
            module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
        module[1].running_mean.fill_(3.0)
        return module

    module = with_buffers()
    materialize(module, torch.device("meta"), params_on_host=True)
    assert {p.device.type for p in module.parameters()} == {"cpu"}
    assert {b.device.type for b in module.buffers()} == {"meta"}
    materialize(module := with_buffers(), torch.device("cpu"))
    assert torch.equal(module[1].running_mean, torch.full((4,), 3.0))


@pytest.mark.slow
def test_a_users_model_module_is_found_beside_the_grid_from_any_folder(tmp_path: Path) -> None:
    """`model.name: mymodels:build` with mymodels.py beside the grid, run from another
    folder with no PYTHONPATH: imported as users expect (here by the estimate's model check
    and simulation, fresh processes that inherit the path)."""
    import subprocess

    import yaml

    from tests.conftest import USER_MODEL

    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir()
    elsewhere.mkdir()
    (project / "mymodels.py").write_text(USER_MODEL.format(width=16))
    grid = {"name": "mine", "base": {"model": {"name": "mymodels:build"}, "world_size": 1}}
    (project / "grid.yaml").write_text(yaml.safe_dump(grid))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-m", "fsdp_bench", "estimate", "../project/grid.yaml"],
                          cwd=elsewhere, env=env, capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "cannot import" not in done.stdout + done.stderr
    header, row = done.stdout.splitlines()[:2]
    analytic = header.split().index("analytic")
    assert row.split()[analytic] == "n/a"  # the formulas need a preset's shape, and say so
    assert "analytic: n/a for hf: and your own models" in done.stdout
