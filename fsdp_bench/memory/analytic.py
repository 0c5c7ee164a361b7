"""The analytic memory model (seed 000, sections 01 and 16), term by term, without torch.

Per rank: steady state P(b_w + b_g + b_o) / R, plus what a step adds on top: the unsharded
parameters of the groups being computed (the largest group, and more when resharding is off),
the prefetched next group(s), unsharded gradients before their reduce-scatter, activations and
temporaries (the logits and their gradient). Each term is its largest value during the step;
they do not all peak at the same moment, so the sum leans high. It explains a peak; the
simulated estimate (`simulate.py`) measures one, and is the figure used for pruning.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from fsdp_bench.config.fsdp import checkpointed_every, grouping_block_count
from fsdp_bench.config.presets import ModelShape
from fsdp_bench.config.run import RunConfig

GB = 10**9
OPTIMIZER_BYTES = {"adamw": 8, "sgd": 0}  # fp32 exp_avg + exp_avg_sq; plain SGD keeps nothing


def steady_state_bytes(weights: float, grads: float, optimizer: float, ranks: int) -> float:
    """Sharded weights, gradients and optimizer state per rank: total / R."""
    return (weights + grads + optimizer) / ranks


def peak_lower_bound(steady: float, largest_group: float, prefetch: float) -> float:
    """Peak before activations and temporaries: steady state + the largest unsharded group +
    the group being prefetched while it computes."""
    return steady + largest_group + prefetch


@dataclass(frozen=True)
class AnalyticEstimate:
    """Peak bytes per rank as a sum of named terms (each printed by `fsdp-bench estimate`)."""

    terms: dict[str, float] = field(default_factory=dict)
    lower_bound_bytes: float = 0.0
    """The seed's bound before activations and temporaries: steady state + the largest
    unsharded group + the prefetch buffer."""
    host_bytes: float = 0.0
    """With CPU offload: the sharded state, held in host memory instead (not in the terms)."""

    @property
    def peak_bytes(self) -> float:
        return sum(self.terms.values())


def analytic_estimate(run: RunConfig) -> AnalyticEstimate:
    """The seed's model applied to a preset shape and a run's FSDP settings."""
    shape = run.model.shape
    shard = 1 if run.strategy == "ddp" else run.shard_group_size
    compute_bytes = 2 if run.fsdp.mixed_precision == "bf16" else 4
    params = _parameter_shapes(shape)
    padded = sum(_padded(rows, cols, shard) for rows, cols in params)  # FSDP2 pads dim 0
    # tensor parallelism splits the matmuls' weights over tp_size (the norms, replicated, are
    # counted split too: a few KiB)
    sharded = padded / shard / run.tp_size
    stored = 2 if run.model.dtype == "bf16" else 4  # parameters, gradients, states alike
    optimizer = OPTIMIZER_BYTES[run.train.optimizer] * stored // 4
    terms = {
        "sharded_parameters": sharded * stored,
        "sharded_gradients": sharded * stored,
        "optimizer_state": sharded * optimizer,
        "optimizer_temporaries": _optimizer_temporaries(run, shape, sharded, stored, shard),
    }
    steady = steady_state_bytes(padded * stored, padded * stored, padded * optimizer, shard)
    if run.strategy == "ddp":
        # The gradients are views of the reducer's buckets (gradient_as_bucket_view): one copy,
        # but micro-batches under no_sync accumulate theirs apart until the last one.
        if run.train.grad_sync == "last" and run.train.accumulation_steps > 1:
            terms["no_sync_gradients"] = sharded * 4
    else:
        terms.update(_unsharded_terms(run, shape, compute_bytes))
    terms["activations"] = _activation_bytes(run, shape, compute_bytes)
    tokens = run.data.micro_batch_size * run.data.seq_len
    if run.tp_sequence_parallel:  # every activation is split: sequence, heads or MLP width,
        # but the norms' outputs, gathered whole for the column-wise matmuls that save them
        # (two a block, one before the output projection)
        gathered = tokens * shape.dim * compute_bytes * (1 - 1 / run.tp_size)
        kept = 2 * _blocks_holding_activations(run, shape) + 1
        terms["activations"] = terms["activations"] / run.tp_size + gathered * kept
    # logits in the compute dtype, their fp32 copy for the loss, and the logits' gradient;
    # under tensor parallelism a rank's share of the vocabulary, on which loss_parallel keeps
    # its fp32 log-softmax and makes three more fp32 tensors of that size at once in backward
    # (torchtitan's 70B 2-D shape, simulated)
    logits = tokens * shape.vocab_size / run.tp_size
    terms["temporaries"] = logits * (compute_bytes + (16 if run.tp_size > 1 else 8))
    largest, prefetch = terms.get("largest_unsharded_group", 0), terms.get("prefetch_buffer", 0)
    host = 0.0
    if run.fsdp.cpu_offload and run.strategy != "ddp":  # the sharded state lives on the host
        host = sum(
            terms.pop(k) for k in ("sharded_parameters", "sharded_gradients", "optimizer_state")
        )
        steady = 0.0
    return AnalyticEstimate(terms, peak_lower_bound(steady, largest, prefetch), host)


def _optimizer_temporaries(
    run: RunConfig, shape: ModelShape, sharded: float, stored: int, shard: int
) -> float:
    """What the optimizer step allocates besides the state: foreach AdamW keeps a square root
    of every second moment at once (a state's worth), the for_loop one only the largest
    parameter's, fused none (torch.optim.adamw's three implementations)."""
    if run.train.optimizer != "adamw":
        return 0.0
    match run.train.optimizer_impl:
        case "foreach":
            return sharded * stored
        case "for_loop":
            rows, cols = max(_parameter_shapes(shape), key=lambda rc: rc[0] * rc[1])
            return _padded(rows, cols, shard) / shard * stored
        case _:
            return 0.0


def _unsharded_terms(run: RunConfig, shape: ModelShape, compute_bytes: int) -> dict[str, float]:
    """Full parameters and gradients that exist while groups compute (FSDP/HSDP only)."""
    block = shape.block_params
    root = shape.embedding_params + shape.head_params + shape.dim
    k = grouping_block_count(str(run.fsdp.grouping))
    groups: Sequence[float]
    match str(run.fsdp.grouping):
        case "root":
            groups = [shape.num_params]
        case "block":
            groups = [block] * shape.n_layers + [root]
        case "linear":
            groups = [shape.ffn_dim * shape.dim] * 3 * shape.n_layers + [root]
        case _ if k is not None:
            groups = [k * block] * (shape.n_layers // k) + [root]
        case _:  # module patterns: at most a block at a time
            groups = [block] * shape.n_layers + [root]
    groups = [g / run.tp_size for g in groups]  # a TP rank unshards its split of each
    params = shape.num_params / run.tp_size
    largest = max(groups)
    typical = max(groups[:-1], default=largest)
    reshard = run.fsdp.reshard_after_forward
    root_group = groups[-1] if len(groups) > 1 else 0  # FSDP2 keeps the root after forward
    kept: float
    if reshard is True:
        kept = 0
    elif reshard is False or reshard == 1:
        kept = params  # every group stays unsharded from forward to backward
    elif reshard == "all_but_last":
        kept = typical + root_group  # the last block group too: backward needs it first
    elif isinstance(reshard, int):
        kept = params / reshard  # resharded to groups of `reshard` ranks
    else:  # FSDP2's default: every group resharded but the root
        kept = root_group
    depth = 1 if run.fsdp.prefetch == "implicit" else int(run.fsdp.prefetch)
    prefetched = 0 if len(groups) == 1 else depth * typical
    sync_last = run.train.grad_sync == "last" and run.train.accumulation_steps > 1
    # a group's gradients in its compute dtype until reduce-scattered; when syncing only on the
    # last micro-batch, every group's accumulate in fp32 until then
    unsharded_grads = params * 4 if sync_last else largest * compute_bytes
    return {
        "largest_unsharded_group": largest * compute_bytes,
        "kept_unsharded_parameters": kept * compute_bytes,
        "prefetch_buffer": prefetched * compute_bytes,
        "unsharded_gradients": unsharded_grads,
    }


def _activation_bytes(run: RunConfig, shape: ModelShape, compute_bytes: int) -> float:
    """Saved activations of one micro-batch (gradients are computed one at a time).

    Per token and block, what autograd keeps for a Llama block: norm inputs and outputs, q, k,
    v and their rotated fp32 copies, the attention output, the three MLP projections and their
    product. A checkpointed block keeps only its input, and one block's activations exist
    while it is recomputed; selective_op keeps, in every block, the attention output and the
    outputs of every other matmul (q, v, the output projection's input... about half the
    projections' outputs).
    """
    tokens = run.data.micro_batch_size * run.data.seq_len
    kv = shape.n_kv_heads * shape.head_dim
    per_token = (6 * shape.dim + 2 * kv + 4 * shape.ffn_dim) * compute_bytes
    per_token += (shape.dim + kv) * 4  # rotary embedding works in fp32
    block = tokens * per_token
    embedding = tokens * shape.dim * compute_bytes
    block_input = tokens * shape.dim * compute_bytes
    mode = run.fsdp.activation_checkpointing
    if mode == "selective_op":
        matmuls = (2 * shape.dim + 2 * kv + 3 * shape.ffn_dim) * compute_bytes / 2
        kept = tokens * (matmuls + 2 * shape.dim * compute_bytes) + block_input
        return embedding + kept * shape.n_layers + block
    checkpointed = _checkpointed_blocks(run, shape)
    if checkpointed == 0:
        return embedding + block * shape.n_layers
    full = shape.n_layers - checkpointed
    return embedding + block_input * checkpointed + block * full + block


def _checkpointed_blocks(run: RunConfig, shape: ModelShape) -> int:
    """Blocks checkpointed whole (block, every_N); 0 for none and selective_op."""
    every = checkpointed_every(run.fsdp.activation_checkpointing)
    return 0 if every is None else -(-shape.n_layers // every)


def _blocks_holding_activations(run: RunConfig, shape: ModelShape) -> int:
    """Blocks whose activations are held at once at most: all without checkpointing (and,
    leaning high, with selective_op), else those not checkpointed and the one recomputed."""
    checkpointed = _checkpointed_blocks(run, shape)
    return shape.n_layers if checkpointed == 0 else shape.n_layers - checkpointed + 1


def _parameter_shapes(shape: ModelShape) -> list[tuple[int, int]]:
    """(rows, cols) of every parameter; vectors are (rows, 1)."""
    kv = shape.n_kv_heads * shape.head_dim
    d, f = shape.dim, shape.ffn_dim
    block = [(d, d), (kv, d), (kv, d), (d, d), (f, d), (d, f), (f, d), (d, 1), (d, 1)]
    out = [(shape.vocab_size, d), *block * shape.n_layers, (d, 1)]
    if not shape.tie_embeddings:
        out.append((shape.vocab_size, d))
    return out


def _padded(rows: int, cols: int, ranks: int) -> int:
    """FSDP2 pads dim 0 to a multiple of the shard count."""
    return -(-rows // ranks) * ranks * cols
