"""Inductor's fusion, for the compiled loss's partitioned graphs under fake tensors.

What inductor does after AOTAutograd's partition is modelled, for the compiled loss
(`train.compile_loss`), by its one rule that moves memory there: pointwise operators are fused
into the kernels that read their results, so a pointwise result exists only where something
that is not a fused kernel needs it: a graph output (what is saved for backward, the
gradients), or an operand of an operator inductor calls out to (a matmul, a collective,
attention). Such results are made `unseen` (counted by neither the recorder nor the tracker);
reductions' results are kept (small, and a kernel's output). A compiled cross-entropy, its
fp32 logits and log-softmax pointwise chains into reductions, keeps the logits and two numbers
per token: with inductor on the CPU its step's peak is two logits-sized tensors where eager's
is six, and so is the simulation's (`tests/test_compile.py`). Not for the blocks: there the
CPU allocator's peak of a compiled block sits at or above the unfused simulation (with
checkpointing -9% fused, within -5% unfused: `sweeps/compiled-cpu.yaml`), so their fused
intermediates are kept, a bound.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from fsdp_bench.job.measure.tracker import unseen

__all__ = ["run_fused"]


def run_fused(graph_module: fx.GraphModule, example_inputs: Any) -> Any:
    """A boxed callable (it frees its inputs as it goes, as AOTAutograd expects), with an
    interpreter for each call: one kept would keep its last outputs, the saved tensors."""
    away = _fused_away(graph_module.graph)

    def run(args: list[Any]) -> Any:
        return _FusedInterpreter(graph_module, away).boxed_run(args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


class _FusedInterpreter(fx.Interpreter):
    def __init__(self, graph_module: fx.GraphModule, unseen_nodes: set[fx.Node]) -> None:
        super().__init__(graph_module)
        self.unseen_nodes = unseen_nodes

    def run_node(self, n: fx.Node) -> Any:
        if n in self.unseen_nodes:
            with unseen():
                return super().run_node(n)
        return super().run_node(n)


def _fused_away(graph: fx.Graph) -> set[fx.Node]:
    """The nodes whose results inductor never makes: fusible (pointwise, or a constant fill)
    and needed by nothing but other fused kernels (a view passes the need to its base), and
    the views of those."""
    needed: set[fx.Node] = set()
    fusible: set[fx.Node] = set()
    for node in reversed(graph.nodes):
        if node.op == "output":
            needed.update(_tensor_nodes(node.args))
        elif node.op != "call_function":
            continue
        elif _is_view(node.target):
            if node in needed:
                needed.update(_tensor_nodes(node.args[:1]))
        elif _is_fusible(node):
            fusible.add(node)
        elif not _is_reduction(node.target):  # a kernel inductor calls out to
            needed.update(_tensor_nodes((node.args, node.kwargs)))
    away = fusible - needed
    for node in graph.nodes:  # a view of what is never made is never made either
        if node.op == "call_function" and _is_view(node.target) and node.args[0] in away:
            away.add(node)
    return away


def _tensor_nodes(args: Any) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg(args, found.append)
    return found


def _is_fusible(node: fx.Node) -> bool:
    """Pointwise, a constant fill (inductor computes it where it is read), or a scatter onto
    one (inductor rewrites it as a pointwise select: `optimize_scatter_upon_const_tensor`)."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags:
        return True
    if not _tensor_nodes((node.args, node.kwargs)):
        return isinstance(target, torch._ops.OpOverload)  # full, scalar_tensor, iota
    if target is torch.ops.aten.scatter.value:
        base = node.args[0]
        return isinstance(base, fx.Node) and not _tensor_nodes((base.args, base.kwargs))
    return target is torch.ops.aten.gather.default  # an indirect load inside the kernel


def _is_reduction(target: Any) -> bool:
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.reduction in target.tags


def _is_view(target: Any) -> bool:
    """An operator whose result aliases its first operand (its schema says so)."""
    if not isinstance(target, torch._ops.OpOverload):
        return False
    returns = target._schema.returns
    return (
        bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write
    )
