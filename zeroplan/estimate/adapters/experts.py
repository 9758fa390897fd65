"""LoRA on fused expert stacks and routers: the merged weight peft builds in every forward.

peft 0.21.2 adapts a parameter (`target_parameters`, what "all-linear" becomes on Mixtral, Qwen3-MoE and
DeepSeek-V3) with `ParamWrapper` (tuners/lora/layer.py). Its forward registers a parametrization on the
base parameter and runs the base module under `parametrize.cached()` (`_activate_lora`): the first read
of the parameter builds W' = W + s·BA once for the whole forward. For a stack of experts and one adapter
`_LoraFactorsProxy` folds it into one `baddbmm(W, lhs, rhs)` (no separate delta); for a router
(`num_experts == 1`) `_LoraParameterProxy` adds a full-size delta (`get_delta_weight`) to W, and the
delta dies with the proxy when the forward returns. W' requires grad (through A and B), so the experts'
matmuls save it (views of its storage) for their input's and W''s gradients: the whole stack, E x out x
in in the parameter's dtype, stays alive from the block's forward to its backward. The cache is dropped
when the forward returns; autograd's references keep it. docs/engines/lora.md "Adapted experts"."""

from __future__ import annotations

from collections.abc import Iterable


def merged_weight_elements(adapted: Iterable) -> int:
    """Elements of the merged weights one adapted block saves for backward: each adapted expert stack
    (E x out x in) and router (out x in) among `adapted` (estimate/adapters/lora.py `Linear`s), as
    `ParamWrapper` builds them (module docstring)."""
    return sum(linear.experts * linear.in_features * linear.out_features for linear in adapted
               if linear.role == "block" and linear.kind in ("experts", "router"))


def merged_weight_bytes(adapted: Iterable, element: int) -> int:
    """Bytes per adapted block: `merged_weight_elements` at `element`, the dtype the experts' matmuls read
    (the parameter's own without autocast: `_LoraFactorsProxy` disables autocast; under autocast the
    matmul saves its 16-bit cast of each expert's slice instead, the same count at 16 bits)."""
    return merged_weight_elements(adapted) * element
