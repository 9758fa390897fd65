"""Engine `fsdp2`: `fully_shard` on every transformer block, then on the root; under
`fsdp2.units` split, on the embeddings and on [final norm, head] before the root, as accelerate's
`fsdp2_prepare_model` does (a tied head: one [embeddings, final norm, head] unit).

Stage 2 is `reshard_after_forward=False` (parameters stay gathered from forward to backward,
gradients and optimizer states are sharded), stage 3 is `True`; the last block's, the root's and
the head unit's settings are those of `training.fsdp2_wrapping` (the estimator models the same). Offload is `CPUOffloadPolicy` (sharded parameters, gradients and the optimizer
step on the host; pinned on CUDA, unpinned on a CPU-only machine, where pinning fails);
fp16/bf16 is `MixedPrecisionPolicy(param_dtype, reduce_dtype=fp32)` over fp32 sharded
parameters; pure-bf16 shards a bf16 model. Source: torch/distributed/fsdp/_fully_shard/.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from zeroplan.measure.engines.common import RunContext, TorchOptimizerSteps, make_optimizer, module_buffers, optimizer_state_tensors, transformer_blocks
from zeroplan.spec.program import FSDP2Units, GradSync
from zeroplan.spec.training import Offload, Precision, TrainingSpec

_PARAM_DTYPE = {Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}


def policies(training: TrainingSpec, ctx: RunContext) -> dict:
    dtype = _PARAM_DTYPE.get(training.precision)
    mp_policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype else MixedPrecisionPolicy()
    offload = training.offload_optimizer == Offload.CPU or training.offload_params == Offload.CPU
    offload_policy = CPUOffloadPolicy(pin_memory=ctx.is_cuda) if offload else OffloadPolicy()
    return {"mp_policy": mp_policy, "offload_policy": offload_policy}


def _device_mesh(training: TrainingSpec, ctx: RunContext):
    """The ranks fully_shard shards over: all of them, or under HSDP (dp_replicate > 1: measure/mesh_rules.py
    `is_adapted_hsdp`) a 2-D (dp_replicate, dp_shard) mesh, which fully_shard replicates over its first dimension
    and shards over its second (torch/distributed/fsdp/_fully_shard/_fully_shard.py, HSDP)."""
    replicas = training.mesh.dp_replicate
    shape, names = ((ctx.world_size,), None) if replicas == 1 else ((replicas, ctx.world_size // replicas),
                                                                     ("dp_replicate", "dp_shard"))
    if not ctx.is_fake:
        return init_device_mesh(ctx.device.type, shape, mesh_dim_names=names)
    # DeviceMesh reads its rank layout back from a tensor (.tolist()), which a fake tensor
    # cannot give: build the mesh from real tensors.
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return init_device_mesh(ctx.device.type, shape, mesh_dim_names=names)


class FSDP2Runner(TorchOptimizerSteps):
    def __init__(self, model: torch.nn.Module, training: TrainingSpec, ctx: RunContext):
        self.model = model
        self.grad_accum = training.grad_accum
        self._micro = 0
        self.sync_every = training.program.grad_sync == GradSync.EVERY
        mesh = _device_mesh(training, ctx)
        reshard = training.zero_stage == 3
        wrapping = training.fsdp2_wrapping
        wrap_policies = policies(training, ctx)  # (the module's function keeps its name)
        blocks = transformer_blocks(model)
        for i, block in enumerate(blocks):
            last = i == len(blocks) - 1
            fully_shard(block, mesh=mesh, reshard_after_forward=wrapping.reshard_last_block if last else reshard, **wrap_policies)
        if wrapping.units == FSDP2Units.SPLIT:
            embeddings, head = outer_modules(model)
            if any(p is q for p in head[-1].parameters() for q in embeddings[0].parameters()):  # tied
                fully_shard(embeddings + head, mesh=mesh, reshard_after_forward=wrapping.reshard_head, **wrap_policies)
            else:
                fully_shard(embeddings, mesh=mesh, reshard_after_forward=reshard, **wrap_policies)
                fully_shard(head, mesh=mesh, reshard_after_forward=wrapping.reshard_head, **wrap_policies)
            fully_shard(model, mesh=mesh, **wrap_policies)  # holds no parameters
        else:
            fully_shard(model, mesh=mesh, reshard_after_forward=wrapping.reshard_root, **wrap_policies)
        if any(p.is_meta for p in model.parameters()):
            # model_init meta (engines.model_device): allocate this rank's shards only
            # (FSDPModule._apply resets each FSDPParam's sharded data), then fill them
            offloaded = isinstance(wrap_policies["offload_policy"], CPUOffloadPolicy)
            model.to_empty(device="cpu" if offloaded else ctx.device)
            if offloaded:  # the shards stay on the host; module buffers are used on the device
                for module in model.modules():
                    for name, buffer in module.named_buffers(recurse=False):
                        module._buffers[name] = buffer.to(ctx.device)
            model.init_materialized()
        self.optimizer = make_optimizer([p for p in model.parameters() if p.requires_grad], training)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # grad_sync last: reduce-scatter only on the last micro-batch; before it FSDP2 accumulates
        # unsharded gradients (FSDPModule.set_requires_gradient_sync).
        self.model.set_requires_gradient_sync(self._syncs())
        return self.model(input_ids, labels)

    def tensors_by_category(self) -> dict[str, list[torch.Tensor]]:
        return fsdp2_tensors(self.model, self.optimizer)


def outer_modules(model: torch.nn.Module) -> tuple[list[torch.nn.Module], list[torch.nn.Module]]:
    """The embeddings (tokens, then learned positions) and [final norm, output head] of a workload
    model, Hugging Face or reference (`zeroplan.measure.workload`)."""
    lm = model.lm
    if not model.hf:
        embeddings = [m for m in (lm.embed_tokens, lm.embed_positions) if m is not None]
        return embeddings, [lm.final_norm, lm.lm_head]
    base = lm.base_model
    positions = [m for name in ("wpe", "embed_positions") if isinstance(m := getattr(base, name, None), torch.nn.Module)]
    # the final norm: the last norm among the base model's children (accelerate `_find_final_norm`)
    norms = [m for _, m in base.named_children() if "Norm" in type(m).__name__]
    return [lm.get_input_embeddings(), *positions], [*norms[-1:], lm.get_output_embeddings()]


def _param_groups(model: torch.nn.Module):
    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            if group is not None:
                yield group


def fsdp2_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, list[torch.Tensor]]:
    """What an FSDP2 rank holds, by category: sharded parameters, sharded and unsharded gradients,
    the optimizer's states, and as buffers the unsharded parameters, module buffers and the
    all-gather / reduce-scatter buffers."""
    # Attribute names from torch/distributed/fsdp/_fully_shard/_fsdp_param.py (FSDPParam) and
    # _fsdp_param_group.py (FSDPParamGroup, comm_ctx).
    params, grads, buffers = [], [], module_buffers(model)
    comm_ctx = None
    for group in _param_groups(model):
        comm_ctx = group.comm_ctx
        for fsdp_param in group.fsdp_params:
            params.append(fsdp_param._sharded_param_data)
            sharded = fsdp_param.sharded_param
            if sharded.grad is not None:
                grads.append(sharded.grad)
            if fsdp_param.unsharded_accumulated_grad is not None:
                grads.append(fsdp_param.unsharded_accumulated_grad)
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if unsharded is not None:
                if unsharded.grad is not None:
                    grads.append(unsharded.grad)
                buffers.append(unsharded)
            buffers.extend(getattr(fsdp_param, "all_gather_outputs", None) or ())
        if group._all_gather_result is not None:
            buffers.append(group._all_gather_result.all_gather_output)
        if group._partial_reduce_output is not None:
            buffers.append(group._partial_reduce_output)
    if comm_ctx is not None:  # attributes set in FSDPCommContext.lazy_init (first forward)
        all_gather_state = getattr(comm_ctx, "all_gather_state", None)
        if all_gather_state is not None:
            buffers.append(all_gather_state.all_gather_result.all_gather_output)
        for state in getattr(comm_ctx, "reduce_scatter_states", ()):
            buffers.append(state.reduce_scatter_input)
    return {
        "params": params,
        "grads": grads,
        "optimizer_states": optimizer_state_tensors(optimizer) if optimizer is not None else [],
        "buffers": buffers,
    }


def build_runner(model: torch.nn.Module, training: TrainingSpec, ctx: RunContext) -> FSDP2Runner:
    return FSDP2Runner(model, training, ctx)
