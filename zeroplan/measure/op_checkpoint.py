"""torchtitan's per-op selective activation checkpointing, reproduced from its source for
`--checkpointing op` (torchtitan 0.3.0 distributed/activation_checkpoint.py: `_get_default_save_ops`,
`SelectiveAC._wrap_block`).

Each block runs under `torch.utils.checkpoint.checkpoint(use_reentrant=False, early_stop=False)`
with a `create_selective_checkpoint_contexts` policy: the outputs of the ops in the save list are
kept, except every second mm (or linear), counted from zero at each block's forward; everything
else is recomputed in backward. torchtitan 0.3.0's force-recompute list names `moe.router.gate`,
a module name of its own MoE, which no Hugging Face model has: it is left out.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts


def save_ops() -> set:
    """`_get_default_save_ops`: torch's compute-intensive ops, torchtitan's additions, and the CPU
    flash kernel. SDPA on a CPU runs `_scaled_dot_product_flash_attention_for_cpu`, which stands
    here for the GPU kernels of the list (torchtitan's own CPU runs must add it too, through
    `SelectiveAC.get_save_ops`, or the attention output is recomputed)."""
    from torch._functorch.partitioners import get_default_op_list

    aten = torch.ops.aten
    ops = {op.default for op in get_default_op_list().compute_intensive_ops}
    ops |= {
        aten._scaled_dot_product_cudnn_attention.default,
        aten._scaled_dot_product_attention_math.default,
        aten._scaled_dot_product_fused_attention_overrideable.default,
        aten.max.default,
        torch._higher_order_ops.flex_attention,
        aten.linear.default,
        aten.topk.default,
        torch.ops._c10d_functional.reduce_scatter_tensor.default,
        torch.ops._c10d_functional.all_to_all_single.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
    }
    return ops


def _policy(saved: set):
    """`SelectiveAC._get_custom_policy`: a fresh forward and recompute mm counter per block call."""
    aten = torch.ops.aten
    mm_ops = (aten.mm.default, aten.linear.default)
    counts = {"forward": 0, "recompute": 0}

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if (func == aten._to_copy.default and "cuda" in str(args[0].device)
                and str(kwargs.get("device")) == "cpu"):
            return CheckpointPolicy.MUST_SAVE
        mode = "recompute" if ctx.is_recompute else "forward"
        if func in mm_ops:
            counts[mode] += 1
        if func in saved:
            if func in mm_ops and counts[mode] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def op_checkpointed(module: torch.nn.Module) -> None:
    """Run `module`'s forward under torchtitan's per-op policy (its `ptd_checkpoint_wrapper` call)."""
    forward = module.forward
    saved = save_ops()

    def checkpointed_forward(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, early_stop=False,
                          context_fn=lambda: create_selective_checkpoint_contexts(_policy(saved)), **kwargs)

    module.forward = checkpointed_forward
