"""Expert parallelism on one rank (issue 14): what estimate/parallel/mesh.py asks of the experts when ep > 1.
Derivations: docs/engines/mesh.md, "Expert parallelism".

- Parameters: each rank holds num_experts / ep experts (torchtitan distributed/expert_parallel.py
  `ExpertParallel._partition_fn`: Shard(0) over the ep mesh). FSDP2 shards them over the efsdp
  ranks, dp_shard * cp * tp / ep (parallel_dims.py `build_mesh`), as a unit of their own
  (models/llama4/infra/parallelize.py `apply_fsdp`: `fully_shard(transformer_block.moe.experts,
  mesh=efsdp)`, Shard(1) once efsdp * ep exceeds the experts); the rest of the block over dp_shard.
  The block's gathered size is then its dense part plus its local experts, whole.
- Activations: the token-expert pairs a rank sends are its own S = tokens x top-k; the pairs it
  receives are R = moe_imbalance x S on the busiest rank (the mean is S). Around transformers'
  grouped experts (integrations/moe.py `grouped_mm_experts_forward`), the dispatch all-to-all output
  is permuted expert-major and that copy is what the first grouped matmul keeps (R x h), with the
  permutation's int64 index (R); the down projection's output is un-permuted into a new tensor and
  sent back, so neither is kept; the combined pairs (S x h) are what the weighting multiply keeps.
- Buffers: the dispatch and combine outputs are transient; at the forward's and backward's peaks no
  all-to-all is in flight (docs/engines/mesh.md), so EP adds no buffer of its own there.
- Full checkpointing: the recomputation stops at the combine with its locals alive, a moment above the MLP's
  backward under EP (`recompute_end_transient`).
"""

from __future__ import annotations

from zeroplan.estimate.model.layout import ParamTensor
from zeroplan.spec.mesh import MeshSpec, routed_experts
from zeroplan.spec.model import TransformerSpec

INT64_BYTES = 8

_EXPERTS = ".experts."  # the fused expert tensors (Mixtral, Qwen3-MoE, DeepSeek-V3, GPT-OSS layouts); not shared_experts


def is_expert(tensor: ParamTensor) -> bool:
    return _EXPERTS in tensor.name


def shard_degree(tensor: ParamTensor, n: int, expert_n: int) -> int:
    """Ranks FSDP2 shards `tensor` over: efsdp for a routed expert's tensor under EP, else the unit's n."""
    return expert_n if expert_n and is_expert(tensor) else n


def _dim1(tensor: ParamTensor, model: TransformerSpec) -> int:
    """Dim 1 of a fused expert tensor: gate_up (E, 2i, h), down (E, h, i), their biases (E, 2i), (E, h);
    GPT-OSS stores the weights transposed (E, h, 2i) and (E, i, h) (estimate/model/moe_layout.py)."""
    inner = model.moe.expert_intermediate_size if model.moe is not None else model.intermediate_size
    h = model.hidden_size
    leaf = tensor.name.rsplit(".", 1)[-1]
    transposed = model.hf_model_type == "gpt_oss" and not leaf.endswith("_bias")
    if leaf.startswith("gate_up_proj"):
        return h if transposed else 2 * inner
    return inner if transposed else h


def placed_experts(tensors: tuple[ParamTensor, ...], model: TransformerSpec, mesh: MeshSpec,
                   gpus: int) -> tuple[ParamTensor, ...]:
    """The rank's (already ep-split) expert tensors as FSDP2 shards them: on dim 1 when efsdp x ep exceeds
    the experts (torchtitan apply_fsdp `_experts_shard_placement_fn`), which `rows` then stands for."""
    if mesh.ep == 1 or mesh.expert_fsdp_degree(gpus) * mesh.ep <= routed_experts(model):
        return tensors
    return tuple(ParamTensor(t.name, t.numel, _dim1(t, model)) if is_expert(t) else t for t in tensors)


def first_block_gradient(model: TransformerSpec, mesh: MeshSpec) -> int | None:
    """The sparse last block's expert gradients alive at its backward peak (estimate/activations/moe.py
    `first_block_gradient`), for the rank's num_experts / ep experts; None where EP is off."""
    from zeroplan.estimate.activations.moe import first_block_gradient as whole

    if mesh.ep == 1 or model.moe is None:
        return None
    gradient = whole(model)
    return None if gradient is None else gradient // mesh.ep


def _routed_pairs(model: TransformerSpec) -> int:
    return model.moe.experts_per_token if model.moe is not None else model.experts_per_token


def saved_per_block_delta(model: TransformerSpec, mesh: MeshSpec, tokens: int, comp: int) -> int:
    """What one sparse block keeps under EP beyond transformers' grouped experts on one rank: the
    permutation's int64 index per received pair, and the received side's pairs (the permuted input and
    the gate's intermediate tensors) moe_imbalance - 1 times over on the busiest rank."""
    if mesh.ep == 1 or model.moe is None:
        return 0
    from zeroplan.estimate.activations.moe import gate_saved

    sent = tokens * _routed_pairs(model)
    received = round(sent * mesh.moe_imbalance)
    per_received = comp * (model.hidden_size + gate_saved(model) * model.moe.expert_intermediate_size)
    return received * INT64_BYTES + (received - sent) * per_received


def backward_transient_delta(model: TransformerSpec, mesh: MeshSpec, tokens: int, comp: int) -> int:
    """The busiest rank's extra gradients at the gate activation's backward (estimate/activations/moe.py
    `_backward_moment`): its per-pair intermediate-width gradients over the received pairs."""
    if mesh.ep == 1 or model.moe is None or mesh.moe_imbalance == 1.0:
        return 0
    sent = tokens * _routed_pairs(model)
    per_pair = 6 if model.hf_model_type == "gpt_oss" else 4
    return (round(sent * mesh.moe_imbalance) - sent) * per_pair * comp * model.moe.expert_intermediate_size


def recompute_end_transient(model: TransformerSpec, mesh: MeshSpec, tokens: int, comp: int, output_grad_bytes: int) -> int:
    """Beyond the recomputed block's saved tensors, live where full checkpointing's recomputation of a sparse
    block stops under EP: at the combine's last saved tensor (the un-permute index, torch/utils/checkpoint.py
    `_StopRecomputationError` once every saved tensor is rebuilt), the forward's locals are still alive
    (measure/engines/mesh_moe.py `ExpertParallelExperts.forward`: the down output and its un-permuted copy, R x h each,
    the weighted pairs S x h, the sort's values and the arange, S int64 each) and its callers' (the decoder layer's
    `residual`, tokens x h; Qwen3MoeSparseMoeBlock's discarded router logits, tokens x experts, and the 16-bit
    routing weights, tokens x k), beside the block output's gradient and the sum's expanded gradient made
    contiguous by view's backward (S x h) that asked for the recomputation.
    0 where EP is off (the moment then lies below the weighting's backward, docs/engines/mesh.md)."""
    if mesh.ep == 1 or model.moe is None:
        return 0
    h = model.hidden_size
    sent = tokens * _routed_pairs(model)
    received = round(sent * mesh.moe_imbalance)
    locals_bytes = comp * h * (2 * received + sent) + 2 * INT64_BYTES * sent
    callers_bytes = comp * tokens * (h + routed_experts(model) + _routed_pairs(model))
    return output_grad_bytes + comp * h * sent + locals_bytes + callers_bytes
