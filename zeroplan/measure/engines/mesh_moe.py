"""Measure expert parallelism: a mixture-of-experts model's experts split over ranks, tokens sent to
them and back by all-to-all, composed with FSDP2 as torchtitan 0.3.0 composes them.

The model is the Hugging Face one of the MoE spec (Qwen3-MoE: transformers 5.23.0
modeling_qwen3_moe.py, whose grouped-matmul experts estimate/activations/moe.py models). Its experts' forward
gets torchtitan's `ExpertParallel` parallel style (torchtitan/distributed/expert_parallel.py) around
transformers' own expert computation (integrations/moe.py `grouped_mm_experts_forward`):
- the token-expert pairs are sorted by expert and gathered, as transformers does;
- dispatch (`_token_dispatch`): the per-expert counts go through an all-to-all (no autograd), which
  gives each rank its send and receive splits; the pairs go through
  `all_to_all_single_autograd`; the received pairs, rank-major, are permuted expert-major
  (models/common/moe/utils.py `_permute`, `_generate_permute_indices`);
- the rank's local experts (dim 0 of the fused tensors, `Shard(0)` over the ep mesh) run the grouped
  matmuls on what it received;
- combine (`_token_combine`): un-permuted (`_unpermute`: new_empty then index_put), sent back by
  `all_to_all_single_autograd`, then weighted and summed per token as transformers does.
FSDP2 (models/llama4/infra/parallelize.py `apply_fsdp`, torchtitan 0.3.0): each block's experts are
a unit of their own over the efsdp mesh (dp_shard * cp * tp / ep ranks; Shard(1) when efsdp * ep
exceeds the experts), then the block over dp_shard, then the root. The sparse mesh is
(efsdp, ep), ep innermost (distributed/parallel_dims.py `build_mesh`).

Each rank counts the pairs it receives per sparse layer; `ExpertParallelRunner.imbalance` is the
busiest rank's received pairs over the mean (all ranks' counts are all-gathered at the end of each
step), reported with the run (docs/measure.md, "Expert parallelism").
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
from torch import nn

from zeroplan.errors import MeasureError
from zeroplan.measure.engines.common import RunContext, TorchOptimizerSteps, make_optimizer, transformer_blocks
from zeroplan.measure.grid_ep import IMBALANCE_NOTE
from zeroplan.spec.training import TrainingSpec



def ep_meshes(training: TrainingSpec, ctx: RunContext):
    """(dense dp_shard mesh, sparse (efsdp, ep) mesh) over the world, as torchtitan's build_mesh lays
    them out: the same ranks, ep innermost in the sparse one."""
    from torch.distributed.device_mesh import init_device_mesh

    ep = training.mesh.ep
    if ctx.world_size % ep:
        raise MeasureError(f"mesh.ep: {ep} does not divide the {ctx.world_size} ranks")
    dense = init_device_mesh(ctx.device.type, (ctx.world_size,), mesh_dim_names=("dp_shard",))
    sparse = init_device_mesh(ctx.device.type, (ctx.world_size // ep, ep), mesh_dim_names=("efsdp", "ep"))
    return dense, sparse


def _permute_indices(counts: torch.Tensor, ep: int, local_experts: int, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-major received pairs to expert-major order (torchtitan `_generate_permute_indices`):
    the gather index and the pairs per local expert."""
    starts = counts.cumsum(0) - counts  # where each (rank, expert) group starts in the received pairs
    lengths = counts.view(ep, local_experts).t().reshape(-1)
    origins = starts.view(ep, local_experts).t().reshape(-1)
    out_starts = lengths.cumsum(0) - lengths
    position = torch.arange(total, device=counts.device)
    group = torch.searchsorted(out_starts + lengths, position, right=True)
    return position + (origins - out_starts)[group], counts.view(ep, local_experts).sum(0)


class ExpertParallelExperts:
    """torchtitan's ExpertParallel on one transformers experts module: its fused expert tensors
    become DTensors sharded on dim 0 over `ep_mesh`, its forward dispatches and combines."""

    def __init__(self, experts: nn.Module, ep_mesh, counter: list[int]):
        from torch.distributed.tensor import Shard, distribute_tensor

        self.group, self.ep = ep_mesh.get_group(), ep_mesh.size()
        self.num_experts = experts.num_experts
        if self.num_experts % self.ep:
            raise MeasureError(f"mesh.ep: {self.ep} does not divide num_experts {self.num_experts}")
        for name, param in list(experts.named_parameters(recurse=False)):
            experts.register_parameter(name, nn.Parameter(distribute_tensor(param, ep_mesh, [Shard(0)])))
        self.counter = counter  # received pairs of this layer, summed over the step's forwards
        experts.forward = types.MethodType(self.forward, experts)

    def forward(self, experts: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_to_all_single_autograd
        from transformers.integrations.moe import _grouped_linear

        k, tokens, width = top_k_index.size(-1), hidden.size(0), hidden.size(-1)
        local_experts = self.num_experts // self.ep
        # transformers grouped_mm_experts_forward: pairs sorted by expert, gathered, their weights
        expert_ids, perm = torch.sort(top_k_index.reshape(-1))
        pairs = hidden[perm // k]
        pair_weights = top_k_weights.reshape(-1)[perm]
        with torch.no_grad():  # dispatch's splits (ExpertParallel._token_dispatch)
            per_expert = torch.histc(expert_ids.float(), bins=self.num_experts, min=0, max=self.num_experts - 1).long()
            received = torch.empty_like(per_expert)
            dist.all_to_all_single(received, per_expert, group=self.group)
            send = per_expert.view(self.ep, -1).sum(1).tolist()
            receive = received.view(self.ep, -1).sum(1).tolist()
        routed = all_to_all_single_autograd(pairs, receive, send, self.group)
        del pairs
        total = routed.size(0)
        self.counter[0] += total
        with torch.no_grad():
            order, local_counts = _permute_indices(received, self.ep, local_experts, total)
        routed = routed[order, :]
        offsets = torch.cumsum(local_counts, dim=0, dtype=torch.int32)
        gate_up, down = experts.gate_up_proj.to_local(), experts.down_proj.to_local()
        out = experts._apply_gate(_grouped_linear(routed, gate_up, offsets))
        out = _grouped_linear(out, down, offsets)
        # combine (ExpertParallel._token_combine): un-permute, then the reverse all-to-all
        unpermuted = out.new_empty((total, width))
        unpermuted[order, :] = out
        back = all_to_all_single_autograd(unpermuted, send, receive, self.group)
        weighted = back * pair_weights.unsqueeze(-1)
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.size(0), device=perm.device)
        return weighted[inverse].view(tokens, k, width).sum(dim=1).to(hidden.dtype)


def _shard_outer_units(model: nn.Module, mesh, training: TrainingSpec, policies: dict) -> None:
    """The embeddings, [final norm, head] and the root as the fsdp2 engine wraps them (fsdp2_engine.py:
    torchtitan's split units, or the root holding all three)."""
    from torch.distributed.fsdp import fully_shard

    from zeroplan.measure.engines.fsdp2_engine import outer_modules
    from zeroplan.spec.program import FSDP2Units

    wrapping = training.fsdp2_wrapping
    if wrapping.units != FSDP2Units.SPLIT:
        fully_shard(model, mesh=mesh, reshard_after_forward=wrapping.reshard_root, **policies)
        return
    embeddings, head = outer_modules(model)
    if any(p is q for p in head[-1].parameters() for q in embeddings[0].parameters()):  # tied: one unit
        fully_shard(embeddings + head, mesh=mesh, reshard_after_forward=wrapping.reshard_head, **policies)
    else:
        fully_shard(embeddings, mesh=mesh, reshard_after_forward=training.zero_stage == 3, **policies)
        fully_shard(head, mesh=mesh, reshard_after_forward=wrapping.reshard_head, **policies)
    fully_shard(model, mesh=mesh, **policies)  # holds no parameters


def _sparse_experts(block: nn.Module) -> nn.Module | None:
    experts = getattr(getattr(block, "mlp", None), "experts", None)
    return experts if experts is not None and hasattr(experts, "gate_up_proj") else None


class ExpertParallelRunner(TorchOptimizerSteps):
    """EP with FSDP2 over the data-parallel ranks: the worker's forward/backward/step."""

    def __init__(self, model: nn.Module, training: TrainingSpec, ctx: RunContext):
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Shard

        from zeroplan.measure.engines.fsdp2_engine import policies

        if not getattr(model, "hf", False):
            raise MeasureError("implementation: expert parallelism is measured on the transformers MoE model; "
                               "install transformers")
        self.model, self.training = model, training
        self.grad_accum, self._micro = training.grad_accum, 0
        dense, sparse = ep_meshes(training, ctx)
        self.counters: list[list[int]] = []
        policies = policies(training, ctx)
        reshard, wrapping = training.zero_stage == 3, training.fsdp2_wrapping
        blocks = transformer_blocks(model)
        efsdp_mesh = sparse["efsdp"]
        for i, block in enumerate(blocks):
            block_reshards = wrapping.reshard_last_block if i == len(blocks) - 1 else reshard
            experts = _sparse_experts(block)
            if experts is not None:
                self.counters.append([0])
                ExpertParallelExperts(experts, sparse["ep"], self.counters[-1])
                # experts over efsdp, resharded as their block; dim 1 once efsdp x ep exceeds the experts
                # (torchtitan apply_fsdp `_experts_shard_placement_fn`)
                on_dim1 = efsdp_mesh.size() * sparse["ep"].size() > experts.num_experts
                fully_shard(experts, mesh=efsdp_mesh, reshard_after_forward=block_reshards,
                            shard_placement_fn=(lambda _: Shard(1)) if on_dim1 else None, **policies)
            fully_shard(block, mesh=dense, reshard_after_forward=block_reshards, **policies)
        _shard_outer_units(model, dense, training, policies)
        if not self.counters:
            raise MeasureError("mesh.ep: the model has no sparse layers to split over ep")
        if any(p.is_meta for p in model.parameters()):  # torchtitan: built on meta, sharded, then materialised
            model.to_empty(device=ctx.device)
            model.init_materialized()
        self.optimizer = make_optimizer([p for p in model.parameters() if p.requires_grad], training)
        self.world = ctx.world_size
        self.imbalance = 0.0  # the largest of the steps' factors

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        self.model.set_requires_gradient_sync(self._syncs())
        return self.model(input_ids, labels)

    def step(self) -> None:
        super().step()
        self._record_imbalance()

    def _record_imbalance(self) -> None:
        """The busiest rank's received pairs, over all sparse layers, against the mean over ranks."""
        mine = torch.tensor([sum(c[0] for c in self.counters)], dtype=torch.long)
        every = [torch.zeros_like(mine) for _ in range(self.world)]
        dist.all_gather(every, mine)
        counts = [int(t.item()) for t in every]
        mean = sum(counts) / len(counts)
        if mean:
            self.imbalance = max(self.imbalance, max(counts) / mean)
        for counter in self.counters:
            counter[0] = 0

    def notes(self) -> list[str]:
        factor = self.imbalance or 1.0
        return [f"{IMBALANCE_NOTE}{factor:.4f} (the busiest rank's received token-expert pairs over the mean)"]

    def tensors_by_category(self) -> dict[str, list[torch.Tensor]]:
        from zeroplan.measure.engines.fsdp2_engine import fsdp2_tensors

        return fsdp2_tensors(self.model, self.optimizer)


def build_runner(model: nn.Module, training: TrainingSpec, ctx: RunContext) -> ExpertParallelRunner:
    return ExpertParallelRunner(model, training, ctx)
