"""Where a bitsandbytes base (int8, nf4, fp4) can be measured, checked before any worker starts (no torch
here); the worker checks the model it built against the same messages (programs/peft_model.py).

bitsandbytes quantizes a weight when it is given real data: `Linear4bit`/`Linear8bitLt` pack
their weight as it is moved (bitsandbytes/nn/modules.py, `Params4bit.to` -> `_quantize`, `Int8Params.to`),
and a move to the meta device keeps it unquantized. So the weights must exist when the model is
quantized: built on the host or the device (FSDP-QLoRA loads them on the host, then shards the packed
bf16 storage), not on the meta device (zeroplan's loop's default for fsdp2), not as deepspeed.zero.Init's
empty partitions (its default under ZeRO-3), and not as fake tensors (--simulate). On CPU these run:
nf4 with uint8 or bf16 storage under fsdp2 with --model-init host or device (docs/measure.md, "LoRA and QLoRA").
"""

from __future__ import annotations

from zeroplan.errors import MeasureError
from zeroplan.spec.program import ModelInit
from zeroplan.spec.training import TrainingSpec

META_DEVICE = ("training.quant: bitsandbytes quantizes weights where they are, and a model built on the meta device "
               "(model init meta{default}) has none to quantize; measure with --model-init host (as FSDP-QLoRA loads "
               "it) or device")
ZERO_INIT = ("training.quant: bitsandbytes cannot quantize weights partitioned by deepspeed.zero.Init (model init "
             "zero-init{default}: each weight is an empty placeholder); measure with --model-init host or device")
SIMULATED = ("training.quant: a bitsandbytes base cannot be simulated (its packed weights are not fake tensors); "
             "measure it on gloo ranks")


def refuse_unmeasurable_quant(training: TrainingSpec, simulate: bool) -> None:
    """Raise MeasureError where a run's quantized base could not be built (module docstring)."""
    quant = training.quant
    if quant is None or not quant.base_precision.is_quantized:
        return
    if simulate:
        raise MeasureError(SIMULATED)
    init = training.program.model_init
    default = f", the {training.recipe.value} recipe's default for {training.engine.value}" if training.model_init is None else ""
    if init == ModelInit.META:
        raise MeasureError(META_DEVICE.format(default=default))
    if init == ModelInit.ZERO_INIT:
        raise MeasureError(ZERO_INIT.format(default=default))
