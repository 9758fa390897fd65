"""Engine `torch`: stage 0 is DistributedDataParallel, stage 1 is DDP + ZeroRedundancyOptimizer.
One rank without `program.ddp` is the bare module, as the Trainer, accelerate and torchtune run it;
`program.optimizer_in_backward` steps each parameter in its gradient hook (engines.OptimizerInBackward).

Mixed precision (fp16/bf16) is `torch.autocast` over fp32 parameters, the usual DDP recipe: the
fp32 parameters are the master copy, autocast keeps the low-precision casts of the weights that
a forward uses (freed when the step's graph is), and there is no gradient scaler (it holds no
memory worth counting; a memory measurement does not need fp16 loss scaling to converge).
pure-bf16 is a bf16 model with a bf16 optimizer.
"""

from __future__ import annotations

import contextlib

import torch
from torch.nn.parallel import DistributedDataParallel

from zeroplan.errors import MeasureError
from zeroplan.measure.accounting import births_as
from zeroplan.measure.engines.common import materialize, OptimizerInBackward, RunContext, TorchOptimizerSteps, gradients, make_optimizer, module_buffers, optimizer_class_and_kwargs, optimizer_state_tensors
from zeroplan.spec.program import GradSync
from zeroplan.spec.training import Precision, TrainingSpec

_AUTOCAST = {Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}


class TorchRunner(TorchOptimizerSteps):
    def __init__(self, model: torch.nn.Module, training: TrainingSpec, ctx: RunContext):
        if ctx.is_fake:
            raise MeasureError("engine torch cannot run under --simulate (DDP needs real tensors); use --engine fsdp2")
        self.model = model
        self.grad_accum = training.grad_accum
        self._micro = 0
        program = training.program
        self.sync_every = program.grad_sync == GradSync.EVERY
        materialize(model, ctx.device)  # model_init meta
        model.to(ctx.device)  # model_init host: accelerate `prepare_model` moves it before wrapping
        self.ddp = DistributedDataParallel(model, device_ids=[ctx.device.index] if ctx.is_cuda else None) if program.ddp else None
        self.params = list(model.parameters())
        trainable = [p for p in self.params if p.requires_grad]  # TrainingSpec.freeze
        self._in_backward = OptimizerInBackward(trainable, training) if program.optimizer_in_backward else None
        if self._in_backward is not None:
            self.optimizer = self._local_optimizer = None
        elif training.zero_stage == 0:
            self.optimizer = make_optimizer(trainable, training)
            self._local_optimizer = self.optimizer
        else:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            cls, kwargs = optimizer_class_and_kwargs(training)
            self.optimizer = ZeroRedundancyOptimizer(trainable, optimizer_class=cls, **kwargs)
            self._local_optimizer = self.optimizer.optim  # holds this rank's shard of the states
        dtype = _AUTOCAST.get(training.precision)
        self._autocast = (lambda: torch.autocast(ctx.device.type, dtype=dtype)) if dtype else contextlib.nullcontext

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        syncs = self._syncs()  # counts the micro-batch
        if self.ddp is None:
            with self._autocast():
                return self.model(input_ids, labels)
        # DDP.no_sync() clears this flag (torch/nn/parallel/distributed.py): with grad_sync last,
        # all-reduce only on the last micro-batch of the step.
        self.ddp.require_backward_grad_sync = syncs
        rebuild_ddp_buckets(self.ddp)
        with self._autocast():
            return self.ddp(input_ids, labels)

    def step(self) -> None:
        if self._in_backward is None:  # with the optimizer in backward every parameter has stepped already
            super().step()
        self._micro = 0

    def tensors_by_category(self) -> dict[str, list[torch.Tensor]]:
        held = ddp_tensors(self.model, self._local_optimizer, self.params)
        if self._in_backward is not None:  # per-parameter optimizers stepped in the gradient hooks
            held["optimizer_states"] = self._in_backward.states()
        return held


def rebuild_ddp_buckets(ddp: DistributedDataParallel) -> None:
    """Call before a DDP forward. DDP re-allocates its buckets in the order gradients arrived, at
    the first forward after the first backward (DistributedDataParallel._pre_forward, which calls
    the same method first thing; it returns False from then on). Called here so that the new
    buckets are counted as the engine's buffers, not as activations."""
    with births_as("buffers"):
        rebuilt = torch.is_grad_enabled() and ddp.reducer._rebuild_buckets()
    if rebuilt:
        ddp._has_rebuilt_buckets = True


def ddp_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                params: list[torch.Tensor] | None = None) -> dict[str, list[torch.Tensor]]:
    """What a DDP rank holds, by category: the module's parameters, their gradients, the local
    optimizer's states and module buffers. DDP's reducer buckets are not reachable from Python;
    the caller counts the storages born while wrapping the model, and not named here, as buffers."""
    params = list(model.parameters()) if params is None else params
    return {
        "params": params,
        "grads": gradients(params),
        "optimizer_states": optimizer_state_tensors(optimizer) if optimizer is not None else [],
        "buffers": module_buffers(model),
    }


def build_runner(model: torch.nn.Module, training: TrainingSpec, ctx: RunContext) -> TorchRunner:
    return TorchRunner(model, training, ctx)
