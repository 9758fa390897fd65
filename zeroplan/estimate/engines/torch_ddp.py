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
from typing import NamedTuple

from zeroplan.estimate.activations.transformer import ActivationBytes
from zeroplan.estimate.caches import memo
from zeroplan.estimate.dtypes import FP32_BYTES, HALF_BYTES, optimizer_state_bytes
from zeroplan.estimate.engines.bnb_optim import (BnbStates, StateTensor, bnb_states, cpu_step_temporary_bytes,
                                                 trainer_keeps_32bit)
from zeroplan.estimate.engines.common import (
    EngineEstimate,
    Setup,
    early_gradient_sizes,
    early_gradients,
    largest_point,
    phase,
    step_temporary_bytes,
)
from zeroplan.estimate.model.facts import ModelFacts
from zeroplan.estimate.result import NodeBytes, Phase, PhaseBytes, Step
from zeroplan.estimate.terms import named, register
from zeroplan.spec.program import Recipe
from zeroplan.spec.training import Device, Optimizer, Precision

register({
    "parameters": "torch/nn/modules/module.py (the model's parameters, on every rank under DDP)",
    "DDP reducer buckets": "torch/csrc/distributed/c10d/reducer.cpp Reducer::initialize_buckets",
    "DDP output clones": "torch/nn/parallel/distributed.py _DDPSink (docs/engines/torch.md)",
    "gradients whole beyond their parameter shards": "torch/distributed/tensor/_ops/_embedding_ops.py (a TP rowwise "
                                                     "embedding's Replicate gradient: estimate/parallel/tp_embedding.py)",
})


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
def largest_local_shard(facts: ModelFacts, world_size: int) -> tuple[tuple[int, int], ...]:
    """The trainable tensors, as (elements, own element size or 0), of the rank with the most elements (all of
    them without sharding): ZeroRedundancyOptimizer partitions by elements whatever a tensor's dtype."""
    tensors = [(t.numel, t.element) for g in facts.groups for _ in range(g.count) for t in g.trainable_tensors]
    tensors = tensors or [(facts.trainable_params, 0)]
    if world_size == 1:
        return tuple(tensors)
    owners = zero_redundancy_shards([numel for numel, _ in tensors], world_size)
    largest = max(range(world_size), key=lambda rank: sum(owners[rank]))
    # the rank's tensors by size: which of equal-sized ones it holds does not change its bytes unless their
    # dtypes differ, and then the partition (elements alone) does not say: the wider are taken first
    left = sorted(tensors, key=lambda tensor: (-tensor[0], -tensor[1]))
    held = []
    for numel in owners[largest]:
        index = next(i for i, tensor in enumerate(left) if tensor[0] == numel)
        held.append(left.pop(index))
    return tuple(held)


class _Sizes(NamedTuple):
    """Bytes the torch engine holds for `facts`, each tensor in its own dtype where it keeps one (a
    modules_to_save copy in the base's: layout.py `ParamTensor.element`; this engine casts nothing)."""

    params: int
    trainable: int  # every .grad (and DDP's buckets)
    local_states: int  # the optimizer states of the rank's shard
    largest_local: int  # bytes of its largest tensor and of the whole shard, for the step's temporaries
    total_local: int
    head: int  # early gradients (common.py `early_gradients`), in bytes
    tied: int
    first: int
    block: int  # the largest block's trainable bytes


@memo(maxsize=1024)  # the planner asks again at every micro-batch
def _sizes(facts: ModelFacts, element: int, world_size: int, optimizer: Optimizer) -> _Sizes:
    def own(tensor) -> int:
        return tensor.element or element

    def wider(tensors) -> int:  # what tensors of their own dtype take beyond the engine's element
        return sum(t.numel * (own(t) - element) for t in tensors)

    params = facts.total_params * element + sum(g.count * wider(g.tensors) for g in facts.groups)
    trainable = facts.trainable_params * element + sum(g.count * wider(g.trainable_tensors) for g in facts.groups)
    local = largest_local_shard(facts, world_size)
    local_bytes = [numel * (kept or element) for numel, kept in local]
    # the states of the shard's elements at the engine's element, and of tensors of their own dtype at theirs
    states = optimizer_state_bytes(sum(numel for numel, _ in local), optimizer, element) + sum(
        optimizer_state_bytes(numel, optimizer, kept) - optimizer_state_bytes(numel, optimizer, element)
        for numel, kept in local if kept)
    head, tied, first = early_gradient_sizes(facts, lambda t: t.numel * own(t))
    block = max((sum(t.numel * own(t) for t in g.trainable_tensors) for g in facts.groups
                 if g.role == "block" and not g.frozen), default=0)
    return _Sizes(params, trainable, states, max(local_bytes, default=0), sum(local_bytes), head, tied, first, block)


def _trainer_output_clones(setup: Setup, acts: ActivationBytes) -> int:
    """Activations at the end of a DDP forward under the Hugging Face Trainer (docs/engines/torch.md).

    The Trainer sets find_unused_parameters unless checkpointing is on (transformers 5.23.0 trainer.py
    `_build_accelerator_args`), so DDP passes the outputs through `_DDPSink`, which clones them
    (torch/nn/parallel/distributed.py `_post_forward`); the model's output, fp32 logits (accelerate's
    `convert_outputs_to_fp32` under autocast), is alive beside its clone until `compute_loss` returns."""
    program = setup.program
    if program.recipe != Recipe.HF_TRAINER or not program.ddp or acts.recompute_block:
        return 0
    fp32_logits = acts.loss_saved  # log_softmax's saved output: the logits' shape in fp32
    return acts.forward_end + named("DDP output clones", 2 * int(fp32_logits))


def estimate_torch(facts: ModelFacts, setup: Setup, acts: ActivationBytes | None) -> EngineEstimate:
    element = HALF_BYTES if setup.precision == Precision.PURE_BF16 else FP32_BYTES
    world = setup.gpus if setup.zero_stage == 1 else 1
    z = _sizes(facts, element, world, setup.optimizer)
    params = named("parameters", z.params)
    grads = (named("gradients (.grad)", z.trainable)
             + named("gradients whole beyond their parameter shards", facts.replicated_grad_params * element))
    # DDP reducer buckets, allocated at wrap time, each gradient in its parameter's dtype (reducer.cpp, one bucket
    # per dtype); a single rank without the wrapper has none
    buckets = named("DDP reducer buckets", z.trainable if setup.program.ddp else 0)
    states = named("optimizer states", z.local_states)
    # the step's temporaries are each tensor's own size and dtype (`step_temporary_bytes` over bytes)
    temporaries = named("optimizer step temporaries", step_temporary_bytes(
        z.largest_local, z.total_local, 1, setup.optimizer, setup.program.optimizer_impl))
    node = NodeBytes()
    if setup.optimizer.is_bitsandbytes:  # bitsandbytes' states, per tensor (engines/bnb_optim.py)
        bnb = _bnb_sizes(facts, setup, element, world, 1)
        states, temporaries, node = bnb.device, bnb.step_temporaries, NodeBytes(unified_bytes=bnb.paged * setup.node_gpus)
    if setup.program.optimizer_in_backward:
        notes = [] if setup.zero_stage == 0 else ["ZeroRedundancyOptimizer on one rank holds every state"]
        phases = _in_backward_phases(facts, setup, acts, element, params, buckets)
        if setup.optimizer.is_bitsandbytes:
            node = NodeBytes(unified_bytes=_bnb_sizes(facts, setup, element, world, 0).paged * setup.node_gpus)
        return EngineEstimate(tuple(phases), node, tuple(notes))
    # .grad survives between micro-batches whatever grad_sync says: with no_sync the bucket idles,
    # without it reducer.cpp copies each .grad into its bucket and the result back (same bytes).
    # Where the model was built (model_init) does not matter either: DDP wraps it whole, in fp32.
    accumulating = setup.accumulating
    num_blocks = acts.num_blocks if acts else 0

    phases = []
    for step, held_states in ((Step.FIRST, 0), (Step.STEADY, states)):
        base = dict(params=params, buffers=buckets, optimizer_states=held_states)
        if step == Step.FIRST:
            phases.append(phase(step, Phase.INIT, **base))
        grads_before = grads if accumulating else 0
        forward = max(acts.forward_peak, acts.blocks_end_peak, _trainer_output_clones(setup, acts)) if acts else 0
        phases.append(phase(step, Phase.FORWARD, **base, grads=grads_before, activations=forward))
        # Backward's moments: the loss's, each block's (linear in the blocks done between the
        # ends), the end with every .grad present (docs/engines/torch.md).
        tied = named("tied head gradient pending in autograd", z.tied)
        points = [dict(grads=grads, temporaries=2 * tied)]
        if acts is not None:
            points.append(dict(grads=grads_before, activations=acts.forward_end, temporaries=acts.logits_grad))
            points.append(dict(grads=max(grads_before, named("gradients (.grad)", z.head)),
                               activations=acts.head_backward_saved, temporaries=acts.head_backward_temporary + tied))
            for j in acts.backward_blocks():
                done = named("gradients (.grad)", z.head + z.first + j * z.block)
                points.append(dict(grads=max(grads_before, done), activations=acts.block_backward_saved(num_blocks - j),
                                   temporaries=acts.block_backward_temporary_at(num_blocks - j) + tied))
        worst = largest_point(*points)
        phases.append(phase(step, Phase.BACKWARD, **base, **worst))
        phases.append(
            phase(step, Phase.OPTIMIZER_STEP, params=params, buffers=buckets, grads=grads,
                  optimizer_states=states, temporaries=temporaries)
        )
    notes = []
    if setup.zero_stage == 1:
        held = sum(numel for numel, _ in largest_local_shard(facts, world))
        notes.append(f"ZeroRedundancyOptimizer: largest rank holds states for {held:,} of {facts.trainable_params:,} elements")
    return EngineEstimate(tuple(phases), node, tuple(notes))


@memo(maxsize=256)
def _bnb_sizes(facts: ModelFacts, setup: Setup, element: int, world: int, instances: int) -> BnbStates:
    """bitsandbytes' states of the tensors the rank steps (`instances` 0: one optimizer per parameter)."""
    tensors = _bnb_tensors(facts, setup, element, world)
    return bnb_states(tensors, setup.optimizer, paged=setup.paged_optimizer, cuda=setup.device == Device.CUDA,
                      instances=instances or len(tensors))


def _bnb_tensors(facts: ModelFacts, setup: Setup, element: int, world: int) -> list[StateTensor]:
    if world > 1:  # ZeroRedundancyOptimizer's shard: whole tensors (the Trainer has no ZeRO-1 to override)
        return [StateTensor(numel, kept or element) for numel, kept in largest_local_shard(facts, world)]
    # the Trainer's 8-bit optimizers keep nn.Embedding weights at 32 bits (engines/bnb_optim.py)
    override = setup.program.recipe == Recipe.HF_TRAINER and setup.optimizer == Optimizer.ADAM_8BIT
    return [StateTensor(t.numel, t.element or element, override and trainer_keeps_32bit(t.role, t.name))
            for g in facts.groups for _ in range(g.count) for t in g.trainable_tensors]


def _in_backward_phases(facts: ModelFacts, setup: Setup, acts: ActivationBytes | None, element: int, params: int,
                        buckets: int) -> list[PhaseBytes]:
    """The optimizer stepped in backward (torchtune training/memory.py `register_optim_in_bwd_hooks`):
    one optimizer per parameter, stepped in its post-accumulate-grad hook, which then frees the
    gradient, so one parameter's .grad and its step's temporaries live at a time; each parameter's
    states appear at its first step, during the first backward (docs/engines/torch.md)."""
    impl = setup.program.optimizer_impl
    trainable = [g for g in facts.groups if not g.frozen]

    def largest(role: str) -> int:
        return max((t.numel for g in trainable if g.role == role for t in g.trainable_tensors), default=0)

    bnb = setup.optimizer.is_bitsandbytes

    def stepping(numel: int) -> tuple[int, int]:
        """(.grad, step temporaries) of one parameter of `numel` elements in its hook."""
        if bnb:
            temporary = 0 if setup.device == Device.CUDA else cpu_step_temporary_bytes(
                StateTensor(numel, element), setup.optimizer)
            return (named("gradients (.grad)", numel * element),
                    named("optimizer step temporaries (bitsandbytes on CPU)", temporary))
        return (named("gradients (.grad)", numel * element),
                named("optimizer step temporaries", step_temporary_bytes(numel, numel, element, setup.optimizer, impl)))

    all_bnb = _bnb_sizes(facts, setup, element, 1, 0).device if bnb else 0

    def states_of(numel: int) -> int:
        if bnb:  # each parameter's own states: the share of the whole stepped so far
            return all_bnb if numel == facts.trainable_params else all_bnb * numel // max(facts.trainable_params, 1)
        return named("optimizer states", optimizer_state_bytes(numel, setup.optimizer, element))

    all_states = states_of(facts.trainable_params)
    head_params = sum(g.trainable_params for g in trainable if g.role == "final")
    block_params = max((g.trainable_params for g in trainable if g.role == "block"), default=0)
    _, tied_numel, _ = early_gradients(facts)
    tied = named("tied head gradient pending in autograd", tied_numel * element)
    num_blocks = acts.num_blocks if acts else 0
    phases = []
    for step in (Step.FIRST, Step.STEADY):
        def held(stepped_numel: int) -> int:
            return all_states if step == Step.STEADY else states_of(stepped_numel)

        base = dict(params=params, buffers=buckets)
        if step == Step.FIRST:
            phases.append(phase(step, Phase.INIT, **base))
        phases.append(phase(step, Phase.FORWARD, **base, optimizer_states=held(0),
                            activations=max(acts.forward_peak, acts.blocks_end_peak) if acts else 0))
        # the end: the embedding's .grad (with a tied head, the sum of both contributions) steps last
        grad, temps = stepping(largest("embedding"))
        points = [dict(optimizer_states=all_states, grads=grad, temporaries=temps + 2 * tied)]
        if acts is not None:
            points.append(dict(optimizer_states=held(0), activations=acts.forward_end, temporaries=acts.logits_grad))
            # a hook runs once its node's backward has returned: the gradients then in flight are the
            # input's (residual width), the node's other temporaries are freed
            in_flight = acts.block_input_grad + tied
            points.append(dict(optimizer_states=held(0), activations=acts.head_backward_saved,
                               temporaries=acts.head_backward_temporary + tied))
            grad, temps = stepping(largest("final"))
            points.append(dict(optimizer_states=held(head_params), grads=grad, activations=acts.head_backward_saved,
                               temporaries=in_flight + temps))
            grad, temps = stepping(largest("block"))
            for j in sorted({0, 1, num_blocks - 2, num_blocks - 1}):
                if 0 <= j < num_blocks:
                    saved = acts.block_backward_saved(num_blocks - j)
                    points.append(dict(optimizer_states=held(head_params + j * block_params), activations=saved,
                                       temporaries=acts.block_backward_temporary + tied))
                    points.append(dict(optimizer_states=held(head_params + (j + 1) * block_params), grads=grad,
                                       activations=saved, temporaries=in_flight + temps))
        phases.append(phase(step, Phase.BACKWARD, **base, **largest_point(*points)))
        # every parameter has stepped in backward: the step itself holds only what stays
        phases.append(phase(step, Phase.OPTIMIZER_STEP, **base, optimizer_states=all_states))
    return phases
