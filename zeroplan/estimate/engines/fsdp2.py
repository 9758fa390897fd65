"""PyTorch FSDP2 (`torch.distributed.fsdp.fully_shard`), one unit per transformer block plus the
root (embeddings, final norm, output head), as zeroplan's measure mode wraps a model.

Read from torch/distributed/fsdp/_fully_shard/ (torch 2.13):
- `_fsdp_param.py` FSDPParam: each parameter is sharded on dim 0, padded to a multiple of the
  world size (`_sharded_param_data` holds ceil(rows/N) rows on every rank); the local shard seen
  by the optimizer is the unpadded chunk, largest on rank 0.
- `_fsdp_collectives.py` foreach_all_gather / foreach_all_gather_copy_out: a flat all-gather
  output of the unit's padded size in param_dtype, copied out into per-parameter unsharded
  tensors: both are alive while copying (2 x unit), then the flat buffer is freed.
- foreach_reduce: unsharded gradients (param_dtype) are copied into a reduce-scatter input of
  the unit's padded size in reduce_dtype, freed, and the reduce-scatter output (one shard) becomes
  the sharded .grad (views into it).
- `_fully_shard.py`: reshard_after_forward=True frees the unsharded parameters after each unit's
  forward and re-gathers them in backward (ZeRO-3); False keeps them until the unit's
  post-backward (ZeRO-2). An explicitly passed value applies to the root too; only `None` makes
  the root keep its parameters (`_fsdp_state.py` _lazy_init).
- CPUOffloadPolicy: sharded parameters, sharded gradients and the optimizer step live on the host;
  each all-gather first copies the unit's shards to the device.
- MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): shards stay fp32, gathers are bf16,
  gradients are reduced and kept in fp32.
The root's unsharded gradients (the output head's first) are alive from the start of backward
until the root's post-backward at the very end.
"""

from __future__ import annotations

from functools import lru_cache

from zeroplan.estimate.activations import ActivationBytes
from zeroplan.estimate.dtypes import FP32_BYTES, HALF_BYTES, optimizer_state_bytes
from zeroplan.estimate.engines.common import EngineEstimate, activation_phases, ceil_div, phase, step_temporary_bytes
from zeroplan.estimate.facts import ModelFacts
from zeroplan.estimate.result import NodeBytes, Phase, PhaseBytes, Step
from zeroplan.spec.training import Device, Offload, Precision, TrainingSpec


def _padded_shard(numel: int, rows: int, world: int) -> int:
    return ceil_div(rows, world) * (numel // rows)


@lru_cache(maxsize=4096)
def _shards(facts: ModelFacts, n: int) -> tuple[int, int, int, int, int]:
    """Per-rank padded elements: root unit, largest block, all, trainable, largest trainable tensor."""

    def shard_elems(group) -> int:
        return sum(_padded_shard(t.numel, t.rows, n) for t in group.tensors)

    # The root unit holds every non-block group (embeddings, final norm, output head).
    root = sum(shard_elems(g) for g in facts.groups if g.role != "block")
    block = max((shard_elems(g) for g in facts.groups if g.role == "block"), default=0)
    total = sum(shard_elems(g) * g.count for g in facts.groups)
    trainable = sum(shard_elems(g) * g.count for g in facts.groups if not g.frozen)
    largest = max((_padded_shard(t.numel, t.rows, n) for g in facts.groups if not g.frozen for t in g.tensors), default=0)
    return root, block, total, trainable, largest


def _largest(*points: dict[str, int]) -> dict[str, int]:
    return max(points, key=lambda p: sum(p.values()))


def estimate_fsdp2(facts: ModelFacts, training: TrainingSpec, acts: ActivationBytes | None) -> EngineEstimate:
    n = training.gpus
    storage = HALF_BYTES if training.precision == Precision.PURE_BF16 else FP32_BYTES
    gathered = FP32_BYTES if training.precision == Precision.FP32 else HALF_BYTES
    reduce = storage  # reduce_dtype fp32 under mixed precision, the model dtype otherwise
    offloaded = training.offload_optimizer == Offload.CPU
    on_device = not offloaded or training.device == Device.CPU  # a CPU run has one memory

    root_shard, block_shard, shard_total, trainable_shard, largest_local = _shards(facts, n)

    sharded_params = shard_total * storage if on_device else 0
    sharded_grads = trainable_shard * reduce if on_device else 0
    states = optimizer_state_bytes(trainable_shard, training.optimizer, storage) if on_device else 0
    temporaries = step_temporary_bytes(largest_local, trainable_shard, storage, training) if on_device else 0
    root_gathered = root_shard * n * gathered
    block_gathered = block_shard * n * gathered
    all_gathered = shard_total * n * gathered
    root_grads = root_shard * n * gathered
    block_grads = block_shard * n * gathered
    root_reduce_in = root_shard * n * reduce
    block_reduce_in = block_shard * n * reduce
    h2d_copy = 0 if on_device else max(root_shard, block_shard) * storage

    reshard = training.zero_stage == 3
    root_reshards = reshard if training.fsdp2.reshard_root_after_forward is None else training.fsdp2.reshard_root_after_forward
    fwd_acts, bwd_acts, recompute = activation_phases(acts)
    block_acts = acts.num_blocks * acts.saved_per_block if acts else 0
    accumulating = training.grad_accum > 1

    phases: list[PhaseBytes] = []
    for step, held_states in ((Step.FIRST, 0), (Step.STEADY, states)):
        base = dict(params=sharded_params, optimizer_states=held_states)
        held_grads = sharded_grads if accumulating else 0
        if step == Step.FIRST:
            phases.append(phase(step, Phase.INIT, **base))
        # Forward: gathering the root (2 x unit while copying out), then the last block with
        # every block's activations saved, then the logits and loss.
        gathered_in_forward = all_gathered if not reshard else root_gathered + block_gathered
        forward = _largest(
            dict(buffers=2 * root_gathered + h2d_copy, grads=held_grads),
            dict(buffers=gathered_in_forward + (block_gathered if reshard else 0) + h2d_copy,
                 grads=held_grads, activations=block_acts),
            dict(buffers=(all_gathered if not reshard else root_gathered), grads=held_grads, activations=fwd_acts),
        )
        phases.append(phase(step, Phase.FORWARD, **base, **forward))
        # Backward: its start (logits' gradients, root re-gathered if it resharded), the first
        # block processed (its gather, gradients and reduce-scatter input), and its end (root
        # gradients reduce-scattered, every sharded gradient present).
        held_gathered = all_gathered if not reshard else root_gathered
        regather = 2 * root_gathered if (root_reshards and reshard) else held_gathered
        backward = _largest(
            dict(buffers=regather + h2d_copy, grads=held_grads, activations=bwd_acts),
            dict(buffers=held_gathered + (block_gathered if reshard else 0) + block_reduce_in,
                 grads=held_grads + root_grads + block_grads, activations=block_acts + recompute),
            dict(buffers=root_gathered + root_reduce_in, grads=sharded_grads + held_grads + root_grads),
        )
        phases.append(phase(step, Phase.BACKWARD, **base, **backward))
        phases.append(phase(step, Phase.OPTIMIZER_STEP, params=sharded_params, grads=sharded_grads,
                            optimizer_states=states, temporaries=temporaries))
    host = 0
    notes = []
    if offloaded:
        host_bytes = (shard_total * storage + trainable_shard * reduce
                      + optimizer_state_bytes(trainable_shard, training.optimizer, storage))
        host = host_bytes * training.node_gpus
        if training.device == Device.CPU:
            notes.append(f"CPU run: the {host_bytes:,} offloaded bytes per rank share the one memory; on GPUs they sit on the host")
    return EngineEstimate(tuple(phases), NodeBytes(cpu_bytes=host, pinned_bytes=0 if training.device == Device.CPU else host), tuple(notes))
