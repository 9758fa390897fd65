"""What the Hugging Face Trainer does with a PEFT model that zeroplan's own loop does not
(recipe hf-trainer with `training.lora`; docs/engines/lora.md "The Trainer with adapters").

One difference changes bytes: under DeepSpeed ZeRO-3 the adapters stay fp32. The Trainer's
ZeRO-3 path builds the base inside `deepspeed.zero.Init` (transformers modeling_utils.py
`_from_config` / `from_pretrained` with `is_deepspeed_zero3_enabled`), in the 16-bit dtype and
partitioned; `get_peft_model` then adds the adapters outside it, in fp32 (peft's
`autocast_adapter_dtype`). DeepSpeed 0.19.8 casts no parameter of a model zero.Init built
(runtime/engine.py `_cast_module_mixed_precision`: "ZeRO-Init params are already at the
configured dtype"), so the adapters keep 4 bytes an element on every rank that holds them, and
with no autocast under DeepSpeed each adapted layer casts its 16-bit input to fp32
(peft tuners/lora/layer.py `Linear.forward` `_cast_input_dtype`) and computes its adapter in fp32.
zeroplan's loop adds the adapters inside zero.Init (measure/worker.py `model_context`), where
they are made 16-bit like the base.

The rest the Trainer does alike, from the source (transformers 5.23.0, accelerate 1.15.0):
the optimizer gets only the parameters that require grad (trainer.py `create_optimizer`:
`p.requires_grad` in both param groups); checkpointing is non-reentrant and adds PEFT's
input-gradient hook (modeling_utils.py `_activation_checkpointing_enable`: `use_reentrant`
False, `enable_input_require_grads` for `main_input_name == "input_ids"`); accelerate's FSDP2
upcasts only trainable 16-bit parameters to fp32 (utils/fsdp_utils.py `fsdp2_prepare_model`),
and the adapters already are.
"""

from __future__ import annotations

from zeroplan.estimate.dtypes import FP32_BYTES, HALF_BYTES  # HALF_BYTES: DeepSpeed's 16-bit parameters (engines/rules.py)
from zeroplan.estimate.terms import named, register

register({"adapters kept fp32 (bytes beyond 16-bit)": "peft get_peft_model autocast_adapter_dtype; deepspeed "
                                                     "runtime/engine.py _cast_module_mixed_precision (estimate/adapters/trainer.py)"})


def adapters_stay_fp32(training) -> bool:
    """Whether the adapters keep fp32 where the engine's other parameters are 16-bit (module docstring)."""
    from zeroplan.spec.program import ModelInit, Recipe

    return (training.lora is not None and training.recipe == Recipe.HF_TRAINER
            and training.engine.value == "deepspeed" and training.zero_stage == 3
            and training.program.model_init == ModelInit.ZERO_INIT
            and training.precision.value in ("bf16", "fp16"))


def adapter_params_delta(held_16bit_bytes: int, training) -> int:
    """Bytes per rank the fp32 adapters take beyond the engine profile's 16-bit count of the same
    tensors, held as DeepSpeed holds them (`held_16bit_bytes`: estimate/adapters/lora.py `adapter_param_bytes`)."""
    if not adapters_stay_fp32(training):
        return 0
    return named("adapters kept fp32 (bytes beyond 16-bit)", held_16bit_bytes * (FP32_BYTES - HALF_BYTES) // HALF_BYTES)
