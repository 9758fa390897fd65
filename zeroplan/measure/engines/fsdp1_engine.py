"""Engine `fsdp1`: `FullyShardedDataParallel` (torch 2.13, torch/distributed/fsdp/fully_sharded_data_parallel.py)
wrapped as accelerate wraps a Hugging Face model: `transformer_auto_wrap_policy` over the decoder layer class
(accelerate `fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP`), the root holding the embeddings, final norm and
head; with LoRA and use_orig_params false (spec/fsdp1.py `adapters_wrapped_apart`), PEFT's `fsdp_auto_wrap_policy`
(peft/utils/other.py), which also wraps every module whose weight trains (the adapters' Linear layers) as a unit
of its own.

The ZeRO stage is the sharding strategy (spec/fsdp1.py `sharding_strategy`); `fsdp1.hybrid` shards over each node's
ranks and replicates across nodes, with the (intra-node, inter-node) process groups given explicitly (FSDP1 would
ask the device count otherwise). Mixed precision is `MixedPrecision(param_dtype, reduce_dtype, buffer_dtype)` over
fp32 parameters: accelerate's policy (all three the training dtype) under the Trainer's recipe, reduce fp32 in
zeroplan's loop (spec/fsdp1.py `fsdp1_reduces_in_param_dtype`); pure-bf16 wraps a bf16 model without a policy.
Offload is `CPUOffload(offload_params=True)`, which pins host memory and cannot run without a GPU
(docs/engines/fsdp1.md, "CPU offload").
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.distributed.fsdp import (
    BackwardPrefetch,
    CPUOffload,
    FullyShardedDataParallel,
    MixedPrecision,
    ShardingStrategy,
)
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

from zeroplan.errors import MeasureError
from zeroplan.measure.engines.common import (RunContext, TorchOptimizerSteps, make_optimizer, module_buffers,
                                             optimizer_state_tensors, transformer_blocks)
from zeroplan.measure.fsdp1_rules import refuse_unmeasurable_fsdp1
from zeroplan.spec.fsdp1 import BackwardPrefetch as Prefetch, adapters_wrapped_apart, fsdp1_reduces_in_param_dtype, sharding_strategy
from zeroplan.spec.program import GradSync
from zeroplan.spec.training import Offload, Precision, TrainingSpec

_DTYPE = {Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}
_PREFETCH = {Prefetch.BACKWARD_PRE: BackwardPrefetch.BACKWARD_PRE, Prefetch.BACKWARD_POST: BackwardPrefetch.BACKWARD_POST,
             Prefetch.NONE: None}


def fsdp1_kwargs(training: TrainingSpec, ctx: RunContext, auto_wrap_policy) -> dict:
    """The FullyShardedDataParallel keyword arguments of `training` (the Trainer builds the same through accelerate)."""
    wrapping = training.fsdp1_wrapping
    dtype = _DTYPE.get(training.precision)
    mixed = None
    if dtype is not None:
        reduce = dtype if fsdp1_reduces_in_param_dtype(training.recipe) else torch.float32
        mixed = MixedPrecision(param_dtype=dtype, reduce_dtype=reduce, buffer_dtype=dtype)
    offload = Offload.CPU in (training.offload_optimizer, training.offload_params)
    return dict(
        auto_wrap_policy=auto_wrap_policy,
        sharding_strategy=ShardingStrategy[sharding_strategy(training.zero_stage, wrapping.hybrid)],
        mixed_precision=mixed,
        cpu_offload=CPUOffload(offload_params=offload),
        backward_prefetch=_PREFETCH[wrapping.backward_prefetch],
        forward_prefetch=wrapping.forward_prefetch,
        limit_all_gathers=wrapping.limit_all_gathers,
        use_orig_params=wrapping.use_orig_params,
        sync_module_states=wrapping.sync_module_states,
        device_id=ctx.device,  # a CPU run names the cpu: FSDP1 refuses to guess a CPU device (_init_device_handle)
        process_group=_process_groups(training, ctx) if wrapping.hybrid else None,
    )


def _process_groups(training: TrainingSpec, ctx: RunContext):
    """HYBRID_SHARD's (intra-node, inter-node) groups: ranks [k*n, (k+1)*n) shard, rank r of every node replicates
    (FSDP1 `_init_intra_and_inter_node_groups` builds the same from the device count)."""
    n, world = training.node_gpus, ctx.world_size
    intra = inter = None
    for start in range(0, world, n):  # every rank creates every group, in the same order (c10d new_group)
        group = dist.new_group(list(range(start, start + n)))
        if start <= ctx.rank < start + n:
            intra = group
    for local in range(n):
        group = dist.new_group(list(range(local, world, n)))
        if ctx.rank % n == local:
            inter = group
    return intra, inter


def block_policy(model: torch.nn.Module):
    """accelerate's TRANSFORMER_BASED_WRAP: every module of the decoder layer's class is a unit."""
    classes = {type(block) for block in transformer_blocks(model)}
    return functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=classes)


def peft_policy(model: torch.nn.Module):
    """PEFT 0.21 utils/other.py `fsdp_auto_wrap_policy`: the decoder layers, and every leaf module whose weight
    trains (lora_A, lora_B: each a unit of its own, so that no FlatParameter mixes frozen and trained tensors)."""
    from torch.distributed.fsdp.wrap import _or_policy, lambda_auto_wrap_policy

    def trains(module: torch.nn.Module) -> bool:
        weight = getattr(module, "weight", None)
        return (len(list(module.named_children())) == 0 and isinstance(weight, torch.Tensor)
                and weight.requires_grad)

    lambda_policy = functools.partial(lambda_auto_wrap_policy, lambda_fn=trains)
    return functools.partial(_or_policy, policies=[lambda_policy, block_policy(model)])


class FSDP1Runner(TorchOptimizerSteps):
    def __init__(self, model: torch.nn.Module, training: TrainingSpec, ctx: RunContext):
        if ctx.is_fake:
            raise MeasureError("engine fsdp1 cannot run under --simulate (FlatParameter needs real storage); use --engine fsdp2")
        refuse_unmeasurable_fsdp1(training, on_gpu=ctx.is_cuda)  # measure/fsdp1_rules.py: CPU offload pins memory
        self.grad_accum = training.grad_accum
        self._micro = 0
        self.sync_every = training.program.grad_sync == GradSync.EVERY
        adapters = training.lora is not None and adapters_wrapped_apart(training.recipe, training.fsdp1_wrapping.use_orig_params)
        policy = peft_policy(model) if adapters else block_policy(model)
        self.model = FullyShardedDataParallel(model, **fsdp1_kwargs(training, ctx, policy))
        self.optimizer = make_optimizer([p for p in self.model.parameters() if p.requires_grad], training)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # grad_sync last: FSDP1's no_sync() keeps the unsharded gradients until the last micro-batch
        if self._syncs():
            return self.model(input_ids, labels)
        with self.model.no_sync():
            return self.model(input_ids, labels)

    def backward(self, loss: torch.Tensor) -> None:
        # no_sync covers the backward too: FSDP1 reads _sync_gradients in its post-backward hooks
        if self.sync_every or self._micro == self.grad_accum:
            super().backward(loss)
            return
        with self.model.no_sync():
            super().backward(loss)

    def tensors_by_category(self) -> dict[str, list[torch.Tensor]]:
        return fsdp1_tensors(self.model, self.optimizer)


def flat_params(model: torch.nn.Module):
    """Every FlatParameter of an FSDP1-wrapped model (one per unit), with its handle."""
    for module in model.modules():
        if isinstance(module, FullyShardedDataParallel) and module._handle is not None:
            yield module._handle.flat_param, module._handle


def fsdp1_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, list[torch.Tensor]]:
    """What an FSDP1 rank holds, by category: the sharded flat parameters (`_local_shard`), their gradients
    (unsharded `.grad` in backward, `_saved_grad_shard`, the original parameters' gradient views), the optimizer's
    states, and as buffers the padded unsharded flat parameters (`_full_param_padded`, the all-gather destination),
    the low-precision shards (`_mp_shard`) and the module buffers. Attribute names from torch/distributed/fsdp/
    _flat_param.py (FlatParamHandle.init_flat_param_attributes, unshard, prepare_gradient_for_backward)."""
    params, grads, buffers = [], [], module_buffers(model)
    for flat_param, _ in flat_params(model):
        # NO_SHARD's _local_shard is the whole flat parameter; under mixed precision flat_param.data is _mp_shard
        # between an unshard and the next reshard, so the flat parameter itself is named by its attributes only
        params.append(getattr(flat_param, "_local_shard", flat_param))
        for name in ("_saved_grad_shard", "_cpu_grad"):
            held = getattr(flat_param, name, None)
            if held is not None:
                grads.append(held)
        if flat_param.grad is not None:
            grads.append(flat_param.grad)
        for name in ("_full_param_padded", "_full_prec_full_param_padded", "_mp_shard"):
            held = getattr(flat_param, name, None)
            if held is not None:
                buffers.append(held)
        for param in flat_param._params or ():  # use_orig_params: the original parameters' gradient views
            if param.grad is not None:
                grads.append(param.grad)
    return {
        "params": params,
        "grads": grads,
        "optimizer_states": optimizer_state_tensors(optimizer) if optimizer is not None else [],
        "buffers": buffers,
    }


def build_runner(model: torch.nn.Module, training: TrainingSpec, ctx: RunContext) -> FSDP1Runner:
    return FSDP1Runner(model, training, ctx)
