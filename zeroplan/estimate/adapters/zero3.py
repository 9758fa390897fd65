"""What a frozen linear keeps under DeepSpeed ZeRO-3 (issue 12, docs/engines/lora.md "Frozen linears
under ZeRO-3 keep their input").

`deepspeed.zero.Init` replaces `torch.nn.functional.linear` with `zero3_linear_wrap` and leaves it so
(DeepSpeed 0.19.8 runtime/zero/partition_parameters.py `_enable_mem_efficient_linear`: "This will
persist unless manually reset"; `memory_efficient_linear` defaults to True, runtime/zero/config.py).
ZeRO-3 runs it for a model built outside zero.Init too: the engine converts the parameters with
`Init(module=module)` (runtime/zero/parameter_offload.py `_convert_to_zero_parameters`), whose
`__init__` enables it when `module` is given.
Its `LinearFunctionForZeroStage3.setup_context` calls `ctx.save_for_backward(input, weight, bias)`
whatever needs a gradient (runtime/zero/linear.py), where autograd's own linear keeps the input only
for the weight's gradient. So under ZeRO-3 every `nn.Linear` keeps its input once
any of its inputs needs a gradient, frozen or not: the tensors `adapter_activations` (estimate/adapters/lora.py)
takes out for a frozen base are kept again. Conv1D (GPT-2's blocks: `torch.addmm`) and bitsandbytes'
layers (`matmul_4bit`) do not call `F.linear` and keep nothing more; the head is an `nn.Linear`.
The saved tensors go through `save_for_backward`, so checkpointing drops and recomputes them.
"""

from __future__ import annotations

from typing import NamedTuple

from zeroplan.spec.model import TransformerSpec

_OUTPUT_PROJECTIONS = ("o_proj", "c_proj", "down_proj", "fc_out")


class KeptInputs(NamedTuple):
    """Per token, bytes the frozen linears keep under ZeRO-3 beyond what estimate/adapters/lora.py counts."""

    block: int  # per adapted block: the norms' outputs read by frozen q/k/v and gate/up, down_proj's input
    first_block: int  # negative: the first block's attention input, when nothing before it needs a gradient
    head: int  # the frozen head's input (the final norm's output)


NOTHING = KeptInputs(0, 0, 0)


def linear_keeps_input(training) -> bool:
    """Whether `F.linear` is DeepSpeed's: under ZeRO-3, however the model was built (module docstring)."""
    return training.engine.value == "deepspeed" and training.zero_stage == 3


def block_linears_keep_inputs(spec: TransformerSpec, quant, training, autocast: bool) -> bool:
    """Whether a dense block's frozen linears keep their inputs: nn.Linear layers (not GPT-2's Conv1D, not
    a quantized base's bitsandbytes layers) under DeepSpeed's `F.linear` (module docstring)."""
    return (linear_keeps_input(training) and not autocast and not spec.is_moe and spec.moe is None
            and spec.hf_model_type != "gpt2" and (quant is None or not quant.base_precision.is_quantized))


def kept_inputs(spec: TransformerSpec, lora, quant, training, comp: int, adapter_element: int, autocast: bool,
                first_input_needs_grad: bool, head_input_removed: bool, block_linears, adapted) -> KeptInputs:
    """`KeptInputs` of a dense model's blocks (`block_linears`: estimate/adapters/lora.py `_linears`, role "block";
    `adapted`: the adapted ones). Where an adapter's A keeps the same tensor itself (no cast, dropout or
    autocast copy: `own_copy` in `adapter_activations`) the input was never taken out.
    `first_input_needs_grad` and `head_input_removed` are `outside_blocks`' conditions."""
    if not linear_keeps_input(training) or autocast:
        return NOTHING
    blocks_call_linear = block_linears_keep_inputs(spec, quant, training, autocast)
    own_copy = lora.dropout > 0 or adapter_element != comp
    h, inner = spec.hidden_size, spec.intermediate_size
    adapted_modules = {linear.module for linear in adapted}
    block = 0
    attention_input = 0
    if blocks_call_linear:
        for side in ("attn", "mlp"):
            readers = [linear for linear in block_linears if linear.module.startswith(f"{side}.")
                       and linear.in_features == h and not linear.module.endswith(_OUTPUT_PROJECTIONS)]
            a_keeps_it = any(linear.module in adapted_modules for linear in readers) and not own_copy
            if readers and not a_keeps_it:
                block += comp * h  # one tensor, the norm's output, whichever linears read it
                if side == "attn":
                    attention_input = comp * h
        down = [linear for linear in block_linears if linear.module.endswith(("mlp.down_proj", "mlp.fc_out"))]
        if down and not (down[0].module in adapted_modules and not own_copy):
            block += comp * inner  # the MLP's product
    # an autograd Function none of whose inputs needs a gradient saves nothing (torch/autograd/function.py)
    first = 0 if first_input_needs_grad else -attention_input
    return KeptInputs(block, first, comp * h if head_input_removed else 0)


def recompute_trainable_element(training) -> int:
    """Under ZeRO-3 with checkpointing and a frozen base, the element size of a rebuilt block's trainable
    tensors (0 otherwise). `fetch_sub_module` (runtime/zero/partitioned_param_coordinator.py) attributes
    each frozen parameter a checkpoint recomputation gathers to the active backward module
    (`update_recompute_parameters`), which frees them only at its backward's end
    (`release_sub_module(forward=False)`); the trainable ones wait for their own backward hook
    ("trainable ones release via their backward hook"). So the whole rebuilt block stays gathered."""
    from zeroplan.estimate.adapters.trainer import FP32_BYTES, HALF_BYTES, adapters_stay_fp32

    if training.lora is None or not linear_keeps_input(training) or training.checkpointing.value != "full":
        return 0
    if adapters_stay_fp32(training) or training.precision.value == "fp32":
        return FP32_BYTES
    return HALF_BYTES


def recomputed_block_gathered(cold, gathered_backward, trainable_backward, n: int, b: int, threshold: int,
                              trainable_element: int):
    """The first step's (no trace) gathered bytes per backward module group, `cold` (estimate/engines/
    deepspeed.py `_stage3_walk`: the largest tensor alone), with each block's tensors all gathered at once
    (`recompute_trainable_element`): the frozen ones above the persistence threshold, in `b` bytes, and
    every trainable one."""
    def padded(x: int) -> int:
        return -(-x // n) * n

    last = len(gathered_backward) - 1
    entries = []
    for index, gathered in cold:
        if 0 < index < last:
            frozen = list(gathered_backward[index])
            for x in trainable_backward[index]:
                frozen.remove(x)
            held = b * sum(padded(x) for x in frozen if x > threshold)
            # the trainable ones under the threshold too: the first step releases them after each use
            # (`release_sub_module`), but in a rebuild they wait for their backward hook
            held += trainable_element * sum(padded(x) for x in trainable_backward[index])
            gathered = max(gathered, held)
        entries.append((index, gathered))
    return entries
