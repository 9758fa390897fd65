"""What every measure runner shares (the dispatch in measure/engines/__init__.py picks the runner): the
run context, the runner protocol, the categories a runner reports, and the torch optimizer helpers.

The engine interface of the measure mode: one `EngineRunner` per engine name.

An engine module (`torch_engine`, `fsdp2_engine`, `deepspeed_engine`) exposes one function,

    build_runner(model, training: TrainingSpec, ctx: RunContext) -> EngineRunner

which wraps `model` (already built on `ctx.device`, under the accounting, so engine buffers are
counted) and creates the optimizer. The worker drives every runner the same way:

    runner = build_runner(model, training, ctx)            # phase "engine"
    for step in range(steps):
        for micro in range(training.grad_accum):
            loss = runner.forward(input_ids, labels)       # phase "forward"
            runner.backward(loss)                          # phase "backward"
        runner.step()                                      # phase "optimizer_step"

Contract:
- `model` is built on `model_device(training, ctx)`, inside `model_context(training, ctx)`, as
  the program's `model_init` says: on the meta device (the runner materialises what it keeps
  with `to_empty` and calls `model.init_materialized()`), on the host (the runner, or the
  engine, moves it), on the rank's device, or inside `deepspeed.zero.Init`.
- `model` is a `torch.nn.Module` whose `forward(input_ids, labels)` returns the mean causal-LM
  loss of the micro-batch (a 0-d tensor); `transformer_blocks(model)` lists its blocks, in order,
  for engines that wrap or shard per block (FSDP2 `fully_shard`, DeepSpeed ZeRO-3 needs none).
- `backward` is called `training.grad_accum` times between two `step()` calls with the raw
  micro-batch loss; the runner counts micro-batches itself, scales the loss by 1/grad_accum where
  its engine does not, and with `grad_sync` last skips gradient synchronisation on all but the
  last micro-batch (DDP `no_sync`, FSDP2 `set_requires_gradient_sync`; DeepSpeed has no such mode).
- `step` runs the optimizer and drops the gradients (`zero_grad(set_to_none=True)` or the
  engine's equivalent), so that gradient memory is what the engine keeps between steps.
- `tensors_by_category` returns the tensors the engine holds right now, by category name
  (`TENSOR_CATEGORIES` minus activations and temporaries: "params", "grads", "optimizer_states",
  "buffers"). The accounting matches them to live storages by storage identity (a view or a
  DTensor counts its storage once), so listing a tensor twice, or a view of a listed tensor, is
  harmless; a storage listed under two categories counts under the first in `TENSOR_CATEGORIES` order.
  "buffers" means the engine's own buffers (DDP buckets, DeepSpeed reduce/all-gather buckets,
  FSDP2 unsharded parameters and their all-gather/reduce-scatter buffers) and module buffers.
  Everything else that is live counts as activations during forward/backward and as temporaries
  in the optimizer step and at set-up.
- `model` may be a fake-tensor model (`ctx.backend == "fake"`); a runner that cannot run there
  raises `MeasureError` saying so.
"""


from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol

from zeroplan.errors import MeasureError
from zeroplan.estimate.result import TENSOR_CATEGORIES
from zeroplan.spec.training import TrainingSpec

if TYPE_CHECKING:  # torch is imported lazily: zeroplan.measure must import without it
    import torch

ENGINE_CATEGORIES = tuple(name for name in TENSOR_CATEGORIES if name not in ("activations", "temporaries"))
"""The categories a runner reports; the others are what is left live."""


@dataclass(frozen=True)
class RunContext:
    """Where one rank runs. Built by the worker once the process group exists."""

    rank: int
    world_size: int
    local_rank: int
    device: Any  # torch.device: cpu for gloo and fake, cuda:<local_rank> for nccl
    backend: str  # "gloo", "nccl" or "fake" (one process simulating world_size ranks)
    engine_config: dict | None = None  # the user's own engine config (DeepSpeed JSON, --config), if any

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def is_fake(self) -> bool:
        return self.backend == "fake"


class EngineRunner(Protocol):
    def forward(self, input_ids: "torch.Tensor", labels: "torch.Tensor") -> "torch.Tensor":
        """Run one micro-batch forward; return its loss."""
        ...

    def backward(self, loss: "torch.Tensor") -> None:
        """Back-propagate one micro-batch's loss (see the contract above for accumulation)."""
        ...

    def step(self) -> None:
        """Optimizer step, then drop the gradients (set_to_none)."""
        ...

    def tensors_by_category(self) -> dict[str, list["torch.Tensor"]]:
        """The tensors the engine holds now: keys among ENGINE_CATEGORIES."""
        ...


class TorchOptimizerSteps:
    """backward and step for runners that drive a torch optimizer themselves (DDP, FSDP2): the
    loss is scaled for gradient accumulation, and gradients are freed after each step
    (zero_grad(set_to_none=True)), as the estimator assumes. Needs `grad_accum`, `optimizer`."""

    grad_accum: int
    optimizer: "torch.optim.Optimizer"
    _micro: int = 0
    sync_every: bool = False  # grad_sync every: reduce at every micro-batch, not only the last

    def _syncs(self) -> bool:
        """Whether the micro-batch starting now reduces its gradients (counts it)."""
        self._micro += 1
        return self.sync_every or self._micro == self.grad_accum

    def backward(self, loss: "torch.Tensor") -> None:
        (loss / self.grad_accum).backward()

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._micro = 0


def transformer_blocks(model: "torch.nn.Module") -> list["torch.nn.Module"]:
    """The transformer blocks of a workload model, in order (see `zeroplan.measure.workload`)."""
    return list(model.transformer_blocks)


def module_buffers(model: "torch.nn.Module") -> list["torch.Tensor"]:
    """Registered module buffers (rotary frequencies, masks): counted as buffers by every runner."""
    return [b for b in model.buffers() if b is not None]


def gradients(params: list["torch.Tensor"]) -> list["torch.Tensor"]:
    """The `.grad` tensors that exist now."""
    return [p.grad for p in params if p.grad is not None]


def optimizer_state_tensors(optimizer: "torch.optim.Optimizer") -> list["torch.Tensor"]:
    """Every tensor in a torch optimizer's state (moments, momentum buffers, step counters)."""
    import torch

    tensors = []
    for state in optimizer.state.values():
        tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return tensors


def make_optimizer(params: list["torch.Tensor"], training: TrainingSpec) -> "torch.optim.Optimizer":
    """The optimizer of `training` over `params` (torch defaults for what does not change memory)."""
    cls, kwargs = optimizer_class_and_kwargs(training)
    return cls(params, **kwargs)


# The kernel of a torch optimizer, passed explicitly (torch/optim/optimizer.py `_default_to_fused_or_foreach`
# would pick the for-loop for CPU tensors and foreach for CUDA ones when both are left None).
_KERNEL_KWARGS = {"fused": {"fused": True, "foreach": False}, "foreach": {"fused": False, "foreach": True},
                  "for-loop": {"fused": False, "foreach": False}}


def optimizer_class_and_kwargs(training: TrainingSpec) -> tuple[type, dict]:
    """The class and keyword arguments of `make_optimizer`, for wrappers that build it themselves
    (ZeroRedundancyOptimizer): the kernel is the training program's `optimizer_impl`."""
    import torch

    name = training.optimizer.value
    table = {
        "adamw": (torch.optim.AdamW, {"lr": 1e-4}),
        "adam": (torch.optim.Adam, {"lr": 1e-4}),
        "sgd": (torch.optim.SGD, {"lr": 1e-3, "momentum": 0.9}),
    }
    if training.optimizer.is_bitsandbytes:
        # what the Trainer builds for adamw_bnb_8bit / paged_adamw_* (transformers trainer_optimizer.py
        # `_get_bitsandbytes_optimizer`), torchtune's bitsandbytes.optim.PagedAdamW8bit alike
        try:
            from bitsandbytes.optim import AdamW
        except ImportError:
            raise MeasureError(f"optimizer: {name} needs bitsandbytes: pip install 'zeroplan[lora]'") from None
        count_bitsandbytes_updates()
        return AdamW, {"lr": 1e-4, "optim_bits": 8 if name == "adam8bit" else 32, "is_paged": training.paged_optimizer}
    cls, kwargs = table[name]
    return cls, {**kwargs, **_KERNEL_KWARGS[training.program.optimizer_impl.value]}


# Ops whose kernel is Python code that allocates inside the one op (bitsandbytes' CPU optimizer updates,
# backends/cpu/ops.py: fp32 copies of the states and the update): a dispatch mode is popped while an op runs,
# so it would see none of them; measure/accounting.py runs these kernels with the mode entered again.
VISIBLE_KERNELS: dict[str, Callable] = {}


def count_bitsandbytes_updates() -> None:
    """Let the accounting see what bitsandbytes' CPU updates allocate inside their ops (measure/accounting.py
    VISIBLE_KERNELS): the kernels bitsandbytes 0.50.2 registers for "cpu" (backends/cpu/ops.py
    `register_kernel("bitsandbytes::optimizer_update_8bit_blockwise", "cpu")`, `..._32bit`)."""
    from bitsandbytes.backends.cpu import ops

    for op, kernel in (("optimizer_update_8bit_blockwise", "_optimizer_update_8bit_blockwise_cpu"),
                       ("optimizer_update_32bit", "_optimizer_update_32bit_cpu")):
        if hasattr(ops, kernel):  # a later bitsandbytes may move them: its updates then count as one op
            VISIBLE_KERNELS[f"bitsandbytes::{op}"] = getattr(ops, kernel)


class OptimizerInBackward:
    """One optimizer per parameter, stepped in the parameter's post-accumulate-grad hook, which
    then frees the gradient (torchtune training/memory.py `register_optim_in_bwd_hooks`,
    `optim_step`: `optim_dict[param].step(); optim_dict[param].zero_grad()`)."""

    def __init__(self, params: list["torch.Tensor"], training: TrainingSpec):
        self.optimizers = {param: make_optimizer([param], training) for param in params}
        for param in params:
            param.register_post_accumulate_grad_hook(self._step)

    def _step(self, param: "torch.Tensor") -> None:
        self.optimizers[param].step()
        self.optimizers[param].zero_grad(set_to_none=True)

    def states(self) -> list["torch.Tensor"]:
        return [t for optimizer in self.optimizers.values() for t in optimizer_state_tensors(optimizer)]


def materialize(model: "torch.nn.Module", device) -> None:
    """Allocate a meta-device model's parameters on `device` and fill them (`to_empty`), keeping
    shared parameters (a tied head) shared: `Module._apply` gives each module a new Parameter."""
    if not any(p.is_meta for p in model.parameters()):
        return
    places: dict[int, list[tuple["torch.nn.Module", str]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                places.setdefault(id(param), []).append((module, name))
    model.to_empty(device=device)
    for (first, first_name), *others in places.values():
        for module, name in others:
            module._parameters[name] = first._parameters[first_name]
    model.init_materialized()
