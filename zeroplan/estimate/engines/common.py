"""Pieces every engine profile shares: the optimizer step's temporaries, sharding arithmetic,
and the per-phase record."""

from __future__ import annotations

from dataclasses import dataclass

from zeroplan.estimate.activations import ActivationBytes
from zeroplan.estimate.result import CategoryBytes, NodeBytes, Phase, PhaseBytes, Step
from zeroplan.spec.training import Device, Optimizer, TrainingSpec


@dataclass(frozen=True)
class EngineEstimate:
    phases: tuple[PhaseBytes, ...]
    per_node: NodeBytes
    notes: tuple[str, ...] = ()


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def step_temporary_bytes(largest_numel: int, total_numel: int, state_element_bytes: int, training: TrainingSpec) -> int:
    """Peak temporaries of one torch optimizer step over a rank's local tensors.

    torch/optim/adam.py `_single_tensor_adam` (the CPU default: `_default_to_fused_or_foreach`
    picks foreach only for CUDA tensors) computes
    `denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)`: two tensors of the largest
    parameter's size are alive at once. `_multi_tensor_adam` (the CUDA default) computes
    `exp_avg_sq_sqrt = torch._foreach_sqrt(device_exp_avg_sqs)` for the whole group: one
    temporary the size of all local parameters. SGD with momentum updates in place.
    """
    if training.optimizer == Optimizer.SGD:
        return 0
    if training.device == Device.CPU:
        return 2 * largest_numel * state_element_bytes
    return total_numel * state_element_bytes


def activation_phases(
    acts: ActivationBytes | None,
) -> tuple[int, int, int]:
    """(forward peak, backward-start peak, recompute peak) of activations; zeros without a model."""
    if acts is None:
        return 0, 0, 0
    return acts.forward_peak, acts.backward_start_peak, acts.recompute_block


def phase(step: Step, name: Phase, **categories: int) -> PhaseBytes:
    """The bytes live at the peak of one phase; categories not given are zero."""
    return PhaseBytes(step, name, CategoryBytes(**categories))
