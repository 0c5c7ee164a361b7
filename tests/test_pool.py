"""Worker processes for the torch work before launch: the kept pool, and fresh processes for
a user's code."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from fsdp_bench.config.run import ModelConfig, RunConfig
from fsdp_bench.memory import pool
from fsdp_bench.memory.estimate import estimate_runs
from fsdp_bench.memory.pool import in_subprocesses


def pid_of(_: int) -> int:
    return os.getpid()


def children() -> set[int]:
    """This process's spawned workers (not multiprocessing's resource tracker), from /proc."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            command = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue  # the process ended meanwhile
        if parent == os.getpid() and b"spawn_main" in command:
            found.add(int(stat.parent.name))
    return found


def test_our_own_work_reuses_the_kept_workers_and_user_code_gets_fresh_ones() -> None:
    pool._close_kept()  # a pool an earlier test kept: start from none
    before = children()
    first = {pid for _, pid in in_subprocesses(pid_of, [0, 1, 2], user_code=False)}
    kept = children() - before
    assert first <= kept and 1 <= len(kept) <= (os.cpu_count() or 1)
    again = {pid for _, pid in in_subprocesses(pid_of, [0, 1, 2], user_code=False)}
    assert again <= kept and children() - before == kept, "no process was started again"
    fresh = {pid for _, pid in in_subprocesses(pid_of, [0, 1], user_code=True)}
    assert fresh and not fresh & kept and os.getpid() not in fresh
    assert children() - before == kept, "the fresh processes ended with their work"
    assert [pid for _, pid in in_subprocesses(pid_of, [0], user_code=False)] == [os.getpid()]


WIDE_MODEL = """
from torch import nn
from fsdp_bench import ModelBundle

WIDTH = {width}

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(100, WIDTH)
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(2))
        self.head = nn.Linear(WIDTH, 100)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x).relu()
        return self.head(x)

def build():
    net = Net()
    return ModelBundle(module=net, blocks=list(net.blocks), vocab_size=100)
"""


@pytest.mark.slow
def test_a_users_model_edited_between_estimates_is_estimated_as_it_is_now(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    runs = [RunConfig(model=ModelConfig(name="wide_model:build"), world_size=w) for w in (1, 2)]

    def peaks(width: int) -> list[float]:
        (tmp_path / "wide_model.py").write_text(textwrap.dedent(WIDE_MODEL.format(width=width)))
        found = estimate_runs(runs, cache_dir=None)
        return [found[r.run_id].estimated_peak_gib or 0.0 for r in runs]

    narrow, wide = peaks(16), peaks(256)
    assert all(0 < n < w for n, w in zip(narrow, wide, strict=True)), (narrow, wide)
