"""`allocator_peak`: the CPU allocator's own count, the measurement compiled CPU runs are
checked against, agrees with the tensor tracker where both can see everything (eager)."""

from __future__ import annotations

import torch
from torch import nn

from fsdp_bench.job.measure.allocator_peak import allocator_peak, live_bytes
from fsdp_bench.job.measure.tracker import TensorMemoryTracker


def test_the_allocator_peak_agrees_with_the_tracker_on_an_eager_step() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256), nn.LayerNorm(256))
    optimizer = torch.optim.AdamW(model.parameters())
    batch = torch.randn(128, 256)

    def step() -> None:
        model(batch).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # the optimizer's state exists from here on
    state = [v for per_param in optimizer.state.values() for v in per_param.values()]
    held = live_bytes([*model.parameters(), *state, batch])
    tracker = TensorMemoryTracker()
    tracker.track_external(model, optimizer)
    with allocator_peak() as found, tracker:
        step()
    tracked = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    measured = held + found.bytes_above_start
    assert found.bytes_above_start > 0
    assert abs(measured / tracked - 1) < 0.02, (measured, tracked)
