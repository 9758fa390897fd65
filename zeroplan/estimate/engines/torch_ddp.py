"""PyTorch data parallelism: DDP (stage 0) and DDP + ZeroRedundancyOptimizer (stage 1).

- DistributedDataParallel (torch/nn/parallel/distributed.py, csrc/distributed/c10d/reducer.cpp
  `Reducer::initialize_buckets`): at construction the reducer allocates flat bucket tensors that
  together hold one gradient per trainable parameter; with the default
  gradient_as_bucket_view=False each .grad is a separate tensor copied into its bucket.
- ZeroRedundancyOptimizer (torch/distributed/optim/zero_redundancy_optimizer.py
  `_partition_parameters`): parameters sorted by size, largest first, each assigned to the rank
  with the fewest elements so far; each rank's local optimizer holds states for its share only,
  and `step()` broadcasts updated parameters in place.
- Precision: fp32 and the 16-bit modes keep fp32 parameters (torch.autocast computes in 16-bit,
  the optimizer sees fp32); pure-bf16 casts the model to bf16, states follow the parameter dtype.
- Optimizer states are created lazily by the first `step()` (torch/optim/adam.py `_init_group`);
  gradients are freed by `zero_grad(set_to_none=True)` after each step.
"""

from __future__ import annotations

import heapq

from zeroplan.estimate.activations import ActivationBytes
from zeroplan.estimate.caches import memo
from zeroplan.estimate.dtypes import FP32_BYTES, HALF_BYTES, optimizer_state_bytes
from zeroplan.estimate.engines.common import (
    EngineEstimate,
    Setup,
    early_gradients,
    largest_point,
    phase,
    step_temporary_bytes,
)
from zeroplan.estimate.facts import ModelFacts
from zeroplan.estimate.result import NodeBytes, Phase, Step
from zeroplan.spec.training import Precision


def zero_redundancy_shards(numels: list[int], world_size: int) -> list[list[int]]:
    """The tensors each rank owns under ZeroRedundancyOptimizer's greedy partition."""
    heap = [(0, rank) for rank in range(world_size)]
    shards: list[list[int]] = [[] for _ in range(world_size)]
    for numel in sorted(numels, reverse=True):
        size, rank = heapq.heappop(heap)
        shards[rank].append(numel)
        heapq.heappush(heap, (size + numel, rank))
    return shards


@memo(maxsize=1024)  # a greedy walk over every tensor: torch-engine plans take 3-20x longer without it
def _largest_local_shard(facts: ModelFacts, world_size: int) -> tuple[int, ...]:
    """The trainable tensors of the rank with the most elements (all of them without sharding)."""
    numels = facts.trainable_numels() or [facts.trainable_params]
    if world_size == 1:
        return tuple(numels)
    return tuple(max(zero_redundancy_shards(numels, world_size), key=sum))


def estimate_torch(facts: ModelFacts, setup: Setup, acts: ActivationBytes | None) -> EngineEstimate:
    element = HALF_BYTES if setup.precision == Precision.PURE_BF16 else FP32_BYTES
    local = _largest_local_shard(facts, setup.gpus if setup.zero_stage == 1 else 1)
    params = facts.total_params * element
    grads = facts.trainable_params * element
    buckets = facts.trainable_params * element  # DDP reducer buckets, allocated at wrap time
    states = optimizer_state_bytes(sum(local), setup.optimizer, element)
    temporaries = step_temporary_bytes(max(local, default=0), sum(local), element, setup.optimizer, setup.device)
    accumulating = setup.accumulating  # .grad survives between micro-batches
    head_numel, tied_numel, first_numel = early_gradients(facts)
    block_numel = max((g.params for g in facts.groups if g.role == "block" and not g.frozen), default=0)
    num_blocks = acts.num_blocks if acts else 0

    phases = []
    for step, held_states in ((Step.FIRST, 0), (Step.STEADY, states)):
        base = dict(params=params, buffers=buckets, optimizer_states=held_states)
        if step == Step.FIRST:
            phases.append(phase(step, Phase.INIT, **base))
        grads_before = grads if accumulating else 0
        phases.append(phase(step, Phase.FORWARD, **base, grads=grads_before, activations=max(acts.forward_peak, acts.blocks_end_peak) if acts else 0))
        # Backward's moments: the loss's, each block's (linear in the blocks done between the
        # ends), the end with every .grad present (docs/engines/torch.md).
        points = [dict(grads=grads, temporaries=2 * tied_numel * element)]
        if acts is not None:
            points.append(dict(grads=grads_before, activations=acts.forward_end, temporaries=acts.logits_grad))
            points.append(dict(grads=max(grads_before, head_numel * element), activations=acts.head_backward_saved,
                               temporaries=acts.head_backward_temporary + tied_numel * element))
            for j in acts.backward_blocks():
                done = (head_numel + first_numel + j * block_numel) * element
                points.append(dict(grads=max(grads_before, done), activations=acts.block_backward_saved(num_blocks - j),
                                   temporaries=acts.block_backward_temporary_at(num_blocks - j) + tied_numel * element))
        worst = largest_point(*points)
        phases.append(phase(step, Phase.BACKWARD, **base, **worst))
        phases.append(
            phase(step, Phase.OPTIMIZER_STEP, params=params, buffers=buckets, grads=grads,
                  optimizer_states=states, temporaries=temporaries)
        )
    notes = []
    if setup.zero_stage == 1:
        notes.append(f"ZeroRedundancyOptimizer: largest rank holds states for {sum(local):,} of {facts.trainable_params:,} elements")
    return EngineEstimate(tuple(phases), NodeBytes(), tuple(notes))
