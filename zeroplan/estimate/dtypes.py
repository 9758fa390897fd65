"""Bytes per element of each model state, by precision and optimizer.

Source: ZeRO paper (Rajbhandari et al. 2020), section 3.1: mixed-precision Adam keeps 2Ψ bytes of
fp16 parameters, 2Ψ of fp16 gradients and KΨ = 12Ψ of optimizer states (fp32 master parameters,
momentum and variance, 4 bytes each). Pure bf16 drops the master copy and keeps the states in bf16.
bitsandbytes 0.50.2 (bitsandbytes/optim/optimizer.py `Optimizer2State.init_state`), per tensor as the
optimizer sees it: 8-bit keeps each state as uint8 plus one fp32 `absmax` per block of 256 elements
(`blocksize = 256`), and a tensor under `min_8bit_size` = 4096 elements two fp32 states; 32-bit
(`optim_bits=32`, paged_adamw_32bit) two fp32 states whatever the parameter's dtype
(`get_state_buffer(p, dtype=torch.float32)`). Each optimizer also builds two 256-value fp32 code
tables, `qmap1`/`qmap2` (`fill_qmap`), shared by its 8-bit tensors. Paged (`is_paged`): the state
buffers of a tensor of at least 1e5 elements come from `F.get_paged` (cudaMallocManaged), outside
PyTorch's allocator; absmax and qmaps stay ordinary tensors (docs/engines/torch.md "bitsandbytes").
"""

from __future__ import annotations

from typing import NamedTuple

from zeroplan.estimate.caches import memo
from zeroplan.spec.training import Optimizer, Precision

FP32_BYTES = 4
HALF_BYTES = 2  # fp16 and bf16
FLOAT8_BYTES = 1  # float8_e4m3fn / float8_e5m2 (torchao float8 training)
ADAM_8BIT_BLOCK = 256  # optim/optimizer.py Optimizer2State.init_state: `blocksize = 256` (one fp32 absmax per block)
MIN_8BIT_SIZE = 4096  # Optimizer2State(min_8bit_size=4096): smaller tensors keep fp32 states
PAGED_MIN_NUMEL = 100_000  # Optimizer8bit.get_state_buffer: `p.numel() < 1e5` stays an ordinary tensor
QMAP_BYTES = 2 * 256 * FP32_BYTES  # Optimizer8bit.fill_qmap: create_dynamic_map(signed) and (unsigned), 256 fp32 each


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
    """Bytes of the optimizer states of one tensor of `numel` elements as the optimizer steps it (for a
    torch optimizer, states `element_bytes` wide, any split of the elements gives the same sum).

    bitsandbytes (Optimizer2State.init_state): 8-bit, two uint8 states and one fp32 absmax per block of
    256 for each, or two fp32 states under min_8bit_size; 32-bit, two fp32 states.
    """
    if optimizer == Optimizer.ADAM_8BIT and numel >= MIN_8BIT_SIZE:
        return 2 * (numel + FP32_BYTES * -(-numel // ADAM_8BIT_BLOCK))
    if optimizer.is_bitsandbytes:
        return 2 * FP32_BYTES * numel
    return optimizer_state_count(optimizer) * numel * element_bytes


def paged_state_bytes(numel: int, optimizer: Optimizer) -> int:
    """Of one tensor's states (`optimizer_state_bytes`), the bytes a paged bitsandbytes optimizer allocates
    in CUDA unified memory: state1 and state2 of a tensor of at least 1e5 elements (get_state_buffer ->
    functional.py `get_paged`); its absmax stay ordinary device tensors."""
    if not optimizer.is_bitsandbytes or numel < PAGED_MIN_NUMEL:
        return 0
    return 2 * numel * (1 if optimizer == Optimizer.ADAM_8BIT and numel >= MIN_8BIT_SIZE else FP32_BYTES)


def qmap_bytes(optimizer: Optimizer, numels) -> int:
    """The code tables one bitsandbytes optimizer over tensors of `numels` elements keeps on their device:
    qmap1 and qmap2, moved there by the first 8-bit tensor's init_state (`fill_qmap`; 32-bit has none)."""
    if optimizer == Optimizer.ADAM_8BIT and any(numel >= MIN_8BIT_SIZE for numel in numels):
        return QMAP_BYTES
    return 0


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
    elif optimizer == Optimizer.ADAM_32BIT:
        states = 2 * FP32_BYTES
    else:
        states = optimizer_state_count(optimizer) * state_element
    return StateBytes(param=param, grad=grad, master=master, optimizer_states=states, activation=activation)
