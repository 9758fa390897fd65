"""The recomputation's own moment in an adapted block's backward (issue 12, docs/engines/lora.md
"Checkpointing: the recomputation's moment").

Under full checkpointing a block's backward starts by recomputing its forward, and the forward's
temporaries are alive again while it runs. Without adapters that moment is smaller than the MLP's
backward (activations.py `_block_backward_transient_per_token`); with adapters, PEFT's LoRA path holds
more of them: the input cast to the adapters' dtype (peft tuners_utils.py `_cast_input_dtype`), the
base layer's output, and B's output with its scaled copy. Kept apart from estimate/adapters/lora.py, which
counts what the blocks save; this module counts what is alive beside it while they are rebuilt.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

from zeroplan.spec.lora import LoraSpec, QuantSpec
from zeroplan.spec.model import TransformerSpec


class RecomputeDtypes(NamedTuple):
    """Element sizes of the tensors alive in an adapted layer's forward."""

    resid: int  # the residual stream and the norms' outputs: the dtype the model is built in
    act: int  # a base linear's output (autocast's dtype, else the model's)
    adapter: int  # the adapters' parameters (fp32 under the torch engine: get_peft_model autocast_adapter_dtype)
    lora_out: int  # lora_A's and lora_B's outputs: autocast's dtype, else the adapters'
    cast_copy: bool  # peft copies the layer's input to the adapters' dtype before lora_A
    autocast: bool


def recompute_dtypes(quant: QuantSpec | None, autocast: bool, comp: int, adapter: int, cuda: bool,
                     resid: int) -> RecomputeDtypes:
    """`RecomputeDtypes` of a run whose model is built in `resid` bytes (estimate/adapters/lora.py `model_element_bytes`):
    autocast's ops return `comp`; without it, a layer returns its model's dtype."""
    act = comp if autocast else resid
    kbit = quant is not None and quant.base_precision.is_quantized
    if kbit and quant.base_precision.is_4bit:  # Linear4bit returns its input's dtype, the model's (lora.py kbit_output_element)
        act = resid
    # peft lora/layer.py Linear.forward casts x to lora_A's dtype always; lora/bnb.py only when
    # `not torch.is_autocast_enabled()`, whose device-less form reads CUDA's autocast (False on CPU)
    casts = not (kbit and autocast and cuda)
    return RecomputeDtypes(resid, act, adapter, comp if autocast else adapter, casts, autocast)


def _adapted(layout, suffixes: tuple[str, ...]):
    return next((linear for linear in layout.adapted if linear.role == "block" and linear.module.endswith(suffixes)), None)


def recompute_moment_bytes(spec: TransformerSpec, lora: LoraSpec, layout, d: RecomputeDtypes, tokens: int,
                           rebuilt_int8: int = 0, linears_save_inputs: bool = False) -> int:
    """Bytes beyond the recomputed block's saved tensors (`ActivationBytes.recompute_block`) at the most
    of the recomputation of an adapted MLP, in the block that the backward is in (docs/engines/lora.md).

    The backward reaches the recomputation at the MLP's last adapted linear's lora_B (MmBackward0 unpacks
    its saved tensors first), holding the block output's gradient, its cast to the MLP output's dtype
    (AddBackward0, when they differ) and the gradient of lora_B's scaled output (MulBackward0).
    The forward being rebuilt holds the residual and the MLP's input (LlamaDecoderLayer, GPT2Block), and:
    - at the last linear (down_proj, c_proj), up to its lora_B saving its inputs, where the rebuild stops
      (torch/utils/checkpoint.py early stop, `_StopRecomputationError`): the MLP's product unless lora_A
      saves it itself, the base output, and the input's copy in the adapters' dtype when autocast then
      copies it again for the matmul (that copy is what lora_A saves);
    - in a gated MLP, at up_proj's `lora_B(...) * scaling`: gate's output and SiLU's (saved), the base
      output, B's output and its scaled copy, before up's output, the product and down_proj's saved
      tensors exist.
    An int8 base's rebuilt graph also holds its layers' inputs (`rebuilt_int8` per token beyond the MLP's
    input and product: estimate/adapters/int8.py) until the rebuild stops. Under ZeRO-3 the frozen linears
    save the MLP's input and product themselves (`linears_save_inputs`, estimate/adapters/zero3.py): they are
    among the rebuilt saved tensors, and the product exists only after up's mul."""
    if spec.is_moe or spec.moe is not None:
        return 0  # experts follow moe.py
    h, inner, r = spec.hidden_size, spec.intermediate_size, lora.rank
    down = _adapted(layout, ("mlp.down_proj", "mlp.c_proj", "mlp.fc_out"))
    up = _adapted(layout, ("mlp.up_proj",)) if spec.mlp == "gated" else None
    mlp_in = _adapted(layout, ("mlp.gate_proj", "mlp.up_proj", "mlp.c_fc", "mlp.fc_in"))
    lora_copy = d.autocast or lora.dropout > 0 or d.adapter != d.act  # lora.py adapter_activations `own_copy`
    copy_element = d.act if d.autocast else d.adapter
    grads = d.resid * h + (d.act * h if d.act != d.resid else 0) + d.lora_out * h
    # the residual; the MLP's input unless lora_A saves that very tensor; GPT2Block's `attn_output`, a
    # local until the block returns (LlamaDecoderLayer rebinds its own)
    mlp_input = 0 if (mlp_in is not None and not lora_copy) or linears_save_inputs else d.resid * h
    attention_output = d.act * h if spec.hf_model_type == "gpt2" else 0
    held = grads + d.resid * h + mlp_input + attention_output + rebuilt_int8
    if lora.dora:
        return _dora_moment(down, lora, d, tokens, held, copy_element) if down is not None else 0
    moments = [0]
    if down is not None:
        # else lora_A (or, under ZeRO-3, down_proj's base) saves it: among the rebuilt saved tensors
        product = d.act * inner if lora_copy and not linears_save_inputs else 0
        transient_copy = d.adapter * inner if d.cast_copy and d.autocast and d.adapter != d.act else 0
        moments.append(tokens * (held + product + d.act * h + transient_copy))
    if up is not None:
        # what exists only after up's mul: up's output, and down's saved input and A's output
        later = d.act * inner + (copy_element * inner + copy_element * r if down is not None and lora_copy else 0)
        later += d.act * inner if down is not None and (not lora_copy or linears_save_inputs) else 0
        weight_casts = d.act * r * (inner + h) if down is not None and d.autocast else 0
        up_copy = d.adapter * h if d.cast_copy and d.autocast and d.adapter != d.resid else 0
        moments.append(tokens * (held + d.act * inner + 2 * d.lora_out * inner + up_copy - later) - weight_casts)
    return max(moments)


def _dora_moment(last, lora: LoraSpec, d: RecomputeDtypes, tokens: int, held: int, copy_element: int) -> int:
    """DoRA (peft tuners/lora/dora.py `DoraLinearLayer.forward`) computes the weight norm before lora_A runs:
    at the MLP's last linear the rebuild holds, besides `held`, its base output and the weight norm's
    temporaries (estimate/adapters/lora.py `adapter_activations`: identity, A on it, the LoRA weight, its scaled copy
    and the sum), while what the layer saves afterwards (autocast's or dropout's copy of the input, A's and
    B's outputs, `base_result - bias`) does not exist yet."""
    n, out, r = last.in_features, last.out_features, lora.rank
    weight_norm = d.adapter * (n * n + n * r + 3 * n * out)
    not_yet = (copy_element * n if d.autocast or lora.dropout > 0 else 0) + copy_element * r + 2 * copy_element * out
    return tokens * (held + d.act * out - not_yet) + weight_norm


def with_recompute_moment(acts, moment: int):
    """`acts` with the recomputation's moment among a checkpointed block's backward moments: the block
    holds `recompute_block` plus `moment` there, against the MLP's backward (`recompute_block -
    block_backward_freed + block_backward_transient`)."""
    if not moment or acts is None:
        return acts

    def adjusted(a):
        if not a.recompute_block:
            return a
        return replace(a, block_backward_transient=max(a.block_backward_transient, moment + a.block_backward_freed))

    return acts.with_each_kind(adjusted)
