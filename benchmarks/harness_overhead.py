"""Harness overhead: fsdp-bench's measured step time against a bare FSDP2 loop, same processes.

The bare loop is what an engineer writes by hand: fully_shard per block, then the root, AdamW,
forward/backward/step, timed between barriers. Both run in the same job (same processes, same
process group), alternating ABAB so drift on a noisy machine hits both alike.

    python benchmarks/harness_overhead.py                 # small model, world size 2, CPU
    python benchmarks/harness_overhead.py --model tiny --rounds 6

Prints each round and the ratio of medians (target <= 1.02).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import submitit
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

from fsdp_bench.config.model import ModelConfig
from fsdp_bench.config.run import DataConfig, MeasureConfig, RunConfig
from fsdp_bench.job.measure.timing import slowest_over_ranks
from fsdp_bench.job.model.zoo import Transformer
from fsdp_bench.job.rendezvous import (
    barrier_and_destroy,
    init_process_group,
    pick_device,
    rank_info,
)
from fsdp_bench.job.training import synchronize
from fsdp_bench.job.worker import JobContext, execute_run
from fsdp_bench.store import ResultStore


def bare_step_time(run: RunConfig, device: torch.device, steps: int, repeats: int) -> float:
    """Median seconds per step of a hand-written FSDP2 loop (no fsdp-bench code in the loop)."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(run.model.shape, device.type)
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device=device)
    model.init_weights()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    rank, b, s = dist.get_rank(), run.data.micro_batch_size, run.data.seq_len
    generator = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, run.model.shape.vocab_size, (b, s + 1), generator=generator)
    inputs, targets = tokens[:, :-1].to(device), tokens[:, 1:].to(device)

    def step() -> None:
        logits = model(inputs)
        F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(run.measure.warmup_steps):
        step()
    times = []
    for _ in range(repeats):
        synchronize(device)
        dist.barrier()
        begin = time.perf_counter()
        for _ in range(steps):
            step()
        synchronize(device)  # on CUDA the step is queued, not done, until synchronised
        times.append((time.perf_counter() - begin) / steps)
    return statistics.median(slowest_over_ranks(times, device))


def compare(run: RunConfig, rounds: int, results_dir: str) -> tuple[list[tuple[float, float]], str]:
    """Runs in every rank; returns (bare, fsdp-bench) median step times per round, and the
    rank's device."""
    info = rank_info()
    device = pick_device("auto", info.local_rank)
    if device.type == "cpu":
        torch.set_num_threads(1)
    init_process_group(info, device, Path(results_dir) / "rendezvous", 120)
    context = JobContext(info=info, device=device, store=ResultStore(results_dir), verify=False)
    pairs = []
    for index in range(rounds):
        order = ["bare", "harness"] if index % 2 == 0 else ["harness", "bare"]
        measured = {}
        for which in order:
            if which == "bare":
                measured[which] = bare_step_time(
                    run, device, run.measure.timed_steps, run.measure.repeats
                )
            else:
                outcome = execute_run(run, context)
                measured[which] = statistics.median(
                    slowest_over_ranks(outcome.step_times_s, device)
                )
        pairs.append((measured["bare"], measured["harness"]))
    barrier_and_destroy()
    return pairs, device.type


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    run = RunConfig(
        world_size=args.world_size,
        model=ModelConfig(name=args.model),
        data=DataConfig(micro_batch_size=2, seq_len=args.seq_len),
        measure=MeasureConfig(warmup_steps=3, timed_steps=10, repeats=3),
    )
    with tempfile.TemporaryDirectory() as folder:
        executor = submitit.LocalExecutor(folder=folder)
        # submitit hides every GPU from a local job that asks for none (CUDA_VISIBLE_DEVICES="")
        gpus = args.world_size if torch.cuda.is_available() else 0
        executor.update_parameters(
            tasks_per_node=args.world_size, nodes=1, timeout_min=60, gpus_per_node=gpus
        )
        pairs, device = executor.submit(compare, run, args.rounds, folder).results()[0]
    print(
        f"model {args.model}, world size {args.world_size}, seq {args.seq_len}, "
        f"micro-batch 2, block grouping, AdamW; {torch.__version__}, ranks on {device}"
    )
    print("round  bare s/step  fsdp-bench s/step  ratio")
    for index, (bare, harness) in enumerate(pairs):
        print(f"{index:5d}  {bare:11.4f}  {harness:17.4f}  {harness / bare:5.3f}")
    bare_median = statistics.median(p[0] for p in pairs)
    harness_median = statistics.median(p[1] for p in pairs)
    print(
        f"median {bare_median:11.4f}  {harness_median:17.4f}  {harness_median / bare_median:5.3f}"
        "   (target <= 1.02)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
