"""What an int8 base keeps outside autograd's saved tensors (issue 12, docs/engines/lora.md "int8 layers
keep their input").

bitsandbytes 0.50.2 autograd/_functions.py: in training, `matmul` runs `MatMul8bitFp` on CPU/XPU, whose
forward stores its input as `ctx.A = A`; `MatMul8bitLt` (CUDA) stores `ctx.tensors = (CAt, subA, A)`
whenever the input or weight needs a gradient. Neither goes through `save_for_backward`, so the
saved-tensor hooks of torch.utils.checkpoint never see them: each int8 layer's input stays alive until
that layer's backward, in a checkpointed block too, where the recomputation makes a second copy for the
graph it rebuilds (freed when the rebuild stops).
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

from zeroplan.spec.lora import QuantSpec
from zeroplan.spec.model import TransformerSpec

_OUTPUT_PROJECTIONS = ("o_proj", "c_proj", "down_proj", "fc_out", "dense", "out_proj")


class Int8Inputs(NamedTuple):
    """Per token of one block, bytes of its int8 linears' inputs (`ctx.A`), in the model's dtype."""

    attention_in: int  # the attention norm's output, shared by q/k/v (c_attn)
    core_out: int  # o_proj's (attn.c_proj's) input: the attention core's output
    mlp_in: int  # the MLP norm's output, shared by gate/up (c_fc)
    product: int  # down_proj's (mlp.c_proj's) input

    @property
    def kept(self) -> int:
        """What the forward graph keeps per block beyond its saved tensors."""
        return sum(self)


def int8_inputs(spec: TransformerSpec, linears, quant: QuantSpec | None, element: int) -> Int8Inputs:
    """`Int8Inputs` of a block whose every linear is int8 (transformers' `replace_with_bnb_linear`); zeros otherwise."""
    if quant is None or quant.base_precision.value != "int8" or spec.is_moe or spec.moe is not None:
        return Int8Inputs(0, 0, 0, 0)
    block = [linear for linear in linears if linear.role == "block" and linear.kind == "linear"]

    def width(side: str, output: bool) -> int:
        found = [linear.in_features for linear in block if linear.module.startswith(f"{side}.")
                 and linear.module.endswith(_OUTPUT_PROJECTIONS) == output]
        return element * (sum(found) if output else (spec.hidden_size if found else 0))

    return Int8Inputs(width("attn", False), width("attn", True), width("mlp", False), width("mlp", True))


def with_int8_inputs(acts, kept: int):
    """`acts` with `kept` bytes per block held from its forward to its backward, outside the tensors
    checkpointing drops (the block input alone under full checkpointing)."""
    if not kept or acts is None:
        return acts

    return acts.with_each_kind(lambda a: replace(a, saved_per_block=a.saved_per_block + kept))
