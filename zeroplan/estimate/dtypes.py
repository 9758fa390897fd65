"""Bytes per element of each model state, by precision and optimizer.

Source: ZeRO paper (Rajbhandari et al. 2020), section 3.1: mixed-precision Adam keeps 2Ψ bytes of
fp16 parameters, 2Ψ of fp16 gradients and KΨ = 12Ψ of optimizer states (fp32 master parameters,
momentum and variance, 4 bytes each). Pure bf16 drops the master copy and keeps the states in bf16.
8-bit Adam: bitsandbytes `Optimizer2State.init_state` (bitsandbytes/optim/optimizer.py) keeps
each state as uint8 plus one fp32 `absmax` per block of 2048 elements (block_wise, the default);
tensors under `min_8bit_size` = 4096 elements keep fp32 states. zeroplan applies the 8-bit rate to
every element: the small tensors (norm weights, biases) are under 0.1% of any catalogue model.
"""

from __future__ import annotations

from typing import NamedTuple

from zeroplan.estimate.caches import memo
from zeroplan.spec.training import Optimizer, Precision

FP32_BYTES = 4
HALF_BYTES = 2  # fp16 and bf16
FLOAT8_BYTES = 1  # float8_e4m3fn / float8_e5m2 (torchao float8 training)
ADAM_8BIT_BLOCK = 2048  # bitsandbytes blockwise quantisation block (one fp32 absmax per block)


class StateBytes(NamedTuple):
    """Bytes per parameter element of each model state."""

    param: int  # the working copy the forward pass reads
    grad: int  # the gradient the backward pass writes (model precision)
    master: int  # fp32 master copy kept by the optimizer (0 when none)
    optimizer_states: float  # all optimizer states together (8-bit Adam has a fractional part)
    activation: int  # element size of activations (the compute dtype)

    @property
    def k(self) -> float:
        """The ZeRO paper's K: optimizer-held bytes per parameter (master + states)."""
        return self.master + self.optimizer_states


def optimizer_state_count(optimizer: Optimizer) -> int:
    """States kept per parameter: Adam/AdamW two moments, SGD one momentum buffer."""
    return 1 if optimizer == Optimizer.SGD else 2


def optimizer_state_bytes(numel: int, optimizer: Optimizer, element_bytes: int) -> int:
    """Bytes of the optimizer states for `numel` parameters whose states are `element_bytes` wide.

    8-bit Adam: two uint8 states plus one fp32 absmax per block of 2048 for each
    (bitsandbytes Optimizer2State.init_state, block_wise).
    """
    if optimizer == Optimizer.ADAM_8BIT:
        return 2 * (numel + FP32_BYTES * -(-numel // ADAM_8BIT_BLOCK))
    return optimizer_state_count(optimizer) * numel * element_bytes


@memo(maxsize=64)  # a mesh plan asks for it a few times per rank estimate; an immutable tuple of its two arguments
def state_bytes(precision: Precision, optimizer: Optimizer) -> StateBytes:
    """Bytes per parameter for `precision` trained with `optimizer`."""
    if precision == Precision.FP32:
        param = grad = activation = FP32_BYTES
        master = 0
        state_element = FP32_BYTES
    elif precision == Precision.PURE_BF16:
        param = grad = activation = HALF_BYTES
        master = 0
        state_element = HALF_BYTES
    else:  # fp16 / bf16 mixed precision: 16-bit working copy, fp32 master and states
        param = grad = activation = HALF_BYTES
        master = FP32_BYTES
        state_element = FP32_BYTES
    if optimizer == Optimizer.ADAM_8BIT:
        states = 2 * (1 + FP32_BYTES / ADAM_8BIT_BLOCK)
    else:
        states = optimizer_state_count(optimizer) * state_element
    return StateBytes(param=param, grad=grad, master=master, optimizer_states=states, activation=activation)
