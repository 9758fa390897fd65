"""Engine `deepspeed`: `deepspeed.initialize` with the stage, offload and precision of the
training spec, or with the user's own DeepSpeed JSON (`--config`).

What DeepSpeed allocates, tensor by tensor, and where this runner finds it, is written down in
docs/engines/deepspeed.md (read from deepspeed/runtime/zero/stage_1_and_2.py, stage3.py,
partition_parameters.py, runtime/fp16/*.py, runtime/bf16_optimizer.py). The runner names those
tensors by walking the engine's optimizer objects; it never runs a tensor op while doing so,
because the accounting asks for the categories from inside its dispatch hook.

On a machine without CUDA, DeepSpeed runs on its CPU accelerator (`DS_ACCELERATOR=cpu`, gloo).
It JIT-compiles C++ ops at first use: a shared-memory comm op at every `deepspeed.initialize`
(about 35 s cold) and `cpu_adam` for optimizer offload (about 60 s, 2 GB of RAM). The build cache
is kept in `ops_dir()` so each builds once per machine and environment; the launcher builds the
ops a run needs before it starts the workers (zeroplan/measure/deepspeed_build.py).

Choices that change memory, mirrored by the estimator (docs/engines/deepspeed.md):
- Adam/AdamW is DeepSpeed's config optimizer: torch's AdamW (`torch_adam: true`) on CPU, where
  DeepSpeed's FusedAdam would need another JIT build; FusedAdam on CUDA (DeepSpeed's default);
  DeepSpeedCPUAdam with optimizer offload. SGD is a client `torch.optim.SGD`, and with
  `deepspeed.client_optimizer` (a JSON without an optimizer section) so is the torch optimizer, with
  the program's kernel (engines.make_optimizer).
- Gradient accumulation is DeepSpeed's own: `engine.step()` after every micro-batch, which only
  steps the optimizer at the accumulation boundary (runtime/engine.py, `step`).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from zeroplan.importers.deepspeed_json import write_deepspeed_config
from zeroplan.errors import MeasureError, MissingDependencyError
from zeroplan.measure.deepspeed_build import EXTENSIONS_ENV, extensions_dir, ops_dir, torch_env  # noqa: F401 - re-exported
from zeroplan.measure.engines.common import RunContext, make_optimizer, module_buffers, optimizer_class_and_kwargs
from zeroplan.spec.training import Offload, Optimizer, Precision, TrainingSpec

if TYPE_CHECKING:  # imported where used: the launcher checks a --config with `user_config`, without torch
    import torch


def prepare_environment(ctx: RunContext) -> None:
    """Must run before `import deepspeed`: it picks its accelerator when imported."""
    if not ctx.is_cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.update(torch_env())
    ops_dir().mkdir(parents=True, exist_ok=True)


def import_deepspeed():
    try:
        import deepspeed
    except ImportError as error:
        raise MissingDependencyError(
            f"engine deepspeed needs DeepSpeed ({error}); install it with: pip install 'zeroplan[deepspeed]'"
        ) from None
    import logging

    deepspeed.utils.logger.setLevel(logging.WARNING)
    return deepspeed


def deepspeed_config(training: TrainingSpec, ctx: RunContext) -> dict:
    """The DeepSpeed JSON that runs `training` on `ctx.world_size` ranks: the config `zeroplan plan
    --emit deepspeed` writes (config_files.write_deepspeed_config), with what a measurement run
    needs on top: the learning rate of the other engines, torch's AdamW on CPU, a client SGD, and
    no progress logging."""
    if Offload.NVME in (training.offload_optimizer, training.offload_params):
        raise MeasureError(
            "offload: nvme needs an nvme_path and DeepSpeed's async_io op; pass your own DeepSpeed JSON with --config"
        )
    if training.precision == Precision.FP16 and not ctx.is_cuda:
        # accelerator/cpu_accelerator.py: is_fp16_supported() is falsy
        raise MeasureError("precision: fp16 needs a GPU with DeepSpeed (its CPU accelerator has no fp16); use bf16")
    if training.precision == Precision.PURE_BF16:
        raise MeasureError(
            "precision: pure-bf16 has no DeepSpeed equivalent measured here (bf16 master weights need "
            "optimizer offload); use bf16 or fp32, or pass your own DeepSpeed JSON with --config"
        )
    if training.optimizer == Optimizer.SGD and training.offload_optimizer != Offload.NONE:
        raise MeasureError("optimizer: sgd cannot be offloaded by DeepSpeed (ZeRO-Offload runs CPU Adam); use adamw")
    if training.optimizer.is_bitsandbytes and not training.deepspeed.client_optimizer:
        # runtime/config.py DEEPSPEED_OPTIMIZERS has no bitsandbytes optimizer: only a client optimizer can be one
        raise MeasureError(f"optimizer: {training.optimizer.value} cannot be measured as DeepSpeed's own (JSON) "
                           "optimizer; measure it as a client optimizer (a DeepSpeed JSON without an optimizer section)")
    _, kwargs = optimizer_class_and_kwargs(training)  # the other engines' settings
    config: dict[str, Any] = write_deepspeed_config(training)
    config["train_batch_size"] = training.micro_batch * training.grad_accum * ctx.world_size
    config.update(steps_per_print=1 << 30, wall_clock_breakdown=False)
    if training.optimizer == Optimizer.SGD or training.deepspeed.client_optimizer:
        # the runner passes a client torch optimizer (SGD is not in DeepSpeed's config optimizers)
        del config["optimizer"]
        config["zero_allow_untested_optimizer"] = True  # not in ZERO_SUPPORTED_OPTIMIZERS
        return config
    params: dict[str, Any] = {"lr": kwargs["lr"]}
    if training.offload_optimizer == Offload.NONE and not ctx.is_cuda:
        params["torch_adam"] = True  # torch.optim.AdamW: no JIT build of FusedAdam on CPU
    config["optimizer"] = {"type": "AdamW" if training.optimizer == Optimizer.ADAMW else "Adam", "params": params}
    return config


def user_config(config: dict, training: TrainingSpec, world_size: int) -> dict:
    """The user's DeepSpeed JSON, with batch sizes filled in where missing or "auto" (Hugging Face
    style). A ZeRO stage, micro-batch or accumulation count that disagrees with the training spec
    is an error: the estimate beside the measurement would describe another configuration."""
    merged = dict(config)
    defaults = {
        "train_micro_batch_size_per_gpu": training.micro_batch,
        "gradient_accumulation_steps": training.grad_accum,
        "train_batch_size": training.micro_batch * training.grad_accum * world_size,
    }
    for key, value in defaults.items():
        if merged.get(key, "auto") == "auto":
            merged[key] = value
    agree = {
        "zero_optimization.stage": (merged.get("zero_optimization", {}).get("stage", 0), "zero_stage", training.zero_stage),
        # the worker runs training.micro_batch sequences and training.grad_accum backwards per step
        "train_micro_batch_size_per_gpu": (merged["train_micro_batch_size_per_gpu"], "micro_batch", training.micro_batch),
        "gradient_accumulation_steps": (merged["gradient_accumulation_steps"], "grad_accum", training.grad_accum),
    }
    for key, (theirs, field, ours) in agree.items():
        if theirs != ours:
            raise MeasureError(f"config: {key} is {theirs} but the training spec says {field} {ours}")
    return merged


def _config(training: TrainingSpec, ctx: RunContext) -> dict:
    if ctx.engine_config is not None:
        return user_config(ctx.engine_config, training, ctx.world_size)
    return deepspeed_config(training, ctx)


def zero_init_context(training: TrainingSpec, ctx: RunContext):
    """`deepspeed.zero.Init` with the run's config (model_init zero-init): each module's parameters
    are partitioned, in the config's dtype and onto offload_param's device, as it is built
    (partition_parameters.py `_post_init_method`). What the Trainer does under ZeRO-3
    (modeling_utils.py `_from_config`); DeepSpeed's comm must wrap the process group first."""
    if ctx.is_fake:
        raise MeasureError("engine deepspeed cannot run under --simulate (it needs real tensors); use --engine fsdp2")
    prepare_environment(ctx)
    deepspeed = import_deepspeed()
    deepspeed.init_distributed(dist_backend="nccl" if ctx.is_cuda else "gloo")
    # zero.Init patches torch.nn.Parameter.__new__; torch._dynamo, if first imported inside it (by
    # transformers), checks that signature and fails ("Signature mismatch ... tensor_pynew")
    import torch._dynamo  # noqa: F401

    return deepspeed.zero.Init(config_dict_or_path=_config(training, ctx))


class DeepSpeedRunner:
    def __init__(self, model: torch.nn.Module, training: TrainingSpec, ctx: RunContext):
        if ctx.is_fake:
            raise MeasureError("engine deepspeed cannot run under --simulate (it needs real tensors); use --engine fsdp2")
        prepare_environment(ctx)
        deepspeed = import_deepspeed()
        config = _config(training, ctx)
        trainable = [p for p in model.parameters() if p.requires_grad]
        client_optimizer = None
        if "optimizer" not in config:
            # A client torch optimizer, as DeepSpeed runs a JSON without an optimizer section (what the
            # Hugging Face Trainer passes: its own torch AdamW); also SGD, which DeepSpeed's config lacks.
            client_optimizer = make_optimizer(trainable, training)
        self.model = model
        self.config = config
        self.grad_accum = int(config["gradient_accumulation_steps"])
        self._micro = 0
        # torch.distributed is already initialised by the worker: DeepSpeed wraps that group
        # (deepspeed/comm/comm.py, init_distributed: "The user initialized torch.dist themselves").
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, model_parameters=trainable, optimizer=client_optimizer, config=config,
        )

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.engine(input_ids, labels)

    def backward(self, loss: torch.Tensor) -> None:
        # DeepSpeed divides the loss by gradient_accumulation_steps itself (engine.backward,
        # scale_wrt_gas) and reduces only where its stage says so.
        self.engine.backward(loss)
        self._micro += 1
        if self._micro < self.grad_accum:
            self.engine.step()  # not a boundary: only advances DeepSpeed's micro-step counter

    def step(self) -> None:
        self.engine.step()  # the boundary: optimizer step, then zero_grad (engine._take_model_step)
        self._micro = 0

    def tensors_by_category(self) -> dict[str, list[torch.Tensor]]:
        return deepspeed_tensors(self.engine, self.model)


# -- finding DeepSpeed's tensors (no tensor ops in here: see the module docstring) ------------

# Attribute names of DeepSpeed optimizer wrappers, by category (docs/engines/deepspeed.md).
_PARAMS = (
    "bit16_groups_flat",  # stage 1-2 flat module parameters (stage_1_and_2.py)
    "lp_param_buffer",  # stage 3 defragmented parameter partitions (stage3.py)
    "fp16_partitioned_groups_flat",  # stage 3 views into lp_param_buffer / the offload buffer
    "param_groups_fp16_flat_cpu_memory",  # stage 3 offload_param partitions
    "fp16_groups_flat",  # stage 0 FP16_Optimizer
    "bf16_groups_flat",  # BF16_Optimizer
)
_GRADS = (
    "grads_in_partition",  # stage 1-2 owned reduced gradients
    "averaged_gradients",  # stage 1-2 and 3: views and compact fp32 partitions
    "all_grad_tensors",
    "grad_partitions_flat_buffer",  # stage 3 gradient partitions
    "accumulated_grads_in_cpu",  # stage 1-2 offload with gradient accumulation
    "fp32_groups_gradients_flat",  # BF16_Optimizer
)
_MASTER = (
    "single_partition_of_fp32_groups",  # stage 1-2 fp32 master partition
    "fp32_partitioned_groups_flat",  # stage 3 fp32 master partition
    "fp32_groups_flat",  # stage 0 FP16_Optimizer
    "fp32_groups",  # stage 0 FP16_UnfusedOptimizer
    "fp32_groups_flat_partition",  # BF16_Optimizer
)
_BUFFERS = (
    "temp_grad_buffer_for_cpu_offload",
    "temp_grad_buffer_for_gpu_offload",
    "param_buffer_of_bit16_for_cpu_offload_groups",
)


def _tensors_in(value: Any, depth: int = 0) -> list[torch.Tensor]:
    """Tensors held in `value`: a tensor, or lists/tuples/dicts of them (dict values)."""
    import torch

    if isinstance(value, torch.Tensor):
        return [value] if value.device.type != "meta" else []
    if depth > 3:
        return []
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors_in(v, depth + 1)]
    if isinstance(value, (list, tuple)):  # GradPartitionBufferGroup is a list with .flat_partition
        found = [t for v in value for t in _tensors_in(v, depth + 1)]
        flat = getattr(value, "flat_partition", None)
        return found + ([flat] if isinstance(flat, torch.Tensor) else [])
    return []


def _attrs(obj: Any, names: tuple[str, ...]) -> list[torch.Tensor]:
    found = []
    for name in names:
        found.extend(_tensors_in(getattr(obj, name, None)))
    return found


def _private(obj: Any, name: str) -> Any:
    """A name-mangled attribute (`self.__x` inside class C is `_C__x`), whichever class set it."""
    for cls in type(obj).__mro__:
        value = getattr(obj, f"_{cls.__name__}{name}", None)
        if value is not None:
            return value
    return None


def _optimizer_states(optimizer: Any) -> list[torch.Tensor]:
    """Tensors in the state of the innermost torch optimizer (Adam moments, step counters)."""
    found = []
    seen = set()
    while optimizer is not None and id(optimizer) not in seen:
        seen.add(id(optimizer))
        state = getattr(optimizer, "state", None)
        if isinstance(state, dict):  # a torch optimizer's defaultdict; wrappers expose a property
            for entry in state.values():
                if isinstance(entry, dict):
                    found.extend(_tensors_in(entry))
        optimizer = getattr(optimizer, "optimizer", None)
    return found


def _buckets(optimizer: Any) -> list[torch.Tensor]:
    """Reduce buckets: `ipg_buckets[dtype].buffer` (a list in stages 1-2, a tensor in stage 3)."""
    found = []
    for bucket in (getattr(optimizer, "ipg_buckets", None) or {}).values():
        found.extend(_tensors_in(getattr(bucket, "buffer", None)))
    return found


def _swap_buffers(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """NVMe parameter swapper buffers (swap_tensor/partitioned_param_swapper.py), held once per run."""
    for param in params:
        swapper = getattr(param, "nvme_swapper", None)
        if swapper is not None:
            return _tensors_in(getattr(swapper, "buffers", None))
    return []


def deepspeed_tensors(engine: Any, model: torch.nn.Module) -> dict[str, list[torch.Tensor]]:
    """The tensors a DeepSpeed engine holds now, by category (docs/engines/deepspeed.md)."""
    import torch

    optimizer = engine.optimizer
    params = list(model.parameters())
    zero3 = any(hasattr(p, "ds_tensor") for p in params)
    module_params, gathered = [], []
    for p in params:
        if not zero3 or getattr(p, "ds_persist", False):
            module_params.append(p)  # stages 0-2: the parameter; stage 3: persistent, kept whole
        else:
            gathered.append(p)  # stage 3: empty, or a view into an all-gather buffer
        if zero3 and p.ds_tensor is not None:
            module_params.append(p.ds_tensor)
    grads = [p.grad for p in params if p.grad is not None]
    grads += [g for g in (getattr(p, "grad_accum", None) for p in params) if isinstance(g, torch.Tensor)]
    masters = _attrs(optimizer, _MASTER)
    grads += [m.grad for m in masters if m.grad is not None]  # fp32 gradient partitions (offload, step)
    grads += _attrs(optimizer, _GRADS)
    grads += _tensors_in(_private(optimizer, "__param_id_to_grad_partition"))  # stage 3 views
    buckets = _buckets(optimizer)
    # A gradient copied into the reduce bucket becomes a view of it (stage_1_and_2.py,
    # reduce_independent_p_g_buckets_and_remove_grads; stage3.py, __add_grad_to_ipg_bucket):
    # the bucket is a buffer, whatever views it. storage.data_ptr() is not a tensor op.
    in_bucket = {b.untyped_storage().data_ptr() for b in buckets}
    grads = [g for g in grads if g.untyped_storage().data_ptr() not in in_bucket]
    return {
        "params": module_params + _attrs(optimizer, _PARAMS),
        "grads": grads,
        "optimizer_states": masters + _optimizer_states(optimizer),
        "buffers": gathered + buckets + _attrs(optimizer, _BUFFERS) + _swap_buffers(params) + module_buffers(model),
    }


def build_runner(model: torch.nn.Module, training: TrainingSpec, ctx: RunContext) -> DeepSpeedRunner:
    return DeepSpeedRunner(model, training, ctx)
