"""A checkpointed block under sequence parallelism: what its recomputation and its backward hold on one TP rank.

torchtitan's plan makes the norms `SequenceParallel`, so a block's input is a DTensor sharded along the
sequence and the checkpoint keeps that shard (`_sequence_parallel_saving`). The recomputation in backward
runs the block's forward again on that same shard (torch/utils/checkpoint.py `recompute_fn`), so the norms
it rebuilds hold tokens / tp, as in the forward without checkpointing; only the colwise linears' input,
all-gathered by `PrepareModuleInput`, is whole. The block's output gradient arrives sharded too. The
measured tensors at the peak and the derivation: docs/engines/mesh.md, "Full checkpointing under
sequence parallelism".
"""

from __future__ import annotations

from zeroplan.estimate.activations.transformer import FP32_BYTES, ActivationBytes, runs_autocast, norm_saves_block_input, Widths
from zeroplan.spec.model import TransformerSpec
from zeroplan.spec.training import Checkpointing, TrainingSpec


def recomputed_norm_cut(model: TransformerSpec, training: TrainingSpec, tokens: int, act_bytes: int, norms_cut: int) -> int:
    """What sequence parallelism takes off one recomputed block: the two norms' saved tensors (`norms_cut`, the
    non-checkpointed cut of mesh.py `_sequence_parallel_saving`) but for the first norm's input when it is the kept
    block input itself, which the checkpoint already holds cut (activations.py `norm_saves_block_input`)."""
    tp, h = training.mesh.tp, model.hidden_size
    autocast = runs_autocast(training)
    widths = Widths(resid=FP32_BYTES if autocast else act_bytes, comp=act_bytes, autocast=autocast)
    shared = widths.resid * h if norm_saves_block_input(model, widths) else 0
    return norms_cut - tokens * shared * (tp - 1) // tp


def checkpointed_under_sequence_parallel(model: TransformerSpec, training: TrainingSpec, acts: ActivationBytes,
                                         tokens: int, act_bytes: int, norms_cut: int) -> dict[str, int]:
    """The ActivationBytes changes for a fully (or per-op) checkpointed block on a sequence-parallel TP rank;
    `norms_cut`: what SP takes off the two norms of a block that is not checkpointed."""
    if training.checkpointing not in (Checkpointing.FULL, Checkpointing.OP) or not acts.recompute_block:
        return {}
    tp = training.mesh.tp
    # the block's output gradient is Shard(1) (style.py SequenceParallel._prepare_output_fn keeps the DTensor):
    # the residual-width gradient of `_block_backward_transient_per_token` is cut as block_input_grad_bytes is
    output_grad_cut = acts.block_input_grad_bytes - acts.block_input_grad_bytes // tp
    # style.py SequenceParallel._prepare_input_fn: the norms run on Shard(1), in the recomputation as in forward
    return {"recompute_block": acts.recompute_block - recomputed_norm_cut(model, training, tokens, act_bytes, norms_cut),
            "block_backward_transient": acts.block_backward_transient - output_grad_cut}
