"""The Python that reproduces a run's parallelism in a user's own training script.

What `job/parallelize.py` does for a RunConfig, written out as the handful of torch calls it
amounts to, for a model whose transformer blocks are the list `blocks` names (`model.layers`
for the presets; for others where the model check found them: `model.model.layers` in a
Llama of transformers).
"""

from __future__ import annotations

from fsdp_bench.config.fsdp import checkpointed_every, grouping_block_count
from fsdp_bench.config.run import RunConfig


def fully_shard_code(run: RunConfig, device: str = "cuda", blocks: str = "model.layers") -> str:
    """Source code: mesh, policies, activation checkpointing, fully_shard calls, prefetch, the
    run's optimizer and the accumulation loop. It expects `model` (its blocks the list
    `blocks`), and for the step `inputs`/`targets` or `micro_batches` and `loss_fn`."""
    lines = ["import torch", "from torch.distributed.device_mesh import init_device_mesh"]
    if run.strategy == "ddp":
        lines += _ddp_code(run, device)
        return "\n".join(lines) + "\n"
    lines += _fsdp_imports(run)
    if run.tp_size > 1:
        lines += [
            "from torch.distributed.tensor import Replicate, Shard",
            "from torch.distributed.tensor.parallel import (",
            "    ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,",
            "    loss_parallel, parallelize_module,",
            ")",
        ]
    lines += _mesh_and_options(run, device)
    lines += _float8_code(run)
    lines += _tensor_parallel_code(run)
    if run.model.dtype == "bf16":
        lines.append("model.to(torch.bfloat16)  # bf16 storage: no fp32 master weights")
    lines += _checkpointing_code(run.fsdp.activation_checkpointing)
    lines += _compile_code(run)
    lines += _grouping_code(
        str(run.fsdp.grouping), run.model.tie_embeddings, run.fsdp.reshard_after_forward
    )
    lines.append("fully_shard(model, **options)  # the root last")
    lines += _prefetch_code(run)
    lines += _communication_code(run)
    lines += [
        f'model.to_empty(device="{device}")',
        "model.init_weights()  # or reset_parameters() on each submodule",
        _optimizer_code(run) + "  # after fully_shard: shards only",
    ]
    lines += _step_code(run, "model.set_requires_gradient_sync", run.tp_size > 1)
    # the pieces below write the blocks as `model.layers`, the presets' list
    return "\n".join(lines).replace("model.layers", blocks) + "\n"


def _float8_code(run: RunConfig) -> list[str]:
    """torchao's float8 linears in the blocks, first of all (`job/parallel/float8.py`)."""
    recipe = run.train.float8
    if recipe == "none":
        return []
    gather = run.fsdp.float8_all_gather
    config = (
        "Float8LinearConfig(enable_fsdp_float8_all_gather=True)"  # tensorwise is the default
        if gather
        else f'Float8LinearConfig.from_recipe_name("{recipe}")'
    )
    return [
        "from torchao.float8 import Float8LinearConfig, convert_to_float8_training"
        + (
            "\nfrom torchao.float8 import precompute_float8_dynamic_scale_for_fsdp"
            if gather
            else ""
        ),
        "in_blocks = {id(m) for block in model.layers for m in block.modules()}",
        "convert_to_float8_training(  # the blocks' Linears whose dimensions divide by 16",
        f"    model, config={config},",
        "    module_filter_fn=lambda m, name: id(m) in in_blocks",
        "    and m.in_features % 16 == 0 and m.out_features % 16 == 0,",
        ")",
    ]


def _fsdp_imports(run: RunConfig) -> list[str]:
    policies = [
        name
        for name, used in (
            ("CPUOffloadPolicy", run.fsdp.cpu_offload),
            (
                "FSDPModule",
                run.fsdp.comm_buffers_from_process_group or run.fsdp.symm_mem,
            ),
            (
                "MixedPrecisionPolicy",
                "bf16" in (run.fsdp.mixed_precision, run.fsdp.reduce_dtype)
                or not run.fsdp.cast_forward_inputs,
            ),
        )
        if used
    ]
    lines = []
    if run.fsdp.activation_checkpointing != "none":
        lines.append(
            "from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import "
            "checkpoint_wrapper"
        )
    return [*lines, f"from torch.distributed.fsdp import {', '.join([*policies, 'fully_shard'])}"]


def _compile_code(run: RunConfig) -> list[str]:
    """torch.compile after checkpointing and before fully_shard, in place (`parallelize`),
    and of the loss on its own (`training.build_loss`)."""
    lines = {
        "none": [],
        "block": ["for block in model.layers:  # in place: fully_shard finds them by name",
                  "    block.compile()"],
        "model": ["model.compile()"],
    }[run.train.compile]  # fmt: skip
    if run.train.compile_loss:
        lines.append("loss_fn = torch.compile(loss_fn)  # its fp32 upcast and softmax fused")
    return lines


def _checkpointing_code(mode: str) -> list[str]:
    """Checkpoint wrappers on the blocks, before sharding (`job/checkpointing.py`)."""
    every = checkpointed_every(mode)
    if mode == "none":
        return []
    if every is not None:
        which = "each block" if every == 1 else f"every {every}th block (0, {every}, ...)"
        keep = "" if every == 1 else f"\n    if index % {every} == 0:"
        indent = "    " if every == 1 else "        "
        return [
            f"for index, block in enumerate(model.layers):  # checkpoint {which}, then shard"
            + keep,
            f"{indent}model.layers[index] = checkpoint_wrapper(block)",
        ]
    return [
        "import functools",
        "from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts",
        "",
        "def keep_some(counts, ctx, op, *args, **kwargs):",
        "    # selective per op: keep attention and every other matmul, recompute the rest",
        "    if op is torch.ops.aten.mm.default:",
        '        phase = "recompute" if ctx.is_recompute else "forward"',
        "        counts[phase] += 1",
        "        keep = counts[phase] % 2 == 1",
        "    else:",
        '        keep = "scaled_dot_product" in str(op)',
        "    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE",
        "",
        "def contexts():",
        '    policy = functools.partial(keep_some, {"forward": 0, "recompute": 0})',
        "    return create_selective_checkpoint_contexts(policy)",
        "",
        "for index, block in enumerate(model.layers):",
        "    model.layers[index] = checkpoint_wrapper(block, context_fn=contexts)",
    ]


def _mesh_and_options(run: RunConfig, device: str) -> list[str]:
    """The device mesh and the keyword arguments every fully_shard call takes."""
    lines = [
        "",
        f"# world size {run.world_size}: {run.nodes} node(s) x "
        f"{run.world_size // run.nodes} process(es); build the model on the meta device first",
    ]
    if run.tp_size > 1:
        lines.append(
            f'mesh = init_device_mesh("{device}", {run.mesh_shape}, '
            'mesh_dim_names=("shard", "tp"))  # TP innermost: a group inside a node'
        )
    elif len(run.mesh_shape) == 2:
        lines.append(
            f'mesh = init_device_mesh("{device}", {run.mesh_shape}, '
            'mesh_dim_names=("replicate", "shard"))  # HSDP'
        )
    else:
        lines.append(f'mesh = init_device_mesh("{device}", ({run.world_size},))')
    options = ['mesh=mesh["shard"]' if run.tp_size > 1 else "mesh=mesh"]
    reshard = run.fsdp.reshard_after_forward
    if reshard not in ("default", "all_but_last"):  # all_but_last: per block, below
        options.append(f"reshard_after_forward={reshard!r}")
    reduce = "torch.bfloat16" if run.fsdp.reduce_dtype == "bf16" else "torch.float32"
    cast = "" if run.fsdp.cast_forward_inputs else ", cast_forward_inputs=False"
    if run.fsdp.mixed_precision == "bf16" or run.fsdp.reduce_dtype == "bf16" or cast:
        param = "torch.bfloat16" if run.fsdp.mixed_precision == "bf16" else "None"
        lines.append(
            f"mp_policy = MixedPrecisionPolicy(param_dtype={param}, reduce_dtype={reduce}{cast})"
        )
        options.append("mp_policy=mp_policy")
    if run.fsdp.cpu_offload:
        pin = "" if run.fsdp.offload_pin_memory else "pin_memory=False"
        options.append(f"offload_policy=CPUOffloadPolicy({pin})")
    return [*lines, f"options = dict({', '.join(options)})"]


def _tensor_parallel_code(run: RunConfig) -> list[str]:
    """torchtitan's Llama plan (`job.tensor_parallel`), before checkpointing and fully_shard."""
    if run.tp_size == 1:
        return []
    sp = run.tp_sequence_parallel
    seq = "Shard(1)" if sp else "Replicate()"
    block = [
        '    "attention.wq": ColwiseParallel(),',
        '    "attention.wk": ColwiseParallel(),',
        '    "attention.wv": ColwiseParallel(),',
        f'    "attention.wo": RowwiseParallel({"output_layouts=Shard(1)" if sp else ""}),',
        '    "feed_forward.w1": ColwiseParallel(),',
        f'    "feed_forward.w2": RowwiseParallel({"output_layouts=Shard(1)" if sp else ""}),',
        '    "feed_forward.w3": ColwiseParallel(),',
    ]
    if sp:  # sequence parallel: norms on sequence shards, gathered before each sub-layer
        block += [
            '    "attention_norm": SequenceParallel(),',
            '    "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),',
            "                                    desired_input_layouts=(Replicate(), None, None)),",
            '    "ffn_norm": SequenceParallel(),',
            '    "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),',
            "                                       desired_input_layouts=(Replicate(),)),",
        ]
    return [
        "",
        f"# tensor parallelism over {run.tp_size} ranks (torchtitan's Llama plan); the",
        "# attention must reshape to (batch, seq, -1, head_dim): a rank has its share of heads",
        "block_plan = {",
        *block,
        "}",
        "for block in model.layers:",
        '    parallelize_module(block, mesh["tp"], block_plan)',
        'parallelize_module(model, mesh["tp"], {',
        f'    "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts={seq}),',
        *(['    "norm": SequenceParallel(),'] if sp else []),
        f'    "output": ColwiseParallel(input_layouts={seq}, output_layouts=Shard(-1),',
        "                              use_local_output=False),  # logits split by vocabulary",
        "})",
    ]


def _prefetch_code(run: RunConfig) -> list[str]:
    if run.fsdp.prefetch == "implicit":
        return []
    depth = int(run.fsdp.prefetch)
    return [
        "blocks = list(model.layers)",
        "for index, block in enumerate(blocks):",
        f"    block.set_modules_to_forward_prefetch(blocks[index + 1 : index + {depth + 1}])",
        f"    earlier = blocks[max(0, index - {depth}) : index]",
        "    block.set_modules_to_backward_prefetch(earlier[::-1])",
    ]


def _optimizer_code(run: RunConfig) -> str:
    """The run's optimizer, learning rate and implementation, as the worker builds them."""
    name = {"adamw": "AdamW", "sgd": "SGD"}[run.train.optimizer]
    impl = run.train.optimizer_impl
    how = {"foreach": "foreach=True", "fused": "fused=True", "for_loop": "foreach=False"}[impl]
    return (
        f"optimizer = torch.optim.{name}(model.parameters(), lr={run.train.learning_rate!r}, {how})"
    )


def _grouping_code(grouping: str, tied: bool | None, reshard: object) -> list[str]:
    k = grouping_block_count(grouping)
    if grouping == "root":
        return []
    but_last = reshard == "all_but_last"
    if grouping == "block":
        if but_last:
            return [
                "last = len(model.layers) - 1  # backward needs the last block first: kept",
                "for index, block in enumerate(model.layers):",
                "    fully_shard(block, **options, reshard_after_forward=index < last)",
            ]
        return ["for block in model.layers:", "    fully_shard(block, **options)"]
    if k is not None:
        keep = ", reshard_after_forward=start + " + f"{k} < len(model.layers)" if but_last else ""
        return [
            f"for start in range(0, len(model.layers), {k}):  # {k} blocks per group",
            f"    fully_shard(list(model.layers[start : start + {k}]), **options{keep})",
        ]
    if grouping == "linear":
        code = [
            "linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]",
            "for linear in linears:  # a tied LM head must share a group with the embedding",
            "    if linear is not model.output:",
            "        fully_shard(linear, **options)",
            "fully_shard([model.tok_embeddings, model.output], **options)",
        ]
        return code if tied else [*code[:2], "    fully_shard(linear, **options)"]
    patterns = grouping.removeprefix("modules:").split(",")
    return [
        "import fnmatch",
        f"patterns = {patterns!r}",
        "named = [(n, m) for n, m in model.named_modules() if n]",
        "for name, module in reversed(named):  # deepest first",
        "    if any(fnmatch.fnmatchcase(name, p) for p in patterns):",
        "        fully_shard(module, **options)",
    ]


def _ddp_code(run: RunConfig, device: str) -> list[str]:
    wrap = (
        "DistributedDataParallel(model.cuda(), device_ids=[local_rank])"
        if device == "cuda"
        else "DistributedDataParallel(model)"
    )
    lines = [
        "from torch.nn.parallel import DistributedDataParallel",
        "",
        *_float8_code(run),
        *_compile_code(run),
        f"model = {wrap}",
        _optimizer_code(run),
    ]
    if run.fsdp.mixed_precision == "bf16":
        lines.append("# forward under torch.autocast('cuda', dtype=torch.bfloat16)")
    return lines + _step_code(run, None)


def _communication_code(run: RunConfig) -> list[str]:
    """FSDP2's communication settings past fully_shard's arguments (`parallelize`)."""
    cfg, lines = run.fsdp, []
    if cfg.reduce_scatter_buffers != 1:
        lines.append(f"model.set_reduce_scatter_max_input_buffers({cfg.reduce_scatter_buffers})")
    if cfg.separate_reduce_scatter_group:
        lines.append("model.set_separate_reduce_scatter_group(True)")
    each = []
    if cfg.comm_buffers_from_process_group:
        each.append("module.set_allocate_memory_from_process_group_for_comm(True)")
    if cfg.symm_mem:
        each.append("module.set_symm_mem_for_comm()")
    if each:
        lines.append("for module in model.modules():  # set per module, not recursively")
        lines.append("    if isinstance(module, FSDPModule):")
        lines += [f"        {line}" for line in each]
    return lines


def _step_code(run: RunConfig, sync_setter: str | None, sharded_logits: bool = False) -> list[str]:
    """The step; `sharded_logits`: the loss and its backward under `loss_parallel`."""
    k = run.train.accumulation_steps
    update = [*_clip_code(run.train.max_grad_norm), "optimizer.step()", "optimizer.zero_grad()"]
    if run.fsdp.float8_all_gather and run.strategy != "ddp":  # DDP gathers nothing
        update.append("precompute_float8_dynamic_scale_for_fsdp(model)  # one all-reduce")
    loss = "loss_fn(model(inputs), targets)" + (f" / {k}" if k > 1 else "")
    backward = (
        ["with loss_parallel():  # the loss on logits split by vocabulary",
         f"    ({loss}).backward()"]
        if sharded_logits
        else [f"({loss}).backward()" if k > 1 else f"{loss}.backward()"]
    )  # fmt: skip
    if k == 1:
        return [*backward, *update]
    lines = [f"for index, (inputs, targets) in enumerate(micro_batches):  # {k} per step"]
    if run.train.grad_sync == "last":
        if sync_setter:
            lines.append(f"    {sync_setter}(index == {k - 1})  # reduce-scatter once")
        else:
            lines.append(f"    model.require_backward_grad_sync = index == {k - 1}")
    if run.train.grad_sync == "all_reduce_last":
        lines.append(f"    model.set_requires_all_reduce(index == {k - 1})  # all-reduce once")
    if run.fsdp.reshard_after_backward == "last" and run.strategy != "ddp":
        lines.append(f"    model.set_reshard_after_backward(index == {k - 1})")
    return lines + [f"    {line}" for line in backward] + update


def _clip_code(max_norm: float | None) -> list[str]:
    """Gradient clipping over sharded gradients: the shards' norms made whole (one
    all-reduce), then every rank scales by the same factor (`training.clip_gradients`)."""
    if max_norm is None:
        return []
    return [
        "grads = [p.grad for p in model.parameters() if p.grad is not None]",
        "norm = torch.nn.utils.get_total_norm(grads)",
        'norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm',
        f"torch.nn.utils.clip_grads_with_norm_(model.parameters(), {max_norm!r}, norm)",
    ]
