"""bitsandbytes' optimizers (8-bit and 32-bit AdamW, paged or not) as an engine steps them: the states of
each tensor the optimizer is given, what a paged optimizer keeps outside PyTorch's allocator, and the
update's temporaries. Derivation: docs/engines/torch.md "bitsandbytes optimizers".

bitsandbytes 0.50.2:
- optim/optimizer.py `Optimizer2State.init_state`: per tensor, two uint8 states and two fp32 absmax
  vectors of one value per 256 elements, or (under `min_8bit_size` = 4096 elements, or at 32 bits)
  two fp32 states; `fill_qmap` gives each optimizer two 256-value fp32 code tables, moved to the
  device by its first 8-bit tensor (dtypes.py).
- `get_state_buffer`: a paged optimizer (`is_paged`) allocates the two states of a CUDA tensor of at
  least 1e5 elements with functional.py `get_paged` (cudaMallocManaged, unified memory registered with
  `GlobalPageManager`), prefetched to the GPU before its update (`prefetch_state` -> `cprefetch`):
  outside PyTorch's caching allocator, so `max_memory_allocated` never counts them; the driver keeps
  them on the GPU while it has room and pages them to host memory under pressure. On a CPU tensor it
  warns "Paged optimizers are not supported on CPU" and allocates ordinary states.
- the update: on CUDA one fused kernel per tensor, in place (csrc/kernels.cu kOptimizer32bit2State,
  kOptimizerStatic8bit2StateBlockwise): no temporaries. On CPU, backends/cpu/ops.py: the 8-bit update
  dequantizes both states to fp32, takes `grad = g.float() * gnorm_scale`, `p_fp32 = p.data.float()`
  (the parameter itself when fp32) and `denom = (state2_fp32.sqrt() / correction2).add_(eps)`, whose
  sqrt and quotient are alive together: five fp32 copies of the tensor, six for a 16-bit parameter;
  the 32-bit update (`_optimizer_update_32bit_cpu`) holds `g_float`, `p_float` (16-bit parameters)
  and `state2.sqrt() + eps` with the quotient `update`: three fp32 copies, four for a 16-bit parameter.
- transformers trainer.py `create_optimizer`: with an 8-bit bitsandbytes optimizer the Trainer registers
  every `nn.Embedding`'s weight for 32-bit states (`register_module_override(..., {"optim_bits": 32})`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from zeroplan.estimate.dtypes import FP32_BYTES, MIN_8BIT_SIZE, optimizer_state_bytes, paged_state_bytes, qmap_bytes
from zeroplan.estimate.terms import named, register
from zeroplan.spec.training import Optimizer

register({
    "optimizer states (bitsandbytes)": "bitsandbytes optim/optimizer.py Optimizer2State.init_state (state1, state2, "
                                       "absmax1, absmax2; fp32 under min_8bit_size)",
    "optimizer code tables (qmap)": "bitsandbytes optim/optimizer.py Optimizer8bit.fill_qmap (create_dynamic_map x 2)",
    "optimizer step temporaries (bitsandbytes on CPU)": "bitsandbytes backends/cpu/ops.py "
                                                        "_optimizer_update_8bit_blockwise_cpu, _optimizer_update_32bit_cpu",
    "paged optimizer states (unified memory)": "bitsandbytes functional.py get_paged (cudaMallocManaged) from "
                                               "optim/optimizer.py get_state_buffer (is_paged, numel >= 1e5)",
})


class StateTensor(NamedTuple):
    """One tensor as a bitsandbytes optimizer sees it."""

    numel: int
    param_bytes: int  # its element size (the update upcasts a 16-bit one)
    bits32: bool = False  # forced 32-bit states (the Trainer's override of an nn.Embedding's weight)


class BnbStates(NamedTuple):
    """The states of the tensors one rank steps: on the device (in the allocator) and in unified memory."""

    device: int
    paged: int
    step_temporaries: int  # the largest single update's temporaries (one tensor at a time)


def bnb_states(tensors: Iterable[StateTensor], optimizer: Optimizer, *, paged: bool, cuda: bool,
               instances: int = 1) -> BnbStates:
    """What `instances` optimizers over `tensors` hold (`instances` > 1: one optimizer per parameter,
    torchtune's optimizer in backward, each with its own code tables)."""
    tensors = list(tensors)
    total = paged_total = temporary = 0
    eight_bit = []
    for t in tensors:
        kind = Optimizer.ADAM_32BIT if t.bits32 else optimizer
        total += optimizer_state_bytes(t.numel, kind, FP32_BYTES)
        if paged and cuda:
            paged_total += paged_state_bytes(t.numel, kind)
        if kind == Optimizer.ADAM_8BIT and t.numel >= MIN_8BIT_SIZE:
            eight_bit.append(t.numel)
        if not cuda:
            temporary = max(temporary, cpu_step_temporary_bytes(t, kind))
    if cuda:  # moved to the GPU by an optimizer's first 8-bit tensor (init_state)
        tables = qmap_bytes(optimizer, eight_bit) * (len(eight_bit) if instances > 1 else 1)
    else:  # built on the host by every 8-bit optimizer's __init__ (fill_qmap), whatever its tensors
        tables = qmap_bytes(optimizer, [MIN_8BIT_SIZE]) * instances
    device = named("optimizer states (bitsandbytes)", total - paged_total) + named("optimizer code tables (qmap)", tables)
    return BnbStates(device, named("paged optimizer states (unified memory)", paged_total),
                     named("optimizer step temporaries (bitsandbytes on CPU)", temporary))


def cpu_step_temporary_bytes(tensor: StateTensor, optimizer: Optimizer) -> int:
    """The fp32 copies bitsandbytes' CPU update of one tensor holds at its largest (module docstring)."""
    upcast = 1 if tensor.param_bytes != FP32_BYTES else 0  # p.data.float() copies a 16-bit parameter
    if optimizer == Optimizer.ADAM_8BIT and tensor.numel >= MIN_8BIT_SIZE:
        copies = 5 + upcast  # state1_fp32, state2_fp32, grad, sqrt, quotient
    else:
        copies = 3 + upcast  # g_float, sqrt + eps, update
    return copies * FP32_BYTES * tensor.numel


def trainer_keeps_32bit(role: str, name: str) -> bool:
    """The Trainer's override: an nn.Embedding's weight (the token embedding, learned positions, their
    modules_to_save copies) steps with 32-bit states; a LoRA embedding adapter is a plain parameter."""
    return role in ("embedding", "positions") and name.endswith("weight") and "lora_" not in name


def paged_notes(engine: str, device: str, client_optimizer: bool, node_gpus: int, unified_bytes: int) -> tuple[str, ...]:
    """What the estimate says of a paged optimizer: where its states are, or why nothing pages and what is
    counted instead (one line each)."""
    if device == "cpu":
        return ("paged_optimizer on device cpu: bitsandbytes cannot page there (\"Paged optimizers are not supported on "
                "CPU\") and allocates ordinary states: counted as such",)
    if engine == "deepspeed":
        if not client_optimizer:
            return ("paged_optimizer: DeepSpeed steps the optimizer of its JSON, which cannot page: its states are "
                    "counted on the GPU; give a JSON without an optimizer section for the Trainer's paged optimizer",)
        return ("paged_optimizer with deepspeed: the client optimizer's flat fp32 partitions would be paged; not "
                "modelled: their states are counted on the GPU",)
    if not unified_bytes:
        return ("paged_optimizer: no tensor has 100,000 elements or more, so nothing is paged (get_state_buffer)",)
    per_gpu = unified_bytes // node_gpus
    return (f"paged optimizer states: {per_gpu:,} bytes per GPU in CUDA unified memory (bitsandbytes get_paged), "
            "outside PyTorch's allocator and not in the peak; they stay on the GPU while it has room (the device then "
            "holds the peak plus them) and are paged to host memory under pressure; each tensor's states are "
            "prefetched to the GPU for its update",)
