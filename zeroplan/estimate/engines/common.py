"""Pieces every engine profile shares: what a profile reads of the training spec (`Setup`), the
optimizer step's temporaries, sharding arithmetic, and the per-phase record."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from zeroplan.estimate.activations.transformer import ActivationBytes
from zeroplan.estimate.model.facts import ModelFacts
from zeroplan.estimate.model.layout import ParamTensor
from zeroplan.estimate.result import CategoryBytes, NodeBytes, Phase, PhaseBytes, Step
from zeroplan.estimate.terms import register
from zeroplan.spec.fsdp1 import FSDP1Wrapping
from zeroplan.spec.program import OptimizerImpl, Program
from zeroplan.spec.training import DeepSpeedKnobs, Device, Offload, Optimizer, Precision, TrainingSpec


# Terms every engine names alike (estimate/terms.py).
register({
    "gradients (.grad)": "torch/csrc/autograd/functions/accumulate_grad.h (one .grad per trainable parameter)",
    "optimizer states": "torch/optim/adam.py _init_group (exp_avg, exp_avg_sq; SGD momentum_buffer)",
    "optimizer step temporaries": "torch/optim/adam.py _single_tensor_adam / _multi_tensor_adam (docs/engines/torch.md)",
    "tied head gradient pending in autograd": "torch/csrc/autograd/input_buffer.cpp accumulate",
})


class DeepSpeedSizes(NamedTuple):
    """The `zero_optimization` knobs the DeepSpeed profile reads (spec/training.py DeepSpeedKnobs)."""

    reduce_bucket_size: int
    overlap_comm: bool | None
    stage3_prefetch_bucket_size: int
    stage3_max_live_parameters: int
    stage3_max_reuse_distance: int
    stage3_param_persistence_threshold: int
    offload_pin_memory: bool
    offload_buffer_count: int
    offload_buffer_size: int
    sub_group_size: int
    client_optimizer: bool


class Setup(NamedTuple):
    """What the engine profiles read of a `TrainingSpec`: the world, the dtypes and where the states
    live, not the batch (the activations carry that). Plain values, so it keys the profiles' caches."""

    zero_stage: int
    gpus: int
    node_gpus: int
    precision: Precision
    optimizer: Optimizer
    offload_optimizer: Offload
    offload_params: Offload
    device: Device
    accumulating: bool  # grad_accum > 1: the profiles keep one accumulated gradient, whatever the count
    deepspeed: DeepSpeedSizes
    fsdp2: FSDP2Wrapping  # FSDP2's units and which reshard after forward
    program: Program  # the training program around the engine, every knob resolved (spec/program.py)
    expert_gpus: int = 0  # FSDP2 under EP: ranks sharding the expert tensors (efsdp; estimate/parallel/experts.py); 0: gpus
    recompute_held_element: int = 0  # ZeRO-3 keeps a rebuilt LoRA block gathered: its adapters' bytes (estimate/adapters/zero3.py)
    float8_all_gather: bool = False  # FSDP2 gathers the blocks' linear weights in float8 (torchao enable_fsdp_float8_all_gather)
    paged_optimizer: bool = False  # bitsandbytes' paged states (engines/bnb_optim.py)
    fsdp1: FSDP1Wrapping | None = None  # engine fsdp1: its settings (spec/fsdp1.py), None for the other engines


def deepspeed_sizes(knobs: DeepSpeedKnobs) -> DeepSpeedSizes:
    return DeepSpeedSizes(
        knobs.reduce_bucket_size, knobs.overlap_comm, knobs.stage3_prefetch_bucket_size, knobs.stage3_max_live_parameters,
        knobs.stage3_max_reuse_distance, knobs.stage3_param_persistence_threshold,
        knobs.offload_pin_memory, knobs.offload_buffer_count, knobs.offload_buffer_size, knobs.sub_group_size,
        knobs.client_optimizer)


def setup_of(training: TrainingSpec) -> Setup:
    """The one place a training spec becomes what the engine profiles read."""
    return Setup(training.zero_stage, training.gpus, training.node_gpus, training.precision, training.optimizer,
                 training.offload_optimizer, training.offload_params, training.device, training.grad_accum > 1,
                 deepspeed_sizes(training.deepspeed), training.fsdp2_wrapping, training.program,
                 recompute_held_element=_recompute_held_element(training),
                 float8_all_gather=training.float8 is not None and training.float8.fsdp_all_gather,
                 paged_optimizer=training.paged_optimizer,
                 fsdp1=training.fsdp1_wrapping if training.engine.value == "fsdp1" else None)


def _recompute_held_element(training: TrainingSpec) -> int:
    from zeroplan.estimate.adapters.zero3 import recompute_trainable_element

    return recompute_trainable_element(training)


class EngineEstimate(NamedTuple):
    phases: tuple[PhaseBytes, ...]
    per_node: NodeBytes
    notes: tuple[str, ...] = ()
    # moments after a phase's peak, in program order (each names its step and phase), that the allocator replay
    # reads and the phase's figures do not: a large request late in a phase (ledger.py Moment.passing)
    passing: tuple[PhaseBytes, ...] = ()


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def step_temporary_bytes(largest_numel: int, total_numel: int, state_element_bytes: int, optimizer: Optimizer,
                         impl: OptimizerImpl) -> int:
    """Peak temporaries of one torch Adam/AdamW step over a rank's local tensors, by kernel
    (torch/optim/adam.py; derivation in docs/engines/torch.md "Optimizer step temporaries").

    - for-loop, `_single_tensor_adam`: `denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)`
      holds the sqrt and the quotient at once, each the size of the tensor being stepped: two
      temporaries of the largest tensor.
    - foreach, `_multi_tensor_adam`: `exp_avg_sq_sqrt = torch._foreach_sqrt(device_exp_avg_sqs)`
      is one list the size of the whole group; the divisions and the update are in place.
    - fused, `_fused_adam`: `torch._fused_adamw_` updates in place: none.
    SGD with momentum updates in place in every kernel.
    """
    if optimizer == Optimizer.SGD or impl == OptimizerImpl.FUSED:
        return 0
    if impl == OptimizerImpl.FOR_LOOP:
        return 2 * largest_numel * state_element_bytes
    return total_numel * state_element_bytes


def step_temporary_tensors(impl: OptimizerImpl) -> int:
    """How many tensors the size of the stepped tensor `step_temporary_bytes` holds at once, stepping a list of one
    (a flat partition): the for-loop's sqrt and quotient (torch/optim/adam.py `_single_tensor_adam`: `denom =
    (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)`), foreach's one-tensor `exp_avg_sq_sqrt` list
    (`_multi_tensor_adam`: `torch._foreach_sqrt(device_exp_avg_sqs)`, the rest in place); fused allocates none."""
    return 2 if impl == OptimizerImpl.FOR_LOOP else 1


def early_gradients(facts: ModelFacts) -> tuple[int, int, int]:
    """Gradient elements alive early in backward: the output head's .grad (lm_head and the final
    norm), the tied head's gradient, and a block's output projection's .grad (the first gradient
    of a block's backward: down_proj / c_proj, weight and bias).

    A tied head's gradient is not a .grad yet: autograd sums the contributions to a leaf used
    twice in its input buffer and calls AccumulateGrad once, after the embedding's backward
    (torch/csrc/autograd/input_buffer.cpp). Until then it is held by autograd like an
    activation, and `zeroplan measure` counts it so."""
    return early_gradient_sizes(facts, lambda t: t.numel)


_MLP_ROLES = ("mlp_in", "mlp_out", "router", "experts")  # a block's MLP, dense or sparse (model/layout.py ROLES)


def early_gradient_sizes(facts: ModelFacts, size: Callable[[ParamTensor], int]) -> tuple[int, int, int]:
    """`early_gradients` with each tensor measured by `size` (its elements, or its bytes in its own dtype)."""
    head = tied = 0
    final = [g for g in facts.groups if g.role == "final" and not g.frozen]
    if final:
        head = sum(size(t) for t in final[0].trainable_tensors)
        if not any(t.name.startswith("lm_head") for t in final[0].trainable_tensors):
            tied = max((size(t) for g in facts.groups if g.role == "embedding" for t in g.trainable_tensors), default=0)
    blocks = [g for g in facts.groups if g.role == "block" and not g.frozen]
    first = 0
    # The output projection: the MLP's last matmul in registration order (the layout lists a block's
    # tensors as the model registers them, norms last for Llama), and that module's other tensors.
    matmuls = [t for t in blocks[0].trainable_tensors if t.role != "norm"] if blocks else []
    if matmuls:
        last = ([t for t in matmuls if t.role in _MLP_ROLES] or matmuls)[-1]
        module = last.name.rsplit(".", 1)[0] + "."
        first = sum(size(t) for t in blocks[0].trainable_tensors if t.name.startswith(module))
    if facts.first_block_gradient is not None:  # a sparse MLP's (estimate/activations/moe.py)
        first = size(ParamTensor("first block gradient", facts.first_block_gradient, facts.first_block_gradient))
    return head, tied, first


def activation_phases(
    acts: ActivationBytes | None,
) -> tuple[int, int, int]:
    """(forward peak, backward-start peak, recompute peak) of activations; zeros without a model."""
    if acts is None:
        return 0, 0, 0
    return acts.forward_peak, acts.backward_start_peak, acts.recompute_block


Point = dict[str, int]  # bytes by category at one moment of a phase; a phase holds its largest


def point_total(point: Point) -> int:
    return sum(point.values())


def largest_point(*points: Point) -> Point:
    """The moment with the most bytes (the first one wins a tie)."""
    return max(points, key=point_total)


def phase(step: Step, name: Phase, **categories: int) -> PhaseBytes:
    """The bytes live at the peak of one phase; categories not given are zero."""
    return PhaseBytes(step, name, CategoryBytes(**categories))
