"""The step-cost model of `zeroplan.plan.cost` extended to a mesh (issue 14): seconds per optimizer step
on one GPU of the worst rank's pipeline rank, term by term, no overlap assumed (an upper bound, as there).

- compute: the data-parallel rank's tokens are shared by its tp x cp x pp GPUs; efficiency from the
  tokens of one local micro-batch (b x s / cp), as `cost.py`.
- data parallelism: `cost.step_cost_model` over the parameters one rank holds (its stage, cut by tp), sharded
  over fsdp = dp_shard x cp ranks; with ep, the experts a rank gathers and reduces are its ep shard (1/ep of each
  layer's experts, over efsdp ranks: torchtitan parallel_dims.py `build_mesh`), not the 1/tp the estimate scales
  them to (estimate/parallel/mesh.py `_experts_resharded`).
- hsdp all-reduce: with dp_replicate r > 1, FSDP2 all-reduces each reduce-scattered gradient shard across the r
  replicas (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py `foreach_reduce`: the all-reduce over the
  replicate group follows the reduce-scatter), a ring moving 2 (r - 1)/r of the shard (Patarasuk and Yuan 2009,
  as NCCL's ring), between nodes; at every micro-batch as the reduce-scatter (torchtitan accumulates with
  gradient sync on), once per step under a pipeline (pipelining/stage.py `perform_reduce_grad`).
- tp: with sequence parallelism each block all-gathers twice and reduce-scatters twice in forward, and as
  much again in backward, each moving (t - 1)/t of b x s/cp x h (Korthikanti et al. 2022 section 4.2.2:
  the same volume as the two all-reduces per pass without SP).
- cp: the ring passes each rank's keys and values cp - 1 times per block in forward, and keys, values and
  their gradients in backward (torch _context_parallel/_attention.py ring).
- pp: the bubble (Narayanan et al. 2021 section 2.2: (p - 1)/m of the ideal time for GPipe and 1F1B,
  (p - 1)/(v m) interleaved; zero bubble (Qi et al. 2023) taken as a third of 1F1B's, its ZB-H1), and each
  micro-batch's activation and gradient sent to the next stage.
- ep: each MoE layer's all-to-all dispatch and combine (GShard, Lepikhin et al. 2020; torchtitan
  distributed/expert_parallel.py `ExpertParallel._token_dispatch` and `_token_combine`, all_to_all_single), in
  forward and again in backward (the all-to-all's gradient is the reverse all-to-all): (ep - 1)/ep of the
  rank's tokens x top-k x h leave it each time.
Links: the mesh is laid out with tp innermost, then cp, dp_shard, dp_replicate, pp (torchtitan
parallel_dims.py `build_mesh`); a dimension whose group fits in a node uses the node's links.
"""

from __future__ import annotations

from dataclasses import dataclass

from zeroplan.estimate.caches import memo
from zeroplan.estimate.dtypes import state_bytes
from zeroplan.plan.cost import Assumptions, ModelFlops, PerToken, step_cost_model
from zeroplan.spec.mesh import PPSchedule
from zeroplan.spec.model import TransformerSpec
from zeroplan.spec.training import TrainingSpec


@dataclass(frozen=True)
class MeshStepCost(PerToken):
    """Seconds per optimizer step on one GPU by term; `tokens` is the GPU's share of the tokens trained."""

    compute_s: float
    recompute_s: float
    data_parallel_s: float
    replicate_s: float
    offload_s: float
    optimizer_s: float
    tensor_parallel_s: float
    context_parallel_s: float
    pipeline_bubble_s: float
    pipeline_p2p_s: float
    expert_parallel_s: float
    tokens: float

    def terms(self) -> dict[str, float]:
        return {"compute": self.compute_s, "recompute": self.recompute_s, "data parallel": self.data_parallel_s,
                "hsdp all-reduce": self.replicate_s, "offload": self.offload_s, "optimizer": self.optimizer_s,
                "tp": self.tensor_parallel_s, "cp": self.context_parallel_s, "pp bubble": self.pipeline_bubble_s, "pp send": self.pipeline_p2p_s,
                "ep": self.expert_parallel_s}

    @property
    def step_s(self) -> float:
        return sum(self.terms().values())


def _link(group_span: int, training: TrainingSpec, assumptions: Assumptions) -> float:
    """Bandwidth of a collective over ranks `group_span` apart at most: inside a node or across nodes."""
    return assumptions.intra_node_bytes_per_s if group_span <= training.node_gpus else assumptions.inter_node_bytes_per_s


def mesh_step_cost(model: TransformerSpec, flops: ModelFlops, rank_params: int, layers: int, training: TrainingSpec,
                   assumptions: Assumptions) -> MeshStepCost:
    """The cost of `training` (mesh included) for a rank holding `rank_params` parameters (before data-parallel
    sharding) and `layers` blocks: the pipeline rank the estimate found worst."""
    mesh, gpus = training.mesh, training.gpus
    tp, cp, pp = mesh.tp, mesh.cp, mesh.pp
    fsdp = mesh.fsdp_degree(gpus)
    micro, accum, seq = training.micro_batch, training.grad_accum, training.seq_len
    local_tokens = micro * seq // cp
    element = state_bytes(training.precision, training.optimizer).activation

    # compute over the tp x cp x pp GPUs of a data-parallel rank; efficiency of a local micro-batch
    forward_backward = flops.dense_flops_per_token + flops.attention_flops_per_token_per_seq * seq
    dense = _data_parallel_training(training.engine, training.zero_stage, fsdp, min(training.node_gpus, fsdp),
                                    training.precision, training.optimizer, seq // cp, training.checkpointing,
                                    training.offload_optimizer, training.offload_params)
    share = ModelFlops(rank_params, rank_params, forward_backward / (tp * pp), 0.0)
    base = step_cost_model(share, dense, assumptions).step_cost(micro, accum)
    # the cost model's data-parallel collectives over fsdp ranks run on the links of their span; under ep the
    # rank's parameters already hold E/ep whole experts (estimate/parallel/experts.py), which its efsdp unit gathers
    span = tp * cp * mesh.dp_shard(gpus)
    data_parallel = base.communication_s * assumptions.intra_node_bytes_per_s / _link(span, training, assumptions)
    replicate = 0.0
    if mesh.dp_replicate > 1:
        shard_bytes = rank_params / fsdp * element
        per_step = 1 if pp > 1 else accum
        replicate = per_step * 2 * (mesh.dp_replicate - 1) / mesh.dp_replicate * shard_bytes / _link(gpus, training, assumptions)

    h = model.hidden_size
    activation = local_tokens * h * element
    passes = 3 if training.checkpointing.value == "full" else 2  # forward, backward, and the recomputed forward
    tensor_parallel = 0.0
    if tp > 1:
        tensor_parallel = accum * layers * passes * 4 * (tp - 1) / tp * activation / _link(tp, training, assumptions)
    context_parallel = 0.0
    if cp > 1:
        kv = local_tokens * model.kv_heads * model.dim_per_head // tp * element
        context_parallel = accum * layers * (cp - 1) * (2 * kv * (passes - 1) + 4 * kv) / _link(tp * cp, training, assumptions)
    bubble = p2p = 0.0
    if pp > 1:
        ideal = base.compute_s + base.recompute_s
        fraction = (pp - 1) / accum
        if mesh.pp_schedule == PPSchedule.INTERLEAVED_1F1B:
            fraction /= mesh.pp_virtual_stages
        elif mesh.pp_schedule == PPSchedule.ZERO_BUBBLE:
            fraction /= 3 * mesh.pp_virtual_stages
        bubble = ideal * fraction
        boundary = activation / (tp if mesh.sequence_parallel else 1)
        p2p = accum * 2 * mesh.pp_virtual_stages * boundary / _link(gpus, training, assumptions)
    expert_parallel = 0.0
    if mesh.ep > 1:
        routed = local_tokens * _experts_per_token(model) * h * element
        expert_parallel = accum * layers * 4 * (mesh.ep - 1) / mesh.ep * routed / _link(mesh.ep, training, assumptions)
    return MeshStepCost(base.compute_s, base.recompute_s, data_parallel, replicate, base.offload_s, base.optimizer_s,
                        tensor_parallel, context_parallel, bubble, p2p, expert_parallel,
                        tokens=micro * seq * accum / (tp * cp * pp))


@memo(maxsize=256)  # the planner asks again for every micro-batch of a mesh
def _data_parallel_training(engine, zero_stage, gpus, gpus_per_node, precision, optimizer, seq_len, checkpointing,
                            offload_optimizer, offload_params) -> TrainingSpec:
    """The plain data-parallel spec `cost.step_cost_model` prices: the fsdp ranks, a rank's share of the sequence."""
    return TrainingSpec(engine=engine, zero_stage=zero_stage, gpus=gpus, gpus_per_node=gpus_per_node,
                        precision=precision, optimizer=optimizer, seq_len=seq_len, checkpointing=checkpointing,
                        offload_optimizer=offload_optimizer, offload_params=offload_params)


def _experts_per_token(model: TransformerSpec) -> int:
    """Experts each token is routed to: the MoE spec's (Qwen3-MoE, DeepSeek-V3, GPT-OSS) or Mixtral's."""
    return model.moe.experts_per_token if model.moe is not None else model.experts_per_token

